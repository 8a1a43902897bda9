"""The fused CPU attention backend (``attention_backend="cpu"``, what ``auto`` picks for CPU tensors).

The contract's two functions (``csrc_triton.contract``) on torch's fused flash attention for CPU
(``aten::_scaled_dot_product_flash_attention_for_cpu`` and its backward, which return and take the log-sum-exp).
A call's keys split into two pieces: those before ``q_start``, which every query sees (one non-causal call, the
query heads of a KV head stacked along the rows, so K/V are never repeated), and the chunk's own keys, which the
queries see causally (one call with ``is_causal``, K/V repeated per query head). The pieces fold into a softmax
state by log-sum-exp (:mod:`lightning_oomb.engine.lse`), as the kernels fold key blocks. Arithmetic in float32
(float64 for float64 inputs), as the reference.

:func:`fast_path` says which calls go this way: CPU tensors without softcap or tile counter. With a page selection
(sparse attention) the keys before ``q_start`` are each query block's selected pages instead: one non-causal call per
batch row and query block over its pages, gathered (masked to what each row's window and document leave). With documents
(packed rows) each batch row's run of rows in one document is a query of its own: the keys of its document before its
first row (non-causal), then its own rows' (causal) — a call or two per document. With a sliding window of ``W`` keys
the rows (a document's rows, with documents) go in blocks of at most ``W``: per block the keys only its first rows see
(the window's lower edge: a causal call on the rows and keys reversed), those every row sees, then its own keys (causal)
(:func:`_pieces`). Every other call is the plain reference's (:mod:`lightning_oomb.engine.reference`, the oracle the
tests compare this backend with).
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from csrc_triton.contract import check_buffer, check_call, check_terms
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


def fast_path(q: torch.Tensor, softcap, visits) -> bool:
    """Whether a call runs on the fused CPU kernels (else on the reference): CPU tensors, no softcap (the kernels'
    scores are plain dot products), no tile counter (a Triton kernel's measure)."""
    return q.device.type == "cpu" and softcap is None and visits is None


def _unit_last_stride(x: torch.Tensor) -> torch.Tensor:
    """``x`` with unit stride along its last dim, copied only when it has another: the fused kernels honour every
    other stride but read the head dim as if dense (a ``q`` transposed from ``[.., D, L]`` gave wrong results)."""
    return x if x.stride(-1) == 1 else x.contiguous()


def _flash(q, k, v, causal: bool, scale: float, mask=None):
    return _flash_op(*map(_unit_last_stride, (q, k, v)), 0.0, causal, attn_mask=mask, scale=scale)


def _flash_backward(dout, q, k, v, out, lse, causal: bool, scale: float, mask=None):
    args = map(_unit_last_stride, (dout, q, k, v, out, lse))
    return _flash_backward_op(*args, 0.0, causal, attn_mask=mask, scale=scale)


class _Piece(NamedTuple):
    """One call: query ``rows`` of the batch rows ``batch`` attend to ``length`` keys starting ``start`` tokens into
    the pages ``slots [len(batch), n]`` (causal: top-left aligned, row ``rows.start + i`` sees the first ``i + 1``
    keys; else every row sees every key, or those ``visible [rows, length]`` marks). ``flipped``: causal with the rows
    and the keys both reversed — the last row sees the last key, the row before it the last two, ... (a window's
    lower edge)."""

    batch: slice
    rows: slice
    causal: bool
    slots: torch.Tensor
    start: int
    length: int
    flipped: bool = False
    visible: torch.Tensor | None = None


def _range(
    page_table: torch.Tensor, page: int, batch: slice, rows: slice, first: int, end: int, causal: bool,
    flipped: bool = False,
):  # fmt: skip
    """The piece of the keys ``[first, end)``."""
    slots = page_table[batch, first // page : -(-end // page)]
    return _Piece(batch, rows, causal, slots, first - first // page * page, end - first, flipped)


def _window_pieces(page_table, page: int, batch: slice, r0: int, r1: int, q_start: int, window: int, lo: int,
                   hi: int):  # fmt: skip
    """The pieces of a sliding window (row at position ``p`` sees keys ``(p - window, p]``) for the rows
    ``[r0, r1)``, in blocks of at most ``window``, in ``[lo, hi)``: per block ``[p0, p1)`` its lower edge, the keys
    from ``p0 - window + 1`` to ``p1 - window`` before ``p0`` (row ``p`` sees those from ``p - window + 1`` on:
    flipped causal, for the rows that see one; a row whose window starts below ``lo`` sees them all), the keys every
    row sees ``[p1 - window + 1, p0)``, and its own keys, causally."""
    for b0 in range(r0, r1, window):
        b1 = min(b0 + window, r1)
        p0, p1 = q_start + b0, q_start + b1
        first, end = max(p0 - window + 1, lo, 0), min(p1 - window + 1, p0, hi)  # (never its own keys)
        if first < end:  # rows from p0 to the last that sees key end - 1
            rows = slice(b0, min(b1, end + window - 1 - q_start))
            yield _range(page_table, page, batch, rows, first, end, True, flipped=True)
        yield from _row_pieces(page_table, page, batch, b0, b1, q_start, max(p1 - window + 1, 0), lo, hi)


def _row_pieces(page_table, page: int, batch: slice, r0: int, r1: int, q_start: int, first_key: int, lo: int,
                hi: int):  # fmt: skip
    """The pieces of rows ``[r0, r1)`` whose keys are ``[first_key, q_start + i]`` (row ``i``), inside the key range
    ``[lo, hi)``: those before the rows' own keys, which every row sees (in blocks of ``PAST_BLOCK``), then the
    rows' own keys, causally."""
    before = min(q_start + r0, hi)
    for first in range(max(first_key, lo), before, PAST_BLOCK):
        yield _range(page_table, page, batch, slice(r0, r1), first, min(first + PAST_BLOCK, before), False)
    own, end = max(q_start + r0, lo), min(q_start + r1, hi)
    if own < end:
        yield _range(page_table, page, batch, slice(own - q_start, r1), own, end, True)


def _pieces(page_table, page: int, q_start: int, lq: int, lo: int, hi: int, window, doc_start, page_select):
    """The calls of an attention call over the keys ``[lo, hi)``: the whole batch's rows at once; a window's in
    blocks of rows (:func:`_window_pieces`); per batch row and document with ``doc_start`` (a window's blocks inside
    each document's rows, its keys from the document's start on); with ``page_select`` per batch row and query
    block its selected pages before ``q_start`` (:func:`_selected_pieces`), then the chunk's own keys as above."""
    if window is not None and window >= q_start + lq:
        window = None  # drops no key
    if page_select is not None:
        yield from _selected_pieces(page_table, page, q_start, lq, lo, hi, window, doc_start, page_select)
        lo = max(lo, q_start)
    if doc_start is not None:
        for b in range(doc_start.shape[0]):
            starts = doc_start[b]
            edges = [0, *(torch.nonzero(starts[1:] != starts[:-1]).flatten() + 1).tolist(), lq]
            for r0, r1 in zip(edges[:-1], edges[1:]):
                first, row = int(starts[r0]), slice(b, b + 1)
                if window is None:
                    yield from _row_pieces(page_table, page, row, r0, r1, q_start, first, lo, hi)
                else:
                    yield from _window_pieces(
                        page_table, page, row, r0, r1, q_start, window, max(lo, first), hi
                    )
    elif window is not None:
        yield from _window_pieces(page_table, page, slice(None), 0, lq, q_start, window, lo, hi)
    else:
        yield from _row_pieces(page_table, page, slice(None), 0, lq, q_start, 0, lo, hi)


def _selected_pieces(
    page_table, page: int, q_start: int, lq: int, lo: int, hi: int, window, doc_start, page_select
):
    """Per batch row and query block, its selected pages in ``[lo, min(hi, q_start))``, gathered: every row of the
    block sees all of their keys, or — with a window or documents — the rows that see any (a first run of the
    block's: the later a row, the fewer of the keys before the chunk it sees) those their window and document
    leave (``visible``)."""
    first, end = lo // page, min(hi, q_start) // page
    for b in range(page_select.shape[0]) if first < end else ():
        for block in range(page_select.shape[1]):
            pages = page_select[b, block].long()
            pages = pages[(pages >= first) & (pages < end)]
            if not pages.numel():
                continue
            rows, visible = slice(block * page, min((block + 1) * page, lq)), None
            if window is not None or doc_start is not None:
                keys = (pages[:, None] * page + torch.arange(page)).flatten()
                at = torch.arange(q_start + rows.start, q_start + rows.stop)[:, None]
                floor = torch.zeros_like(at) if window is None else at - window + 1  # each row's first key
                if doc_start is not None:
                    floor = torch.maximum(floor, doc_start[b, rows, None])
                visible = keys >= floor  # [rows, keys]
                seen = int(visible.any(1).sum())
                if not seen:
                    continue
                rows, visible = slice(rows.start, rows.start + seen), visible[:seen]
                visible = None if bool(visible.all()) else visible
            slots = page_table[b, pages][None]
            yield _Piece(slice(b, b + 1), rows, False, slots, 0, slots.shape[1] * page, visible=visible)


def _mask(piece: _Piece, groups: int, dtype: torch.dtype) -> torch.Tensor | None:
    """The piece's ``visible`` as the fused kernels take it: additive (0 or -inf) in ``dtype``, for the query heads
    of a KV head stacked as rows (``groups`` of them); ``None`` without."""
    if piece.visible is None:
        return None
    mask = torch.zeros(piece.visible.shape, dtype=dtype).masked_fill_(~piece.visible, float("-inf"))
    return mask.repeat(groups, 1)[None, None]


def _reversed(piece: _Piece, *xs: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """``xs`` (rows or keys along dim 2) reversed for a flipped piece (:class:`_Piece`), else as they are."""
    return tuple(x.flip(2) for x in xs) if piece.flipped else xs


def _keys(pages: torch.Tensor, piece: _Piece, dtype: torch.dtype) -> torch.Tensor:
    """The piece's keys (or values) as ``[B, Hkv, length, D]`` in ``dtype``."""
    return gather_tokens(pages, piece.slots).to(dtype)[:, :, piece.start : piece.start + piece.length]


def _stacked(x: torch.Tensor, hkv: int) -> torch.Tensor:
    """``[B, Hq, L, ...]`` -> ``[B, Hkv, G * L, ...]``: the query heads of a KV head as one row sequence."""
    return x.reshape(x.shape[0], hkv, -1, *x.shape[3:])


def _per_query_head(x: torch.Tensor, hq: int) -> torch.Tensor:
    return x.repeat_interleave(hq // x.shape[1], 1)


def _attend(q, k, v, causal: bool, scale: float, mask=None):
    """``(out, lse)`` ``[B, Hq, L, D]``, ``[B, Hq, L]`` of one piece (``k, v`` per KV head; ``mask``: as
    :func:`_mask` makes it)."""
    b, hq, lq, d = q.shape
    if causal:
        return _flash(q, _per_query_head(k, hq), _per_query_head(v, hq), True, scale)
    out, lse = _flash(_stacked(q, k.shape[1]), k, v, False, scale, mask)
    return out.reshape(b, hq, lq, d), lse.reshape(b, hq, lq)


def _attend_backward(dout, q, out, lse, k, v, causal: bool, scale: float, mask=None):
    """``(dq [B, Hq, L, D], dk, dv [B, Hkv, Lk, D])`` of one piece, as :func:`_attend` splits it."""
    hq, hkv = q.shape[1], k.shape[1]
    if causal:
        dq, dk, dv = _flash_backward(
            dout, q, _per_query_head(k, hq), _per_query_head(v, hq), out, lse, True, scale
        )
        return dq, _grouped_sum(dk, hkv), _grouped_sum(dv, hkv)
    dout, qs, out, lse = (_stacked(x, hkv) for x in (dout, q, out, lse))
    dq, dk, dv = _flash_backward(dout, qs, k, v, out, lse, False, scale, mask)
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
    if not fast_path(q, softcap, visits):
        return reference.paged_attention_forward(*args, key_range=key_range, state=state, **terms)
    lq, page = q.shape[2], k_pages.shape[2]
    lo, hi = check_call(q, k_pages, v_pages, page_table, q_start, key_range)
    check_terms(q, page, q_start, window, softcap, doc_start, page_select)
    dtype = compute_dtype(q)
    own = state is None
    if own:
        state = init_state(q)
    else:
        for name, x, shape in zip(("acc", "m", "l"), state, (q.shape, q.shape[:-1], q.shape[:-1])):
            check_buffer(f"state {name}", x, shape, dtype, q.device)
    qc = q.to(dtype)
    pieces = list(_pieces(page_table, page, q_start, lq, lo, hi, window, doc_start, page_select))
    for piece in pieces:
        qr, k, v = _reversed(piece, qc[piece.batch, :, piece.rows], _keys(k_pages, piece, dtype),
                             _keys(v_pages, piece, dtype))  # fmt: skip
        mask = _mask(piece, q.shape[1] // k.shape[1], dtype)
        out, lse = _reversed(piece, *_attend(qr, k, v, piece.causal, scale, mask))
        if own and len(pieces) == 1 and piece.batch == slice(None) and piece.rows == slice(0, lq):
            return out.to(q.dtype), lse
        add_part(tuple(x[piece.batch, :, piece.rows] for x in state), out, lse)
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
    if not fast_path(q, softcap, visits):
        return reference.paged_attention_backward(*args, key_range=key_range, delta=delta, dq=dq, **terms)
    lq, page = q.shape[2], k_pages.shape[2]
    lo, hi = check_call(q, k_pages, v_pages, page_table, q_start, key_range)
    check_terms(q, page, q_start, window, softcap, doc_start, page_select)
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
    # a piece's gathered K/V are dropped once its kernel has run, and its gradients once added: at most four
    # K/V-sized copies at a time (K, V and their gradients; the gradients and their paged or flipped copies)
    for piece in _pieces(page_table, page, q_start, lq, lo, hi, window, doc_start, page_select):
        k, v = _keys(k_pages, piece, dtype), _keys(v_pages, piece, dtype)
        if delta is not None:
            k, v = _with_column(k, 0.0), _with_column(v, 0.0)
        mask = _mask(piece, q.shape[1] // k.shape[1], dtype)
        rows = _reversed(piece, *(x[piece.batch, :, piece.rows] for x in (doc, qc, outc, lsec)), k, v)
        del k, v  # (rows holds them, or their flipped copies)
        grads = _attend_backward(*rows, piece.causal, scale, mask)
        del rows
        gq, gk, gv = _reversed(piece, *grads)
        del grads
        dq[piece.batch, :, piece.rows] += gq[..., :d]
        _add(dk_pages, piece, gk[..., :d])
        _add(dv_pages, piece, gv[..., :d])
        del gq, gk, gv
    return dq.to(q.dtype) if own else dq


def _add(pages: torch.Tensor, piece: _Piece, tokens: torch.Tensor) -> None:
    """Add the piece's key gradients ``tokens [B, Hkv, length, D]`` into its pages."""
    after = piece.slots.shape[1] * pages.shape[2] - piece.start - tokens.shape[2]
    if piece.start or after:  # whole pages: no padded copy
        tokens = torch.nn.functional.pad(tokens, (0, 0, piece.start, after))
    add_tokens(pages, piece.slots, tokens)


def _with_column(x: torch.Tensor, value: float) -> torch.Tensor:
    return torch.nn.functional.pad(x, (0, 1), value=value)


def _grouped_sum(g: torch.Tensor, hkv: int) -> torch.Tensor:
    """``[B, Hq, L, D]`` gradients per query head -> ``[B, Hkv, L, D]`` (summed over each KV head's group)."""
    b, hq, length, d = g.shape
    return g.view(b, hkv, hq // hkv, length, d).sum(2)
