"""Sparse attention's page scores as a Triton kernel (the selection rule of ``lightning_oomb.engine.sparse``).

``block_scores(grouped, keys, first, page) -> [B, blocks, past]``: for each query block of ``page`` rows, the sum over
KV heads and the block's rows of ``softmax over the pages the row sees`` of the rows' page scores — ``g . mean``
(one summary vector) or the bound ``relu(g) . max + min(g, 0) . min`` (two) — with ``grouped [B, Hkv, Lq, D]`` the
query heads of each KV head summed, ``keys [B, Hkv, vectors, D, past]`` the page summaries and ``first [B, Lq]`` each
row's first visible key (a page is seen when its last key is at or after it). A row that sees no page adds nothing.

One program per (tile of rows, batch row and KV head): a first walk over the pages keeps each row's running max
and normaliser, a second adds the normalised probabilities, summed over the tile's rows, into the scores of its
query block (``atomic_add``: the KV heads and the block's row tiles of a query block add into the same scores).
Float32 throughout, ``ieee`` matmuls (a tf32 score could reorder near-equal pages against the torch rule). The
torch implementation in ``lightning_oomb.engine.sparse`` is the oracle; under ``TRITON_INTERPRET=1`` this runs on
CPU tensors (tests).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _row_scores(g_pos, g_neg, keys, pages, p_ok, first, row_ok, page: tl.constexpr, BOUND: tl.constexpr,
                stride_kv, stride_kd, stride_kp, BLOCK_D: tl.constexpr, HEAD_DIM: tl.constexpr):  # fmt: skip
    """Scores ``[rows, pages]`` of one tile of pages, ``-inf`` where a row does not see the page."""
    d = tl.arange(0, BLOCK_D)
    mask = (d[:, None] < HEAD_DIM) & p_ok[None, :]
    high = tl.load(keys + d[:, None] * stride_kd + pages[None, :] * stride_kp, mask=mask, other=0.0)
    s = tl.dot(g_pos, high, input_precision="ieee")
    if BOUND:
        low = tl.load(
            keys + stride_kv + d[:, None] * stride_kd + pages[None, :] * stride_kp, mask=mask, other=0.0
        )
        s += tl.dot(g_neg, low, input_precision="ieee")
    seen = ((pages * page + page - 1)[None, :] >= first[:, None]) & p_ok[None, :] & row_ok[:, None]
    return tl.where(seen, s, float("-inf"))


@triton.jit
def _block_scores_kernel(
    G, K, FIRST, OUT, Lq, past, kv_heads,
    stride_gb, stride_gh, stride_gl, stride_gd,
    stride_kb, stride_kh, stride_kv, stride_kd, stride_kp,
    stride_fb, stride_fl, stride_ob, stride_or, stride_op,
    page: tl.constexpr, BOUND: tl.constexpr, HEAD_DIM: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_D: tl.constexpr,
):  # fmt: skip
    tile, bh = tl.program_id(0), tl.program_id(1)
    b, h = bh // kv_heads, bh % kv_heads
    rows = tile * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = rows < Lq
    d = tl.arange(0, BLOCK_D)
    g = tl.load(G + b * stride_gb + h * stride_gh + rows[:, None] * stride_gl + d[None, :] * stride_gd,
                mask=row_ok[:, None] & (d[None, :] < HEAD_DIM), other=0.0)  # fmt: skip
    g_pos = tl.maximum(g, 0.0) if BOUND else g
    g_neg = g - g_pos
    first = tl.load(FIRST + b * stride_fb + rows * stride_fl, mask=row_ok, other=0)
    keys = K + b * stride_kb + h * stride_kh
    m = tl.full([BLOCK_M], float("-inf"), tl.float32)
    total = tl.zeros([BLOCK_M], tl.float32)
    for start in range(0, past, BLOCK_P):
        pages = start + tl.arange(0, BLOCK_P)
        s = _row_scores(g_pos, g_neg, keys, pages, pages < past, first, row_ok, page, BOUND, stride_kv, stride_kd,
                        stride_kp, BLOCK_D, HEAD_DIM)  # fmt: skip
        top = tl.maximum(m, tl.max(s, 1))
        shift = tl.where(top == float("-inf"), 0.0, top)
        total = total * tl.exp(m - shift) + tl.sum(tl.exp(s - shift[:, None]), 1)
        m = top
    shift = tl.where(m == float("-inf"), 0.0, m)
    scale = tl.where(
        total > 0, 1.0 / tl.where(total > 0, total, 1.0), 0.0
    )  # a row seeing nothing adds nothing
    block = (tile * BLOCK_M) // page
    out = OUT + b * stride_ob + block * stride_or
    for start in range(0, past, BLOCK_P):
        pages = start + tl.arange(0, BLOCK_P)
        p_ok = pages < past
        s = _row_scores(g_pos, g_neg, keys, pages, p_ok, first, row_ok, page, BOUND, stride_kv, stride_kd,
                        stride_kp, BLOCK_D, HEAD_DIM)  # fmt: skip
        p = tl.exp(s - shift[:, None]) * scale[:, None]
        tl.atomic_add(out + pages * stride_op, tl.sum(p, 0), mask=p_ok)


def block_scores(grouped: torch.Tensor, keys: torch.Tensor, first: torch.Tensor, page: int) -> torch.Tensor:
    """The scores of the module docstring, float32 ``[B, ceil(Lq / page), past]``."""
    b, heads, lq, d = grouped.shape
    vectors, past = keys.shape[2], keys.shape[4]
    grouped, keys = grouped.float().contiguous(), keys.float().contiguous()
    first = first.contiguous()
    blocks = triton.cdiv(lq, page)
    out = torch.zeros(b, blocks, past, dtype=torch.float32, device=grouped.device)
    block_m = block_p = 16  # larger tiles spill at head dim 64-128 on sm_90 (ptxas -v, offline compile)
    grid = (triton.cdiv(lq, block_m), b * heads)
    _block_scores_kernel[grid](
        grouped, keys, first, out, lq, past, heads,
        *grouped.stride(), *keys.stride()[:2], keys.stride(2), keys.stride(3), keys.stride(4),
        *first.stride(), *out.stride(),
        page=page, BOUND=vectors == 2, HEAD_DIM=d, BLOCK_M=block_m, BLOCK_P=block_p,
        BLOCK_D=max(16, triton.next_power_of_2(d)),
    )  # fmt: skip
    return out
