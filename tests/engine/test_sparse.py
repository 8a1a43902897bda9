"""Sparse attention through the engine (float64): exact at full budget, equal to an independent masked oracle at
small budgets, the forward sweep's selection reused by the backward, the rule and its counters by hand."""

from __future__ import annotations

import math

import pytest
import torch

from lightning_oomb.engine import OOMBConfig, OOMBConfigError, OOMBEngine
from lightning_oomb.engine import sparse as sparse_module
from lightning_oomb.engine.attention import attend
from lightning_oomb.engine.pages import PagedKV
from lightning_oomb.engine.sparse import Probe, SparseStep, select_pages, summarize
from lightning_oomb.integrations.hf import HFChunkModel
from tests.helpers.attention import BACKENDS, dense_attention, selection_mask, shuffled_pages
from tests.helpers.models import (
    build_causal_lm,
    full_sequence_loss,
    grads_of,
    masked_full_sequence_loss,
    max_relative_error,
)

TOL = 1e-10
SEQ, CHUNK, PAGE = 70, 16, 8  # 5 chunks, 9 pages: the last chunk has 8 past pages and a ragged end


def oomb(model, ids, budget, backend="torch", offload=False, checkpointing=False, **batch):
    """Loss and gradients of one sparse OOMB step, and the selections it made (by layer and chunk start)."""
    buffers = 3 if offload is True else offload  # offload: True, or the staging buffers (5: 2 blocks a call)
    extra = {"offload": True, "hbm_budget": 0, "staging_buffers": buffers} if offload else {}
    config = OOMBConfig(CHUNK, PAGE, attention_backend=backend, page_budget=budget, **extra)
    engine = OOMBEngine(HFChunkModel(model, layer_checkpointing=checkpointing), config)
    model.zero_grad()
    loss = engine.loss(ids, **batch)
    selections = dict(loss.grad_fn.step.sparse.selections) if budget is not None else {}
    loss.backward()
    return loss.detach(), grads_of(model), selections, engine


def oracle_masks(selections, batch: int, seq: int, layers: int, docs=None):
    """Per layer, bool ``[B, N, N]``: the stored selections applied over the full sequence (plus documents)."""
    masks = {}
    for layer in range(layers):
        mask = torch.ones(batch, seq, seq, dtype=torch.bool)
        for (lay, start), selection in selections.items():
            if lay == layer and selection.pages is not None:
                end = min(start + CHUNK, seq)
                mask[:, start:end] = selection_mask(selection.pages, start, end - start, seq, PAGE)
        if docs is not None:
            mask &= torch.arange(seq)[None, None] >= docs[:, :, None]
        masks[layer] = mask
    return masks


def reference(model, ids, masks, **kwargs):
    model.zero_grad()
    loss = masked_full_sequence_loss(model, ids, masks, **kwargs)
    loss.backward()
    return loss.detach(), grads_of(model)


def assert_equal(got, want):
    (loss, grads), (want_loss, want_grads) = got, want
    assert abs(loss.item() - want_loss.item()) <= TOL * abs(want_loss.item())
    assert max_relative_error(grads, want_grads) <= TOL


@pytest.mark.parametrize(("offload", "checkpointing"), [(False, False), (True, False), (False, True)])
@pytest.mark.parametrize("family", ["qwen2", "mistral"])
def test_full_budget_equals_dense_and_full_sequence(family, offload, checkpointing):
    model = build_causal_lm(family)
    ids = torch.randint(0, 97, (2, SEQ), generator=torch.Generator().manual_seed(1))
    want = full_sequence_loss(model, ids)
    want.backward()
    want_grads = grads_of(model)
    loss, grads, selections, engine = oomb(
        model, ids, SEQ // PAGE, offload=offload, checkpointing=checkpointing
    )
    assert all(s.pages is None for s in selections.values())  # every block keeps all its past: dense
    assert engine.stats.sparse.attended_fraction == 1.0
    assert_equal((loss, grads), (want.detach(), want_grads))


@pytest.mark.parametrize(
    ("offload", "checkpointing"), [(False, False), (True, False), (False, True), (5, False), (5, True)]
)
@pytest.mark.parametrize(("family", "budget"), [("qwen2", 1), ("qwen2", 3), ("mistral", 1)])
def test_small_budget_equals_masked_full_sequence(family, budget, offload, checkpointing):
    """The loss and gradients are those of full-sequence training with each layer's stored selection applied as
    a dense mask (an independent oracle: textbook attention over the whole sequence)."""
    model = build_causal_lm(family, sliding_window=29) if family == "mistral" else build_causal_lm(family)
    ids = torch.randint(0, 97, (2, SEQ), generator=torch.Generator().manual_seed(budget))
    loss, grads, selections, engine = oomb(model, ids, budget, offload=offload, checkpointing=checkpointing)
    sparse = [s for s in selections.values() if s.pages is not None]
    assert sparse and engine.stats.sparse.attended_fraction < 1.0
    masks = oracle_masks(selections, 2, SEQ, 2)
    assert_equal((loss, grads), reference(model, ids, masks))
    # negative control: the same step densely differs (the selection matters)
    dense_loss = full_sequence_loss(model, ids).detach()
    assert abs(dense_loss.item() - loss.item()) > 1e-4


def test_small_budget_with_packed_documents():
    model = build_causal_lm("qwen2")
    gen = torch.Generator().manual_seed(5)
    lengths = (30, 9, 31)
    ids = torch.randint(0, 97, (1, sum(lengths)), generator=gen)
    positions = torch.cat([torch.arange(n) for n in lengths])[None]
    docs = torch.cat([torch.full((n,), s) for n, s in zip(lengths, (0, 30, 39), strict=True)])[None]
    loss, grads, selections, _ = oomb(model, ids, 1, position_ids=positions)
    assert any(s.pages is not None for s in selections.values())
    masks = oracle_masks(selections, 1, ids.shape[1], 2, docs)
    labels = ids.clone()
    labels[:, [30, 39]] = -100  # no token predicts the next document's first one
    assert_equal((loss, grads), reference(model, ids, masks, labels=labels, position_ids=positions))


@pytest.mark.parametrize("backend", ["torch", "cpu"])
def test_padding_does_not_steer_the_real_rows_selection(backend):
    """Padded rows add nothing to their query block's page scores: the pad ids change neither the selection, nor
    the loss, nor a gradient (they moved the loss by 1e-3: the padded rows' queries steered the block's pages)."""
    model = build_causal_lm("qwen2")
    ids = torch.randint(0, 97, (2, SEQ), generator=torch.Generator().manual_seed(3))
    mask = torch.ones_like(ids)
    mask[1, 52:] = (
        0  # row 1's last block of 8 rows is 4 real rows and 4 pads (the chunk at 48 has 6 past pages)
    )
    runs = []
    for pad in (0, 7, 91):
        padded = torch.where(mask.bool(), ids, pad)
        loss, grads, selections, _ = oomb(model, padded, 1, backend, attention_mask=mask)
        runs.append((loss, grads, {key: s.pages for key, s in selections.items()}))
    assert any(p is not None for p in runs[0][2].values())
    for loss, grads, pages in runs[1:]:
        assert_equal((loss, grads), runs[0][:2])
        assert all(torch.equal(p, runs[0][2][key]) for key, p in pages.items() if p is not None)


def test_padded_rows_score_no_page_with_either_scorer():
    """The selection with padded rows equals the selection of the real rows alone (the pads' queries zeroed and
    seeing nothing), with the torch scores and the Triton kernel's (interpreted)."""
    gen = torch.Generator().manual_seed(4)
    q = torch.randn(2, 4, 32, 16, generator=gen)
    summaries = summarize(torch.randn(2, 2, 96, 16, generator=gen), 16, "bound")
    real = torch.ones(2, 32, dtype=torch.bool)
    real[1, 20:] = False
    noise = torch.where(real[:, None, :, None], q, 50 * torch.randn(q.shape, generator=gen))
    for backend in ("torch", "triton"):
        want = select_pages(q, summaries, 96, 16, 2, backend=backend, real=real)
        got = select_pages(noise, summaries, 96, 16, 2, backend=backend, real=real)
        assert torch.equal(got.pages, want.pages)
        assert not torch.equal(select_pages(noise, summaries, 96, 16, 2, backend=backend).pages, want.pages)


def test_backward_reuses_the_forward_selection(monkeypatch):
    """The backward sweep never selects again: with the page summaries scrambled after the forward sweep (a
    re-selection would pick other pages) the gradients still equal the forward selection's oracle."""
    model = build_causal_lm("qwen2")
    ids = torch.randint(0, 97, (1, SEQ), generator=torch.Generator().manual_seed(7))
    calls = []
    real = sparse_module.select_pages

    def counted(*args, **kwargs):
        calls.append(args[2])
        return real(*args, **kwargs)

    monkeypatch.setattr("lightning_oomb.engine.attention.select_pages", counted)
    engine = OOMBEngine(HFChunkModel(model), OOMBConfig(CHUNK, PAGE, page_budget=2))
    loss = engine.loss(ids)
    selections = dict(loss.grad_fn.step.sparse.selections)
    assert len(calls) == 2 * math.ceil(SEQ / CHUNK)  # one per layer and chunk, in the forward sweep
    engine.pool._summaries.copy_(torch.randn_like(engine.pool._summaries))
    loss.backward()
    assert len(calls) == 2 * math.ceil(SEQ / CHUNK)  # none in the backward sweep
    assert_equal((loss.detach(), grads_of(model)), reference(model, ids, oracle_masks(selections, 1, SEQ, 2)))


def test_evaluate_is_sparse_and_equals_the_training_loss():
    model = build_causal_lm("qwen2")
    ids = torch.randint(0, 97, (2, SEQ), generator=torch.Generator().manual_seed(2))
    engine = OOMBEngine(HFChunkModel(model), OOMBConfig(CHUNK, PAGE, page_budget=2))
    with torch.inference_mode():
        evaluated = engine.evaluate(ids)
    loss = engine.loss(ids)
    loss.backward()
    assert abs(evaluated.item() - loss.item()) <= 1e-12
    engine.page_budget = None
    assert abs(engine.evaluate(ids).item() - full_sequence_loss(model, ids).item()) <= 1e-10


# --------------------------------------------------------------------------------------------------- the rule
def naive_score(g, summary):
    """A query's score of one page: ``g . mean``, or the bound ``sum_d max(g_d max_d, g_d min_d)``."""
    if summary.shape[0] == 1:
        return g @ summary[0]
    return torch.maximum(g * summary[0], g * summary[1]).sum()


def naive_selection(q, summaries, q_start, page, budget, window=None):
    """The rule in the docstring's words, one query block, KV head and query at a time (float64)."""
    b, hq, lq, _ = q.shape
    past, hkv = summaries.shape[1], summaries.shape[3]
    group = hq // hkv
    out = []
    for row in range(b):
        blocks = []
        for start in range(0, lq, page):
            queries = range(start, min(start + page, lq))
            first = [0 if window is None else max(0, q_start + i - window + 1) for i in queries]
            candidates = [p for p in range(past) if p * page + page - 1 >= first[0]]
            if len(candidates) <= budget:
                blocks.append(candidates)
                continue
            score = {p: 0.0 for p in candidates}
            for h in range(hkv):
                for i, f in zip(queries, first, strict=True):
                    seen = [p for p in candidates if p * page + page - 1 >= f]
                    qsum = q[row, h * group : (h + 1) * group, i].sum(0)
                    logits = torch.stack([naive_score(qsum, summaries[row, p, :, h]) for p in seen])
                    for p, w in zip(seen, torch.softmax(logits, 0).tolist(), strict=True):
                        score[p] += w
            top = sorted(candidates, key=lambda p: -score[p])[:budget]
            blocks.append(sorted(top))
        out.append(blocks)
    return out


@pytest.mark.parametrize("score", ["bound", "mean"])
@pytest.mark.parametrize("window", [None, 40])
def test_selection_follows_the_rule(window, score):
    gen = torch.Generator().manual_seed(0)
    b, hq, hkv, lq, d, page, q_start = 2, 6, 2, 20, 4, 4, 64
    q = torch.randn(b, hq, lq, d, dtype=torch.float64, generator=gen)
    keys = torch.randn(b, hkv, q_start, d, dtype=torch.float64, generator=gen)
    summaries = summarize(keys, page, score)
    got = select_pages(q, summaries, q_start, page, 3, window)
    want = naive_selection(q, summaries, q_start, page, 3, window)
    assert got.pages.shape == (b, 5, 3)
    for row in range(b):
        for block in range(5):
            listed = [p for p in got.pages[row, block].tolist() if p >= 0]
            assert listed == want[row][block]
    # counts per block: candidates (past pages visible), selected, own pages visible
    assert got.selected.tolist() == [[min(3, len(w)) for w in rows] for rows in want]
    assert got.candidates.tolist() == [[len(naive_selection(q, summaries, q_start, page, 99, window)[r][k])
                                        for k in range(5)] for r in range(b)]  # fmt: skip


def test_summaries_by_hand():
    k = torch.randn(2, 3, 13, 4, dtype=torch.float64)  # a ragged last page of 5 tokens
    bound, mean = summarize(k, 8, "bound"), summarize(k, 8, "mean")
    assert bound.shape == (2, 2, 2, 3, 4) and mean.shape == (2, 2, 1, 3, 4)
    for page, (lo, hi) in enumerate([(0, 8), (8, 13)]):
        tokens = k[:, :, lo:hi]
        assert torch.equal(bound[:, page, 0], tokens.amax(2)) and torch.equal(
            bound[:, page, 1], tokens.amin(2)
        )
        torch.testing.assert_close(mean[:, page, 0], tokens.mean(2), rtol=1e-14, atol=1e-14)


def test_selection_is_dense_when_the_past_fits():
    q = torch.randn(1, 2, 16, 4, dtype=torch.float64)
    summaries = torch.randn(1, 3, 2, 1, 4, dtype=torch.float64)
    assert select_pages(q, summaries, 24, 8, 3).pages is None
    assert select_pages(q, summaries, 24, 8, 2).pages is not None
    assert select_pages(q, summaries[:, :0], 0, 8, 2).pages is None  # the first chunk


@pytest.mark.parametrize(("score", "vectors"), [("bound", 2), ("mean", 1)])
def test_summaries_are_kept_in_the_pool(score, vectors):
    model = build_causal_lm("qwen2")
    ids = torch.randint(0, 97, (2, SEQ), generator=torch.Generator().manual_seed(3))
    engine = OOMBEngine(HFChunkModel(model), OOMBConfig(CHUNK, PAGE, page_budget=2, page_score=score))
    loss = engine.loss(ids)
    pool = engine.pool
    for layer in range(2):
        k, _ = pool.read_kv(layer, 0, SEQ)
        assert torch.equal(pool.summaries(layer, 9), summarize(k, PAGE, score))
    # counted in the pool's device bytes: layers x rows x pages x vectors x kv heads x head dim x float64
    assert pool.stats()["summary_bytes"] == 2 * 2 * 9 * vectors * 1 * 8 * 8
    loss.backward()


def test_attended_fraction_by_hand():
    """48 tokens, chunk 16, page 8, budget 1, no window: chunk c's block r attends min(1, 2c) past pages of 2c and
    r + 1 own pages: (3 + 5 + 5) / (3 + 7 + 11) = 13 / 21, in both layers."""
    model = build_causal_lm("qwen2")
    ids = torch.randint(0, 97, (1, 48), generator=torch.Generator().manual_seed(4))
    engine = OOMBEngine(HFChunkModel(model), OOMBConfig(CHUNK, PAGE, page_budget=1))
    engine.loss(ids).backward()
    assert engine.stats.sparse.attended_fraction == pytest.approx(13 / 21, rel=1e-12)
    assert engine.stats.sparse.page_budget == 1 and engine.stats.sparse.selection_recall is None


@pytest.mark.parametrize("backend", BACKENDS)
def test_probe_measures_the_kept_attention_mass(backend):
    """A probed block's two log-sum-exps are those of its rows over the attended and over all visible keys, also
    when the keys arrive in several parts (offload)."""
    gen = torch.Generator().manual_seed(6)
    b, hq, hkv, d, page, q_start, lq = 1, 4, 2, 16, 16, 64, 40
    dtype = torch.float32
    q = torch.randn(b, hq, lq, d, generator=gen, dtype=dtype)
    k = torch.randn(b, hkv, q_start + lq, d, generator=gen, dtype=dtype)
    v = torch.randn(b, hkv, q_start + lq, d, generator=gen, dtype=dtype)
    kv, _ = shuffled_pages(k, v, page, gen)
    select = torch.tensor([[[0, 2], [1, -1], [3, -1]]], dtype=torch.int32)
    n = q_start + lq
    parts = [
        PagedKV(kv.k, kv.v, kv.dk, kv.dv, kv.page_table, (lo, min(lo + 32, n))) for lo in range(0, n, 32)
    ]
    probe = Probe(16, 32)
    out, lse = attend(backend, q, parts, q_start, d**-0.5, None, select=select, probe=probe)
    mask = selection_mask(select, q_start, lq, n, page)
    want_out, want_lse = dense_attention(q.double(), k.double(), v.double(), q_start, d**-0.5, with_lse=True,
                                         mask=mask)  # fmt: skip
    _, dense_lse = dense_attention(q.double(), k.double(), v.double(), q_start, d**-0.5, with_lse=True)
    torch.testing.assert_close(out.double(), want_out, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(probe.sparse_lse.double(), want_lse[..., 16:32], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(probe.dense_lse.double(), dense_lse[..., 16:32], rtol=1e-5, atol=1e-5)


def test_recall_is_the_kept_share():
    step = SparseStep(2, probe=True)
    step.add_recall(torch.log(torch.tensor([[0.5, 1.0]])), torch.zeros(1, 2))
    step.add_recall(torch.log(torch.tensor([[0.25]])), torch.zeros(1, 1))
    assert step.stats().selection_recall == pytest.approx((0.75 + 0.25) / 2)


def test_recall_is_measured_when_probing():
    model = build_causal_lm("qwen2")
    ids = torch.randint(0, 97, (1, SEQ), generator=torch.Generator().manual_seed(8))
    engine = OOMBEngine(HFChunkModel(model), OOMBConfig(CHUNK, PAGE, page_budget=1))
    engine.probe_recall = True
    engine.loss(ids).backward()
    recall = engine.stats.sparse.selection_recall
    assert 0.0 < recall < 1.0
    engine.page_budget = SEQ // PAGE  # covers every page: no call selects, so all the attention mass is kept
    engine.loss(ids).backward()
    assert engine.stats.sparse.attended_fraction == 1.0
    assert engine.stats.sparse.selection_recall == 1.0  # it was None: read as "not measured"


def test_under_offload_the_recall_is_measured_on_the_device_layers():
    """A host layer's call stages only its selected pages, so its dense attention mass is not there to measure: its
    calls are not probed (their blocks drawn all the same). One HBM and one host layer: the recall is the HBM
    layer's, as the step without offload measures it; every layer on the host: not measured (``None``, which
    ``OOMBSparseBudget`` does not log) — it read the selected pages as all of them before."""

    def probed(**offload):
        engine = OOMBEngine(HFChunkModel(model), OOMBConfig(CHUNK, PAGE, page_budget=1, **offload))
        engine.probe_recall = True
        loss = engine.loss(ids)
        step = loss.grad_fn.step.sparse  # (the step lets go of it in the backward)
        loss.backward()
        return torch.stack(step._recall) if step._recall else None, engine

    model = build_causal_lm("qwen2")  # 2 layers
    ids = torch.randint(0, 97, (2, SEQ), generator=torch.Generator().manual_seed(8))
    every, engine = probed()
    assert (
        len(every) % 2 == 0 and engine.stats.sparse.selection_recall < 1.0
    )  # layers 0, 1 of each sparse chunk
    _, hosted = probed(offload=True, hbm_budget=0, staging_buffers=3)
    assert hosted.stats.sparse.selection_recall is None
    shape = hosted.pool.shape
    one, engine = probed(
        offload=True, hbm_budget=shape.layer_bytes + 3 * shape.block_bytes, staging_buffers=3
    )
    assert engine.pool.plan.hbm_layers == (0,) and engine.pool.plan.host_layers == (1,)
    torch.testing.assert_close(one, every[0::2], rtol=1e-12, atol=0)
    assert engine.stats.sparse.selection_recall == pytest.approx(one.mean().item(), rel=1e-12)


def test_padding_does_not_change_the_recall():
    """Right padding's token ids change the padded rows' queries but not what a real row attends; the recall
    counted the padded rows of a probed block (the padding's ids changed it: 0.3756 against 0.3780). A probe on a
    block of padding only measures nothing: ``None``, not 1.0."""
    model = build_causal_lm("qwen2")
    ids = torch.randint(0, 97, (1, SEQ), generator=torch.Generator().manual_seed(0))
    mask = (torch.arange(SEQ) < 40).long()[None]
    recalls = []
    for seed in (1, 2):
        padded = ids.clone()
        padded[:, 40:] = torch.randint(0, 97, (1, SEQ - 40), generator=torch.Generator().manual_seed(seed))
        engine = OOMBEngine(HFChunkModel(model), OOMBConfig(CHUNK, PAGE, page_budget=1))
        engine.probe_recall = True
        engine.loss(padded, attention_mask=mask)
        recalls.append(engine.stats.sparse.selection_recall)
    assert 0.0 < recalls[0] < 1.0 and recalls[0] == recalls[1]
    step = SparseStep(1, probe=True)
    step.add_recall(torch.zeros(1, 1, 2), torch.ones(1, 1, 2), real=torch.zeros(1, 2, dtype=torch.bool))
    assert step.stats().selection_recall is None


def test_recall_is_none_only_when_not_probing():
    assert SparseStep(2).stats().selection_recall is None
    assert SparseStep(2, probe=True).stats().selection_recall == 1.0  # probing, every call dense


def test_bad_page_score_is_refused():
    with pytest.raises(OOMBConfigError, match="page_score='max'"):
        OOMBConfig(page_score="max")


@pytest.mark.parametrize("budget", [0, -1, True, 1.5, "64"])
def test_bad_budgets_are_refused(budget):
    with pytest.raises(OOMBConfigError, match="page_budget"):
        OOMBConfig(page_budget=budget)
    engine = OOMBEngine(HFChunkModel(build_causal_lm("qwen2")), OOMBConfig(CHUNK, PAGE))
    with pytest.raises(OOMBConfigError, match="page_budget"):
        engine.page_budget = budget


@pytest.mark.slow
@pytest.mark.parametrize(
    ("budget", "offload", "checkpointing"), [(1, False, True), (1, True, False), (2, False, False)]
)
def test_triton_backend_matches_torch(budget, offload, checkpointing):
    """The Triton kernels (interpreted on CPU) give the torch backend's sparse loss and gradients (fp32); at full
    budget (2 past pages of 16 before the last chunk) both equal dense training."""
    model = build_causal_lm("qwen2", dtype=torch.float32, head_dim=16)
    ids = torch.randint(0, 97, (1, 45), generator=torch.Generator().manual_seed(9))
    buffers = 3 if offload is True else offload  # offload: True, or the staging buffers (5: 2 blocks a call)
    extra = {"offload": True, "hbm_budget": 0, "staging_buffers": buffers} if offload else {}
    results = {}
    for backend in BACKENDS:
        config = OOMBConfig(16, 16, attention_backend=backend, page_budget=budget, **extra)
        engine = OOMBEngine(HFChunkModel(model, layer_checkpointing=checkpointing), config)
        model.zero_grad()
        loss = engine.loss(ids)
        loss.backward()
        assert (engine.stats.sparse.attended_fraction < 1.0) == (budget == 1)
        results[backend] = loss.detach(), grads_of(model)
    (loss_t, grads_t), (loss_k, grads_k) = results["torch"], results["triton"]
    assert abs(loss_k.item() - loss_t.item()) <= 1e-5 * loss_t.item()
    assert max_relative_error(grads_k, grads_t) <= 1e-4
    if budget == 2:
        model.zero_grad()
        want = full_sequence_loss(model, ids)
        want.backward()
        assert abs(want.item() - loss_t.item()) <= 1e-5 * want.item()
        assert max_relative_error(grads_t, grads_of(model)) <= 1e-4


def test_offloaded_sparse_steps_stream_only_selected_pages():
    """Under offload a sparse step copies in only selected pages: every K/V copy from the host (both sweeps) holds
    pages a selection of that layer names, at most the selected pages' bytes per stream move, every backward copy
    is predicted (no demand copy), fewer bytes move than in the dense step, and the result equals the step
    without offload."""
    model = build_causal_lm("qwen2")
    ids = torch.randint(0, 97, (2, SEQ), generator=torch.Generator().manual_seed(11))
    loss, grads, selections, engine = oomb(model, ids, 1, offload=True)
    want_loss, want, *_ = oomb(model, ids, 1)
    assert (
        abs(loss.item() - want_loss.item()) <= TOL * want_loss.item()
        and max_relative_error(grads, want) <= TOL
    )
    pool = engine.pool
    named = {layer: set() for layer, _ in selections}
    streamed = 0  # selected pages of every stream: one in the forward sweep, two in the backward
    for (layer, _), s in selections.items():
        if s.pages is not None:
            pages = set(s.pages[s.pages >= 0].tolist())
            named[layer] |= pages
            streamed += 3 * len(pages)
    copies = [t for t in pool.transfers if t.direction == "h2d" and t.what == "kv"]
    assert copies and all(set(range(t.first, t.end)) <= named[t.layer] for t in copies)
    assert sum(t.nbytes for t in copies) <= streamed * pool.shape.page_bytes("kv")
    backward = [t for t in copies if t.sweep == "backward"]
    assert backward and all(t.cause == "prefetch" for t in backward)  # predicted from the stored selections
    *_, dense = oomb(model, ids, None, offload=True)
    assert pool.stats()["h2d_bytes"] < dense.pool.stats()["h2d_bytes"]


@pytest.mark.parametrize("gathers", [False, True], ids=["runs", "gathered"])
def test_page_copies_of_a_sparse_step_are_ordered_by_events(gathers):
    """The CUDA schedule's events, checked on CPU for a sparse step (copies of single pages, partial buffers; or
    ``OOMB_OFFLOAD_GATHER``'s one gather of a block's scattered pages): no two conflicting operations on different
    streams are left unordered."""
    from tests.helpers.streams import RecordingTransport

    sim = RecordingTransport(gathers=gathers)
    model = build_causal_lm("qwen2")
    ids = torch.randint(0, 97, (2, SEQ), generator=torch.Generator().manual_seed(11))
    config = OOMBConfig(
        CHUNK, 4, page_budget=2, offload=True, hbm_budget=0, staging_buffers=3
    )  # 4 pages a block
    engine = OOMBEngine(HFChunkModel(model), config, transport=lambda device: sim)
    engine.loss(ids).backward()
    assert {op[0] for op in sim.ops} == {"compute", "h2d", "d2h"} and (sim.gathered > 0) == gathers
    assert sim.hazards() == []


def test_each_offloaded_stream_copies_exactly_its_selected_pages():
    """With no buffer to keep a page between streams (2 buffers, no prefetch), every forward-sweep stream of a host
    layer copies in exactly its selected pages (all earlier pages where the call is dense): the bytes counted by the
    transport equal the selections' pages."""
    model = build_causal_lm("qwen2")
    ids = torch.randint(0, 97, (2, SEQ), generator=torch.Generator().manual_seed(5))
    config = OOMBConfig(
        CHUNK, PAGE, page_budget=1, offload=True, hbm_budget=0, staging_buffers=2, prefetch_depth=0
    )
    engine = OOMBEngine(HFChunkModel(model), config)
    loss = engine.loss(ids)
    selections = loss.grad_fn.step.sparse.selections
    pages = 0
    for (_, start), s in selections.items():
        pages += start // PAGE if s.pages is None else len(s.pages[s.pages >= 0].unique())
    copied = sum(t.nbytes for t in engine.pool.transfers if t.direction == "h2d" and t.what == "kv")
    assert copied == pages * engine.pool.shape.page_bytes("kv") > 0


def test_recall_probe_follows_the_global_step_not_the_engines_history():
    """The probe's blocks are drawn by the trainer's step (``global_step``, restored by a resume) and the
    micro-batch within it: a fresh engine at step 2 measures what an engine that ran steps 0-1 and evaluations
    measures there (the weights are unchanged: no optimizer step); evaluations do not advance the draws."""
    model = build_causal_lm("qwen2")
    ids = torch.randint(0, 97, (1, SEQ), generator=torch.Generator().manual_seed(8))

    def engine_at(step: int) -> OOMBEngine:
        engine = OOMBEngine(HFChunkModel(model), OOMBConfig(CHUNK, PAGE, page_budget=1))
        engine.probe_recall, engine.global_step = True, step
        return engine

    def recalls(engine, micro_batches=2) -> list[float]:
        measured = []
        for _ in range(micro_batches):
            engine.loss(ids).backward()
            measured.append(engine.stats.sparse.selection_recall)
        return measured

    ran = engine_at(0)
    seen = [recalls(ran)]
    ran.evaluate(ids)
    ran.global_step = 1
    seen.append(recalls(ran))
    ran.evaluate(ids)
    ran.global_step = 2
    ran.evaluate(ids)
    seen.append(recalls(ran))
    assert recalls(engine_at(2)) == seen[2]
    assert len({r for step in seen for r in step}) == 6  # each step and micro-batch draws its own blocks


def test_a_budget_for_a_model_without_attention_layers_warns():
    """A pure Mamba2 model has no pages to select: ``page_budget`` did nothing, silently."""
    from tests.helpers.models import build_hybrid

    chunked = HFChunkModel(build_hybrid("mamba2"), verify_exactness=False)
    with pytest.warns(UserWarning, match="page_budget=1 has no effect: the model has no attention layers"):
        engine = OOMBEngine(chunked, OOMBConfig(16, 8, page_budget=1))
    with pytest.warns(UserWarning, match="page_budget=2 has no effect"):  # (a schedule's first sparse step)
        engine.page_budget, engine.page_budget = None, 2
