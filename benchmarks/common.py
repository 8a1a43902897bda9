"""What the benchmark scripts share: building models from config classes, one training step per method, timing
steps with their peak memory, the planner's prediction, a FLOP count, writing rows as they are measured. Baselines
that the tests also use (the dense attention oracle, paged layouts) come from ``tests/helpers`` (run the scripts from
the repository root with ``PYTHONPATH=$PWD``)."""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import platform
import statistics
import subprocess
import sys
import time
import types
from collections.abc import Callable
from pathlib import Path

import torch

GIB = 2**30
HF, OOMB = "hf", "oomb"


def build_qwen2(device: torch.device, dtype: torch.dtype, config) -> torch.nn.Module:
    """A randomly initialised ``Qwen2ForCausalLM`` (SDPA attention, train mode) built directly on ``device`` in
    ``dtype`` from a ``Qwen2Config`` or the keyword arguments of one."""
    from transformers import Qwen2Config

    return build_causal_lm(
        config if isinstance(config, Qwen2Config) else Qwen2Config(**config), device, dtype
    )


def build_causal_lm(config, device: torch.device, dtype: torch.dtype) -> torch.nn.Module:
    """A randomly initialised causal LM of a transformers ``config`` (SDPA attention, train mode) built directly on
    ``device`` in ``dtype``."""
    from transformers import AutoModelForCausalLM

    config._attn_implementation = "sdpa"
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with device:
            model = AutoModelForCausalLM.from_config(config)
    finally:
        torch.set_default_dtype(previous)
    return model.train()


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def free_device_memory(device: torch.device) -> None:
    """Return dropped rows' device memory before the next row: collect cycles, then empty the cached blocks. Only
    on CUDA — a CPU run (the tiny checks) has no cache to return, and a full collection costs ~0.5 s in a big
    process (a test session)."""
    if device.type == "cuda":
        gc.collect()
        torch.cuda.empty_cache()


def timed(step: Callable[[], object], device: torch.device) -> tuple[float, int, object]:
    """Run ``step`` once: ``(seconds, peak device bytes during it (0 off CUDA), its result)``."""
    synchronize(device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    start = time.perf_counter()
    result = step()
    synchronize(device)
    peak = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else 0
    return time.perf_counter() - start, peak, result


def measure(step: Callable[[], object], device: torch.device, repeats: int, warmup: int = 0) -> dict:
    """``warmup`` untimed runs (compilation, first allocations; their seconds in ``warmup_s``), then ``repeats``
    timed ones: ``step_s`` (median), ``min_s``, ``steps_s``, ``peak_gib`` (the largest peak of the timed runs,
    ``torch.cuda.max_memory_allocated``; ``None`` off CUDA)."""
    warm = [timed(step, device)[0] for _ in range(warmup)]
    runs = [timed(step, device) for _ in range(repeats)]
    seconds = [r[0] for r in runs]
    return {
        "step_s": statistics.median(seconds),
        "min_s": min(seconds),
        "steps_s": seconds,
        "warmup_s": sum(warm) if warm else None,
        "peak_gib": max(r[1] for r in runs) / GIB if device.type == "cuda" else None,
    }


# --------------------------------------------------------------------------------------------------- steps
def make_step(model, method: str, config=None) -> tuple[Callable[[torch.Tensor], torch.Tensor], object]:
    """``(step(ids) -> loss, engine)``: one forward + backward on ``ids [1, N]`` (starting without gradients, as
    Lightning's ``optimizer.zero_grad()`` leaves them: the step makes them) by ``method``: ``"hf"`` — transformers
    + SDPA + per-layer checkpointing, the usual recipe (engine ``None``) — or ``"oomb"`` — the OOMB engine with
    ``config`` (an ``OOMBConfig``; its ``layer_checkpointing`` checkpoints each layer inside a chunk's recompute)."""
    from lightning_oomb.engine import OOMBEngine
    from lightning_oomb.integrations.hf import HFChunkModel, set_layer_checkpointing

    set_layer_checkpointing(model, method == HF)
    if method == HF:

        def step(ids: torch.Tensor) -> torch.Tensor:
            model.zero_grad(set_to_none=True)
            loss = model(input_ids=ids, labels=ids).loss
            loss.backward()
            return loss.detach()

        return step, None
    # (Qwen2's shape, which the tests check exact: no self-check twin in the GPU session's time)
    adapter = HFChunkModel(model, layer_checkpointing=config.layer_checkpointing, verify_exactness=False)
    engine = OOMBEngine(adapter, config)

    def step(ids: torch.Tensor) -> torch.Tensor:
        model.zero_grad(set_to_none=True)
        loss = engine.loss(ids)
        loss.backward()
        return loss.detach()

    return step, engine


def grad_probe(model) -> torch.Tensor:
    """A few small parameters' gradients of a Qwen2-style ``model`` (the final norm's, the first layer's input
    norm's and the last layer's post-attention norm's) as one float32 vector: a fingerprint of a step's gradients
    to compare methods by (every layer's gradient flows through them)."""
    inner = model.model
    parts = (inner.norm, inner.layers[0].input_layernorm, inner.layers[-1].post_attention_layernorm)
    return torch.cat([m.weight.grad.float().flatten() for m in parts if m.weight.grad is not None])


def head_dim(cfg) -> int:
    return getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads


def pool_shape(model, config, seq_len: int, dtype: torch.dtype | None = None):
    """The ``PoolShape`` a step of ``seq_len`` tokens of the HF ``model`` (or its config) under ``config`` needs
    (K/V in ``dtype``; default: the module's parameters', or bf16 for a config)."""
    from lightning_oomb.engine import PoolShape

    if dtype is None:
        dtype = next(model.parameters()).dtype if isinstance(model, torch.nn.Module) else torch.bfloat16
    cfg = getattr(model, "config", model)
    return PoolShape(
        cfg.num_hidden_layers, 1, seq_len, cfg.num_key_value_heads, head_dim(cfg),
        config.page_size, config.chunk_size, config.kv_grad_dtype, dtype=dtype,
        page_score=None if config.page_budget is None else config.page_score,
    )  # fmt: skip


def reserve_pool(engine, model, seq_len: int, device: torch.device) -> None:
    """Size ``engine``'s pool for ``seq_len`` tokens before a timed step (its arenas only grow, so the step then
    allocates nothing; pinning a host tier takes seconds)."""
    engine.pool.reserve(pool_shape(model, engine.config, seq_len), device)


def hbm_budget_for(device_layers: int, shape, staging_buffers: int) -> int:
    """The ``hbm_budget`` that keeps the first ``device_layers`` full layers of ``shape`` on the device (HBM tier)
    and the rest in pinned host memory (whole layers are placed; the staging buffers count against it)."""
    return shape.layer_bytes * device_layers + staging_buffers * shape.block_bytes


def engine_stats(engine) -> dict:
    """Where the last step's pages were and what moved: device / host pool GiB, GiB copied each way, copy waits,
    and a sparse step's attended fraction."""
    extra = engine.stats.extra
    row = {
        "pool_device_gib": (extra.get("hbm_pool_bytes", 0) + extra.get("staging_bytes", 0)) / GIB,
        "pool_host_gib": extra.get("host_pool_bytes", 0) / GIB,
        "h2d_gib": extra.get("h2d_bytes", 0) / GIB,
        "d2h_gib": extra.get("d2h_bytes", 0) / GIB,
        "copy_wait_s": extra.get("copy_wait_s", 0.0),
        "copy_runs": extra.get("copy_runs", 0),
        "hbm_layers": extra.get("hbm_layers"),
        "host_layers": extra.get("host_layers"),
        "reused_attention_gib": extra.get("reused_attention_bytes", 0) / GIB,
    }
    if engine.stats.sparse is not None:
        row["attended_fraction"] = engine.stats.sparse.attended_fraction
    return row


def planned_peak_gib(
    model, seq_len: int, config, device: torch.device, precision: str = "bf16-true"
) -> float | None:
    """The memory planner's predicted device peak (GiB) of an OOMB step without optimizer state (what the
    benchmarks run) for ``model`` (a module or config); ``None`` if it cannot plan it."""
    from lightning_oomb import plan

    try:
        return plan(model, seq_len, 1, config, precision, None, device.type, suggest=False).peak_device / GIB
    except Exception as e:  # the plan is a side note of a measured row: never the reason a row is lost
        print(f"planner: {type(e).__name__}: {e}", file=sys.stderr)
        return None


# -------------------------------------------------------------------------------------------------- report
def versions() -> dict:
    """The software and machine a result came from."""
    out = {"python": platform.python_version(), "torch": torch.__version__, "cuda": torch.version.cuda}
    for name in ("triton", "transformers", "lightning"):
        try:
            out[name] = __import__(name).__version__
        except Exception:
            out[name] = None
    if torch.cuda.is_available():
        out["gpu"] = torch.cuda.get_device_name()
        out["gpu_memory_gib"] = torch.cuda.get_device_properties(0).total_memory / GIB
    with contextlib.suppress(OSError, KeyError, ValueError):
        meminfo = dict(line.split(":", 1) for line in Path("/proc/meminfo").read_text().splitlines())
        out["host_memory_gib"] = int(meminfo["MemTotal"].split()[0]) * 1024 / GIB
    with contextlib.suppress(OSError, subprocess.SubprocessError):
        out["commit"] = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, timeout=5
        ).stdout.strip()
    out["env"] = {k: v for k, v in os.environ.items() if k.startswith(("OOMB_", "TRITON_"))}
    return out


def command() -> str:
    return " ".join([Path(sys.argv[0]).as_posix(), *sys.argv[1:]])


class Report:
    """One script's results: ``{"command", "versions", **meta, "rows": [...]}`` in ``path``, rewritten after every
    row so a run cut short keeps what it measured; the command and versions, then each row, are also printed as
    one JSON line each."""

    def __init__(self, path: Path, **meta):
        self.path = path
        self.data = {"command": command(), "versions": versions()}
        self.data.update(meta, rows=[])
        print(json.dumps({"command": self.data["command"], "versions": self.data["versions"]}), flush=True)
        self.save()

    @property
    def rows(self) -> list[dict]:
        return self.data["rows"]

    def add(self, row: dict) -> dict:
        self.rows.append(row)
        print(json.dumps(row, default=float), flush=True)
        self.save()
        return row

    def save(self) -> None:
        write_json(self.path, self.data)


def write_json(path: Path, data) -> None:
    """Write ``data`` as indented JSON (parents created); called after every row so a cut-short run keeps rows."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=1, default=float))


def old_module(commit: str, path: str) -> types.ModuleType:
    """The module at ``path`` (from the repository root) as it was at ``commit``, imported under a private name
    (a benchmark's "before", measured in the same run as the "after")."""
    source = subprocess.run(["git", "show", f"{commit}:{path}"], cwd=Path(__file__).resolve().parents[1],
                            capture_output=True, text=True, check=True).stdout  # fmt: skip
    module = types.ModuleType(f"_old_{Path(path).stem}")
    sys.modules[module.__name__] = module  # dataclasses look their module up
    exec(compile(source, f"{commit}:{path}", "exec"), module.__dict__)
    return module


# ------------------------------------------------------------------------------------- one-model step benchmarks
def step_args(
    doc: str, argv: list[str] | None, layers: int, tokens: int, out: Path, tiny_tokens: int
) -> argparse.Namespace:
    """The arguments of a benchmark timing one model's steps two ways (``--layers``, ``--tokens`` in chunks of
    ``--chunk``, ``--page``, ``--repeats``, ``--device``, ``--out``); ``--tiny``: ``tiny_tokens`` in chunks of 32,
    one repeat (a CPU smoke)."""
    p = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    p.add_argument("--layers", type=int, default=layers)
    p.add_argument("--tokens", type=int, default=tokens)
    p.add_argument("--chunk", type=int, default=4096)
    p.add_argument("--page", type=int, default=128)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--device", default="cuda")
    p.add_argument(
        "--tiny", action="store_true", help=f"a tiny width, {tiny_tokens} tokens in chunks of 32 (CPU smoke)"
    )
    p.add_argument("--out", type=Path, default=out)
    args = p.parse_args(argv)
    if args.tiny:
        args.tokens, args.chunk, args.page, args.repeats = tiny_tokens, 32, 16, 1
    return args


def finish(report: Report, out: Path, plot: Callable, table: Callable) -> dict:
    """Save a step benchmark's JSON, its PNG (``plot(rows, path)``) and Markdown table (``table(data)``, printed)."""
    report.save()
    plot(report.rows, out.with_suffix(".png"))
    out.with_suffix(".md").write_text(table(report.data))
    print(table(report.data))
    return report.data


@contextlib.contextmanager
def timed_engine(model, ids: torch.Tensor, config, device: torch.device, repeats: int):
    """An OOMB engine of ``model`` (HF, layer checkpointing as ``config`` says, no self-check) and its steps on
    ``ids`` timed (:func:`measure`, one warm-up): yields ``(engine, timing, loss)`` — a last step's loss — and
    releases the pool and the device memory afterwards."""
    from lightning_oomb.engine import OOMBEngine
    from lightning_oomb.integrations.hf import HFChunkModel

    checkpointing = config.layer_checkpointing is True
    engine = OOMBEngine(
        HFChunkModel(model, layer_checkpointing=checkpointing, verify_exactness=False), config
    )

    def step() -> torch.Tensor:
        model.zero_grad(set_to_none=True)
        loss = engine.loss(ids)
        loss.backward()
        return loss.detach()

    timing = measure(step, device, repeats, warmup=1)
    try:
        yield engine, timing, step().item()
    finally:
        engine.pool.release()
        free_device_memory(device)
