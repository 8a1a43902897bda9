"""Paged attention kernels (csrc_triton) against torch SDPA and FlexAttention on OOMB's shape, on one GPU.

Measured in the same run:

1. Accuracy, the FlashAttention rule: the error (max |x - x_fp32|) of out, dQ, dK, dV against a float32 reference
   on the same inputs must be at most 2x the error of a plain-torch implementation in the low-precision dtype.
2. Throughput: forward and forward+backward of a chunk of queries at the end of long key sequences (default 4096
   queries against 32K and 128K keys, B=1, 28 query / 4 KV heads, head_dim 128, bf16, page 128) for our kernels,
   SDPA with ``causal_lower_right`` (K/V expanded by ``repeat_interleave``, and ``enable_gqa=True``) and compiled
   FlexAttention (``enable_gqa=True``, lower-right causal block mask). Median of ``--iters`` runs after warm-up
   (compilation and autotuning happen there; the first call's seconds are recorded), timed with CUDA events. Also
   our kernels with a page selection (``page_select``: every query block of 128 queries sees ``--page-budget``
   random earlier pages and its chunk causally, as sparse attention runs them), at each kernel's default tile
   (``--default-tiles``: before tuning), and over the keys in staged blocks of Lq keys merged by log-sum-exp, as
   offload runs them (the compute overhead of streaming): ``merged``, the default staging buffers' groups of
   blocks per kernel call (``staging_buffers=9``: 4 blocks a call), ``merged-block`` one block per call (4 buffers
   or fewer).

FLOPs count the query-key pairs attended: forward = 4 * Hq * D * pairs (two matmuls), forward+backward = 3.5x that
(backward = 2.5 forwards, FlashAttention's count); dense pairs are the lower-right causal ones, ``Lq * (Lk - Lq) +
Lq (Lq + 1) / 2``, sparse ones ``Lq * budget * page + Lq (Lq + 1) / 2``. So TFLOP/s is per attended key and the
ratios sparse/dense and ours/FlexAttention compare work per key.

Tuning: ``--tune-configs N`` caps the configs tried per kernel and tuning key (``OOMB_TRITON_TUNE_CONFIGS``; each
costs a compilation, about 1-3 s, plus ~0.1 s of timing); the chosen config, ``n_regs`` and ``n_spills`` of every
compiled kernel are recorded where the Triton version exposes them. ``--budget-s`` is the time by which the
throughput runs end: a row starts only if what it may take (:func:`reserve_s`) is left, otherwise it is recorded as
skipped (rows so far are kept: the JSON is rewritten after each row); the accuracy check and the kernel records
come after it.

Writes JSON to ``--out`` (default ``benchmarks/results/kernels-<gpu>.json``) and a PNG next to it; prints the
table last. ``--smoke`` runs tiny shapes (on a machine without a GPU through the Triton interpreter, float16) to
check that the script works.
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16}
# method ids (--methods) -> row names
METHODS = ("paged", "sparse", "merged", "merged-block", "sdpa-repeat", "sdpa-gqa", "flex")
OURS = ("paged", "sparse", "merged", "merged-block")
NAMES = {
    "paged": "oomb triton (paged)",
    "sparse": "oomb triton (paged, sparse)",
    "merged": "oomb triton (chunk-sized key blocks, merged)",
    "merged-block": "oomb triton (one key block per call, merged)",
    "sdpa-repeat": "sdpa lower-right (repeat_interleave)",
    "sdpa-gqa": "sdpa lower-right (enable_gqa)",
    "flex": "flex compiled (enable_gqa)",
}
DEFAULT_TILE = " at default tiles"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--queries", type=int, default=4096, help="queries per chunk (Lq)")
    parser.add_argument(
        "--keys", type=int, nargs="+", default=[32768, 131072], help="total keys Lk (each a run)"
    )
    parser.add_argument("--heads", type=int, default=28, help="query heads")
    parser.add_argument("--kv-heads", type=int, default=4, help="KV heads")
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--page", type=int, default=128, help="tokens per KV page")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="bfloat16")
    parser.add_argument("--accuracy-shape", type=int, nargs=2, default=[2048, 16384], metavar=("LQ", "LK"))
    parser.add_argument(
        "--page-budget", type=int, default=64, help="sparse rows: earlier pages per query block"
    )
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--iters", type=int, default=10)
    parser.add_argument("--methods", default=",".join(METHODS), help=f"comma-separated subset of {METHODS}")
    parser.add_argument("--default-tiles", action="store_true", help="also time our kernels before tuning")
    parser.add_argument("--tune-configs", type=int, default=None, help="at most N configs per kernel and key")
    parser.add_argument("--budget-s", type=float, default=None, help="throughput rows end by this many s")
    parser.add_argument("--out", type=Path, default=None, help="JSON path (PNG written next to it)")
    parser.add_argument("--smoke", action="store_true", help="tiny shapes and iterations; runs on CPU too")
    args = parser.parse_args(argv)
    if args.smoke:
        args.queries, args.keys, args.heads, args.kv_heads, args.page_budget = 32, [96], 4, 2, 2
        args.head_dim, args.page, args.accuracy_shape, args.warmup, args.iters = 16, 16, [32, 96], 1, 1
    unknown = set(args.methods.split(",")) - set(METHODS)
    if unknown:
        parser.error(f"unknown methods {sorted(unknown)}; choose from {METHODS}")
    return args


# ------------------------------------------------------------------------------------------------- problem
class Problem:
    """One chunk: ``q, dout [1, Hq, Lq, D]``; ``k, v [1, Hkv, Lk, D]`` and the same K/V in shuffled pages."""

    def __init__(self, args, lq: int, lk: int, dtype: torch.dtype, device: torch.device, seed: int = 0):
        gen = torch.Generator().manual_seed(seed)
        h, hkv, d, page = args.heads, args.kv_heads, args.head_dim, args.page

        def randn(*shape):
            return torch.randn(*shape, generator=gen).to(device, dtype)

        self.lq, self.lk, self.page, self.scale = lq, lk, page, d**-0.5
        self.q, self.dout = randn(1, h, lq, d), randn(1, h, lq, d)
        self.k, self.v = randn(1, hkv, lk, d), randn(1, hkv, lk, d)
        from tests.helpers.attention import to_pages  # (imports triton: after main() chose interpret mode)

        n_pages = math.ceil(lk / page)
        self.table = torch.randperm(n_pages, generator=gen).int().to(device)[None]
        self.k_arena, self.v_arena = (to_pages(x, self.table, page) for x in (self.k, self.v))
        self.dk_arena = torch.zeros(self.k_arena.shape, dtype=torch.float32, device=device)
        self.dv_arena = torch.zeros_like(self.dk_arena)

    def select(self, budget: int, seed: int = 0) -> torch.Tensor:
        """``page_select [1, Lq / P, budget]``: every query block sees ``budget`` distinct random pages before
        ``q_start`` (ascending), all of them when there are fewer."""
        gen = torch.Generator().manual_seed(seed)
        past, blocks = (self.lk - self.lq) // self.page, math.ceil(self.lq / self.page)
        pages = [
            torch.randperm(past, generator=gen)[: min(budget, past)].sort().values for _ in range(blocks)
        ]
        return torch.stack(pages).int()[None].to(self.q.device)

    def pairs(self, budget: int | None = None) -> float:
        """Query-key pairs attended (per query head): lower-right causal, or with ``budget`` pages per block."""
        own = self.lq * (self.lq + 1) / 2
        past = self.lk - self.lq if budget is None else min(budget * self.page, self.lk - self.lq)
        return self.lq * past + own

    def from_pages(self, arena: torch.Tensor) -> torch.Tensor:
        """The problem's tokens ``[1, Hkv, Lk, D]`` held in ``arena``."""
        from tests.helpers.attention import from_pages

        return from_pages(arena, self.table, self.lk)


def torch_grads(
    p: Problem, dtype: torch.dtype, select: torch.Tensor | None = None
) -> dict[str, torch.Tensor]:
    from tests.helpers.attention import dense_attention, selection_mask

    q_start = p.lk - p.lq
    mask = (
        None if select is None else selection_mask(select.cpu(), q_start, p.lq, p.lk, p.page).to(p.q.device)
    )
    q, k, v = (x.detach().to(dtype).requires_grad_() for x in (p.q, p.k, p.v))
    out = dense_attention(
        q, k, v, q_start, p.scale, mask=mask
    )  # plain torch, materialised scores, in ``dtype``
    out.backward(p.dout.to(dtype))
    return {"out": out.detach(), "dq": q.grad, "dk": k.grad, "dv": v.grad}


def run_oomb(
    kernels, p: Problem, backward: bool = True, select: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Our forward (and backward, which adds into ``p``'s gradient pages), with an optional ``page_select``;
    returns ``out`` and ``dq``."""
    q_start = p.lk - p.lq
    out, lse = kernels.paged_attention_forward(
        p.q, p.k_arena, p.v_arena, p.table, q_start, p.scale, None, page_select=select
    )
    if not backward:
        return out, None
    dq = kernels.paged_attention_backward(
        p.q, out, lse, p.dout, p.k_arena, p.v_arena, p.dk_arena, p.dv_arena, p.table, q_start, p.scale, None,
        page_select=select,
    )  # fmt: skip
    return out, dq


def run_oomb_blocks(p: Problem, block: int, backward: bool = True) -> None:
    """The offload path: the keys in parts of ``block`` tokens (a group of staged chunks each), merged by the
    engine's ``attend`` / ``attend_backward`` (carried softmax state, accumulated dQ) — its cost over one call is
    the compute overhead of streaming."""
    from lightning_oomb.engine.attention import attend, attend_backward
    from lightning_oomb.engine.pages import PagedKV

    q_start = p.lk - p.lq
    arenas = (p.k_arena, p.v_arena, p.dk_arena, p.dv_arena)
    parts = [PagedKV(*arenas, p.table, (lo, min(lo + block, p.lk))) for lo in range(0, p.lk, block)]
    out, lse = attend("triton", p.q, parts, q_start, p.scale, None)
    if backward:
        attend_backward("triton", p.q, out, lse, p.dout, parts, q_start, p.scale, None)


def oomb_grads(kernels, p: Problem, select: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
    p.dk_arena.zero_()
    p.dv_arena.zero_()
    out, dq = run_oomb(kernels, p, select=select)
    return {"out": out, "dq": dq, "dk": p.from_pages(p.dk_arena), "dv": p.from_pages(p.dv_arena)}


def accuracy(kernels, args, dtype, device) -> dict:
    """FlashAttention rule for out, dQ, dK, dV at ``--accuracy-shape``: dense, and with a page selection (the
    references attend through the same selection as a mask)."""
    p = Problem(args, *args.accuracy_shape, dtype, device, seed=1)
    result = {}
    for case, select in (("dense", None), ("sparse", p.select(args.page_budget, seed=1))):
        want = torch_grads(p, torch.float32, select)
        plain = torch_grads(p, dtype, select)
        ours = oomb_grads(kernels, p, select)
        for name, ref in want.items():
            err_ours = (ours[name].float() - ref).abs().max().item()
            err_plain = (plain[name].float() - ref).abs().max().item()
            key = name if case == "dense" else f"{name} (sparse)"
            result[key] = {"oomb": err_ours, "plain_torch": err_plain, "ok": err_ours <= 2 * err_plain}
        del want, plain, ours
    return result


# ---------------------------------------------------------------------------------------------- throughput
def methods(
    kernels, p: Problem, chosen: list[str], budget: int
) -> dict[str, tuple[Callable, Callable, float]]:
    """method id -> (forward, forward+backward, attended pairs per head) closures on the problem ``p``."""
    from torch.nn.attention.bias import causal_lower_right
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    q_start, lq, lk = p.lk - p.lq, p.lq, p.lk
    leaves = [x.detach().requires_grad_() for x in (p.q, p.k, p.v)]

    def autograd(attend: Callable) -> Callable:
        def run(backward: bool):
            for x in leaves:
                x.grad = None
            with torch.set_grad_enabled(backward):
                out = attend(*leaves)
            if backward:
                out.backward(p.dout)

        return run

    from lightning_oomb.engine import OOMBConfig
    from lightning_oomb.engine.offload.offloader import group_size

    group = p.q.shape[1] // p.k.shape[1]
    # blocks a step's offload attends per kernel call (its blocks: a chunk's K, V and float32 dK, dV pages)
    per_call = group_size(
        OOMBConfig().staging_count(2 * lq * p.k.shape[1] * p.k.shape[3] * (p.k.element_size() + 4))
    )
    mask = causal_lower_right(lq, lk)
    makers = {
        "paged": lambda: functools.partial(run_oomb, kernels, p),
        "sparse": lambda: functools.partial(run_oomb, kernels, p, select=p.select(budget)),
        "merged": lambda: functools.partial(run_oomb_blocks, p, per_call * math.ceil(lq / p.page) * p.page),
        "merged-block": lambda: functools.partial(run_oomb_blocks, p, math.ceil(lq / p.page) * p.page),
        "sdpa-repeat": lambda: autograd(
            lambda q, k, v: F.scaled_dot_product_attention(
                q, k.repeat_interleave(group, 1), v.repeat_interleave(group, 1), attn_mask=mask, scale=p.scale
            )
        ),
        "sdpa-gqa": lambda: autograd(
            lambda q, k, v: F.scaled_dot_product_attention(
                q, k, v, attn_mask=mask, scale=p.scale, enable_gqa=True
            )
        ),
    }

    def flex_run():
        block_mask = create_block_mask(
            lambda b, h, qi, ki: ki <= qi + q_start, None, None, lq, lk, device=p.q.device.type
        )
        flex = torch.compile(flex_attention, dynamic=False)
        return autograd(lambda q, k, v: flex(q, k, v, block_mask=block_mask, scale=p.scale, enable_gqa=True))

    makers["flex"] = flex_run
    out = {}
    for name in chosen:
        run = makers[name]()
        pairs = p.pairs(budget if name == "sparse" else None)
        out[name] = (lambda r=run: r(False), lambda r=run: r(True), pairs)
    return out


def timed_ms(fn: Callable, warmup: int, iters: int, device: torch.device) -> tuple[float, float]:
    """``(median ms of iters runs, seconds of the first call)`` of ``fn`` (CUDA events on GPU, ``perf_counter`` on
    CPU); the first call (compilation, autotuning) and ``warmup - 1`` more are not timed."""
    t0 = time.perf_counter()
    fn()
    if device.type == "cuda":
        torch.cuda.synchronize()
    first = time.perf_counter() - t0
    for _ in range(warmup - 1):
        fn()
    times = []
    for _ in range(iters):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            torch.cuda.synchronize()
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        else:
            t1 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t1) * 1e3)
    return statistics.median(times), first


def reserve_s(method: str, default_tiles: bool, compiled: bool) -> float:
    """Seconds a row may take, for ``--budget-s`` (a row starts only if this much is left): compiled FlexAttention
    compiles for every key length (~20 s); our kernels compile at their first length (~2 s per config and kernel,
    three kernels, ``--tune-configs`` configs when tuned); the rest time in a few seconds."""
    if method == "flex":
        return 30.0
    if method in OURS and not compiled:
        configs = 1 if default_tiles else int(os.environ.get("OOMB_TRITON_TUNE_CONFIGS") or 4)
        return 5.0 + 3 * 2.0 * configs
    return 5.0


def reset_tuning(kernels, tune: bool) -> None:
    """Forget every kernel's chosen config (the next call of each key picks again), with tuning on or off."""
    os.environ["OOMB_TRITON_AUTOTUNE"] = "1" if tune else "0"
    for tuner in tuners(kernels).values():
        tuner.cache.clear()


def throughput(
    kernels, args, dtype, device, save: Callable[[list[dict]], None], started: float
) -> list[dict]:
    """Rows per key length and method (``save(rows)`` after each); ``--default-tiles`` first times our kernels at
    their default tiles, then tuning starts afresh."""
    chosen = args.methods.split(",")
    passes = [(DEFAULT_TILE, [m for m in chosen if m in OURS])] if args.default_tiles else []
    # the offload path's merged key blocks: at the default tiles only, when they are measured (what a step runs)
    passes.append(("", [m for m in chosen if not (args.default_tiles and m.startswith("merged"))]))
    tune = os.environ.get("OOMB_TRITON_AUTOTUNE", "1") != "0"
    rows = []
    for suffix, names in passes:
        reset_tuning(kernels, tune and not suffix)
        seen: set[str] = set()
        for lk in args.keys:
            p = Problem(args, args.queries, lk, dtype, device)
            for name, (fwd, fwd_bwd, pairs) in methods(kernels, p, names, args.page_budget).items():
                row = {"method": NAMES[name] + suffix, "keys": lk, "attended_keys_per_query": pairs / p.lq}
                need = reserve_s(name, bool(suffix), name in seen)
                seen.add(name)
                left = None if args.budget_s is None else args.budget_s - (time.monotonic() - started)
                if left is not None and left < need:
                    row["skipped"] = (
                        f"{left:.0f} s left of the {args.budget_s:.0f} s budget, {need:.0f} s needed"
                    )
                else:
                    try:
                        flops = 4 * args.heads * args.head_dim * pairs
                        row["fwd_ms"], row["first_fwd_s"] = timed_ms(fwd, args.warmup, args.iters, device)
                        row["fwd_bwd_ms"], row["first_fwd_bwd_s"] = timed_ms(
                            fwd_bwd, args.warmup, args.iters, device
                        )
                        row["fwd_tflops"] = flops / row["fwd_ms"] / 1e9
                        row["fwd_bwd_tflops"] = 3.5 * flops / row["fwd_bwd_ms"] / 1e9
                    except Exception as e:  # a reference this torch build cannot run is recorded, not fatal
                        row["error"] = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
                rows.append(row)
                print(json.dumps(row), flush=True)
                save(rows)
            del p
            if device.type == "cuda":
                torch.cuda.empty_cache()
    os.environ["OOMB_TRITON_AUTOTUNE"] = "1" if tune else "0"
    return rows


# ----------------------------------------------------------------------------------------------- kernels
def tuners(kernels) -> dict:
    """The module's autotuned kernels by name."""
    import triton

    return {
        name: obj
        for name, obj in vars(kernels).items()
        if isinstance(obj, triton.runtime.autotuner.Autotuner)
    }


def _jit_function(fn):
    import triton

    while fn is not None and not isinstance(fn, triton.runtime.jit.JITFunction):
        fn = getattr(fn, "fn", None)
    return fn


def _compiled(jit) -> list:
    """Compiled kernels of a ``JITFunction``: ``device_caches`` (Triton >= 3.2: per device a tuple whose first item
    is the kernel cache) or the older ``cache`` (per device a dict)."""
    found = []
    caches = getattr(jit, "device_caches", None)
    if isinstance(caches, dict):
        for entry in caches.values():
            cache = entry[0] if isinstance(entry, tuple) else entry
            if isinstance(cache, dict):
                found += list(cache.values())
    elif isinstance(getattr(jit, "cache", None), dict):
        for cache in jit.cache.values():
            if isinstance(cache, dict):
                found += list(cache.values())
    return found


def _constants(kernel, jit) -> dict:
    """The tile and specialisation constexprs of a compiled kernel, by name (``src.constants`` is keyed by
    argument index tuples, indices or names depending on the Triton version)."""
    constants = getattr(getattr(kernel, "src", None), "constants", None) or {}
    names = getattr(jit, "arg_names", [])
    out = {}
    for key, value in constants.items():
        index = key[0] if isinstance(key, tuple) and len(key) == 1 else key
        name = names[index] if isinstance(index, int) and index < len(names) else str(index)
        if name in (
            "BLOCK_M",
            "BLOCK_N",
            "SPLIT",
            "SPARSE",
            "CARRY",
            "ACCUMULATE",
            "ROWS",
            "SOFTCAP",
            "HEAD_DIM",
            "PAGE",
        ):
            out[name] = value if isinstance(value, (bool, int, float, str)) else str(value)
    return out


def kernel_info(kernels) -> dict:
    """Per autotuned kernel: the config chosen per tuning key, and every compiled variant's tile, warps, stages,
    registers and spills (``None`` where this Triton does not expose them; ``load_error`` for a variant that did
    not load on this GPU)."""
    info = {}
    for name, tuner in tuners(kernels).items():
        try:
            info[name] = _kernel_record(tuner)
        except Exception as e:  # a record this Triton version lays out differently: noted, never fatal
            info[name] = {"error": f"{type(e).__name__}: {e}"}
    return info


def _kernel_record(tuner) -> dict:
    jit = _jit_function(tuner)
    variants = []
    for kernel in _compiled(jit) if jit is not None else []:
        meta = getattr(kernel, "metadata", None)
        failed = None
        if getattr(kernel, "n_regs", None) is None:  # read when the binary is loaded (on first launch)
            try:
                kernel._init_handles()
            # e.g. OutOfResources: compiled, never ran (the launcher took a smaller tile)
            except Exception as e:
                failed = f"{type(e).__name__}: {e}"
        variants.append({
            **({"load_error": failed} if failed else {}),
            **_constants(kernel, jit),
            "num_warps": getattr(meta, "num_warps", None),
            "num_stages": getattr(meta, "num_stages", None),
            "shared_bytes": getattr(meta, "shared", None),
            "n_regs": getattr(kernel, "n_regs", None),
            "n_spills": getattr(kernel, "n_spills", None),
        })  # fmt: skip
    return {
        "chosen": {str(key): str(config) for key, config in getattr(tuner, "cache", {}).items()},
        "compiled": variants,
    }


# ------------------------------------------------------------------------------------------------- report
def ratios(rows: list[dict]) -> dict[str, dict[int, float | None]]:
    """Per key length, fwd+bwd TFLOP/s (per attended key) of: our dense kernels over the fastest reference's and
    over compiled FlexAttention's; our sparse kernels, and the keys in merged blocks (offload's path), over our
    dense ones — ours at their default tiles where measured."""

    def tflops(lk: int, method: str) -> float | None:
        """Our kernels at their default tiles where measured (what a training step runs), else tuned."""
        for name in (NAMES[method] + DEFAULT_TILE, NAMES[method]):
            found = [r.get("fwd_bwd_tflops") for r in rows if r["keys"] == lk and r["method"] == name]
            if found and found[0]:
                return found[0]
        return None

    out = {
        "oomb_over_best_reference": {},
        "oomb_over_flex": {},
        "sparse_over_dense": {},
        "merged_over_dense": {},
        "merged_block_over_dense": {},
    }
    for lk in dict.fromkeys(r["keys"] for r in rows):
        ours, flex, sparse, merged, block = (
            tflops(lk, m) for m in ("paged", "flex", "sparse", "merged", "merged-block")
        )
        refs = [r["fwd_bwd_tflops"] for r in rows if r["keys"] == lk and "fwd_bwd_tflops" in r
                and not r["method"].startswith("oomb")]  # fmt: skip
        out["oomb_over_best_reference"][lk] = ours / max(refs) if ours and refs else None
        out["oomb_over_flex"][lk] = ours / flex if ours and flex else None
        out["sparse_over_dense"][lk] = sparse / ours if ours and sparse else None
        out["merged_over_dense"][lk] = merged / ours if ours and merged else None
        out["merged_block_over_dense"][lk] = block / ours if ours and block else None
    return out


def tuning_seconds(rows: list[dict]) -> float | None:
    """Seconds our kernels' first calls took beyond a timed call (compilation and tuning), summed."""
    ours = [r for r in rows if r["method"].startswith("oomb") and "first_fwd_s" in r]
    if not ours:
        return None
    return sum(
        r["first_fwd_s"] - r["fwd_ms"] / 1e3 + r["first_fwd_bwd_s"] - r["fwd_bwd_ms"] / 1e3 for r in ours
    )


def plot(rows: list[dict], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    keys = list(dict.fromkeys(r["keys"] for r in rows))
    names = list(dict.fromkeys(r["method"] for r in rows))
    width = 0.8 / len(names)
    fig, ax = plt.subplots(figsize=(8, 4.5))
    for i, name in enumerate(names):
        values = [
            next((r.get("fwd_bwd_tflops", 0.0) for r in rows if r["keys"] == k and r["method"] == name), 0.0)
            for k in keys
        ]
        ax.bar([j + i * width for j in range(len(keys))], values, width, label=name)
    ax.set_xticks([j + 0.4 - width / 2 for j in range(len(keys))], [f"{k / 1024:g}K keys" for k in keys])
    ax.set_ylabel("forward+backward TFLOP/s")
    ax.set_title(title)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    started = time.monotonic()
    args = parse_args(argv)
    if args.tune_configs is not None:
        os.environ["OOMB_TRITON_TUNE_CONFIGS"] = str(args.tune_configs)
    if torch.cuda.is_available():
        device = torch.device("cuda")
        gpu = torch.cuda.get_device_name()
    elif args.smoke:
        os.environ.setdefault("TRITON_INTERPRET", "1")  # before csrc_triton decorates its kernels
        device, gpu = torch.device("cpu"), "cpu-interpreter"
        args.dtype = "float16"  # the interpreter's tl.dot mishandles bfloat16
    else:
        print(
            "benchmarks/attention_kernels.py needs a CUDA GPU (use --smoke to check the script on CPU).",
            file=sys.stderr,
        )
        return 2
    sys.path.insert(0, str(ROOT))
    from benchmarks.common import command, versions, write_json
    from csrc_triton import paged_attention as kernels

    dtype = DTYPES[args.dtype]
    slug = gpu.lower().replace(" ", "-")
    out = args.out or ROOT / "benchmarks" / "results" / f"kernels-{slug}.json"
    shape = f"{args.queries} queries, {args.heads}:{args.kv_heads} heads, d={args.head_dim}, page {args.page}"
    result = {
        "command": command(),
        "versions": versions(),
        "gpu": gpu,
        "dtype": args.dtype,
        "shape": {k: getattr(args, k) for k in ("queries", "keys", "heads", "kv_heads", "head_dim", "page")},
        "page_budget": args.page_budget,
        "flops": "attended pairs: fwd = 4*Hq*D*pairs; fwd+bwd = 3.5 * fwd",
        "throughput": [],
    }
    print(json.dumps({"command": result["command"], "versions": result["versions"]}), flush=True)

    def save(rows: list[dict]) -> None:
        result["throughput"] = rows
        result.update(ratios(rows))
        write_json(out, result)

    # first, so the kernels autotune on the benchmark shape
    rows = throughput(kernels, args, dtype, device, save, started)
    result["tuning_s"] = tuning_seconds(rows)
    result["kernels"] = kernel_info(kernels)  # the variants the throughput runs compiled and chose
    save(rows)
    plot(rows, out.with_suffix(".png"), f"{gpu}, {args.dtype}: {shape}")
    acc = accuracy(kernels, args, dtype, device)
    result["accuracy"] = {"shape": args.accuracy_shape, "errors_vs_fp32": acc}
    save(rows)

    print(
        f"accuracy ({args.accuracy_shape[0]} queries, {args.accuracy_shape[1]} keys), max abs error vs fp32:"
    )
    for name, e in acc.items():
        verdict = "ok" if e["ok"] else "FAIL (> 2x plain torch)"
        print(f"  {name:13s} oomb {e['oomb']:.3e}  plain {args.dtype} {e['plain_torch']:.3e}  {verdict}")
    print(
        "kernels (chosen config per tuning key; compiled variants: tile, warps, stages, registers, spills):"
    )
    for name, k in result["kernels"].items():
        if "error" in k:
            print(f"  {name}: {k['error']}")
        for key, config in k.get("chosen", {}).items():
            print(f"  {name} {key}: {config}")
        for v in k.get("compiled", []):
            print(f"  {name} compiled: {v}")
    print(f"\nwrote {out} and {out.with_suffix('.png').name}\n{gpu}, {args.dtype}, {shape}")
    print(f"first calls of our kernels beyond a timed call (compile + tune): {result['tuning_s'] or 0:.1f} s")
    print(f"{'keys':>7}  {'method':52s} {'fwd ms':>9} {'fwd+bwd ms':>11} {'TFLOP/s':>8}")
    for r in rows:
        if "fwd_bwd_tflops" not in r:
            print(f"{r['keys']:>7}  {r['method']:52s} {(r.get('error') or r.get('skipped', ''))[:60]}")
        else:
            print(
                f"{r['keys']:>7}  {r['method']:52s} {r['fwd_ms']:9.2f} {r['fwd_bwd_ms']:11.2f} {r['fwd_bwd_tflops']:8.1f}"
            )
    for label, key in (("oomb / fastest reference", "oomb_over_best_reference"),
                       ("oomb / compiled FlexAttention", "oomb_over_flex"),
                       ("sparse / dense, per attended key", "sparse_over_dense"),
                       ("merged key blocks (offload) / one call", "merged_over_dense"),
                       ("one key block a call (offload, <= 4 buffers) / one call", "merged_block_over_dense")):  # fmt: skip
        for lk, ratio in result[key].items():
            print(f"{lk:>7}  {label} (fwd+bwd): " + (f"{ratio:.2f}x" if ratio else "n/a"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
