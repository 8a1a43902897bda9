"""Hybrids — attention beside gated-delta (Qwen3-Next, Qwen3.5, OLMo-Hybrid), Mamba2 (Falcon-H1, Bamba,
Nemotron-H, Granite 4), Mamba-1 (Jamba) or short-convolution (LFM2) layers, and pure Mamba2 / Mamba-1 (Mamba,
Falcon-Mamba) models — exact across chunks: each layer's state is carried from
chunk to chunk with its gradient (``lightning_oomb.engine.states``). float64 against the model's own full-sequence
training, ragged lengths, one and several chunks, with and without layer checkpointing.

Parts of these models compute in float32 whatever the model's dtype: the gated delta rule and the Mamba2 scan
(replaced by float64 oracles of the same rules, ``float64_hybrid``), ``exp(A_log)`` (and Mamba-1's ``D`` and
time-step bias) in the mixers' own forward, whose gradients are float32 sums over tokens that chunking reorders
(~1e-7: they are compared at 1e-6, every other parameter at 1e-10), and Nemotron-H's norms (compared at float32 rounding).
"""

from __future__ import annotations

import contextlib
import copy

import pytest
import torch
import transformers as tf

from lightning_oomb.engine import OOMBConfig, OOMBConfigError, OOMBEngine
from lightning_oomb.integrations.hf import HFChunkModel
from tests.helpers.lightning import oomb_step_through_trainer
from tests.helpers.models import (
    HYBRIDS,
    assert_hybrid_exact,
    build_hybrid,
    float64_hybrid,
    grads_of,
    hybrid_full_sequence,
    relative_errors,
)

SEQ = 53  # 4 chunks of 16, the last ragged


def oomb(model, ids, chunk_size: int, checkpointing: bool = False):
    engine = OOMBEngine(HFChunkModel(model, layer_checkpointing=checkpointing), OOMBConfig(chunk_size, 8))
    loss = engine.loss(ids)
    loss.backward()
    grads = grads_of(model)
    model.zero_grad()
    return loss.detach(), grads, engine


def ids_for(model, seed=0, seq=SEQ):
    vocab = model.get_output_embeddings().weight.shape[0]
    return torch.randint(0, vocab, (2, seq), generator=torch.Generator().manual_seed(seed))


FLOAT32_NORMS = ("nemotron_h",)


@pytest.mark.parametrize("family", [f for f in HYBRIDS if f not in FLOAT32_NORMS])
def test_every_carried_family_is_exact_across_chunks(family):
    with float64_hybrid(build_hybrid(family)) as model:
        ids = ids_for(model)
        want_loss, want = hybrid_full_sequence(model, ids)
        loss, grads, engine = oomb(model, ids, 16)
    assert_hybrid_exact(loss, grads, want_loss, want)
    assert engine.stats.chunks == 4


@pytest.mark.parametrize("checkpointing", [False, True])
@pytest.mark.parametrize("chunk_size", [64, 16], ids=["1-chunk", "4-chunks"])
@pytest.mark.parametrize(
    "family", ["qwen3_next", "lfm2", "falcon_h1", "mamba2", "jamba", "kimi_linear", "zaya"]
)
def test_hybrid_is_exact_through_the_trainer(family, chunk_size, checkpointing):
    with float64_hybrid(build_hybrid(family)) as model:
        ids = ids_for(model, seed=1)
        want_loss, want = hybrid_full_sequence(model, ids)
        config = OOMBConfig(chunk_size, 8, layer_checkpointing=checkpointing)
        loss, grads = oomb_step_through_trainer(model, ids, config)
    assert_hybrid_exact(loss, grads, want_loss, want)


def test_dropping_the_states_is_wrong():
    """Negative control: with the states not carried (every chunk starts from zero states, as before), the
    gradients are far off; the test above would catch it."""
    with float64_hybrid(build_hybrid("qwen3_next")) as model:
        ids = ids_for(model)
        _, want = hybrid_full_sequence(model, ids)
        adapter = HFChunkModel(model)
        adapter._mixers = []  # nothing carried
        engine = OOMBEngine(adapter, OOMBConfig(16, 8))
        engine.loss(ids).backward()
        assert max(relative_errors(grads_of(model), want).values()) > 1e-3


def test_a_mamba1_scan_restarted_from_zero_is_caught(monkeypatch):
    """Negative control: transformers' own multi-token Mamba-1 scan (each chunk from a zero state, the incoming
    state read but unused) would train silently wrong; the engine refuses the step, as no gradient reaches the
    state it read. The continued scan is what makes Mamba, Falcon-Mamba and Jamba exact."""
    from lightning_oomb.integrations.hf import selective_scan

    monkeypatch.setattr(
        selective_scan, "continued_scan", lambda scan, h0, *args, **kwargs: scan(*args, **kwargs)
    )
    model = build_hybrid("mamba")
    with pytest.raises(
        OOMBConfigError, match=r"read the carried state \(\d+, 'recurrent', 0\) but no gradient"
    ):
        oomb(model, ids_for(model), 16)


@pytest.mark.parametrize("family", ["qwen3_next", "bamba", "jamba", "kimi_linear", *FLOAT32_NORMS])
def test_chunks_add_no_error_to_transformers_own_float32_rules(family):
    """Unpatched (the rules in float32, as users train): against float64 truth, the chunked step is no less
    accurate than the model's own full-sequence step (their float32 error is the model's, not the chunking's)."""
    model = build_hybrid(family)
    ids = ids_for(model)
    _, full = hybrid_full_sequence(model, ids)
    _, chunked, _ = oomb(model, ids, 16)
    with float64_hybrid(copy.deepcopy(model)) as oracle:
        _, truth = hybrid_full_sequence(oracle, ids)
    assert (
        max(relative_errors(chunked, truth).values()) <= 2 * max(relative_errors(full, truth).values()) + 1e-9
    )


def test_states_are_kept_per_chunk_boundary_and_pages_only_for_attention_layers():
    model = build_hybrid("qwen3_next")  # 3 gated delta-net layers, 1 attention layer
    ids = ids_for(model)
    _, _, engine = oomb(model, ids, 16)
    assert engine.model.num_layers == 1 and engine.pool.shape.num_layers == 1
    mixer = model.model.layers[0].linear_attn
    recurrent = 2 * mixer.num_v_heads * mixer.head_k_dim * mixer.head_v_dim * 4  # float32 inside the rule
    conv = 2 * mixer.conv_dim * mixer.conv_kernel_size * 8
    assert engine.stats.extra["carried_state_bytes"] == 3 * 3 * (recurrent + conv)  # 3 boundaries, 3 layers


@pytest.mark.parametrize("family", ["qwen3_next", "falcon_h1", "falcon_mamba"])
def test_bf16_training_runs_and_matches_in_float32_rounding(family):
    """bf16 weights (the states in the mixers' own dtypes): the chunked step is finite and near the whole one."""
    model = build_hybrid(family, dtype=torch.bfloat16)
    ids = ids_for(model)
    want_loss, _ = hybrid_full_sequence(model, ids)
    loss, grads, _ = oomb(model, ids, 16)
    assert torch.isfinite(loss) and all(torch.isfinite(g).all() for g in grads.values())
    assert abs(loss.item() - want_loss.item()) <= 2e-2 * want_loss.item()


@pytest.mark.parametrize(
    "family", ["lfm2", "qwen3_next", "falcon_h1", "mamba"]
)  # convolution; gated delta rule; Mamba2; Mamba-1
def test_a_one_token_last_chunk_is_padded_and_exact(family):
    """49 tokens in chunks of 16 leave one token to the last chunk, which the recurrent layers would take as a
    decoding step: the engine pads a token after it (no target, seen by no real token), and the step equals
    full-sequence training of the 49."""
    with float64_hybrid(build_hybrid(family)) as model:
        ids = ids_for(model, seq=49)
        want_loss, want = hybrid_full_sequence(model, ids)
        loss, grads, engine = oomb(model, ids, 16)
    assert_hybrid_exact(loss, grads, want_loss, want)
    assert engine.stats.chunks == 4


def test_chunks_of_one_token_are_refused_before_any_allocation():
    model = build_hybrid("lfm2")
    engine = OOMBEngine(HFChunkModel(model), OOMBConfig(1, 1))
    with pytest.raises(OOMBConfigError, match="chunk_size >= 2"):
        engine.loss(ids_for(model, seq=5))
    assert engine.pool.allocated_bytes == 0
    engine.loss(ids_for(model, seq=1)).backward()  # one token in all: the first chunk, no state to continue


def test_packed_documents_are_refused_for_carried_states():
    model = build_hybrid("lfm2")
    engine = OOMBEngine(HFChunkModel(model), OOMBConfig(16, 8))
    positions = torch.cat([torch.arange(20), torch.arange(20)])[None].expand(2, -1)
    with pytest.raises(OOMBConfigError, match="packed documents"):
        engine.loss(ids_for(model, seq=40), position_ids=positions)


def test_a_recurrent_model_oomb_cannot_continue_is_refused():
    """RecurrentGemma's RG-LRU layers carry a state by a rule OOMB does not continue: refused, naming the layer."""
    config = tf.RecurrentGemmaConfig(hidden_size=32, intermediate_size=32, num_hidden_layers=3, num_attention_heads=4,
                                     num_key_value_heads=1, vocab_size=64, lru_width=32, attention_window_size=16)  # fmt: skip
    with pytest.raises(
        OOMBConfigError, match=r"RecurrentGemma\w+.*carries the states of: .*Qwen3NextGatedDeltaNet"
    ):
        HFChunkModel(tf.RecurrentGemmaForCausalLM(config))


@pytest.mark.parametrize("offload", [False, True], ids=["on-device", "offload"])
@pytest.mark.parametrize("family", list(HYBRIDS))
def test_the_planner_predicts_the_pool_and_the_carried_states_exactly(family, offload):
    """Pages only for the attention layers, and the states kept at the chunk boundaries, as measured: on the device,
    or under offload in the host buffer (the device then keeps none after the forward sweep)."""
    from lightning_oomb.engine.planner import Machine, plan

    model = build_hybrid(family, dtype=torch.float32)
    ids = ids_for(model)
    adapter = HFChunkModel(model)
    config = OOMBConfig(16, 8, offload=offload)
    engine = OOMBEngine(adapter, config)
    engine.loss(ids).backward()
    predicted = plan(adapter, SEQ, 2, config, "32-true", None, Machine("cpu", 1 << 40, 1 << 40))
    stats = engine.stats.extra
    if offload:
        assert stats["carried_state_bytes"] == 0 and stats["carried_state_host_bytes"] > 0
        assert predicted.host_tier == stats["host_pool_bytes"] + stats["carried_state_host_bytes"]
        boundaries = -(-SEQ // 16) - 1
        assert predicted.device["carried_states"] * boundaries == 2 * stats["carried_state_host_bytes"]
    else:
        assert predicted.device["carried_states"] == stats["carried_state_bytes"] > 0
        assert stats["carried_state_host_bytes"] == 0
    if engine.pool.shape is None:  # no attention layer (pure Mamba2): no pool reserved
        assert predicted.pool.num_layers == 0 and predicted.device["kv_hbm"] == 0
        return
    # Falcon-H1: attention and Mamba2 side by side in every layer; ZAYA: the carried states inside attention
    every_layer_attends = family in ("falcon_h1", "zaya")
    assert predicted.pool.num_layers == engine.pool.shape.num_layers
    assert engine.pool.shape.num_layers < model.config.num_hidden_layers or every_layer_attends
    assert predicted.device["kv_hbm"] == engine.pool.device_bytes


@pytest.mark.parametrize("options", [{"offload": True, "hbm_budget": 0, "staging_buffers": 2}, {"page_budget": 1}],
                         ids=["offload", "sparse-full-budget-check"])  # fmt: skip
def test_hybrid_attention_layers_offload_and_go_sparse(options):
    """The attention layers' pages stream from the host tier (every attention layer there) exactly as without
    offload; a page budget runs sparse attention beside the carried states."""
    with float64_hybrid(
        build_hybrid("qwen3_5_text")
    ) as model:  # attention layer at index 2 of 4: pool layer 0
        ids = ids_for(model)
        want_loss, want = hybrid_full_sequence(model, ids)
        engine = OOMBEngine(HFChunkModel(model), OOMBConfig(16, 8, **options))
        loss = engine.loss(ids)
        loss.backward()
        grads = grads_of(model)
    if "offload" in options:
        assert engine.stats.extra["host_layers"] == 1 and engine.stats.extra["h2d_bytes"] > 0
        assert engine.stats.extra["carried_state_host_bytes"] > 0  # the states waited in the host buffer
        assert_hybrid_exact(loss.detach(), grads, want_loss, want)
    else:  # sparse: a different (masked) function, but finite and with every gradient
        assert engine.stats.sparse is not None and torch.isfinite(loss)
        assert set(grads) == set(want)


def test_right_padding_is_exact():
    """Padded positions come after a row's tokens: the states the real tokens see are the whole sequence's."""
    with float64_hybrid(build_hybrid("qwen3_next")) as model:
        ids = ids_for(model)
        mask = torch.ones_like(ids)
        mask[1, 40:] = 0
        want_loss, want = hybrid_full_sequence(model, ids, ids.masked_fill(mask == 0, -100))
        loss = OOMBEngine(HFChunkModel(model), OOMBConfig(16, 8)).loss(ids, attention_mask=mask)
        loss.backward()
        assert_hybrid_exact(loss.detach(), grads_of(model), want_loss, want)


def test_no_chunk_state_outlives_its_backward_under_checkpointing():
    """HF's layer checkpoint keeps its call's arguments (the chunk's context, hence its states) in the graph that
    the chunk's outgoing states hold: a cycle through autograd that Python's collector cannot see. The engine breaks
    it after each chunk's backward; before, the sweep kept every chunk's convolution inputs alive (O(N))."""
    import gc

    from lightning_oomb.engine.states import ChunkStates

    model = build_hybrid("qwen3_5_text", dtype=torch.float32)
    oomb(model, ids_for(model), 16, checkpointing=True)
    gc.collect()
    assert not [o for o in gc.get_objects() if isinstance(o, ChunkStates) and o.reported]


@pytest.mark.parametrize("family", ["lfm2", "falcon_h1"])
def test_autocast_adds_no_error_with_carried_states(family):
    """``bf16-mixed``: the convolution states come out of autocast in bf16, the recurrent ones in float32; against
    float32 truth the chunked step is about as accurate as the model's own autocast step (within 2x: the worst
    gradient, Falcon-H1's Mamba ``dt_bias``, is 25-35 % off in the model's own step, and chunking moves where bf16
    rounds — 1.5x on torch 2.11, 1.2x on 2.13). (The tiny random Qwen3-Next is too ill-conditioned in bf16 to tell:
    its own autocast step is 5.8x off.)"""
    model = build_hybrid(family, dtype=torch.float32)
    ids = ids_for(model)
    _, truth = hybrid_full_sequence(model, ids)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        _, own = hybrid_full_sequence(model, ids)
        _, chunked, engine = oomb(model, ids, 16)
    assert engine.stats.extra["carried_state_bytes"] > 0
    assert max(relative_errors(chunked, truth).values()) <= 2 * max(relative_errors(own, truth).values())


@pytest.mark.parametrize("family", list(HYBRIDS))
def test_the_self_check_trains_every_hybrid_in_chunks(family):
    """The twin runs the gated delta rule / Mamba2 scan in float64 (transformers computes them in float32, whose
    rounding differs between chunkings by up to 4e-2): every hybrid is checked in chunks, and passes."""
    from lightning_oomb.integrations.hf.support import verify_exactness

    assert verify_exactness(build_hybrid(family, dtype=torch.float32), HFChunkModel) is True


@pytest.mark.parametrize(
    "family", ["qwen3_next", "falcon_h1", "lfm2", "kimi_linear"]
)  # gated delta rule, Mamba2, convolution, Kimi's delta rule
def test_the_self_check_refuses_a_hybrid_whose_states_are_dropped(family, monkeypatch):
    from lightning_oomb.integrations.hf import adapter, support

    monkeypatch.setattr(adapter, "carrying_states", lambda mixers, states: contextlib.nullcontext())
    monkeypatch.setattr(support, "_verdicts", {})
    with pytest.raises(OOMBConfigError, match="relative error of .* between three chunks and one"):
        support.verify_exactness(build_hybrid(family, dtype=torch.float32), HFChunkModel)


def test_the_self_check_names_a_hybrids_head_that_oomb_misreads(monkeypatch):
    """Falcon-H1 multiplies its logits by ``lm_head_multiplier`` (the families' tests above run with 0.5): a scale
    OOMB would miss is refused by the head's probe, which runs first and names the head."""
    from lightning_oomb.integrations.hf import adapter, support

    model = build_hybrid("falcon_h1", dtype=torch.float32)
    assert support.logit_transform(model.config) == (0.5, None)
    monkeypatch.setattr(adapter, "logit_transform", lambda config: (1.0, None))  # the multiplier not read
    monkeypatch.setattr(support, "_verdicts", {})
    with pytest.raises(OOMBConfigError, match="LM head makes other logits.*relative error of 5.0e-01"):
        support.verify_exactness(model, adapter.HFChunkModel)
