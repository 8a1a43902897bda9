"""Will it fit? The longest training step the memory planner finds for popular 1.5-9B models on common GPUs.

For each model (built from its published config numbers on the ``meta`` device: nothing allocated, nothing
downloaded), training mode and GPU, a bisection over whole chunks (4,096 tokens, pages of 128) for the longest
one-row step :func:`lightning_oomb.plan` says fits, with the strategies' defaults (``OOMBStrategy()``: offload,
layer checkpointing, gradient page dtype, kept attention results and gradient sums decided by the plan, as at
setup), ``precision="bf16-true"``:

- full fine-tuning: every weight trained with AdamW (fused: its states in the weights' dtype, bf16);
- LoRA: rank-16 adapters (``peft``) on every attention and MLP projection, AdamW on the adapters, the base frozen.

GPU memory: the card's capacity as torch reports it, less 0.5 GiB for the CUDA context; host memory ``--host-gib``
(default 128 GiB: where the pinned tier of KV pages, gradient pages and parked results lives — past what the GPU
holds, it bounds the longest step). Every figure is a **prediction** of the planner, whose peaks were within 1 % of
the measured ones for 11 of 13 rows on an H200 (the other two 1.7 % and 3.2 % above; README, Results). A model whose
weights, gradients and optimizer states alone exceed the GPU shows "—" with those bytes; after each length, what a
chunk more would overflow: the GPU's memory or the host's. K = 1,024 tokens, M = 1,048,576 (as "a 1M-token step").

Writes JSON (``--out``) and a Markdown table next to it; ~2 min on 2 cores.

    PYTHONPATH=$PWD python benchmarks/fits.py --out benchmarks/results/fits.json
"""

from __future__ import annotations

import argparse
from pathlib import Path

from benchmarks.common import GIB, command, versions, write_json
from lightning_oomb import plan
from lightning_oomb.cli import planned_model
from lightning_oomb.engine import OOMBConfig
from lightning_oomb.engine.config import STRATEGY_DEFAULTS
from lightning_oomb.engine.planner import Machine, longest_fitting
from lightning_oomb.models import qwen2_5_7b_config

K = 1024
CHUNK = 4096
LONGEST = 4 * K * K  # the search's cap: "≥ 4M" beyond it
CONFIG = OOMBConfig(CHUNK, 128, **STRATEGY_DEFAULTS)
LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


GPUS = {"RTX 4090 (24 GB)": 23.6, "L40S (48 GB)": 44.4, "A100 / H100 (80 GB)": 79.1, "H200 (141 GB)": 139.8}
# (GiB as torch reports each card's total memory)


def machine(gpu: str, host_gib: int) -> Machine:
    total = int(GPUS[gpu] * GIB)
    return Machine("cuda", total - GIB // 2, host_gib * GIB, total)


def model_configs() -> dict:
    """Published config numbers (``config.json`` of each hub repository) as transformers config classes."""
    import transformers as tf

    llama3_rope = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                   "original_max_position_embeddings": 8192}  # fmt: skip
    return {
        "Qwen2.5-1.5B": tf.Qwen2Config(
            hidden_size=1536,
            intermediate_size=8960,
            num_hidden_layers=28,
            num_attention_heads=12,
            num_key_value_heads=2,
            vocab_size=151936,
            max_position_embeddings=131072,
            rope_theta=1e6,
            tie_word_embeddings=True,
        ),  # fmt: skip
        "Qwen2.5-7B": qwen2_5_7b_config(),
        "Qwen3-8B": tf.Qwen3Config(
            hidden_size=4096,
            intermediate_size=12288,
            num_hidden_layers=36,
            num_attention_heads=32,
            num_key_value_heads=8,
            head_dim=128,
            vocab_size=151936,
            max_position_embeddings=131072,
            rope_theta=1e6,
            tie_word_embeddings=False,
        ),  # fmt: skip
        "Llama-3.1-8B": tf.LlamaConfig(
            hidden_size=4096,
            intermediate_size=14336,
            num_hidden_layers=32,
            num_attention_heads=32,
            num_key_value_heads=8,
            vocab_size=128256,
            max_position_embeddings=131072,
            rope_theta=5e5,
            rope_scaling=llama3_rope,
            rms_norm_eps=1e-5,
            tie_word_embeddings=False,
        ),  # fmt: skip
        "Mistral-7B-v0.3": tf.MistralConfig(
            hidden_size=4096,
            intermediate_size=14336,
            num_hidden_layers=32,
            num_attention_heads=32,
            num_key_value_heads=8,
            vocab_size=32768,
            max_position_embeddings=32768,
            rope_theta=1e6,
            sliding_window=None,
            tie_word_embeddings=False,
        ),  # fmt: skip
        "Gemma-2-9B": tf.Gemma2Config(
            hidden_size=3584,
            intermediate_size=14336,
            num_hidden_layers=42,
            num_attention_heads=16,
            num_key_value_heads=8,
            head_dim=256,
            vocab_size=256000,
            sliding_window=4096,
            query_pre_attn_scalar=256,
            attn_logit_softcapping=50.0,
            final_logit_softcapping=30.0,
        ),  # fmt: skip
    }


def meta_model(config, lora: bool):
    """The model as ``oomb plan`` reads it (built on the ``meta`` device in bf16: no memory), with rank-16 LoRA
    adapters if ``lora``."""
    return planned_model(
        config, "bf16-true", lora={"r": 16, "target_modules": LORA_TARGETS} if lora else None
    )


def planned(model, tokens: int, where: Machine, config: OOMBConfig = CONFIG):
    return plan(model, tokens, 1, config, "bf16-true", "adamw-fused", where, suggest=False)


def longest(model, where: Machine, config: OOMBConfig = CONFIG) -> dict:
    """The longest step (whole chunks, up to :data:`LONGEST`) that fits with ``config``, with what the plan decided
    there."""
    tokens = longest_fitting(lambda n: planned(model, n, where, config).fits, CHUNK, LONGEST)
    if tokens == 0:
        p = planned(model, CHUNK, where, config)
        return {
            "tokens": 0,
            "persistent_gib": sum(p.device[k] for k in ("weights", "gradients", "optimizer_states")) / GIB,
        }
    p, beyond = planned(model, tokens, where, config), planned(model, tokens + CHUNK, where, config)
    bound = None if beyond.fits else "GPU" if not beyond.device_fits else "host"
    decided = {k: getattr(p.config, k) for k in (*STRATEGY_DEFAULTS, "grad_accumulation")}
    return {"tokens": tokens, "bound_by": bound, "peak_gib": p.peak_device / GIB, "host_gib": p.host_tier / GIB,
            "hbm_layers": p.hbm_layers, "host_layers": p.host_layers, "decided": decided}  # fmt: skip


def cell(result: dict) -> str:
    tokens = result["tokens"]
    if tokens == 0:
        return f"— ({result['persistent_gib']:.0f} GiB before any token)"
    text = f"{tokens / K / K:.2f}M" if tokens >= K * K else f"{tokens // K}K"
    return f"≥ {text}" if tokens >= LONGEST else f"{text} ({result['bound_by']})"


def table(rows: list[dict]) -> str:
    lines = ["| model | training | " + " | ".join(GPUS) + " |", "|---|---|" + "---|" * len(GPUS)]
    for row in rows:
        cells = " | ".join(cell(row["gpus"][g]) for g in GPUS)
        lines.append(f"| {row['model']} | {row['mode']} | {cells} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    configs = model_configs()
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("fits.json"))
    parser.add_argument(
        "--models", nargs="*", choices=list(configs), help="a subset of the models (default: all)"
    )
    parser.add_argument("--host-gib", type=int, default=128, help="host memory of every machine (GiB)")
    args = parser.parse_args(argv)
    rows = []
    for name in args.models or configs:
        for mode, lora in (("full, AdamW", False), ("LoRA r=16, AdamW", True)):
            model = meta_model(configs[name], lora)
            row = {
                "model": name,
                "mode": mode,
                "gpus": {g: longest(model, machine(g, args.host_gib)) for g in GPUS},
            }
            print(
                f"{name}, {mode}: " + ", ".join(f"{g}: {cell(r)}" for g, r in row["gpus"].items()), flush=True
            )
            rows.append(row)
    write_json(args.out, {"command": command(), "versions": versions(), "chunk": CHUNK, "host_gib": args.host_gib,
                          "rows": rows})  # fmt: skip
    how = "\n\n".join(__doc__.split("\n\n")[1:4])
    title = f"# Longest one-row training step that fits (planned; {args.host_gib} GiB of host memory)"
    text = f"{title}\n\n`{command()}`\n\n{how}\n\n{table(rows)}\n"
    args.out.with_suffix(".md").write_text(text)
    print(table(rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
