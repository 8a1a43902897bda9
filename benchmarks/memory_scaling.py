"""Peak GPU memory and step time vs context: OOMB (dense, with and without offload) next to Hugging Face.

One forward+backward step of a Qwen2.5-7B-shaped model (random init from ``Qwen2Config``, bf16, no optimizer
state) per method and context length, all in the same run:

- ``hf``: transformers + SDPA + per-layer checkpointing (the usual recipe), until it runs out of memory;
- ``oomb``: the OOMB engine (Triton attention, per-layer checkpointing inside each chunk);
- ``oomb-offload``: the same with KV / gradient pages in pinned host memory.

Writes rows ``{"method", "context", "peak_gib", "step_s", "oom"}`` to ``--out`` (JSON), a PNG next to it, and prints
a table (with the OOMB/HF time ratio and the offload GPU-memory slope) last.

    PYTHONPATH=$PWD python3 benchmarks/memory_scaling.py --out benchmarks/results/memory-scaling-h200.json
    python benchmarks/memory_scaling.py --tiny --device cpu   # smoke run of the script itself
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from benchmarks.common import (
    GIB,
    HF,
    build_qwen2,
    engine_stats,
    free_device_memory,
    make_step,
    measure,
    reserve_pool,
    write_json,
)
from lightning_oomb.engine import OOMBConfig
from lightning_oomb.models import qwen2_5_7b_config

TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            vocab_size=256)  # fmt: skip


def build_model(tiny: bool, device: torch.device):
    return build_qwen2(device, torch.bfloat16, TINY if tiny else qwen2_5_7b_config())


def run_method(method: str, model, context: int, args, device, warmup: bool = True) -> dict:
    ids = torch.randint(0, model.config.vocab_size, (1, context), device=device)
    config = None
    if method != HF:
        offload = method == "oomb-offload"
        config = OOMBConfig(args.chunk_size, layer_checkpointing=True, offload=offload,
                            hbm_budget=0 if offload else "auto")  # fmt: skip
    step, engine = make_step(model, HF if method == HF else "oomb", config)
    row = {"method": method, "context": context, "peak_gib": None, "step_s": None, "oom": False}
    try:
        if engine is not None:
            reserve_pool(engine, model, context, device)
        timing = measure(lambda: step(ids), device, args.repeats, warmup=int(warmup))
        row["step_s"] = timing["step_s"]
        row["peak_gib"] = float("nan") if timing["peak_gib"] is None else timing["peak_gib"]  # nan off CUDA
        if engine is not None:  # where the pages were and what moved in the last step
            row.update(engine_stats(engine))
    except torch.OutOfMemoryError:
        row["oom"] = True
    finally:
        if engine is not None:
            engine.release()
        free_device_memory(device)
    print(json.dumps(row), flush=True)
    return row


def slope_mb_per_10k(rows: list[dict], method: str) -> float | None:
    points = [(r["context"], r["peak_gib"]) for r in rows if r["method"] == method and not r["oom"]]
    if len(points) < 2:
        return None
    (x0, y0), (x1, y1) = points[0], points[-1]
    return (y1 - y0) * GIB / 1e6 / ((x1 - x0) / 1e4)


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (mem, sec) = plt.subplots(1, 2, figsize=(11, 4))
    for method in dict.fromkeys(r["method"] for r in rows):
        ok = [r for r in rows if r["method"] == method and not r["oom"]]
        xs = [r["context"] / 1024 for r in ok]
        mem.plot(xs, [r["peak_gib"] for r in ok], "o-", label=method)
        sec.plot(xs, [r["step_s"] for r in ok], "o-", label=method)
    for ax, label in ((mem, "peak GPU memory (GiB)"), (sec, "step time (s)")):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("context (K tokens)")
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
        ax.legend()
    fig.suptitle("Qwen2.5-7B shape, bf16, forward+backward, one GPU")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def table(rows: list[dict]) -> str:
    """Rows with step time relative to HF and (offload rows) to OOMB without offload at the same context."""
    done = {(r["method"], r["context"]): r["step_s"] for r in rows if not r["oom"]}

    def ratio(r: dict, base: str) -> str:
        key = (base, r["context"])
        return f"{r['step_s'] / done[key]:.2f}x" if key in done and not r["oom"] else ""

    lines = [f"{'method':<14}{'context':>9}{'peak GiB':>10}{'step s':>9}{'vs hf':>8}{'vs oomb':>9}"]
    for r in rows:
        peak, step = ("OOM", "") if r["oom"] else (f"{r['peak_gib']:.1f}", f"{r['step_s']:.2f}")
        offload_ratio = ratio(r, "oomb") if r["method"] == "oomb-offload" else ""
        lines.append(
            f"{r['method']:<14}{r['context']:>9}{peak:>10}{step:>9}{ratio(r, 'hf'):>8}{offload_ratio:>9}"
        )
    slope = slope_mb_per_10k(rows, "oomb-offload")
    if slope is not None:
        lines.append(f"oomb-offload GPU memory slope: {slope:.1f} MB per 10K tokens")
    return "\n".join(lines)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--methods", default="hf,oomb,oomb-offload")
    parser.add_argument("--contexts", default="8192,16384,32768,65536,131072")
    parser.add_argument("--offload-contexts", default="32768,65536,131072,262144")
    parser.add_argument("--hf-max", type=int, default=65536, help="skip HF above this context (it runs out)")
    parser.add_argument("--chunk-size", type=int, default=4096)
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument(
        "--warmup-once",
        action="store_true",
        help="warm up only at each method's first context (long contexts take minutes per step)",
    )
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--tiny", action="store_true", help="a 2-layer model (smoke test of the script)")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/memory-scaling-h200.json"))
    return parser.parse_args(argv)


def main() -> None:
    args = parse_args()

    device = torch.device(args.device)
    model = build_model(args.tiny, device)
    rows = []
    for method in args.methods.split(","):
        contexts = args.offload_contexts if method == "oomb-offload" else args.contexts
        for i, context in enumerate(map(int, contexts.split(","))):
            if method == "hf" and context > args.hf_max:
                continue
            # kernels compile and autotune once per method (keyed on head dim and page size, not length)
            warmup = i == 0 or not args.warmup_once
            rows.append(run_method(method, model, context, args, device, warmup))
            write_json(args.out, rows)  # a run cut short keeps what it measured
    plot(rows, args.out.with_suffix(".png"))
    print(table(rows))


if __name__ == "__main__":
    main()
