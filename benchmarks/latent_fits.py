"""Will it fit over latents? The longest training step the memory planner finds for multi-head latent attention
models with their pages expanded (every head's keys and values, the default) and as latents
(``mla_pages="latent"``), on common GPUs.

As ``benchmarks/fits.py`` (its bisection, GPUs, host memory and the strategies' defaults), for the latent attention
models one GPU can train — each built from its published config numbers on the ``meta`` device (nothing allocated,
nothing downloaded): GLM-4.7-Flash (transformers' ``Glm4MoeLiteConfig`` defaults), DeepSeek-V2-Lite, MiniCPM3-4B
and Youtu-LLM-2B (their config classes' defaults) — with rank-16 LoRA adapters on every attention and MLP projection
(routed experts' weights stay frozen), AdamW on the adapters, ``precision="bf16-true"``. Every figure is a
**prediction** of the planner; the time a step takes over latents (each head attends 576 wide, tiled at 1,024 by
the Triton kernels) is what ``benchmarks/latent_pages.py`` measures on a GPU.

    PYTHONPATH=$PWD python benchmarks/latent_fits.py --out benchmarks/results/latent-fits.json
"""

from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path

from benchmarks.common import command, versions, write_json
from benchmarks.fits import CONFIG, GPUS, cell, longest, machine
from lightning_oomb.cli import planned_model

LORA_TARGETS = ["q_proj", "q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj", "gate_proj",
                "up_proj", "down_proj"]  # fmt: skip
MODES = ("expanded", "latent")


def model_configs() -> dict:
    """Published config numbers as transformers config classes."""
    import transformers as tf

    return {
        "GLM-4.7-Flash": tf.Glm4MoeLiteConfig(),
        "DeepSeek-V2-Lite": tf.DeepseekV2Config(
            hidden_size=2048,
            intermediate_size=10944,
            moe_intermediate_size=1408,
            num_hidden_layers=27,
            num_attention_heads=16,
            num_key_value_heads=16,
            n_routed_experts=64,
            n_shared_experts=2,
            num_experts_per_tok=6,
            first_k_dense_replace=1,
            kv_lora_rank=512,
            q_lora_rank=None,
            qk_nope_head_dim=128,
            qk_rope_head_dim=64,
            v_head_dim=128,
            vocab_size=102400,
        ),  # fmt: skip
        "MiniCPM3-4B": tf.MiniCPM3Config(),
        "Youtu-LLM-2B": tf.YoutuConfig(),
    }


def main(argv: list[str] | None = None) -> int:
    configs = model_configs()
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("latent-fits.json"))
    parser.add_argument("--models", nargs="*", choices=list(configs), help="a subset (default: all)")
    parser.add_argument("--host-gib", type=int, default=128)
    args = parser.parse_args(argv)
    rows = []
    for name in args.models or configs:
        model = planned_model(configs[name], "bf16-true", lora={"r": 16, "target_modules": LORA_TARGETS})
        for mode in MODES:
            config = dataclasses.replace(CONFIG, mla_pages=mode)
            gpus = {g: longest(model, machine(g, args.host_gib), config) for g in GPUS}
            rows.append({"model": name, "mode": mode, "gpus": gpus})
            print(name, mode, {g: cell(r) for g, r in gpus.items()}, flush=True)
    data = {"command": command(), "versions": versions(), "host_gib": args.host_gib, "rows": rows}
    write_json(args.out, data)
    lines = [f"`{data['command']}`", "", f"Predicted, rank-16 LoRA, {args.host_gib} GiB host memory:", "",
             "| model | pages | " + " | ".join(GPUS) + " |", "|---|---|" + "---|" * len(GPUS)]  # fmt: skip
    lines += [
        f"| {r['model']} | {r['mode']} | " + " | ".join(cell(r["gpus"][g]) for g in GPUS) + " |" for r in rows
    ]
    args.out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
