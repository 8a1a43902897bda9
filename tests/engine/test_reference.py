"""The torch reference of the paged kernels against dense attention with autograd (float64)."""

from __future__ import annotations

import math

import pytest
import torch

from lightning_oomb.engine import reference
from lightning_oomb.engine.kv_pool import PagedKV


def dense_attention(q, k, v, q_start, scale, window):
    """Textbook attention over keys [0, q_start + Lq), lower-right causal, GQA by repetition."""
    b, hq, lq, d = q.shape
    k = k.repeat_interleave(hq // k.shape[1], 1)
    v = v.repeat_interleave(hq // v.shape[1], 1)
    s = q @ k.transpose(-1, -2) * scale
    qpos = torch.arange(q_start, q_start + lq)[:, None]
    kpos = torch.arange(k.shape[2])[None]
    mask = kpos <= qpos
    if window is not None:
        mask &= kpos > qpos - window
    return torch.softmax(s.masked_fill(~mask, -math.inf), -1) @ v


def paged(k, v, page, gen):
    """Scatter token tensors [B, Hkv, N, D] into shuffled pages of an arena with stale (non-zero) slack."""
    b, h, n, d = k.shape
    pages = math.ceil(n / page)
    slots = torch.randperm(b * pages + 3, generator=gen)[: b * pages].view(b, pages).int()
    arenas = []
    for x in (k, v):
        arena = torch.randn(b * pages + 3, h, page, d, dtype=x.dtype, generator=gen)
        padded = torch.nn.functional.pad(x, (0, 0, 0, pages * page - n))
        arena[slots.flatten().long()] = (
            padded.view(b, h, pages, page, d).transpose(1, 2).reshape(-1, h, page, d)
        )
        arenas.append(arena)
    grads = [torch.randn_like(a) for a in arenas]
    return PagedKV(arenas[0], arenas[1], grads[0].clone(), grads[1].clone(), slots), grads


@pytest.mark.parametrize(
    ("b", "hq", "hkv", "lq", "q_start", "page", "window"),
    [
        (1, 2, 2, 13, 0, 4, None),  # first chunk, ragged last page
        (2, 7, 1, 9, 24, 8, None),  # GQA 7, several chunks deep, ragged
        (1, 4, 2, 16, 48, 8, 10),  # sliding window shorter than the chunk
        (2, 4, 2, 5, 4096 - 5, 128, 3000),  # more than one key block
    ],
)
def test_reference_matches_dense(b, hq, hkv, lq, q_start, page, window):
    gen = torch.Generator().manual_seed(lq + q_start)
    d, dt = 8, torch.float64
    n = q_start + lq
    q = torch.randn(b, hq, lq, d, dtype=dt, generator=gen, requires_grad=True)
    k = torch.randn(b, hkv, n, d, dtype=dt, generator=gen, requires_grad=True)
    v = torch.randn(b, hkv, n, d, dtype=dt, generator=gen, requires_grad=True)
    dout = torch.randn(b, hq, lq, d, dtype=dt, generator=gen)
    scale = d**-0.5

    want = dense_attention(q, k, v, q_start, scale, window)
    want.backward(dout)
    kv, grads_before = paged(k.detach(), v.detach(), page, gen)

    out, lse = reference.paged_attention_forward(q.detach(), kv, q_start, scale, window)
    torch.testing.assert_close(out, want, rtol=1e-12, atol=1e-12)
    assert lse.shape == (b, hq, lq) and torch.isfinite(lse).all()

    dq = reference.paged_attention_backward(q.detach(), out, lse, dout, kv, q_start, scale, window)
    torch.testing.assert_close(dq, q.grad, rtol=1e-12, atol=1e-12)
    for arena, before, want_grad in ((kv.dk, grads_before[0], k.grad), (kv.dv, grads_before[1], v.grad)):
        added = (arena - before)[kv.page_table.flatten().long()]
        tokens = added.view(b, -1, *arena.shape[1:]).transpose(1, 2).reshape(b, hkv, -1, d)[:, :, :n]
        torch.testing.assert_close(tokens, want_grad, rtol=1e-12, atol=1e-12)
