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
    chunk_size: int = 0

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
            self.chunk_size,
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


def _kernels(backend: str):
    if backend == "triton":
        from csrc_triton import paged_attention as kernels

        return kernels
    return None


def _forward(backend: str, q, kv: PagedKV, q_start: int, scale: float, window, **block):
    kernels = _kernels(backend)
    if kernels is not None:
        return kernels.paged_attention_forward(q, kv.k, kv.v, kv.page_table, q_start, scale, window, **block)
    return reference.paged_attention_forward(q, kv, q_start, scale, window, **block)


def _backward(backend: str, q, out, lse, dout, kv: PagedKV, q_start: int, scale: float, window, **block):
    kernels = _kernels(backend)
    if kernels is not None:
        return kernels.paged_attention_backward(
            q, out, lse, dout, kv.k, kv.v, kv.dk, kv.dv, kv.page_table, q_start, scale, window, **block
        )
    return reference.paged_attention_backward(q, out, lse, dout, kv, q_start, scale, window, **block)


def _first_key(q_start: int, window: int | None) -> int:
    """The first key any query of a chunk starting at ``q_start`` sees."""
    return 0 if window is None else max(0, q_start - window + 1)


def _whole(kv: PagedKV, num_keys: int) -> bool:
    return kv.keys is None or kv.keys == (0, num_keys)


def attend(backend: str, q, parts, q_start: int, scale: float, window):
    """``(out, lse)`` of ``q`` over the key parts of :meth:`KVPool.parts`: one call for a part holding every key,
    else each part folded into one running softmax state (the log-sum-exp merge)."""
    num_keys, state = q_start + q.shape[2], None
    for kv in parts:
        if state is None and _whole(kv, num_keys):
            return _forward(backend, q, kv, q_start, scale, window)
        if state is None:
            state = reference.init_state(q)
        _forward(backend, q, kv, q_start, scale, window, key_range=kv.keys, state=state)
    return reference.finish_state(state, q.dtype)


def attend_backward(backend: str, q, out, lse, dout, parts, q_start: int, scale: float, window):
    """``dq``, adding dK/dV into every part's gradient pages; dQ is summed over the parts."""
    num_keys, dq, delta = q_start + q.shape[2], None, None
    for kv in parts:
        if dq is None and _whole(kv, num_keys):
            return _backward(backend, q, out, lse, dout, kv, q_start, scale, window)
        if dq is None:
            delta = reference.attention_delta(out, dout)
            dq = torch.zeros(q.shape, dtype=delta.dtype, device=q.device)
        _backward(
            backend, q, out, lse, dout, kv, q_start, scale, window, key_range=kv.keys, delta=delta, dq=dq
        )
    return dq.to(q.dtype)


class PagedAttention(torch.autograd.Function):
    """Thin Function around the kernels: saves ``q, out, lse`` (and the chunk's ``k, v`` for a host-tier layer,
    restaged on the device for the backward); no math of its own."""

    @staticmethod
    def forward(ctx, q, k, v, chunk: ChunkContext, layer: int, scale: float, window: int | None):
        pool = chunk.pool
        if chunk.sweep != "backward":  # the backward sweep's recompute writes nothing new
            shape = chunk.layout.shape(k.dtype)
            if pool.shape != shape:
                pool.reserve(shape, k.device)
        pool.write(layer, chunk.start, k, v)
        parts = pool.parts(layer, chunk.start + q.shape[2], first_key=_first_key(chunk.start, window))
        with torch.autocast(q.device.type, enabled=False):
            out, lse = attend(chunk.backend, q, parts, chunk.start, scale, window)
        ctx.save_for_backward(q, out, lse, *((k, v) if pool.streams(layer) else ()))
        ctx.args = (chunk, layer, scale, window, k.dtype)
        return out

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, dout):
        q, out, lse, *kv = ctx.saved_tensors
        chunk, layer, scale, window, kv_dtype = ctx.args
        pool = chunk.pool
        if kv:
            pool.write(layer, chunk.start, *kv)
        first_key = _first_key(chunk.start, window)
        # the kernels add into each part's dk, dv
        parts = pool.parts(layer, chunk.start + q.shape[2], True, first_key)
        with torch.autocast(q.device.type, enabled=False):
            dq = attend_backward(
                chunk.backend, q, out, lse, dout.contiguous(), parts, chunk.start, scale, window
            )
        dk, dv = pool.read_grad(layer, chunk.start, q.shape[2])
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
