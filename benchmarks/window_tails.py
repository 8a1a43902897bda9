"""What the window layers' tails in host memory cost and save: one training step of a Gemma-3-shaped model with its
tails on the GPU and in host memory (``host_tails``), in the same run.

A layer-reduced Gemma-3-27B shape (hidden 5376, 32 query heads, 16 KV heads of 128, window 1,024; ``--layers``
layers, five window layers per full one; bf16; random weights) takes forward + backward of one ``--tokens`` sequence
in chunks of ``--chunk`` under ``offload=True`` with a budget that holds every page, so only the option differs:

- ``device``: ``host_tails=False`` — each window layer keeps every tail group on the GPU (a quarter of its pages at
  window 1,024 and chunks of 4,096);
- ``host``: ``host_tails=True`` — a ring of two tail groups on the GPU, every group's K/V in pinned host memory,
  out once written, back one chunk before the backward reads it.

Reported per method: the step time (median of ``--repeats`` after one warm-up), the peak GPU memory, the pool's
device and host bytes, the bytes copied each way and the seconds the compute stream waited for them. The overhead of
``host`` over ``device`` is the goal's measure (predicted: the copies, ~2 x the tails' K/V per step, overlap the
compute). Writes JSON (``--out``), a PNG and a Markdown table next to it.

    PYTHONPATH=$PWD python3 benchmarks/window_tails.py --out benchmarks/results/window-tails-h200.json
    PYTHONPATH=$PWD python benchmarks/window_tails.py --tiny --device cpu --out /tmp/window-tails.json  # smoke
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

from benchmarks.common import (
    GIB,
    Report,
    build_causal_lm,
    engine_stats,
    finish,
    step_args,
    timed_engine,
)
from lightning_oomb.engine import OOMBConfig

ROOT = Path(__file__).resolve().parents[1]
GEMMA3_27B = dict(hidden_size=5376, intermediate_size=21504, num_attention_heads=32, num_key_value_heads=16,
                  head_dim=128, sliding_window=1024, vocab_size=262208)  # fmt: skip
TINY = dict(hidden_size=32, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
            sliding_window=12, vocab_size=97)  # fmt: skip
METHODS = {"device": False, "host": True}


def build(fields: dict, layers: int, device: torch.device, dtype: torch.dtype) -> torch.nn.Module:
    """A random Gemma 3 text model of ``layers`` layers (five window layers per full one) on ``device``."""
    import transformers as tf

    return build_causal_lm(tf.Gemma3TextConfig(num_hidden_layers=layers, **fields), device, dtype)


def run(args) -> Report:
    device = torch.device(args.device)
    fields = TINY if args.tiny else GEMMA3_27B
    dtype = torch.float32 if args.tiny else torch.bfloat16
    report = Report(args.out, model=fields, layers=args.layers, tokens=args.tokens, chunk=args.chunk,
                    page=args.page, repeats=args.repeats, device=str(device))  # fmt: skip
    model = build(fields, args.layers, device, dtype)
    ids = torch.randint(0, fields["vocab_size"], (1, args.tokens), generator=torch.Generator().manual_seed(0))
    ids = ids.to(device)
    for method, hosted in METHODS.items():
        config = OOMBConfig(args.chunk, args.page, layer_checkpointing=True, offload=True, hbm_budget=1 << 50,
                            host_tails=hosted, kv_grad_dtype="bfloat16" if dtype == torch.bfloat16 else "float32")  # fmt: skip
        with timed_engine(model, ids, config, device, args.repeats) as (engine, timing, loss):
            shape = engine.pool.shape
            report.add({"method": method, **timing, **engine_stats(engine),
                        "hosted_tail_layers": len(shape.hosted_tails), "tail_host_gib": shape.tail_host_bytes / GIB,
                        "loss": loss})  # fmt: skip
    return report


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(9, 3.5))
    names = [r["method"] for r in rows]
    axes[0].bar(names, [r["step_s"] for r in rows])
    axes[0].set_ylabel("seconds per step")
    axes[1].bar(names, [r["pool_device_gib"] for r in rows], label="pool on the device")
    axes[1].bar(names, [r["pool_host_gib"] for r in rows], bottom=[r["pool_device_gib"] for r in rows],
                label="pool in host memory")  # fmt: skip
    axes[1].set_ylabel("GiB")
    axes[1].legend(fontsize=8)
    fig.suptitle("window layers' tails on the device vs in host memory")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def table(data: dict) -> str:
    rows = {r["method"]: r for r in data["rows"]}
    lines = [
        f"`{data['command']}`",
        "",
        f"{data['layers']} layers of the {'Gemma-3-27B' if data['model'] == GEMMA3_27B else 'a tiny Gemma 3'} shape "
        f"(5 window layers per full one), one sequence of "
        f"{data['tokens']:,} tokens in chunks of {data['chunk']:,}, layer checkpointing, offload with every page in "
        f"budget; {data['device']}; median of {data['repeats']} steps after one warm-up.",
        "",
        "| tails | step (s) | vs device | peak GPU (GiB) | pool GPU (GiB) | pool host (GiB) | copied in / out (GiB) "
        "| copy wait (s) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    base = rows.get("device")
    for method, r in rows.items():
        ratio = f"{r['step_s'] / base['step_s']:.3f}x" if base else "-"
        peak = "-" if r["peak_gib"] is None else f"{r['peak_gib']:.2f}"
        lines.append(
            f"| {method} | {r['step_s']:.3f} | {ratio} | {peak} | {r['pool_device_gib']:.3f} | "
            f"{r['pool_host_gib']:.3f} | {r['h2d_gib']:.3f} / {r['d2h_gib']:.3f} | {r['copy_wait_s']:.4f} |"
        )
    return "\n".join(lines) + "\n"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    return step_args(__doc__, argv, 6, 65536, ROOT / "benchmarks" / "results" / "window-tails-h200.json", 256)


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    return finish(run(args), args.out, plot, table)


if __name__ == "__main__":
    main()
