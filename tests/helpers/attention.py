"""The textbook attention oracle and paged layouts of token tensors (shared by the attention tests and the kernel
benchmark)."""

from __future__ import annotations

import math

import torch

from lightning_oomb.engine.pages import PagedKV, gather_tokens, write_tokens

BACKENDS = ("torch", "cpu", "triton")


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
    mask=None,
):
    """Attention of ``q [B, Hq, Lq, D]`` over keys ``[0, q_start + Lq)`` (``k, v [B, Hkv, N, D]``), lower-right
    causal, GQA by repetition, materialised scores, in the inputs' dtype (autograd works through it): scores
    ``q . k * scale``, soft-capped ``c * tanh(. / c)`` with ``softcap``, and with ``sinks [Hq]`` one extra logit per
    head in each row's softmax (attending to nothing), as Hugging Face's eager GPT-OSS attention; with
    ``doc_start [B, Lq]`` a query sees only keys at or after its document's start; ``mask`` (bool ``[B, Lq, N]``,
    e.g. :func:`selection_mask`) narrows what each query sees; with ``with_lse`` also the log-sum-exp of each row's
    scores (sink included)."""
    lq = q.shape[2]
    k = k.repeat_interleave(q.shape[1] // k.shape[1], 1)
    v = v.repeat_interleave(q.shape[1] // v.shape[1], 1)
    s = q @ k.transpose(-1, -2) * scale
    if softcap is not None:
        s = torch.tanh(s / softcap) * softcap
    qpos = torch.arange(q_start, q_start + lq, device=q.device)[:, None]
    kpos = torch.arange(k.shape[2], device=q.device)[None]
    visible = kpos <= qpos
    if window is not None:
        visible &= kpos > qpos - window
    if doc_start is not None:
        visible = (visible & (kpos >= doc_start[:, :, None].to(kpos.device)))[:, None]
    if mask is not None:
        visible = visible & mask[:, None].to(kpos.device)
    s = s.masked_fill(~visible, -math.inf)
    if sinks is not None:
        s = torch.cat([s, sinks.to(s.dtype).view(1, -1, 1, 1).expand(*s.shape[:-1], 1)], -1)
    p = torch.softmax(s, -1)
    out = (p[..., :-1] if sinks is not None else p) @ v
    return (out, torch.logsumexp(s, -1)) if with_lse else out


def selection_mask(
    page_select: torch.Tensor, q_start: int, lq: int, num_keys: int, page: int
) -> torch.Tensor:
    """Bool ``[B, Lq, num_keys]``: the keys a page selection (``page_select [B, R, K]``, the kernels' contract) lets
    each query see — keys before ``q_start`` on its block's listed pages, every key from ``q_start`` on — written
    from the contract's words, one query block at a time."""
    b = page_select.shape[0]
    mask = torch.zeros(b, lq, num_keys, dtype=torch.bool)
    mask[:, :, q_start:] = True
    for row in range(b):
        for block, pages in enumerate(page_select[row].tolist()):
            for p in pages:
                if p >= 0:
                    mask[row, block * page : (block + 1) * page, p * page : (p + 1) * page] = True
    return mask


def random_selection(
    batch: int, lq: int, q_start: int, page: int, budget: int, gen: torch.Generator
) -> torch.Tensor:
    """A random valid ``page_select [B, ceil(Lq / page), budget]``: per query block up to ``budget`` distinct pages
    before ``q_start``, ascending, ``-1``-padded (some blocks select nothing)."""
    blocks, past = math.ceil(lq / page), q_start // page
    out = torch.full((batch, blocks, budget), -1, dtype=torch.int32)
    for row in range(batch):
        for block in range(blocks):
            count = int(torch.randint(0, min(budget, past) + 1, (1,), generator=gen))
            chosen = torch.randperm(past, generator=gen)[:count].sort().values
            out[row, block, :count] = chosen.int()
    return out


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
