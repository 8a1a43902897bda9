"""Key ranges, carried forward state and dQ accumulation, for both backends (Triton interpreted on CPU).

One attention call split into calls over shuffled page-aligned key ranges must combine to the one-shot result,
never read the page-table entries of other pages, and leave pages outside the range untouched; every step is
compared with the torch reference doing the same step, and the result with the one-shot call — with a page
selection (sparse attention) too. Triton's autotuning must restore every in-place argument between its runs.
"""

from __future__ import annotations

import math

import pytest
import torch
import triton

from csrc_triton import paged_attention as triton_kernels
from lightning_oomb.engine import reference
from lightning_oomb.engine.attention import kernels
from lightning_oomb.engine.lse import attention_delta, finish_state, init_state
from lightning_oomb.engine.pages import PagedKV
from tests.helpers.attention import BACKENDS, dense_attention, from_pages, selection_mask, shuffled_pages
from tests.kernels.test_paged_attention import (
    DEVICE,
    TOLERANCE,
    Case,
    assert_close,
    copy_grads,
    doc_starts,
    make_inputs,
    page_selection,
)

GARBAGE = 2**31 - 1  # far outside every arena: reading it faults (or, on the reference, raises)
CASES = {  # q_start > 0, Lq not a multiple of the page, GQA 2, batch 2
    "gqa2": Case(hq=4, hkv=2, q_start=40, lq=37),
    "gqa2-window": Case(hq=4, hkv=2, q_start=40, lq=37, window=20),  # keys [0, 21) are in no query's window
    "fp16-window": Case(b=1, hq=2, hkv=1, q_start=24, lq=21, window=12, dtype=torch.float16),
    # selections of up to 2 of the 4 past pages, some outside the window
    "sparse-window": Case(hq=4, hkv=2, q_start=64, lq=37, window=40, select=2),
    # pages at head dims narrower than the tiles: Phi-3's 96; latent pages' 576 with a selection
    "head-dim-96-window": Case(b=1, hq=2, hkv=1, d=96, q_start=40, lq=37, window=30),
    "sparse-head-dim-576-window": Case(hq=2, hkv=1, d=576, q_start=64, lq=37, window=40, select=2),
}


def split_keys(num_keys: int, page: int, seed: int) -> list[tuple[int, int]]:
    """``[0, num_keys)`` cut at random page boundaries (at least half of them), in a shuffled order."""
    gen = torch.Generator().manual_seed(seed)
    bounds = torch.arange(page, num_keys, page)
    bounds = bounds[torch.randperm(len(bounds), generator=gen)[: (len(bounds) + 1) // 2]].sort().values
    edges = [0, *bounds.tolist(), num_keys]
    ranges = list(zip(edges[:-1], edges[1:]))
    return [ranges[i] for i in torch.randperm(len(ranges), generator=gen)]


def range_pages(kv: PagedKV, key_range: tuple[int, int]) -> slice:
    return slice(key_range[0] // kv.page_size, math.ceil(key_range[1] / kv.page_size))


def with_garbage(kv: PagedKV, key_range: tuple[int, int], poison: int) -> PagedKV:
    """``kv`` whose page-table entries outside ``key_range``'s pages alternate between an out-of-range slot and
    ``poison`` (a spare slot of NaN keys/values): reading either shows."""
    table = torch.full_like(kv.page_table, GARBAGE)
    table[:, ::2] = poison
    table[:, range_pages(kv, key_range)] = kv.page_table[:, range_pages(kv, key_range)]
    return PagedKV(kv.k, kv.v, kv.dk, kv.dv, table)


def poisoned_inputs(case: Case):
    """``make_inputs`` plus a spare slot (one the table never names) whose K/V are NaN."""
    q, dout, kv = make_inputs(case)
    poison = next(s for s in range(kv.k.shape[0]) if not (kv.page_table == s).any())
    kv.k[poison] = kv.v[poison] = float("nan")
    return q, dout, kv, poison


def sees(case: Case, key_range: tuple[int, int]) -> torch.Tensor:
    """Bool [B, 1, Lq]: which query rows see at least one key of ``key_range`` (through the case's selection)."""
    qpos = torch.arange(case.q_start, case.q_start + case.lq)[:, None]
    kpos = torch.arange(key_range[1])[None]
    visible = (kpos >= key_range[0]) & (kpos <= qpos) & (kpos > qpos - (case.window or qpos.max() + 1))
    select = page_selection(case)
    if select is not None:
        visible = visible & selection_mask(select.cpu(), case.q_start, case.lq, key_range[1], case.page)
    return visible.expand(case.b, -1, -1).any(-1)[:, None].to(DEVICE)


def check_state(got, want, seen: torch.Tensor, tol: float):
    """A backend's state against the reference's: the same log-sum-exp ``m + log(l)`` and ``acc / l`` where a row has
    seen a key (``m`` is only a reference point: the fused CPU path folds whole parts at their log-sum-exp);
    elsewhere Triton may hold zero-weight junk under its finite masked max (ln-units -1e30 / log2 e) but nothing
    else."""
    (acc, m, l_sum), (want_acc, want_m, want_l) = got, want
    assert torch.equal(want_l > 0, seen)
    assert_close((m + l_sum.log())[seen], (want_m + want_l.log())[seen], 1e-5, "m + log(l)")
    assert_close(acc[seen] / l_sum[seen][:, None], want_acc[seen] / want_l[seen][:, None], tol, "acc / l")
    assert (m[~seen] < -1e29).all()


@pytest.mark.parametrize("case", CASES.values(), ids=CASES.keys())
@pytest.mark.parametrize("backend", BACKENDS)
def test_forward_key_ranges_fold_to_one_shot(backend: str, case: Case):
    ops, terms = kernels(backend), {"page_select": page_selection(case)}
    q, _, kv, poison = poisoned_inputs(case)
    scale, num_keys = case.d**-0.5, case.q_start + case.lq
    ranges = split_keys(num_keys, case.page, seed=case.lq)
    assert any(0 < sees(case, r).sum() < case.b * case.lq for r in ranges)  # a range only some rows see
    got, want = init_state(q), init_state(q)
    seen = torch.zeros(case.b, case.hq, case.lq, dtype=torch.bool, device=DEVICE)
    for key_range in ranges:
        view = with_garbage(kv, key_range, poison)
        before = [x.clone() for x in got]
        assert ops.paged_attention_forward(q, view.k, view.v, view.page_table, case.q_start, scale,
                                           case.window, key_range=key_range, state=got, **terms) is None  # fmt: skip
        reference.paged_attention_forward(q, kv.k, kv.v, kv.page_table, case.q_start, scale, case.window,
                                          key_range=key_range, state=want, **terms)  # fmt: skip
        seen |= sees(case, key_range)
        check_state(got, want, seen, TOLERANCE[case.dtype])
        blind = ~sees(case, key_range) & (before[1] > -1e29)  # blind rows with a real state
        for x, y in zip(got, before):
            assert torch.equal(x[blind], y[blind])

    out, lse = finish_state(got, q.dtype)
    want_out, want_lse = ops.paged_attention_forward(
        q, kv.k, kv.v, kv.page_table, case.q_start, scale, case.window, **terms
    )
    assert_close(out, want_out, TOLERANCE[case.dtype], "out")
    assert_close(lse, want_lse, 1e-5, "lse")


def close_or_zero(got: torch.Tensor, want: torch.Tensor, tol: float, what: str):
    """:func:`assert_close`, or both exactly zero (no row has seen a key yet: e.g. a first range no block selected)."""
    if want.any():
        assert_close(got, want, tol, what)
    else:
        assert not got.any(), what


@pytest.mark.parametrize("case", CASES.values(), ids=CASES.keys())
@pytest.mark.parametrize("backend", BACKENDS)
def test_backward_key_ranges_accumulate_to_one_shot(backend: str, case: Case):
    ops, terms = kernels(backend), {"page_select": page_selection(case)}
    q, dout, kv, poison = poisoned_inputs(case)
    scale, num_keys = case.d**-0.5, case.q_start + case.lq
    out, lse = reference.paged_attention_forward(
        q, kv.k, kv.v, kv.page_table, case.q_start, scale, case.window, **terms
    )
    delta = ops.attention_delta(out, dout)  # the Triton backend's pre-pass kernel
    got, want = copy_grads(kv), copy_grads(kv)
    dq, want_dq = (
        torch.zeros(q.shape, dtype=torch.float32, device=DEVICE),
        torch.zeros(q.shape, dtype=torch.float32, device=DEVICE),
    )
    tol = TOLERANCE[case.dtype]
    for key_range in split_keys(num_keys, case.page, seed=case.lq + 1):
        view = with_garbage(got, key_range, poison)
        dk, dv = got.dk.clone(), got.dv.clone()
        assert ops.paged_attention_backward(
            q, out, lse, dout, view.k, view.v, view.dk, view.dv, view.page_table, case.q_start, scale, case.window,
            key_range=key_range, delta=delta, dq=dq, **terms,
        ) is dq  # fmt: skip
        reference.paged_attention_backward(q, out, lse, dout, want.k, want.v, want.dk, want.dv, want.page_table,
                                           case.q_start, scale, case.window, key_range=key_range, delta=delta,
                                           dq=want_dq, **terms)  # fmt: skip
        close_or_zero(dq, want_dq, tol, f"dq after {key_range}")
        close_or_zero(got.dk - kv.dk, want.dk - kv.dk, tol, f"added dk after {key_range}")
        close_or_zero(got.dv - kv.dv, want.dv - kv.dv, tol, f"added dv after {key_range}")
        outside = torch.ones(kv.dk.shape[0], dtype=torch.bool, device=DEVICE)
        outside[kv.page_table[:, range_pages(kv, key_range)].flatten().long()] = False
        assert torch.equal(got.dk[outside], dk[outside]) and torch.equal(got.dv[outside], dv[outside])

    whole = copy_grads(kv)
    want_full = ops.paged_attention_backward(q, out, lse, dout, whole.k, whole.v, whole.dk, whole.dv,
                                             whole.page_table, case.q_start, scale, case.window, **terms)  # fmt: skip
    assert_close(dq.to(q.dtype), want_full, tol, "accumulated dq")
    assert_close(got.dk - kv.dk, whole.dk - kv.dk, tol, "dk over all ranges")
    assert_close(got.dv - kv.dv, whole.dv - kv.dv, tol, "dv over all ranges")


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_attention_delta_pre_pass(dtype):
    """The Triton backend's ``attention_delta`` (the pre-pass kernel) is the reference's ``rowsum(dO * O)`` in fp32,
    for mixed dtypes and an empty chunk too."""
    gen = torch.Generator().manual_seed(3)
    out, dout = (torch.randn(2, 3, 37, 16, generator=gen).to(dtype).to(DEVICE) for _ in "od")
    got = triton_kernels.attention_delta(out, dout)
    assert got.dtype == torch.float32 and got.shape == (2, 3, 37)
    assert_close(got, attention_delta(out, dout), 1e-6, "delta")
    mixed = triton_kernels.attention_delta(out, dout.float().transpose(1, 2).contiguous().transpose(1, 2))
    assert_close(mixed, attention_delta(out, dout.float()), 1e-6, "delta of mixed dtypes, strided")
    assert triton_kernels.attention_delta(out[:, :, :0], dout[:, :, :0]).shape == (2, 3, 0)
    with pytest.raises(ValueError, match="one shape"):
        triton_kernels.attention_delta(out, dout[:, :, :5])


def test_key_parts_share_the_kernels_delta(monkeypatch):
    """The engine's backward over several key parts (offload blocks) computes delta once, with the Triton pre-pass
    kernel on the Triton backend, and matches the torch backend."""
    from lightning_oomb.engine.attention import attend_backward

    calls = []
    kernel_delta = triton_kernels.attention_delta
    monkeypatch.setattr(triton_kernels, "attention_delta", lambda *a: calls.append(1) or kernel_delta(*a))
    case = CASES["gqa2-window"]
    q, dout, kv = make_inputs(case)
    scale, num_keys = case.d**-0.5, case.q_start + case.lq
    out, lse = reference.paged_attention_forward(
        q, kv.k, kv.v, kv.page_table, case.q_start, scale, case.window
    )
    results = {}
    for backend in BACKENDS:
        grads = copy_grads(kv)
        arenas = (grads.k, grads.v, grads.dk, grads.dv, grads.page_table)
        parts = [PagedKV(*arenas, (lo, min(lo + 32, num_keys))) for lo in range(0, num_keys, 32)]
        dq = attend_backward(backend, q, out, lse, dout, parts, case.q_start, scale, case.window)
        results[backend] = dq, grads.dk - kv.dk, grads.dv - kv.dv
    assert calls == [1]
    for name, got, want in zip(("dq", "dk", "dv"), results["triton"], results["torch"]):
        assert_close(got, want, TOLERANCE[case.dtype], name)


@pytest.mark.parametrize("backend", BACKENDS)
def test_backward_key_range_alone(backend: str):
    """A key range without ``delta``/``dq``: the launcher computes delta and returns dq in q's dtype."""
    case = CASES["gqa2-window"]
    q, dout, kv, poison = poisoned_inputs(case)
    scale, key_range = case.d**-0.5, (32, 64)
    out, lse = reference.paged_attention_forward(
        q, kv.k, kv.v, kv.page_table, case.q_start, scale, case.window
    )
    got, want = copy_grads(kv), copy_grads(kv)
    view = with_garbage(got, key_range, poison)
    dq = kernels(backend).paged_attention_backward(q, out, lse, dout, view.k, view.v, view.dk, view.dv,
                                                   view.page_table, case.q_start, scale, case.window,
                                                   key_range=key_range)  # fmt: skip
    want_dq = reference.paged_attention_backward(q, out, lse, dout, want.k, want.v, want.dk, want.dv,
                                                 want.page_table, case.q_start, scale, case.window,
                                                 key_range=key_range)  # fmt: skip
    assert_close(dq, want_dq, TOLERANCE[case.dtype], "dq")
    assert_close(got.dk - kv.dk, want.dk - kv.dk, TOLERANCE[case.dtype], "added dk")


@pytest.mark.parametrize("backend", BACKENDS)
def test_rejects_bad_key_ranges_and_buffers(backend: str):
    """One contract, one set of errors (``csrc_triton.contract``) for both backends."""
    ops = kernels(backend)
    q, dout, kv = make_inputs(Case(b=1, hq=2, hkv=1, q_start=32, lq=13))
    args = (kv.k, kv.v, kv.page_table, 32, 1.0, None)
    for bad in [(8, 32), (16, 40), (0, 46), (32, 32), (-16, 16)]:  # unaligned lo / hi, past the end, empty
        with pytest.raises(ValueError, match="key_range"):
            ops.paged_attention_forward(q, *args, key_range=bad)
    ops.paged_attention_forward(q, *args, key_range=(32, 45))  # hi may be the chunk's end
    with pytest.raises(ValueError, match="state acc"):
        ops.paged_attention_forward(q, *args, state=init_state(q.double()))
    with pytest.raises(ValueError, match="window=0"):
        ops.paged_attention_forward(q, *args[:-1], 0)
    out, lse = ops.paged_attention_forward(q, *args)
    grads = (kv.k, kv.v, kv.dk, kv.dv, kv.page_table, 32, 1.0, None)
    with pytest.raises(ValueError, match="dq must be"):
        ops.paged_attention_backward(q, out, lse, dout, *grads, dq=torch.zeros_like(q, dtype=torch.float16))
    with pytest.raises(ValueError, match="dq must be"):
        ops.paged_attention_backward(
            q, out, lse, dout, *grads, dq=torch.zeros_like(q, dtype=torch.float32).mT
        )
    with pytest.raises(ValueError, match="delta must be"):
        ops.paged_attention_backward(q, out, lse, dout, *grads, delta=lse[..., :-1])


def test_restore_hooks_touch_only_the_key_range():
    """The autotune hooks on plain CPU tensors: garbage page-table entries outside the range are never used,
    only the range's gradient pages, the state (with CARRY) and dQ (with ACCUMULATE) are saved and restored."""
    table = torch.tensor([[GARBAGE, 3, 5, GARBAGE], [GARBAGE, 0, 6, GARBAGE]], dtype=torch.int32)
    dk, dv = torch.randn(8, 1, 16, 4), torch.randn(8, 1, 16, 4)
    nargs = {"TABLE": table, "DK": dk, "DV": dv, "PAGE": 16, "first_key": 20, "key_hi": 45}
    before = dk.clone(), dv.clone()
    triton_kernels._restore_grad_pages.pre(nargs)
    dk += 1
    dv += 1
    triton_kernels._restore_grad_pages.post(nargs)
    restored = torch.tensor([0, 3, 5, 6])
    assert torch.equal(dk[restored], before[0][restored]) and torch.equal(dv[restored], before[1][restored])
    others = torch.tensor([1, 2, 4, 7])
    assert torch.equal(dk[others], before[0][others] + 1)

    state, dq = [torch.randn(2, 3) for _ in range(3)], torch.randn(2, 3)
    for hook, names, flag in ((triton_kernels._restore_state, ("OUT", "LSE", "L"), "CARRY"),
                              (triton_kernels._restore_dq, ("DQ",), "ACCUMULATE")):  # fmt: skip
        tensors = dict(zip(names, state if flag == "CARRY" else [dq]))
        for on in (True, False):
            saved = {n: t.clone() for n, t in tensors.items()}
            hook.pre({**tensors, flag: on})
            for t in tensors.values():
                t += 1
            hook.post({**tensors, flag: on})
            for n, t in tensors.items():
                assert torch.equal(t, saved[n] if on else saved[n] + 1), (n, on)
    hook.pre({**tensors, "ACCUMULATE": True}, reset_only=True)  # after tuning: nothing saved, nothing to undo
    assert hook.saved is None


@pytest.mark.parametrize("select", [0, 1], ids=["dense", "sparse"])
def test_autotuning_restores_in_place_arguments(monkeypatch, select: int):
    """Tuning runs every kernel once per config and repeat; with key ranges, a carried state and a dQ
    accumulator (and a page selection) the result must equal one untuned run bitwise (the first config is the
    untuned one and wins)."""
    case = Case(b=1, hq=2, hkv=1, q_start=16, lq=20, select=select)
    q, dout, kv, poison = poisoned_inputs(case)
    scale, ranges, terms = case.d**-0.5, [(16, 36), (0, 16)], {"page_select": page_selection(case)}
    out, lse = reference.paged_attention_forward(
        q, kv.k, kv.v, kv.page_table, case.q_start, scale, case.window, **terms
    )
    delta = attention_delta(out, dout)

    def run():
        state, grads = init_state(q), copy_grads(kv)
        dq = torch.zeros(q.shape, dtype=torch.float32, device=DEVICE)
        for key_range in ranges:
            view = with_garbage(grads, key_range, poison)
            triton_kernels.paged_attention_forward(q, view.k, view.v, view.page_table, case.q_start, scale, None,
                                                   key_range=key_range, state=state, **terms)  # fmt: skip
            triton_kernels.paged_attention_backward(q, out, lse, dout, view.k, view.v, view.dk, view.dv,
                                                    view.page_table, case.q_start, scale, None, key_range=key_range,
                                                    delta=delta, dq=dq, **terms)  # fmt: skip
        return *state, dq, grads.dk, grads.dv

    untuned = run()
    monkeypatch.setenv("OOMB_TRITON_AUTOTUNE", "1")
    tuners = (triton_kernels._fwd_kernel, triton_kernels._bwd_dkdv_kernel, triton_kernels._bwd_dq_kernel)
    # (a sparse call clamps BLOCK_M to the page: the stages keep the two configs apart; dK/dV's in the untuned
    # config's variant, SPLIT: the other walks the query blocks in another order, rounding dK/dV differently)
    variant = {tuners[1]: {"SPLIT": True}}
    benched = []

    def bench(fn, quantiles):  # two runs per config; every config ties, so the first (the untuned one) wins
        benched.append(fn)
        return [min(fn() or 1.0 for _ in "ab")] * 3

    for tuner in tuners:
        configs = [
            triton.Config({"BLOCK_M": m, "BLOCK_N": 16, **variant.get(tuner, {})}, num_warps=4, num_stages=st)
            for m, st in ((16, 1), (32, 2))
        ]
        monkeypatch.setattr(tuner, "configs", configs)
        monkeypatch.setattr(tuner, "cache", {})
        # (the cached property `do_bench` is shadowed through __dict__: reading it first would need a GPU driver)
        monkeypatch.setitem(tuner.__dict__, "do_bench", bench)
    tuned = run()
    assert len(benched) == 2 * len(tuners)  # each kernel tuned once (its first call), over both configs
    assert all(len(t.cache) == 1 and next(iter(t.cache.values())).kwargs["BLOCK_M"] == 16 for t in tuners)
    for name, got, want in zip(("acc", "m", "l", "dq", "dk", "dv"), tuned, untuned):
        assert torch.equal(got, want), name


# ----------------------------------------------------------------------------------- reference in float64
def split_ranges(num_keys: int, page: int, gen: torch.Generator, pieces: int | None) -> list[tuple[int, int]]:
    """``[0, num_keys)`` cut at random page boundaries into ``pieces`` ranges (every page its own for None),
    returned in a shuffled order."""
    bounds = torch.arange(page, num_keys, page)
    if pieces is not None:
        bounds = bounds[torch.randperm(len(bounds), generator=gen)[: pieces - 1]].sort().values
    edges = [0, *bounds.tolist(), num_keys]
    ranges = list(zip(edges[:-1], edges[1:]))
    return [ranges[i] for i in torch.randperm(len(ranges), generator=gen)]


def range_view(kv: PagedKV, key_range: tuple[int, int]) -> PagedKV:
    """``kv`` with garbage in every page-table entry outside ``key_range``'s pages: they must never be read."""
    table = torch.full_like(kv.page_table, GARBAGE)
    table[:, range_pages(kv, key_range)] = kv.page_table[:, range_pages(kv, key_range)]
    return PagedKV(kv.k, kv.v, kv.dk, kv.dv, table)


def rows_seeing(q_start: int, lq: int, key_range: tuple[int, int], window: int | None) -> torch.Tensor:
    """Bool [Lq]: which query rows see at least one key of ``key_range``."""
    qpos = torch.arange(q_start, q_start + lq)
    first = key_range[0] if window is None else torch.clamp(qpos - window + 1, min=key_range[0])
    return torch.as_tensor(first <= torch.clamp(qpos, max=key_range[1] - 1))


REFERENCE_RANGE_CASES = {  # (b, hq, hkv, lq, q_start, page, window); q_start > 0 and ragged Lq throughout
    "gqa3": (2, 6, 2, 11, 21, 4, None),
    "gqa3-window": (2, 6, 2, 11, 21, 4, 9),  # keys [0, 12) are in no query's window
    "gqa4-window-1": (2, 4, 1, 7, 30, 8, 1),
}


@pytest.mark.parametrize("pieces", [None, 2, 3])
@pytest.mark.parametrize("case", REFERENCE_RANGE_CASES.values(), ids=REFERENCE_RANGE_CASES.keys())
def test_reference_key_ranges_fold_exactly_in_float64(case, pieces):
    """Forward over shuffled key ranges folded into one state, backward per range with the final out/lse, a
    shared delta and one dQ accumulator: both equal the one-shot call and the dense oracle to 1e-12; pages outside
    a range stay untouched; a row that sees no key keeps its state bitwise."""
    b, hq, hkv, lq, q_start, page, window = case
    gen = torch.Generator().manual_seed(lq + q_start + (pieces or 0))
    d, dt, scale = 8, torch.float64, 8**-0.5
    n = q_start + lq
    q = torch.randn(b, hq, lq, d, dtype=dt, generator=gen)
    dout = torch.randn(b, hq, lq, d, dtype=dt, generator=gen)
    k, v = (torch.randn(b, hkv, n, d, dtype=dt, generator=gen) for _ in "kv")
    kv, _ = shuffled_pages(k, v, page, gen)
    out, lse = reference.paged_attention_forward(q, kv.k, kv.v, kv.page_table, q_start, scale, window)
    torch.testing.assert_close(out, dense_attention(q, k, v, q_start, scale, window), rtol=1e-12, atol=1e-12)
    want = PagedKV(kv.k, kv.v, kv.dk.clone(), kv.dv.clone(), kv.page_table)
    want_dq = reference.paged_attention_backward(q, out, lse, dout, want.k, want.v, want.dk, want.dv,
                                                 want.page_table, q_start, scale, window)  # fmt: skip

    ranges = split_ranges(n, page, gen, pieces)
    state = init_state(q)
    delta = attention_delta(out, dout)
    dq = torch.zeros_like(q)
    for key_range in ranges:
        before = [x.clone() for x in state]
        view = range_view(kv, key_range)
        assert reference.paged_attention_forward(q, view.k, view.v, view.page_table, q_start, scale, window,
                                                 key_range=key_range, state=state) is None  # fmt: skip
        blind = ~rows_seeing(q_start, lq, key_range, window)
        for x, y in zip(state, before):
            assert torch.equal(x[:, :, blind], y[:, :, blind])  # a row that sees no key keeps its state

        dk, dv = kv.dk.clone(), kv.dv.clone()
        got = reference.paged_attention_backward(q, out, lse, dout, view.k, view.v, view.dk, view.dv,
                                                 view.page_table, q_start, scale, window, key_range=key_range,
                                                 delta=delta, dq=dq)  # fmt: skip
        assert got is dq
        outside = torch.ones(kv.dk.shape[0], dtype=torch.bool)
        outside[kv.page_table[:, range_pages(kv, key_range)].flatten().long()] = False
        assert torch.equal(kv.dk[outside], dk[outside]) and torch.equal(kv.dv[outside], dv[outside])
    if pieces is None:  # the garbage is live: reading it fails
        view = range_view(kv, ranges[0])
        with pytest.raises(IndexError):
            reference.paged_attention_forward(q, view.k, view.v, view.page_table, q_start, scale, window)
    if pieces is None and window is not None:
        assert any(not rows_seeing(q_start, lq, r, window).any() for r in ranges)  # a range no query can see
    if pieces is None:
        assert any(
            0 < rows_seeing(q_start, lq, r, window).sum() < lq for r in ranges
        )  # one only some rows see

    got_out, got_lse = finish_state(state, q.dtype)
    torch.testing.assert_close(got_out, out, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(got_lse, lse, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(dq, want_dq, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(kv.dk, want.dk, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(kv.dv, want.dv, rtol=1e-12, atol=1e-12)


# the engine's attend / attend_backward over key parts with everything the op adds around the
# kernels — sinks (GPT-OSS), chunked attention's spans (Llama 4: `block`, as documents and a window)
BF16 = {"dtype": torch.bfloat16, "grad_dtype": torch.bfloat16}
PART_CASES = {  # (case, block, sinks)
    "bf16-sinks-window-packed": (
        Case(q_start=48, window=40, softcap=5.0, docs=(21, 40, 77), **BF16),
        None,
        True,
    ),
    "fp16-spans-sparse": (Case(b=1, hq=2, q_start=64, lq=33, select=2, dtype=torch.float16), 24, False),
    "spans-in-documents-sinks": (Case(hq=4, hkv=2, q_start=40, docs=(21, 40, 60)), 13, True),
    # DeepSeek's keys 192 wide, values 128 zero-padded to them (pages 192 wide, tiles 256)
    "head-dim-192-sparse-sinks": (Case(b=1, hq=2, d=192, v_d=128, q_start=64, lq=33, select=2), None, True),
}


def span_mask(case: Case, block: int | None) -> torch.Tensor | None:
    """Bool [B, Lq, N]: chunked attention from its definition — query ``i`` of a document starting at ``s`` sees
    the keys of its own span of ``block`` positions counted from ``s``."""
    if block is None:
        return None
    n = case.q_start + case.lq
    docs = doc_starts(case)
    starts = torch.zeros(case.b, case.lq, dtype=torch.long) if docs is None else docs.long().cpu()
    qpos = torch.arange(case.q_start, n)[None, :, None]
    kpos = torch.arange(n)[None, None]
    doc = starts[:, :, None]
    return (kpos >= doc) & ((kpos - doc) // block == (qpos - doc) // block)


@pytest.mark.parametrize(
    ("backend", "fused"), [("torch", "0"), ("cpu", "0"), ("triton", "0"), ("triton", "1")],
    ids=["torch", "cpu", "triton", "triton-fused-dq"],
)  # fmt: skip
@pytest.mark.parametrize("name", PART_CASES)
def test_attend_over_key_parts_with_sinks_and_spans(monkeypatch, name: str, backend: str, fused: str):
    """``attend`` / ``attend_backward`` as the op calls them: the keys in shuffled page-aligned parts (table entries
    outside each part garbage), a carried state, dQ accumulated, sinks folded in last and their gradient from the
    shared delta, chunked attention's spans as documents and a window (``attention._in_blocks``) — out, lse, dQ,
    dK, dV and dsinks against the dense float64 oracle, which masks the spans from their definition."""
    from lightning_oomb.engine.attention import ChunkContext, _in_blocks, attend, attend_backward
    from lightning_oomb.engine.lse import sink_grad
    from lightning_oomb.engine.pages import PoolShape

    case, block, with_sinks = PART_CASES[name]
    monkeypatch.setenv("OOMB_TRITON_FUSED_DQ", fused)
    q, dout, kv, poison = poisoned_inputs(case)
    n, scale, tol = case.q_start + case.lq, case.d**-0.5, TOLERANCE[case.dtype]
    sinks = 2 * torch.randn(case.hq, generator=torch.Generator().manual_seed(1)) if with_sinks else None
    sinks = None if sinks is None else sinks.to(case.dtype).to(DEVICE)
    docs, window = doc_starts(case), case.window
    if block is not None:  # as the op: the spans become documents and a window of `block`
        shape = PoolShape(1, case.b, n, case.hkv, case.d, case.page, chunk_size=n)
        chunk = ChunkContext(None, shape, case.q_start, "forward", backend, doc_start=docs)
        docs = _in_blocks(chunk, block, q.device).doc_start
        window = block if window is None else min(window, block)
    select = page_selection(case)
    parts = []
    for key_range in split_keys(n, case.page, seed=case.lq):
        view = with_garbage(kv, key_range, poison)
        parts.append(PagedKV(view.k, view.v, view.dk, view.dv, view.page_table, key_range))
    before = copy_grads(kv)
    ops = kernels(backend)
    out, lse = attend(backend, q, parts, case.q_start, scale, window, case.softcap, sinks, docs, select)
    delta = ops.attention_delta(out, dout)
    dq = attend_backward(backend, q, out, lse, dout, parts, case.q_start, scale, window, case.softcap, delta, docs,
                         select)  # fmt: skip

    leaves = [x.detach().double().requires_grad_() for x in (q, from_pages(kv.k, kv.page_table, n),
                                                               from_pages(kv.v, kv.page_table, n))]  # fmt: skip
    sink_leaf = None if sinks is None else sinks.detach().double().requires_grad_()
    mask = span_mask(case, block)
    if select is not None:
        selected = selection_mask(select.cpu(), case.q_start, case.lq, n, case.page)
        mask = selected if mask is None else mask & selected
    want_out, want_lse = dense_attention(*leaves, case.q_start, scale, case.window, True, case.softcap,
                                         sink_leaf, doc_starts(case), mask)  # fmt: skip
    want_out.backward(dout.double())
    assert_close(out, want_out, tol, "out")
    assert_close(lse, want_lse, 1e-5, "lse")
    assert_close(dq, leaves[0].grad, tol, "dq")
    pad = kv.page_table.shape[1] * case.page - n
    grad_tol = max(tol, TOLERANCE[case.grad_dtype])
    spare = torch.ones(kv.dk.shape[0], dtype=torch.bool, device=DEVICE)  # slots the table never names
    spare[kv.page_table.flatten().long()] = False
    for what, got, old, leaf in (("dk", kv.dk, before.dk, leaves[1]), ("dv", kv.dv, before.dv, leaves[2])):
        added = from_pages(got.double() - old.double(), kv.page_table, n + pad)
        assert_close(added, torch.nn.functional.pad(leaf.grad, (0, 0, 0, pad)), grad_tol, f"added {what}")
        assert torch.equal(got[spare], old[spare])
    if sinks is not None:
        assert_close(sink_grad(sinks, lse, delta), sink_leaf.grad, tol, "dsinks")
