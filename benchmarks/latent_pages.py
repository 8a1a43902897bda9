"""What attending over latents costs and saves: one training step of a GLM-4.7-Flash-shaped model with its latent
attention layers' pages expanded (every head's keys and values) and as latents (``mla_pages="latent"``), in the
same run.

A layer-reduced GLM-4.7-Flash shape (transformers' ``Glm4MoeLiteConfig`` defaults: hidden 2048, 20 heads, keys of
192 + 64 and values of 256 per head, a latent of 512 + 64; ``--layers`` layers, the first a dense MLP, the others
MoE; bf16; random weights) takes forward + backward of one ``--tokens`` sequence in chunks of ``--chunk`` with layer
checkpointing, every page on the GPU:

- ``expanded``: the pages hold 20 heads of keys and values, 256 + 256 wide (bf16: 20 KiB per token and layer, and
  float32 gradient pages twice that);
- ``latent``: one head of 576 serving as keys and values, one page tensor and one gradient page (1.1 KiB per token
  and layer, 17.8x less), which every query head attends at that width (the queries absorb ``kv_b_proj``'s keys
  half), the Triton kernels tiling it at 1,024.

Reported per method: the step time (median of ``--repeats`` after one warm-up), the peak GPU memory next to the
planner's, the pool's bytes and the loss. Predicted: the latent pool 17.8x smaller, its attention ~4x the FLOPs
(1,024-wide tiles against 256-wide ones). Writes JSON (``--out``), a PNG and a Markdown table next to it.

    PYTHONPATH=$PWD python3 benchmarks/latent_pages.py --out benchmarks/results/latent-pages-h200.json
    PYTHONPATH=$PWD python benchmarks/latent_pages.py --tiny --device cpu --out /tmp/latent-pages.json  # smoke
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

from benchmarks.common import (
    Report,
    build_causal_lm,
    engine_stats,
    finish,
    planned_peak_gib,
    step_args,
    timed_engine,
)
from lightning_oomb.engine import OOMBConfig

ROOT = Path(__file__).resolve().parents[1]
TINY = dict(hidden_size=32, intermediate_size=64, moe_intermediate_size=16, num_attention_heads=4,
            num_key_value_heads=4, kv_lora_rank=16, q_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=4,
            v_head_dim=8, n_routed_experts=4, num_experts_per_tok=2, vocab_size=97)  # fmt: skip
METHODS = ("expanded", "latent")


def build(tiny: bool, layers: int, device: torch.device, dtype: torch.dtype) -> torch.nn.Module:
    """A random GLM-4.7-Flash-shaped model (``Glm4MoeLiteConfig``'s defaults, or :data:`TINY`) of ``layers`` layers."""
    import transformers as tf

    config = tf.Glm4MoeLiteConfig(num_hidden_layers=layers, first_k_dense_replace=1, **(TINY if tiny else {}))
    return build_causal_lm(config, device, dtype)


def run(args) -> Report:
    device = torch.device(args.device)
    dtype = torch.float32 if args.tiny else torch.bfloat16
    report = Report(args.out, model="tiny" if args.tiny else "GLM-4.7-Flash", layers=args.layers,
                    tokens=args.tokens, chunk=args.chunk, page=args.page, repeats=args.repeats,
                    device=str(device))  # fmt: skip
    model = build(args.tiny, args.layers, device, dtype)
    vocab = model.config.vocab_size
    ids = torch.randint(0, vocab, (1, args.tokens), generator=torch.Generator().manual_seed(0)).to(device)
    for method in METHODS:
        config = OOMBConfig(args.chunk, args.page, layer_checkpointing=True, mla_pages=method,
                            kv_grad_dtype="bfloat16" if dtype == torch.bfloat16 else "float32")  # fmt: skip
        with timed_engine(model, ids, config, device, args.repeats) as (engine, timing, loss):
            precision = "32-true" if args.tiny else "bf16-true"
            planned = planned_peak_gib(engine.model, args.tokens, config, device, precision)
            shape = engine.pool.shape
            report.add({"method": method, **timing, **engine_stats(engine), "kv_heads": shape.kv_heads,
                        "head_dim": shape.head_dim, "planned_peak_gib": planned, "loss": loss})  # fmt: skip
    return report


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(9, 3.5))
    names = [r["method"] for r in rows]
    axes[0].bar(names, [r["step_s"] for r in rows])
    axes[0].set_ylabel("seconds per step")
    axes[1].bar(names, [r["pool_device_gib"] for r in rows])
    axes[1].set_ylabel("pool on the GPU (GiB)")
    fig.suptitle("latent attention: expanded pages vs latents")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def table(data: dict) -> str:
    rows = {r["method"]: r for r in data["rows"]}
    lines = [
        f"`{data['command']}`",
        "",
        f"{data['layers']} layers of the {data['model']} shape, one sequence of {data['tokens']:,} tokens in chunks of "
        f"{data['chunk']:,}, layer checkpointing, every page on the device; {data['device']}; median of "
        f"{data['repeats']} steps after one warm-up.",
        "",
        "| pages | step (s) | vs expanded | peak GPU (GiB) | planned peak (GiB) | pool (GiB) | loss |",
        "|---|---|---|---|---|---|---|",
    ]
    base = rows.get("expanded")
    for method, r in rows.items():
        ratio = f"{r['step_s'] / base['step_s']:.2f}x" if base else "-"
        peak = "-" if r["peak_gib"] is None else f"{r['peak_gib']:.2f}"
        planned = "-" if r["planned_peak_gib"] is None else f"{r['planned_peak_gib']:.2f}"
        lines.append(
            f"| {method} | {r['step_s']:.3f} | {ratio} | {peak} | {planned} | {r['pool_device_gib']:.3f} | "
            f"{r['loss']:.4f} |"
        )
    return "\n".join(lines) + "\n"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    return step_args(__doc__, argv, 2, 32768, ROOT / "benchmarks" / "results" / "latent-pages-h200.json", 128)


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    return finish(run(args), args.out, plot, table)


if __name__ == "__main__":
    main()
