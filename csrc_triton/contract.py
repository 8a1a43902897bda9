"""The call contract of paged attention, shared by the Triton kernels, their torch reference and the fused CPU path
(plain Python).

Every backend exposes the same three functions with the same arguments, so that dispatch is choosing a module
(``csrc_triton.paged_attention``, ``lightning_oomb.engine.reference`` or ``lightning_oomb.engine.cpu_attention``) and
one test suite runs over all::

    paged_attention_forward(q, k_pages, v_pages, page_table, q_start, scale, window=None, *,
                            key_range=None, state=None, softcap=None, doc_start=None, page_select=None,
                            visits=None) -> (out, lse) | None
    paged_attention_backward(q, out, lse, dout, k_pages, v_pages, dk_pages, dv_pages, page_table, q_start, scale,
                             window=None, *, key_range=None, delta=None, dq=None, softcap=None, doc_start=None,
                             page_select=None, visits=None) -> dq
    attention_delta(out, dout) -> delta

- ``q [B, Hq, Lq, D]`` at absolute positions ``[q_start, q_start + Lq)``; pages ``[slots, Hkv, P, D]``;
  ``page_table`` int32 ``[B, n_pages]`` (row ``b``'s page ``j`` is slot ``page_table[b, j]``).
- Query ``i`` sees key ``j`` iff ``j <= q_start + i`` and, with a sliding ``window`` W, ``j > q_start + i - W``
  (lower-right causal); query head ``h`` reads KV head ``h // (Hq // Hkv)`` (GQA, never repeated).
- Scores are ``s = q . k * scale``, or with ``softcap`` c (Gemma 2) ``s = c * tanh(q . k * scale / c)``.
- Packed rows: ``doc_start`` int ``[B, Lq]`` is each query's document start (absolute, never decreasing along a
  row): query ``i`` also needs ``j >= doc_start[b, i]``; key blocks before a query block's earliest document start
  are never visited. ``visits``: an int32 ``[1]`` tensor the number of tiles computed is added to (tests and
  benchmarks measure the skipping with it).
- Sparse attention: ``page_select`` int32 ``[B, R, K]`` with ``R = ceil(Lq / P)`` (``q_start`` a multiple of the
  page size ``P``): query block ``r`` (queries ``[r * P, (r + 1) * P)`` of the call) sees, of the keys before
  ``q_start``, only those on the pages listed in row ``[b, r]`` — absolute page indices ``< q_start / P``,
  ascending, padded at the end with ``-1`` (:func:`check_page_select`). Keys at or after ``q_start`` (the chunk's
  own pages) are seen as without it. Only listed pages are read; backward adds dK/dV only into them.
- ``key_range=(lo, hi)``: only keys ``[lo, hi)`` (:func:`checked_key_range`); ``state=(acc, m, l)``: fold the keys
  into a carried softmax state in place and return ``None``; ``delta``/``dq``: a precomputed ``rowsum(dO * O)``
  and an accumulator dQ is added into (all checked by :func:`check_buffer`).
- ``attention_delta``: ``rowsum(dout * out)`` ``[B, Hq, Lq]``, the ``delta`` that the backward calls of several
  key parts share (the Triton backend computes it with its pre-pass kernel, the reference in torch).
- ``out`` has ``q``'s dtype, ``lse`` (natural log) and the buffers are float32 (float64 for float64 inputs, which
  only the torch backends take). Backward **adds** dK/dV of every key it visits into ``dk_pages``/``dv_pages``.

Attention sinks (a learned logit per query head in the softmax denominator) need no kernel argument: they are
applied to the merged ``(out, lse)`` and the backward takes the sink-corrected ones (``lightning_oomb.engine.lse``).
New score terms enter as further keyword-only arguments of both functions, documented and checked here.
"""

from __future__ import annotations

import torch


def checked_key_range(key_range: tuple[int, int] | None, num_keys: int, page: int) -> tuple[int, int]:
    """``key_range`` checked against its contract; ``None`` is every key ``[0, num_keys)``."""
    if key_range is None:
        return 0, num_keys
    lo, hi = key_range
    if not (0 <= lo < hi <= num_keys and lo % page == 0 and (hi % page == 0 or hi == num_keys)):
        raise ValueError(
            f"key_range={key_range} is not a page-aligned part of the keys [0, {num_keys}): need lo < hi, lo a "
            f"multiple of the page size {page} and hi one too or equal to q_start + Lq = {num_keys} — split "
            "the keys at page boundaries."
        )
    return lo, hi


def check_call(
    q: torch.Tensor,
    k_pages: torch.Tensor,
    v_pages: torch.Tensor,
    page_table: torch.Tensor,
    q_start: int,
    key_range,
) -> tuple[int, int]:
    """Check what every backend reads of a call: ``q [B, Hq, Lq, D]`` against the arenas ``[slots, Hkv, P, D]``
    (equal head_dim, Hq divisible by Hkv), a page table ``[B, n_pages]`` covering the keys up to the chunk's (or
    key range's) end; return the key range ``(lo, hi)``."""
    if q.dim() != 4 or k_pages.dim() != 4:
        raise ValueError(
            f"q must be [B, Hq, Lq, D] and arenas [slots, Hkv, P, D]; got {tuple(q.shape)}, {tuple(k_pages.shape)}"
        )
    b, hq, lq, d = q.shape
    hkv, page = k_pages.shape[1], k_pages.shape[2]
    if k_pages.shape[3] != d or v_pages.shape != k_pages.shape or hq % hkv:
        raise ValueError(
            f"q {tuple(q.shape)} does not match K/V pages {tuple(k_pages.shape)}/{tuple(v_pages.shape)}: "
            "need equal head_dim and Hq divisible by Hkv."
        )
    if page_table.dim() != 2 or page_table.shape[0] != b:
        raise ValueError(f"page_table must be [B={b}, n_pages]; got {tuple(page_table.shape)}.")
    lo, hi = checked_key_range(key_range, q_start + lq, page)
    if q_start < 0 or page_table.shape[1] * page < hi:
        raise ValueError(
            f"q_start={q_start}, Lq={lq}: the page table's {page_table.shape[1]} pages of {page} must cover keys "
            f"[0, {hi}) — pass the pages of every key up to the chunk's (or key range's) end."
        )
    return lo, hi


def check_window(window: int | None) -> None:
    if window is not None and window < 1:
        raise ValueError(f"window={window} must be a positive number of keys (or None).")


def check_softcap(softcap: float | None) -> None:
    if softcap is not None and not softcap > 0:
        raise ValueError(f"softcap={softcap} must be a positive logit cap (or None).")


def check_doc_start(doc_start, shape: tuple[int, int], device):
    """``doc_start`` (or ``None``) as an integer ``[B, Lq]`` tensor on ``device``."""
    if doc_start is not None and (
        tuple(doc_start.shape) != shape
        or doc_start.is_floating_point()
        or doc_start.device != torch.device(device)
    ):
        raise ValueError(
            f"doc_start must be an integer tensor [B, Lq] = {list(shape)} on {device} (each query's document start); "
            f"got {doc_start.dtype} {tuple(doc_start.shape)} on {doc_start.device}."
        )
    return doc_start


def check_buffer(name: str, x: torch.Tensor, shape: tuple[int, ...], dtype: torch.dtype, device) -> None:
    """A caller-owned buffer: the forward state or the dQ accumulator (updated in place), or a precomputed delta."""
    if x.shape != shape or x.dtype != dtype or not x.is_contiguous() or x.device != torch.device(device):
        raise ValueError(
            f"{name} must be a contiguous {dtype} tensor of shape {shape} on {device}; got {x.dtype} "
            f"{tuple(x.shape)} on {x.device} (contiguous: {x.is_contiguous()})."
        )


def check_page_select(page_select, shape: tuple[int, int], page: int, q_start: int, device):
    """``page_select`` (or ``None``) as an int32 ``[B, ceil(Lq / P), K]`` tensor on ``device`` with ``q_start`` page
    aligned (the values are the caller's: ascending page indices before ``q_start``, then ``-1`` padding — valid
    entries first: the kernels read a block's first ``n`` entries as its pages)."""
    if page_select is None:
        return None
    batch, lq = shape
    want = (batch, -(-lq // page))
    if (
        page_select.dim() != 3
        or tuple(page_select.shape[:2]) != want
        or page_select.dtype != torch.int32
        or page_select.device != torch.device(device)
    ):
        raise ValueError(
            f"page_select must be an int32 tensor [B, ceil(Lq / page), K] = [{want[0]}, {want[1]}, K] on {device} "
            f"(each query block's selected pages); got {page_select.dtype} {tuple(page_select.shape)} on "
            f"{page_select.device}."
        )
    if q_start % page:
        raise ValueError(
            f"page_select needs q_start={q_start} on a page boundary (page size {page}): query blocks and the "
            "pages before them are aligned to pages."
        )
    return page_select.contiguous()


def check_terms(q: torch.Tensor, page: int, q_start: int, window, softcap, doc_start, page_select):
    """Check a call's score terms (window, softcap, documents, page selection) against the contract; return the
    page selection (contiguous) or ``None``."""
    check_window(window)
    check_softcap(softcap)
    shape = (q.shape[0], q.shape[2])
    check_doc_start(doc_start, shape, q.device)
    return check_page_select(page_select, shape, page, q_start, q.device)
