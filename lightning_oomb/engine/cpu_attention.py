"""The fused CPU attention backend (``attention_backend="cpu"``, what ``auto`` picks for CPU tensors).

The contract's two functions (``csrc_triton.contract``) on torch's fused flash attention for CPU
(``aten::_scaled_dot_product_flash_attention_for_cpu`` and its backward, which return and take the log-sum-exp).
A call's keys split into two pieces: those before ``q_start``, which every query sees (one non-causal call, the
query heads of a KV head stacked along the rows, so K/V are never repeated), and the chunk's own keys, which the
queries see causally (one call with ``is_causal``, K/V repeated per query head). The pieces fold into a softmax
state by log-sum-exp (:mod:`lightning_oomb.engine.lse`), as the kernels fold key blocks. Arithmetic in float32
(float64 for float64 inputs), as the reference.

:func:`fast_path` says which calls go this way: CPU tensors without softcap, documents or tile counter, and without
a window or with one no key falls out of. With a page selection (sparse attention) the keys before ``q_start`` are
each query block's selected pages instead: one non-causal call per batch row and query block over its pages,
gathered (:func:`_selected_pieces`). Every other call is the plain reference's
(:mod:`lightning_oomb.engine.reference`, the oracle the tests compare this backend with).
"""

from __future__ import annotations

import torch

from csrc_triton.contract import check_buffer, check_terms, checked_key_range
from lightning_oomb.engine import reference
from lightning_oomb.engine.lse import (
    State,
    add_part,
    attention_delta,
    compute_dtype,
    finish_state,
    init_state,
)
from lightning_oomb.engine.pages import add_tokens, gather_tokens

__all__ = ["attention_delta", "paged_attention_backward", "paged_attention_forward"]  # the backend contract

_flash_op = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default
_flash_backward_op = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward.default
PAST_BLOCK = 16384  # keys per call before q_start: bounds the gathered copy of K/V, not the work


def fast_path(q: torch.Tensor, q_start: int, window, softcap, doc_start, page_select, visits) -> bool:
    """Whether a call runs on the fused CPU kernels (else on the reference)."""
    no_window = window is None or window >= q_start + q.shape[2]
    plain = softcap is None and doc_start is None and visits is None
    return q.device.type == "cpu" and no_window and plain


def _unit_last_stride(x: torch.Tensor) -> torch.Tensor:
    """``x`` with unit stride along its last dim, copied only when it has another: the fused kernels honour every
    other stride but read the head dim as if dense (a ``q`` transposed from ``[.., D, L]`` gave wrong results)."""
    return x if x.stride(-1) == 1 else x.contiguous()


def _flash(q, k, v, causal: bool, scale: float):
    return _flash_op(*map(_unit_last_stride, (q, k, v)), 0.0, causal, scale=scale)


def _flash_backward(dout, q, k, v, out, lse, causal: bool, scale: float):
    return _flash_backward_op(*map(_unit_last_stride, (dout, q, k, v, out, lse)), 0.0, causal, scale=scale)


def _pieces(q_start: int, lo: int, hi: int):
    """``(first_row, first_key, end_key, causal)`` covering the keys ``[lo, hi)``: blocks of the keys before
    ``q_start`` (every row, non-causal), then the rest, causal for the rows from its first key on (top-left
    aligned: row ``first_row + i`` sees keys up to ``first_key + i``)."""
    for first in range(lo, min(hi, q_start), PAST_BLOCK):
        yield 0, first, min(first + PAST_BLOCK, hi, q_start), False
    own = max(lo, q_start)
    if own < hi:
        yield own - q_start, own, hi, True


def _selected_pieces(page_select: torch.Tensor, page_table: torch.Tensor, page: int, q_start: int, lq: int, lo: int,
                     hi: int):  # fmt: skip
    """``(b, rows, slots [1, n])`` per batch row ``b`` and query block (``rows``: its slice of the chunk) with
    selected pages among the keys ``[lo, hi)`` before ``q_start``: the slots of those pages (every row of the block
    sees all of their keys: without a window or documents, a past key is visible). Blocks without one are skipped."""
    first, end = lo // page, min(hi, q_start) // page
    if first >= end:
        return
    for b in range(page_select.shape[0]):
        for block in range(page_select.shape[1]):
            pages = page_select[b, block].long()
            pages = pages[(pages >= first) & (pages < end)]
            if pages.numel():
                yield b, slice(block * page, min((block + 1) * page, lq)), page_table[b, pages][None]


def _keys(pages: torch.Tensor, page_table: torch.Tensor, first: int, end: int, dtype: torch.dtype):
    """Tokens ``[first, end)`` of the pages as ``[B, Hkv, end - first, D]`` in ``dtype``, and the slots read."""
    page = pages.shape[2]
    slots = page_table[:, first // page : -(-end // page)]
    start = first - first // page * page
    return gather_tokens(pages, slots).to(dtype)[:, :, start : start + end - first], slots, start


def _stacked(x: torch.Tensor, hkv: int) -> torch.Tensor:
    """``[B, Hq, L, ...]`` -> ``[B, Hkv, G * L, ...]``: the query heads of a KV head as one row sequence."""
    return x.reshape(x.shape[0], hkv, -1, *x.shape[3:])


def _per_query_head(x: torch.Tensor, hq: int) -> torch.Tensor:
    return x.repeat_interleave(hq // x.shape[1], 1)


def _attend(q, k, v, causal: bool, scale: float):
    """``(out, lse)`` ``[B, Hq, L, D]``, ``[B, Hq, L]`` of one piece (``k, v`` per KV head)."""
    b, hq, lq, d = q.shape
    if causal:
        return _flash(q, _per_query_head(k, hq), _per_query_head(v, hq), True, scale)
    out, lse = _flash(_stacked(q, k.shape[1]), k, v, False, scale)
    return out.reshape(b, hq, lq, d), lse.reshape(b, hq, lq)


def _attend_backward(dout, q, out, lse, k, v, causal: bool, scale: float):
    """``(dq [B, Hq, L, D], dk, dv [B, Hkv, Lk, D])`` of one piece, as :func:`_attend` splits it."""
    hq, hkv = q.shape[1], k.shape[1]
    if causal:
        dq, dk, dv = _flash_backward(
            dout, q, _per_query_head(k, hq), _per_query_head(v, hq), out, lse, True, scale
        )
        return dq, _grouped_sum(dk, hkv), _grouped_sum(dv, hkv)
    dout, qs, out, lse = (_stacked(x, hkv) for x in (dout, q, out, lse))
    dq, dk, dv = _flash_backward(dout, qs, k, v, out, lse, False, scale)
    return dq.reshape(q.shape), dk, dv


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
    """As :func:`lightning_oomb.engine.reference.paged_attention_forward`."""
    args = (q, k_pages, v_pages, page_table, q_start, scale, window)
    terms = {"softcap": softcap, "doc_start": doc_start, "page_select": page_select, "visits": visits}
    if not fast_path(q, q_start, window, softcap, doc_start, page_select, visits):
        return reference.paged_attention_forward(*args, key_range=key_range, state=state, **terms)
    lq, page = q.shape[2], k_pages.shape[2]
    check_terms(q, page, q_start, window, softcap, doc_start, page_select)
    lo, hi = checked_key_range(key_range, q_start + lq, page)
    dtype = compute_dtype(q)
    own = state is None
    if own:
        state = init_state(q)
    else:
        for name, x, shape in zip(("acc", "m", "l"), state, (q.shape, q.shape[:-1], q.shape[:-1])):
            check_buffer(f"state {name}", x, shape, dtype, q.device)
    qc = q.to(dtype)
    pieces = list(_pieces(q_start, lo, hi))
    if page_select is not None:  # the keys before q_start: each query block's selected pages
        for b, rows, slots in _selected_pieces(page_select, page_table, page, q_start, lq, lo, hi):
            k, v = (gather_tokens(x, slots).to(dtype) for x in (k_pages, v_pages))
            add_part(
                tuple(x[b : b + 1, :, rows] for x in state),
                *_attend(qc[b : b + 1, :, rows], k, v, False, scale),
            )
        pieces = [piece for piece in pieces if piece[3]]  # the chunk's own keys
    for row, first, end, causal in pieces:
        k = _keys(k_pages, page_table, first, end, dtype)[0]
        v = _keys(v_pages, page_table, first, end, dtype)[0]
        out, lse = _attend(qc[:, :, row:], k, v, causal, scale)
        if own and len(pieces) == 1 and row == 0 and page_select is None:
            return out.to(q.dtype), lse
        add_part(state, out, lse, row)
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
    """As :func:`lightning_oomb.engine.reference.paged_attention_backward`. A given ``delta`` is used as given
    (``out`` is then not read): it rides in one extra head-dim column, where ``out`` is zero."""
    args = (q, out, lse, dout, k_pages, v_pages, dk_pages, dv_pages, page_table, q_start, scale, window)
    terms = {"softcap": softcap, "doc_start": doc_start, "page_select": page_select, "visits": visits}
    if not fast_path(q, q_start, window, softcap, doc_start, page_select, visits):
        return reference.paged_attention_backward(*args, key_range=key_range, delta=delta, dq=dq, **terms)
    lq, page = q.shape[2], k_pages.shape[2]
    check_terms(q, page, q_start, window, softcap, doc_start, page_select)
    lo, hi = checked_key_range(key_range, q_start + lq, page)
    dtype = compute_dtype(q)
    if delta is not None:
        check_buffer("delta", delta, q.shape[:-1], dtype, q.device)
    own = dq is None
    if own:
        dq = torch.zeros(q.shape, dtype=dtype, device=q.device)
    check_buffer("dq", dq, q.shape, dtype, q.device)
    qc, doc, outc, lsec = (x.to(dtype) for x in (q, dout, out, lse))
    # rowsum(dO' * O') = delta for dO' = [dO, 1], O' = [0, delta]; q, k, v get a 0 column
    if delta is not None:
        qc, doc = _with_column(qc, 0.0), _with_column(doc, 1.0)
        outc = torch.cat([torch.zeros_like(outc), delta[..., None]], -1)
    d = q.shape[3]
    pieces = list(_pieces(q_start, lo, hi))
    if page_select is not None:  # the keys before q_start: each query block's selected pages
        for b, rows, slots in _selected_pieces(page_select, page_table, page, q_start, lq, lo, hi):
            k, v = (gather_tokens(x, slots).to(dtype) for x in (k_pages, v_pages))
            if delta is not None:
                k, v = _with_column(k, 0.0), _with_column(v, 0.0)
            part = [x[b : b + 1, :, rows] for x in (doc, qc, outc, lsec)]
            gq, gk, gv = _attend_backward(*part, k, v, False, scale)
            dq[b : b + 1, :, rows] += gq[..., :d]
            add_tokens(dk_pages, slots, gk[..., :d])
            add_tokens(dv_pages, slots, gv[..., :d])
        pieces = [piece for piece in pieces if piece[3]]  # the chunk's own keys
    for row, first, end, causal in pieces:
        k, slots, start = _keys(k_pages, page_table, first, end, dtype)
        v = _keys(v_pages, page_table, first, end, dtype)[0]
        if delta is not None:
            k, v = _with_column(k, 0.0), _with_column(v, 0.0)
        rows = [x[:, :, row:] for x in (doc, qc, outc, lsec)]
        gq, gk, gv = _attend_backward(*rows, k, v, causal, scale)
        dq[:, :, row:] += gq[..., :d]
        _add(dk_pages, slots, start, gk[..., :d])
        _add(dv_pages, slots, start, gv[..., :d])
    return dq.to(q.dtype) if own else dq


def _add(pages: torch.Tensor, slots: torch.Tensor, start: int, tokens: torch.Tensor) -> None:
    """Add ``tokens [B, Hkv, n, D]`` (from offset ``start`` of the first page) into the pages ``slots``."""
    after = slots.shape[1] * pages.shape[2] - start - tokens.shape[2]
    add_tokens(pages, slots, torch.nn.functional.pad(tokens, (0, 0, start, after)))


def _with_column(x: torch.Tensor, value: float) -> torch.Tensor:
    return torch.nn.functional.pad(x, (0, 1), value=value)


def _grouped_sum(g: torch.Tensor, hkv: int) -> torch.Tensor:
    """``[B, Hq, L, D]`` gradients per query head -> ``[B, Hkv, L, D]`` (summed over each KV head's group)."""
    b, hq, length, d = g.shape
    return g.view(b, hkv, hq // hkv, length, d).sum(2)
