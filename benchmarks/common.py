"""What the benchmark scripts share: building models from config classes, timing a step with its peak memory,
writing results. Baselines that the tests also use (the dense attention oracle, paged layouts) come from
``tests/helpers`` (run the scripts from the repository root with ``PYTHONPATH=$PWD``)."""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from pathlib import Path

import torch

GIB = 2**30


def build_qwen2(device: torch.device, dtype: torch.dtype, config) -> torch.nn.Module:
    """A randomly initialised ``Qwen2ForCausalLM`` (SDPA attention, train mode) built directly on ``device`` in
    ``dtype`` from a ``Qwen2Config`` or the keyword arguments of one."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = config if isinstance(config, Qwen2Config) else Qwen2Config(**config)
    config._attn_implementation = "sdpa"
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with device:
            model = Qwen2ForCausalLM(config)
    finally:
        torch.set_default_dtype(previous)
    return model.train()


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


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


def write_json(path: Path, data) -> None:
    """Write ``data`` as indented JSON (parents created); called after every row so a cut-short run keeps rows."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=1, default=float))
