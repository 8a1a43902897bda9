"""Memory and time of one training step of a hybrid (Qwen3.5-style: 3 gated delta-net layers per attention layer)
or of a Mamba-1 model on the CPU: OOMB next to Hugging Face, in the same run, by sequence length.

A randomly initialised small model (``--family``: a Qwen3.5 text model, or a Mamba; float32, transformers' own
float32 rules) takes forward + backward of one sequence per case:

- ``hf``: the model's own full-sequence step (SDPA attention), with per-layer checkpointing (the usual long-context
  baseline) and without;
- ``oomb``: the engine at ``--chunk`` tokens per chunk with layer checkpointing; the states of the delta-net layers
  are carried across chunks (``lightning_oomb.engine.states``).

Reported per case: the peak of the CPU storages the step creates (weights and their gradients not counted; live
bytes sampled at every op, ``tests/helpers/memory.py``), for OOMB also the carried states and the KV pool it keeps,
and the step time (median of ``--repeats`` runs outside the memory probe). The activations of HF grow with the
sequence; OOMB's step holds one chunk's activations plus pages (attention layers only) and the carried states
(``O(state)`` per chunk boundary).

Writes JSON (``--out``), a PNG and a Markdown table next to it; about 3 minutes on 2 cores.

    PYTHONPATH=$PWD python benchmarks/hybrid_memory.py --out benchmarks/results/hybrid-memory-cpu.json
    PYTHONPATH=$PWD python benchmarks/hybrid_memory.py --family mamba

transformers' torch Mamba-1 scan back-propagates through per-token slices of its whole-call tensors, in time that
grows faster than the square of the call's tokens; in chunks it grows with the tokens (about 2 minutes).
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from benchmarks.common import Report
from lightning_oomb.engine import OOMBConfig, OOMBEngine
from lightning_oomb.integrations.hf import HFChunkModel, set_layer_checkpointing
from tests.helpers.memory import LiveBytes

ROOT = Path(__file__).resolve().parents[1]
MIB = 2**20
MODELS = {  # family -> (config fields, description, default contexts, default chunk)
    "qwen3_5": (dict(model_type="qwen3_5_text", hidden_size=256, intermediate_size=512, num_hidden_layers=8,
                     num_attention_heads=4, num_key_value_heads=2, head_dim=64, vocab_size=2048,
                     linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=64,
                     linear_value_head_dim=64, linear_conv_kernel_dim=4),
                "Qwen3.5-style hybrid (hidden 256, 6 gated delta-net + 2 attention layers, float32)",
                [2048, 4096, 8192, 16384], 1024),
    "mamba": (dict(model_type="mamba", hidden_size=256, num_hidden_layers=4, state_size=16, vocab_size=2048),
              "Mamba (Mamba-1: hidden 256, 4 layers, state 16, float32)", [256, 512, 768], 128),
}  # fmt: skip


def build(family: str):
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(**MODELS[family][0])).float().train()
    model.config._attn_implementation = "sdpa"
    return model


def hf_step(model, checkpointing: bool):
    def step(ids):
        set_layer_checkpointing(model, checkpointing)
        try:
            logits = model(input_ids=ids, use_cache=False).logits[:, :-1]
            F.cross_entropy(logits.reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1)).backward()
        finally:
            set_layer_checkpointing(model, False)

    return step


def oomb_step(model, chunk: int):
    engine = OOMBEngine(HFChunkModel(model, layer_checkpointing=True), OOMBConfig(chunk, min(chunk, 128)))

    def step(ids):
        engine.loss(ids).backward()

    return step, engine


def measure(step, model, ids, repeats: int) -> tuple[int, float]:
    """(peak live bytes the step adds, median seconds)."""
    held = [p for p in model.parameters()] + [b for b in model.buffers()]
    model.zero_grad(set_to_none=False)  # gradients exist: a later step's memory, not the first one's
    step(ids)
    held += [p.grad for p in model.parameters() if p.grad is not None]
    with LiveBytes(exclude=held) as probe:
        step(ids)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        step(ids)
        times.append(time.perf_counter() - start)
    return probe.peak, statistics.median(times)


def run(args) -> Report:
    fields = MODELS[args.family][0]
    report = Report(args.out, family=args.family, model=fields, chunk=args.chunk, threads=torch.get_num_threads(),
                    repeats=args.repeats)  # fmt: skip
    model = build(args.family)
    for n in args.contexts:
        ids = torch.randint(0, fields["vocab_size"], (1, n), generator=torch.Generator().manual_seed(n))
        for checkpointing in (False, True):
            peak, seconds = measure(hf_step(model, checkpointing), model, ids, args.repeats)
            report.add({"method": "hf", "checkpointing": checkpointing, "tokens": n, "peak_bytes": peak,
                        "step_s": seconds})  # fmt: skip
        step, engine = oomb_step(model, args.chunk)
        peak, seconds = measure(step, model, ids, args.repeats)
        report.add({"method": "oomb", "checkpointing": True, "tokens": n, "peak_bytes": peak, "step_s": seconds,
                    "carried_state_bytes": engine.stats.extra["carried_state_bytes"],
                    "pool_bytes": engine.stats.pool_bytes})  # fmt: skip
    return report


def plot(rows: list[dict], path: Path, family: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for method, ckpt in (("hf", False), ("hf", True), ("oomb", True)):
        rs = [r for r in rows if r["method"] == method and r["checkpointing"] == ckpt]
        label = f"{method}{' + checkpointing' if ckpt else ''}"
        axes[0].plot([r["tokens"] for r in rs], [r["peak_bytes"] / MIB for r in rs], "o-", label=label)
        axes[1].plot([r["tokens"] for r in rs], [r["step_s"] for r in rs], "o-", label=label)
    for ax, label in zip(axes, ("peak MiB the step adds", "seconds per step"), strict=True):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("tokens")
        ax.set_ylabel(label)
        ax.legend(fontsize=8)
    fig.suptitle(f"{MODELS[family][1]}, one step on CPU")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def table(data: dict) -> str:
    lines = [
        f"`{data['command']}`",
        "",
        f"{MODELS[data.get('family', 'qwen3_5')][1]}, one sequence; OOMB in chunks of {data['chunk']} with layer checkpointing; {data['threads']} CPU thread(s), "
        f"times the median of {data['repeats']}. Peak: live CPU bytes the step adds (weights and gradients not "
        "counted); OOMB's includes its KV pool and the carried states.",
        "",
        "| tokens | HF peak (MiB) | HF + ckpt peak (MiB) | OOMB peak (MiB) | of it: carried states / pool (MiB) | "
        "HF + ckpt step (s) | OOMB step (s) |",
        "|---|---|---|---|---|---|---|",
    ]
    by = {(r["method"], r["checkpointing"], r["tokens"]): r for r in data["rows"]}
    for n in sorted({r["tokens"] for r in data["rows"]}):
        hf, ck, oo = by.get(("hf", False, n)), by.get(("hf", True, n)), by.get(("oomb", True, n))
        if not (hf and ck and oo):
            continue
        lines.append(
            f"| {n:,} | {hf['peak_bytes'] / MIB:.1f} | {ck['peak_bytes'] / MIB:.1f} | {oo['peak_bytes'] / MIB:.1f} "
            f"| {oo['carried_state_bytes'] / MIB:.2f} / {oo['pool_bytes'] / MIB:.1f} | {ck['step_s']:.2f} "
            f"| {oo['step_s']:.2f} |"
        )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--family", choices=sorted(MODELS), default="qwen3_5")
    p.add_argument("--contexts", type=int, nargs="+", help="tokens per step (default: the family's)")
    p.add_argument("--chunk", type=int, help="OOMB's chunk size (default: the family's)")
    p.add_argument("--repeats", type=int, default=1)
    p.add_argument(
        "--out", type=Path, help="JSON path (default: benchmarks/results/hybrid-memory[-FAMILY]-cpu.json)"
    )
    args = p.parse_args(argv)
    _, _, contexts, chunk = MODELS[args.family]
    args.contexts, args.chunk = args.contexts or contexts, args.chunk or chunk
    suffix = "" if args.family == "qwen3_5" else f"-{args.family}"
    args.out = args.out or ROOT / "benchmarks" / "results" / f"hybrid-memory{suffix}-cpu.json"
    start = time.perf_counter()
    report = run(args)
    report.data["wall_s"] = time.perf_counter() - start
    report.save()
    plot(report.rows, args.out.with_suffix(".png"), args.family)
    args.out.with_suffix(".md").write_text(table(report.data))
    print(table(report.data))
    return report.data


if __name__ == "__main__":
    main()
