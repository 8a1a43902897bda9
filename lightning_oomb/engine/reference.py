"""Plain-torch reference of the paged attention kernels: the CPU path and the kernels' test oracle.

The same functions, with the same arguments, as ``csrc_triton.paged_attention`` (the contract is in
``csrc_triton.contract``; ``attention_delta`` is :func:`lightning_oomb.engine.lse.attention_delta`). Keys are
visited in blocks of pages and merged by log-sum-exp, so memory is ``O(Lq * KEY_BLOCK)``, not ``O(Lq * Lk)``.
Arithmetic in float32 (float64 for float64 inputs, which only this backend takes). Key ranges, a carried forward
state and a dQ accumulator split one call into calls over disjoint key ranges whose results combine exactly
(:mod:`lightning_oomb.engine.lse`). A page selection (sparse attention) reads, per query block, only its selected
pages before ``q_start`` (one tile each) and the keys from ``q_start`` on as without it.
"""

from __future__ import annotations

import math

import torch

from csrc_triton.contract import check_buffer, check_call, check_terms, checked_key_range
from lightning_oomb.engine.lse import State, attention_delta, compute_dtype, finish_state, init_state
from lightning_oomb.engine.pages import add_tokens, gather_tokens

KEY_BLOCK = 2048  # keys per block; a multiple of every supported page size


def _key_blocks(page_table, page: int, q_start: int, lq: int, window, key_range, doc_start=None):
    """Yield ``(first_key, slots [B, n])`` for the page blocks of ``key_range`` any query can see (none before the
    window's or the earliest document's start); only the page table's entries of the key range's pages are read."""
    lo, hi = checked_key_range(key_range, q_start + lq, page)
    first = lo if window is None else max(lo, max(0, q_start - window + 1) // page * page)
    if doc_start is not None:
        first = max(first, int(doc_start.min()) // page * page)
    per_block = max(1, KEY_BLOCK // page)
    last_page = math.ceil(hi / page)
    for p0 in range(first // page, last_page, per_block):
        yield p0 * page, page_table[:, p0 : min(p0 + per_block, last_page)]


def _gather(pages: torch.Tensor, slots: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Pages ``slots [B, n]`` as ``[B, Hkv, 1, n * page, D]`` tokens in ``dtype`` (broadcasts over groups)."""
    return gather_tokens(pages, slots).to(dtype)[:, :, None]


def _visible(q_start: int, lq: int, first_key: int, nk: int, window: int | None, device, doc_start=None):
    """Bool ``[Lq, nk]`` (``[B, 1, 1, Lq, nk]`` with documents): which keys of the block starting at ``first_key``
    each query sees."""
    qpos = torch.arange(q_start, q_start + lq, device=device)[:, None]
    kpos = torch.arange(first_key, first_key + nk, device=device)[None, :]
    mask = kpos <= qpos
    if window is not None:
        mask &= kpos > qpos - window
    if doc_start is not None:
        mask = (mask & (kpos >= doc_start[:, :, None]))[:, None, None]
    return mask


def _tiles(page_table, page: int, q_start: int, lq: int, window, key_range, doc_start, page_select):
    """Yield ``(rows, slots [B, n], visible)``: the key tiles some query sees and the query rows (a slice) they are
    for — the key blocks of :func:`_key_blocks` for all rows (with a selection: from ``q_start`` on) and, with a
    selection, each query block's selected pages before ``q_start``."""
    lo, hi = checked_key_range(key_range, q_start + lq, page)
    if page_select is not None:
        yield from _selected_tiles(page_table, page, q_start, lq, window, (lo, hi), doc_start, page_select)
        if hi <= q_start:
            return
        lo = max(lo, q_start)
    for first, slots in _key_blocks(page_table, page, q_start, lq, window, (lo, hi), doc_start):
        nk = slots.shape[1] * page
        yield slice(None), slots, _visible(q_start, lq, first, nk, window, slots.device, doc_start)


def _selected_tiles(page_table, page: int, q_start: int, lq: int, window, keys, doc_start, page_select):
    """Per query block, its selected pages inside ``keys`` (and before ``q_start``) as one tile: ``(rows, slots,
    visible [B, 1, 1, rows, K * P])``; padding entries are masked (their slot is the key range's first page's:
    read, never seen, and their gradient adds are zeros). Blocks without a page are skipped."""
    first, end = keys[0] // page, min(keys[1], q_start) // page
    pages = page_select.long()
    pages = torch.where((pages >= first) & (pages < end), pages, -1)
    offsets = torch.arange(page, device=pages.device)
    for block in range(pages.shape[1]):
        listed = pages[:, block]  # [B, K]
        valid = listed >= 0
        if not bool(valid.any()):
            continue
        rows = slice(block * page, min((block + 1) * page, lq))
        slots = page_table.gather(1, torch.where(valid, listed, first))
        kpos = (listed[..., None] * page + offsets).flatten(1)[:, None]  # [B, 1, K * P]
        qpos = torch.arange(q_start + rows.start, q_start + rows.stop, device=pages.device)[None, :, None]
        visible = valid.repeat_interleave(page, -1)[:, None] & (kpos <= qpos)
        if window is not None:
            visible &= kpos > qpos - window
        if doc_start is not None:
            visible &= kpos >= doc_start[:, rows, None]
        yield rows, slots, visible[:, None, None]


def _scores(qg: torch.Tensor, k: torch.Tensor, scale: float, softcap: float | None):
    """Scaled scores ``q . k * scale`` (soft-capped: ``c * tanh(. / c)``) and the tanh (``None`` without cap)."""
    s = (qg @ k.transpose(-1, -2)) * scale
    if softcap is None:
        return s, None
    t = torch.tanh(s / softcap)
    return t * softcap, t


def _grouped(q: torch.Tensor, hkv: int, dtype: torch.dtype) -> torch.Tensor:
    """``[B, Hq, L, D]`` -> ``[B, Hkv, G, L, D]`` (query heads grouped by the KV head they read)."""
    b, hq, lq, d = q.shape
    return q.to(dtype).reshape(b, hkv, hq // hkv, lq, d)


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
    state: State | None = None,
    softcap: float | None = None,
    doc_start: torch.Tensor | None = None,
    page_select: torch.Tensor | None = None,
    visits: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """``out [B, Hq, Lq, D]`` (dtype of ``q``) and ``lse [B, Hq, Lq]`` (float32; float64 for float64 q).

    ``key_range=(lo, hi)`` visits only the keys at positions ``[lo, hi)``. With ``state`` (see
    :func:`~lightning_oomb.engine.lse.init_state`) the keys are folded into it in place and ``None`` is returned.
    ``softcap``: scores ``c * tanh(q . k * scale / c)``. ``doc_start`` ``[B, Lq]``: each query's document start.
    ``page_select`` ``[B, R, K]``: each query block's pages before ``q_start`` (sparse attention). ``visits``: an
    int32 ``[1]`` counter the number of key blocks visited is added to."""
    lq, hkv, page = q.shape[2], k_pages.shape[1], k_pages.shape[2]
    check_call(q, k_pages, v_pages, page_table, q_start, key_range)
    select = check_terms(q, page, q_start, window, softcap, doc_start, page_select)
    dtype = compute_dtype(q)
    own = state is None
    if own:
        state = init_state(q)
    else:
        for name, x, shape in zip(("acc", "m", "l"), state, (q.shape, q.shape[:-1], q.shape[:-1])):
            check_buffer(f"state {name}", x, shape, dtype, q.device)
    qg = _grouped(q, hkv, dtype)
    shape = qg.shape[:-1]  # [B, Hkv, G, Lq]: views of the state's tensors, updated in place
    acc_all, m_all, denom_all = state[0].view(qg.shape), state[1].view(shape), state[2].view(shape)
    for rows, slots, visible in _tiles(page_table, page, q_start, lq, window, key_range, doc_start, select):
        if visits is not None:
            visits += 1
        acc, m, denom = acc_all[..., rows, :], m_all[..., rows], denom_all[..., rows]
        k, v = _gather(k_pages, slots, dtype), _gather(v_pages, slots, dtype)
        s, _ = _scores(qg[..., rows, :], k, scale, softcap)
        s = s.masked_fill(~visible, -math.inf)
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
    """Return ``dq`` (dtype of ``q``) and **add** dK, dV of every page read into ``dk_pages``, ``dv_pages``.

    ``key_range=(lo, hi)``: only keys ``[lo, hi)`` (``out``, ``lse`` are still the final ones, over all keys).
    ``delta``: a precomputed ``attention_delta(out, dout)``. ``dq``: a float32 (float64 for float64 q)
    ``[B, Hq, Lq, D]`` accumulator the contribution is added into (and which is returned). ``softcap``,
    ``doc_start``, ``page_select``, ``visits``: as in the forward."""
    lq, hkv, page = q.shape[2], k_pages.shape[1], k_pages.shape[2]
    check_call(q, k_pages, v_pages, page_table, q_start, key_range)
    select = check_terms(q, page, q_start, window, softcap, doc_start, page_select)
    dtype = compute_dtype(q)
    if delta is None:
        delta = attention_delta(out, dout)  # D_i = rowsum(dO * O)
    check_buffer("delta", delta, q.shape[:-1], dtype, q.device)
    own = dq is None
    if own:
        dq = torch.zeros(q.shape, dtype=dtype, device=q.device)
    check_buffer("dq", dq, q.shape, dtype, q.device)
    qg_all, dog_all = (_grouped(x, hkv, dtype) for x in (q, dout))
    lse_all, delta_all = (x.to(dtype).reshape(qg_all.shape[:-1]) for x in (lse, delta))
    dq_all = dq.view(qg_all.shape)  # accumulated in place
    for rows, slots, visible in _tiles(page_table, page, q_start, lq, window, key_range, doc_start, select):
        if visits is not None:
            visits += 1
        qg, dog, lseg, deltag = (
            qg_all[..., rows, :],
            dog_all[..., rows, :],
            lse_all[..., rows],
            delta_all[..., rows],
        )
        k, v = _gather(k_pages, slots, dtype), _gather(v_pages, slots, dtype)
        s, t = _scores(qg, k, scale, softcap)
        p = torch.exp(s - lseg[..., None]).masked_fill(~visible, 0.0)
        dv = (p.transpose(-1, -2) @ dog).sum(2)  # sum over the query heads sharing a KV head
        ds = p * (dog @ v.transpose(-1, -2) - deltag[..., None])
        if t is not None:  # d(c tanh(x / c)) / dx = 1 - tanh^2
            ds = ds * (1 - t * t)
        dq_all[..., rows, :] += (ds @ k) * scale
        dk = (ds.transpose(-1, -2) @ qg).sum(2) * scale
        add_tokens(dk_pages, slots, dk)
        add_tokens(dv_pages, slots, dv)
    return dq.to(q.dtype) if own else dq
