"""Context parallelism through the engine (2 gloo processes, float64): loss and every gradient equal one process
and full-sequence training; pool bytes per rank; communication per chunk independent of the length."""

from __future__ import annotations

import time

import pytest
import torch
import torch.distributed as dist

from lightning_oomb.engine import OOMBConfig, OOMBEngine
from lightning_oomb.engine.context import ContextGroup
from lightning_oomb.engine.planner import plan
from lightning_oomb.integrations.hf import HFChunkModel
from tests.helpers.distributed import failing_ranks, run_ranks
from tests.helpers.models import (
    build_causal_lm,
    build_family,
    exact_moe_loss,
    full_sequence_loss,
    grads_of,
    max_relative_error,
)

pytestmark = pytest.mark.slow
TOL = 1e-10


def group_step(model, ids, config, checkpointing=False, context=None, position_ids=None, probe_recall=False,
               attention_mask=None):  # fmt: skip
    """One step of ``model`` across the context group ``context`` (``None``: one process): the engine, the loss
    and the gradients summed over the group."""
    engine = OOMBEngine(HFChunkModel(model, layer_checkpointing=checkpointing), config, context=context)
    engine.probe_recall = probe_recall
    loss = engine.loss(ids, position_ids=position_ids, attention_mask=attention_mask)
    loss.backward()
    grads = grads_of(model)
    if context is not None:
        for g in grads.values():
            dist.all_reduce(g, group=context.group)
    return engine, loss.detach(), grads


def _step(rank, world, family, seq, checkpointing, offload, reuse=False):
    model = build_causal_lm(family)
    ids = torch.randint(0, 97, (2, seq), generator=torch.Generator().manual_seed(seq))
    extra = {"offload": True, "hbm_budget": 0, "staging_buffers": 3} if offload else {}
    config = OOMBConfig(16, 8, reuse_attention=reuse, **extra)
    engine, loss, grads = group_step(model, ids, config, checkpointing, ContextGroup.of())
    return {"loss": loss, "grads": grads, "pool": engine.pool.allocated_bytes,
            "sent": engine.context.sent_bytes, "results": engine.results.nbytes}  # fmt: skip


def reference(family, seq, checkpointing):
    model = build_causal_lm(family)
    ids = torch.randint(0, 97, (2, seq), generator=torch.Generator().manual_seed(seq))
    want = full_sequence_loss(model, ids)
    want.backward()
    full = grads_of(model)
    model.zero_grad()
    engine = OOMBEngine(HFChunkModel(model, layer_checkpointing=checkpointing), OOMBConfig(16, 8))
    loss = engine.loss(ids)
    loss.backward()
    return want.detach(), full, loss.detach(), grads_of(model), engine.pool.allocated_bytes


@pytest.mark.parametrize(("family", "seq", "checkpointing", "offload", "reuse"), [
    ("qwen2", 53, False, False, False),  # a ragged last chunk of 5 tokens: one page, so rank 1 runs a stand-in
    ("qwen2", 53, True, False, True),  # reuse_attention: every rank takes its slice's forward results
    ("mistral", 45, True, False, False),  # sliding window 11; ragged last chunk of 13 tokens (a page each)
    ("mistral", 45, False, False, False),
    ("qwen2", 45, False, True, False),  # every layer offloaded on each rank
    ("qwen2", 45, False, True, True),
    ("qwen2", 53, True, True, False),  # offloaded, rank 0's stand-in streams all its blocks as earlier ones
    ("qwen2", 53, False, True, True),
])  # fmt: skip
def test_two_ranks_equal_one_process_and_full_sequence(tmp_path, family, seq, checkpointing, offload, reuse):
    results = run_ranks(_step, 2, tmp_path, family, seq, checkpointing, offload, reuse)
    want, full, one_loss, one_grads, _ = reference(family, seq, checkpointing)
    config = OOMBConfig(16, 8, reuse_attention=reuse)  # each rank's buffer: its slices' results, as planned
    planned = plan(build_causal_lm(family), seq, 2, config, "64-true", None, "cpu", context_parallel=2)
    assert all(r["results"] == planned.host_parts["reused_attention"] for r in results)
    assert (planned.host_parts["reused_attention"] > 0) == reuse
    for r in results:
        assert abs(r["loss"].item() - want.item()) <= TOL * want.item()
        assert abs(r["loss"].item() - one_loss.item()) <= TOL * want.item()
        assert max_relative_error(r["grads"], full) <= TOL
        assert max_relative_error(r["grads"], one_grads) <= TOL


def test_pool_is_split_and_traffic_does_not_grow_with_the_length(tmp_path):
    """Each rank's pool is half the one-process pool (64 and 128 tokens, whole chunks), and the bytes a rank sends
    per layer and chunk are the same at both lengths."""
    per_chunk = []
    for seq in (64, 128):
        results = run_ranks(_step, 2, tmp_path, "qwen2", seq, False, False)
        *_, one_pool = reference("qwen2", seq, False)
        assert all(r["pool"] == one_pool // 2 for r in results)
        planned = plan(
            build_causal_lm("qwen2"), seq, 2, OOMBConfig(16, 8), "64-true", None, "cpu", context_parallel=2
        )
        assert planned.device["kv_hbm"] == results[0]["pool"]  # the planner plans one rank's pool exactly
        per_chunk.append(results[0]["sent"] / (2 * seq // 16))  # 2 layers, seq / 16 chunks
    assert per_chunk[0] == per_chunk[1] > 0


def _data_and_context(rank, world):
    """4 ranks as 2 (data) x 2 (context): ranks {0, 1} and {2, 3} share a batch each."""
    groups = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    context = ContextGroup.of(groups[rank // 2])
    model = build_causal_lm("qwen2")
    ids = torch.randint(0, 97, (1, 45), generator=torch.Generator().manual_seed(rank // 2))
    engine = OOMBEngine(HFChunkModel(model), OOMBConfig(16, 8), context=context)
    loss = engine.loss(ids)
    loss.backward()
    grads = grads_of(model)
    for g in grads.values():  # the sum over the context group, the mean over the data replicas
        dist.all_reduce(g)
        g /= 2
    return {"loss": loss.detach(), "grads": grads}


def test_data_times_context_equals_the_mean_of_full_sequence_steps(tmp_path):
    results = run_ranks(_data_and_context, 4, tmp_path)
    model = build_causal_lm("qwen2")
    losses = []
    for seed in (0, 1):
        ids = torch.randint(0, 97, (1, 45), generator=torch.Generator().manual_seed(seed))
        loss = full_sequence_loss(model, ids) / 2
        loss.backward()
        losses.append(2 * loss.item())
    want = grads_of(model)
    for rank, r in enumerate(results):
        assert abs(r["loss"].item() - losses[rank // 2]) <= TOL * losses[rank // 2]
        assert max_relative_error(r["grads"], want) <= TOL


def _failing_step(rank, world, where):
    model = build_causal_lm("qwen2")
    seed = rank if where == "batch" else 0
    ids = torch.randint(0, 97, (1, 45), generator=torch.Generator().manual_seed(seed))
    if where == "model" and rank == 1:  # rank 1 fails in the forward sweep of its second chunk
        layer = model.model.layers[1]
        calls = []

        def explode(module, args):
            calls.append(1)
            if len(calls) == 2:
                raise RuntimeError("rank 1 ran out of something")

        layer.register_forward_pre_hook(explode)
    engine = OOMBEngine(HFChunkModel(model), OOMBConfig(16, 8), context=ContextGroup.of())
    engine.loss(ids).backward()


def test_a_batch_that_differs_across_the_group_is_refused_on_every_rank(tmp_path):
    errors = failing_ranks(_failing_step, 2, tmp_path, "batch")
    assert all(e is not None and "ranks [1] differs from rank 0's" in e for e in errors)


def test_a_failing_rank_ends_the_others_naming_it(tmp_path):
    start = time.perf_counter()
    errors = failing_ranks(_failing_step, 2, tmp_path, "model", timeout_s=10.0)
    assert time.perf_counter() - start < 60
    assert "rank 1 ran out of something" in errors[1]
    assert "RankFailure" in errors[0] and "rank 1: RuntimeError: rank 1 ran out of something" in errors[0]


def _failing_replica(rank, world):
    """Two data replicas of one rank each: rank 1's step fails; rank 0 reduces its gradients as the strategy does."""
    from types import SimpleNamespace

    from lightning_oomb.context_parallel import OOMBContextParallelStrategy

    groups = [dist.new_group([r]) for r in range(world)]
    model = build_causal_lm("qwen2")
    if rank == 1:
        model.model.layers[0].register_forward_pre_hook(
            lambda m, a: (_ for _ in ()).throw(RuntimeError("rank 1 broke"))
        )
    engine = OOMBEngine(HFChunkModel(model), OOMBConfig(16, 8), context=ContextGroup.of(groups[rank]))
    if rank == 1:
        time.sleep(3)  # rank 0 is in the all-reduce by then (a rank gone first would only have it killed)
    engine.loss(torch.randint(0, 97, (1, 45))).backward()
    strategy = SimpleNamespace(engine=engine, lightning_module=model, root_device=torch.device("cpu"),
                               data_parallel_size=world)  # fmt: skip
    strategy._reduce_gradients = lambda: OOMBContextParallelStrategy._reduce_gradients(strategy)
    OOMBContextParallelStrategy.reduce_gradients(strategy)


def test_a_rank_failing_in_another_data_replica_is_named_by_the_gradient_reduction(tmp_path):
    """2 replicas x 1-rank groups: the other replica's rank waits in the gradients' all-reduce, which ended with
    gloo's bare "connection closed by peer" (an audit's 2 x 2 mesh: a batch refused on one replica only)."""
    errors = failing_ranks(_failing_replica, 2, tmp_path)
    assert "rank 1 broke" in errors[1]
    assert "RankFailure" in errors[0] and "rank 1: RuntimeError: rank 1 broke" in errors[0], errors[0]


def _sparse_step(rank, world, family, checkpointing, budget, padded=False):
    model = build_causal_lm(family)
    ids = torch.randint(0, 97, (2, 61), generator=torch.Generator().manual_seed(7))
    mask = (torch.arange(61) < torch.tensor([[61], [37]])).long() if padded else None
    config = OOMBConfig(16, 8, page_budget=budget)
    context = ContextGroup.of() if world > 1 else None
    engine, loss, grads = group_step(model, ids, config, checkpointing, context, probe_recall=True,
                                     attention_mask=mask)  # fmt: skip
    stats = engine.stats.sparse
    return {"loss": loss, "grads": grads, "attended": stats.attended_fraction,
            "recall": stats.selection_recall}  # fmt: skip


@pytest.mark.parametrize(
    ("family", "checkpointing", "budget", "padded"),
    [
        ("qwen2", False, 1, False),
        ("qwen2", True, 2, False),
        ("mistral", True, 1, False),
        ("qwen2", False, 1, True),
    ],
)
def test_sparse_steps_select_and_train_as_one_process(tmp_path, family, checkpointing, budget, padded):
    """Page summaries are gathered, so every rank selects what one process selects: the same sparse loss and
    gradients (fp64), the same attended fraction (< 1: the step was sparse) and selection recall (the probed
    blocks' dense attention gathered from every rank's pages; right padding: over the real rows, as one process)."""
    results = run_ranks(_sparse_step, 2, tmp_path, family, checkpointing, budget, padded)
    one = _sparse_step(0, 1, family, checkpointing, budget, padded)
    assert one["attended"] < 1
    for r in results:
        assert abs(r["loss"].item() - one["loss"].item()) <= TOL * one["loss"].item()
        assert max_relative_error(r["grads"], one["grads"]) <= TOL
        assert r["attended"] == pytest.approx(one["attended"], rel=1e-12)
        assert 0 < one["recall"] < 1 and r["recall"] == pytest.approx(one["recall"], rel=1e-10)


def _moe_step(rank, world, family):
    model = build_family(family, output_router_logits=True, router_aux_loss_coef=0.5)
    ids = torch.randint(0, 64, (2, 53), generator=torch.Generator().manual_seed(3))
    _, loss, grads = group_step(model, ids, OOMBConfig(16, 8), context=ContextGroup.of())
    return {"loss": loss, "grads": grads}


@pytest.mark.parametrize("family", ["qwen3_moe", "gpt_oss"])
def test_router_balancing_loss_across_the_group_is_exact(tmp_path, family):
    """The router's load-balancing term couples all tokens: the ranks sum its constants, so loss and gradients equal
    full-sequence training with it (fp64; 53 tokens: rank 1 runs a stand-in in the last chunk)."""
    results = run_ranks(_moe_step, 2, tmp_path, family)
    model = build_family(family, output_router_logits=True, router_aux_loss_coef=0.5)
    ids = torch.randint(0, 64, (2, 53), generator=torch.Generator().manual_seed(3))
    want = exact_moe_loss(model, ids)
    want.backward()
    for r in results:
        assert abs(r["loss"].item() - want.item()) <= TOL * want.item()
        assert max_relative_error(r["grads"], grads_of(model)) <= TOL


PACKED = (37, 30, 29)  # documents of one packed row: later chunks start past the first document


def _skipping_cases():
    """``(family, ids, position ids, keys the group must read per layer)``: chunk 16, page 8. Packed documents
    starting at 0, 37, 67: the chunks from 48 on see nothing before 37 (pages from 32), the last nothing before 67
    (pages from 64): 16 + 32 + 48 + 32 + 48 + 32 keys. A sliding window of 11 (Mistral): chunk ``s`` sees nothing
    before ``16 s - 10``: 16 + 32 + 32 + 32."""
    ids = torch.randint(0, 97, (1, sum(PACKED)), generator=torch.Generator().manual_seed(11))
    positions = torch.cat([torch.arange(n) for n in PACKED])[None]
    return [("qwen2", ids, positions, 208), ("mistral", ids[:, :64], None, 112)]


def _counting_step(rank, world):
    """Each case's loss, summed gradients and the keys this rank's forward attention calls read."""
    from lightning_oomb.engine import context as context_module

    keys, forward = [0], context_module.attend_forward

    class Counted:  # the backend, counting the keys of every forward call
        def __init__(self, ops):
            self.ops = ops

        def __getattr__(self, name):
            return getattr(self.ops, name)

        def paged_attention_forward(self, q, *args, key_range, page_select=None, **kwargs):
            lo, hi = key_range
            keys[0] += hi - lo if page_select is None else int((page_select[0, 0] >= 0).sum()) * 8
            return self.ops.paged_attention_forward(
                q, *args, key_range=key_range, page_select=page_select, **kwargs
            )

    context_module.attend_forward = lambda ops, *args, **kwargs: forward(Counted(ops), *args, **kwargs)
    results = []
    try:
        for family, ids, positions, _ in _skipping_cases():
            keys[0] = 0
            model = build_causal_lm(family)
            _, loss, grads = group_step(
                model, ids, OOMBConfig(16, 8), context=ContextGroup.of(), position_ids=positions
            )
            results.append({"loss": loss, "grads": grads, "keys": keys[0]})
    finally:  # the worker process runs other tests' functions next
        context_module.attend_forward = forward
    return results


def test_the_group_reads_only_the_keys_its_queries_see(tmp_path):
    """Packed documents and a sliding window across 2 ranks: the loss and gradients of one process (checked against
    full-sequence training in test_packing.py and test_window_pages.py), and together the ranks read exactly the
    pages the chunk's queries can see (per layer and chunk: from the page of its first visible key on)."""
    ranks = run_ranks(_counting_step, 2, tmp_path)
    for case, (family, ids, positions, keys) in enumerate(_skipping_cases()):
        model = build_causal_lm(family)
        loss = OOMBEngine(HFChunkModel(model), OOMBConfig(16, 8)).loss(ids, position_ids=positions)
        loss.backward()
        want = grads_of(model)
        for r in ranks:
            assert abs(r[case]["loss"].item() - loss.item()) <= TOL * loss.item()
            assert max_relative_error(r[case]["grads"], want) <= TOL
        # 2 layers, each attended in the forward sweep and in the recompute
        assert sum(r[case]["keys"] for r in ranks) == 2 * 2 * keys


def _window_model(family):
    """Window 5 (Mistral, every layer) or 7 (GPT-OSS, every other layer): chunks of 32 give each rank slices of 16
    tokens, 2 pages of 8; both windows reach 1 page back."""
    return build_causal_lm("mistral", sliding_window=5) if family == "mistral" else build_family("gpt_oss")


def _window_config(offload):
    return OOMBConfig(32, 8, **({"offload": True, "hbm_budget": 0, "staging_buffers": 3} if offload else {}))


WINDOW_IDS = torch.randint(0, 64, (2, 128), generator=torch.Generator().manual_seed(5))


WINDOW_CASES = (("mistral", False), ("gpt_oss", True))  # every layer windowed / alternating, offloaded


def _window_steps(rank, world):
    results = []
    for family, offload in WINDOW_CASES:
        engine, loss, grads = group_step(_window_model(family), WINDOW_IDS, _window_config(offload),
                                         context=ContextGroup.of())  # fmt: skip
        results.append({"loss": loss, "grads": grads, "pool": engine.pool.allocated_bytes,
                        "tails": engine.pool.shape.tails, "host_layers": engine.pool.stats()["host_layers"],
                        "hosted": engine.pool.shape.hosted_tails})  # fmt: skip
    return results


def test_window_layers_keep_only_their_tails_on_every_rank(tmp_path):
    """Each rank keeps a window layer's pages that a later chunk's window reaches (in its local token space: the
    last page of each of its slices) plus one slice's transient pages — 5 of its 8 pages — and the step equals one
    process's (float64); under offload full layers stream from the host and window layers' tails wait there; the
    planner plans a rank's pool exactly."""
    ranks = run_ranks(_window_steps, 2, tmp_path)
    for case, (family, offload) in enumerate(WINDOW_CASES):
        model = _window_model(family)
        loss = OOMBEngine(HFChunkModel(model), OOMBConfig(32, 8)).loss(WINDOW_IDS)
        loss.backward()
        want = grads_of(model)
        planned = plan(model, 128, 2, _window_config(offload), "64-true", None, "cpu", context_parallel=2)
        types = getattr(model.config, "layer_types", None) or ("sliding_attention",) * 2
        windowed = [t == "sliding_attention" for t in types]
        for r in (rank[case] for rank in ranks):
            assert r["tails"] == tuple((1, 3, 5) if w else None for w in windowed)
            assert r["host_layers"] == (windowed.count(False) if offload else 0)
            # under offload the window layers' tails wait in host memory too (3 groups: a ring of 2 on the device)
            assert r["hosted"] == (tuple(i for i, w in enumerate(windowed) if w) if offload else ())
            assert abs(r["loss"].item() - loss.item()) <= TOL * loss.item()
            assert max_relative_error(r["grads"], want) <= TOL
            assert r["pool"] == planned.device["kv_hbm"] + planned.device["staging"] + planned.host_tier


def _dropout_masks(rank, world):
    """One training step of a tiny GPT-NeoX with ``hidden_dropout=0.5`` on a context group: the dropout masks of
    the forward sweep and of the backward sweep's recompute, in call order."""
    import transformers as tf

    torch.manual_seed(0)
    config = tf.GPTNeoXConfig(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                              vocab_size=61, hidden_dropout=0.5, attention_dropout=0.0)  # fmt: skip
    model = tf.GPTNeoXForCausalLM(config).double().train()
    masks = []
    model.gpt_neox.layers[0].post_mlp_dropout.register_forward_hook(lambda m, i, out: masks.append(out == 0))
    ids = torch.randint(0, 61, (1, 32), generator=torch.Generator().manual_seed(1))
    engine = OOMBEngine(HFChunkModel(model), OOMBConfig(16, 8), context=ContextGroup.of())
    shared = torch.get_rng_state()
    engine.loss(ids).backward()
    return {"masks": masks, "shared_advanced_alike": torch.get_rng_state(), "before": shared}


def test_dropout_masks_are_each_ranks_own_and_replayed_by_the_recompute(tmp_path):
    """Each rank's slices draw their own dropout masks (with the shared stream token i of every slice had the same
    one); the backward sweep's recompute replays the forward's; the shared stream ends alike on every rank."""
    ranks = run_ranks(_dropout_masks, 2, tmp_path)
    for r in ranks:
        forward, recompute = (
            r["masks"][:2],
            r["masks"][2:][::-1],
        )  # 2 chunks; the backward sweep goes in reverse
        assert all(torch.equal(a, b) for a, b in zip(forward, recompute, strict=True))
    assert not any(torch.equal(a, b) for a, b in zip(ranks[0]["masks"], ranks[1]["masks"], strict=True))
    assert torch.equal(ranks[0]["shared_advanced_alike"], ranks[1]["shared_advanced_alike"])
    assert not torch.equal(ranks[0]["shared_advanced_alike"], ranks[0]["before"])
