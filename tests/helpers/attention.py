"""The textbook attention oracle and paged layouts of token tensors (shared by the attention tests and the kernel
benchmark)."""

from __future__ import annotations

import math

import torch

from lightning_oomb.engine.pages import PagedKV, gather_tokens, write_tokens

BACKENDS = ("torch", "triton")


def dense_attention(
    q,
    k,
    v,
    q_start: int,
    scale: float,
    window: int | None = None,
    with_lse: bool = False,
    softcap=None,
    sinks=None,
    doc_start=None,
):
    """Attention of ``q [B, Hq, Lq, D]`` over keys ``[0, q_start + Lq)`` (``k, v [B, Hkv, N, D]``), lower-right
    causal, GQA by repetition, materialised scores, in the inputs' dtype (autograd works through it): scores
    ``q . k * scale``, soft-capped ``c * tanh(. / c)`` with ``softcap``, and with ``sinks [Hq]`` one extra logit per
    head in each row's softmax (attending to nothing), as Hugging Face's eager GPT-OSS attention; with
    ``doc_start [B, Lq]`` a query sees only keys at or after its document's start; with ``with_lse`` also the
    log-sum-exp of each row's scores (sink included)."""
    lq = q.shape[2]
    k = k.repeat_interleave(q.shape[1] // k.shape[1], 1)
    v = v.repeat_interleave(q.shape[1] // v.shape[1], 1)
    s = q @ k.transpose(-1, -2) * scale
    if softcap is not None:
        s = torch.tanh(s / softcap) * softcap
    qpos = torch.arange(q_start, q_start + lq, device=q.device)[:, None]
    kpos = torch.arange(k.shape[2], device=q.device)[None]
    mask = kpos <= qpos
    if window is not None:
        mask &= kpos > qpos - window
    if doc_start is not None:
        mask = (mask & (kpos >= doc_start[:, :, None].to(kpos.device)))[:, None]
    s = s.masked_fill(~mask, -math.inf)
    if sinks is not None:
        s = torch.cat([s, sinks.to(s.dtype).view(1, -1, 1, 1).expand(*s.shape[:-1], 1)], -1)
    p = torch.softmax(s, -1)
    out = (p[..., :-1] if sinks is not None else p) @ v
    return (out, torch.logsumexp(s, -1)) if with_lse else out


def to_pages(tokens: torch.Tensor, table: torch.Tensor, page: int, slots: int | None = None) -> torch.Tensor:
    """Tokens ``[B, H, N, D]`` written into an arena ``[slots, H, P, D]`` at the slots of ``table [B, pages]``
    (other slots: uninitialised memory; the last page's tail: zeros)."""
    b, h, _, d = tokens.shape
    arena = torch.empty(slots or int(table.max()) + 1, h, page, d, dtype=tokens.dtype, device=tokens.device)
    write_tokens(arena, table, tokens)
    return arena


def from_pages(arena: torch.Tensor, table: torch.Tensor, num_tokens: int) -> torch.Tensor:
    """Inverse of :func:`to_pages`: the first ``num_tokens`` tokens ``[B, H, N, D]`` of ``table``'s pages."""
    return gather_tokens(arena, table)[:, :, :num_tokens]


def shuffled_pages(k, v, page: int, gen: torch.Generator) -> tuple[PagedKV, list[torch.Tensor]]:
    """Token tensors ``[B, Hkv, N, D]`` in shuffled pages of arenas with stale (non-zero) slack slots, and random
    gradient pages; returns the paged view and a copy of the gradient pages before any add."""
    b, h, n, d = k.shape
    pages = math.ceil(n / page)
    table = torch.randperm(b * pages + 3, generator=gen)[: b * pages].view(b, pages).int()
    arenas = []
    for x in (k, v):
        arena = torch.randn(b * pages + 3, h, page, d, dtype=x.dtype, generator=gen)
        write_tokens(arena, table, x)
        arenas.append(arena)
    grads = [torch.randn_like(a) for a in arenas]
    return PagedKV(arenas[0], arenas[1], grads[0].clone(), grads[1].clone(), table), grads
