"""Plain-torch reference of the paged attention kernels (the CPU path and the kernels' test oracle).

Same functions as ``csrc_triton.paged_attention``: a chunk's queries at absolute positions
``[q_start, q_start + Lq)`` attend to every key at positions ``[0, q_start + Lq)`` stored in the pool's pages,
causally aligned to the lower right (query ``i`` sees key ``j`` iff ``j <= q_start + i`` and, with a sliding
``window`` W, ``j > q_start + i - W``). GQA without repeating K/V: query head ``h`` reads KV head
``h // (Hq // Hkv)``. Keys are visited in blocks of pages and merged by log-sum-exp, so memory is
``O(Lq * KEY_BLOCK)``, not ``O(Lq * Lk)``. Arithmetic in float32 (float64 for float64 inputs).

Key ranges (same contract as the kernels): so that the keys can be streamed through fixed-size device buffers
(offloaded to host memory), one call can be split into calls over disjoint, page-aligned ``key_range=(lo, hi)``
whose results combine exactly. The forward folds each range into a carried state ``(acc, m, l)``
(``init_state`` / ``finish_state``, in any order); the backward takes the final ``out``/``lse``, a shared
``attention_delta`` and adds each range's dQ into one accumulator (dK/dV are added into the pages as always).
"""

from __future__ import annotations

import math

import torch

from csrc_triton.contract import checked_key_range
from lightning_oomb.engine.kv_pool import PagedKV

KEY_BLOCK = 2048  # keys per block; a multiple of every supported page size

State = tuple[torch.Tensor, torch.Tensor, torch.Tensor]


def _compute_dtype(x: torch.Tensor) -> torch.dtype:
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def _check_buffer(name: str, x: torch.Tensor, shape: tuple[int, ...], dtype: torch.dtype) -> None:
    """A caller-owned accumulator updated in place (state, dQ) or a precomputed delta."""
    if x.shape != shape or x.dtype != dtype or not x.is_contiguous():
        raise ValueError(
            f"{name} must be a contiguous {dtype} tensor of shape {shape} (see init_state); got {x.dtype} "
            f"{tuple(x.shape)} (contiguous: {x.is_contiguous()})."
        )


def _key_blocks(kv: PagedKV, q_start: int, lq: int, window: int | None, key_range: tuple[int, int] | None):
    """Yield ``(first_key, slots [B, n])`` for the page blocks of ``key_range`` any query can see; only the page
    table's entries of the key range's pages are read."""
    page = kv.page_size
    lo, hi = checked_key_range(key_range, q_start + lq, page)
    first = lo if window is None else max(lo, max(0, q_start - window + 1) // page * page)
    per_block = max(1, KEY_BLOCK // page)
    last_page = math.ceil(hi / page)
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


def init_state(q: torch.Tensor) -> State:
    """A fresh forward state for ``q [B, Hq, Lq, D]``: ``acc`` 0, ``m`` -inf, ``l`` 0 (float32; float64 for
    float64 ``q``). Used for both backends."""
    dtype = _compute_dtype(q)
    acc = torch.zeros(q.shape, dtype=dtype, device=q.device)
    return acc, torch.full(q.shape[:-1], -math.inf, dtype=dtype, device=q.device), acc.new_zeros(q.shape[:-1])


def finish_state(state: State, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """``(out, lse)`` of a state that has seen every key: ``out = acc / l`` in ``dtype``, ``lse = m + log(l)``."""
    acc, m, l_sum = state
    return (acc / l_sum[..., None]).to(dtype), m + torch.log(l_sum)


def attention_delta(out: torch.Tensor, dout: torch.Tensor) -> torch.Tensor:
    """``delta = rowsum(dout * out)`` ``[B, Hq, Lq]`` (float32; float64 for float64), shared by the backward
    calls of every key range. Used for both backends."""
    dtype = _compute_dtype(out)
    return (dout.to(dtype) * out.to(dtype)).sum(-1)


def paged_attention_forward(
    q: torch.Tensor,
    kv: PagedKV,
    q_start: int,
    scale: float,
    window: int | None = None,
    *,
    key_range: tuple[int, int] | None = None,
    state: State | None = None,
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """``out [B, Hq, Lq, D]`` (dtype of ``q``) and ``lse [B, Hq, Lq]`` (float32; float64 for float64 q).

    ``key_range=(lo, hi)`` visits only the keys at positions ``[lo, hi)``. With ``state`` (see ``init_state``)
    the keys are folded into it in place and ``None`` is returned."""
    lq, hkv = q.shape[2], kv.k.shape[1]
    dtype = _compute_dtype(q)
    own = state is None
    if own:
        state = init_state(q)
    else:
        for name, x, shape in zip(("acc", "m", "l"), state, (q.shape, q.shape[:-1], q.shape[:-1])):
            _check_buffer(f"state {name}", x, shape, dtype)
    qg = _grouped(q, hkv, dtype)
    rows = qg.shape[:-1]  # [B, Hkv, G, Lq]: views of the state's tensors, updated in place
    acc, m, denom = state[0].view(qg.shape), state[1].view(rows), state[2].view(rows)
    for first, slots in _key_blocks(kv, q_start, lq, window, key_range):
        k, v = _gather(kv.k, slots, dtype), _gather(kv.v, slots, dtype)
        s = (qg @ k.transpose(-1, -2)) * scale
        s = s.masked_fill(~_visible(q_start, lq, first, k.shape[-2], window, q.device), -math.inf)
        m_new = torch.maximum(m, s.amax(-1))
        # rows with nothing visible yet keep m = -inf; shift by 0 there so exp() gives 0, not NaN
        shift = torch.where(torch.isinf(m_new), torch.zeros_like(m_new), m_new)
        p = torch.exp(s - shift[..., None])
        alpha = torch.exp(m - shift)
        denom.mul_(alpha).add_(p.sum(-1))
        acc.mul_(alpha[..., None]).add_(p @ v)
        m.copy_(m_new)
    return finish_state(state, q.dtype) if own else None


def paged_attention_backward(
    q: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    dout: torch.Tensor,
    kv: PagedKV,
    q_start: int,
    scale: float,
    window: int | None = None,
    *,
    key_range: tuple[int, int] | None = None,
    delta: torch.Tensor | None = None,
    dq: torch.Tensor | None = None,
) -> torch.Tensor:
    """Return ``dq`` (dtype of ``q``) and **add** dK, dV of every page read into ``kv.dk``, ``kv.dv``.

    ``key_range=(lo, hi)``: only keys ``[lo, hi)`` (``out``, ``lse`` are still the final ones, over all keys).
    ``delta``: a precomputed ``attention_delta(out, dout)``. ``dq``: a float32 (float64 for float64 q)
    ``[B, Hq, Lq, D]`` accumulator the contribution is added into (and which is returned)."""
    lq, hkv = q.shape[2], kv.k.shape[1]
    dtype = _compute_dtype(q)
    if delta is None:
        delta = attention_delta(out, dout)  # D_i = rowsum(dO * O)
    _check_buffer("delta", delta, q.shape[:-1], dtype)
    own = dq is None
    if own:
        dq = torch.zeros(q.shape, dtype=dtype, device=q.device)
    _check_buffer("dq", dq, q.shape, dtype)
    qg, dog = (_grouped(x, hkv, dtype) for x in (q, dout))
    lseg, deltag = (x.to(dtype).reshape(qg.shape[:-1]) for x in (lse, delta))
    dqg = dq.view(qg.shape)  # accumulated in place
    for first, slots in _key_blocks(kv, q_start, lq, window, key_range):
        k, v = _gather(kv.k, slots, dtype), _gather(kv.v, slots, dtype)
        s = (qg @ k.transpose(-1, -2)) * scale
        visible = _visible(q_start, lq, first, k.shape[-2], window, q.device)
        p = torch.exp(s - lseg[..., None]).masked_fill(~visible, 0.0)
        dv = (p.transpose(-1, -2) @ dog).sum(2)  # sum over the query heads sharing a KV head
        ds = p * (dog @ v.transpose(-1, -2) - deltag[..., None])
        dqg += (ds @ k) * scale
        dk = (ds.transpose(-1, -2) @ qg).sum(2) * scale
        _add_to_pages(kv.dk, slots, dk)
        _add_to_pages(kv.dv, slots, dv)
    return dq.to(q.dtype) if own else dq


def _add_to_pages(arena: torch.Tensor, slots: torch.Tensor, grad: torch.Tensor) -> None:
    """Add token gradients ``[B, Hkv, n * page, D]`` into the pages ``slots [B, n]`` of ``arena``."""
    b, n = slots.shape
    h, page, d = arena.shape[1:]
    pages = grad.reshape(b, h, n, page, d).transpose(1, 2).reshape(b * n, h, page, d)
    arena.index_add_(0, slots.flatten().long(), pages.to(arena.dtype))
