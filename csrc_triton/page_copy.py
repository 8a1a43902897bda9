"""Scattered page copies in one kernel: ``dst[dst_rows] = src[src_rows]`` for one or two tensor pairs.

Offload's sparse calls stage only the selected pages of a host-tier block: hundreds of short runs, which as
``copy_`` calls cost the host more time than the copy engine needs for their bytes
(``benchmarks/staging_host_time.py``). This kernel moves them all at once: each program copies one slice of one row
(a page slot: ``[H, P, D]`` elements) of each pair. A CUDA kernel can read and write page-locked host memory mapped
into the device's address space (``cudaHostRegisterMapped``; Triton accepts such host pointers), so one side may
be the host tier — the copy then runs over PCIe on the SMs instead of the copy engine. Under ``TRITON_INTERPRET=1``
it runs on CPU tensors (tests); :func:`copy_rows_reference` is the torch oracle.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import triton
import triton.language as tl

BLOCK = 4096  # elements per program: 8 KB of bf16 per tensor, 16-byte vectors on 4 warps


@triton.jit
def _copy_rows_kernel(
    DST_A, SRC_A, DST_B, SRC_B, ROWS, n_rows, row_elems, TWO: tl.constexpr, BLOCK: tl.constexpr
):
    """Program ``(i, j)``: elements ``[j * BLOCK, (j + 1) * BLOCK)`` of row ``ROWS[n_rows + i]`` of the sources
    into row ``ROWS[i]`` of the destinations (``ROWS``: destination rows, then source rows)."""
    i, j = tl.program_id(0), tl.program_id(1)
    offs = j * BLOCK + tl.arange(0, BLOCK)
    ok = offs < row_elems
    dst = tl.load(ROWS + i).to(tl.int64) * row_elems + offs
    src = tl.load(ROWS + n_rows + i).to(tl.int64) * row_elems + offs
    tl.store(DST_A + dst, tl.load(SRC_A + src, mask=ok), mask=ok)
    if TWO:
        tl.store(DST_B + dst, tl.load(SRC_B + src, mask=ok), mask=ok)


def _checked(pairs: Sequence[tuple[torch.Tensor, torch.Tensor]], rows: torch.Tensor) -> int:
    """Elements per row of every tensor, after checking the call (see :func:`copy_rows`)."""
    if not 1 <= len(pairs) <= 2:
        raise ValueError(f"copy_rows takes one or two (dst, src) pairs; got {len(pairs)}.")
    tensors = [t for pair in pairs for t in pair]
    row = tensors[0].stride(0) if tensors[0].dim() else 0  # (contiguous: the elements of one index of dim 0)
    for t in tensors:
        if not t.is_contiguous() or t.dtype != tensors[0].dtype or t.dim() == 0 or t.stride(0) != row:
            raise ValueError(
                "copy_rows needs contiguous tensors of one dtype and one row size (elements per index of dim 0); "
                f"got {[(tuple(t.shape), t.dtype, t.is_contiguous()) for t in tensors]}."
            )
    if rows.dim() != 2 or rows.shape[0] != 2 or rows.dtype != torch.int64:
        raise ValueError(
            f"rows must be int64 [2, n] (destination rows, source rows); got {rows.dtype} {tuple(rows.shape)}."
        )
    return row


def copy_rows(pairs: Sequence[tuple[torch.Tensor, torch.Tensor]], rows: torch.Tensor) -> None:
    """For each ``(dst, src)`` of ``pairs`` (one or two, all of one dtype and row size): ``dst[rows[0]] =
    src[rows[1]]``, rows along dim 0, in one kernel on the current stream. ``rows``: int64 ``[2, n]`` where the
    kernel can read it (the device's memory). Rows are not checked against the tensors' lengths."""
    row = _checked(pairs, rows)
    n = rows.shape[1]
    if n == 0 or row == 0:
        return
    (dst_a, src_a), (dst_b, src_b) = pairs[0], pairs[-1]
    grid = (n, triton.cdiv(row, BLOCK))
    _copy_rows_kernel[grid](
        dst_a, src_a, dst_b, src_b, rows, n, row, TWO=len(pairs) == 2, BLOCK=BLOCK, num_warps=4
    )


def copy_rows_reference(pairs: Sequence[tuple[torch.Tensor, torch.Tensor]], rows: torch.Tensor) -> None:
    """:func:`copy_rows` in torch (the oracle; what a transport without the kernel does)."""
    _checked(pairs, rows)
    for dst, src in pairs:
        dst.index_copy_(0, rows[0].to(dst.device), src.index_select(0, rows[1].to(src.device)).to(dst.device))
