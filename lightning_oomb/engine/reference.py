"""Plain-torch reference of the paged attention kernels (the CPU path and the kernels' test oracle).

Same functions as ``csrc_triton.paged_attention``: a chunk's queries at absolute positions
``[q_start, q_start + Lq)`` attend to every key at positions ``[0, q_start + Lq)`` stored in the pool's pages,
causally aligned to the lower right (query ``i`` sees key ``j`` iff ``j <= q_start + i`` and, with a sliding
``window`` W, ``j > q_start + i - W``). GQA without repeating K/V: query head ``h`` reads KV head
``h // (Hq // Hkv)``. Keys are visited in blocks of pages and merged by log-sum-exp, so memory is
``O(Lq * KEY_BLOCK)``, not ``O(Lq * Lk)``. Arithmetic in float32 (float64 for float64 inputs).
"""

from __future__ import annotations

import math

import torch

from lightning_oomb.engine.kv_pool import PagedKV

KEY_BLOCK = 2048  # keys per block; a multiple of every supported page size


def _compute_dtype(x: torch.Tensor) -> torch.dtype:
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def _key_blocks(kv: PagedKV, q_start: int, lq: int, window: int | None):
    """Yield ``(first_key, slots [B, n])`` for the page blocks any query can see."""
    page = kv.page_size
    num_keys = q_start + lq
    first = 0 if window is None else max(0, q_start - window + 1) // page * page
    per_block = max(1, KEY_BLOCK // page)
    last_page = math.ceil(num_keys / page)
    for p0 in range(first // page, last_page, per_block):
        yield p0 * page, kv.page_table[:, p0 : min(p0 + per_block, last_page)]


def _gather(arena: torch.Tensor, slots: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Pages ``slots [B, n]`` of ``arena`` as ``[B, Hkv, 1, n * page, D]`` tokens (broadcasts over groups)."""
    b, n = slots.shape
    pages = arena[slots.flatten().long()].view(b, n, *arena.shape[1:]).to(dtype)
    return pages.transpose(1, 2).reshape(b, arena.shape[1], 1, n * arena.shape[2], arena.shape[3])


def _visible(q_start: int, lq: int, first_key: int, nk: int, window: int | None, device) -> torch.Tensor:
    """Bool ``[Lq, nk]``: which keys of the block starting at ``first_key`` each query sees."""
    qpos = torch.arange(q_start, q_start + lq, device=device)[:, None]
    kpos = torch.arange(first_key, first_key + nk, device=device)[None, :]
    mask = kpos <= qpos
    if window is not None:
        mask &= kpos > qpos - window
    return mask


def _grouped(q: torch.Tensor, hkv: int, dtype: torch.dtype) -> torch.Tensor:
    """``[B, Hq, L, D]`` -> ``[B, Hkv, G, L, D]`` (query heads grouped by the KV head they read)."""
    b, hq, lq, d = q.shape
    return q.to(dtype).reshape(b, hkv, hq // hkv, lq, d)


def paged_attention_forward(
    q: torch.Tensor, kv: PagedKV, q_start: int, scale: float, window: int | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """``out [B, Hq, Lq, D]`` (dtype of ``q``) and ``lse [B, Hq, Lq]`` (float32; float64 for float64 q)."""
    b, hq, lq, d = q.shape
    dtype = _compute_dtype(q)
    qg = _grouped(q, kv.k.shape[1], dtype)
    m = torch.full(qg.shape[:-1], -math.inf, dtype=dtype, device=q.device)
    denom = torch.zeros_like(m)
    acc = torch.zeros_like(qg)
    for first, slots in _key_blocks(kv, q_start, lq, window):
        k, v = _gather(kv.k, slots, dtype), _gather(kv.v, slots, dtype)
        s = (qg @ k.transpose(-1, -2)) * scale
        s = s.masked_fill(~_visible(q_start, lq, first, k.shape[-2], window, q.device), -math.inf)
        m_new = torch.maximum(m, s.amax(-1))
        # rows with nothing visible yet keep m = -inf; shift by 0 there so exp() gives 0, not NaN
        shift = torch.where(torch.isinf(m_new), torch.zeros_like(m_new), m_new)
        p = torch.exp(s - shift[..., None])
        alpha = torch.exp(m - shift)
        denom = denom * alpha + p.sum(-1)
        acc = acc * alpha[..., None] + p @ v
        m = m_new
    out = acc / denom[..., None]
    lse = m + torch.log(denom)
    return out.reshape(b, hq, lq, d).to(q.dtype), lse.reshape(b, hq, lq)


def paged_attention_backward(
    q: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    dout: torch.Tensor,
    kv: PagedKV,
    q_start: int,
    scale: float,
    window: int | None = None,
) -> torch.Tensor:
    """Return ``dq`` (dtype of ``q``) and **add** dK, dV of every page read into ``kv.dk``, ``kv.dv``."""
    b, hq, lq, d = q.shape
    hkv = kv.k.shape[1]
    dtype = _compute_dtype(q)
    qg, og, dog = (_grouped(x, hkv, dtype) for x in (q, out, dout))
    lseg = lse.to(dtype).reshape(b, hkv, hq // hkv, lq)
    delta = (dog * og).sum(-1)  # D_i = rowsum(dO * O)
    dq = torch.zeros_like(qg)
    for first, slots in _key_blocks(kv, q_start, lq, window):
        k, v = _gather(kv.k, slots, dtype), _gather(kv.v, slots, dtype)
        s = (qg @ k.transpose(-1, -2)) * scale
        visible = _visible(q_start, lq, first, k.shape[-2], window, q.device)
        p = torch.exp(s - lseg[..., None]).masked_fill(~visible, 0.0)
        dv = (p.transpose(-1, -2) @ dog).sum(2)  # sum over the query heads sharing a KV head
        ds = p * (dog @ v.transpose(-1, -2) - delta[..., None])
        dq += (ds @ k) * scale
        dk = (ds.transpose(-1, -2) @ qg).sum(2) * scale
        _add_to_pages(kv.dk, slots, dk)
        _add_to_pages(kv.dv, slots, dv)
    return dq.reshape(b, hq, lq, d).to(q.dtype)


def _add_to_pages(arena: torch.Tensor, slots: torch.Tensor, grad: torch.Tensor) -> None:
    """Add token gradients ``[B, Hkv, n * page, D]`` into the pages ``slots [B, n]`` of ``arena``."""
    b, n = slots.shape
    h, page, d = arena.shape[1:]
    pages = grad.reshape(b, h, n, page, d).transpose(1, 2).reshape(b * n, h, page, d)
    arena.index_add_(0, slots.flatten().long(), pages.to(arena.dtype))
