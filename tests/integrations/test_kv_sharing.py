"""Layers that reuse an earlier layer's K/V (Gemma 4's E-series, ``num_kv_shared_layers``) read that layer's pages
and store none of their own: exact in float64, the pool without the duplicates, planned byte for byte."""

import pytest
import torch
import transformers as tf

from lightning_oomb.engine import OOMBConfig, OOMBConfigError, OOMBEngine
from lightning_oomb.engine.context import ContextGroup
from lightning_oomb.engine.model_shape import layer_kv_sources
from lightning_oomb.engine.planner import plan
from lightning_oomb.integrations.hf import HFChunkModel
from tests.engine.test_planner import BIG_CPU, DTYPES, assert_pool_planned, second_step
from tests.helpers.distributed import run_ranks
from tests.helpers.models import (
    TINY,
    build_causal_lm,
    exact_full_sequence_loss,
    float64_norms,
    grads_of,
    max_relative_error,
)

# 6 layers (sliding, sliding, full) x 2, window 8; the last 3 reuse K/V: 3 and 4 those of layer 1, 5 those of layer 2
GEMMA4_E_LIKE = dict(
    num_hidden_layers=6,
    num_key_value_heads=2,
    head_dim=8,
    global_head_dim=16,
    hidden_size_per_layer_input=0,
    sliding_window=8,
    layer_types=["sliding_attention", "sliding_attention", "full_attention"] * 2,
    num_kv_shared_layers=3,
)


def _model(dtype=torch.float64, **overrides):
    fields = {**TINY, "pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2, **GEMMA4_E_LIKE, **overrides}
    with torch.random.fork_rng():  # the same weights in every process (a context group's ranks)
        torch.manual_seed(0)
        model = tf.AutoModelForCausalLM.from_config(tf.AutoConfig.for_model("gemma4_text", **fields)).to(
            dtype
        )
    if dtype == torch.float64:
        float64_norms(model)  # Gemma's compute in float32
    return model


def _step(model, ids, duplicated=False, **options):
    model.zero_grad()
    chunked = HFChunkModel(model, layer_checkpointing=options.pop("layer_checkpointing", False))
    if (
        duplicated
    ):  # every layer stores the K/V its call passes (as before sharing layers read their sources')
        chunked.layer_kv_sources = None
    engine = OOMBEngine(chunked, OOMBConfig(16, 8, **options))
    loss = engine.loss(ids)
    loss.backward()
    return loss.detach(), grads_of(model), engine


def test_the_sources_are_the_last_earlier_layer_of_each_type():
    assert layer_kv_sources(_model().config) == (None, None, None, 1, 1, 2)
    assert layer_kv_sources(_model(num_kv_shared_layers=0).config) is None


@pytest.mark.parametrize(
    "options",
    [
        {},
        {"layer_checkpointing": True},
        {"offload": True, "hbm_budget": 0, "staging_buffers": 3},
        {"page_budget": 2},
        {"reuse_attention": True},
        {"reuse_attention": True, "layer_checkpointing": True},
    ],
    ids=["dense", "checkpointing", "offload", "sparse", "reuse", "reuse-checkpointing"],
)
def test_shared_kv_layers_read_their_sources_pages_exactly(options):
    """Before, each sharing layer stored a copy of its source's pages. Now it stores none — it attends its source's
    pages and adds its gradients into theirs, which the source's call hands to autograd for both (the K/V are one
    tensor) — and the step equals full-sequence training in float64 (the sparse step: the same step with the pages
    duplicated, whose selections are made from the same summaries)."""
    model = _model()
    ids = torch.randint(0, 64, (2, 61), generator=torch.Generator().manual_seed(4))
    if "page_budget" in options:
        want_loss, want, _ = _step(model, ids, duplicated=True, **options)
    else:
        want_loss = exact_full_sequence_loss(model, ids)
        want_loss.backward()
        want = grads_of(model)
    loss, grads, engine = _step(model, ids, **options)
    assert abs(loss.item() - want_loss.item()) <= 1e-10 * want_loss.item()
    assert max_relative_error(grads, want) <= 1e-10
    shape = engine.pool.shape
    assert shape.aliases == (3, 4, 5) and all(shape.layer_pages(layer) == 0 for layer in shape.aliases)
    assert shape.recycling == (0,)  # the sources keep every page (their readers back-propagate first)
    if "offload" in options:
        assert engine.pool.plan.host_layers == ()  # layer 0 keeps its tails, 2 has its own geometry


def test_the_pool_drops_the_duplicates_and_the_plan_counts_it():
    model, ids = _model(), torch.randint(0, 64, (1, 64), generator=torch.Generator().manual_seed(5))
    engine = assert_pool_planned(model, OOMBConfig(16, 8), ids)
    shared = engine.pool.device_bytes
    unshared = _model(num_kv_shared_layers=0)
    duplicated = assert_pool_planned(unshared, OOMBConfig(16, 8), ids).pool.device_bytes
    assert shared < 0.6 * duplicated  # 3 layers of 6 hold no pages (the sources keep all of theirs)


@pytest.mark.parametrize("precision", ["32-true", "bf16-true", "bf16-mixed"])
def test_the_plan_counts_what_autograd_saves_for_sharing_layers(precision):
    """A sharing layer computes no K/V (no projections or norms of its own): the plan counts none (+3.5 % of what
    autograd saves in float32 when it counted them; -1.2 % now, as without sharing)."""
    model = _model(DTYPES[precision])
    config = OOMBConfig(chunk_size=32, page_size=16, loss_block=32)
    engine = OOMBEngine(HFChunkModel(model), config)
    ids = torch.randint(0, 64, (2, 96), generator=torch.Generator().manual_seed(6))
    saved, _ = second_step(engine, model, ids, precision, live=False)
    predicted = plan(engine.model, 96, 2, config, precision, None, BIG_CPU)
    assert abs(predicted.device["activations"] / saved - 1) <= 0.03, (predicted.saved, saved)


def test_a_declared_source_whose_keys_a_call_does_not_pass_is_refused():
    """A model declaring ``layer_kv_sources`` whose call passes other K/V than its source's would attend the
    source's keys silently: refused, naming both layers."""
    model = build_causal_lm("qwen2", num_hidden_layers=2)
    chunked = HFChunkModel(model)
    chunked.layer_kv_sources = (None, 0)
    engine = OOMBEngine(chunked, OOMBConfig(16, 8))
    with pytest.raises(OOMBConfigError, match="layer 1 is declared to read layer 0's pages"):
        engine.loss(torch.randint(0, 64, (1, 32)))


def _group_steps(rank, world):
    model = _model()
    ids = torch.randint(0, 64, (2, 64), generator=torch.Generator().manual_seed(7))
    results = []
    for options, duplicated in (({}, False), ({"page_budget": 2}, False), ({"page_budget": 2}, True)):
        model.zero_grad()
        chunked = HFChunkModel(model)
        if duplicated:
            chunked.layer_kv_sources = None
        engine = OOMBEngine(chunked, OOMBConfig(32, 8, **options), context=ContextGroup.of())
        loss = engine.loss(ids)
        loss.backward()
        results.append(
            {"loss": loss.detach(), "grads": grads_of(model), "aliases": engine.pool.shape.aliases}
        )
    return results


def test_shared_kv_layers_across_a_context_group(tmp_path):
    """Under context parallelism (2 ranks) each rank's sharing layers read their sources' pages too: the dense
    step equals full-sequence training, the sparse one the same step with the pages duplicated (each rank's
    gradients: its share of the group's sum)."""
    ranks = run_ranks(_group_steps, 2, tmp_path)
    model = _model()
    ids = torch.randint(0, 64, (2, 64), generator=torch.Generator().manual_seed(7))
    want_loss = exact_full_sequence_loss(model, ids)
    want_loss.backward()
    want = grads_of(model)
    dense, sparse, duplicated = zip(*ranks)
    assert all(r["aliases"] == (3, 4, 5) for r in dense + sparse) and duplicated[0]["aliases"] == ()
    for r in dense:
        assert abs(r["loss"].item() - want_loss.item()) <= 1e-10 * want_loss.item()
    summed = {n: sum(r["grads"][n] for r in dense) for n in want}
    assert max_relative_error(summed, want) <= 1e-10
    for got, twin in zip(sparse, duplicated):
        assert abs(got["loss"].item() - twin["loss"].item()) <= 1e-12 * twin["loss"].item()
        assert max_relative_error(got["grads"], twin["grads"]) <= 1e-10
