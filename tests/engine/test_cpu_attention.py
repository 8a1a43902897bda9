"""The fused CPU attention backend against the plain reference (its oracle) on fresh random inputs, and its dispatch:
which calls take the fused kernels, which fall back, and which backend ``auto`` picks."""

from __future__ import annotations

import pytest
import torch

from lightning_oomb.engine import OOMBConfigError, cpu_attention, reference
from lightning_oomb.engine.attention import resolve_backend
from lightning_oomb.engine.lse import attention_delta, finish_state, init_state
from tests.helpers.attention import shuffled_pages

# (batch, query heads, KV heads, Lq, q_start, page, head dim): GQA, ragged Lq, offsets on and off page boundaries
SHAPES = {
    "first-chunk": (1, 4, 2, 29, 0, 8, 8),
    "gqa4-deep": (2, 8, 2, 37, 48, 16, 16),
    "mha-one-token": (1, 2, 2, 1, 40, 16, 8),
    "unaligned-start": (2, 3, 1, 21, 13, 8, 8),
}
TOL = {torch.float64: 1e-12, torch.float32: 2e-5}


def inputs(shape, dtype, seed=0):
    b, hq, hkv, lq, q_start, page, d = shape
    gen = torch.Generator().manual_seed(seed)
    n = q_start + lq
    k, v = (torch.randn(b, hkv, n, d, generator=gen).to(dtype) for _ in "kv")
    kv, _ = shuffled_pages(k, v, page, gen)
    q = torch.randn(b, lq, hq, d, generator=gen).to(dtype).transpose(1, 2)  # HF's transposed view
    dout = torch.randn(b, hq, lq, d, generator=gen).to(dtype)
    return q, dout, kv, q_start


def close(got, want, tol, what):
    err = ((got.double() - want.double()).abs().max() / want.double().abs().max()).item()
    assert err <= tol, f"{what}: relative error {err:.1e}"


def both_backward(q, out, lse, dout, kv, q_start, scale, window=None, **kw):
    """dq and the dK/dV added by each backend, from the same gradient pages."""
    results = []
    for ops in (cpu_attention, reference):
        dk, dv = kv.dk.clone(), kv.dv.clone()
        dq = ops.paged_attention_backward(q, out, lse, dout, kv.k, kv.v, dk, dv, kv.page_table, q_start, scale,
                                          window, **kw)  # fmt: skip
        results.append((dq, dk - kv.dk, dv - kv.dv))
    return results


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("shape", SHAPES.values(), ids=SHAPES.keys())
def test_one_call_matches_the_reference(shape, dtype):
    q, dout, kv, q_start = inputs(shape, dtype)
    scale, window = q.shape[-1] ** -0.5, q_start + q.shape[2]  # a window no key falls out of: fused too
    assert cpu_attention.fast_path(q, None, None)
    out, lse = cpu_attention.paged_attention_forward(q, kv.k, kv.v, kv.page_table, q_start, scale, window)
    want_out, want_lse = reference.paged_attention_forward(
        q, kv.k, kv.v, kv.page_table, q_start, scale, window
    )
    assert out.dtype == q.dtype and lse.dtype == want_lse.dtype and lse.shape == want_lse.shape
    close(out, want_out, TOL[dtype], "out")
    close(lse, want_lse, TOL[dtype], "lse")
    got, want = both_backward(q, want_out, want_lse, dout, kv, q_start, scale, window)
    for name, x, y in zip(("dq", "dk", "dv"), got, want):
        close(x, y, TOL[dtype], name)


@pytest.mark.parametrize("past_block", [16384, 16])  # 16: the keys before q_start in several calls
@pytest.mark.parametrize("shape", ["gqa4-deep", "unaligned-start"])
def test_key_ranges_state_and_accumulators_match_the_reference(monkeypatch, shape, past_block):
    """Calls over page-aligned key ranges, folded into one state and one dQ accumulator, with a given delta."""
    monkeypatch.setattr(cpu_attention, "PAST_BLOCK", past_block)
    q, dout, kv, q_start = inputs(SHAPES[shape], torch.float64, seed=1)
    page, n = kv.k.shape[2], q_start + q.shape[2]
    edges = [0, *range(page, n, 2 * page), n]
    ranges = list(zip(edges[:-1], edges[1:]))[::-1]
    scale = 0.3
    states = init_state(q), init_state(q)
    for key_range in ranges:
        for ops, state in zip((cpu_attention, reference), states):
            ops.paged_attention_forward(q, kv.k, kv.v, kv.page_table, q_start, scale, key_range=key_range,
                                        state=state)  # fmt: skip
    (out, lse), (want_out, want_lse) = (finish_state(s, q.dtype) for s in states)
    close(out, want_out, 1e-12, "out")
    close(lse, want_lse, 1e-12, "lse")
    delta = attention_delta(want_out, dout)
    dqs = torch.zeros(q.shape, dtype=q.dtype), torch.zeros(q.shape, dtype=q.dtype)
    grads = [[kv.dk.clone(), kv.dv.clone()] for _ in "ab"]
    for key_range in ranges:
        for ops, dq, (dk, dv) in zip((cpu_attention, reference), dqs, grads):
            placeholder = torch.full_like(want_out, float("nan"))  # a given delta: out is not read
            ops.paged_attention_backward(q, placeholder, want_lse, dout, kv.k, kv.v, dk, dv, kv.page_table,
                                         q_start, scale, key_range=key_range, delta=delta, dq=dq)  # fmt: skip
    close(dqs[0], dqs[1], 1e-12, "dq")
    for name, got, want, before in zip(("dk", "dv"), *grads, (kv.dk, kv.dv)):
        close(got - before, want - before, 1e-12, name)


def random_selection(q, q_start, page, width, seed):
    """Each query block's pages before ``q_start``: up to ``width`` distinct ones, ascending, ``-1``-padded (some
    blocks none)."""
    gen = torch.Generator().manual_seed(seed)
    b, blocks, past = q.shape[0], -(-q.shape[2] // page), q_start // page
    select = torch.full((b, blocks, width), -1, dtype=torch.int32)
    for row in range(b):
        for block in range(blocks):
            count = int(torch.randint(0, min(width, past) + 1, (1,), generator=gen))
            select[row, block, :count] = torch.randperm(past, generator=gen)[:count].sort().values
    return select


def matches_the_reference(q, dout, kv, q_start, tol, **terms):
    """One call over every key, then calls over page-aligned key ranges folded into one state and one dQ
    accumulator with a given delta: the same results from both backends."""
    page, n, scale = kv.k.shape[2], q_start + q.shape[2], 0.3
    assert cpu_attention.fast_path(q, None, None)
    out, lse = cpu_attention.paged_attention_forward(q, kv.k, kv.v, kv.page_table, q_start, scale, **terms)
    want_out, want_lse = reference.paged_attention_forward(
        q, kv.k, kv.v, kv.page_table, q_start, scale, **terms
    )
    close(out, want_out, tol, "out")
    close(lse, want_lse, tol, "lse")
    got, want = both_backward(q, want_out, want_lse, dout, kv, q_start, scale, **terms)
    for name, x, y in zip(("dq", "dk", "dv"), got, want):
        close(x, y, tol, name)
    edges = [0, *range(page, n, 2 * page), n]
    ranges = list(zip(edges[:-1], edges[1:]))[::-1]
    states = init_state(q), init_state(q)
    for key_range in ranges:
        for ops, state in zip((cpu_attention, reference), states):
            ops.paged_attention_forward(q, kv.k, kv.v, kv.page_table, q_start, scale, key_range=key_range,
                                        state=state, **terms)  # fmt: skip
    (out, _), (want_out, _) = (finish_state(s, q.dtype) for s in states)
    close(out, want_out, tol, "out (key ranges)")
    delta = attention_delta(want_out, dout)
    dqs = torch.zeros(q.shape, dtype=q.dtype), torch.zeros(q.shape, dtype=q.dtype)
    grads = [[kv.dk.clone(), kv.dv.clone()] for _ in "ab"]
    for key_range in ranges:
        for ops, dq, (dk, dv) in zip((cpu_attention, reference), dqs, grads):
            ops.paged_attention_backward(q, want_out, want_lse, dout, kv.k, kv.v, dk, dv, kv.page_table, q_start,
                                         scale, key_range=key_range, delta=delta, dq=dq, **terms)  # fmt: skip
    close(dqs[0], dqs[1], tol, "dq (key ranges)")
    for name, got, want, before in zip(("dk", "dv"), *grads, (kv.dk, kv.dv)):
        close(got - before, want - before, tol, f"{name} (key ranges)")


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("shape", ["gqa4-deep", "unaligned-start"])
def test_page_selections_match_the_reference(shape, dtype):
    """Sparse calls: each query block's selected pages, then the chunk's own keys."""
    b, hq, hkv, lq, q_start, page, d = SHAPES[shape]
    q_start = q_start // page * page + 3 * page  # (a selection needs q_start on a page boundary)
    q, dout, kv, q_start = inputs((b, hq, hkv, lq, q_start, page, d), dtype, seed=2)
    matches_the_reference(
        q, dout, kv, q_start, TOL[dtype], page_select=random_selection(q, q_start, page, 3, 3)
    )


def document_starts(q, q_start, seed):
    """Each query's document start: documents that start before the chunk, at its first row, inside it, one of
    a single token; different per batch row."""
    gen = torch.Generator().manual_seed(seed)
    b, lq = q.shape[0], q.shape[2]
    rows = []
    for _ in range(b):
        cuts = torch.randperm(lq - 1, generator=gen)[: max(1, lq // 6)] + 1
        starts = torch.tensor(sorted({0, *cuts.tolist(), lq - 1}))  # (the last row: a document of one token)
        first = int(torch.randint(0, q_start + 1, (1,), generator=gen))  # the chunk's first document's start
        at = starts[torch.searchsorted(starts, torch.arange(lq), right=True) - 1]
        rows.append(torch.where(at == 0, first, q_start + at))
    return torch.stack(rows)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("shape", ["gqa4-deep", "unaligned-start", "first-chunk"])
def test_documents_match_the_reference(shape, dtype):
    """Packed rows: each batch row's documents, one starting before the chunk."""
    q, dout, kv, q_start = inputs(SHAPES[shape], dtype, seed=6)
    matches_the_reference(q, dout, kv, q_start, TOL[dtype], doc_start=document_starts(q, q_start, seed=7))


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize(
    ("shape", "window"),
    [("gqa4-deep", 2), ("gqa4-deep", 10), ("gqa4-deep", 16), ("gqa4-deep", 40), ("unaligned-start", 3),
     ("first-chunk", 7)],
)  # fmt: skip
def test_sliding_windows_match_the_reference(shape, window, dtype):
    """A window shorter than the keys: rows in blocks of at most the window, each block's lower edge, the keys all
    its rows see, its own keys."""
    q, dout, kv, q_start = inputs(SHAPES[shape], dtype, seed=8)
    matches_the_reference(q, dout, kv, q_start, TOL[dtype], window=window)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize(
    ("shape", "window"), [("gqa4-deep", 3), ("gqa4-deep", 16), ("unaligned-start", 5), ("first-chunk", 4)]
)
def test_windows_inside_documents_match_the_reference(shape, window, dtype):
    """Packed rows with a sliding window (a packed Mistral): each document's rows in blocks of at most the window,
    no key before the document's start."""
    q, dout, kv, q_start = inputs(SHAPES[shape], dtype, seed=9)
    docs = document_starts(q, q_start, seed=10)
    matches_the_reference(q, dout, kv, q_start, TOL[dtype], window=window, doc_start=docs)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize(
    ("shape", "terms"),
    [("gqa4-deep", dict(window=20)), ("gqa4-deep", dict(window=40)), ("gqa4-deep", dict(documents=True)),
     ("gqa4-deep", dict(window=24, documents=True)), ("unaligned-start", dict(window=9)),
     ("unaligned-start", dict(window=12, documents=True))],
)  # fmt: skip
def test_page_selections_with_windows_or_documents_match_the_reference(shape, terms, dtype):
    """Sparse calls with a window or documents: each query block's selected pages masked to what its rows see (the
    rows that see none of them left out), then the chunk's own keys as without a selection."""
    b, hq, hkv, lq, q_start, page, d = SHAPES[shape]
    q_start = q_start // page * page + 3 * page
    q, dout, kv, q_start = inputs((b, hq, hkv, lq, q_start, page, d), dtype, seed=11)
    extra = {"window": terms["window"]} if "window" in terms else {}
    if terms.get("documents"):
        extra["doc_start"] = document_starts(q, q_start, seed=12)
    select = random_selection(q, q_start, page, 4, seed=13)
    matches_the_reference(q, dout, kv, q_start, TOL[dtype], page_select=select, **extra)


def test_bf16_inputs_compute_in_float32():
    q, dout, kv, q_start = inputs(SHAPES["gqa4-deep"], torch.bfloat16)
    out, lse = cpu_attention.paged_attention_forward(q, kv.k, kv.v, kv.page_table, q_start, 0.25)
    want_out, want_lse = reference.paged_attention_forward(q, kv.k, kv.v, kv.page_table, q_start, 0.25)
    assert out.dtype == torch.bfloat16 and lse.dtype == torch.float32
    close(out, want_out, 1e-2, "out")
    close(lse, want_lse, 1e-5, "lse")


TERMS = {
    "softcap": dict(softcap=5.0),
    "softcap, a window, documents and a page selection": dict(softcap=5.0, doc_start=True, page_select=True),
    "tile counter": dict(visits=True),
}


@pytest.mark.parametrize("term", TERMS.values(), ids=TERMS.keys())
def test_other_calls_fall_back_to_the_reference(monkeypatch, term):
    """A call with a term the fused kernels do not take is the reference's call, with every argument."""
    q, dout, kv, q_start = inputs(SHAPES["gqa4-deep"], torch.float64)
    b, lq = q.shape[0], q.shape[2]
    kw = dict(term)
    if "doc_start" in kw:
        kw["doc_start"] = torch.full((b, lq), 5)
    if "page_select" in kw:
        kw["page_select"] = random_selection(q, q_start, kv.k.shape[2], 2, seed=5)
    if "visits" in kw:
        kw["visits"] = torch.zeros(1, dtype=torch.int32)
    window = 10 if "doc_start" in kw else None  # every other term too
    assert not cpu_attention.fast_path(q, kw.get("softcap"), kw.get("visits"))
    calls = []
    for name in ("paged_attention_forward", "paged_attention_backward"):
        original = getattr(reference, name)
        monkeypatch.setattr(reference, name, lambda *a, _f=original, **k: calls.append(k) or _f(*a, **k))
    out, lse = cpu_attention.paged_attention_forward(q, kv.k, kv.v, kv.page_table, q_start, 0.3, window, **kw)
    cpu_attention.paged_attention_backward(q, out, lse, dout, kv.k, kv.v, kv.dk, kv.dv, kv.page_table, q_start,
                                           0.3, window, **kw)  # fmt: skip
    assert len(calls) == 2 and all(all(c[k] is v for k, v in kw.items()) for c in calls)


def test_fused_calls_never_reach_the_reference(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("the reference ran")

    monkeypatch.setattr(reference, "paged_attention_forward", refuse)
    monkeypatch.setattr(reference, "paged_attention_backward", refuse)
    q, dout, kv, q_start = inputs(SHAPES["gqa4-deep"], torch.float32)
    select = random_selection(q, q_start, kv.k.shape[2], 2, seed=4)  # (q_start: a page boundary)
    docs = document_starts(q, q_start, seed=4)
    for window, terms in ((None, {}), (None, dict(page_select=select)),
                          (10, dict(doc_start=docs, page_select=select))):  # fmt: skip
        out, lse = cpu_attention.paged_attention_forward(q, kv.k, kv.v, kv.page_table, q_start, 0.3, window,
                                                         **terms)  # fmt: skip
        cpu_attention.paged_attention_backward(q, out, lse, dout, kv.k, kv.v, kv.dk, kv.dv, kv.page_table,
                                               q_start, 0.3, window, **terms)  # fmt: skip


def test_backend_selection(monkeypatch):
    monkeypatch.delenv("OOMB_ATTENTION_BACKEND", raising=False)
    cpu, cuda, mps = (torch.device(t) for t in ("cpu", "cuda", "mps"))
    assert [resolve_backend("auto", d) for d in (cpu, cuda, mps)] == ["cpu", "triton", "torch"]
    assert resolve_backend("torch", cpu) == "torch"  # the plain reference, forced
    with pytest.raises(OOMBConfigError, match="attention_backend='cpu' cannot run on a cuda device.*'auto'"):
        resolve_backend("cpu", cuda)
    monkeypatch.setenv("OOMB_ATTENTION_BACKEND", "torch")
    assert resolve_backend("auto", cpu) == "torch"


def test_a_backend_forced_by_the_environment_is_named_in_its_refusal(monkeypatch):
    from lightning_oomb.engine.attention import resolve_backend

    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.setenv("OOMB_ATTENTION_BACKEND", "triton")
    with pytest.raises(
        OOMBConfigError, match="OOMB_ATTENTION_BACKEND='triton'.*unset OOMB_ATTENTION_BACKEND"
    ):
        resolve_backend("auto", torch.device("cpu"))
