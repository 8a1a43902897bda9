"""Paged causal attention, forward and backward, as Triton kernels.

One chunk's queries ``q [B, Hq, Lq, D]`` at absolute positions ``[q_start, q_start + Lq)`` attend to the keys
``[0, q_start + Lq)`` stored in pages: arenas ``[slots, Hkv, P, D]`` and ``page_table [B, n_pages]`` (row ``b``'s
page ``j`` is slot ``page_table[b, j]``). Query ``i`` sees key ``j`` iff ``j <= q_start + i`` and, with a sliding
``window`` W, ``j > q_start + i - W`` (lower-right causal). Query head ``h`` reads KV head ``h // (Hq // Hkv)``;
K/V are never repeated. Every ``(b, j)`` must name its own slot. The launchers' arguments are the contract of
``csrc_triton.contract``, shared with the plain-torch oracle ``lightning_oomb.engine.reference``.

Kernels (FlashAttention-2 style; softmax in base 2 with ``qk_scale = scale * log2(e)``, the returned ``lse`` is
the natural log):

- ``_fwd_kernel``: one program per (query block, query head); walks the key blocks it can see through the page
  table, keeping the running max ``m_i``, normaliser ``l_i`` and accumulator ``acc``.
- ``_bwd_preprocess``: ``delta_i = rowsum(dO_i * O_i)`` (:func:`attention_delta`: also the delta that the backward
  calls of several key parts share, as offload and context parallelism make them).
- ``_bwd_dkdv_kernel``: one program per (key block, KV head) **owns** that block of the K/V pages: it loops over
  every query head of its group and every query block that sees it, accumulates dK, dV in registers and adds them
  into the gradient pages with a plain load + add + store.
- ``_bwd_dq_kernel``: one program per (query block, query head) recomputes P and accumulates dQ over key blocks.

Why owner programs and a separate dQ kernel rather than atomics: each gradient-page element has exactly one
writer, so there are no atomics at all — the result is deterministic, bf16 gradient pages work on every Triton
version (bf16 ``atomic_add`` does not), and no fp32 dQ scratch or atomic traffic is needed; the price is
recomputing ``Q K^T`` and ``dO V^T`` in both kernels (7 instead of 5 matmuls). The Triton fused-attention
tutorial makes the same trade for Hopper; FlashAttention-2's CUDA kernel instead adds dQ atomically into fp32.

Why the forward and dQ kernels run one program per query head rather than all query heads of a KV head packed in
one tile: a tile's rows are bounded by registers (128 rows of head_dim 128 in fp32 on 8 warps), so packing G heads
leaves 128 / G queries per tile and each K/V tile is still loaded once per 128 rows — the same K/V bytes per row —
while power-of-two tiles would waste 1/8 of the rows at G = 7 (28:4). The heads of a group are launched close
together (query blocks vary fastest), so their K/V tiles are mostly re-read from L2 (predicted, not measured).
Packing pays where a call has few queries (decoding), which training chunks never are.

Head dims: the pages and the chunk's tensors are as wide as the model's heads (any width); the tiles are
:func:`tile_width` wide (the next power of two, at least 16), and every access of a tensor narrower than its tile
reads and writes only its own columns (:func:`_load`, :func:`_store`; zero columns in the tiles add nothing to a
score). Whether an access is masked is a compile-time decision: at a power-of-two head dim the kernels compile as
without it.

Every key range is split into blocks that need no mask (all their keys visible to every query of the block) and
the few on the causal diagonal / window edge / ragged last page that do; blocks nobody sees are never visited.
Tiles, warps and stages: by default each kernel runs at its shipped tile (:data:`SM90_DEFAULTS`, the fastest
measured on an H200, no MMA rows computed twice; spills checked offline with ptxas, ``benchmarks/kernel_compile.py``;
on GPUs without wgmma :data:`MMA_SYNC_DEFAULTS`, which fit their 99 KB of shared memory; the dK/dV kernel computing
dQ too its own, :data:`SM90_FUSED_DQ_DEFAULT`), fitted to the call's ``HEAD_DIM``, ``PAGE`` and ``SPARSE``
(:func:`_fitted`) — the first step compiles but never tunes; a GPU whose
shared memory still does not hold a tile gets a smaller one (:func:`smaller_configs`). ``OOMB_TRITON_AUTOTUNE=1``
turns on ``triton.autotune`` keyed on those (and the dtypes), over spaces pruned of tiles that duplicate MMA rows or
whose accumulators take too many registers; tuning then happens at
the first call of each key (``TRITON_CACHE_AUTOTUNING=1`` keeps the result on disk, ``OOMB_TRITON_TUNE_CONFIGS=N``
tries at most N configs per key — the default and the rest spread over the space — each one compilation). Under
``TRITON_INTERPRET=1`` one tiny config is used so CPU tests stay fast.

Key ranges, carried state, dQ accumulation — so that the caller can stream the keys through fixed-size device
buffers (offloaded to host memory), one attention call splits into calls over disjoint ``key_range=(lo, hi)``
(``lo`` page-aligned; ``hi`` page-aligned or the chunk's end) whose results combine exactly:

- every kernel clamps its key-block loops (or its grid) into ``[lo, hi)`` and never reads keys ``>= hi`` or the
  page-table entries of other pages (the caller may leave garbage there);
- ``state=(acc, m, l)`` (fp32; ``acc [B, Hq, Lq, D]`` the unnormalised ``sum exp(s - m) v``, ``m`` the running
  max of the scaled scores in natural-log units, ``l = sum exp(s - m)``; fresh: 0, -inf, 0) makes the forward
  fold its keys into the state in place (``CARRY``), in any order; ``out = acc / l``, ``lse = m + log(l)``. A
  row that sees no key of a range keeps its state, or, while it has seen no key at all, holds zero-weight junk
  under the finite masked max that its first visible key wipes (as in a one-shot call);
- the backward takes the final ``out``/``lse``, an optional precomputed ``delta`` and an optional fp32 ``dq``
  it adds into (``ACCUMULATE``: one writer per row, no atomics).

Without these arguments the kernels compile and run as before. Autotuning restores every in-place argument
between its runs: the gradient pages of the key range (never a whole arena), the state, the dQ accumulator.

Sparse attention — ``page_select [B, R, K]`` (``SPARSE``): query block ``r`` (queries ``[r * P, (r + 1) * P)``)
sees, of the keys before ``q_start``, only the pages listed in its row; the chunk's own keys as without it. A
forward or dQ program's tile lies inside one selection block (the pruner clamps ``BLOCK_M`` to the page): it loads
the block's list once as a vector and counts (``tl.sum``) how many listed key blocks lie below each of its bounds,
which makes the listed pages' blocks flat index ranges — before the key range or the first visible block (skipped),
needing the window / document mask, visible to every row — walked by the dense loops themselves (:func:`_key_block`
maps an index to its slot through the list, which holds each page next to its slot: one load per block as in a dense
walk, not a page-then-slot chain), then the chunk's own keys as without a selection. The dK/dV program of a past key
block visits only the query blocks listing its page, from inverse lists (CSR) the launcher builds on the device
without a host sync, the tiles of those that see the whole page in one loop across them (a page's listing blocks are
few: a loop per block would refill its pipeline every few tiles); its grid follows the selection, not the context:
the chunk's own key blocks first, then a call over every past page has programs for as many pages as the lists hold
entries, the most listed first (the longest programs start first), a call over a key range one per page of it; an
unlisted page's program returns at once. Without a selection the compiled kernels are the dense ones, unchanged.
"""

from __future__ import annotations

import functools
import math
import os
import weakref
from typing import NamedTuple

import torch
import triton
import triton.language as tl
from triton.runtime.errors import OutOfResources

from csrc_triton.contract import (
    check_buffer,
    check_call,
    check_doc_start,
    check_page_select,
    check_softcap,
    check_window,
)

LOG2E = math.log2(math.e)
_LOG2E = tl.constexpr(LOG2E)
_SUPPORTED = (torch.float16, torch.bfloat16, torch.float32)
_GRAD_DTYPES = (torch.float32, torch.bfloat16)
# Masked scores: large and finite, so a row whose first visited block is fully masked gets m_i = -1e30 instead of
# -inf (no inf - inf = NaN); its first visible key then rescales that junk by exp2(-1e30 - m) = 0.
_MASKED = tl.constexpr(-1.0e30)


# ------------------------------------------------------------------------------------------------ tile configs
def _interpreting() -> bool:
    return triton.knobs.runtime.interpret


# The tiles used without tuning, (BLOCK_M, BLOCK_N, warps, stages), for sm_90 (H100/H200) at head_dim 128, page
# 128, bf16: the fastest of each kernel's candidates measured on an H200 (benchmarks/tile_sweep.py, Triton 3.6:
# benchmarks/results/tile-sweep-h200.md). Forward + backward of 4096 queries after 32K keys take 15.9 ms at them
# against 24.6 ms at the earlier tiles, chosen offline for no spills (67 against 110 ms after 128K keys; compiled
# FlexAttention 15.8 and 66.1 ms). Every MMA has >= 16 rows per warp (no MMA row computed twice, see _fitted). The
# forward: 128 query rows x 128 keys on 8 warps (no spills but 4 bytes at two flag sets). dK/dV: 64 keys x 32
# queries on 4 warps, the query blocks that see the whole key block in an unmasked loop of their own (SPLIT True;
# False masks every block in one loop): 8 % less time than the next tile (32 x 128 on 8 warps) and 29 % less than
# 16 x 128 with one loop, measured when it spilled 0.45-1.3 KB (its walk looped over the query heads outside its
# key-range loops, whose hoisted offsets stayed live); each range now walks every head of the group in one loop:
# no spills (benchmarks/results/kernel-compile-sm90.md), speed not yet measured. dQ: 64 query rows x 64 keys on 4
# warps, no spills (128 x 128 was 1 % faster and spills 0.2 KB). Tuning (OOMB_TRITON_AUTOTUNE=1) tries both loops at
# every tile (SM90_VARIANTS).
SM90_DEFAULTS = {"forward": (128, 128, 8, 3), "dkdv": (32, 64, 4, 3), "dq": (64, 64, 4, 3)}
# The dK/dV kernel computing dQ too (OOMB_TRITON_FUSED_DQ=1) holds a third fp32 tile, the query block's dQ share:
# at the dK/dV tile above it spills 8-924 bytes on Triton 3.9 and 100-1,000 on 3.6 (the GPU machine's). 128 keys
# x 32 queries on 8 warps, one masked loop, compiles without spills there, dense and sparse, plain and with
# documents, on both (softcap with a selection: 24-112 bytes; benchmarks/results/kernel-compile-sm90*.md); it was
# 16 % slower than the dK/dV default without dQ (tile sweep above), its speed with dQ is not measured. Other widths
# and GPUs keep their dK/dV tile with dQ (no spills at 256 and 512 on sm_90).
SM90_FUSED_DQ_DEFAULT = (32, 128, 8, 2)
SM90_VARIANTS = {"dkdv": ({"SPLIT": True}, {"SPLIT": False})}  # constexprs per tile; the default's first
# the other tables' dK/dV tiles (wide heads, GPUs without wgmma) were compiled with one masked loop, which spills
# less there (sm_89: 20 bytes against 76); their speed is not measured
OTHER_VARIANTS = {"dkdv": ({"SPLIT": False}, {"SPLIT": True})}
# Wider heads (Gemma 2/3's 256; Gemma 4's 512, DeepSeek's latent attention's 192 tiled at 256) at the 128 tiles
# spill (dK/dV 2.9 KB at 256, 7-12 KB everywhere at 512) and the dQ tile needs 262 KB of shared memory at 256 (sm_90
# has 227 KB per block). These tiles compile for sm_90 without spills at every flag on Triton 3.9, within the shared
# memory (benchmarks/results/kernel-compile-sm90-wide.md; on 3.6 the sparse forward at 256 spills 20 bytes): 32
# query rows on 8 warps (mma.sync laid along the keys; 128-row wgmma tiles at 256 spill 48-256 bytes with offload's
# CARRY / ACCUMULATE), 32 or 16 keys per dK/dV step. Whether a spilling wgmma tile is faster is for a GPU to say
# (OOMB_TRITON_AUTOTUNE=1 tries the space). Narrower pages take the next width's tiles, masked (tile_width): at 192
# the dense forward spills 20 bytes (ptxas keeps it at 128 registers; 0 at 256), the rest compile as at 256; latent
# pages (576) tile at 1,024 with the 512 tiles, as when they were stored at 1,024: dQ's needs 272 KB of shared memory
# and falls back (smaller_configs) to 32 x 16 at 2 stages, 208 KB, spilling 8-228 bytes; dK/dV spills 0.3-1.3 KB.
SM90_WIDE_DEFAULTS = {
    256: {"forward": (32, 64, 8, 3), "dkdv": (16, 32, 8, 2), "dq": (32, 64, 8, 2)},
    512: {"forward": (32, 32, 8, 2), "dkdv": (16, 16, 8, 2), "dq": (32, 32, 8, 2)},
}
# GPUs without wgmma (sm_80 A100; sm_86 / sm_89 / sm_120: RTX 30 / 40 / 50, A10, L4, L40S) run every MMA as mma.sync,
# and all but sm_80 have 99 KB of shared memory per block (101,376 bytes): the sm_90 dQ tile needs 102,404 bytes
# there (and spills 0.6-1.3 KB), the wide dQ tiles 102,400 and 139,264 — Triton refuses to load them. These tiles
# fit 99 KB at every flag (offline compile for sm_89, sm_120 and sm_80; sm_89 on Triton 3.9 and 3.6:
# benchmarks/results/kernel-compile-sm89.md): at head dim 128 the forward and dQ take 32 keys per step, dK/dV keeps
# its tile (78 KB); the wide dQ tiles are halved. Spills: at most 64 bytes on sm_89 (dQ at 128 with a selection),
# 188 on sm_120, 104 on sm_80. Speed on those GPUs is not measured.
MMA_SYNC_DEFAULTS = {
    128: {"forward": (128, 32, 8, 3), "dkdv": (16, 128, 8, 2), "dq": (128, 32, 8, 3)},
    256: {"forward": (32, 64, 8, 3), "dkdv": (16, 32, 8, 2), "dq": (32, 32, 8, 2)},
    512: {"forward": (32, 32, 8, 2), "dkdv": (16, 16, 8, 2), "dq": (16, 16, 8, 2)},
}


def wgmma(arch: int) -> bool:
    """Whether the GPU of compute capability ``arch`` (``10 * major + minor``) gets the sm_90 tiles: Hopper and the
    data-centre Blackwells (227 KB of shared memory per block); the others get :data:`MMA_SYNC_DEFAULTS`."""
    return 90 <= arch < 120


def shipped_tile(
    kernel: str, head_dim: int, arch: int = 90, fused_dq: bool = False
) -> tuple[int, int, int, int]:
    """The default ``(BLOCK_M, BLOCK_N, warps, stages)`` of ``kernel`` at ``head_dim`` on a GPU of compute
    capability ``arch`` (:func:`wgmma`): :data:`SM90_DEFAULTS` up to 128, :data:`SM90_WIDE_DEFAULTS` for wider heads
    (the next width up), or :data:`MMA_SYNC_DEFAULTS` likewise; ``fused_dq``: the dK/dV kernel's computing dQ too
    (:data:`SM90_FUSED_DQ_DEFAULT` where it would take :data:`SM90_DEFAULTS`' tile)."""
    tables = {128: SM90_DEFAULTS, **SM90_WIDE_DEFAULTS} if wgmma(arch) else MMA_SYNC_DEFAULTS
    width = next((w for w in sorted(tables) if head_dim <= w), max(tables))
    if fused_dq and kernel == "dkdv" and tables[width] is SM90_DEFAULTS:
        return SM90_FUSED_DQ_DEFAULT
    return tables[width][kernel]


def _device_arch() -> int:
    """The current CUDA device's compute capability as ``10 * major + minor`` (90 without CUDA)."""
    return _arch_of(torch.cuda.current_device()) if torch.cuda.is_available() else 90


@functools.cache
def _arch_of(device: int) -> int:
    major, minor = torch.cuda.get_device_capability(device)
    return 10 * major + minor


def _configs(kernel: str, tiles: list[tuple[int, int]], stages: tuple[int, ...]):
    """Tuning space: the kernel's default (:data:`SM90_DEFAULTS`) first, then ``tiles`` x warps x ``stages``, each
    tile in every variant of :data:`SM90_VARIANTS` (the default's first)."""
    if _interpreting():
        variant = SM90_VARIANTS.get(kernel, ({},))[0]
        return [triton.Config({"BLOCK_M": 16, "BLOCK_N": 16, **variant}, num_warps=1, num_stages=1)]
    space = [SM90_DEFAULTS[kernel]] + [(m, n, w, st) for m, n in tiles for w in (4, 8) for st in stages]
    return [config for tile in dict.fromkeys(space) for config in _tile_configs(kernel, tile)]


def _tile_configs(
    kernel: str, tile: tuple[int, int, int, int], variants=SM90_VARIANTS
) -> list[triton.Config]:
    """``tile`` in every variant of ``variants`` (:data:`SM90_VARIANTS`; the default's first)."""
    m, n, w, st = tile
    return [triton.Config({"BLOCK_M": m, "BLOCK_N": n, **variant}, num_warps=w, num_stages=st)
            for variant in variants.get(kernel, ({},))]  # fmt: skip


def _autotune() -> bool:
    """``OOMB_TRITON_AUTOTUNE=1``: tune at the first call of each key; unset or ``0``: the shipped default tiles."""
    return os.environ.get("OOMB_TRITON_AUTOTUNE", "0") not in ("", "0")


def _fitted(c: triton.Config, mma_rows: str, page: int, sparse: bool) -> triton.Config:
    """``c`` fitted to a call: ``BLOCK_N`` clamped to ``PAGE`` (key blocks never straddle pages) and, with
    ``SPARSE``, ``BLOCK_M`` too (a query tile lies inside one selection block and divides it); then at most
    ``rows / 16`` warps for an MMA of ``rows >= 64`` rows (``mma_rows``: its M). On sm_90 such an MMA is a wgmma whose
    warps tile the rows 16 each (chained dots put every warp on M), so more warps would compute the same rows twice
    (8 warps on 64 rows: both warpgroups do the same ``Q K^T``); a smaller MMA is an ``mma.sync`` laid out along N."""
    kw = {**c.kwargs, "BLOCK_N": min(c.kwargs["BLOCK_N"], page)}
    if sparse:
        kw["BLOCK_M"] = min(kw["BLOCK_M"], page)
    rows, warps = kw[mma_rows], c.num_warps
    if rows >= 64:
        warps = min(warps, rows // 16)
    return triton.Config(kw, num_warps=warps, num_stages=c.num_stages)


def _pruner(mma_rows: str, factor: int, max_regs: int = 64, head: int = 1, kernel: str | None = None):
    """``early_config_prune`` for a kernel whose MMAs have ``mma_rows`` rows and whose fp32 accumulators hold
    ``factor * <mma_rows>`` rows of ``HEAD_DIM``: every config fitted to the call (:func:`_fitted`; duplicates
    dropped), and of the rest those needing at most ``max_regs`` accumulator registers per thread. The limits are
    measured (``benchmarks/kernel_compile.py --all``, sm_90, head_dim 128): 64 for the forward and dQ (their 128-row
    tiles on 4 warps spill 0.1-4 KB), 128 for dK/dV (its duplication-free 128-key tiles on 8 warps need it; at 16
    queries per step they do not spill). The default (first) always stays. With tuning off (the default,
    :func:`_autotune`) only the default is kept; with ``OOMB_TRITON_TUNE_CONFIGS=N`` at most N, the first ``head``
    (the default tile in each of its variants) among them (:func:`_spread`). ``prune.space(configs, **key)``: the
    whole space. ``kernel`` (``"forward"``, ``"dkdv"``, ``"dq"``): the default tile is that kernel's
    :func:`shipped_tile` for the call's ``HEAD_DIM`` and the device (``ARCH`` in the key, else the current one's)."""

    def space(configs: list[triton.Config], **kwargs) -> list[triton.Config]:
        arch = kwargs.get("ARCH") or _device_arch()
        own = kernel and shipped_tile(kernel, kwargs["HEAD_DIM"], arch, kwargs.get("FUSED_DQ", False))
        if own and own != SM90_DEFAULTS[kernel] and not _interpreting():
            # this width's and device's default first
            configs = _tile_configs(kernel, own, OTHER_VARIANTS) + configs[head:]
        kept = {}
        for i, c in enumerate(configs):
            f = _fitted(c, mma_rows, kwargs["PAGE"], kwargs.get("SPARSE", False))
            key = (*sorted(f.kwargs.items()), f.num_warps, f.num_stages)
            width = tile_width(kwargs["HEAD_DIM"])
            if i == 0 or factor * f.kwargs[mma_rows] * width <= max_regs * 32 * f.num_warps:
                kept.setdefault(key, f)
        return list(kept.values())

    def prune(configs: list[triton.Config], named_args: dict, **kwargs) -> list[triton.Config]:
        kept = space(configs, **kwargs)
        return _spread(kept, _tune_cap(), head) if _autotune() else kept[:1]

    prune.space, prune.mma_rows = space, mma_rows
    return prune


def tuning_space(tuner, key: dict) -> list[triton.Config]:
    """The configs an autotuned kernel of this module tries for ``key`` (``HEAD_DIM``, ``PAGE``, ``SPARSE``; ``ARCH``:
    a compute capability, default the current device's; dK/dV's ``FUSED_DQ``), the default first."""
    return tuner.early_config_prune.space(tuner.configs, **key)


def default_config(tuner, key: dict) -> triton.Config:
    """The config a kernel runs with when tuning is off: its shipped default fitted to ``key``."""
    return tuning_space(tuner, key)[0]


def smaller_configs(config: triton.Config, mma_rows: str, page: int, sparse: bool) -> list[triton.Config]:
    """``config``, then configs needing less shared memory, fitted as it is (:func:`_fitted`): fewer stages, then the
    key tile halved, then the query tile too (at least 16 each) — what :func:`_launch` falls back to on a GPU whose
    shared memory the shipped tile does not fit."""
    m, n = config.kwargs["BLOCK_M"], config.kwargs["BLOCK_N"]
    tiles = dict.fromkeys([(m, n), (m, max(16, n // 2)), (max(16, m // 2), max(16, n // 2)), (16, 16)])
    found = {}
    for tm, tn in tiles:
        for stages in range(config.num_stages, 0, -1):
            kw = {**config.kwargs, "BLOCK_M": tm, "BLOCK_N": tn}
            c = _fitted(
                triton.Config(kw, num_warps=config.num_warps, num_stages=stages), mma_rows, page, sparse
            )
            found.setdefault((*sorted(c.kwargs.items()), c.num_warps, c.num_stages), c)
    return list(found.values())


def _launch(tuner, grid, *args, **kwargs) -> None:
    """Run an autotuned kernel: through its autotuner with ``OOMB_TRITON_AUTOTUNE=1``, else straight at
    :func:`default_config` for the call's key and device (recorded in ``tuner.cache``) — no benchmarking on any
    Triton version. Where the device's shared memory does not hold that tile (Triton refuses to load it), the
    first of :func:`smaller_configs` that loads is used from then on."""
    if _autotune():
        tuner[grid](*args, **kwargs)
        return
    arch = _device_arch()
    key = (
        "default",
        arch,
        kwargs["HEAD_DIM"],
        kwargs["PAGE"],
        kwargs["SPARSE"],
        kwargs.get("FUSED_DQ", False),
    )
    config = tuner.cache.get(key)
    if config is not None:
        tuner.fn.run(*args, grid=grid, warmup=False, **kwargs, **config.all_kwargs())
        return
    default = default_config(tuner, dict(zip(("ARCH", "HEAD_DIM", "PAGE", "SPARSE", "FUSED_DQ"), key[1:])))
    refused = None
    fallbacks = smaller_configs(default, tuner.early_config_prune.mma_rows, kwargs["PAGE"], kwargs["SPARSE"])
    for config in fallbacks:
        try:  # Triton checks shared memory when it loads the compiled kernel, before any launch
            tuner.fn.run(*args, grid=grid, warmup=False, **kwargs, **config.all_kwargs())
        except OutOfResources as err:
            refused = refused or err
            continue
        tuner.cache[key] = config
        return
    raise refused


def fused_dq() -> bool:
    """Whether the dK/dV kernel computes dQ too (``OOMB_TRITON_FUSED_DQ=1``; off by default until a GPU has
    measured it, ``benchmarks/tile_sweep.py``): each tile's dS, made for dK, times K, added atomically into an fp32
    dQ — the dQ kernel, which recomputes P and dP, is not launched (5 matmuls per query-key tile instead of 7, as
    FlashAttention-2's backward). Exact up to rounding, but the adds' order varies from run to run."""
    return os.environ.get("OOMB_TRITON_FUSED_DQ", "0") != "0"


def _tune_cap() -> int | None:
    """``OOMB_TRITON_TUNE_CONFIGS`` as a positive int (``None``: unset, every config; read when tuning)."""
    value = os.environ.get("OOMB_TRITON_TUNE_CONFIGS", "")
    if not value:
        return None
    if not value.isdigit() or int(value) < 1:
        raise ValueError(
            f"OOMB_TRITON_TUNE_CONFIGS={value!r} must be a positive number of configs to try per kernel and tuning "
            "key with OOMB_TRITON_AUTOTUNE=1 (unset: all)."
        )
    return int(value)


def _spread(configs: list, cap: int | None, head: int = 1) -> list:
    """At most ``cap`` of ``configs``: the first ``head`` (the default) and the rest evenly spaced over the list up
    to its last, so a capped search still spans the tiles."""
    if cap is None or len(configs) <= cap:
        return configs
    if cap <= head:
        return configs[:cap]
    tail, picks = configs[head - 1 :], cap - head + 1  # (picks >= 2: the head's last and the list's last)
    return configs[: head - 1] + [tail[round(i * (len(tail) - 1) / (picks - 1))] for i in range(picks)]


class _Restore:
    """Autotune hooks of a kernel that updates tensors in place: tuning runs it once per config (and repeat), so
    what it can touch is saved before each run and put back after it. ``touched(nargs)`` lists ``(tensor, rows)``
    pairs: the rows ``rows`` (int64) of dim 0, or the whole tensor for ``None``."""

    def __init__(self, touched) -> None:
        self.touched = touched
        self.saved: list | None = None

    def pre(self, nargs: dict, reset_only: bool = False) -> None:
        if not reset_only:
            self.saved = [(t, r, t.clone() if r is None else t[r]) for t, r in self.touched(nargs)]

    def post(self, nargs: dict, exception: Exception | None = None) -> None:
        for t, r, copy in self.saved:
            if r is None:
                t.copy_(copy)
            else:
                t.index_copy_(0, r, copy)
        self.saved = None


def _range_slots(nargs: dict) -> torch.Tensor:
    """Slots of the pages the dK/dV kernel writes: those of keys ``[first_key, key_hi)`` (only their page-table
    entries are valid)."""
    page = nargs["PAGE"]
    return nargs["TABLE"][:, nargs["first_key"] // page : triton.cdiv(nargs["key_hi"], page)].flatten().long()


# the gradient pages of the call's key range — never a whole arena; the forward state; the dQ accumulator
_restore_grad_pages = _Restore(
    lambda a: (
        [(a["DK"], _range_slots(a)), (a["DV"], _range_slots(a))]
        + ([(a["DQ"], None)] if a.get("FUSED_DQ") else [])
    )
)
_restore_state = _Restore(lambda a: [(a[n], None) for n in ("OUT", "LSE", "L")] if a["CARRY"] else [])
_restore_dq = _Restore(lambda a: [(a["DQ"], None)] if a["ACCUMULATE"] else [])


# ------------------------------------------------------------------------------------------- shared helpers
@triton.constexpr_function
def tile_width(head_dim: int) -> int:
    """The tiles' head dim for tensors ``head_dim`` wide: the next power of two (``tl.arange``), at least 16 (the
    K of an MMA). Pages and the chunk's tensors keep ``head_dim``; the columns beyond it are never read (0 in the
    tiles: they add nothing to a score, and their outputs are never written) — :func:`_load`, :func:`_store`."""
    return max(16, triton.next_power_of_2(head_dim))


@triton.constexpr_function
def _narrow(head_dim: int) -> bool:
    """Whether tensors ``head_dim`` wide are narrower than the tiles: their accesses need a column mask."""
    return tile_width(head_dim) != head_dim


@triton.jit
def _mask(ok, d, MASK: tl.constexpr, HEAD_DIM: tl.constexpr):
    """The mask of a tile access whose head-dim offsets are ``d`` (broadcastable to the tile): ``ok`` with
    ``MASK``, and the first ``HEAD_DIM`` columns where the tile is wider than the tensors (:func:`tile_width`)."""
    if not _narrow(HEAD_DIM):
        return ok
    elif MASK:
        return ok & (d < HEAD_DIM)
    else:
        return d < HEAD_DIM


@triton.jit
def _load(ptrs, ok, d, MASK: tl.constexpr, HEAD_DIM: tl.constexpr):
    """``ptrs``' tile, 0 outside :func:`_mask` (``ok``: only read with ``MASK``). Whether a mask exists at all is
    decided at compile time: a tile as wide as the tensors without ``MASK`` is a plain load."""
    if MASK or _narrow(HEAD_DIM):
        return tl.load(ptrs, mask=_mask(ok, d, MASK, HEAD_DIM), other=0.0)
    else:
        return tl.load(ptrs)


@triton.jit
def _store(ptrs, x, ok, d, MASK: tl.constexpr, HEAD_DIM: tl.constexpr):
    """Store the tile ``x`` within :func:`_mask` (as :func:`_load`)."""
    if MASK or _narrow(HEAD_DIM):
        tl.store(ptrs, x, mask=_mask(ok, d, MASK, HEAD_DIM))
    else:
        tl.store(ptrs, x)


@triton.jit
def _clamp(x, lo, hi):
    return tl.minimum(tl.maximum(x, lo), hi)


@triton.jit
def _key_blocks(q_first, q_last, first_min, first_max, key_lo, key_hi, BLOCK_N: tl.constexpr):
    """Key blocks in ``[key_lo, key_hi)`` seen by query positions ``[q_first, q_last]`` whose first visible keys
    span ``[first_min, first_max]``: ``[lo, full_lo)`` and ``[full_hi, hi)`` need masks (window edge or document
    start, causal diagonal, ragged end), ``[full_lo, full_hi)`` is visible to every query. ``key_lo`` is a multiple
    of ``BLOCK_N``; clamping keeps the three ranges a partition. Blocks before ``first_min`` are never visited."""
    key_end = tl.cdiv(key_hi, BLOCK_N) * BLOCK_N
    lo = tl.maximum(first_min, 0) // BLOCK_N * BLOCK_N
    hi = tl.cdiv(q_last + 1, BLOCK_N) * BLOCK_N
    full_lo = tl.cdiv(tl.maximum(first_max, 0), BLOCK_N) * BLOCK_N
    full_hi = tl.maximum((q_first + 1) // BLOCK_N * BLOCK_N, full_lo)
    return (_clamp(lo, key_lo, key_end), _clamp(full_lo, key_lo, key_end),
            _clamp(full_hi, key_lo, key_end), _clamp(hi, key_lo, key_end))  # fmt: skip


@triton.jit
def _query_blocks(
    k_first, q_start, rows_seeing_last, rows_seeing_first, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr
):
    """Query blocks (local indices) that see keys ``[k_first, k_first + BLOCK_N)``: ``[lo, full_lo)`` and
    ``[full_hi, hi)`` need masks, ``[full_lo, full_hi)`` see every key of the block (and are all valid rows).
    ``rows_seeing_last`` / ``rows_seeing_first``: how many leading rows have a first visible key at or before the
    block's last / first key (rows' first keys never decrease)."""
    k_last = k_first + BLOCK_N - 1
    # query i sees key j iff first_i <= j <= q_start + i
    lo = tl.maximum(k_first - q_start, 0) // BLOCK_M * BLOCK_M
    hi = tl.cdiv(tl.maximum(rows_seeing_last, 0), BLOCK_M) * BLOCK_M
    full_lo = tl.minimum(tl.cdiv(tl.maximum(k_last - q_start, 0), BLOCK_M) * BLOCK_M, hi)
    full_hi = tl.maximum(tl.maximum(rows_seeing_first, 0) // BLOCK_M * BLOCK_M, full_lo)
    return lo, full_lo, full_hi, hi


@triton.jit
def _listed_blocks(
    SEL, n_sel, x_lo, x_mid, x_hi, PAGE: tl.constexpr, BLOCK_N: tl.constexpr, K_P2: tl.constexpr
):
    """A query block's selected pages ``SEL[0 : 2 * n_sel : 2]`` (ascending, ``-1``-padded) enumerate their key
    blocks page by page, ``PAGE // BLOCK_N`` each (:func:`_key_block`): the flat indices of the first listed blocks
    at or after key positions ``x_lo <= x_mid <= x_hi`` (multiples of ``BLOCK_N``), so that ``[x_lo, x_mid)`` and
    ``[x_mid, x_hi)`` become index ranges. One vector load of the list, no search."""
    offs = tl.arange(0, K_P2)
    pages = tl.load(SEL + 2 * offs, mask=offs < n_sel, other=-1)
    listed, starts = pages >= 0, pages * PAGE
    t_lo = tl.sum(tl.where(listed, _clamp(x_lo - starts, 0, PAGE), 0), 0) // BLOCK_N
    t_mid = tl.sum(tl.where(listed, _clamp(x_mid - starts, 0, PAGE), 0), 0) // BLOCK_N
    t_hi = tl.sum(tl.where(listed, _clamp(x_hi - starts, 0, PAGE), 0), 0) // BLOCK_N
    return t_lo, t_mid, t_hi


@triton.jit
def _key_block(
    TABLE, SEL, it, stride_ks, stride_kp, PAGE: tl.constexpr, BLOCK_N: tl.constexpr, LISTED: tl.constexpr
):
    """The key block of loop index ``it`` — the one starting there (a contiguous walk in ``BLOCK_N`` steps), or with
    ``LISTED`` the ``it``-th key block of the selected pages (a walk in steps of 1, :func:`_listed_blocks`) — as its
    first key position and its first key's element offset in the K/V arenas (less the head part). ``SEL`` holds each
    listed page next to its slot (:func:`_selection_args`): the slot is read at an address that follows ``it``, as
    the page table's in a contiguous walk, so the loop pipelines as the dense one does (no page-then-slot chain of
    dependent loads); the page only where a mask needs the position."""
    if LISTED:
        j = it // (PAGE // BLOCK_N)
        in_page = it % (PAGE // BLOCK_N) * BLOCK_N
        start_n = tl.load(SEL + 2 * j) * PAGE + in_page
        base = tl.load(SEL + 2 * j + 1).to(tl.int64) * stride_ks + in_page * stride_kp
    else:
        start_n = it
        base = _page_offset(TABLE, start_n, stride_ks, PAGE) + (start_n % PAGE) * stride_kp
    return tl.multiple_of(start_n, BLOCK_N), base


@triton.jit
def _page_offset(TABLE, start_n, stride_ks, PAGE: tl.constexpr):
    """Element offset of key ``start_n`` (a block start; blocks never straddle pages) in a K/V arena, minus the
    head and token-in-page parts: ``slot * stride_ks`` in int64 (arenas exceed 2**31 elements)."""
    slot = tl.load(TABLE + start_n // PAGE).to(tl.int64)
    return slot * stride_ks


@triton.jit
def _tanh(x):
    """tanh from exp2 (portable: the interpreter and every GPU backend); exact at the saturated ends."""
    return 1.0 - 2.0 / (tl.math.exp2(x * (2.0 * _LOG2E)) + 1.0)


@triton.jit
def _scores(qk, qk_scale, cap, SOFTCAP: tl.constexpr):
    """Base-2 scores from raw ``q . k``: ``qk * scale * log2(e)``; with ``SOFTCAP`` (``qk_scale = scale / c``,
    ``cap = c * log2(e)``) the capped ``c * tanh(qk * scale / c) * log2(e)``. Also returns the tanh (the backward's
    chain rule: d(c tanh(x / c)) / dx = 1 - tanh^2); without ``SOFTCAP`` that slot is unused."""
    if SOFTCAP:
        t = _tanh(qk * qk_scale)
        return t * cap, t
    else:
        return qk * qk_scale, qk


@triton.jit
def _visible(q_pos, k_pos, first):
    """Query position ``q_pos`` sees key position ``k_pos`` iff ``first <= k_pos <= q_pos`` (``first``: the row's
    first visible key — its window's start or, packed, its document's; callers broadcast them to a tile)."""
    return (k_pos <= q_pos) & (k_pos >= first)


@triton.jit
def _firsts(FIRST, rows, q_pos, window, ROWS: tl.constexpr):
    """The rows' first visible keys: loaded (``ROWS``: windows and document starts folded by the launcher) or
    from the window alone."""
    if ROWS:
        return tl.load(FIRST + rows)
    else:
        return q_pos - window + 1


@triton.jit
def _load_keys(
    K, V, base, start_n, key_hi, stride_kp, stride_kd,
    HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr, MASK: tl.constexpr, V_T: tl.constexpr,
):  # fmt: skip
    """Key positions, ``K^T [D, BLOCK_N]`` and ``V [BLOCK_N, D]`` (``V^T`` with ``V_T``; ``D`` the tiles' head dim,
    :func:`tile_width`) of the key block at ``start_n`` whose first key is ``base`` elements into the arenas
    (:func:`_key_block`); ``K``/``V`` point at the program's KV head. With ``MASK`` keys ``>= key_hi`` (ragged last
    page, end of the key range) are never read."""
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, tile_width(HEAD_DIM))
    kt_ptrs = K + base + offs_n[None, :] * stride_kp + offs_d[:, None] * stride_kd
    if V_T:
        v_ptrs = V + base + offs_n[None, :] * stride_kp + offs_d[:, None] * stride_kd
    else:
        v_ptrs = V + base + offs_n[:, None] * stride_kp + offs_d[None, :] * stride_kd
    k_pos = start_n + offs_n
    kt = _load(kt_ptrs, k_pos[None, :] < key_hi, offs_d[:, None], MASK, HEAD_DIM)
    if V_T:
        v = _load(v_ptrs, k_pos[None, :] < key_hi, offs_d[:, None], MASK, HEAD_DIM)
    else:
        v = _load(v_ptrs, k_pos[:, None] < key_hi, offs_d[None, :], MASK, HEAD_DIM)
    return k_pos, kt, v


@triton.jit
def _query_block(
    Q, K, V, TABLE, FIRST, SEL, stride_qb, stride_qh, stride_qm, stride_qd, stride_kh, stride_tb,
    num_heads, group, q_len, q_start, key_lo, key_hi, window, n_sel,
    HEAD_DIM: tl.constexpr, PAGE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, ROWS: tl.constexpr,
    SPARSE: tl.constexpr, K_P2: tl.constexpr,
):  # fmt: skip
    """Set-up of a program that owns one query block of one head (forward and dQ): its rows, their ``q``, the
    ``K``/``V``/``TABLE`` pointers moved to its KV head and batch row, the rows' first visible keys and the key-block
    ranges. With ``SPARSE`` (the tile lies in one selection block): ``SEL`` moved to the block's list and the flat
    ranges of its listed past blocks that need a mask / need none (:func:`_listed_blocks`; a past key is never on
    the causal diagonal), while the key-block ranges cover only the chunk's own keys."""
    if SPARSE:
        tl.static_assert(PAGE % BLOCK_M == 0, "sparse query tiles must divide the page (see _pruner)")
    start_m = tl.program_id(0) * BLOCK_M
    bh = tl.program_id(1)
    b = bh // num_heads
    h = bh % num_heads
    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, tile_width(HEAD_DIM))
    row_ok = offs_m < q_len
    q_ptrs = Q + b * stride_qb + h * stride_qh + offs_m[:, None] * stride_qm + offs_d[None, :] * stride_qd
    q = _load(q_ptrs, row_ok[:, None], offs_d[None, :], True, HEAD_DIM)
    kv_head = (h // group) * stride_kh
    K += kv_head
    V += kv_head
    TABLE += b * stride_tb
    rows = bh * q_len + offs_m
    row_offs = rows[:, None] * HEAD_DIM + offs_d[None, :]  # (out, dO, dQ, a state's acc: contiguous)
    q_pos = q_start + offs_m
    q_last = q_start + tl.minimum(start_m + BLOCK_M, q_len) - 1
    first = _firsts(FIRST + b * q_len, tl.where(row_ok, offs_m, 0), q_pos, window, ROWS)
    first_min = tl.min(tl.where(row_ok, first, q_last + 1))
    first_max = tl.max(tl.where(row_ok, first, -1))
    if SPARSE:
        past_lo, past_full, past_hi, _ = _key_blocks(q_start + start_m, q_last, first_min, first_max, key_lo,
                                                     tl.minimum(key_hi, q_start), BLOCK_N)  # fmt: skip
        SEL += (b * tl.cdiv(q_len, PAGE) + start_m // PAGE) * 2 * n_sel  # (page, slot) pairs
        t_lo, t_full, t_hi = _listed_blocks(SEL, n_sel, past_lo, past_full, past_hi, PAGE, BLOCK_N, K_P2)
        key_lo = tl.maximum(key_lo, q_start)
    else:
        t_lo, t_full, t_hi = 0, 0, 0
    lo, full_lo, full_hi, hi = _key_blocks(
        q_start + start_m, q_last, first_min, first_max, key_lo, key_hi, BLOCK_N
    )
    return (q, K, V, TABLE, SEL, rows, row_offs, row_ok, q_pos, first, lo, full_lo, full_hi, hi,
            t_lo, t_full, t_hi)  # fmt: skip


# ---------------------------------------------------------------------------------------------------- forward
@triton.jit
def _fwd_inner(
    acc, l_i, m_i, q, K, V, TABLE, SEL,
    stride_ks, stride_kp, stride_kd,
    q_pos, first, lo, hi, key_hi, qk_scale, cap,
    HEAD_DIM: tl.constexpr, PAGE: tl.constexpr, BLOCK_N: tl.constexpr, MASK: tl.constexpr, PRECISION: tl.constexpr,
    SOFTCAP: tl.constexpr, LISTED: tl.constexpr,
):  # fmt: skip
    """Online softmax over key blocks ``[lo, hi)`` (``LISTED``: the selected pages' blocks ``lo..hi - 1``,
    :func:`_key_block`); ``K``/``V`` already point at this program's KV head."""
    for it in range(lo, hi, 1 if LISTED else BLOCK_N):
        start_n, base = _key_block(TABLE, SEL, it, stride_ks, stride_kp, PAGE, BLOCK_N, LISTED)
        k_pos, kt, v = _load_keys(
            K, V, base, start_n, key_hi, stride_kp, stride_kd, HEAD_DIM, BLOCK_N, MASK, False
        )
        # s_ij = q_i . k_j * scale * log2(e)  (soft-capped: c * tanh(q_i . k_j * scale / c) * log2(e))
        s, _ = _scores(tl.dot(q, kt, input_precision=PRECISION), qk_scale, cap, SOFTCAP)
        if MASK:
            s = tl.where(_visible(q_pos[:, None], k_pos[None, :], first[:, None]), s, _MASKED)
        # m_new = max(m_i, rowmax(s)); alpha rescales what was summed under the old max
        m_new = tl.maximum(m_i, tl.max(s, 1))
        p = tl.math.exp2(s - m_new[:, None])
        alpha = tl.math.exp2(m_i - m_new)
        # l_i = alpha * l_i + rowsum(p); acc = alpha * acc + p @ v
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None]
        acc = tl.dot(p.to(v.dtype), v, acc, input_precision=PRECISION)
        m_i = m_new
    return acc, l_i, m_i


@triton.jit
def _fwd_walk(
    acc, l_i, m_i, q, K, V, TABLE, SEL,
    stride_ks, stride_kp, stride_kd,
    q_pos, first, lo, full_lo, full_hi, hi, key_hi, qk_scale, cap,
    HEAD_DIM: tl.constexpr, PAGE: tl.constexpr, BLOCK_N: tl.constexpr, PRECISION: tl.constexpr,
    SOFTCAP: tl.constexpr, LISTED: tl.constexpr,
):  # fmt: skip
    """The window edge (or document starts), then the blocks every query sees, then the causal diagonal and the
    ragged last page: ``[lo, full_lo)`` and ``[full_hi, hi)`` masked, ``[full_lo, full_hi)`` not; ``LISTED`` (past
    pages) the first two only."""
    acc, l_i, m_i = _fwd_inner(acc, l_i, m_i, q, K, V, TABLE, SEL, stride_ks, stride_kp, stride_kd, q_pos, first, lo,
                               full_lo, key_hi, qk_scale, cap, HEAD_DIM, PAGE, BLOCK_N, True, PRECISION, SOFTCAP,
                               LISTED)  # fmt: skip
    acc, l_i, m_i = _fwd_inner(acc, l_i, m_i, q, K, V, TABLE, SEL, stride_ks, stride_kp, stride_kd, q_pos, first,
                               full_lo, full_hi, key_hi, qk_scale, cap, HEAD_DIM, PAGE, BLOCK_N, False, PRECISION,
                               SOFTCAP, LISTED)  # fmt: skip
    if not LISTED:  # (past pages are never on the diagonal)
        acc, l_i, m_i = _fwd_inner(acc, l_i, m_i, q, K, V, TABLE, SEL, stride_ks, stride_kp, stride_kd, q_pos, first,
                                   full_hi, hi, key_hi, qk_scale, cap, HEAD_DIM, PAGE, BLOCK_N, True, PRECISION,
                                   SOFTCAP, LISTED)  # fmt: skip
    return acc, l_i, m_i


@triton.autotune(
    configs=_configs("forward", [(64, 64), (64, 128), (128, 64), (128, 128)], stages=(2, 3)),
    key=["HEAD_DIM", "PAGE", "SPARSE"],
    prune_configs_by={
        "early_config_prune": _pruner("BLOCK_M", 1, kernel="forward")
    },  # acc [BLOCK_M, HEAD_DIM]
    pre_hook=_restore_state.pre,
    post_hook=_restore_state.post,
)
@triton.jit
def _fwd_kernel(
    Q, K, V, TABLE, FIRST, SEL, OUT, LSE, L, VISITS,
    stride_qb, stride_qh, stride_qm, stride_qd,
    stride_ks, stride_kh, stride_kp, stride_kd,
    stride_tb,
    num_heads, group, q_len, q_start, key_lo, key_hi, window, qk_scale, cap, n_sel,
    HEAD_DIM: tl.constexpr, PAGE: tl.constexpr, PRECISION: tl.constexpr, CARRY: tl.constexpr,
    SOFTCAP: tl.constexpr, ROWS: tl.constexpr, COUNT: tl.constexpr, SPARSE: tl.constexpr, K_P2: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):  # fmt: skip
    """Keys ``[key_lo, key_hi)``. Without ``CARRY``: writes ``OUT``, ``LSE``. With ``CARRY``: ``OUT``, ``LSE``, ``L``
    are a carried state's ``acc``, ``m`` (natural log), ``l`` (fp32), updated in place. With ``SPARSE`` the keys
    before ``q_start`` are those of the block's selected pages (``SEL [B, R, n_sel, 2]``: each with its slot)."""
    q, K, V, TABLE, SEL, rows, row_offs, row_ok, q_pos, first, lo, full_lo, full_hi, hi, t_lo, t_full, t_hi = (
        _query_block(Q, K, V, TABLE, FIRST, SEL, stride_qb, stride_qh, stride_qm, stride_qd, stride_kh, stride_tb,
                     num_heads, group, q_len, q_start, key_lo, key_hi, window, n_sel, HEAD_DIM, PAGE, BLOCK_M,
                     BLOCK_N, ROWS, SPARSE, K_P2)
    )  # fmt: skip
    if COUNT:  # key blocks this program visits (tests and benchmarks)
        tiles = tl.maximum(hi - lo, 0) // BLOCK_N
        if SPARSE:
            tiles += t_hi - t_lo
        tl.atomic_add(VISITS, tiles)

    cols = tl.arange(0, tile_width(HEAD_DIM))[None, :]
    if CARRY:  # the state's max is in natural-log units, the kernel's in base 2
        m_in = tl.load(LSE + rows, mask=row_ok, other=0.0)
        m_start = m_in * _LOG2E
        m_i = m_start
        l_i = tl.load(L + rows, mask=row_ok, other=0.0)
        acc = _load(OUT + row_offs, row_ok[:, None], cols, True, HEAD_DIM)
    else:
        m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
        l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
        acc = tl.zeros([BLOCK_M, tile_width(HEAD_DIM)], dtype=tl.float32)
    if SPARSE:  # the selected past pages: window edge / document starts masked, the rest not
        acc, l_i, m_i = _fwd_walk(acc, l_i, m_i, q, K, V, TABLE, SEL, stride_ks, stride_kp, stride_kd, q_pos, first,
                                  t_lo, t_full, t_hi, t_hi, key_hi, qk_scale, cap, HEAD_DIM, PAGE, BLOCK_N,
                                  PRECISION, SOFTCAP, True)  # fmt: skip
    acc, l_i, m_i = _fwd_walk(acc, l_i, m_i, q, K, V, TABLE, SEL, stride_ks, stride_kp, stride_kd, q_pos, first, lo,
                              full_lo, full_hi, hi, key_hi, qk_scale, cap, HEAD_DIM, PAGE, BLOCK_N, PRECISION,
                              SOFTCAP, False)  # fmt: skip

    # with CARRY an unchanged max keeps its exact natural-log value: a row that saw no key stays bit-identical
    if CARRY:
        tl.store(LSE + rows, tl.where(m_i == m_start, m_in, m_i / _LOG2E), mask=row_ok)
        tl.store(L + rows, l_i, mask=row_ok)
        _store(OUT + row_offs, acc, row_ok[:, None], cols, True, HEAD_DIM)
    else:  # out = acc / l_i; lse = ln(sum_j exp(s_j)) = (m_i + log2(l_i)) * ln(2)
        tl.store(LSE + rows, (m_i + tl.math.log2(l_i)) / _LOG2E, mask=row_ok)
        out_ptrs = OUT + row_offs
        _store(out_ptrs, (acc / l_i[:, None]).to(OUT.dtype.element_ty), row_ok[:, None], cols, True, HEAD_DIM)


# --------------------------------------------------------------------------------------------------- backward
@triton.jit
def _bwd_preprocess(OUT, DOUT, DELTA, num_rows, HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr):
    """``delta_i = sum_d dO_id * O_id`` over contiguous ``[rows, HEAD_DIM]``."""
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.arange(0, tile_width(HEAD_DIM))[None, :]
    offs = rows[:, None] * HEAD_DIM + cols
    ok = rows < num_rows
    o = _load(OUT + offs, ok[:, None], cols, True, HEAD_DIM).to(tl.float32)
    do = _load(DOUT + offs, ok[:, None], cols, True, HEAD_DIM).to(tl.float32)
    tl.store(DELTA + rows, tl.sum(o * do, 1), mask=ok)


@triton.jit
def _bwd_dkdv_inner(
    dk, dv, k, v, Q, DO, LSE, DELTA, FIRST, DQ, INV,
    stride_qh, stride_qm, stride_qd,
    k_pos, lo, hi, heads, q_start, q_len, window, qk_scale, cap, scale,
    HEAD_DIM: tl.constexpr, PAGE: tl.constexpr, BLOCK_M: tl.constexpr, MASK: tl.constexpr, PRECISION: tl.constexpr,
    SOFTCAP: tl.constexpr, ROWS: tl.constexpr, FUSED_DQ: tl.constexpr, LISTED: tl.constexpr,
):  # fmt: skip
    """Add the contributions of query blocks ``[lo, hi)`` of ``heads`` consecutive query heads to this key block's
    ``dk``, ``dv`` ``[BLOCK_N, HEAD_DIM]``; scores are kept transposed (keys x queries). ``Q``/``DO``/``LSE``/
    ``DELTA`` (and ``DQ``) point at the first head's rows, the next head's are ``stride_qh`` (``Q``) or ``q_len``
    rows further. The heads' tiles are one loop, head after head: one pipeline across the heads, and no loop over
    heads around it whose invariants (the first tiles' addresses and masks) the compiler would keep in registers.
    ``LISTED``: ``[lo, hi)`` are tiles of the listing query blocks ``INV[0], INV[1], ...`` (``PAGE // BLOCK_M``
    tiles each). ``FUSED_DQ``: also add the key block's share of dQ into fp32 ``DQ`` (atomically: every key block
    of the rows adds into them)."""
    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, tile_width(HEAD_DIM))
    # a tile's addresses: a scalar base (its first row) plus offsets that are the same for every tile
    qt_offs = offs_m[None, :] * stride_qm + offs_d[:, None] * stride_qd
    do_offs = offs_m[:, None] * HEAD_DIM + offs_d[None, :]
    step: tl.constexpr = 1 if LISTED else BLOCK_M
    per_head = tl.maximum(hi - lo, 0) // step
    end = lo + per_head * step
    g = tl.full([], 0, tl.int32)  # the head, and the tile in it
    it = lo
    for _ in range(0, per_head * heads):
        if LISTED:
            start_m = tl.load(INV + it // (PAGE // BLOCK_M)) * PAGE + it % (PAGE // BLOCK_M) * BLOCK_M
        else:
            start_m = it
        start_m = tl.multiple_of(start_m, BLOCK_M)
        rows = start_m + offs_m
        row = g * q_len + start_m  # the tile's first row in DO, LSE, DELTA, DQ
        qt_ptrs = (Q + g * stride_qh + start_m * stride_qm) + qt_offs
        do_ptrs = (DO + row * HEAD_DIM) + do_offs
        ok = offs_m < q_len - start_m  # (MASK: the rows of the chunk)
        qt = _load(qt_ptrs, ok[None, :], offs_d[:, None], MASK, HEAD_DIM)
        do = _load(do_ptrs, ok[:, None], offs_d[None, :], MASK, HEAD_DIM)
        if MASK:
            lse = tl.load(LSE + row + offs_m, mask=ok, other=0.0)
            delta = tl.load(DELTA + row + offs_m, mask=ok, other=0.0)
        else:
            lse = tl.load(LSE + row + offs_m)
            delta = tl.load(DELTA + row + offs_m)
        # p^T_ji = exp(s_ij - lse_i), computed as exp2(s * log2(e) - lse * log2(e))
        st, tt = _scores(tl.dot(k, qt, input_precision=PRECISION), qk_scale, cap, SOFTCAP)
        pt = tl.math.exp2(st - lse[None, :] * _LOG2E)
        if MASK:
            first = _firsts(FIRST, tl.where(ok, rows, 0), q_start + rows, window, ROWS)
            seen = _visible(q_start + rows[None, :], k_pos[:, None], first[None, :])
            pt = tl.where(seen & ok[None, :], pt, 0.0)
        # dV += P^T dO
        dv = tl.dot(pt.to(do.dtype), do, dv, input_precision=PRECISION)
        # dS^T = P^T * (dP^T - delta), dP^T = V dO^T;  dK += dS^T Q (scaled once at the end)
        dpt = tl.dot(v, tl.trans(do), input_precision=PRECISION)
        dst = pt * (dpt - delta[None, :])
        if SOFTCAP:
            dst = dst * (1.0 - tt * tt)
        dk = tl.dot(dst.to(qt.dtype), tl.trans(qt), dk, input_precision=PRECISION)
        if FUSED_DQ:  # dQ += dS K (the dQ kernel's recomputation of P and dP saved)
            dq = tl.dot(tl.trans(dst.to(qt.dtype)), k, input_precision=PRECISION) * scale
            dq_ptrs = (DQ + row * HEAD_DIM) + do_offs
            if MASK or _narrow(HEAD_DIM):
                tl.atomic_add(
                    dq_ptrs, dq, mask=_mask(ok[:, None], offs_d[None, :], MASK, HEAD_DIM), sem="relaxed"
                )
            else:
                tl.atomic_add(dq_ptrs, dq, sem="relaxed")
        it += step
        g = tl.where(it == end, g + 1, g)
        it = tl.where(it == end, lo, it)
    return dk, dv


@triton.jit
def _bwd_dkdv_walk(
    dk, dv, k, v, Q, DO, LSE, DELTA, FIRST, DQ, INV,
    b, h, heads, num_heads, stride_qb, stride_qh, stride_qm, stride_qd,
    k_pos, lo, full_lo, full_hi, hi, q_start, q_len, window, qk_scale, cap, scale,
    HEAD_DIM: tl.constexpr, PAGE: tl.constexpr, BLOCK_M: tl.constexpr, PRECISION: tl.constexpr,
    SOFTCAP: tl.constexpr, ROWS: tl.constexpr, SPLIT: tl.constexpr, FUSED_DQ: tl.constexpr, LISTED: tl.constexpr,
):  # fmt: skip
    """Add the query blocks ``[lo, hi)`` of query heads ``h .. h + heads - 1`` (of batch row ``b``) to ``dk``,
    ``dv``, each range walked for all of them in one loop (:func:`_bwd_dkdv_inner`): with
    ``SPLIT`` ``[lo, full_lo)`` and ``[full_hi, hi)`` masked, ``[full_lo, full_hi)`` not; else all masked.
    ``LISTED``: tiles of the listing query blocks ``INV`` (:func:`_bwd_dkdv_inner`), every one seeing the whole key
    block (with ``SPLIT`` only the unmasked loop is compiled)."""
    q_head = Q + b * stride_qb + h * stride_qh
    row0 = (b * num_heads + h) * q_len
    do_head, dq_head = DO + row0 * HEAD_DIM, DQ + row0 * HEAD_DIM
    if SPLIT:
        if not LISTED:
            dk, dv = _bwd_dkdv_inner(dk, dv, k, v, q_head, do_head, LSE + row0, DELTA + row0, FIRST + b * q_len,
                                     dq_head, INV, stride_qh, stride_qm, stride_qd, k_pos, lo, full_lo, heads,
                                     q_start, q_len, window, qk_scale, cap, scale, HEAD_DIM, PAGE, BLOCK_M, True,
                                     PRECISION, SOFTCAP, ROWS, FUSED_DQ, LISTED)  # fmt: skip
        dk, dv = _bwd_dkdv_inner(dk, dv, k, v, q_head, do_head, LSE + row0, DELTA + row0, FIRST + b * q_len,
                                 dq_head, INV, stride_qh, stride_qm, stride_qd, k_pos, full_lo, full_hi, heads,
                                 q_start, q_len, window, qk_scale, cap, scale, HEAD_DIM, PAGE, BLOCK_M, False,
                                 PRECISION, SOFTCAP, ROWS, FUSED_DQ, LISTED)  # fmt: skip
        lo = full_hi
    if not (SPLIT and LISTED):
        dk, dv = _bwd_dkdv_inner(dk, dv, k, v, q_head, do_head, LSE + row0, DELTA + row0, FIRST + b * q_len,
                                 dq_head, INV, stride_qh, stride_qm, stride_qd, k_pos, lo, hi, heads, q_start, q_len,
                                 window, qk_scale, cap, scale, HEAD_DIM, PAGE, BLOCK_M, True, PRECISION, SOFTCAP,
                                 ROWS, FUSED_DQ, LISTED)  # fmt: skip
    return dk, dv


@triton.jit
def _full_listings(INV, n, rows_full, PAGE: tl.constexpr, R_P2: tl.constexpr):
    """How many of a page's listing query blocks ``INV[:n]`` (ascending) lie wholly below row ``rows_full`` — a
    prefix of the list: one vector load of it, no search."""
    offs = tl.arange(0, R_P2)
    listing = tl.load(INV + offs, mask=offs < n, other=0)
    return tl.sum(((offs < n) & (listing * PAGE + PAGE <= rows_full)).to(tl.int32), 0)


@triton.autotune(
    configs=_configs("dkdv", [(16, 128), (32, 64), (32, 128)], stages=(2, 3)),  # 64 queries or 4 stages spill
    key=["HEAD_DIM", "PAGE", "SPARSE", "FUSED_DQ"],
    # dk, dv [BLOCK_N, HEAD_DIM]; a capped search tries the default tile with both loops
    prune_configs_by={"early_config_prune": _pruner("BLOCK_N", 2, 128, len(SM90_VARIANTS["dkdv"]), "dkdv")},
    pre_hook=_restore_grad_pages.pre,
    post_hook=_restore_grad_pages.post,
)
@triton.jit
def _bwd_dkdv_kernel(
    Q, K, V, DO, LSE, DELTA, TABLE, DK, DV, FIRST, SEEING, VISITS, INV_PTR, INV_IDX, WORK, DQ,
    stride_qb, stride_qh, stride_qm, stride_qd,
    stride_ks, stride_kh, stride_kp, stride_kd,
    stride_tb,
    num_heads, kv_heads, group, q_len, q_start, first_key, key_hi, window, scale, qk_scale, cap, past_pages, n_work,
    page_lo, ordered,
    HEAD_DIM: tl.constexpr, PAGE: tl.constexpr, PRECISION: tl.constexpr, SOFTCAP: tl.constexpr,
    ROWS: tl.constexpr, COUNT: tl.constexpr, SPARSE: tl.constexpr, R_P2: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr, SPLIT: tl.constexpr = False, FUSED_DQ: tl.constexpr = False,
    ONE_GRAD: tl.constexpr = False,
):  # fmt: skip
    """Key blocks from the one holding ``first_key`` up to ``key_hi`` (keys >= ``key_hi`` are never read);
    ``FUSED_DQ``: dQ too, added into fp32 ``DQ`` (see :func:`fused_dq`). With
    ``SPARSE`` a past key block (before ``q_start``) is seen by the query blocks whose lists hold its page:
    ``INV_IDX[INV_PTR[p] : INV_PTR[p + 1]]`` for ``p = b * past_pages + page`` (ascending; :func:`_inverse_lists`),
    and only listed pages do work: programs go to the chunk's own key blocks from ``max(first_key, q_start)`` first
    (the longest), then ``n_work * PAGE // BLOCK_N`` to past key blocks — with ``ordered`` (a call over every past
    page) those of ``WORK[b]``'s first ``n_work`` pages, the most listed first (:class:`SelectionLists`), else
    those of the pages from ``page_lo``; an unlisted page's program reads and writes nothing; the listing blocks
    that see the whole page are walked as one loop over their tiles (``R_P2``: the query blocks rounded up to a
    power of two, the size of the list's vector load), the others one by one. ``SPLIT``: the query blocks that see
    the whole key block run in a loop of their own, without the mask (see :data:`SM90_DEFAULTS`)."""
    if SPARSE:
        tl.static_assert(PAGE % BLOCK_M == 0, "sparse query tiles must divide the page (see _pruner)")
    bh, pid = tl.program_id(1), tl.program_id(0)
    if SPARSE:  # launched in order of key block, each for every (row, KV head): the own ones all start first
        flat = bh * tl.num_programs(0) + pid
        bh, pid = flat % tl.num_programs(1), flat // tl.num_programs(1)
    b = bh // kv_heads
    kv_head = bh % kv_heads
    # with SPARSE: first the chunk's own key blocks (the longest programs: most query blocks see them, so they start
    # first and do not trail the step), then the past pages' (the most listed first, where the call has them all)
    if SPARSE:
        per_page = PAGE // BLOCK_N
        own_first = tl.maximum(first_key, q_start) // BLOCK_N
        own = tl.maximum(tl.cdiv(key_hi, BLOCK_N) - own_first, 0)
        past = pid >= own
        i = (pid - own) // per_page  # the i-th past page: of WORK (every past page), or of [page_lo, ...)
        page = tl.where(ordered != 0, tl.load(WORK + b * past_pages + i, mask=past & (ordered != 0), other=0),
                        page_lo + i)  # fmt: skip
        start_n = tl.where(past, page * PAGE + (pid - own) % per_page * BLOCK_N, (own_first + pid) * BLOCK_N)
        start_n = tl.multiple_of(start_n, BLOCK_N)
        inv = INV_PTR + b * past_pages + start_n // PAGE
        j_lo = tl.load(inv, mask=past, other=0)
        j_hi = tl.load(inv + 1, mask=past, other=0)
        if past & (j_hi == j_lo):  # an unlisted page: nothing to read or write (only listed pages are read)
            return
    else:
        start_n = (first_key // BLOCK_N + tl.program_id(0)) * BLOCK_N
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, tile_width(HEAD_DIM))
    k_pos = start_n + offs_n
    key_ok = k_pos < key_hi
    # gradient pages have the K/V pages' layout: one offset serves K, V, dK and dV
    tokens = (start_n % PAGE + offs_n)[:, None]
    kv_base = _page_offset(TABLE + b * stride_tb, start_n, stride_ks, PAGE) + kv_head * stride_kh
    kv_offs = tokens * stride_kp + offs_d[None, :] * stride_kd
    k = _load(K + kv_base + kv_offs, key_ok[:, None], offs_d[None, :], True, HEAD_DIM)
    v = _load(V + kv_base + kv_offs, key_ok[:, None], offs_d[None, :], True, HEAD_DIM)
    tile_base = kv_base + (start_n % PAGE) * stride_kp  # the block's first token (the gradient pages' add)

    if ROWS:  # per page: rows whose first visible key is at or before the page's last / first key
        seeing = SEEING + (b * tl.cdiv(key_hi, PAGE) + start_n // PAGE) * 2
        rows_last, rows_first = tl.load(seeing), tl.load(seeing + 1)
    else:  # query i sees key j iff j <= q_start + i < j + window
        rows_last = tl.minimum(start_n + BLOCK_N - 1 + window - q_start, q_len)
        rows_first = tl.minimum(start_n + window - q_start, q_len)
    lo, full_lo, full_hi, hi = _query_blocks(start_n, q_start, rows_last, rows_first, BLOCK_M, BLOCK_N)
    # a past key block: of the listing blocks' rows, [0, full_hi) see all of it, [full_hi, hi) some
    if SPARSE:
        listed_full, listed_hi = full_hi, hi
        full_hi = tl.where(past, 0, full_hi)  # (lo = full_lo = 0 for a past block)
        hi = tl.where(past, 0, hi)
        n_full = _full_listings(INV_IDX + j_lo, j_hi - j_lo, listed_full, PAGE, R_P2)
        full_tiles = n_full * (PAGE // BLOCK_M)
        listed = full_tiles * group  # tiles of the listing blocks computed (every query head's)
    if COUNT:
        tl.atomic_add(VISITS, tl.maximum(hi - lo, 0) // BLOCK_M * group)
    dk = tl.zeros([BLOCK_N, tile_width(HEAD_DIM)], dtype=tl.float32)
    dv = tl.zeros([BLOCK_N, tile_width(HEAD_DIM)], dtype=tl.float32)
    # every query head that reads this KV head: heads h0 .. h0 + group - 1, walked in the loops of each range
    h0 = kv_head * group
    # this program is the only writer of these gradient-page rows: a plain read-modify-write at the end, no atomics
    # (and none at all for a key block no query sees: e.g. one before every document of the chunk, or an unlisted
    # page)
    work = hi > lo
    if SPARSE:
        if past:  # the query blocks listing the page (the dense ranges are empty: not walked)
            # the listing blocks that see the whole page: their tiles in one loop (pipelined across the blocks)
            dk, dv = _bwd_dkdv_walk(dk, dv, k, v, Q, DO, LSE, DELTA, FIRST, DQ, INV_IDX + j_lo, b, h0, group,
                                    num_heads, stride_qb, stride_qh, stride_qm, stride_qd, k_pos, 0, 0, full_tiles,
                                    full_tiles, q_start, q_len, window, qk_scale, cap, scale, HEAD_DIM, PAGE,
                                    BLOCK_M, PRECISION, SOFTCAP, ROWS, SPLIT, FUSED_DQ, True)  # fmt: skip
            # the others (a window edge, documents, the ragged end), one by one
            for j in range(j_lo + n_full, j_hi):
                r0 = tl.load(INV_IDX + j) * PAGE
                end = _clamp(listed_hi, r0, r0 + PAGE)
                dk, dv = _bwd_dkdv_walk(dk, dv, k, v, Q, DO, LSE, DELTA, FIRST, DQ, INV_IDX, b, h0, group,
                                        num_heads, stride_qb, stride_qh, stride_qm, stride_qd, k_pos, r0, r0,
                                        _clamp(listed_full, r0, r0 + PAGE), end, q_start, q_len, window, qk_scale,
                                        cap, scale, HEAD_DIM, PAGE, BLOCK_M, PRECISION, SOFTCAP, ROWS, SPLIT,
                                        FUSED_DQ, False)  # fmt: skip
                listed += (end - r0) // BLOCK_M * group
            work = listed > 0
        else:  # the chunk's own key block (no list: the listed walks are empty)
            dk, dv = _bwd_dkdv_walk(dk, dv, k, v, Q, DO, LSE, DELTA, FIRST, DQ, INV_IDX, b, h0, group, num_heads,
                                    stride_qb, stride_qh, stride_qm, stride_qd, k_pos, lo, full_lo, full_hi, hi,
                                    q_start, q_len, window, qk_scale, cap, scale, HEAD_DIM, PAGE, BLOCK_M, PRECISION,
                                    SOFTCAP, ROWS, SPLIT, FUSED_DQ, False)  # fmt: skip
    else:
        dk, dv = _bwd_dkdv_walk(dk, dv, k, v, Q, DO, LSE, DELTA, FIRST, DQ, INV_IDX, b, h0, group, num_heads,
                                stride_qb, stride_qh, stride_qm, stride_qd, k_pos, lo, full_lo, full_hi, hi, q_start,
                                q_len, window, qk_scale, cap, scale, HEAD_DIM, PAGE, BLOCK_M, PRECISION, SOFTCAP,
                                ROWS, SPLIT, FUSED_DQ, False)  # fmt: skip

    if SPARSE and COUNT:
        tl.atomic_add(VISITS, listed)
    if work:
        # the block's offsets again, from its first token: not the K/V loads' offsets, kept through the loops
        tile_offs = offs_n[:, None] * stride_kp + offs_d[None, :] * stride_kd
        cols = offs_d[None, :]
        dk_ptrs = (DK + tile_base) + tile_offs
        if ONE_GRAD:  # values are keys: one gradient page takes dK and dV, added once (no second read of it)
            dk = (_load(dk_ptrs, cols, cols, False, HEAD_DIM) + (dk * scale + dv)).to(DK.dtype.element_ty)
            _store(dk_ptrs, dk, cols, cols, False, HEAD_DIM)
        else:
            dk = (_load(dk_ptrs, cols, cols, False, HEAD_DIM) + dk * scale).to(DK.dtype.element_ty)
            _store(dk_ptrs, dk, cols, cols, False, HEAD_DIM)
            dv_ptrs = (DV + tile_base) + tile_offs
            dv = (_load(dv_ptrs, cols, cols, False, HEAD_DIM) + dv).to(DV.dtype.element_ty)
            _store(dv_ptrs, dv, cols, cols, False, HEAD_DIM)


@triton.jit
def _bwd_dq_inner(
    dq, q, do, lse, delta, K, V, TABLE, SEL,
    stride_ks, stride_kp, stride_kd,
    q_pos, first, lo, hi, key_hi, qk_scale, cap,
    HEAD_DIM: tl.constexpr, PAGE: tl.constexpr, BLOCK_N: tl.constexpr, MASK: tl.constexpr, PRECISION: tl.constexpr,
    SOFTCAP: tl.constexpr, LISTED: tl.constexpr,
):  # fmt: skip
    """Add key blocks ``[lo, hi)`` (``LISTED``: the selected pages' blocks ``lo..hi - 1``) to ``dq`` (unscaled);
    ``K``/``V`` already point at this program's KV head."""
    for it in range(lo, hi, 1 if LISTED else BLOCK_N):
        start_n, base = _key_block(TABLE, SEL, it, stride_ks, stride_kp, PAGE, BLOCK_N, LISTED)
        k_pos, kt, vt = _load_keys(
            K, V, base, start_n, key_hi, stride_kp, stride_kd, HEAD_DIM, BLOCK_N, MASK, True
        )
        # p_ij = exp(s_ij - lse_i)
        s, t = _scores(tl.dot(q, kt, input_precision=PRECISION), qk_scale, cap, SOFTCAP)
        p = tl.math.exp2(s - lse[:, None])
        if MASK:
            p = tl.where(_visible(q_pos[:, None], k_pos[None, :], first[:, None]), p, 0.0)
        # dS = P * (dO V^T - delta);  dQ += dS K
        ds = p * (tl.dot(do, vt, input_precision=PRECISION) - delta[:, None])
        if SOFTCAP:
            ds = ds * (1.0 - t * t)
        dq = tl.dot(ds.to(kt.dtype), tl.trans(kt), dq, input_precision=PRECISION)
    return dq


@triton.jit
def _bwd_dq_walk(
    dq, q, do, lse, delta, K, V, TABLE, SEL,
    stride_ks, stride_kp, stride_kd,
    q_pos, first, lo, full_lo, full_hi, hi, key_hi, qk_scale, cap,
    HEAD_DIM: tl.constexpr, PAGE: tl.constexpr, BLOCK_N: tl.constexpr, PRECISION: tl.constexpr,
    SOFTCAP: tl.constexpr, LISTED: tl.constexpr,
):  # fmt: skip
    """:func:`_fwd_walk`'s ranges for dQ."""
    dq = _bwd_dq_inner(dq, q, do, lse, delta, K, V, TABLE, SEL, stride_ks, stride_kp, stride_kd, q_pos, first, lo,
                       full_lo, key_hi, qk_scale, cap, HEAD_DIM, PAGE, BLOCK_N, True, PRECISION, SOFTCAP,
                       LISTED)  # fmt: skip
    dq = _bwd_dq_inner(dq, q, do, lse, delta, K, V, TABLE, SEL, stride_ks, stride_kp, stride_kd, q_pos, first,
                       full_lo, full_hi, key_hi, qk_scale, cap, HEAD_DIM, PAGE, BLOCK_N, False, PRECISION, SOFTCAP,
                       LISTED)  # fmt: skip
    if not LISTED:
        dq = _bwd_dq_inner(dq, q, do, lse, delta, K, V, TABLE, SEL, stride_ks, stride_kp, stride_kd, q_pos, first,
                           full_hi, hi, key_hi, qk_scale, cap, HEAD_DIM, PAGE, BLOCK_N, True, PRECISION, SOFTCAP,
                           LISTED)  # fmt: skip
    return dq


@triton.autotune(
    configs=_configs("dq", [(64, 32), (64, 64), (128, 32), (128, 64)], stages=(2, 3)),
    key=["HEAD_DIM", "PAGE", "SPARSE"],
    prune_configs_by={"early_config_prune": _pruner("BLOCK_M", 1, kernel="dq")},  # dq [BLOCK_M, HEAD_DIM]
    pre_hook=_restore_dq.pre,
    post_hook=_restore_dq.post,
)
@triton.jit
def _bwd_dq_kernel(
    Q, K, V, DO, LSE, DELTA, TABLE, DQ, FIRST, SEL,
    stride_qb, stride_qh, stride_qm, stride_qd,
    stride_ks, stride_kh, stride_kp, stride_kd,
    stride_tb,
    num_heads, group, q_len, q_start, key_lo, key_hi, window, scale, qk_scale, cap, n_sel,
    HEAD_DIM: tl.constexpr, PAGE: tl.constexpr, PRECISION: tl.constexpr, ACCUMULATE: tl.constexpr,
    SOFTCAP: tl.constexpr, ROWS: tl.constexpr, SPARSE: tl.constexpr, K_P2: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):  # fmt: skip
    """dQ over keys ``[key_lo, key_hi)``: written to ``DQ``, or with ``ACCUMULATE`` added into fp32 ``DQ``;
    ``SPARSE`` as in the forward."""
    q, K, V, TABLE, SEL, rows, row_offs, row_ok, q_pos, first, lo, full_lo, full_hi, hi, t_lo, t_full, t_hi = (
        _query_block(Q, K, V, TABLE, FIRST, SEL, stride_qb, stride_qh, stride_qm, stride_qd, stride_kh, stride_tb,
                     num_heads, group, q_len, q_start, key_lo, key_hi, window, n_sel, HEAD_DIM, PAGE, BLOCK_M,
                     BLOCK_N, ROWS, SPARSE, K_P2)
    )  # fmt: skip
    cols = tl.arange(0, tile_width(HEAD_DIM))[None, :]
    do = _load(DO + row_offs, row_ok[:, None], cols, True, HEAD_DIM)
    lse = tl.load(LSE + rows, mask=row_ok, other=0.0) * _LOG2E
    delta = tl.load(DELTA + rows, mask=row_ok, other=0.0)
    dq = tl.zeros([BLOCK_M, tile_width(HEAD_DIM)], dtype=tl.float32)
    if SPARSE:
        dq = _bwd_dq_walk(dq, q, do, lse, delta, K, V, TABLE, SEL, stride_ks, stride_kp, stride_kd, q_pos, first,
                          t_lo, t_full, t_hi, t_hi, key_hi, qk_scale, cap, HEAD_DIM, PAGE, BLOCK_N, PRECISION,
                          SOFTCAP, True)  # fmt: skip
    dq = _bwd_dq_walk(dq, q, do, lse, delta, K, V, TABLE, SEL, stride_ks, stride_kp, stride_kd, q_pos, first, lo,
                      full_lo, full_hi, hi, key_hi, qk_scale, cap, HEAD_DIM, PAGE, BLOCK_N, PRECISION, SOFTCAP,
                      False)  # fmt: skip
    dq = dq * scale
    if ACCUMULATE:  # this program is the only writer of these rows: a plain read-modify-write, no atomics
        dq = dq + _load(DQ + row_offs, row_ok[:, None], cols, True, HEAD_DIM)
    _store(DQ + row_offs, dq.to(DQ.dtype.element_ty), row_ok[:, None], cols, True, HEAD_DIM)


# -------------------------------------------------------------------------------------------------- launchers
def _check(
    q: torch.Tensor,
    k_pages: torch.Tensor,
    v_pages: torch.Tensor,
    page_table: torch.Tensor,
    q_start: int,
    key_range: tuple[int, int] | None,
):
    """Validate shapes/dtypes (cheap, before any launch); return ``(B, Hq, Lq, D, Hkv, P, key_lo, key_hi)``."""
    if q.numel() >= 2**31:  # the kernels' row offsets into q, out, dO, dQ are 32-bit
        raise ValueError(
            f"q {tuple(q.shape)} holds {q.numel():,} elements, over the kernels' 2**31 — attend fewer queries per "
            "call (a smaller chunk_size)."
        )
    key_lo, key_hi = check_call(q, k_pages, v_pages, page_table, q_start, key_range)
    b, hq, lq, d = q.shape
    hkv, page = k_pages.shape[1], k_pages.shape[2]
    if q.dtype not in _SUPPORTED or k_pages.dtype != q.dtype or v_pages.dtype != q.dtype:
        raise TypeError(
            f"paged attention kernels take {_SUPPORTED} with K/V pages in the query dtype; got q {q.dtype}, "
            f"pages {k_pages.dtype}/{v_pages.dtype} — use the torch reference backend for other dtypes."
        )
    if page < 16 or page & (page - 1):
        raise ValueError(f"page size={page} is not supported — the kernels need a power of two >= 16.")
    if not (k_pages.is_contiguous() and v_pages.is_contiguous()):
        raise ValueError("K/V arenas must be contiguous [slots, Hkv, P, D] tensors.")
    if q.device.type != "cuda" and not _interpreting():
        raise ValueError(
            f"the Triton kernels run on CUDA tensors, got {q.device} — use the torch reference backend, "
            "or set TRITON_INTERPRET=1 before importing csrc_triton (slow; for tests)."
        )
    if page_table.dtype != torch.int32 or page_table.stride(1) != 1:
        raise ValueError(
            f"page_table must be int32 [B={b}, n_pages] with unit last stride; got {page_table.dtype} "
            f"{tuple(page_table.shape)}."
        )
    return b, hq, lq, d, hkv, page, key_lo, key_hi


def _window(window: int | None, q_start: int, lq: int) -> int:
    """The window as a kernel int; ``None`` becomes one that excludes nothing (every key is > position - Lk)."""
    check_window(window)
    return q_start + lq if window is None else min(window, q_start + lq)


def _row_firsts(
    doc_start: torch.Tensor | None, q_start: int, lq: int, window: int | None
) -> torch.Tensor | None:
    """int32 ``[B, Lq]``: each query's first visible key, its document's start and its window's folded (``None``
    without documents: the kernels derive it from the window)."""
    if doc_start is None:
        return None
    first = doc_start.to(torch.int32)
    if window is not None:
        positions = torch.arange(q_start, q_start + lq, device=doc_start.device, dtype=torch.int32)
        first = torch.maximum(first, positions - window + 1)
    return first.contiguous()


def _rows_seeing(first: torch.Tensor, key_hi: int, page: int) -> torch.Tensor:
    """int32 ``[B, pages, 2]``: per key page, how many leading query rows have their first visible key at or before
    the page's last key, and at or before its first key (``first`` never decreases along a row)."""
    starts = torch.arange(0, triton.cdiv(key_hi, page) * page, page, device=first.device, dtype=torch.int32)
    bounds = (
        torch.stack([starts + page - 1, starts], -1)
        .expand(first.shape[0], -1, -1)
        .reshape(first.shape[0], -1)
    )
    return (
        torch.searchsorted(first, bounds.contiguous(), right=True).to(torch.int32).view(first.shape[0], -1, 2)
    )


def _inverse_lists(select: torch.Tensor, past_pages: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The selection inverted (CSR, int32): the query blocks listing row ``b``'s past page ``p`` are
    ``blocks[offsets[i] : offsets[i + 1]]`` with ``i = b * past_pages + p``, ascending. Built on the device with
    static shapes and no host sync (a stable sort of the entries by ``(b, page)``; padding sorts last)."""
    batch, blocks, width = select.shape
    rows = torch.arange(batch, device=select.device).view(-1, 1, 1) * past_pages
    valid = (select >= 0) & (select < past_pages)
    key = torch.where(valid, select.long() + rows, batch * past_pages).flatten()
    order = torch.argsort(key, stable=True)
    owners = torch.arange(blocks, device=select.device, dtype=torch.int32).view(1, -1, 1).expand_as(select)
    counts = torch.zeros(batch * past_pages + 1, dtype=torch.int32, device=select.device)
    counts.index_add_(0, key, torch.ones_like(key, dtype=torch.int32))
    offsets = torch.cumsum(counts, 0, dtype=torch.int32) - counts  # exclusive: [i] = entries of keys below i
    return offsets, owners.flatten()[order].contiguous()


class SelectionLists(NamedTuple):
    """What the dK/dV kernel reads of a selection (int32, built on the device without a host sync): the inverse
    lists (:func:`_inverse_lists`) and per row every past page, those listed by the most query blocks first
    (``work [B, past_pages]``; ties and the unlisted in page order) — the longest programs start first."""

    offsets: torch.Tensor
    blocks: torch.Tensor
    work: torch.Tensor


_last_selection: list = [None]  # (key, weak reference to the selection, what the launchers built from it)


def _built_from(select: torch.Tensor) -> dict:
    """What the launchers built from ``select`` (its :class:`SelectionLists`, its page-slot pairs per page table),
    kept for the last selection seen: offload's calls over the key parts of one chunk share it (up to 64 at 1M
    tokens), and would otherwise build the same each time (several small device ops, each a launch from the host).
    An in-place change of the selection (its version) starts afresh; an inference tensor (no version counter) keeps
    nothing."""
    if select.is_inference():
        return {}
    key = (select.data_ptr(), select._version, tuple(select.shape), select.device)
    last = _last_selection[0]
    if last is None or last[0] != key or last[1]() is not select:
        last = (key, weakref.ref(select), {})
        _last_selection[0] = last
    return last[2]


def _selection_lists(select: torch.Tensor, past_pages: int) -> SelectionLists:
    """:class:`SelectionLists` of ``select`` (kept: :func:`_built_from`)."""
    built = _built_from(select)
    lists = built.get(past_pages)
    if lists is None:
        offsets, blocks = _inverse_lists(select, past_pages)
        listings = (offsets[1:] - offsets[:-1])[: select.shape[0] * past_pages].view(
            select.shape[0], past_pages
        )
        work = torch.argsort(-listings, dim=1, stable=True).to(torch.int32)
        lists = built[past_pages] = SelectionLists(offsets, blocks, work)
    return lists


def _selection_args(select: torch.Tensor | None, page_table: torch.Tensor) -> tuple:
    """``(SEL, n_sel, K_P2)`` of the forward and dQ kernels: each selected page next to its slot (int32 ``[B, R, K,
    2]``: ``select`` and ``page_table[b, select[b, r, k]]``; ``-1`` padding gets page 0's slot, which no kernel
    reads), the list's width and that rounded up to a power of two (the vector load's size); without a selection a
    dummy pointer and sizes the kernels never use. The pairs are kept per page table (:func:`_built_from`; offload's
    staging buffers have a table each), which the entry holds so that its memory is not reused under the key — a
    table changed in place without torch's version counter knowing (a kernel's or a ``.data`` write) must not be
    reused with the same selection; an inference-mode table is not kept."""
    if select is None:
        return page_table, 0, 1
    if page_table.is_inference():  # no version counter to key on: built for this call only
        built, key = {}, None
    else:
        built = _built_from(select)
        key = (page_table.data_ptr(), page_table._version, page_table.shape, page_table.stride())
    pairs = built.get(key, (None, None))[1]
    if pairs is None:
        pages = select.flatten(1).clamp(0, page_table.shape[1] - 1).long()
        pairs = torch.stack((select, page_table.gather(1, pages).view(select.shape)), -1)
        built[key] = (page_table, pairs)
    return pairs, select.shape[2], triton.next_power_of_2(max(select.shape[2], 1))


def _score_scales(scale: float, softcap: float | None) -> tuple[float, float]:
    """``(qk_scale, cap)`` of :func:`_scores`: ``(scale * log2 e, unused)``, soft-capped ``(scale / c, c log2 e)``."""
    check_softcap(softcap)
    return (scale * LOG2E, 0.0) if softcap is None else (scale / softcap, softcap * LOG2E)


def _precision(dtype: torch.dtype) -> str:
    # fp32 inputs stay fp32 in the matmuls (tf32 would break parity with the reference); 16-bit inputs ignore it
    return "ieee" if dtype == torch.float32 else "tf32"


def _query_grid(q_len: int, heads: int):
    """One program per (query block, head)."""
    return lambda meta: (triton.cdiv(q_len, meta["BLOCK_M"]), heads)


def _key_grid(first_key: int, key_hi: int, heads: int, listed: tuple[int, int, int] | None = None):
    """One program per (key block from the one holding ``first_key`` to the one holding ``key_hi - 1``, head);
    ``listed=(slots, page, q_start)`` (a selection): per (key block from ``max(first_key, q_start)``, head), then
    per (key block of ``slots`` listed pages, head)."""
    if listed is None:
        return lambda meta: (triton.cdiv(key_hi, meta["BLOCK_N"]) - first_key // meta["BLOCK_N"], heads)
    slots, page, q_start = listed
    own = max(first_key, q_start)
    return lambda meta: (
        slots * (page // meta["BLOCK_N"])
        + max(0, triton.cdiv(key_hi, meta["BLOCK_N"]) - own // meta["BLOCK_N"]),
        heads,
    )


def attention_delta(out: torch.Tensor, dout: torch.Tensor) -> torch.Tensor:
    """``delta = rowsum(dout * out)`` fp32 ``[B, Hq, Lq]`` by the pre-pass kernel (``out``, ``dout``
    ``[B, Hq, Lq, D]`` in dtypes the kernels take): one read of each, no fp32 temporaries."""
    if out.shape != dout.shape or out.dim() != 4 or {out.dtype, dout.dtype} - set(_SUPPORTED):
        raise ValueError(
            f"attention_delta takes out and dout of one shape [B, Hq, Lq, D] in dtypes of {_SUPPORTED}; got "
            f"{out.dtype} {tuple(out.shape)} and {dout.dtype} {tuple(dout.shape)}."
        )
    d = out.shape[-1]
    delta = torch.empty(out.shape[:-1], dtype=torch.float32, device=out.device)
    rows = delta.numel()
    if rows:
        grid = (triton.cdiv(rows, 64),)
        _bwd_preprocess[grid](out.contiguous(), dout.contiguous(), delta, rows, HEAD_DIM=d, BLOCK_M=64)
    return delta


def paged_attention_forward(
    q: torch.Tensor,
    k_pages: torch.Tensor,
    v_pages: torch.Tensor,
    page_table: torch.Tensor,
    q_start: int,
    scale: float,
    window: int | None = None,
    *,
    key_range: tuple[int, int] | None = None,
    state: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
    softcap: float | None = None,
    doc_start: torch.Tensor | None = None,
    page_select: torch.Tensor | None = None,
    visits: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """``out [B, Hq, Lq, D]`` (dtype of ``q``, contiguous) and ``lse [B, Hq, Lq]`` (float32, natural log).

    ``key_range=(lo, hi)`` visits only the keys at positions ``[lo, hi)`` (page-table entries of other pages are
    never read). With ``state=(acc, m, l)`` (fp32, see the module docstring) the keys are folded into the state in
    place and ``None`` is returned. ``softcap``: scores ``c * tanh(q . k * scale / c)``. ``doc_start``: int
    ``[B, Lq]``, each query's document start (packed rows). ``page_select``: int32 ``[B, ceil(Lq / P), K]``, each
    query block's pages before ``q_start`` (sparse attention; the contract's rules): only those pages and the
    chunk's own are read. ``visits``: an int32 ``[1]`` counter the number of (query block, key block) tiles computed
    is added to."""
    b, hq, lq, d, hkv, page, key_lo, key_hi = _check(q, k_pages, v_pages, page_table, q_start, key_range)
    qk_scale, cap = _score_scales(scale, softcap)
    first = _row_firsts(check_doc_start(doc_start, (b, lq), q.device), q_start, lq, window)
    select = check_page_select(page_select, (b, lq), page, q_start, q.device)
    if state is None:
        out = torch.empty((b, hq, lq, d), dtype=q.dtype, device=q.device)
        lse = l_sum = torch.empty((b, hq, lq), dtype=torch.float32, device=q.device)
    else:
        out, lse, l_sum = state
        rows = (b, hq, lq)
        for name, x, shape in zip(("acc", "m", "l"), state, ((*rows, d), rows, rows)):
            check_buffer(f"state {name}", x, shape, torch.float32, q.device)
    if out.numel() == 0:
        return None if state is not None else (out, lse)
    sel, n_sel, k_p2 = _selection_args(select, page_table)
    _launch(
        _fwd_kernel, _query_grid(lq, b * hq),
        q, k_pages, v_pages, page_table, page_table if first is None else first, sel, out, lse, l_sum,
        lse if visits is None else visits,
        *q.stride(), *k_pages.stride(), page_table.stride(0),
        hq, hq // hkv, lq, q_start, key_lo, key_hi, _window(window, q_start, lq), qk_scale, cap, n_sel,
        HEAD_DIM=d, PAGE=page, PRECISION=_precision(q.dtype), CARRY=state is not None, SOFTCAP=softcap is not None,
        ROWS=first is not None, COUNT=visits is not None, SPARSE=select is not None, K_P2=k_p2,
    )  # fmt: skip
    return None if state is not None else (out, lse)


def paged_attention_backward(
    q: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    dout: torch.Tensor,
    k_pages: torch.Tensor,
    v_pages: torch.Tensor,
    dk_pages: torch.Tensor,
    dv_pages: torch.Tensor,
    page_table: torch.Tensor,
    q_start: int,
    scale: float,
    window: int | None = None,
    *,
    key_range: tuple[int, int] | None = None,
    delta: torch.Tensor | None = None,
    dq: torch.Tensor | None = None,
    softcap: float | None = None,
    doc_start: torch.Tensor | None = None,
    page_select: torch.Tensor | None = None,
    visits: torch.Tensor | None = None,
) -> torch.Tensor:
    """Return ``dq`` (dtype of ``q``) and **add** dK, dV of every page read into ``dk_pages``, ``dv_pages``
    (float32 or bfloat16 ``[slots, Hkv, P, D]``, same layout as the K/V arenas; one tensor for both where values
    are keys — ``v_pages`` is ``k_pages`` — which takes their sum, each tile read and written once).

    ``key_range=(lo, hi)``: only keys ``[lo, hi)`` (``out``, ``lse`` are still the final ones, over all keys).
    ``delta``: a precomputed ``rowsum(dout * out)`` (fp32 ``[B, Hq, Lq]``). ``dq``: an fp32 ``[B, Hq, Lq, D]``
    accumulator the contribution is added into (and which is returned). ``softcap``, ``doc_start``,
    ``page_select``: as in the forward (past pages no query block lists get nothing added, bit for bit);
    ``visits`` counts the dK/dV kernel's tiles."""
    b, hq, lq, d, hkv, page, key_lo, key_hi = _check(q, k_pages, v_pages, page_table, q_start, key_range)
    qk_scale, cap = _score_scales(scale, softcap)
    first = _row_firsts(check_doc_start(doc_start, (b, lq), q.device), q_start, lq, window)
    select = check_page_select(page_select, (b, lq), page, q_start, q.device)
    grads = (dk_pages, dv_pages)
    if any(g.shape != k_pages.shape or g.dtype not in _GRAD_DTYPES or not g.is_contiguous() for g in grads):
        raise ValueError(
            f"dK/dV arenas must be contiguous {_GRAD_DTYPES} tensors shaped like the K/V arenas "
            f"{tuple(k_pages.shape)}; got {[(tuple(g.shape), g.dtype) for g in grads]}."
        )
    accumulate, fused = dq is not None, fused_dq()
    if accumulate:
        check_buffer("dq", dq, (b, hq, lq, d), torch.float32, q.device)
    elif fused:  # the dK/dV kernel adds into it
        dq = torch.zeros((b, hq, lq, d), dtype=torch.float32, device=q.device)
    else:
        dq = torch.empty((b, hq, lq, d), dtype=q.dtype, device=q.device)
    if dq.numel() == 0:
        return dq if accumulate else dq.to(q.dtype)
    dout, lse = dout.contiguous(), lse.contiguous()
    window = _window(window, q_start, lq)
    if delta is None:
        delta = attention_delta(out, dout)
    else:
        check_buffer("delta", delta, (b, hq, lq), torch.float32, q.device)

    precision = _precision(q.dtype)
    first_key = max(0, q_start - window + 1, key_lo)  # keys before q_start - window + 1 are in no window
    if first_key < key_hi:
        seeing = page_table if first is None else _rows_seeing(first, key_hi, page)
        past_pages = q_start // page
        lists, listed, page_lo, ordered = SelectionLists(*[page_table] * 3), None, 0, 0
        if select is not None:
            lists = _selection_lists(select, past_pages)
            page_lo = min(first_key // page, past_pages)  # the key range's past pages
            page_hi = max(page_lo, triton.cdiv(min(key_hi, q_start), page))
            ordered = int(page_lo == 0 and page_hi == past_pages)  # all of them: the most listed first
            # every past page: as many as some list names, at most one per entry; else each page of the range
            slots = min(past_pages, select.shape[1] * select.shape[2]) if ordered else page_hi - page_lo
            listed = (slots, page, q_start)
        _launch(
            _bwd_dkdv_kernel, _key_grid(first_key, key_hi, b * hkv, listed),
            q, k_pages, v_pages, dout, lse, delta, page_table, dk_pages, dv_pages,
            page_table if first is None else first, seeing, lse if visits is None else visits, *lists,
            dq if fused else lse, *q.stride(), *k_pages.stride(), page_table.stride(0),
            hq, hkv, hq // hkv, lq, q_start, first_key, key_hi, window, scale, qk_scale, cap, past_pages,
            0 if listed is None else listed[0], page_lo, ordered,
            HEAD_DIM=d, PAGE=page, PRECISION=precision, SOFTCAP=softcap is not None, ROWS=first is not None,
            COUNT=visits is not None, SPARSE=select is not None, FUSED_DQ=fused,
            R_P2=1 if select is None else triton.next_power_of_2(select.shape[1]),
            ONE_GRAD=dk_pages.data_ptr() == dv_pages.data_ptr(),
        )  # fmt: skip
    if fused:
        return dq if accumulate else dq.to(q.dtype)
    sel, n_sel, k_p2 = _selection_args(select, page_table)
    _launch(
        _bwd_dq_kernel, _query_grid(lq, b * hq),
        q, k_pages, v_pages, dout, lse, delta, page_table, dq, page_table if first is None else first, sel,
        *q.stride(), *k_pages.stride(), page_table.stride(0),
        hq, hq // hkv, lq, q_start, key_lo, key_hi, window, scale, qk_scale, cap, n_sel,
        HEAD_DIM=d, PAGE=page, PRECISION=precision, ACCUMULATE=accumulate, SOFTCAP=softcap is not None,
        ROWS=first is not None, SPARSE=select is not None, K_P2=k_p2,
    )  # fmt: skip
    return dq
