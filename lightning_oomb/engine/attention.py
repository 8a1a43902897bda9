"""The attention op: a chunk's queries against all stored pages of its layer, as an autograd Function.

``paged_attention(q, k, v, chunk, layer, scale, window) -> out`` with ``q [B, Hq, Lq, D]`` and the chunk's own
post-RoPE ``k, v [B, Hkv, Lq, D]``. In the forward sweep ``k, v`` are first written into the pool, so the kernels
see one uniform paged sequence ``[0, chunk.start + Lq)`` with lower-right causal alignment. Backward computes dQ,
**adds** dK/dV of every page read into the pool's gradient pages (the chunk's own pages included), and returns
the chunk's accumulated gradient pages as the gradient of ``k, v`` — they already hold every later chunk's
contribution because the backward sweep runs chunks in reverse.

Dispatch: the Triton kernels (``csrc_triton``) for CUDA tensors, the plain-torch reference
(:mod:`lightning_oomb.engine.reference`) elsewhere; ``OOMBConfig.attention_backend`` or the environment variable
``OOMB_ATTENTION_BACKEND`` (``auto`` | ``torch`` | ``triton``) forces one.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Literal

import torch

from lightning_oomb.engine import reference
from lightning_oomb.engine.errors import OOMBConfigError
from lightning_oomb.engine.kv_pool import KVPool, PagedKV, PoolShape, resolve_grad_dtype

BACKENDS = ("auto", "torch", "triton")


@dataclass
class PoolLayout:
    """Everything the pool needs for a step except the K/V dtype, which the first written chunk decides."""

    num_layers: int
    batch: int
    seq_len: int
    kv_heads: int
    head_dim: int
    page_size: int
    kv_grad_dtype: str

    def shape(self, kv_dtype: torch.dtype) -> PoolShape:
        return PoolShape(
            self.num_layers,
            self.batch,
            self.seq_len,
            self.kv_heads,
            self.head_dim,
            self.page_size,
            kv_dtype,
            resolve_grad_dtype(self.kv_grad_dtype, kv_dtype),
        )


@dataclass
class ChunkContext:
    """Travels with one model call (an extra keyword of the call): where the chunk sits and where K/V go."""

    pool: KVPool
    layout: PoolLayout
    start: int
    sweep: Literal["forward", "backward", "eval"]
    backend: Literal["torch", "triton"]


def resolve_backend(name: str, device: torch.device) -> Literal["torch", "triton"]:
    """``auto`` -> Triton on CUDA, the torch reference elsewhere; ``OOMB_ATTENTION_BACKEND`` overrides ``auto``."""
    if name == "auto":
        name = os.environ.get("OOMB_ATTENTION_BACKEND", "auto")
    if name not in BACKENDS:
        raise OOMBConfigError(
            f"attention backend {name!r} is unknown — choose one of {BACKENDS} "
            "(OOMBConfig.attention_backend or OOMB_ATTENTION_BACKEND)."
        )
    if name == "auto":
        return "triton" if device.type == "cuda" else "torch"
    return name


def _forward(backend: str, q, kv: PagedKV, q_start: int, scale: float, window):
    if backend == "triton":
        from csrc_triton import paged_attention as kernels

        return kernels.paged_attention_forward(q, kv.k, kv.v, kv.page_table, q_start, scale, window)
    return reference.paged_attention_forward(q, kv, q_start, scale, window)


def _backward(backend: str, q, out, lse, dout, kv: PagedKV, q_start: int, scale: float, window):
    if backend == "triton":
        from csrc_triton import paged_attention as kernels

        return kernels.paged_attention_backward(
            q, out, lse, dout, kv.k, kv.v, kv.dk, kv.dv, kv.page_table, q_start, scale, window
        )
    return reference.paged_attention_backward(q, out, lse, dout, kv, q_start, scale, window)


class PagedAttention(torch.autograd.Function):
    """Thin Function around the kernels: saves ``q, out, lse``; no math of its own."""

    @staticmethod
    def forward(ctx, q, k, v, chunk: ChunkContext, layer: int, scale: float, window: int | None):
        pool = chunk.pool
        if chunk.sweep != "backward":  # the backward sweep recomputes identical K/V: never rewrite pages
            shape = chunk.layout.shape(k.dtype)
            if pool.shape != shape:
                pool.reserve(shape, k.device)
            pool.write(layer, chunk.start, k, v)
        kv = pool.view(layer, chunk.start + q.shape[2])
        with torch.autocast(q.device.type, enabled=False):
            out, lse = _forward(chunk.backend, q, kv, chunk.start, scale, window)
        ctx.save_for_backward(q, out, lse)
        ctx.args = (chunk, layer, scale, window, k.dtype)
        return out

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, dout):
        q, out, lse = ctx.saved_tensors
        chunk, layer, scale, window, kv_dtype = ctx.args
        kv = chunk.pool.view(layer, chunk.start + q.shape[2], grads=True)  # the kernel adds into kv.dk, kv.dv
        with torch.autocast(q.device.type, enabled=False):
            dq = _backward(chunk.backend, q, out, lse, dout.contiguous(), kv, chunk.start, scale, window)
        dk, dv = chunk.pool.read_grad(layer, chunk.start, q.shape[2])
        return dq, dk.to(kv_dtype), dv.to(kv_dtype), None, None, None, None


def paged_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    chunk: ChunkContext,
    layer: int,
    scale: float,
    window: int | None = None,
) -> torch.Tensor:
    """Attention of a chunk's ``q [B, Hq, Lq, D]`` over its layer's pages plus its own ``k, v``; ``[B, Hq, Lq, D]``."""
    return PagedAttention.apply(q, k, v, chunk, layer, scale, window)
