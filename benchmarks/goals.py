"""Every goal of docs/design.md section 4 measured on one GPU, in parts that each fit a time budget
(``benchmarks/run_gpu.sh`` runs them all in one command).

Model: the Qwen2.5-7B shape (``Qwen2Config``: hidden 3584, intermediate 18944, 28 layers, 28 query / 4 KV heads of
128, vocab 152064), random init, bf16, no optimizer state. OOMB: chunk 4096, page 128, per-layer checkpointing
inside each chunk; the Triton kernels at the tiles the environment gives them (``run_gpu.sh`` sets
``OOMB_TRITON_AUTOTUNE=0``: each kernel's default tile, no tuning in any step).

Parts (``--part``; each writes ``<out-dir>/goals-<part>.json`` after every row and prints every row as a JSON line):

- ``compare`` — the full model: HF + SDPA + per-layer checkpointing and OOMB at 32K, each warmed up at 32K and
  timed over ``--repeats`` steps (median and min; every step starts without gradients, as under Lightning's
  ``zero_grad()``); OOMB at 64K (one step: the check of the layer scaling below); if the budget allows, OOMB at 32K
  with the options the strategies' defaults decide on this machine, with every layer offloaded and with
  ``reuse_attention``.
- ``reduced`` — the same layers, 2 or 4 of them, where a 28-layer step would not fit the budget (a 256K step of 28
  layers is minutes), in priority order (:func:`reduced_rows`): 64K with 4 and 2 layers (the fit); then 2 layers:
  128K without and with offload (3 steps each), 256K dense with every layer offloaded (with the 32K and 128K
  offloaded steps: the GPU-memory slope), a 1M-token sparse step with one layer in the HBM tier and one in pinned
  host memory (chunk 16K: a host layer streams every earlier chunk, 1/16K of them per token), 256K sparse
  (``page_budget=64``), 256K with the options the strategies' defaults decide for the full model on this machine.
  Every configuration is warmed up at 32K first (kernels compiled, pool arenas grown). Only
  one model and one engine are alive at a time, so each peak is the row's own.
- ``summary`` — the memory planner for the full model at 1M tokens (as benchmarked, and with AdamW) and the
  longest step that fits this machine;
  then the goal table from the parts' JSON and the kernel benchmark's (``--kernels-json``) to ``summary.md`` (and
  ``summary.json``, ``goals.png``), printed last.

Scaling to 28 layers: step time ``t(L) = a(N) + L * b(N)``, where ``a`` (embedding, LM head, loss: work per token)
comes from the 2- and 4-layer steps at 64K and grows with N; peak = measured + the planner's difference between 28
layers and the measured count (weights, gradients and pages are per layer). At 64K both are checked against the
measured 28-layer step. Every OOMB row carries the planner's predicted peak (``planned_gib``) next to the measured
``torch.cuda.max_memory_allocated`` (``peak_gib``).

Time budget (``--budget-s``, from the start of ``main``): before each row its time is predicted from its FLOPs
and copies (``lightning_oomb.engine.step_time``, the planner's model) at rates calibrated on the rows measured so
far; a row that would not fit what is left is skipped with the reason. The smoke run: ``--tiny --device cpu``.

The summary fits the step rates of this device (matmul and attention FLOP/s, by least squares over the dense
OOMB rows without offload; host-device bytes/s from a timed pinned copy; host memory bytes/s of float32-host's adds
from a timed float32 += bf16 add) and writes them to ``summary.json``
(``step_rates``) with each row's planned step time at them next to its measured one: the entry for
``lightning_oomb.engine.planner.MEASURED_STEP_RATES``.

    PYTHONPATH=$PWD python3 benchmarks/goals.py --part compare --out-dir /tmp/goals
"""

from __future__ import annotations

import argparse
import dataclasses
import glob
import json
import math
import statistics
import sys
import time
import traceback
from dataclasses import dataclass
from pathlib import Path

import torch

from benchmarks.common import (
    GIB,
    HF,
    OOMB,
    Report,
    build_qwen2,
    command,
    engine_stats,
    free_device_memory,
    grad_probe,
    hbm_budget_for,
    make_step,
    measure,
    planned_peak_gib,
    pool_shape,
    reserve_pool,
    versions,
    write_json,
)
from lightning_oomb import plan
from lightning_oomb.engine import OOMBConfig
from lightning_oomb.engine.activation_bytes import parked_bytes
from lightning_oomb.engine.config import STRATEGY_DEFAULTS
from lightning_oomb.engine.model_shape import model_shape
from lightning_oomb.engine.planner import (
    NOMINAL_STEP_RATES,
    Machine,
    longest_fitting,
    reused_attention_bytes,
)
from lightning_oomb.engine.step_setup import precision_dtypes
from lightning_oomb.engine.step_time import StepRates, copy_bytes, host_sum_bytes, step_flops, step_time

GB = 1e9
PARTS = ("compare", "reduced", "summary")
# nominal rates that predict the first row; later rows use the ratio measured/nominal of the rows before them
# (compute only; copies overlap it, so a row takes the larger)
PIN_BYTES_PER_S = (
    4e9  # cudaHostRegister of a host tier (pages faulted in and locked), for the prediction only
)


def precision(device: torch.device) -> str:
    """bf16 on the GPU (what the goals are about); float32 on a CPU, where bf16 matmuls crawl (smoke runs)."""
    return "bf16-true" if device.type == "cuda" else "32-true"


def dtype(device: torch.device) -> torch.dtype:
    return torch.bfloat16 if device.type == "cuda" else torch.float32


@dataclass(frozen=True)
class Scale:
    """The shapes of a run: the full model's ``Qwen2Config`` fields, the reduced layer counts, context lengths by
    name, chunk / page / sparse budget, and the chunk of the 1M-token row."""

    model: dict
    reduced: tuple[int, int]
    lengths: dict
    chunk: int
    page: int
    budget: int
    long_chunk: int

    def config(self, layers: int | None = None):
        from transformers import Qwen2Config

        fields = dict(self.model)
        if layers is not None:
            fields["num_hidden_layers"] = layers
        return Qwen2Config(**fields)


K = 1024
FULL = dict(reduced=(2, 4), lengths={"32k": 32 * K, "64k": 64 * K, "128k": 128 * K, "256k": 256 * K, "1m": K * K},
            chunk=4096, page=128, budget=64, long_chunk=16 * K)  # fmt: skip
TINY = Scale(dict(hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
                  num_key_value_heads=2, vocab_size=256),
             (1, 2), {"32k": 128, "64k": 192, "128k": 256, "256k": 384, "1m": 768}, 64, 16, 2, 64)  # fmt: skip


def scale_of(tiny: bool) -> Scale:
    """The rows' scale: Qwen2.5-7B's shape at the goals' lengths, or :data:`TINY` (a check of the scripts)."""
    from lightning_oomb.models import QWEN2_5_7B

    return TINY if tiny else Scale({k: v for k, v in QWEN2_5_7B.items() if k != "model_type"}, **FULL)


@dataclass(frozen=True)
class Row:
    """One measurement: ``layers`` (``None``: the full model) at context ``length`` (a name of ``Scale.lengths``),
    ``warmup`` untimed then ``repeats`` timed steps; OOMB options: ``offload`` (every layer on the host unless
    ``device_layers`` of them stay in the HBM tier), ``sparse`` (``page_budget``), ``long_chunk``, ``mlp_tile``,
    ``grad_accumulation``, ``reuse`` (``reuse_attention``); ``defaults``: the options the strategies' defaults
    (``"auto"``) decide for this step on this machine (the others ignored)."""

    role: str
    layers: int | None
    length: str
    repeats: int = 1
    warmup: int = 0
    method: str = OOMB
    offload: bool = False
    sparse: bool = False
    long_chunk: bool = False
    device_layers: int | None = None
    mlp_tile: int | None = None
    grad_accumulation: str = "auto"
    reuse: bool = False
    defaults: bool = False


def compare_rows(repeats: int) -> list:
    return [
        Row("hf-32k", None, "32k", repeats, 1, method=HF),
        Row("oomb-32k", None, "32k", repeats, 1),
        Row("oomb-64k", None, "64k"),
        # what Trainer(strategy="oomb") runs: the options its defaults decide here
        Row("oomb-32k-defaults", None, "32k", repeats, 1, defaults=True),
        Row("oomb-32k-offload", None, "32k", repeats, 1, offload=True),  # the least GPU memory at 32K
        Row("oomb-32k-reuse", None, "32k", repeats, 1, reuse=True),  # one attention forward per chunk
    ]


def reduced_rows(scale: Scale) -> list:
    """In priority order (the budget cuts from the end); consecutive rows of one configuration share an engine: the
    64K fit (both layer counts: every scaled row needs it), then on the fewer layers the 128K pair (the overhead),
    the offloaded 256K step (peak, throughput, the slope's far end), 256K sparse and with the strategies' defaults
    (the two throughput goals), the 1M-token step (one HBM and one host layer; measured before, 49 s on the H200),
    64K sparse (against the 64K fit's dense step)."""
    small, large = scale.reduced
    sparse_host = dict(offload=True, sparse=True, long_chunk=True, device_layers=1)
    # the slope's steps sum gradients alike (auto: float32-host up to 16 chunks, float32 beyond on an H200)
    offloaded = dict(offload=True, grad_accumulation="float32")
    return [
        Row("warm-dense", large, "32k", 1, 1),
        Row("fit-64k", large, "64k", 2),
        Row("warm-dense", small, "32k", 1, 1),
        Row("fit-64k", small, "64k", 2),
        Row("128k-dense", small, "128k", 3),
        Row("warm-offload", small, "32k", 1, 1, **offloaded),
        Row("128k-offload", small, "128k", 3, **offloaded),
        Row("256k-offload", small, "256k", **offloaded),
        Row("warm-sparse", small, "32k", 1, 1, sparse=True),
        Row("256k-sparse", small, "256k", sparse=True),
        # the options the strategies' defaults decide for the full model at 256K here (no optimizer states)
        Row("256k-defaults", small, "256k", defaults=True),
        Row("1m-warm", 2, "32k", 1, 1, **sparse_host),
        Row("1m-sparse-host", 2, "1m", **sparse_host),
        Row("64k-sparse", small, "64k", 2, sparse=True),  # next to fit-64k on as many layers: sparse vs dense
        Row("256k-offload-reuse", small, "256k", offload=True, reuse=True),  # the forward's attention reused
        # next to 256k-offload: the gradient sums in host memory (its flush cost is an upper bound for the full
        # model's: the reduced model keeps the full embedding and head, a larger share of its parameters)
        Row("256k-offload-host", small, "256k", offload=True, grad_accumulation="float32-host"),
        Row(
            "256k-offload-tiled", small, "256k", offload=True, mlp_tile=1024
        ),  # next to 256k-offload: mlp_tile
    ]


def oomb_config(row: Row, scale: Scale, model, tokens: int) -> OOMBConfig:
    chunk = scale.long_chunk if row.long_chunk else scale.chunk
    if row.defaults:
        # as the strategies decide them here for the full model (the benchmark's step: no optimizer states)
        asked = OOMBConfig(chunk, scale.page, **STRATEGY_DEFAULTS)
        return plan(
            scale.config(), tokens, 1, asked, "bf16-true", None, Machine.local(), suggest=False
        ).config
    config = OOMBConfig(chunk, scale.page, layer_checkpointing=True,
                        page_budget=scale.budget if row.sparse else None, mlp_tile=row.mlp_tile,
                        grad_accumulation=row.grad_accumulation, reuse_attention=row.reuse)  # fmt: skip
    if not row.offload:
        return config
    budget = 0
    if row.device_layers:
        shape = pool_shape(model, config, tokens)
        budget = hbm_budget_for(row.device_layers, shape, config.staging_count(shape.block_bytes))
    return dataclasses.replace(config, offload=True, hbm_budget=budget)


# ------------------------------------------------------------------------------------------------- budget
class Clock:
    """The part's time budget and the row-time predictions (see the module docstring)."""

    def __init__(self, budget_s: float, device: torch.device):
        self.start, self.budget = time.monotonic(), budget_s
        self.cuda = device.type == "cuda"
        self.rates = NOMINAL_STEP_RATES["cuda" if self.cuda else "cpu"]
        self.ratios: list[float] = []

    def left(self) -> float:
        return self.budget - (time.monotonic() - self.start)

    def nominal_s(
        self, row: Row, scale: Scale, tokens: int, config: OOMBConfig | None
    ) -> tuple[float, float]:
        """(compute, copies) seconds of one step at the nominal rates."""
        host_layers = scale.config(row.layers).num_hidden_layers - (row.device_layers or 0)
        flops, copies, summed = row_work(scale, row.layers, tokens, config, host_layers, self.cuda)
        return step_time(*flops, 0.0, self.rates, summed), copies / self.rates.copy_bytes

    def predict(self, row: Row, scale: Scale, tokens: int, config, host_bytes: int) -> float:
        compute, copies = self.nominal_s(row, scale, tokens, config)
        ratio = statistics.median(self.ratios) if self.ratios else 1.0
        return (row.warmup + row.repeats) * max(compute * ratio, copies) + host_bytes / PIN_BYTES_PER_S

    def calibrate(self, row: Row, scale: Scale, tokens: int, config, seconds: float) -> None:
        compute, copies = self.nominal_s(row, scale, tokens, config)
        if compute > copies:
            self.ratios.append(seconds / compute)


def row_work(
    scale: Scale,
    layers: int | None,
    tokens: int,
    config: OOMBConfig | None,
    host_layers: int = 0,
    mirrored: bool = True,
) -> tuple[tuple[float, float], float, tuple[float, float]]:
    """``((matmul, attention) FLOPs, copied bytes, float32-host's flushed bytes)`` of one step on ``layers`` decoder
    layers (the planner's model, every parameter bf16 and trainable; ``config``: ``None`` for the reference,
    checkpointed as the benchmark runs it; ``mirrored``: float32-host's adds beside the compute, as on a GPU with
    host memory to spare for the mirror)."""
    shape = model_shape(scale.config(layers))
    reference = config is None
    config = config or OOMBConfig(scale.chunk, scale.page, layer_checkpointing=True)
    flops = step_flops(shape, tokens, config, reference=reference)
    chunks = math.ceil(tokens / config.chunk_size)
    summed = (
        host_sum_bytes(chunks, False, shape.parameter_count() - shape.vector_params(), mirrored)
        if not reference and config.grad_summing(chunks, False) == "float32-host"
        else (0.0, 0.0)
    )
    if reference:
        return flops, 0.0, summed
    dtypes = precision_dtypes("bf16-true")
    kv = 2 * shape.kv_heads * shape.head_dim * 2  # bf16 K and V per token (the GPU's dtype)
    grad = kv * (1 if config.kv_grad_dtype == "bfloat16" else 2)
    chunk = min(config.chunk_size, tokens)
    parks = config.offloads and config.layer_checkpointing is True
    parked = parked_bytes(shape, dtypes, chunk) if parks else 0
    reused = reused_attention_bytes(shape, dtypes, config, 1, tokens)
    host = host_layers if config.offloads else 0
    return flops, copy_bytes(tokens, config, host, kv, grad, parked, reused), summed


# ------------------------------------------------------------------------------------------------- parts
class Runner:
    """Runs rows on one model at a time, keeping one engine alive (consecutive rows of a configuration share it)."""

    def __init__(self, args, scale: Scale, device: torch.device, report: Report, clock: Clock):
        self.args, self.scale, self.device, self.report, self.clock = args, scale, device, report, clock
        self.model, self.layers = None, None
        self.step = self.engine = self.key = None
        self.reference: tuple | None = None  # (context, loss, grad probe) of the full model's HF row

    def use_model(self, layers: int | None) -> None:
        if self.model is not None and layers == self.layers:
            return
        self.drop_engine()
        self.model = None
        self.free()
        self.model = build_qwen2(self.device, dtype(self.device), self.scale.config(layers))
        self.layers = layers

    def drop_engine(self) -> None:
        if self.engine is not None:
            self.engine.release()
        self.step = self.engine = self.key = None

    def free(self) -> None:
        free_device_memory(self.device)

    def run(self, row: Row) -> dict:
        scale, device = self.scale, self.device
        tokens = scale.lengths[row.length]
        out = {"role": row.role, "method": row.method, "layers": row.layers or scale.model["num_hidden_layers"],
               "context": tokens, "warmup": row.warmup, "repeats": row.repeats}  # fmt: skip
        try:
            self.use_model(row.layers)
            config = None if row.method == HF else oomb_config(row, scale, self.model, tokens)
            host_bytes = 0
            if config is not None:
                out["config"] = dataclasses.asdict(config)
                if config.offloads:
                    shape = pool_shape(self.model, config, tokens)
                    host_layers = shape.num_layers - (row.device_layers or 0)
                    host_bytes = host_layers * shape.layer_bytes
            predicted = self.clock.predict(row, scale, tokens, config, host_bytes)
            out["predicted_s"] = predicted
            if predicted > self.clock.left():
                out["skipped"] = f"predicted {predicted:.0f} s > {self.clock.left():.0f} s left of the budget"
                return self.report.add(out)
            key = (row.method, config)
            if key != self.key:
                self.drop_engine()
                self.free()
                self.step, self.engine = make_step(self.model, row.method, config)
                self.key = key
            if self.engine is not None:
                out["planned_gib"] = planned_peak_gib(self.model, tokens, config, device, precision(device))
                reserve_pool(self.engine, self.model, tokens, device)
            gen = torch.Generator(device).manual_seed(tokens)  # one batch per length: the methods compare
            ids = torch.randint(0, self.model.config.vocab_size, (1, tokens), device=device, generator=gen)
            last = {}
            out.update(measure(lambda: last.update(loss=self.step(ids)), device, row.repeats, row.warmup))
            out["tokens_per_s"] = tokens / out["step_s"]
            self.agreement(row, out, float(last["loss"]))
            if self.engine is not None:
                out.update(engine_stats(self.engine))
            self.clock.calibrate(row, scale, tokens, config, out["step_s"])
        except torch.OutOfMemoryError as e:
            out["oom"] = str(e).splitlines()[0]
            self.drop_engine()
            self.free()
        except Exception as e:  # noqa: BLE001 - a failed row is recorded and the part goes on
            traceback.print_exc()
            out["error"] = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
            self.drop_engine()
            self.free()
        return self.report.add(out)

    def agreement(self, row: Row, out: dict, loss: float) -> None:
        """Record the step's loss; a full-model OOMB row after HF's on the same batch also records how far its loss
        and gradients (:func:`grad_probe`) are from HF's — a kernel bug on this GPU would show here."""
        out["loss"] = loss
        if row.layers is not None:
            return
        probe = grad_probe(self.model)
        if row.method == HF:
            self.reference = (out["context"], loss, probe)
        elif self.reference is not None and self.reference[0] == out["context"]:
            _, ref_loss, ref_probe = self.reference
            out["loss_vs_hf"] = abs(loss - ref_loss) / abs(ref_loss)
            out["grads_vs_hf"] = float((probe - ref_probe).norm() / ref_probe.norm())


def run_part(rows: list, args, scale: Scale, device: torch.device, report: Report, clock: Clock) -> int:
    runner = Runner(args, scale, device, report, clock)
    for row in rows:
        runner.run(row)
    runner.drop_engine()
    return int(any("error" in r for r in report.rows))


def fidelity(scale: Scale, device: torch.device, report: Report, clock: Clock) -> dict:
    """The gradient check against the truth rather than against HF: on the reduced model at 32K, the norms'
    gradients (:func:`grad_probe`) of a bf16 OOMB step and a bf16 HF step, each against the same weights' HF step in
    float32 — both carry bf16 rounding, so OOMB's error is judged by HF's (the 28-layer rows are only compared with
    each other: two bf16 computations apart)."""
    layers, tokens = scale.reduced[0], scale.lengths["32k"]
    out = {
        "role": "fidelity-32k",
        "method": "oomb and hf (bf16) vs float32",
        "layers": layers,
        "context": tokens,
    }
    need = 15.0 if device.type == "cuda" else 1.0  # on an H200: three 2-layer steps at 32K, two model builds
    if clock.left() < need:
        out["skipped"] = f"{need:.0f} s needed, {clock.left():.0f} s left of the budget"
        return report.add(out)
    try:
        out.update(gradient_errors(scale, device, layers, tokens))
    except Exception as e:  # noqa: BLE001 - recorded, the part goes on
        traceback.print_exc()
        out["error"] = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
    free_device_memory(device)
    return report.add(out)


def gradient_errors(scale: Scale, device: torch.device, layers: int, tokens: int) -> dict:
    """``oomb_error``, ``hf_error`` (relative, against float32) and how far apart the two are (:func:`fidelity`)."""
    model = build_qwen2(device, torch.bfloat16, scale.config(layers))
    gen = torch.Generator(device).manual_seed(tokens)
    ids = torch.randint(0, model.config.vocab_size, (1, tokens), device=device, generator=gen)
    probes = {}
    for method in (OOMB, HF):
        config = OOMBConfig(scale.chunk, scale.page, layer_checkpointing=True) if method == OOMB else None
        step, engine = make_step(model, method, config)
        step(ids)
        probes[method] = grad_probe(model)
        if engine is not None:
            engine.release()
    model.zero_grad(set_to_none=True)
    step, _ = make_step(model.float(), HF)  # the same weights, exactly, in float32
    step(ids)
    truth = grad_probe(model)
    oomb, hf = (float((probes[m] - truth).norm() / truth.norm()) for m in (OOMB, HF))
    return {
        "oomb_error": oomb,
        "hf_error": hf,
        "apart": float((probes[OOMB] - probes[HF]).norm() / probes[HF].norm()),
    }


# ------------------------------------------------------------------------------------------------ summary
def plan_rows(scale: Scale, device: torch.device) -> list[dict]:
    """The planner for the full model with offload (``hbm_budget="auto"``) on this machine: the 1M-token step as the
    benchmark runs it (no optimizer state), the longest such step that fits with float32 and with bfloat16 gradient
    pages, and the 1M-token step with AdamW."""
    machine = Machine.local(device)
    cfg = scale.config()
    base = OOMBConfig(scale.chunk, scale.page, layer_checkpointing=True, offload=True)

    def planned(tokens: int, config: OOMBConfig):
        return plan(cfg, tokens, 1, config, precision(device), None, machine, suggest=False)

    million = scale.lengths["1m"]
    p = planned(million, base)
    rows = [{"role": "plan-1m", "context": million, "fits": p.fits, "peak_device_gib": p.peak_device / GIB,
             "host_tier_gib": p.host_tier / GIB, "hbm_layers": p.hbm_layers, "host_layers": p.host_layers,
             "device_gib": machine.device_bytes / GIB, "host_gib": machine.host_bytes / GIB,
             "why_not": None if p.fits else p.refusal()}]  # fmt: skip
    for grads in ("float32", "bfloat16"):
        config = dataclasses.replace(base, kv_grad_dtype=grads)
        longest = longest_fitting(lambda n, c=config: planned(n, c).fits, scale.chunk, 64 * million)
        rows.append({"role": "plan-longest", "kv_grad_dtype": grads, "context": longest})
    # a training step of it: AdamW's states and step on the device too (hbm_budget="auto" leaves a quarter of the
    # device, which may not hold them): the planner's first option that keeps 1M tokens on one GPU
    p = plan(cfg, million, 1, base, precision(device), "adamw", machine, suggest=True)
    option = next((o for o in p.options or [] if not {"seq_len", "devices"} & set(o.changes)), None)
    rows.append({"role": "plan-1m-adamw", "context": million, "fits": p.fits, "peak_device_gib": p.peak_device / GIB,
                 "host_tier_gib": p.host_tier / GIB, "option": None if option is None else option.text,
                 "option_peak_device_gib": None if option is None else option.peak_device / GIB,
                 "option_host_tier_gib": None if option is None else option.host_tier / GIB})  # fmt: skip
    return rows


def load_rows(out_dir: Path, part: str) -> list[dict]:
    path = out_dir / f"goals-{part}.json"
    return json.loads(path.read_text())["rows"] if path.exists() else []


def ok(rows: list[dict], role: str, layers: int | None = None) -> dict | None:
    """The measured row of ``role`` (and ``layers``), if it ran."""
    for r in rows:
        if r["role"] == role and "step_s" in r and (layers is None or r["layers"] == layers):
            return r
    return None


class Scaling:
    """28-layer step time and peak from a reduced row (see the module docstring)."""

    def __init__(self, scale: Scale, rows: list[dict], device: torch.device):
        self.scale, self.device = scale, device
        self.full = scale.model["num_hidden_layers"]
        small, large = (ok(rows, "fit-64k", n) for n in scale.reduced)
        self.a_per_token = None
        if small and large:
            (l0, t0), (l1, t1) = ((r["layers"], r["step_s"]) for r in (small, large))
            b = (t1 - t0) / (l1 - l0)
            self.a_per_token = max(t0 - l0 * b, 0.0) / small["context"]

    def time(self, row: dict) -> float | None:
        if self.a_per_token is None:
            return None
        a = self.a_per_token * row["context"]
        return a + self.full * (row["step_s"] - a) / row["layers"]

    def peak(self, row: dict) -> tuple[float | None, float | None]:
        """(measured peak + the planner's difference to the full model, the planner's full-model peak), GiB."""
        if row.get("peak_gib") is None or "config" not in row:
            return None, None
        config = OOMBConfig(**row["config"])
        if config.offloads and config.hbm_budget:
            return None, None  # an explicit HBM tier is sized for the reduced model
        tokens, flag = row["context"], precision(self.device)
        full = planned_peak_gib(self.scale.config(), tokens, config, self.device, flag)
        reduced = planned_peak_gib(self.scale.config(row["layers"]), tokens, config, self.device, flag)
        if full is None or reduced is None:
            return None, full
        return row["peak_gib"] + full - reduced, full

    def grad_sums_gib(self, row: dict) -> float | None:
        """The planner's float32 gradient sums (GiB) of the full model in ``row``'s step (0 under ``native``)."""
        if "config" not in row:
            return None
        config = OOMBConfig(**row["config"])
        native = dataclasses.replace(config, grad_accumulation="native")
        summed, plain = (planned_peak_gib(self.scale.config(), row["context"], c, self.device, precision(self.device))
                         for c in (config, native))  # fmt: skip
        return None if summed is None or plain is None else summed - plain


def quadratic_time(n0: int, t0: float, n1: int, t1: float, n: int) -> float:
    """``t(n)`` of ``t = a N + b N^2`` through ``(n0, t0)`` and ``(n1, t1)`` (per-token work + attention's)."""
    b = (t1 / n1 - t0 / n0) / (n1 - n0)
    a = t0 / n0 - b * n0
    return a * n + b * n * n


def offload_slope(rows: list[dict], scaling: Scaling) -> dict | None:
    """GPU memory growth (MB per 10K tokens) between the shortest and the longest measured step with every layer
    offloaded, of one configuration and layer count (the one measured at the most lengths: rows with other options,
    e.g. another ``grad_accumulation``, are not compared): as measured, and scaled to the full model (each peak + the
    planner's difference, as for the 256K peak); ``None`` with fewer than two such lengths."""
    found = [r for r in rows if "step_s" in r and r.get("peak_gib") is not None and r.get("config", {}).get("offload")
             and not r["config"].get("hbm_budget") and not r["config"].get("page_budget")]  # fmt: skip
    if not found:
        return None
    groups: dict = {}
    for r in found:
        groups.setdefault((r["layers"], json.dumps(r["config"], sort_keys=True)), []).append(r)

    def lengths(group: list[dict]) -> tuple[int, int]:
        return len({r["context"] for r in group}), max(r["context"] for r in group)

    found = sorted(max(groups.values(), key=lengths), key=lambda r: r["context"])
    layers = found[0]["layers"]
    if len(found) < 2 or found[0]["context"] == found[-1]["context"]:
        return None
    first, last = found[0], found[-1]
    per_10k = GIB / 1e6 / ((last["context"] - first["context"]) / 1e4)
    (p0, f0), (p1, f1) = scaling.peak(first), scaling.peak(last)
    measured = (last["peak_gib"] - first["peak_gib"]) * per_10k
    scaled = None if p0 is None or p1 is None else (p1 - p0) * per_10k
    return {"value": measured if scaled is None else scaled, "measured": measured, "scaled": scaled is not None,
            "planned": None if f0 is None or f1 is None else (f1 - f0) * per_10k, "layers": layers,
            "contexts": ", ".join(tokens(r["context"]) for r in found)}  # fmt: skip


def kernel_goals(path: Path | None) -> dict:
    """From the kernel benchmark's JSON: the worst ratio (over key lengths) of paged fwd+bwd TFLOP/s to compiled
    FlexAttention's, and of the sparse kernels' and the merged key blocks' (offload's path) to the dense ones' (per
    attended key)."""
    if path is None or not path.exists():
        return {}
    data = json.loads(path.read_text())
    out = {}
    for name in ("oomb_over_flex", "sparse_over_dense", "merged_over_dense"):
        values = [v for v in data.get(name, {}).values() if v is not None]
        if values:
            out[name] = min(values)
            out[name + "_by_keys"] = data[name]
    out["tuning_s"] = data.get("tuning_s")
    return out


def tokens(n: int) -> str:
    return f"{n // (K * K)}M" if n >= K * K and n % (K * K) == 0 else f"{n // K}K" if n % K == 0 else str(n)


def fmt(x: float | None, spec: str = ".2f", unit: str = "") -> str:
    return "n/a" if x is None else f"{x:{spec}}{unit}"


def verdict(value: float | None, good: bool, predicted: bool = False) -> str:
    if value is None:
        return "n/a"
    return ("yes" if good else "no") + (" (predicted)" if predicted else "")


def goal_table(scale: Scale, rows: list[dict], kernels: dict, plans: list[dict], device) -> list[dict]:
    """``{"goal", "target", "measured", "met", "how"}`` for every goal of docs/design.md section 4."""
    scaling = Scaling(scale, rows, device)
    full = scale.model["num_hidden_layers"]
    goals = []

    def add(goal, target, value, good, measured, how, predicted=False):
        goals.append({"goal": goal, "target": target, "value": value, "measured": measured,
                      "met": verdict(value, bool(good), predicted), "how": how})  # fmt: skip

    hf, oomb = ok(rows, "hf-32k"), ok(rows, "oomb-32k")
    if hf and oomb:
        t = oomb["step_s"] / hf["step_s"]
        add("32K step time vs HF + SDPA + checkpointing", "<= 1.2x", t, t <= 1.2,
            f"{t:.2f}x ({oomb['step_s']:.2f} s vs {hf['step_s']:.2f} s; min {oomb['min_s']:.2f} vs {hf['min_s']:.2f})",
            f"{full} layers, median of {oomb['repeats']} steps after a warm-up")  # fmt: skip
        if hf.get("peak_gib") and oomb.get("peak_gib"):
            m = oomb["peak_gib"] / hf["peak_gib"]
            add("32K peak vs HF's", "<= 50 %", m, m <= 0.5,
                f"{100 * m:.0f} % ({oomb['peak_gib']:.1f} vs {hf['peak_gib']:.1f} GiB; planned "
                f"{fmt(oomb.get('planned_gib'), '.1f')})",
                "torch.cuda.max_memory_allocated; both steps start without gradients (Lightning's zero_grad)")  # fmt: skip
        if oomb.get("loss_vs_hf") is not None:
            add("check: OOMB's loss = HF's at 32K", "loss <= 1 % apart", oomb["loss_vs_hf"],
                oomb["loss_vs_hf"] <= 0.01, f"loss {oomb['loss_vs_hf']:.1e}, the norms' gradients "
                f"{fmt(oomb.get('grads_vs_hf'), '.1e')} apart (relative)",
                "the same batch and weights; two bf16 computations of the gradients are apart by both one's "
                "rounding: the check against float32 is the next row")  # fmt: skip
        defaults = ok(rows, "oomb-32k-defaults")
        if defaults:
            t = defaults["step_s"] / hf["step_s"]
            share = ""
            if hf.get("peak_gib") and defaults.get("peak_gib"):
                share = f", {100 * defaults['peak_gib'] / hf['peak_gib']:.0f} % of HF's"
            decided = ", ".join(f"{k}={defaults['config'][k]!r}" for k in STRATEGY_DEFAULTS)
            add("32K step time vs HF, the strategies' defaults", "<= 1.2x", t, t <= 1.2,
                f"{t:.2f}x ({defaults['step_s']:.2f} s; peak {fmt(defaults.get('peak_gib'), '.1f')} GiB{share})",
                f"{full} layers; decided here: {decided}")  # fmt: skip
        reuse = ok(rows, "oomb-32k-reuse")
        if reuse:
            t = reuse["step_s"] / hf["step_s"]
            add("32K step time vs HF, reuse_attention", "<= 1.2x", t, t <= 1.2,
                f"{t:.2f}x ({reuse['step_s']:.2f} s; peak {fmt(reuse.get('peak_gib'), '.1f')} GiB)",
                f"{full} layers; the forward sweep's attention results reused by the backward")  # fmt: skip
        offloaded = ok(rows, "oomb-32k-offload")
        if offloaded and hf.get("peak_gib") and offloaded.get("peak_gib"):
            t, m = offloaded["step_s"] / hf["step_s"], offloaded["peak_gib"] / hf["peak_gib"]
            add("32K peak vs HF's, every layer offloaded", "<= 50 % (time <= 1.2x)", m, m <= 0.5 and t <= 1.2,
                f"{100 * m:.0f} % ({offloaded['peak_gib']:.1f} GiB), {t:.2f}x HF's step time",
                f"{full} layers; the pages in pinned host memory")  # fmt: skip
        first = (oomb.get("warmup_s") or 0) - oomb["step_s"]
        add("first step: no minutes of autotuning", "< 60 s extra", first, first < 60,
            f"{first:.1f} s over a warm step (compilation at default tiles); kernel benchmark tuning "
            f"{fmt(kernels.get('tuning_s'), '.0f', ' s')}",
            "OOMB_TRITON_AUTOTUNE=0; run_gpu.sh gives the steps a cold Triton cache")  # fmt: skip
    check = next((r for r in rows if r["role"] == "fidelity-32k" and r.get("hf_error")), None)
    if check:
        ratio = check["oomb_error"] / check["hf_error"]
        add("check: OOMB's gradient error vs HF's (bf16, against float32)", "<= 1.25x", ratio, ratio <= 1.25,
            f"{ratio:.2f}x (OOMB {check['oomb_error']:.1e}, HF {check['hf_error']:.1e}; "
            f"{check['apart']:.1e} apart)",
            f"{check['layers']} layers at {tokens(check['context'])}: the norms' gradients against the same "
            "weights' float32 step")  # fmt: skip

    dense = ok(rows, "256k-offload")
    if dense:
        peak, planned = scaling.peak(dense)
        value = None if peak is None else peak * GIB / GB
        add(
            "peak GPU memory at 256K (dense, offload)",
            "<= 33 GB",
            value,
            value is not None and value <= 33,
            f"{fmt(value, '.1f', ' GB')} ({fmt(peak, '.1f')} GiB; planner {fmt(planned, '.1f')} GiB)",
            f"{dense['layers']} layers measured {fmt(dense.get('peak_gib'), '.1f')} GiB + the planner's other layers",
        )
        sums = scaling.grad_sums_gib(dense)  # the goal's bf16 gradients: the default float32 sums less
        native = None if peak is None or sums is None else (peak - sums) * GIB / GB
        add(
            "peak at 256K with grad_accumulation: native",
            "<= 33 GB",
            native,
            native is not None and native <= 33,
            f"{fmt(native, '.1f', ' GB')} (the row above less the planner's float32 gradient sums, "
            f"{fmt(sums, '.1f', ' GiB')})",
            "bf16 .grad summed chunk by chunk (error grows with the chunks: bf16_grad_fidelity.py)",
        )
        t = scaling.time(dense)
        tps = None if t is None else dense["context"] / t
        add(
            "dense throughput at 256K",
            ">= 1,500 tokens/s",
            tps,
            tps is not None and tps >= 1500,
            f"{fmt(tps, ',.0f', ' tokens/s')} ({fmt(t, '.1f', ' s')} per step)",
            f"{dense['layers']} layers {dense['step_s']:.1f} s scaled to {full}; every layer offloaded",
        )
        mid = ok(rows, "128k-offload")
        t_mid = None if mid is None else scaling.time(mid)
        million = scaling.scale.lengths["1m"]
        t_1m = (
            None
            if t is None or t_mid is None
            else quadratic_time(mid["context"], t_mid, dense["context"], t, million)
        )
        add(
            "dense 1M-token step (extrapolated)",
            "<= 2,500 s",
            t_1m,
            t_1m is not None and t_1m <= 2500,
            f"{fmt(t_1m, ',.0f', ' s')} (t = aN + bN^2 through the 128K and 256K offloaded steps, scaled to {full})",
            "a prediction from measured steps, not a measured 1M step",
        )
    reused = ok(rows, "256k-offload-reuse")
    if dense and reused:
        t = scaling.time(reused)
        tps = None if t is None else reused["context"] / t
        add("dense throughput at 256K, reuse_attention", ">= 1,500 tokens/s", tps, tps is not None and tps >= 1500,
            f"{fmt(tps, ',.0f', ' tokens/s')} ({fmt(t, '.1f', ' s')} per step; host "
            f"{fmt(reused.get('reused_attention_gib'), '.1f', ' GiB')} of results)",
            f"{reused['layers']} layers {reused['step_s']:.1f} s scaled to {full}; every layer offloaded")  # fmt: skip
    defaults = ok(rows, "256k-defaults")
    if defaults:
        t = scaling.time(defaults)
        tps = None if t is None else defaults["context"] / t
        decided = ", ".join(f"{k}={defaults['config'][k]!r}" for k in STRATEGY_DEFAULTS)
        add("dense throughput at 256K, the strategies' defaults", ">= 1,500 tokens/s", tps,
            tps is not None and tps >= 1500, f"{fmt(tps, ',.0f', ' tokens/s')} ({fmt(t, '.1f', ' s')} per step)",
            f"{defaults['layers']} layers {defaults['step_s']:.1f} s scaled to {full}; decided for {full}: "
            f"{decided}")  # fmt: skip
    hosted = ok(rows, "256k-offload-host")
    if dense and hosted:
        (host_peak, planned), t, t_host = scaling.peak(hosted), scaling.time(dense), scaling.time(hosted)
        value = None if host_peak is None else host_peak * GIB / GB
        cost = None if t is None or t_host is None else t_host / t - 1
        add("peak at 256K with grad_accumulation: float32-host", "<= 33 GB", value, value is not None and value <= 33,
            f"{fmt(value, '.1f', ' GB')} ({fmt(host_peak, '.1f')} GiB; planner {fmt(planned, '.1f')} GiB); step time "
            f"{fmt(cost and 100 * cost, '+.1f')} % (an upper bound: {hosted['layers']} layers)",
            "float32 sums of the matrices in host memory, flat error (bf16_grad_fidelity.py)")  # fmt: skip
    tiled = ok(rows, "256k-offload-tiled")
    if dense and tiled:
        (peak, _), (tiled_peak, _) = scaling.peak(dense), scaling.peak(tiled)
        t, t_tiled = scaling.time(dense), scaling.time(tiled)
        saved = None if peak is None or tiled_peak is None else peak - tiled_peak
        cost = None if t is None or t_tiled is None else t_tiled / t - 1
        add("check: mlp_tile=1024 at 256K (offload)", "less memory", saved, saved is not None and saved > 0,
            f"peak {fmt(tiled_peak, '.1f')} vs {fmt(peak, '.1f')} GiB, step time {fmt(cost and 100 * cost, '+.1f')} %",
            f"{tiled['layers']} layers scaled to {full}, next to the untiled 256K row")  # fmt: skip
    sparse = ok(rows, "256k-sparse")
    if sparse:
        t = scaling.time(sparse)
        tps = None if t is None else sparse["context"] / t
        add("sparse (chunk 4096 + 64 pages) at 256K", ">= 4,000 tokens/s", tps, tps is not None and tps >= 4000,
            f"{fmt(tps, ',.0f', ' tokens/s')} ({fmt(t, '.1f', ' s')} per step; attended "
            f"{fmt(sparse.get('attended_fraction'), '.1%')}; peak {fmt(sparse.get('peak_gib'), '.1f')} GiB)",
            f"{sparse['layers']} layers {sparse['step_s']:.1f} s scaled to {full}")  # fmt: skip

    sparse64 = ok(rows, "64k-sparse")
    dense64 = [
        r for r in rows if r.get("role") == "fit-64k" and sparse64 and r.get("layers") == sparse64["layers"]
    ]
    if sparse64 and dense64 and dense64[0].get("step_s"):
        x = dense64[0]["step_s"] / sparse64["step_s"]
        add("check: sparse vs dense at 64K", "faster", x, x > 1,
            f"{x:.2f}x ({sparse64['step_s']:.2f} s vs {dense64[0]['step_s']:.2f} s; attended "
            f"{fmt(sparse64.get('attended_fraction'), '.1%')})", f"{sparse64['layers']} layers, same run")  # fmt: skip

    slope = offload_slope(rows, scaling)
    if slope is not None:
        add("GPU memory growth with offload", "<= 5 MB per 10K tokens", slope["value"], slope["value"] <= 5,
            f"{slope['value']:.2f} MB per 10K tokens ({slope['layers']} layers measured: {slope['measured']:.2f}; "
            f"planner for {full} layers: {fmt(slope['planned'])})",
            f"peaks at {slope['contexts']}, every layer offloaded; + the planner's difference to {full} layers"
            if slope["scaled"] else f"peaks at {slope['contexts']}, as measured")  # fmt: skip
    base, off = ok(rows, "128k-dense"), ok(rows, "128k-offload")
    if base and off:
        measured = off["step_s"] / base["step_s"] - 1
        t = scaling.time(base)
        value = measured if t is None else full * (off["step_s"] - base["step_s"]) / base["layers"] / t
        add("offload overhead at 128K", "<= 3 %", value, value <= 0.03,
            f"{100 * value:.1f} % ({base['layers']} layers: {100 * measured:.1f} %, medians "
            f"{off['step_s']:.2f} vs {base['step_s']:.2f} s; mins {off['min_s']:.2f} vs {base['min_s']:.2f})",
            f"per-layer difference scaled to {full} layers" if t is not None else "as measured")  # fmt: skip

    for key, goal, target, bound in (
        ("sparse_over_dense", "sparse kernels per attended key vs dense", ">= 0.8x", 0.8),
        ("oomb_over_flex", "paged attention fwd+bwd vs compiled FlexAttention", ">= 0.9x", 0.9),
        # offload's compute overhead: its keys come in blocks of a chunk, one kernel call each, merged
        ("merged_over_dense", "check: offload's merged key blocks vs one call", ">= 0.97x", 0.97),
    ):
        if key in kernels:
            by_keys = ", ".join(
                f"{tokens(int(k))} keys {fmt(v)}x" for k, v in kernels[key + "_by_keys"].items()
            )
            add(
                goal,
                target,
                kernels[key],
                kernels[key] >= bound,
                f"{kernels[key]:.2f}x (worst; {by_keys})",
                "benchmarks/attention_kernels.py, 4096 queries",
            )

    plan_1m = next((p for p in plans if p["role"] == "plan-1m"), None)
    measured_1m = ok(rows, "1m-sparse-host")
    if plan_1m:
        ran = (f"; measured {measured_1m['layers']} layers ({measured_1m['hbm_layers']} in HBM, host tier "
               f"{measured_1m['pool_host_gib']:.1f} GiB): {measured_1m['step_s']:.1f} s, peak "
               f"{fmt(measured_1m.get('peak_gib'), '.1f')} GiB (planned {fmt(measured_1m.get('planned_gib'), '.1f')})"
               if measured_1m else "; no measured 1M step")  # fmt: skip
        how = (f"planner, full model, {plan_1m['hbm_layers']} HBM + {plan_1m['host_layers']} host layers, "
               f"device peak {plan_1m['peak_device_gib']:.1f} GiB, host tier {plan_1m['host_tier_gib']:.1f} of "
               f"{plan_1m['host_gib']:.0f} GiB")  # fmt: skip
        add(
            "1M tokens in one step with the host's memory",
            "fits",
            1.0 if plan_1m["fits"] else 0.0,
            plan_1m["fits"],
            ("fits" if plan_1m["fits"] else plan_1m["why_not"]) + ran,
            how,
            predicted=True,
        )
    adamw = next((p for p in plans if p["role"] == "plan-1m-adamw"), None)
    if adamw:
        fits = adamw["fits"] or adamw["option"] is not None
        how = (
            "as is"
            if adamw["fits"]
            else f"with {adamw['option']}: device peak "
            f"{fmt(adamw['option_peak_device_gib'], '.1f')} GiB, host tier {fmt(adamw['option_host_tier_gib'], '.1f')} GiB"
        )
        add("1M tokens in one training step with AdamW (one GPU)", "fits", 1.0 if fits else 0.0, fits,
            ("fits " if fits else "does not fit; planner: ") + how, "planner, full model, bf16-true, AdamW",
            predicted=True)  # fmt: skip
    for p in plans:
        if p["role"] == "plan-longest":
            n = p["context"]
            add(
                f"longest step ({p['kv_grad_dtype']} gradient pages)",
                ">= 1.5M tokens",
                n,
                n >= 1.5 * K * K,
                f"{n / (K * K):.2f}M tokens",
                "planner, full model, offload, hbm_budget auto",
                predicted=True,
            )

    full64 = ok(rows, "oomb-64k")
    if full64:
        large = ok(rows, "fit-64k", scale.reduced[1])
        t = None if large is None else scaling.time(large)
        if t is not None:
            e = t / full64["step_s"] - 1
            add("check: layer scaling of step time at 64K", "within 10 %", e, abs(e) <= 0.1,
                f"{t:.2f} s scaled vs {full64['step_s']:.2f} s measured ({100 * e:+.1f} %)",
                f"fit of {scale.reduced} layers")  # fmt: skip
        peak = None if large is None else scaling.peak(large)[0]
        if peak is not None and full64.get("peak_gib"):
            e = peak / full64["peak_gib"] - 1
            add("check: layer scaling of peak at 64K", "within 5 %", e, abs(e) <= 0.05,
                f"{peak:.1f} GiB scaled vs {full64['peak_gib']:.1f} GiB measured ({100 * e:+.1f} %)",
                f"planned {fmt(full64.get('planned_gib'), '.1f')} GiB")  # fmt: skip
    return goals


def rows_table(rows: list[dict]) -> list[str]:
    lines = ["| row | layers | context | step s (median / min) | tokens/s | peak GiB | planned GiB | note |",
             "|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for r in rows:
        note = r.get("skipped") or r.get("error") or r.get("oom") or ""
        step = f"{r['step_s']:.2f} / {r['min_s']:.2f}" if "step_s" in r else ""
        lines.append(
            f"| {r['role']} | {r['layers']} | {tokens(r['context'])} | {step} | {fmt(r.get('tokens_per_s'), ',.0f')} "
            f"| {fmt(r.get('peak_gib'), '.1f')} | {fmt(r.get('planned_gib'), '.1f')} | {note} |"
        )
    return lines


def plot(goals: list[dict], path: Path) -> None:
    """Measured / target per numeric goal (1 = the target; which side is good is in the bar's colour)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    shown = [g for g in goals if g["value"] is not None and g["target"][:2] in ("<=", ">=")]
    if not shown:
        return
    fig, ax = plt.subplots(figsize=(9, 0.4 * len(shown) + 1))
    for i, g in enumerate(shown):
        target = float(g["target"].split()[1].replace(",", "").rstrip("x%").replace("M", "e6"))
        value = g["value"] * (100 if "%" in g["target"] else 1)
        value = value / (K * K) * 1e6 if "M tokens" in g["target"] else value
        ax.barh(i, value / target, color="tab:green" if g["met"].startswith("yes") else "tab:red")
    ax.axvline(1, color="k", lw=1)
    ax.set_yticks(range(len(shown)), [f"{g['goal']} ({g['target']})" for g in shown], fontsize=7)
    ax.set_xlabel("measured / target")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def fit_rates(scale: Scale, rows: list[dict], device: torch.device) -> dict | None:
    """This device's step rates (the module docstring) and every measured OOMB row's planned time at them next to
    its measured one; ``None`` without two dense rows to fit."""
    measured = [r for r in rows if r.get("method") == OOMB and "step_s" in r and "config" in r]
    work = [row_work(scale, r["layers"], r["context"], OOMBConfig(**r["config"]), r.get("host_layers") or 0,
                     device.type == "cuda") for r in measured]  # fmt: skip
    dense = [
        i for i, r in enumerate(measured) if not r["config"]["offload"] and r["config"]["page_budget"] is None
    ]
    if len(dense) < 2:
        return None
    flops = torch.tensor([work[i][0] for i in dense], dtype=torch.float64)
    seconds = torch.tensor([[measured[i]["step_s"]] for i in dense], dtype=torch.float64)
    inverse = torch.linalg.lstsq(flops, seconds).solution.flatten().tolist()  # seconds per FLOP
    fit = "matmul and attention rates, least squares"
    # the rows cannot tell matmuls from attention: one factor on the nominal rates' ratio
    if min(inverse) <= 0:
        nominal = NOMINAL_STEP_RATES[device.type if device.type == "cuda" else "cpu"]
        unit = flops @ torch.tensor(
            [1 / nominal.dense_flops, 1 / nominal.attention_flops], dtype=torch.float64
        )
        factor = float((unit @ seconds.flatten()) / (unit @ unit))
        inverse = [factor / nominal.dense_flops, factor / nominal.attention_flops]
        fit = "one factor on the nominal rates"
    rates = StepRates(1 / inverse[0], 1 / inverse[1], copy_rate(device), host_add_rate(device))
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    planned = [{"role": r["role"], "layers": r["layers"], "context": r["context"], "measured_s": r["step_s"],
                "planned_s": step_time(*row_flops, row_copies, rates, row_summed)}
               for r, (row_flops, row_copies, row_summed) in zip(measured, work)]  # fmt: skip
    copies = "a timed pinned copy and host add" if device.type == "cuda" else "nominal"
    return {"device": name, **dataclasses.asdict(rates), "fit": fit, "copies": copies, "fitted_rows": len(dense),
            "rows": planned,
            "entry": f"MEASURED_STEP_RATES[{name!r}] = StepRates({rates.dense_flops:.3g}, "
                     f"{rates.attention_flops:.3g}, {rates.copy_bytes:.3g}, {rates.host_bytes:.3g})"}  # fmt: skip


def rates_table(rates: dict | None) -> list[str]:
    if rates is None:
        return ["not fitted: fewer than two dense OOMB rows without offload"]
    lines = [f"`{rates['entry']}` ({rates['fit']}, {rates['fitted_rows']} rows; copies: {rates['copies']})", "",
             "| row | layers | tokens | measured s | planned s |", "|---|---|---|---|---|"]  # fmt: skip
    lines += [f"| {r['role']} | {r['layers']} | {r['context']:,} | {r['measured_s']:.2f} | {r['planned_s']:.2f} |"
              for r in rates["rows"]]  # fmt: skip
    return lines


def copy_rate(device: torch.device, size: int = 1 << 30, repeats: int = 3) -> float:
    """Host-device bytes/s each way: a pinned buffer copied to the device and back (nominal off CUDA)."""
    if device.type != "cuda":
        return NOMINAL_STEP_RATES["cpu"].copy_bytes
    host = torch.empty(size, dtype=torch.uint8, pin_memory=True)
    on_device = torch.empty_like(host, device=device)
    on_device.copy_(host)
    torch.cuda.synchronize(device)
    start = time.perf_counter()
    for _ in range(repeats):
        on_device.copy_(host, non_blocking=True)
        host.copy_(on_device, non_blocking=True)
    torch.cuda.synchronize(device)
    return 2 * repeats * size / (time.perf_counter() - start)


def host_add_rate(device: torch.device, elements: int = 1 << 28, repeats: int = 3) -> float:
    """Host memory bytes/s of ``float32-host``'s add (a float32 sum += a pinned bf16 window: 10 bytes an element);
    nominal off CUDA (a CPU run has no host sums to time against a GPU's)."""
    if device.type != "cuda":
        return NOMINAL_STEP_RATES["cpu"].host_bytes
    total = torch.zeros(elements, dtype=torch.float32)
    window = torch.ones(elements, dtype=torch.bfloat16, pin_memory=True)
    total.add_(window)
    start = time.perf_counter()
    for _ in range(repeats):
        total.add_(window)
    return 10 * repeats * elements / (time.perf_counter() - start)


def summary(args, scale: Scale, device: torch.device) -> int:
    plans = plan_rows(scale, device)
    for p in plans:
        print(json.dumps(p), flush=True)
    rows = load_rows(args.out_dir, "compare") + load_rows(args.out_dir, "reduced")
    kernels_json = args.kernels_json
    if kernels_json is None:
        found = sorted(glob.glob(str(args.out_dir / "kernels-*.json")))
        kernels_json = Path(found[0]) if found else None
    kernels = kernel_goals(kernels_json)
    goals = goal_table(scale, rows, kernels, plans, device)
    lines = ["| goal | target | measured | met? | how |", "|---|---|---|---|---|"]
    lines += [f"| {g['goal']} | {g['target']} | {g['measured']} | {g['met']} | {g['how']} |" for g in goals]
    rates = fit_rates(scale, rows, device)
    text = "\n".join(
        ["## Goals (docs/design.md section 4)", "", *lines, "", "## Rows", "", *rows_table(rows), "",
         "## Step rates (the planner's step time)", "", *rates_table(rates)]
    )  # fmt: skip
    (args.out_dir / "summary.md").write_text(text + "\n")
    data = {"command": command(), "versions": versions(), "goals": goals, "plans": plans, "kernels": kernels,
            "step_rates": rates}  # fmt: skip
    write_json(args.out_dir / "summary.json", data)
    plot(goals, args.out_dir / "goals.png")
    print(text, flush=True)
    return 0


# --------------------------------------------------------------------------------------------------- main
def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--part", choices=PARTS, required=True)
    parser.add_argument("--out-dir", type=Path, default=Path("benchmarks/results"))
    parser.add_argument(
        "--budget-s", type=float, default=600.0, help="seconds this part may take (from main)"
    )
    parser.add_argument("--repeats", type=int, default=3, help="timed steps of each method at 32K")
    parser.add_argument(
        "--kernels-json", type=Path, default=None, help="summary: attention_kernels.py's JSON"
    )
    parser.add_argument("--device", default="cuda")
    parser.add_argument(
        "--tiny", action="store_true", help="tiny shapes (smoke test of the script, e.g. on CPU)"
    )
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    device = torch.device(args.device)
    threads = torch.get_num_threads()
    if device.type == "cpu":
        torch.set_num_threads(1)  # tiny smoke shapes: steadier on a busy machine
    try:
        return run(args, device)
    finally:
        torch.set_num_threads(threads)


def run(args: argparse.Namespace, device: torch.device) -> int:
    scale = scale_of(args.tiny)
    if args.part == "summary":
        return summary(args, scale, device)
    clock = Clock(args.budget_s, device)
    report = Report(args.out_dir / f"goals-{args.part}.json", part=args.part, scale=dataclasses.asdict(scale),
                    budget_s=args.budget_s)  # fmt: skip
    rows = compare_rows(args.repeats) if args.part == "compare" else reduced_rows(scale)
    failed = args.part == "reduced" and "error" in fidelity(scale, device, report, clock)  # cheap: first
    status = run_part(rows, args, scale, device, report, clock) or int(failed)
    print(f"{args.part}: {sum('step_s' in r for r in report.rows)} of {len(rows)} rows measured in "
          f"{time.monotonic() - clock.start:.0f} s (budget {args.budget_s:.0f} s)", flush=True)  # fmt: skip
    return status


if __name__ == "__main__":
    sys.exit(main())
