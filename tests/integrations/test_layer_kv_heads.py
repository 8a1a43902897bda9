"""Layers with their own KV heads and head dims (Gemma 4: global layers of wider heads, and in its 31B and
26B-A4B — ``attention_k_eq_v`` — fewer, ``num_global_key_value_heads``, beside sliding layers with more): each
layer's pages at its own geometry, exact."""

import dataclasses

import pytest
import torch
import transformers as tf

from lightning_oomb.engine import OOMBConfig, OOMBEngine
from lightning_oomb.engine.kv_pool import place_layers
from lightning_oomb.engine.pages import PoolShape, arena_bytes
from lightning_oomb.integrations.hf import HFChunkModel
from tests.helpers.models import TINY, exact_full_sequence_loss, float64_norms, grads_of, max_relative_error

# 4 sliding layers of 2 KV heads x 8 and 2 global ones of 1 KV head x 16 (keys are values there), window 8
GEMMA4_31B_LIKE = dict(
    num_hidden_layers=6,
    num_key_value_heads=2,
    num_global_key_value_heads=1,
    attention_k_eq_v=True,
    head_dim=8,
    global_head_dim=16,
    hidden_size_per_layer_input=0,
    sliding_window=8,
    layer_types=["sliding_attention", "sliding_attention", "full_attention"] * 2,
)


def _model():
    fields = {**TINY, "pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2, **GEMMA4_31B_LIKE}
    model = tf.AutoModelForCausalLM.from_config(tf.AutoConfig.for_model("gemma4_text", **fields)).double()
    float64_norms(model)  # Gemma's compute in float32
    return model


def _step(model, ids, **options):
    model.zero_grad()
    chunked = HFChunkModel(model, layer_checkpointing=options.pop("layer_checkpointing", False))
    engine = OOMBEngine(chunked, OOMBConfig(16, 8, **options))
    loss = engine.loss(ids)
    loss.backward()
    return loss.detach(), grads_of(model), engine


@pytest.mark.parametrize(
    "options",
    [
        {},
        {"layer_checkpointing": True},
        {
            "offload": True,
            "hbm_budget": 0,
            "staging_buffers": 3,
        },  # the global layers' pages stream from the host
        {"page_budget": 2},  # sparse: the summaries at each layer's own heads
        {"reuse_attention": True},
    ],
    ids=["dense", "checkpointing", "offload", "sparse", "reuse"],
)
def test_layers_with_their_own_kv_heads_train_exactly(options):
    """Before, such a model was refused ("its layers differ in num_key_value_heads"): the pool had one page shape.
    Now each layer's pages hold its own heads and head dim — the sliding layers (2 heads of 8) keep only their
    window's tails on the device, the global ones (1 head of 16, the pool's slots) may stream from host memory — and
    a step equals full-sequence training in float64 (the sparse step: its own dense twin, with a budget past every
    page)."""
    model = _model()
    ids = torch.randint(0, 64, (2, 61), generator=torch.Generator().manual_seed(3))
    if "page_budget" in options:  # a budget past every page attends densely: the same as the dense step
        want_loss, want, _ = _step(model, ids, page_budget=64)
    else:
        want_loss = exact_full_sequence_loss(model, ids)
        want_loss.backward()
        want = grads_of(model)
    loss, grads, engine = _step(model, ids, **options)
    pool = engine.pool
    assert pool.shape.layer_kv_heads == (2, 2, 1, 2, 2, 1) and pool.shape.kv_heads == 1
    assert pool.shape.layer_head_dims == (8, 8, 16, 8, 8, 16) and pool.shape.head_dim == 16
    assert pool.shape.recycling == (0, 1, 3, 4)  # the window layers keep only their tails
    if "offload" in options:
        assert pool.plan.host_layers == (2, 5)
    if "page_budget" in options:
        loss, grads, _ = _step(model, ids, page_budget=64)  # (its selection is checked by the sparse suite)
    assert abs(loss.item() - want_loss.item()) <= 1e-10 * abs(want_loss.item())
    assert max_relative_error(grads, want) <= 1e-10


def test_each_layer_takes_the_slots_of_its_own_heads():
    """A layer of ``h`` KV heads takes ``h / kv_heads`` of a slot per page (rounded up per layer); the device-only
    layers are the window layers and those of other heads; the bytes are what the arenas allocate."""
    shape = PoolShape(4, 2, 64, 1, 16, 8, 16, dtype=torch.float32, windows=(None, 8, None, None),
                      layer_kv_heads=(1, 4, 1, 2))  # fmt: skip
    assert shape.device_only == (1, 3)
    # layer 1: 3 tails and a chunk's 2 pages, 2 rows, 4 heads
    assert [shape.hbm_slots_of(layer) for layer in range(4)] == [16, 4 * (3 + 2) * 2, 16, 32]
    everything = sum(map(shape.bytes_of, range(4)))
    placed, plan, _ = place_layers(shape, everything, staging_buffers=2)
    assert placed == shape and plan.host_layers == ()  # every page fits: the tails stay on the device
    # short of that, the window layer's tails wait in host memory first: a ring of two tail groups stays
    hosted = dataclasses.replace(shape, host_tails=True)
    assert hosted.hbm_slots_of(1) == 4 * (2 + 2) * 2
    budget = (
        hosted.bytes_of(1) + shape.bytes_of(3) + shape.layer_bytes + 2 * shape.block_bytes
    )  # 1 full layer
    placed, plan, slots = place_layers(shape, budget, staging_buffers=2)
    assert placed.hosted_tails == (1,) and plan.host_layers == (2,) and plan.hbm_layers == (0, 1, 3)
    assert slots["hbm"] == 16 + 32 + 32
    assert arena_bytes(slots["hbm"], placed) == sum(map(placed.bytes_of, plan.hbm_layers))
    assert (
        placed.tail_host_bytes == 2 * 2 * 3 * (4 * 8 * 16) * 4
    )  # K and V, 2 rows, 3 tails, 4 heads, float32


@pytest.mark.parametrize(
    ("heads", "dims", "windows", "want"),
    [
        (
            (16, 16, 4, 16, 16, 4),
            (256, 256, 512) * 2,
            (1024, 1024, None) * 2,
            (4, 512),
        ),  # Gemma 4 31B: global
        ((8, 8, 4, 4, 4), (64,) * 5, None, (4, 64)),  # no windows: the most layers'
        ((2, 4), (16, 16), (8, 8), (4, 16)),  # every layer a window layer: a tie, the larger
    ],
)
def test_the_slots_take_the_geometry_of_the_full_layers(heads, dims, windows, want):
    shape = PoolShape.for_layers(1, 64, heads, dims, dims, 8, windows, chunk_size=16)
    assert (shape.kv_heads, shape.head_dim) == want


@pytest.mark.parametrize(
    "options", [{}, {"offload": True, "hbm_budget": 0, "staging_buffers": 3}], ids=["device", "offload"]
)
def test_the_plan_counts_each_layers_pages_at_its_own_heads(options):
    """The memory plan's pool is the pool's, byte for byte, from the config, the model or its adapter."""
    from tests.engine.test_planner import assert_pool_planned

    assert_pool_planned(_model(), OOMBConfig(16, 8, **options), torch.randint(0, 64, (2, 61)))


@pytest.mark.parametrize("precision", ["32-true", "bf16-true"])
def test_activations_are_planned_at_each_layers_own_heads(precision):
    """Without checkpointing the sliding layers' K/V (4 heads here, beside the global layers' 1) were planned at
    the global layers' heads: -8.5 % (float32) and -9.0 % (bfloat16) of what autograd saves; -0.7 % and -1.8 %
    now."""
    from tests.engine.test_planner import measure

    def build(family, dtype, vocab_size):
        fields = {**TINY, "pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2, **GEMMA4_31B_LIKE}
        fields.update(vocab_size=vocab_size, hidden_size=64, num_attention_heads=8, num_key_value_heads=4)
        return tf.AutoModelForCausalLM.from_config(tf.AutoConfig.for_model(family, **fields)).to(dtype)

    predicted, measured, _ = measure("gemma4_text", precision, False, 32, seq_len=96, vocab=64, build=build)
    assert abs(predicted.device["activations"] / measured - 1) <= 0.03, (predicted.saved, measured)


def _shared_summaries_step(rank, world):
    """A sparse step of two context-parallel ranks: the bytes of every layer's shared summaries on this rank."""
    from lightning_oomb.engine import context as cp
    from lightning_oomb.engine.context import ContextGroup

    made, init = [], cp.SharedSummaries.__init__

    def spy(self, score):
        init(self, score)
        made.append(self)

    cp.SharedSummaries.__init__ = spy
    try:
        model = _model()
        engine = OOMBEngine(HFChunkModel(model), OOMBConfig(16, 8, page_budget=2), context=ContextGroup.of())
        engine.loss(torch.randint(0, 64, (2, 61), generator=torch.Generator().manual_seed(5))).backward()
    finally:
        cp.SharedSummaries.__init__ = init
    return {"layers": {layer: t.nbytes for s in made for layer, t in s.pages.items()}}


def test_context_parallel_summaries_are_planned_at_each_layers_own_heads(tmp_path):
    """Under context parallelism every rank keeps every page's summary, each layer's at its own KV heads and head
    dim (``context.SharedSummaries``): the plan counted every layer at the widest layer's (2 KV heads of 16 here,
    where the sliding layers have 2 of 8 and the global ones 1 of 16: 49,152 bytes planned, 24,576 held, 2x); now
    each layer's, byte for byte."""
    from lightning_oomb.engine.planner import plan
    from tests.helpers.distributed import run_ranks

    results = run_ranks(_shared_summaries_step, 2, tmp_path)
    held = [sum(r["layers"].values()) for r in results]
    assert len(results[0]["layers"]) == 6 and held[0] == held[1]
    planned = plan(_model(), 61, 2, OOMBConfig(16, 8, page_budget=2), "64-true", None, "cpu", host_memory=2**40,
                   context_parallel=2)  # fmt: skip
    assert planned.device["page_summaries"] == held[0]
