"""The README's predictions for the H200 goals, from the planner alone (no GPU): memory by
:func:`lightning_oomb.plan`, time by its step model (:mod:`lightning_oomb.engine.step_time`) at nominal rates.

Qwen2.5-7B's shape, bf16-true, one row, no optimizer state (as the benchmarks step) unless a row says AdamW; chunks
of 4096, pages of 128, layer checkpointing, unless a row says "strategy defaults" (``kv_grad_dtype``,
``layer_checkpointing`` and ``reuse_attention`` decided by the plan, as ``OOMBStrategy()`` decides them). The machine: 139.8 GiB of GPU memory, 120 GiB of host memory for the
step. Rates (assumed): 500 TFLOP/s for matmuls, 300 TFLOP/s for attention, 25 GB/s host-device copies; "scaled"
multiplies a time by HF's step measured on an H200 at 32K (5.16 s) over its predicted time at those rates — a
correction of the assumed rates by the one measurement there is. Every number here is a prediction.

    PYTHONPATH=$PWD python benchmarks/predictions.py --out benchmarks/results/predictions-h200.json
"""

from __future__ import annotations

import argparse
import dataclasses
import math
from pathlib import Path

from benchmarks.common import GIB, write_json
from lightning_oomb import plan
from lightning_oomb.engine import OOMBConfig
from lightning_oomb.engine.activation_bytes import parked_bytes
from lightning_oomb.engine.config import STRATEGY_DEFAULTS
from lightning_oomb.engine.model_shape import model_shape
from lightning_oomb.engine.planner import (
    NOMINAL_STEP_RATES,
    Machine,
    longest_fitting,
)
from lightning_oomb.engine.step_setup import precision_dtypes
from lightning_oomb.engine.step_time import copy_bytes, step_flops, step_time
from lightning_oomb.models import qwen2_5_7b_config

MACHINE = Machine("cuda", int(139.8 * GIB), 120 * GIB)
RATES = NOMINAL_STEP_RATES["cuda"]  # 500 TFLOP/s matmuls, 300 attention, 25 GB/s copies
HF_32K_S, HF_32K_GIB = 5.16, 77.0  # HF + SDPA + checkpointing on an H200, measured (docs/design.md section 4)
K = 1024
BASE = OOMBConfig(4096, 128, layer_checkpointing=True)
OFFLOADED = dataclasses.replace(BASE, offload=True, hbm_budget=0)  # every layer's pages in host memory
AUTO = dataclasses.replace(BASE, offload=True)  # hbm_budget="auto": as many layers on the GPU as fit
DEFAULTS = OOMBConfig(4096, 128, **STRATEGY_DEFAULTS)  # the strategies' defaults, decided by the plan


def planned(tokens: int, config: OOMBConfig, optimizer: str | None = None):
    return plan(qwen2_5_7b_config(), tokens, 1, config, "bf16-true", optimizer, MACHINE, suggest=False)


def seconds(tokens: int, config: OOMBConfig, reference: bool = False) -> float:
    return step_time(
        *step_flops(model_shape(qwen2_5_7b_config()), tokens, config, reference=reference), 0.0, RATES
    )


def label(accumulation: str, p) -> str:
    """``grad_accumulation``'s name in a row; ``"auto"`` with what the plan decided."""
    return f"auto = {p.config.grad_accumulation}" if accumulation == "auto" else accumulation


def longest(config: OOMBConfig) -> int:
    """The longest step (whole chunks) that fits the machine."""
    return longest_fitting(lambda n: planned(n, config).fits, config.chunk_size, 4 * K * K)


H100 = Machine("cuda", int(79.1 * GIB), 120 * GIB, rates=RATES)  # an 80 GB GPU (H100 SXM: the H200's compute)


def on_80gb() -> dict:
    """Qwen2.5-7B, bf16-true, fused AdamW (``CausalLMModule`` on a GPU) with the strategy defaults on an 80 GB GPU
    and 120 GiB of host memory: per step length what the plan decides, its peaks and its predicted time; and the
    longest step that fits."""

    def at(tokens: int):
        config = dataclasses.replace(DEFAULTS, hbm_budget="auto")
        return plan(qwen2_5_7b_config(), tokens, 1, config, "bf16-true", "adamw-fused", H100, suggest=False)

    rows = {}
    for tokens in (32 * K, 128 * K, 256 * K, 512 * K):
        p = at(tokens)
        decided = {k: getattr(p.config, k) for k in (*STRATEGY_DEFAULTS, "grad_accumulation")}
        rows[f"{tokens // K}K"] = {"fits": p.fits, "decided": decided, "hbm_layers": p.hbm_layers,
                                   "peak_gib": p.peak_device / GIB, "host_gib": p.host_tier / GIB,
                                   "seconds": p.step_time_s, "tokens_per_s": tokens / p.step_time_s}  # fmt: skip
    rows["longest_tokens"] = longest_fitting(lambda n: at(n).fits, DEFAULTS.chunk_size, 2 * K * K)
    return rows


def predictions() -> dict:
    shape = model_shape(qwen2_5_7b_config())
    hf = seconds(32 * K, BASE, reference=True)
    scale = HF_32K_S / hf
    rows = {"scale": scale}
    rows["32k_time_vs_hf"] = {name: seconds(32 * K, config) / hf for name, config in (
        ("checkpointing", BASE), ("reuse_attention", dataclasses.replace(BASE, reuse_attention=True)),
        ("no_checkpointing", dataclasses.replace(BASE, layer_checkpointing=False)),
        ("strategy_defaults", planned(32 * K, DEFAULTS).config))}  # fmt: skip
    sums = ("auto", "float32", "float32-host", "native")  # auto: the default, as the strategies decide it
    at_32k = {g: planned(32 * K, dataclasses.replace(BASE, grad_accumulation=g)) for g in sums}
    rows["32k_peak_gib"] = {label(g, p): p.peak_device / GIB for g, p in at_32k.items()}
    rows["32k_peak_gib"]["auto, every layer offloaded"] = planned(32 * K, OFFLOADED).peak_device / GIB
    rows["32k_peak_gib"]["strategy defaults"] = (
        planned(32 * K, DEFAULTS).peak_device / GIB
    )  # speed where it fits
    rows["32k_peak_vs_hf"] = {g: v / HF_32K_GIB for g, v in rows["32k_peak_gib"].items()}
    # HF's 77.0 GiB was measured with its gradients allocated before the step; at its peak (the loss backward)
    # only the LM head's exist when the step starts without them, as Lightning's zero_grad() leaves it
    head = shape.vocab_size * shape.hidden_size * 2
    rows["hf_32k_peak_without_grads_gib"] = hf_lazy = HF_32K_GIB - (2 * shape.parameter_count() - head) / GIB
    rows["32k_peak_vs_hf_without_grads"] = {g: v / hf_lazy for g, v in rows["32k_peak_gib"].items()}
    peaks = {g: planned(256 * K, dataclasses.replace(OFFLOADED, grad_accumulation=g)) for g in sums}
    tiled = planned(256 * K, dataclasses.replace(OFFLOADED, grad_accumulation="float32-host", mlp_tile=1024))
    rows["256k_offloaded_peak_gb"] = {label(g, p): p.peak_device / 1e9 for g, p in peaks.items()} | {
        "float32-host, mlp_tile 1024": tiled.peak_device / 1e9
    }
    rows["256k_offloaded_peak_at"] = {label(g, p): p.peak_phase for g, p in peaks.items()}
    small = planned(32 * K, dataclasses.replace(OFFLOADED, grad_accumulation="float32")).peak_device
    rows["offload_slope_mb_per_10k"] = (peaks["float32"].peak_device - small) / 1e6 / ((256 - 32) * K) * 1e4
    kv, grad = (peaks["float32"].pool.page_bytes(part) / BASE.page_size for part in ("kv", "grad"))
    one_layer = copy_bytes(128 * K, OFFLOADED, 1, kv, grad) / RATES.copy_bytes
    # what each chunk's recompute parks (kept results, layer inputs), out and back, per layer
    parked = parked_bytes(shape, precision_dtypes("bf16-true"), BASE.chunk_size)
    chunks = 128 * K // BASE.chunk_size
    _, attention = step_flops(shape, 128 * K, OFFLOADED)
    rows["128k_offload"] = {"copies_s_per_layer": one_layer,
                            "parking_s_per_layer": 2 * chunks * parked / shape.num_layers / RATES.copy_bytes,
                            "attention_s_per_layer": attention / RATES.attention_flops / shape.num_layers}  # fmt: skip
    dense = {"plain": BASE, "reuse_attention": dataclasses.replace(BASE, reuse_attention=True),
             "strategy defaults": planned(256 * K, DEFAULTS).config}  # fmt: skip
    rows["256k_tokens_per_s"] = {n: 256 * K / seconds(256 * K, c) for n, c in dense.items()}
    rows["256k_defaults_decided"] = {k: getattr(dense["strategy defaults"], k) for k in STRATEGY_DEFAULTS}
    rows["256k_reuse_host_gib"] = (
        planned(256 * K, dense["reuse_attention"]).host_parts["reused_attention"] / GIB
    )
    million = {}
    for name, config in (("plain", AUTO), ("reuse auto", dataclasses.replace(AUTO, reuse_attention="auto")),
                         ("reuse auto, bf16 gradient pages", dataclasses.replace(
                             AUTO, reuse_attention="auto", kv_grad_dtype="bfloat16")),
                         ("strategy defaults", dataclasses.replace(DEFAULTS, offload=True))):  # fmt: skip
        p = planned(K * K, config)
        million[name] = {"seconds": seconds(K * K, p.config), "kept_chunks": p.config.reused_chunks(256),
                         "kv_grad_dtype": p.config.kv_grad_dtype, "layer_checkpointing": p.config.layer_checkpointing,
                         "hbm_layers": p.hbm_layers, "host_layers": p.host_layers, "fits": p.fits}  # fmt: skip
    rows["1m_step"] = million
    sparse = dataclasses.replace(BASE, page_budget=64)
    rows["256k_sparse_tokens_per_s"] = 256 * K / seconds(256 * K, sparse)
    rows["longest_tokens"] = {f"{g}, {pages} gradient pages": longest(dataclasses.replace(
        AUTO, kv_grad_dtype=pages, grad_accumulation=g)) for g in ("float32", "float32-host")
        for pages in ("float32", "bfloat16")} | {"float32, auto gradient pages (the default)": longest(
        dataclasses.replace(AUTO, kv_grad_dtype="auto", grad_accumulation="float32"))}  # fmt: skip
    rows["80gb"] = on_80gb()
    for optimizer in (None, "adamw"):
        p = planned(K * K, AUTO, optimizer)
        rows[f"1m_fits_{optimizer or 'no_optimizer'}"] = {
            "fits": p.fits,
            "hbm_layers": p.hbm_layers,
            "host_layers": p.host_layers,
            "peak_gib": p.peak_device / GIB,
            "host_gib": p.host_tier / GIB,
        }
    return rows


def table(rows: dict) -> list[str]:
    s, t = rows["scale"], rows["32k_time_vs_hf"]
    p32, peak, one = rows["32k_peak_vs_hf"], rows["256k_offloaded_peak_gb"], rows["128k_offload"]
    tps, m, longest_ = rows["256k_tokens_per_s"], rows["1m_step"], rows["longest_tokens"]

    def fits(key):
        f = rows[key]
        return f"{f['fits']}: {f['hbm_layers']} HBM + {f['host_layers']} host layers, {f['peak_gib']:.1f} GiB GPU, {f['host_gib']:.1f} GiB host"

    million = "; ".join(f"{n} {v['seconds']:,.0f} s ({v['seconds'] * s:,.0f} scaled, {v['kept_chunks']} chunks kept)"
                        for n, v in m.items())  # fmt: skip
    return [
        f"Scale (HF's measured 5.16 s at 32K over its predicted time): {s:.2f}.",
        "",
        "| goal | target | predicted |",
        "|---|---|---|",
        f"| 32K step time vs HF | <= 1.2x | {t['checkpointing']:.2f}x with checkpointing, {t['reuse_attention']:.2f}x "
        f"with reuse_attention, {t['no_checkpointing']:.2f}x without checkpointing, {t['strategy_defaults']:.2f}x "
        "with the strategy defaults |",
        "| 32K peak vs HF's 77.0 GiB (its gradients allocated before the step) | <= 50 % | "
        + ", ".join(f"{g} {rows['32k_peak_gib'][g]:.1f} GiB ({100 * v:.0f} %)" for g, v in p32.items())
        + " |",
        f"| 32K peak vs HF's {rows['hf_32k_peak_without_grads_gib']:.1f} GiB (predicted: the step starts without "
        "gradients, as Lightning's; run_gpu.sh measures so) | <= 50 % | "
        + ", ".join(f"{g} {100 * v:.0f} %" for g, v in rows["32k_peak_vs_hf_without_grads"].items())
        + " |",
        "| peak at 256K, every layer offloaded | <= 33 GB | "
        + ", ".join(f"{g} {v:.1f} GB" for g, v in peak.items())
        + " |",
        f"| GPU memory growth with offload | <= 5 MB per 10K tokens | {rows['offload_slope_mb_per_10k']:.2f} MB |",
        f"| offload overhead at 128K | <= 3 % | copies {one['copies_s_per_layer']:.1f} s per layer "
        f"(+ {one['parking_s_per_layer']:.2f} s parking) vs {one['attention_s_per_layer']:.1f} s of its attention "
        "(overlapped) |",
        "| dense throughput at 256K | >= 1,500 tokens/s | "
        + ", ".join(f"{n} {v:,.0f} ({v / s:,.0f} scaled)" for n, v in tps.items())
        + f"; reuse keeps {rows['256k_reuse_host_gib']:.1f} GiB in host memory; the strategy defaults decide "
        + ", ".join(f"{k}={v!r}" for k, v in rows["256k_defaults_decided"].items())
        + " |",
        f"| dense 1M-token step | <= 2,500 s | {million} |",
        f"| sparse (4K + 64 pages) at 256K | >= 4,000 tokens/s | {rows['256k_sparse_tokens_per_s']:,.0f} "
        f"({rows['256k_sparse_tokens_per_s'] / s:,.0f} scaled) |",
        "| longest step (128 GB host) | >= 1.5M tokens | "
        + ", ".join(f"{n} {v / K / K:.2f}M" for n, v in longest_.items())
        + " |",
        f"| 1M tokens in one step | fits | {fits('1m_fits_no_optimizer')}; with AdamW {fits('1m_fits_adamw')} |",
        "",
        "An 80 GB GPU (79.1 GiB, the H200's rates) with 120 GiB of host memory: Qwen2.5-7B, bf16-true, fused AdamW "
        "(`CausalLMModule` on a GPU), the strategy defaults as the plan decides them "
        f"(longest step that fits: {rows['80gb']['longest_tokens'] / K / K:.2f}M tokens):",
        "",
        "| step | decided | GPU peak | host | step time | tokens/s |",
        "|---|---|---|---|---|---|",
        *(_row_80gb(n, r, s) for n, r in rows["80gb"].items() if n != "longest_tokens"),
    ]


def _row_80gb(name: str, r: dict, scale: float) -> str:
    decided = ", ".join(f"{k}={v!r}" for k, v in r["decided"].items())
    time, rate = r["seconds"], r["tokens_per_s"]
    return (f"| {name} | {decided}; pages of {r['hbm_layers']} of 28 layers on the GPU | {r['peak_gib']:.1f} GiB | "
            f"{r['host_gib']:.1f} GiB | {time:,.1f} s ({time * scale:,.1f} scaled) | {rate:,.0f} "
            f"({rate / scale:,.0f} scaled) |")  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/predictions-h200.json"))
    args = parser.parse_args(argv)
    rows = predictions()
    assumptions = {"machine": dataclasses.asdict(MACHINE), "rates": dataclasses.asdict(RATES),
                   "hf_32k_s": HF_32K_S, "hf_32k_gib": HF_32K_GIB}  # fmt: skip
    write_json(args.out, {"command": f"PYTHONPATH=$PWD python benchmarks/predictions.py --out {args.out}",
                          "assumptions": assumptions, "predictions": rows})  # fmt: skip
    text = "\n".join([f"`PYTHONPATH=$PWD python benchmarks/predictions.py --out {args.out}`", "",
                      "Predicted, not measured (the planner and its step model; module docstring).", "",
                      *table(rows)])  # fmt: skip
    args.out.with_suffix(".md").write_text(text + "\n")
    print(text)
    return 0 if math.isfinite(rows["scale"]) else 1


if __name__ == "__main__":
    raise SystemExit(main())
