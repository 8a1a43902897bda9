"""A GPU run's time goals re-timed for faster attention kernels: the README's "shipped tiles (predicted)" column.

``benchmarks/run_gpu.sh`` measured its steps at some kernel tiles and fitted the device's step rates on them
(``goals-summary-<gpu>.json``: ``step_rates``); ``benchmarks/tile_sweep.py`` then measured how much faster forward +
backward attention runs at the tiles shipped since (``tile-sweep-<gpu>.json``: the shipped and the best tiles'
``fwd_bwd_ms`` after the first key length). Each time goal is predicted as its measured value times the planner's
step time at the new rates (attention FLOP/s times that speed-up) over its step time at the fitted ones — the same
Qwen2.5-7B configuration as the measured row (28 layers, the row's options) — so whatever the step model misses
stays in the measured factor. A goal without a measured row of its configuration (256K with the strategies'
defaults, and 1M with them) borrows the factor of the nearest measured one (256K, every layer offloaded; the 1M step
extrapolated from the offloaded rows). Last, what the strategies decide on that GPU at the new rates for a full
fine-tune (bf16-true, AdamW: its states counted), the README's "auto" paragraph. The goals with the strategies'
defaults are predicted once more for ``OOMB_TRITON_FUSED_DQ=1`` (the dK/dV kernel computing dQ too: 5 matmuls per
query-key tile in the backward instead of 7) at the same time per matmul: the step model's attention backward times
5/7 (:data:`FUSED_DQ_BACKWARD`; its atomics and its own tile's speed not counted). Every number here is a prediction.

    PYTHONPATH=$PWD python benchmarks/retimed.py --gpu h200
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
from pathlib import Path
from unittest import mock

from benchmarks.common import write_json
from benchmarks.predictions import MACHINE
from lightning_oomb import plan
from lightning_oomb.engine import OOMBConfig, step_time
from lightning_oomb.engine.config import STRATEGY_DEFAULTS
from lightning_oomb.engine.step_time import StepRates
from lightning_oomb.models import qwen2_5_7b_config

RESULTS = Path(__file__).resolve().parent / "results"
K = 1024
# the attention backward in forwards with the fused dQ kernel: 5 of its 7 matmuls per query-key tile remain
FUSED_DQ_BACKWARD = step_time.ATTENTION_BACKWARD * 5 / 7


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--gpu", default="h200", help="the results' suffix (goals-*-<gpu>.json, tile-sweep-<gpu>.json)"
    )
    parser.add_argument("--results", type=Path, default=RESULTS)
    parser.add_argument(
        "--out", type=Path, default=None, help="default: <results>/retimed-<gpu>.json (and .md)"
    )
    return parser.parse_args(argv)


def load(results: Path, name: str) -> dict:
    return json.loads((results / name).read_text())


def speedup(sweep: dict) -> float:
    """Forward + backward time at the shipped tiles over the best ones', dense, at the sweep's first key length."""
    first = sweep["shape"]["keys"][0]
    ms = {r["tiles"]: r["fwd_bwd_ms"] for r in sweep["rows"]
          if r.get("keys") == first and r.get("sparse") is False and "fwd_bwd_ms" in r}  # fmt: skip
    return ms["shipped"] / ms["best"]


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    summary = load(args.results, f"goals-summary-{args.gpu}.json")
    rows = {r["role"]: r for part in ("compare", "reduced")
            for r in load(args.results, f"goals-{part}-{args.gpu}.json")["rows"]}  # fmt: skip
    fitted = summary["step_rates"]
    old = StepRates(
        fitted["dense_flops"], fitted["attention_flops"], fitted["copy_bytes"], fitted["host_bytes"]
    )
    gain = speedup(load(args.results, f"tile-sweep-{args.gpu}.json"))
    new = dataclasses.replace(old, attention_flops=old.attention_flops * gain)
    model = qwen2_5_7b_config()

    def planned(tokens: int, config: OOMBConfig, rates: StepRates, optimizer: str | None = None):
        machine = dataclasses.replace(
            MACHINE, rates=rates
        )  # the predictions' H200: 139.8 GiB, 120 GiB of host
        return plan(model, tokens, 1, config, "bf16-true", optimizer, machine, suggest=False)

    def seconds(tokens: int, config: OOMBConfig, rates: StepRates) -> float:
        return planned(tokens, config, rates).step_time_s

    def factor(tokens: int, config: OOMBConfig) -> float:
        return seconds(tokens, config, new) / seconds(tokens, config, old)

    def measured_config(role: str) -> OOMBConfig:
        return OOMBConfig(**rows[role]["config"])

    goals = {g["goal"]: g["value"] for g in summary["goals"]}
    hf = rows["hf-32k"]["step_s"]
    offloaded_256k = measured_config("256k-offload")
    out = []

    def add(goal: str, measured: float, predicted: float, unit: str, how: str) -> None:
        out.append({"goal": goal, "measured": measured, "predicted": predicted, "unit": unit, "how": how})

    step = rows["oomb-32k"]["step_s"]
    add("32K step vs HF, layer checkpointing", step / hf,
        step * factor(32 * K, measured_config("oomb-32k")) / hf, "x HF", "oomb-32k: 28 layers")  # fmt: skip
    tps = goals["dense throughput at 256K"]
    add("dense throughput at 256K, every layer offloaded", tps, tps / factor(256 * K, offloaded_256k), "tokens/s",
        "256k-offload scaled to 28 layers")  # fmt: skip
    million = goals["dense 1M-token step (extrapolated)"]
    add("dense 1M-token step", million, million * factor(K * K, offloaded_256k), "s",
        "extrapolated from 128K and 256K, offloaded")  # fmt: skip
    # each row with the defaults at the new rates, times a measured row's measured / planned (at the fitted rates):
    # its own at 32K; the offloaded 256K row's (the defaults' 256K step was not measured); the 1M extrapolation's
    defaults = OOMBConfig(4096, 128, **STRATEGY_DEFAULTS)
    step32, config32 = rows["oomb-32k-defaults"]["step_s"], measured_config("oomb-32k-defaults")
    measured_over_planned = {
        32 * K: step32 / seconds(32 * K, config32, old),
        256 * K: (256 * K / tps) / seconds(256 * K, offloaded_256k, old),
        K * K: million / seconds(K * K, offloaded_256k, old),
    }
    for fused in (False, True):
        backward = mock.patch.object(step_time, "ATTENTION_BACKWARD", FUSED_DQ_BACKWARD)
        with backward if fused else contextlib.nullcontext():
            times = {n: seconds(n, config32 if n == 32 * K else planned(n, defaults, new).config, new)
                 for n in measured_over_planned}  # fmt: skip
        times = {n: t * measured_over_planned[n] for n, t in times.items()}
        tag = ", fused dQ backward" if fused else ""
        how = ": the attention backward at 5/7" if fused else ""
        add("32K step vs HF, the strategies' defaults" + tag, None if fused else step32 / hf, times[32 * K] / hf,
            "x HF", "oomb-32k-defaults: 28 layers" + how)  # fmt: skip
        add("dense throughput at 256K, the strategies' defaults" + tag, None, 256 * K / times[256 * K], "tokens/s",
            "not measured: its plan at the new rates x 256k-offload's measured / planned" + how)  # fmt: skip
        add("dense 1M-token step, the strategies' defaults" + tag, None, times[K * K], "s",
            "not measured: its plan at the new rates x the extrapolated 1M step's measured / planned" + how)  # fmt: skip

    decisions = []
    for tokens in (32 * K, 128 * K, 256 * K, K * K, 1536 * K):
        p = planned(tokens, defaults, new, "adamw")
        c = p.config
        decisions.append({"tokens": tokens, "layer_checkpointing": c.layer_checkpointing, "kv_grad_dtype":
                          c.kv_grad_dtype, "grad_accumulation": c.grad_accumulation, "reuse_attention":
                          c.reuse_attention, "gpu_layers": p.hbm_layers, "step_s": p.step_time_s})  # fmt: skip

    path = args.out or args.results / f"retimed-{args.gpu}.json"
    write_json(path, {"command": "benchmarks/retimed.py --gpu " + args.gpu, "attention_speedup": gain,
                      "fitted_rates": fitted, "goals": out, "decisions": decisions})  # fmt: skip
    lines = [f"# Time goals re-timed for the shipped tiles ({args.gpu})", "",
             f"`PYTHONPATH=$PWD python benchmarks/retimed.py --gpu {args.gpu}`", "",
             f"Attention {gain:.2f}x faster (tile sweep); every 'predicted' value is a prediction.", "",
             "| goal | measured | predicted | unit | how |", "|---|---|---|---|---|"]  # fmt: skip
    for g in out:
        measured = "—" if g["measured"] is None else f"{g['measured']:,.2f}"
        lines.append(f"| {g['goal']} | {measured} | {g['predicted']:,.2f} | {g['unit']} | {g['how']} |")
    lines += ["", "The strategies' decisions at the new rates (Qwen2.5-7B, bf16-true, AdamW, one row; chunks of 4096):", "",
              "| tokens | layer checkpointing | gradient pages | gradient sums | chunks kept | layers' pages on the GPU | "
              "step s |", "|---|---|---|---|---|---|---|"]  # fmt: skip
    for d in decisions:
        lines.append(f"| {d['tokens']:,} | {d['layer_checkpointing']} | {d['kv_grad_dtype']} | "
                     f"{d['grad_accumulation']} | {d['reuse_attention']} of {-(-d['tokens'] // 4096)} | "
                     f"{d['gpu_layers']} of 28 | {d['step_s']:,.1f} |")  # fmt: skip
    path.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
