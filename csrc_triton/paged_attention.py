"""Paged causal attention, forward and backward, as Triton kernels.

One chunk's queries ``q [B, Hq, Lq, D]`` at absolute positions ``[q_start, q_start + Lq)`` attend to the keys
``[0, q_start + Lq)`` stored in pages: arenas ``[slots, Hkv, P, D]`` and ``page_table [B, n_pages]`` (row ``b``'s
page ``j`` is slot ``page_table[b, j]``). Query ``i`` sees key ``j`` iff ``j <= q_start + i`` and, with a sliding
``window`` W, ``j > q_start + i - W`` (lower-right causal). Query head ``h`` reads KV head ``h // (Hq // Hkv)``;
K/V are never repeated. Every ``(b, j)`` must name its own slot. The plain-torch oracle is
``lightning_oomb.engine.reference``.

Kernels (FlashAttention-2 style; softmax in base 2 with ``qk_scale = scale * log2(e)``, the returned ``lse`` is
the natural log):

- ``_fwd_kernel``: one program per (query block, query head); walks the key blocks it can see through the page
  table, keeping the running max ``m_i``, normaliser ``l_i`` and accumulator ``acc``.
- ``_bwd_preprocess``: ``delta_i = rowsum(dO_i * O_i)``.
- ``_bwd_dkdv_kernel``: one program per (key block, KV head) **owns** that block of the K/V pages: it loops over
  every query head of its group and every query block that sees it, accumulates dK, dV in registers and adds them
  into the gradient pages with a plain load + add + store.
- ``_bwd_dq_kernel``: one program per (query block, query head) recomputes P and accumulates dQ over key blocks.

Why owner programs and a separate dQ kernel rather than atomics: each gradient-page element has exactly one
writer, so there are no atomics at all — the result is deterministic, bf16 gradient pages work on every Triton
version (bf16 ``atomic_add`` does not), and no fp32 dQ scratch or atomic traffic is needed; the price is
recomputing ``Q K^T`` and ``dO V^T`` in both kernels (7 instead of 5 matmuls). The Triton fused-attention
tutorial makes the same trade for Hopper; FlashAttention-2's CUDA kernel instead adds dQ atomically into fp32.

Every key range is split into blocks that need no mask (all their keys visible to every query of the block) and
the few on the causal diagonal / window edge / ragged last page that do; blocks nobody sees are never visited.
Tiles, warps and stages come from ``triton.autotune`` keyed on ``HEAD_DIM`` and ``PAGE`` (and the dtypes), over
spaces pruned of tiles whose accumulators spill (checked with ptxas for sm_90); tuning happens at the first call
of each key (``TRITON_CACHE_AUTOTUNING=1`` keeps the result on disk, ``OOMB_TRITON_AUTOTUNE=0`` skips tuning and
uses each kernel's default tile). The dK/dV kernel's tuning runs restore only the gradient pages of the call's
page table, never a whole arena. Under ``TRITON_INTERPRET=1`` one tiny config is used so CPU tests stay fast.
"""

from __future__ import annotations

import math
import os

import torch
import triton
import triton.language as tl

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


def _configs(default: tuple[int, int, int, int], tiles: list[tuple[int, int]], stages: tuple[int, ...]):
    """Tuning space: ``default`` ``(BLOCK_M, BLOCK_N, warps, stages)`` first, then ``tiles`` x warps x ``stages``."""
    if _interpreting():
        return [triton.Config({"BLOCK_M": 16, "BLOCK_N": 16}, num_warps=1, num_stages=1)]
    space = [default] + [(m, n, w, st) for m, n in tiles for w in (4, 8) for st in stages]
    return [
        triton.Config({"BLOCK_M": m, "BLOCK_N": n}, num_warps=w, num_stages=st)
        for m, n, w, st in dict.fromkeys(space)
    ]


def _pruner(accumulator_rows: str, factor: int):
    """``early_config_prune`` for a kernel whose fp32 accumulators hold ``factor * <accumulator_rows>`` rows of
    ``HEAD_DIM``: clamps ``BLOCK_N`` to ``PAGE`` (key blocks never straddle pages) and drops tiles needing more than
    64 accumulator registers per thread (they spill: ptxas for sm_90 at head_dim 128). With
    ``OOMB_TRITON_AUTOTUNE=0`` only the default (first) config is kept: no tuning at the first call."""

    def prune(configs: list[triton.Config], named_args: dict, **kwargs) -> list[triton.Config]:
        kept = {}
        for c in configs:
            kw = {**c.kwargs, "BLOCK_N": min(c.kwargs["BLOCK_N"], kwargs["PAGE"])}
            key = (kw["BLOCK_M"], kw["BLOCK_N"], c.num_warps, c.num_stages)
            if factor * kw[accumulator_rows] * kwargs["HEAD_DIM"] <= 64 * 32 * c.num_warps or not kept:
                kept.setdefault(key, triton.Config(kw, num_warps=c.num_warps, num_stages=c.num_stages))
        tune = os.environ.get("OOMB_TRITON_AUTOTUNE", "1") != "0"
        return list(kept.values()) if tune else list(kept.values())[:1]

    return prune


class _RestoreGradPages:
    """Autotune hooks of the dK/dV kernel: tuning runs it several times and it adds in place, so the gradient pages
    it can touch (those of this call's page table) are saved before each run and restored after it."""

    def __init__(self) -> None:
        self.saved: tuple[torch.Tensor, ...] | None = None

    def pre(self, nargs: dict, reset_only: bool = False) -> None:
        if not reset_only:
            slots = nargs["TABLE"].flatten().long()
            self.saved = (slots, nargs["DK"][slots], nargs["DV"][slots])

    def post(self, nargs: dict, exception: Exception | None = None) -> None:
        slots, dk, dv = self.saved
        nargs["DK"].index_copy_(0, slots, dk)
        nargs["DV"].index_copy_(0, slots, dv)
        self.saved = None


_restore_grad_pages = _RestoreGradPages()


# ------------------------------------------------------------------------------------------- shared helpers
@triton.jit
def _key_blocks(q_first, q_last, window, BLOCK_N: tl.constexpr):
    """Key blocks seen by query positions ``[q_first, q_last]``: ``[lo, full_lo)`` and ``[full_hi, hi)`` need
    masks (window edge, causal diagonal), ``[full_lo, full_hi)`` is visible to every query."""
    lo = tl.maximum(q_first - window + 1, 0) // BLOCK_N * BLOCK_N
    hi = tl.cdiv(q_last + 1, BLOCK_N) * BLOCK_N
    full_lo = tl.cdiv(tl.maximum(q_last - window + 1, 0), BLOCK_N) * BLOCK_N
    full_hi = tl.maximum((q_first + 1) // BLOCK_N * BLOCK_N, full_lo)
    return lo, full_lo, full_hi, hi


@triton.jit
def _query_blocks(k_first, q_start, q_len, window, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """Query blocks (local indices) that see keys ``[k_first, k_first + BLOCK_N)``: ``[lo, full_lo)`` and
    ``[full_hi, hi)`` need masks, ``[full_lo, full_hi)`` see every key of the block (and are all valid rows)."""
    k_last = k_first + BLOCK_N - 1
    # query i sees key j iff j <= q_start + i < j + window
    lo = tl.maximum(k_first - q_start, 0) // BLOCK_M * BLOCK_M
    hi = tl.cdiv(tl.maximum(tl.minimum(k_last + window - q_start, q_len), 0), BLOCK_M) * BLOCK_M
    full_lo = tl.minimum(tl.cdiv(tl.maximum(k_last - q_start, 0), BLOCK_M) * BLOCK_M, hi)
    full_hi = tl.maximum(
        tl.maximum(tl.minimum(k_first + window - q_start, q_len), 0) // BLOCK_M * BLOCK_M, full_lo
    )
    return lo, full_lo, full_hi, hi


@triton.jit
def _page_offset(TABLE, start_n, stride_ks, PAGE: tl.constexpr):
    """Element offset of key ``start_n`` (a block start; blocks never straddle pages) in a K/V arena, minus the
    head and token-in-page parts: ``slot * stride_ks`` in int64 (arenas exceed 2**31 elements)."""
    slot = tl.load(TABLE + start_n // PAGE).to(tl.int64)
    return slot * stride_ks


@triton.jit
def _visible(q_pos, k_pos, window):
    """Query position ``q_pos`` sees key position ``k_pos`` (callers broadcast them to a tile)."""
    return (k_pos <= q_pos) & (k_pos > q_pos - window)


# ---------------------------------------------------------------------------------------------------- forward
@triton.jit
def _fwd_inner(
    acc, l_i, m_i, q, K, V, TABLE,
    stride_ks, stride_kp, stride_kd,
    q_pos, lo, hi, num_keys, window, qk_scale,
    HEAD_DIM: tl.constexpr, PAGE: tl.constexpr, BLOCK_N: tl.constexpr, MASK: tl.constexpr, PRECISION: tl.constexpr,
):  # fmt: skip
    """Online softmax over key blocks ``[lo, hi)``; ``K``/``V`` already point at this program's KV head."""
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM)
    for start_n in range(lo, hi, BLOCK_N):
        start_n = tl.multiple_of(start_n, BLOCK_N)
        base = _page_offset(TABLE, start_n, stride_ks, PAGE) + (start_n % PAGE) * stride_kp
        kt_ptrs = K + base + offs_n[None, :] * stride_kp + offs_d[:, None] * stride_kd
        v_ptrs = V + base + offs_n[:, None] * stride_kp + offs_d[None, :] * stride_kd
        k_pos = start_n + offs_n
        if MASK:  # the ragged last page holds keys >= num_keys: never read them
            kt = tl.load(kt_ptrs, mask=k_pos[None, :] < num_keys, other=0.0)
            v = tl.load(v_ptrs, mask=k_pos[:, None] < num_keys, other=0.0)
        else:
            kt = tl.load(kt_ptrs)
            v = tl.load(v_ptrs)
        # s_ij = q_i . k_j * scale * log2(e)
        s = tl.dot(q, kt, input_precision=PRECISION) * qk_scale
        if MASK:
            s = tl.where(_visible(q_pos[:, None], k_pos[None, :], window), s, _MASKED)
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


@triton.autotune(
    configs=_configs((128, 64, 8, 3), [(64, 64), (64, 128), (128, 64), (128, 128)], stages=(2, 3)),
    key=["HEAD_DIM", "PAGE"],
    prune_configs_by={"early_config_prune": _pruner("BLOCK_M", 1)},  # acc [BLOCK_M, HEAD_DIM]
)
@triton.jit
def _fwd_kernel(
    Q, K, V, TABLE, OUT, LSE,
    stride_qb, stride_qh, stride_qm, stride_qd,
    stride_ks, stride_kh, stride_kp, stride_kd,
    stride_tb,
    num_heads, group, q_len, q_start, window, qk_scale,
    HEAD_DIM: tl.constexpr, PAGE: tl.constexpr, PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):  # fmt: skip
    start_m = tl.program_id(0) * BLOCK_M
    bh = tl.program_id(1)
    b = bh // num_heads
    h = bh % num_heads
    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM)
    row_ok = offs_m < q_len
    q = tl.load(
        Q + b * stride_qb + h * stride_qh + offs_m[:, None] * stride_qm + offs_d[None, :] * stride_qd,
        mask=row_ok[:, None],
        other=0.0,
    )
    kv_head = (h // group) * stride_kh
    K += kv_head
    V += kv_head
    TABLE += b * stride_tb

    q_pos = q_start + offs_m
    num_keys = q_start + q_len
    q_last = q_start + tl.minimum(start_m + BLOCK_M, q_len) - 1
    lo, full_lo, full_hi, hi = _key_blocks(q_start + start_m, q_last, window, BLOCK_N)

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
    # window edge, then the blocks every query sees, then the causal diagonal (and the ragged last page)
    acc, l_i, m_i = _fwd_inner(acc, l_i, m_i, q, K, V, TABLE, stride_ks, stride_kp, stride_kd, q_pos, lo,
                               full_lo, num_keys, window, qk_scale, HEAD_DIM, PAGE, BLOCK_N, True, PRECISION)  # fmt: skip
    acc, l_i, m_i = _fwd_inner(acc, l_i, m_i, q, K, V, TABLE, stride_ks, stride_kp, stride_kd, q_pos, full_lo,
                               full_hi, num_keys, window, qk_scale, HEAD_DIM, PAGE, BLOCK_N, False, PRECISION)  # fmt: skip
    acc, l_i, m_i = _fwd_inner(acc, l_i, m_i, q, K, V, TABLE, stride_ks, stride_kp, stride_kd, q_pos, full_hi,
                               hi, num_keys, window, qk_scale, HEAD_DIM, PAGE, BLOCK_N, True, PRECISION)  # fmt: skip

    # out = acc / l_i; lse = ln(sum_j exp(s_j)) = (m_i + log2(l_i)) * ln(2)
    rows = bh * q_len + offs_m
    tl.store(LSE + rows, (m_i + tl.math.log2(l_i)) / _LOG2E, mask=row_ok)
    out = acc / l_i[:, None]
    tl.store(
        OUT + rows[:, None] * HEAD_DIM + offs_d[None, :], out.to(OUT.dtype.element_ty), mask=row_ok[:, None]
    )


# --------------------------------------------------------------------------------------------------- backward
@triton.jit
def _bwd_preprocess(OUT, DOUT, DELTA, num_rows, HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr):
    """``delta_i = sum_d dO_id * O_id`` over contiguous ``[rows, HEAD_DIM]``."""
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs = rows[:, None] * HEAD_DIM + tl.arange(0, HEAD_DIM)[None, :]
    ok = rows < num_rows
    o = tl.load(OUT + offs, mask=ok[:, None], other=0.0).to(tl.float32)
    do = tl.load(DOUT + offs, mask=ok[:, None], other=0.0).to(tl.float32)
    tl.store(DELTA + rows, tl.sum(o * do, 1), mask=ok)


@triton.jit
def _bwd_dkdv_inner(
    dk, dv, k, v, Q, DO, LSE, DELTA,
    stride_qm, stride_qd,
    k_pos, lo, hi, q_start, q_len, window, qk_scale,
    HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, MASK: tl.constexpr, PRECISION: tl.constexpr,
):  # fmt: skip
    """Add the contributions of query blocks ``[lo, hi)`` of one query head to this key block's ``dk``, ``dv``
    ``[BLOCK_N, HEAD_DIM]``; scores are kept transposed (keys x queries). ``Q``/``DO``/``LSE``/``DELTA`` point
    at that head's rows."""
    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM)
    for start_m in range(lo, hi, BLOCK_M):
        start_m = tl.multiple_of(start_m, BLOCK_M)
        rows = start_m + offs_m
        qt_ptrs = Q + rows[None, :] * stride_qm + offs_d[:, None] * stride_qd
        do_ptrs = DO + rows[:, None] * HEAD_DIM + offs_d[None, :]
        if MASK:
            ok = rows < q_len
            qt = tl.load(qt_ptrs, mask=ok[None, :], other=0.0)
            do = tl.load(do_ptrs, mask=ok[:, None], other=0.0)
            lse = tl.load(LSE + rows, mask=ok, other=0.0)
            delta = tl.load(DELTA + rows, mask=ok, other=0.0)
        else:
            qt = tl.load(qt_ptrs)
            do = tl.load(do_ptrs)
            lse = tl.load(LSE + rows)
            delta = tl.load(DELTA + rows)
        # p^T_ji = exp(s_ij - lse_i), computed as exp2(s * log2(e) - lse * log2(e))
        pt = tl.math.exp2(tl.dot(k, qt, input_precision=PRECISION) * qk_scale - lse[None, :] * _LOG2E)
        if MASK:
            pt = tl.where(_visible(q_start + rows[None, :], k_pos[:, None], window) & ok[None, :], pt, 0.0)
        # dV += P^T dO
        dv = tl.dot(pt.to(do.dtype), do, dv, input_precision=PRECISION)
        # dS^T = P^T * (dP^T - delta), dP^T = V dO^T;  dK += dS^T Q (scaled once at the end)
        dpt = tl.dot(v, tl.trans(do), input_precision=PRECISION)
        dst = pt * (dpt - delta[None, :])
        dk = tl.dot(dst.to(qt.dtype), tl.trans(qt), dk, input_precision=PRECISION)
    return dk, dv


@triton.autotune(
    configs=_configs((32, 64, 8, 3), [(32, 64), (32, 128), (64, 64), (64, 128)], stages=(2, 3, 4)),
    key=["HEAD_DIM", "PAGE"],
    prune_configs_by={"early_config_prune": _pruner("BLOCK_N", 2)},  # dk, dv [BLOCK_N, HEAD_DIM]
    pre_hook=_restore_grad_pages.pre,
    post_hook=_restore_grad_pages.post,
)
@triton.jit
def _bwd_dkdv_kernel(
    Q, K, V, DO, LSE, DELTA, TABLE, DK, DV,
    stride_qb, stride_qh, stride_qm, stride_qd,
    stride_ks, stride_kh, stride_kp, stride_kd,
    stride_tb,
    num_heads, kv_heads, group, q_len, q_start, first_key, window, scale, qk_scale,
    HEAD_DIM: tl.constexpr, PAGE: tl.constexpr, PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):  # fmt: skip
    start_n = (first_key // BLOCK_N + tl.program_id(0)) * BLOCK_N
    bh = tl.program_id(1)
    b = bh // kv_heads
    kv_head = bh % kv_heads
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM)
    k_pos = start_n + offs_n
    key_ok = k_pos < q_start + q_len
    # gradient pages have the K/V pages' layout: one offset serves K, V, dK and dV
    tokens = (start_n % PAGE + offs_n)[:, None]
    kv_offs = _page_offset(TABLE + b * stride_tb, start_n, stride_ks, PAGE) + kv_head * stride_kh
    kv_offs += tokens * stride_kp + offs_d[None, :] * stride_kd
    k = tl.load(K + kv_offs, mask=key_ok[:, None], other=0.0)
    v = tl.load(V + kv_offs, mask=key_ok[:, None], other=0.0)

    lo, full_lo, full_hi, hi = _query_blocks(start_n, q_start, q_len, window, BLOCK_M, BLOCK_N)
    dk = tl.zeros([BLOCK_N, HEAD_DIM], dtype=tl.float32)
    dv = tl.zeros([BLOCK_N, HEAD_DIM], dtype=tl.float32)
    for g in range(group):  # every query head that reads this KV head
        h = kv_head * group + g
        q_head = Q + b * stride_qb + h * stride_qh
        row0 = (b * num_heads + h) * q_len
        do_head = DO + row0 * HEAD_DIM
        dk, dv = _bwd_dkdv_inner(dk, dv, k, v, q_head, do_head, LSE + row0, DELTA + row0, stride_qm, stride_qd,
                                 k_pos, lo, full_lo, q_start, q_len, window, qk_scale, HEAD_DIM, BLOCK_M, True,
                                 PRECISION)  # fmt: skip
        dk, dv = _bwd_dkdv_inner(dk, dv, k, v, q_head, do_head, LSE + row0, DELTA + row0, stride_qm, stride_qd,
                                 k_pos, full_lo, full_hi, q_start, q_len, window, qk_scale, HEAD_DIM, BLOCK_M,
                                 False, PRECISION)  # fmt: skip
        dk, dv = _bwd_dkdv_inner(dk, dv, k, v, q_head, do_head, LSE + row0, DELTA + row0, stride_qm, stride_qd,
                                 k_pos, full_hi, hi, q_start, q_len, window, qk_scale, HEAD_DIM, BLOCK_M, True,
                                 PRECISION)  # fmt: skip

    # this program is the only writer of these gradient-page rows: a plain read-modify-write, no atomics
    tl.store(DK + kv_offs, (tl.load(DK + kv_offs) + dk * scale).to(DK.dtype.element_ty))
    tl.store(DV + kv_offs, (tl.load(DV + kv_offs) + dv).to(DV.dtype.element_ty))


@triton.jit
def _bwd_dq_inner(
    dq, q, do, lse, delta, K, V, TABLE,
    stride_ks, stride_kp, stride_kd,
    q_pos, lo, hi, num_keys, window, qk_scale,
    HEAD_DIM: tl.constexpr, PAGE: tl.constexpr, BLOCK_N: tl.constexpr, MASK: tl.constexpr, PRECISION: tl.constexpr,
):  # fmt: skip
    """Add key blocks ``[lo, hi)`` to ``dq`` (unscaled); ``K``/``V`` already point at this program's KV head."""
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM)
    for start_n in range(lo, hi, BLOCK_N):
        start_n = tl.multiple_of(start_n, BLOCK_N)
        base = _page_offset(TABLE, start_n, stride_ks, PAGE) + (start_n % PAGE) * stride_kp
        kt_ptrs = K + base + offs_n[None, :] * stride_kp + offs_d[:, None] * stride_kd
        vt_ptrs = V + base + offs_n[None, :] * stride_kp + offs_d[:, None] * stride_kd
        k_pos = start_n + offs_n
        if MASK:
            kt = tl.load(kt_ptrs, mask=k_pos[None, :] < num_keys, other=0.0)
            vt = tl.load(vt_ptrs, mask=k_pos[None, :] < num_keys, other=0.0)
        else:
            kt = tl.load(kt_ptrs)
            vt = tl.load(vt_ptrs)
        # p_ij = exp(s_ij - lse_i)
        p = tl.math.exp2(tl.dot(q, kt, input_precision=PRECISION) * qk_scale - lse[:, None])
        if MASK:
            p = tl.where(_visible(q_pos[:, None], k_pos[None, :], window), p, 0.0)
        # dS = P * (dO V^T - delta);  dQ += dS K
        ds = p * (tl.dot(do, vt, input_precision=PRECISION) - delta[:, None])
        dq = tl.dot(ds.to(kt.dtype), tl.trans(kt), dq, input_precision=PRECISION)
    return dq


@triton.autotune(
    configs=_configs((128, 64, 8, 3), [(64, 32), (64, 64), (128, 32), (128, 64)], stages=(2, 3)),
    key=["HEAD_DIM", "PAGE"],
    prune_configs_by={"early_config_prune": _pruner("BLOCK_M", 1)},  # dq [BLOCK_M, HEAD_DIM]
)
@triton.jit
def _bwd_dq_kernel(
    Q, K, V, DO, LSE, DELTA, TABLE, DQ,
    stride_qb, stride_qh, stride_qm, stride_qd,
    stride_ks, stride_kh, stride_kp, stride_kd,
    stride_tb,
    num_heads, group, q_len, q_start, window, scale, qk_scale,
    HEAD_DIM: tl.constexpr, PAGE: tl.constexpr, PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):  # fmt: skip
    start_m = tl.program_id(0) * BLOCK_M
    bh = tl.program_id(1)
    b = bh // num_heads
    h = bh % num_heads
    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM)
    row_ok = offs_m < q_len
    q = tl.load(
        Q + b * stride_qb + h * stride_qh + offs_m[:, None] * stride_qm + offs_d[None, :] * stride_qd,
        mask=row_ok[:, None],
        other=0.0,
    )
    rows = bh * q_len + offs_m
    row_offs = rows[:, None] * HEAD_DIM + offs_d[None, :]
    do = tl.load(DO + row_offs, mask=row_ok[:, None], other=0.0)
    lse = tl.load(LSE + rows, mask=row_ok, other=0.0) * _LOG2E
    delta = tl.load(DELTA + rows, mask=row_ok, other=0.0)
    kv_head = (h // group) * stride_kh
    K += kv_head
    V += kv_head
    TABLE += b * stride_tb

    q_pos = q_start + offs_m
    num_keys = q_start + q_len
    q_last = q_start + tl.minimum(start_m + BLOCK_M, q_len) - 1
    lo, full_lo, full_hi, hi = _key_blocks(q_start + start_m, q_last, window, BLOCK_N)
    dq = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
    dq = _bwd_dq_inner(dq, q, do, lse, delta, K, V, TABLE, stride_ks, stride_kp, stride_kd, q_pos, lo, full_lo,
                       num_keys, window, qk_scale, HEAD_DIM, PAGE, BLOCK_N, True, PRECISION)  # fmt: skip
    dq = _bwd_dq_inner(dq, q, do, lse, delta, K, V, TABLE, stride_ks, stride_kp, stride_kd, q_pos, full_lo,
                       full_hi, num_keys, window, qk_scale, HEAD_DIM, PAGE, BLOCK_N, False, PRECISION)  # fmt: skip
    dq = _bwd_dq_inner(dq, q, do, lse, delta, K, V, TABLE, stride_ks, stride_kp, stride_kd, q_pos, full_hi, hi,
                       num_keys, window, qk_scale, HEAD_DIM, PAGE, BLOCK_N, True, PRECISION)  # fmt: skip
    tl.store(DQ + row_offs, (dq * scale).to(DQ.dtype.element_ty), mask=row_ok[:, None])


# -------------------------------------------------------------------------------------------------- launchers
def _check(
    q: torch.Tensor, k_arena: torch.Tensor, v_arena: torch.Tensor, page_table: torch.Tensor, q_start: int
):
    """Validate shapes/dtypes (cheap, before any launch); return ``(B, Hq, Lq, D, Hkv, P)``."""
    if q.dim() != 4 or k_arena.dim() != 4:
        raise ValueError(
            f"q must be [B, Hq, Lq, D] and arenas [slots, Hkv, P, D]; got {q.shape}, {k_arena.shape}"
        )
    b, hq, lq, d = q.shape
    hkv, page = k_arena.shape[1], k_arena.shape[2]
    if q.dtype not in _SUPPORTED or k_arena.dtype != q.dtype or v_arena.dtype != q.dtype:
        raise TypeError(
            f"paged attention kernels take {_SUPPORTED} with K/V pages in the query dtype; got q {q.dtype}, "
            f"pages {k_arena.dtype}/{v_arena.dtype} — use the torch reference backend for other dtypes."
        )
    for name, size in (("head_dim", d), ("page size", page)):
        if size < 16 or size & (size - 1):
            raise ValueError(f"{name}={size} is not supported — the kernels need a power of two >= 16.")
    if k_arena.shape[3] != d or v_arena.shape != k_arena.shape or hq % hkv:
        raise ValueError(
            f"q {tuple(q.shape)} does not match K/V pages {tuple(k_arena.shape)}/{tuple(v_arena.shape)}: "
            "need equal head_dim and Hq divisible by Hkv."
        )
    if not (k_arena.is_contiguous() and v_arena.is_contiguous()):
        raise ValueError("K/V arenas must be contiguous [slots, Hkv, P, D] tensors.")
    if q.device.type != "cuda" and not _interpreting():
        raise ValueError(
            f"the Triton kernels run on CUDA tensors, got {q.device} — use the torch reference backend, "
            "or set TRITON_INTERPRET=1 before importing csrc_triton (slow; for tests)."
        )
    if page_table.dtype != torch.int32 or page_table.shape[0] != b or page_table.stride(1) != 1:
        raise ValueError(
            f"page_table must be int32 [B={b}, n_pages] with unit last stride; got {page_table.shape}."
        )
    if q_start < 0 or page_table.shape[1] * page < q_start + lq:
        raise ValueError(
            f"q_start={q_start}, Lq={lq}: the page table's {page_table.shape[1]} pages of {page} must cover keys "
            f"[0, {q_start + lq}) — pass the pages of every key up to the chunk's end."
        )
    return b, hq, lq, d, hkv, page


def _window(window: int | None, q_start: int, lq: int) -> int:
    """The window as a kernel int; ``None`` becomes one that excludes nothing (every key is > position - Lk)."""
    if window is None:
        return q_start + lq
    if window < 1:
        raise ValueError(f"window={window} must be a positive number of keys (or None).")
    return min(window, q_start + lq)


def _precision(dtype: torch.dtype) -> str:
    # fp32 inputs stay fp32 in the matmuls (tf32 would break parity with the reference); 16-bit inputs ignore it
    return "ieee" if dtype == torch.float32 else "tf32"


def _query_grid(q_len: int, heads: int):
    """One program per (query block, head)."""
    return lambda meta: (triton.cdiv(q_len, meta["BLOCK_M"]), heads)


def _key_grid(first_key: int, num_keys: int, heads: int):
    """One program per (key block from the one holding ``first_key``, head)."""
    return lambda meta: (triton.cdiv(num_keys, meta["BLOCK_N"]) - first_key // meta["BLOCK_N"], heads)


def paged_attention_forward(
    q: torch.Tensor,
    k_arena: torch.Tensor,
    v_arena: torch.Tensor,
    page_table: torch.Tensor,
    q_start: int,
    scale: float,
    window: int | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``out [B, Hq, Lq, D]`` (dtype of ``q``, contiguous) and ``lse [B, Hq, Lq]`` (float32, natural log)."""
    b, hq, lq, d, hkv, page = _check(q, k_arena, v_arena, page_table, q_start)
    out = torch.empty((b, hq, lq, d), dtype=q.dtype, device=q.device)
    lse = torch.empty((b, hq, lq), dtype=torch.float32, device=q.device)
    if out.numel() == 0:
        return out, lse
    _fwd_kernel[_query_grid(lq, b * hq)](
        q, k_arena, v_arena, page_table, out, lse,
        *q.stride(), *k_arena.stride(), page_table.stride(0),
        hq, hq // hkv, lq, q_start, _window(window, q_start, lq), scale * LOG2E,
        HEAD_DIM=d, PAGE=page, PRECISION=_precision(q.dtype),
    )  # fmt: skip
    return out, lse


def paged_attention_backward(
    q: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    dout: torch.Tensor,
    k_arena: torch.Tensor,
    v_arena: torch.Tensor,
    dk_arena: torch.Tensor,
    dv_arena: torch.Tensor,
    page_table: torch.Tensor,
    q_start: int,
    scale: float,
    window: int | None,
) -> torch.Tensor:
    """Return ``dq`` (dtype of ``q``) and **add** dK, dV of every page read into ``dk_arena``, ``dv_arena``
    (float32 or bfloat16 ``[slots, Hkv, P, D]``, same layout as the K/V arenas)."""
    b, hq, lq, d, hkv, page = _check(q, k_arena, v_arena, page_table, q_start)
    grads = (dk_arena, dv_arena)
    if any(g.shape != k_arena.shape or g.dtype not in _GRAD_DTYPES or not g.is_contiguous() for g in grads):
        raise ValueError(
            f"dK/dV arenas must be contiguous {_GRAD_DTYPES} tensors shaped like the K/V arenas "
            f"{tuple(k_arena.shape)}; got {[(tuple(g.shape), g.dtype) for g in grads]}."
        )
    dq = torch.empty((b, hq, lq, d), dtype=q.dtype, device=q.device)
    if dq.numel() == 0:
        return dq
    out, dout, lse = out.contiguous(), dout.contiguous(), lse.contiguous()
    window = _window(window, q_start, lq)
    delta = torch.empty_like(lse)
    _bwd_preprocess[(triton.cdiv(b * hq * lq, 64),)](out, dout, delta, b * hq * lq, HEAD_DIM=d, BLOCK_M=64)

    precision = _precision(q.dtype)
    first_key = max(0, q_start - window + 1)  # keys before it are outside every query's window
    _bwd_dkdv_kernel[_key_grid(first_key, q_start + lq, b * hkv)](
        q, k_arena, v_arena, dout, lse, delta, page_table, dk_arena, dv_arena,
        *q.stride(), *k_arena.stride(), page_table.stride(0),
        hq, hkv, hq // hkv, lq, q_start, first_key, window, scale, scale * LOG2E,
        HEAD_DIM=d, PAGE=page, PRECISION=precision,
    )  # fmt: skip
    _bwd_dq_kernel[_query_grid(lq, b * hq)](
        q, k_arena, v_arena, dout, lse, delta, page_table, dq,
        *q.stride(), *k_arena.stride(), page_table.stride(0),
        hq, hq // hkv, lq, q_start, window, scale, scale * LOG2E,
        HEAD_DIM=d, PAGE=page, PRECISION=precision,
    )  # fmt: skip
    return dq
