"""Paged KV + KV-gradient pool.

One *page* holds ``page_size`` consecutive tokens of K (and V) for one layer and one batch row, laid out
``[kv_heads, page_size, head_dim]``. All pages of a tier live in one arena tensor ``[slots, kv_heads, page_size,
head_dim]`` (never one tensor per page); a page table ``[layers, batch, pages] -> slot`` addresses them, so kernels
index pages through the table and know nothing about where a page came from.

Gradient pages mirror the K/V pages (same slots) in ``grad_dtype``: float32 by default, bfloat16 opt-in; they
are never kept below the K/V dtype (float64 models get float64 gradient pages, which the exactness tests use).

The pool is sized per step from the sequence length and reused across steps: arenas only grow. Today there is
one tier (the device the model runs on); the offload issue adds a pinned host tier behind :meth:`KVPool.view`,
which is the only way attention reads pages, so callers do not change.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from lightning_oomb.engine.errors import OOMBConfigError

GRAD_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


@dataclass(frozen=True)
class PoolShape:
    """What the pool must hold for one step."""

    num_layers: int
    batch: int
    seq_len: int
    kv_heads: int
    head_dim: int
    page_size: int
    dtype: torch.dtype
    grad_dtype: torch.dtype

    @property
    def pages_per_row(self) -> int:
        return math.ceil(self.seq_len / self.page_size)

    @property
    def num_slots(self) -> int:
        return self.num_layers * self.batch * self.pages_per_row

    @property
    def page_numel(self) -> int:
        return self.kv_heads * self.page_size * self.head_dim

    @property
    def kv_bytes(self) -> int:
        """Bytes of the K and V pages."""
        return 2 * self.num_slots * self.page_numel * self.dtype.itemsize

    @property
    def grad_bytes(self) -> int:
        """Bytes of the dK and dV gradient pages."""
        return 2 * self.num_slots * self.page_numel * self.grad_dtype.itemsize


@dataclass
class PagedKV:
    """What the attention op reads for one layer: arenas, the page table and how many tokens are valid.

    ``k``/``v``: ``[slots, kv_heads, page_size, head_dim]``; ``dk``/``dv``: the same in the gradient dtype;
    ``page_table``: int32 ``[batch, pages]`` (row ``b``'s page ``j`` lives in slot ``page_table[b, j]``).
    """

    k: torch.Tensor
    v: torch.Tensor
    dk: torch.Tensor
    dv: torch.Tensor
    page_table: torch.Tensor

    @property
    def page_size(self) -> int:
        return self.k.shape[2]


def resolve_grad_dtype(name: str, kv_dtype: torch.dtype) -> torch.dtype:
    """The gradient-page dtype for option ``name``, never narrower than the K/V dtype."""
    if name not in GRAD_DTYPES:
        raise OOMBConfigError(
            f"kv_grad_dtype={name!r} is not supported — gradient pages are accumulated in place — "
            f"use one of {sorted(GRAD_DTYPES)}."
        )
    grad = GRAD_DTYPES[name]
    return kv_dtype if kv_dtype.itemsize > grad.itemsize else grad


class KVPool:
    """Paged K/V and dK/dV storage for one sequence batch (see the module docstring)."""

    def __init__(self) -> None:
        self.shape: PoolShape | None = None
        self._k = self._v = self._dk = self._dv = None
        self._table: torch.Tensor | None = None

    # ----------------------------------------------------------------------------------------------- sizing
    def reserve(self, shape: PoolShape, device: torch.device) -> None:
        """Make room for ``shape``; arenas are reallocated only when they must grow (or change dtype/device)."""
        if self._k is not None and not self._fits(shape, device):
            self.release()
        if self._k is None:
            arena = (shape.num_slots, shape.kv_heads, shape.page_size, shape.head_dim)
            # zeros, not empty: a masked-out key in a ragged last page must never be NaN (0 * NaN = NaN).
            self._k = torch.zeros(arena, dtype=shape.dtype, device=device)
            self._v = torch.zeros_like(self._k)
            self._dk = torch.zeros(arena, dtype=shape.grad_dtype, device=device)
            self._dv = torch.zeros_like(self._dk)
        slots = torch.arange(shape.num_slots, dtype=torch.int32, device=device)
        self._table = slots.view(shape.num_layers, shape.batch, shape.pages_per_row)
        self.shape = shape

    def _fits(self, shape: PoolShape, device: torch.device) -> bool:
        k = self._k
        return (
            k.device == device
            and k.dtype == shape.dtype
            and self._dk.dtype == shape.grad_dtype
            and k.shape[1:] == (shape.kv_heads, shape.page_size, shape.head_dim)
            and k.shape[0] >= shape.num_slots
        )

    def release(self) -> None:
        """Free every arena (after an exception, or on teardown)."""
        self._k = self._v = self._dk = self._dv = self._table = None
        self.shape = None

    @property
    def allocated_bytes(self) -> int:
        """Bytes held by the arenas (K, V, dK, dV), including slack from earlier, longer steps."""
        return sum(t.numel() * t.element_size() for t in (self._k, self._v, self._dk, self._dv) if t is not None)

    # ------------------------------------------------------------------------------------------------ access
    def _pages(self, layer: int, start: int, length: int) -> torch.Tensor:
        """Slots of the pages that hold tokens ``[start, start + length)``; ``start`` is page aligned."""
        page = self.shape.page_size
        assert start % page == 0, "chunks start on page boundaries"
        return self._table[layer, :, start // page : math.ceil((start + length) / page)]

    def _token_view(self, arena: torch.Tensor, slots: torch.Tensor, length: int) -> torch.Tensor:
        """Gather pages ``slots [B, n]`` into ``[B, kv_heads, length, head_dim]`` (a copy)."""
        b, n = slots.shape
        pages = arena[slots.flatten().long()].view(b, n, *arena.shape[1:])
        tokens = pages.transpose(1, 2).reshape(b, arena.shape[1], n * self.shape.page_size, arena.shape[3])
        return tokens[:, :, :length]

    def write(self, layer: int, start: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store a chunk's post-RoPE ``k, v [B, kv_heads, L, head_dim]`` at token ``start``; zero its grads."""
        length = k.shape[2]
        slots = self._pages(layer, start, length).flatten().long()
        b, h, _, d = k.shape
        page = self.shape.page_size
        padded = math.ceil(length / page) * page
        for arena, grad, x in ((self._k, self._dk, k), (self._v, self._dv, v)):
            if padded != length:
                x = torch.nn.functional.pad(x, (0, 0, 0, padded - length))
            pages = x.reshape(b, h, padded // page, page, d).transpose(1, 2).reshape(-1, h, page, d)
            arena.index_copy_(0, slots, pages.to(arena.dtype))
            grad.index_fill_(0, slots, 0)

    def view(self, layer: int, num_tokens: int) -> PagedKV:
        """The pages of ``layer`` holding tokens ``[0, num_tokens)``, for the attention op."""
        return PagedKV(self._k, self._v, self._dk, self._dv, self._pages(layer, 0, num_tokens))

    def read_grad(self, layer: int, start: int, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Accumulated ``dk, dv [B, kv_heads, length, head_dim]`` of tokens ``[start, start + length)``."""
        slots = self._pages(layer, start, length)
        return self._token_view(self._dk, slots, length), self._token_view(self._dv, slots, length)

    def read_kv(self, layer: int, start: int, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Stored ``k, v`` of tokens ``[start, start + length)`` (tests and debugging)."""
        slots = self._pages(layer, start, length)
        return self._token_view(self._k, slots, length), self._token_view(self._v, slots, length)
