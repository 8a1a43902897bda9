"""``reuse_attention``: the backward sweep's recompute takes the forward sweep's attention results (kept in host
memory) instead of attending again — exact in float64, one attention forward per chunk and layer, the host bytes
the planner counts, and an offloaded step whose prefetch predicts the climbs that read no page (context
parallelism: tests/parallel/test_context_engine.py)."""

from __future__ import annotations

import functools

import pytest
import torch

from lightning_oomb.engine import OOMBConfig, OOMBConfigError, OOMBEngine, attention, planner
from lightning_oomb.integrations.hf import HFChunkModel, adapter
from tests.helpers.models import build_causal_lm, full_sequence_loss, grads_of, max_relative_error, oomb_step

CHUNK, PAGE, SEQ = 16, 8, 70  # 5 chunks, the last ragged


@pytest.fixture
def calls(monkeypatch):
    """Counts the step's attention calls (each layer's forward over its pages) — not those of the adapter's
    self-check, which trains a twin in chunks the first time the process sees an architecture (so a count taken when
    this file runs alone would depend on which tests ran before)."""
    count, checking = [], []
    attend, verify = attention.attend, adapter.verify_exactness_of

    def spy(*args, **kwargs):
        if not checking:
            count.append(1)
        return attend(*args, **kwargs)

    def verify_uncounted(model):
        checking.append(1)
        try:
            return verify(model)
        finally:
            checking.pop()

    monkeypatch.setattr(attention, "attend", spy)
    monkeypatch.setattr(adapter, "verify_exactness_of", verify_uncounted)
    return count


step = functools.partial(oomb_step, chunk=CHUNK, page=PAGE)


@pytest.mark.parametrize("checkpointing", [False, True])
@pytest.mark.parametrize(("reuse", "offload"), [(True, False), (2, False), (True, True)])
def test_reused_results_are_exact_and_attend_once(calls, reuse, offload, checkpointing):
    """Every chunk (or the last 2) takes its forward results in the backward sweep: float64 gradients equal
    full-sequence training's, and each reused chunk attends once per layer instead of twice."""
    model = build_causal_lm("qwen2", num_hidden_layers=2)
    ids = torch.randint(0, 97, (2, SEQ), generator=torch.Generator().manual_seed(4))
    want_loss = full_sequence_loss(model, ids)
    want_loss.backward()
    want = grads_of(model)
    model.train()
    off = {"offload": True, "hbm_budget": 0} if offload else {}
    loss, got, engine = step(model, ids, checkpointing, reuse_attention=reuse, **off)
    assert abs(loss.item() - want_loss.item()) <= 1e-10 * want_loss.item()
    assert max_relative_error(got, want) <= 1e-10
    chunks, layers = 5, 2
    reused = chunks if reuse is True else reuse
    assert len(calls) == layers * (2 * chunks - reused)
    if offload:
        assert engine.stats.extra["demand_copies"] == 0  # the climbs that read nothing were predicted


def test_a_step_without_reuse_attends_twice(calls):
    """The control: the recompute attends again (twice forward per chunk and layer)."""
    model = build_causal_lm("qwen2", num_hidden_layers=2)
    step(model, torch.randint(0, 97, (1, SEQ)))
    assert len(calls) == 2 * 2 * 5


def test_offloaded_reuse_streams_fewer_pages():
    """With every layer on the host, the reused climbs copy no page to the device."""
    model = build_causal_lm("qwen2", num_hidden_layers=2)
    ids = torch.randint(0, 97, (1, SEQ))
    moved = {}
    for reuse in (False, True):
        _, _, engine = step(model, ids, reuse_attention=reuse, offload=True, hbm_budget=0)
        moved[reuse] = engine.stats.extra["h2d_bytes"]
    assert 0 < moved[True] < moved[False]


@pytest.mark.parametrize(("reuse", "seq"), [(True, SEQ), (3, SEQ), (True, 12)])
def test_host_bytes_are_planned_exactly(reuse, seq):
    """The buffer holds one whole-chunk slot per kept chunk and layer: the planner's host term, to the byte."""
    model = build_causal_lm("qwen2", num_hidden_layers=2)
    _, _, engine = step(model, torch.randint(0, 97, (2, seq)), reuse_attention=reuse)
    config = engine.config
    predicted = planner.plan(model, seq, 2, config, "64-true", None, planner.Machine("cpu", 2**36, 2**36))
    assert predicted.host_parts["reused_attention"] == engine.results.nbytes > 0


def test_no_results_are_kept_without_grad():
    """A loss made under no_grad has no backward sweep: nothing is copied out."""
    model = build_causal_lm("qwen2", num_hidden_layers=2)
    engine = OOMBEngine(HFChunkModel(model), OOMBConfig(CHUNK, PAGE, reuse_attention=True))
    with torch.no_grad():
        engine.loss(torch.randint(0, 97, (1, SEQ)))
    assert engine.results.nbytes == 0


@pytest.mark.parametrize("bad", [-1, "yes", 1.5, None])
def test_bad_values_are_refused(bad):
    with pytest.raises(OOMBConfigError, match="reuse_attention"):
        OOMBConfig(reuse_attention=bad)


@pytest.mark.parametrize(("checkpointing", "offload"), [(False, False), (True, True)])
def test_reuse_with_window_layers(checkpointing, offload):
    """Mistral's window layers recycle their pages: the skipped recompute leaves the restaging to the backward."""
    from tests.engine.test_window_pages import SEQ as WINDOW_SEQ
    from tests.engine.test_window_pages import step as window_step

    model = build_causal_lm("mistral")
    ids = torch.randint(0, 64, (2, WINDOW_SEQ), generator=torch.Generator().manual_seed(0))
    want_loss = full_sequence_loss(model, ids)
    want_loss.backward()
    want = grads_of(model)
    off = {"offload": True, "hbm_budget": 0, "staging_buffers": 3} if offload else {}
    loss, grads, engine = window_step(model, ids, checkpointing, reuse_attention=True, **off)
    assert engine.pool.shape.tails[0] is not None
    assert abs(loss.item() - want_loss.item()) <= 1e-10 * want_loss.item()
    assert max_relative_error(grads, want) <= 1e-10


@pytest.mark.parametrize("offload", [False, True])
def test_reuse_in_a_sparse_step(offload):
    """The forward sweep's results of a sparse step carry its selection: equal to the masked oracle."""
    from tests.engine.test_sparse import oracle_masks, reference

    model = build_causal_lm("qwen2")
    ids = torch.randint(0, 97, (2, SEQ), generator=torch.Generator().manual_seed(1))
    off = {"offload": True, "hbm_budget": 0, "staging_buffers": 3} if offload else {}
    config = OOMBConfig(CHUNK, PAGE, attention_backend="torch", page_budget=1, reuse_attention=True, **off)
    engine = OOMBEngine(HFChunkModel(model), config)
    loss = engine.loss(ids)
    selections = dict(loss.grad_fn.step.sparse.selections)
    loss.backward()
    got = loss.detach(), grads_of(model)
    want_loss, want = reference(model, ids, oracle_masks(selections, 2, SEQ, 2))
    assert any(s.pages is not None for s in selections.values())
    assert abs(got[0].item() - want_loss.item()) <= 1e-10 * want_loss.item()
    assert max_relative_error(got[1], want) <= 1e-10


@pytest.mark.parametrize("offload", [False, True])
def test_reuse_with_carried_states(offload):
    """A recurrent layer beside attention: the chunk's states and the reused attention result together."""
    from tests.engine.test_carried_states import model_and_ids

    model, ids = model_and_ids()
    want_loss = model.full_sequence_loss(ids)
    want_loss.backward()
    want = grads_of(model)
    engine = OOMBEngine(
        model, OOMBConfig(16, 8, attention_backend="torch", offload=offload, reuse_attention=True)
    )
    for _ in range(2):  # the second step reuses the buffer
        model.zero_grad()
        loss = engine.loss(ids)
        loss.backward()
        assert abs(loss.item() - want_loss.item()) <= 1e-10 * want_loss.item()
        assert max_relative_error(grads_of(model), want) <= 1e-10


def test_a_host_that_cannot_hold_the_results_is_refused_with_fewer_chunks_offered():
    """Qwen2.5-7B at 256K: every chunk's results (49.8 GiB) do not fit 48 GiB of host memory next to nothing
    else; the plan refuses and offers the most chunks that fit (32 of 64: 24.9 GiB)."""
    from tests.engine.test_planner import qwen2_5_7b_config

    machine = planner.Machine("cuda", 141 * 10**9, 48 * 2**30)
    config = OOMBConfig(layer_checkpointing=True, reuse_attention=True)
    result = planner.plan(qwen2_5_7b_config(), 262144, 1, config, "bf16-true", None, machine)
    assert result.device_fits and not result.host_fits
    assert "forward attention results" in result.refusal()
    offered = [o.changes for o in result.options]
    assert offered[0] == {"reuse_attention": 32}


def test_through_the_trainer():
    """`Trainer(strategy=OOMBStrategy(reuse_attention=True))`: the logged loss and gradients of full-sequence
    training (float64)."""
    from tests.helpers.lightning import oomb_step_through_trainer

    model = build_causal_lm("qwen2", num_hidden_layers=2)
    ids = torch.randint(0, 97, (2, SEQ), generator=torch.Generator().manual_seed(6))
    want_loss = full_sequence_loss(model, ids)
    want_loss.backward()
    want = grads_of(model)
    model.zero_grad()
    loss, grads = oomb_step_through_trainer(model, ids, OOMBConfig(CHUNK, PAGE, reuse_attention=True))
    assert abs(float(loss) - want_loss.item()) <= 1e-10 * want_loss.item()
    assert max_relative_error(grads, want) <= 1e-10


def test_reuse_gives_the_recomputes_bits_in_bf16():
    """The forward sweep's result is the one the recompute would make: in bf16, with MLP tiles and the gradient
    sums in host memory, the step's gradients are those of the step that attends again, bit for bit."""
    ids = torch.randint(0, 97, (1, SEQ), generator=torch.Generator().manual_seed(8))
    runs = []
    for reuse in (False, True):
        model = build_causal_lm("qwen2", dtype=torch.bfloat16)
        config = OOMBConfig(CHUNK, PAGE, reuse_attention=reuse, mlp_tile=8, grad_accumulation="float32-host")
        engine = OOMBEngine(HFChunkModel(model), config)
        engine.host_grads.every = 2
        engine.loss(ids).backward()
        runs.append(grads_of(model))
    assert all(torch.equal(runs[0][n], runs[1][n]) for n in runs[0])


def test_auto_keeps_the_most_chunks_the_host_holds(monkeypatch):
    """``reuse_attention="auto"`` (the strategies' default): the plan keeps the most last chunks that still fit in
    half the memory the rest of the step leaves (Qwen2.5-7B at 256K beside 48 GiB of host memory: some, not all of
    64; with room: all), and the strategy decides it at setup."""
    import lightning_oomb
    from tests.engine.test_planner import SizedData, cpu_of, qwen2_5_7b_config
    from tests.helpers.lightning import TinyLM, make_trainer

    config = OOMBConfig(layer_checkpointing=True, reuse_attention="auto")
    decided = []
    for host in (48, 512):
        machine = planner.Machine("cuda", 141 * 10**9, host * 2**30)
        result = planner.plan(qwen2_5_7b_config(), 262144, 1, config, "bf16-true", None, machine)
        k = result.config.reuse_attention
        kept, more = (planner.plan(qwen2_5_7b_config(), 262144, 1, OOMBConfig(layer_checkpointing=True,
                      reuse_attention=n), "bf16-true", None, machine, suggest=False) for n in (k, k + 1))  # fmt: skip
        none = planner.plan(qwen2_5_7b_config(), 262144, 1, OOMBConfig(layer_checkpointing=True), "bf16-true",
                            None, machine)  # fmt: skip
        share = (none.host_capacity - none.host_tier) // 2
        assert result.fits and kept.host_parts["reused_attention"] <= share
        assert k == 64 or more.host_parts["reused_attention"] > share
        decided.append(k)
    assert 0 < decided[0] < 64 == decided[1]
    assert OOMBConfig(reuse_attention="auto").reused_chunks(8) == 0  # undecided: none kept
    monkeypatch.setattr(planner.Machine, "local", cpu_of(1 << 40))
    strategy = lightning_oomb.OOMBStrategy(chunk_size=16, page_size=8, verify_exactness=False,
                                           reuse_attention="auto")  # fmt: skip
    trainer = make_trainer(strategy, steps=1, limit_val_batches=0)
    trainer.fit(TinyLM(), datamodule=SizedData())
    assert strategy.engine.config.reuse_attention == 3 and trainer.global_step == 1  # 40 tokens: 3 chunks
    assert strategy.engine.stats.extra["reused_attention_bytes"] > 0


@pytest.mark.parametrize("layout", ["packed", "padded"])
def test_reuse_equals_recompute_for_packed_and_padded_rows(layout):
    """Packed documents (positions that restart) and right padding: the same loss and gradients, bit for bit, over
    two accumulated micro-batches and an evaluation between them."""
    ids = torch.randint(0, 97, (2, SEQ), generator=torch.Generator().manual_seed(9))
    if layout == "packed":
        extra = {"position_ids": torch.cat([torch.arange(30), torch.arange(SEQ - 30)])[None].expand(2, -1)}
    else:
        mask = torch.ones(2, SEQ, dtype=torch.long)
        mask[1, 50:] = 0
        extra = {"attention_mask": mask}
    runs = []
    for reuse in (False, True):
        model = build_causal_lm("qwen2", num_hidden_layers=2)
        engine = OOMBEngine(HFChunkModel(model), OOMBConfig(CHUNK, PAGE, reuse_attention=reuse))
        losses = [engine.loss(ids, **extra)]
        losses[0].backward()
        losses.append(engine.evaluate(ids, **extra))
        losses.append(engine.loss(ids.flip(1), **extra))
        losses[-1].backward()
        runs.append(([loss.item() for loss in losses], grads_of(model)))
    (want_losses, want), (losses, got) = runs
    assert losses == want_losses and all(torch.equal(got[n], want[n]) for n in want)
