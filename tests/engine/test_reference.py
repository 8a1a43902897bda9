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


GARBAGE = 2**31 - 1  # an out-of-range slot: indexing an arena with it raises


def split_keys(num_keys: int, page: int, gen: torch.Generator, pieces: int | None) -> list[tuple[int, int]]:
    """``[0, num_keys)`` cut at random page boundaries into ``pieces`` ranges (every page its own for None),
    returned in a shuffled order."""
    bounds = torch.arange(page, num_keys, page)
    if pieces is not None:
        bounds = bounds[torch.randperm(len(bounds), generator=gen)[: pieces - 1]].sort().values
    edges = [0, *bounds.tolist(), num_keys]
    ranges = list(zip(edges[:-1], edges[1:]))
    return [ranges[i] for i in torch.randperm(len(ranges), generator=gen)]


def range_pages(kv: PagedKV, key_range: tuple[int, int]) -> slice:
    return slice(key_range[0] // kv.page_size, math.ceil(key_range[1] / kv.page_size))


def range_view(kv: PagedKV, key_range: tuple[int, int]) -> PagedKV:
    """``kv`` with garbage in every page-table entry outside ``key_range``'s pages: they must never be read."""
    table = torch.full_like(kv.page_table, GARBAGE)
    table[:, range_pages(kv, key_range)] = kv.page_table[:, range_pages(kv, key_range)]
    return PagedKV(kv.k, kv.v, kv.dk, kv.dv, table)


def sees(q_start: int, lq: int, key_range: tuple[int, int], window: int | None) -> torch.Tensor:
    """Bool [Lq]: which query rows see at least one key of ``key_range``."""
    qpos = torch.arange(q_start, q_start + lq)
    first = key_range[0] if window is None else torch.clamp(qpos - window + 1, min=key_range[0])
    return torch.as_tensor(first <= torch.clamp(qpos, max=key_range[1] - 1))


RANGE_CASES = {  # (b, hq, hkv, lq, q_start, page, window); q_start > 0 and ragged Lq throughout
    "gqa3": (2, 6, 2, 11, 21, 4, None),
    "gqa3-window": (2, 6, 2, 11, 21, 4, 9),  # keys [0, 12) are in no query's window
    "gqa4-window-1": (2, 4, 1, 7, 30, 8, 1),
}


@pytest.mark.parametrize("pieces", [None, 2, 3])
@pytest.mark.parametrize("case", RANGE_CASES.values(), ids=RANGE_CASES.keys())
def test_key_ranges_fold_to_one_shot(case, pieces):
    """Forward over shuffled key ranges folded into one state, backward per range with the final out/lse, a
    shared delta and one dQ accumulator: both equal the one-shot call; pages outside a range stay untouched."""
    b, hq, hkv, lq, q_start, page, window = case
    gen = torch.Generator().manual_seed(lq + q_start + (pieces or 0))
    d, dt, scale = 8, torch.float64, 8**-0.5
    n = q_start + lq
    q = torch.randn(b, hq, lq, d, dtype=dt, generator=gen)
    dout = torch.randn(b, hq, lq, d, dtype=dt, generator=gen)
    kv, _ = paged(*(torch.randn(b, hkv, n, d, dtype=dt, generator=gen) for _ in "kv"), page, gen)
    out, lse = reference.paged_attention_forward(q, kv, q_start, scale, window)
    want = PagedKV(kv.k, kv.v, kv.dk.clone(), kv.dv.clone(), kv.page_table)
    want_dq = reference.paged_attention_backward(q, out, lse, dout, want, q_start, scale, window)

    ranges = split_keys(n, page, gen, pieces)
    state = reference.init_state(q)
    delta = reference.attention_delta(out, dout)
    dq = torch.zeros_like(q)
    for key_range in ranges:
        before = [x.clone() for x in state]
        assert reference.paged_attention_forward(q, range_view(kv, key_range), q_start, scale, window,
                                                 key_range=key_range, state=state) is None  # fmt: skip
        blind = ~sees(q_start, lq, key_range, window)
        for x, y in zip(state, before):
            assert torch.equal(x[:, :, blind], y[:, :, blind])  # a row that sees no key keeps its state

        dk, dv = kv.dk.clone(), kv.dv.clone()
        got = reference.paged_attention_backward(q, out, lse, dout, range_view(kv, key_range), q_start, scale,
                                                 window, key_range=key_range, delta=delta, dq=dq)  # fmt: skip
        assert got is dq
        outside = torch.ones(kv.dk.shape[0], dtype=torch.bool)
        outside[kv.page_table[:, range_pages(kv, key_range)].flatten().long()] = False
        assert torch.equal(kv.dk[outside], dk[outside]) and torch.equal(kv.dv[outside], dv[outside])
    if pieces is None:  # the garbage is live: reading it fails
        with pytest.raises(IndexError):
            reference.paged_attention_forward(q, range_view(kv, ranges[0]), q_start, scale, window)
    if pieces is None and window is not None:
        assert any(not sees(q_start, lq, r, window).any() for r in ranges)  # a range no query can see
    if pieces is None:
        assert any(0 < sees(q_start, lq, r, window).sum() < lq for r in ranges)  # one only some rows see

    got_out, got_lse = reference.finish_state(state, q.dtype)
    torch.testing.assert_close(got_out, out, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(got_lse, lse, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(dq, want_dq, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(kv.dk, want.dk, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(kv.dv, want.dv, rtol=1e-12, atol=1e-12)


def test_rejects_bad_key_ranges_and_buffers():
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(1, 2, 5, 8, dtype=torch.float64, generator=gen)
    kv, _ = paged(*(torch.randn(1, 1, 13, 8, dtype=torch.float64, generator=gen) for _ in "kv"), 4, gen)
    for bad in [(2, 8), (4, 10), (0, 14), (8, 8), (-4, 4)]:  # lo unaligned, hi unaligned, past the end, empty
        with pytest.raises(ValueError, match="key_range"):
            reference.paged_attention_forward(q, kv, 8, 1.0, key_range=bad)
    reference.paged_attention_forward(q, kv, 8, 1.0, key_range=(8, 13))  # hi may be the chunk's end
    with pytest.raises(ValueError, match="state acc"):
        reference.paged_attention_forward(q, kv, 8, 1.0, state=reference.init_state(q.float()))
    out, lse = reference.paged_attention_forward(q, kv, 8, 1.0)
    with pytest.raises(ValueError, match="dq must be"):
        reference.paged_attention_backward(q, out, lse, out, kv, 8, 1.0, dq=torch.zeros_like(q).mT)
