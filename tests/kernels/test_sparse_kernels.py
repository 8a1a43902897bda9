"""What only the Triton kernels' sparse path has (page selections; the shared contract's cases run over both
backends in ``test_paged_attention.py``): the tiles it computes, its agreement with the dense path, the inverse
lists of the dK/dV kernel, the tile shapes a selection allows."""

from __future__ import annotations

import pytest
import torch
import triton

from csrc_triton import paged_attention as triton_kernels
from tests.kernels.test_paged_attention import (
    DEVICE,
    TOLERANCE,
    Case,
    assert_close,
    copy_grads,
    doc_starts,
    make_inputs,
)

TUNERS = (triton_kernels._fwd_kernel, triton_kernels._bwd_dkdv_kernel, triton_kernels._bwd_dq_kernel)


@pytest.fixture
def tiles_16x16(monkeypatch):
    """Every kernel on 16 x 16 tiles (the interpreter's; on CUDA instead of the tuned ones): countable visits."""
    config = [triton.Config({"BLOCK_M": 16, "BLOCK_N": 16}, num_warps=4, num_stages=1)]
    for tuner in TUNERS:
        monkeypatch.setattr(tuner, "configs", config)
        monkeypatch.setattr(tuner, "cache", {})


def run(case: Case, select: torch.Tensor | None, visits: bool = False):
    """One forward and backward through the kernels: out, lse, dq, the dK/dV added, the tiles counted."""
    q, dout, kv = make_inputs(case)
    scale, grads = case.d**-0.5, copy_grads(kv)
    counts = [torch.zeros(1, dtype=torch.int32, device=DEVICE) if visits else None for _ in "fb"]
    terms = {"softcap": case.softcap, "doc_start": doc_starts(case), "page_select": select}
    out, lse = triton_kernels.paged_attention_forward(q, kv.k, kv.v, kv.page_table, case.q_start, scale,
                                                      case.window, visits=counts[0], **terms)  # fmt: skip
    dq = triton_kernels.paged_attention_backward(q, out, lse, dout, grads.k, grads.v, grads.dk, grads.dv,
                                                 grads.page_table, case.q_start, scale, case.window,
                                                 visits=counts[1], **terms)  # fmt: skip
    tiles = tuple(int(c.item()) for c in counts) if visits else None
    return (out, lse, dq, grads.dk - kv.dk, grads.dv - kv.dv), tiles


def selection(rows: list[list[list[int]]]) -> torch.Tensor:
    return torch.tensor(rows, dtype=torch.int32, device=DEVICE)


@pytest.mark.parametrize(
    ("window", "want"),
    [
        # block 0 (queries 64..79): pages 1, 3 + its diagonal block; block 1 (80..95): page 0 + 2 own blocks
        (None, 3 + 3),
        # queries see keys > position - 40: block 0 keys >= 25 (page 1 partly, masked), block 1 keys >= 41 (page 0
        # skipped); the dK/dV grid starts at key 25's block, page 0 is outside it anyway
        (40, 3 + 2),
    ],
    ids=["full", "window"],
)
def test_sparse_calls_compute_the_listed_tiles(tiles_16x16, window, want):
    """Visits (16 x 16 tiles) of a sparse call: exactly the listed pages' key blocks a query block can see plus its
    own, per query head — forward and dK/dV alike (the same tiles, by key block) — far fewer than dense."""
    case = Case(b=1, hq=2, hkv=1, q_start=64, lq=32, window=window)
    select = selection([[[1, 3], [0, -1]]])  # 4 past pages: page 2 nobody's
    _, sparse = run(case, select, visits=True)
    assert sparse == (want * case.hq, want * case.hq)
    _, dense = run(case, None, visits=True)
    dense_tiles = (4 + 1) + (4 + 2) if window is None else (3 + 1) + (2 + 2)  # past pages in the window + own
    assert dense == (dense_tiles * case.hq, dense_tiles * case.hq) and sparse[0] < dense[0]


@pytest.mark.parametrize(
    "case",
    [
        Case(b=1, hq=4, hkv=2, q_start=48, lq=37, window=40),
        Case(b=2, hq=2, hkv=1, q_start=48, lq=37, docs=(21, 40, 60, 77)),
    ],
    ids=["window", "packed"],
)
def test_selecting_every_page_is_the_dense_call(case: Case):
    """A selection listing every past page (in every query block) gives the dense result: out, lse, dq, dk, dv."""
    past, blocks = case.q_start // case.page, triton.cdiv(case.lq, case.page)
    every = torch.arange(past, dtype=torch.int32, device=DEVICE).expand(case.b, blocks, -1).contiguous()
    sparse, _ = run(case, every)
    dense, _ = run(case, None)
    for name, got, want in zip(("out", "lse", "dq", "dk", "dv"), sparse, dense):
        assert_close(got, want, 1e-6 if name == "lse" else TOLERANCE[case.dtype], name)


def test_unlisted_pages_are_never_read():
    """NaN keys and values on every past page no block lists change nothing, bit for bit."""
    case = Case(b=1, hq=2, hkv=1, q_start=64, lq=32, window=50)
    select = selection([[[0, 2, -1], [2, -1, -1]]])  # pages 1 and 3 unread
    q, dout, kv = make_inputs(case)
    clean = copy_grads(kv)
    poisoned = copy_grads(kv)
    poisoned.k, poisoned.v = kv.k.clone(), kv.v.clone()
    unread = kv.page_table[0, [1, 3]].long()
    poisoned.k[unread] = poisoned.v[unread] = float("nan")
    results = []
    for pages in (clean, poisoned):
        args = (pages.k, pages.v, pages.page_table, case.q_start, 0.25, case.window)
        out, lse = triton_kernels.paged_attention_forward(q, *args, page_select=select)
        dq = triton_kernels.paged_attention_backward(q, out, lse, dout, pages.k, pages.v, pages.dk, pages.dv,
                                                     *args[2:], page_select=select)  # fmt: skip
        results.append((out, lse, dq, pages.dk, pages.dv))
    for name, got, want in zip(("out", "lse", "dq", "dk", "dv"), *results):
        assert torch.equal(got, want), name


def test_inverse_lists():
    """The dK/dV kernel's CSR: per (row, past page) the query blocks listing it, ascending; padding ignored."""
    select = selection(
        [[[0, 2], [2, -1], [-1, -1]], [[1, -1], [0, 1], [1, 2]]]
    )  # [B=2, R=3, K=2], 3 past pages
    offsets, blocks = triton_kernels._inverse_lists(select, 3)
    want = {(0, 0): [0], (0, 1): [], (0, 2): [0, 1], (1, 0): [1], (1, 1): [0, 1, 2], (1, 2): [2]}
    assert offsets.dtype == blocks.dtype == torch.int32 and offsets.shape == (2 * 3 + 1,)
    for (row, page), listing in want.items():
        i = row * 3 + page
        assert blocks[offsets[i] : offsets[i + 1]].tolist() == listing, (row, page)
    assert offsets[-1] == 8  # the valid entries, all before the padding


def test_selection_lists_make_the_dkdv_grid():
    """The dK/dV grid's past pages for a call over all of them: per row every past page, those listed by the most
    query blocks first (then by page); built once for the last selection seen (a step's key parts share it), again
    for a new one or after an in-place change. The grid has the chunk's own key blocks, then one program per key
    block of as many pages as the selection has entries (or as the call's range has pages)."""
    select = selection(
        [[[0, 5], [5, 7], [-1, -1]], [[6, -1], [2, 6], [-1, -1]]]
    )  # [B=2, R=3, K=2], 8 past pages
    lists = triton_kernels._selection_lists(select, 8)
    assert lists.work.dtype == torch.int32
    assert lists.work.tolist() == [[5, 0, 7, 1, 2, 3, 4, 6], [6, 2, 0, 1, 3, 4, 5, 7]]
    assert triton_kernels._selection_lists(select, 8) is lists  # the same selection: kept
    select[0, 2, 0] = 7
    assert triton_kernels._selection_lists(select, 8).work[0, :4].tolist() == [5, 7, 0, 1]  # changed: rebuilt
    grid = triton_kernels._key_grid(first_key=16, key_hi=8 * 16 + 40, heads=3, listed=(6, 16, 8 * 16))
    assert grid({"BLOCK_N": 8}) == (6 * 2 + 5, 3)  # 2 key blocks per listed page; 40 own keys
    assert triton_kernels._key_grid(16, 100, 3, (4, 16, 128))({"BLOCK_N": 16}) == (
        4,
        3,
    )  # no own keys in range


def test_key_parts_share_one_build_of_the_selection_lists(monkeypatch):
    """Offload's calls over a chunk's key parts (same selection) build the inverse lists once, and their dK/dV and dQ
    add up to the whole call's."""
    case = Case(b=2, hq=4, hkv=2, q_start=64, lq=32)
    select = selection([[[0, 2, -1], [1, 2, 3]], [[3, -1, -1], [0, 3, -1]]])
    q, dout, kv = make_inputs(case)
    scale = case.d**-0.5
    out, lse = triton_kernels.paged_attention_forward(q, kv.k, kv.v, kv.page_table, case.q_start, scale,
                                                      page_select=select)  # fmt: skip
    whole = copy_grads(kv)
    want_dq = triton_kernels.paged_attention_backward(q, out, lse, dout, whole.k, whole.v, whole.dk, whole.dv,
                                                      whole.page_table, case.q_start, scale, page_select=select)  # fmt: skip
    builds = []
    inverse_lists = triton_kernels._inverse_lists
    monkeypatch.setattr(triton_kernels, "_inverse_lists", lambda *a: builds.append(a) or inverse_lists(*a))
    monkeypatch.setattr(triton_kernels, "_last_selection", [None])  # (the whole call kept this selection's)
    parts, dq = copy_grads(kv), torch.zeros(q.shape, dtype=torch.float32, device=DEVICE)
    for key_range in ((0, 32), (32, 64), (64, 96)):
        triton_kernels.paged_attention_backward(q, out, lse, dout, parts.k, parts.v, parts.dk, parts.dv,
                                                parts.page_table, case.q_start, scale, key_range=key_range, dq=dq,
                                                page_select=select)  # fmt: skip
    assert len(builds) == 1
    for name, got, want in (("dq", dq, want_dq), ("dk", parts.dk, whole.dk), ("dv", parts.dv, whole.dv)):
        assert_close(got.to(want.dtype), want, TOLERANCE[case.dtype], name)


def test_page_slot_pairs_are_built_once_per_selection_and_page_table():
    """The forward and dQ kernels read each listed page next to its slot: built from the selection and the call's
    page table, kept for the last selection per table (offload's key parts, each staging buffer's table), built
    again for another table, after an in-place change of either, and for a new selection."""
    select = selection([[[0, 2, -1], [1, 2, 3]]])  # [B=1, R=2, K=3]
    table = torch.tensor([[7, 4, 9, 5, 8]], dtype=torch.int32, device=DEVICE)
    pairs, width, width_p2 = triton_kernels._selection_args(select, table)
    assert (width, width_p2) == (3, 4)
    assert pairs.tolist() == [[[[0, 7], [2, 9], [-1, 7]], [[1, 4], [2, 9], [3, 5]]]]  # padding: page 0's slot
    assert triton_kernels._selection_args(select, table)[0] is pairs
    other = table.flip(1)
    assert triton_kernels._selection_args(select, other)[0][0, 1, 2].tolist() == [3, 4]
    assert triton_kernels._selection_args(select, table)[0] is pairs  # both tables' kept
    table[0, 3] = 6
    assert triton_kernels._selection_args(select, table)[0][0, 1, 2].tolist() == [3, 6]
    select[0, 0, 1] = 3
    assert triton_kernels._selection_args(select, table)[0][0, 0, 1].tolist() == [3, 6]


def test_a_sparse_forward_runs_under_inference_mode():
    """Inference tensors have no version counter, which the kept page-slot pairs are keyed on: a selection and a page
    table made under ``torch.inference_mode`` are built afresh per call, with the same result."""
    case = Case(b=1, hq=4, hkv=2, q_start=64, lq=32)
    q, _, kv = make_inputs(case)
    rows = [[[0, 2, -1], [1, 2, 3]]]
    want = triton_kernels.paged_attention_forward(q, kv.k, kv.v, kv.page_table, case.q_start, 0.3,
                                                  page_select=selection(rows))  # fmt: skip
    with torch.inference_mode():
        table = kv.page_table.clone()
        got = triton_kernels.paged_attention_forward(q, kv.k, kv.v, table, case.q_start, 0.3,
                                                     page_select=selection(rows))  # fmt: skip
    for name, x, y in zip(("out", "lse"), got, want):
        assert_close(x, y, 0.0, name)


def test_sparse_tiles_fit_a_page(monkeypatch):
    """With SPARSE no tile's query rows exceed a page (a tile lies in one selection block, and divides it); the
    dense space keeps its tall tiles, and the tuning keys tell the two apart (a dense tile is never reused)."""
    monkeypatch.setenv("OOMB_TRITON_AUTOTUNE", "1")
    configs = [
        triton.Config({"BLOCK_M": m, "BLOCK_N": n}, num_warps=w, num_stages=2)
        for m, n, w in [(128, 64, 8), (64, 128, 4), (32, 64, 4), (16, 16, 4)]
    ]
    for rows, factor in (("BLOCK_M", 1), ("BLOCK_N", 2)):  # forward / dQ, dK/dV
        prune = triton_kernels._pruner(rows, factor)
        for page in (16, 32, 64):
            sparse = prune(configs, {}, PAGE=page, HEAD_DIM=64, SPARSE=True)
            assert sparse and all(page % c.kwargs["BLOCK_M"] == 0 for c in sparse), (rows, page)
            dense = prune(configs, {}, PAGE=page, HEAD_DIM=64, SPARSE=False)
            assert max(c.kwargs["BLOCK_M"] for c in dense) == 128 or rows == "BLOCK_N"
    assert all("SPARSE" in tuner.keys for tuner in TUNERS)
