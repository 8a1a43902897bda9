"""The HF adapter: refusals at setup, attention switched only inside OOMB calls, bad calls."""

from __future__ import annotations

import pytest
import torch
import transformers as tf

from lightning_oomb.engine import OOMBConfig, OOMBConfigError, OOMBEngine
from lightning_oomb.integrations.hf import HFChunkModel, register_attention, set_layer_checkpointing
from lightning_oomb.integrations.hf.attention import RUNNING
from tests.helpers.models import (
    build_causal_lm,
    exact_full_sequence_loss,
    float64_norms,
    grads_of,
    max_relative_error,
    oomb_step,
)

TINY = dict(hidden_size=32, intermediate_size=32, num_hidden_layers=1, num_attention_heads=4, vocab_size=64)


def unsupported_models():
    """Each with the feature OOMB cannot chunk exactly (hybrids used to be accepted and train silently wrong; those
    whose states OOMB carries are exact: tests/integrations/test_hybrids.py)."""
    yield "attention_dropout", build_causal_lm("qwen2", attention_dropout=0.1)
    yield (
        "MiniMaxLightningAttention",  # lightning attention: a linear-attention state OOMB does not carry
        tf.MiniMaxForCausalLM(
            tf.MiniMaxConfig(
                **{**TINY, "num_hidden_layers": 2},
                num_key_value_heads=2,
                head_dim=8,
                num_local_experts=2,
                layer_types=["linear_attention", "full_attention"],
            )
        ),  # fmt: skip
    )
    indexed = build_causal_lm(
        "llama"
    )  # a layer type OOMB does not know (DeepSeek-V3.2's top-k key selection)
    indexed.config.layer_types = ["indexed_attention", "full_attention"]
    yield "indexed_attention", indexed


@pytest.mark.parametrize(("reason", "model"), list(unsupported_models()), ids=lambda x: str(x)[:20])
def test_unsupported_models_are_refused_with_the_reason(reason, model):
    with pytest.raises(OOMBConfigError, match=reason) as err:
        HFChunkModel(model)
    assert "another strategy" in str(err.value)


@pytest.mark.parametrize(
    ("family", "match"),
    [
        ("diffllama", r"twice with layer=\d+ in one chunk"),  # attends twice per layer
        ("bert", r"parameters that get no gradient through OOMB \(cls\.predictions"),  # a head OOMB skips
    ],
)
def test_the_self_check_refuses_what_the_reading_misses(family, match):
    """Architectures that pass every static rule but would train wrongly: the float64 twin finds it and names the
    measured error — by default, as the strategies do (the engine's adapter skipped it: the README's engine-only
    snippet trained them silently wrong); without the check they are accepted."""
    overrides = (
        {"is_decoder": True, "attention_probs_dropout_prob": 0.0}
        if family == "bert"
        else {"num_key_value_heads": 2}
    )
    config = tf.AutoConfig.for_model(family, **TINY, **overrides)
    model = tf.AutoModelForCausalLM.from_config(config)
    HFChunkModel(model, verify_exactness=False)  # the static rules see nothing wrong
    with pytest.raises(OOMBConfigError, match="self-check.*" + match):
        HFChunkModel(model)


def test_the_self_check_accepts_the_exact_families():
    """Including models whose exact gradient of a key bias is zero (rounding noise on both sides): OPT, BioGPT."""
    for family in ("qwen2", "llama", "mistral", "qwen3"):
        HFChunkModel(build_causal_lm(family, dtype=torch.float32), verify_exactness=True)
    for family in ("opt", "biogpt"):
        config = tf.AutoConfig.for_model(
            family, **TINY, ffn_dim=32, word_embed_proj_dim=32, attention_probs_dropout_prob=0.0
        )
        HFChunkModel(tf.AutoModelForCausalLM.from_config(config), verify_exactness=True)


def newer_family(name: str, **config):
    """A tiny model of transformers family ``name`` (skipped where this transformers lacks it)."""
    if name not in tf.models.auto.modeling_auto.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        pytest.skip(f"transformers {tf.__version__} has no {name}")
    fields = dict(**TINY, pad_token_id=0, bos_token_id=1, eos_token_id=2, attention_dropout=0.0)
    return tf.AutoModelForCausalLM.from_config(tf.AutoConfig.for_model(name, **{**fields, **config}))


@pytest.mark.parametrize(
    ("name", "config", "match"),
    [
        ("biogpt", dict(attention_probs_dropout_prob=0.1), "attention_probs_dropout_prob=0.1"),
        (
            "dory",
            dict(num_key_value_heads=2, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16),
            r"LM head \(DoryLMHead\) is not a plain linear layer",
        ),  # its own learnable logit scale  # fmt: skip
        ("falcon", dict(alibi=True, ffn_hidden_size=32), r"ALiBi position biases .*alibi=True"),  # Falcon-RW
    ],
)
def test_more_unsupported_models_are_refused_before_any_work(name, config, match):
    with pytest.raises(OOMBConfigError, match=match):
        HFChunkModel(newer_family(name, **config))


def test_a_drafter_that_reads_its_main_models_states_is_refused():
    """Gemma 4's unified assistant was accepted and failed at the first step with transformers' own error (its
    sibling ``gemma4_assistant``, refused by the same rule, has no default config that builds)."""
    name = "gemma4_unified_assistant"
    if name not in tf.models.auto.modeling_auto.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        pytest.skip(f"transformers {tf.__version__} has no {name}")
    try:
        with torch.device("meta"):  # its default size, allocating nothing
            model = tf.AutoModelForCausalLM.from_config(tf.AutoConfig.for_model(name))
    except AttributeError as err:  # transformers 5.17 cannot build its default config (no text vocab_size)
        pytest.skip(f"transformers {tf.__version__} cannot build {name}'s default config: {err}")
    with pytest.raises(
        OOMBConfigError, match="speculative-decoding drafter: its forward reads its main model's"
    ):
        HFChunkModel(model)


# float64: eager experts (grouped matmuls refuse it)
MLA = dict(num_hidden_layers=2, num_key_value_heads=4, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=4,
           head_dim=4, n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=16, first_k_dense_replace=1,
           experts_implementation="eager")  # fmt: skip


@pytest.mark.parametrize("checkpointing", [False, True])
@pytest.mark.parametrize(
    ("name", "config"),
    [
        ("stablelm", dict(num_key_value_heads=2, use_parallel_residual=True, qk_layernorm=True)),
        ("nemotron", dict(num_key_value_heads=2)),
        ("deepseek_v3", dict(MLA, q_lora_rank=16, v_head_dim=8, n_group=1, topk_group=1)),
        ("deepseek_v2", dict(MLA, q_lora_rank=None, v_head_dim=16)),
        (
            "gemma4_text",
            dict(
                num_hidden_layers=3,
                num_key_value_heads=2,
                head_dim=8,
                global_head_dim=16,
                hidden_size_per_layer_input=0,
                sliding_window=8,
                layer_types=["sliding_attention", "full_attention", "sliding_attention"],
            ),
        ),
        (
            "minicpm3",
            dict(
                num_key_value_heads=4,
                kv_lora_rank=16,
                q_lora_rank=16,
                qk_nope_head_dim=8,
                qk_rope_head_dim=4,
                head_dim=4,
                v_head_dim=8,
                dim_model_base=8,
                scale_emb=3.0,
            ),
        ),
    ],
)
def test_attention_the_adapter_routes_or_pads_is_exact(name, config, checkpointing):
    """StableLM's and Nemotron's decoder layers call attention without the keywords that carry the chunk context:
    the attention module finds its model's running chunk instead (also in a checkpoint's recompute). DeepSeek's
    multi-head latent attention has keys of 12 and values of 8 (V3, MiniCPM3: its logits divided by
    logits_scaling) or 16 (V2) per head: both are zero-padded to the wider (float64; DeepSeek's router computes in
    float32, so its weight's gradient matches to 1e-6). Gemma 4's full-attention layers have heads of 16 beside
    its sliding layers' 8: each layer's pages hold its own (tests/integrations/test_layer_kv_heads.py)."""
    model = newer_family(name, **config).double()
    float64_norms(model)  # Gemma's compute in float32
    ids = torch.randint(0, 64, (2, 37), generator=torch.Generator().manual_seed(2))
    want_loss = exact_full_sequence_loss(model, ids)
    want_loss.backward()
    want = grads_of(model)
    loss, grads, _ = oomb_step(model, ids, checkpointing, chunk=16, page=8)
    assert abs(loss.item() - want_loss.item()) <= 1e-10 * want_loss.item()
    routers = {n for n in want if n.endswith("mlp.gate.weight")}
    assert max_relative_error({n: grads[n] for n in want if n not in routers},
                              {n: want[n] for n in want if n not in routers}) <= 1e-10  # fmt: skip
    assert (
        not routers
        or max_relative_error({n: grads[n] for n in routers}, {n: want[n] for n in routers}) <= 1e-6
    )
    assert not RUNNING  # nothing left registered after the step


def test_keys_of_another_shape_than_the_config_declares_are_refused():
    """GPT-NeoX ignores a ``num_key_value_heads`` in its config (its K/V have every head): named, not a raw
    ``index_copy_`` error from the page pool."""
    model = tf.GPTNeoXForCausalLM(tf.GPTNeoXConfig(**TINY, num_key_value_heads=2, attention_dropout=0.0))
    with pytest.raises(OOMBConfigError, match="keys of 4 heads.*declared 2 KV heads"):
        OOMBEngine(HFChunkModel(model), OOMBConfig(16, 8)).loss(torch.randint(0, 64, (1, 20)))


def test_non_hf_module_is_refused():
    with pytest.raises(OOMBConfigError, match="AutoModelForCausalLM"):
        HFChunkModel(torch.nn.Linear(2, 2))


def test_attention_is_oomb_only_inside_engine_calls():
    model = build_causal_lm("qwen2", dtype=torch.float32)
    engine = OOMBEngine(HFChunkModel(model), OOMBConfig(16, 8))
    ids = torch.randint(0, 97, (1, 40))
    engine.loss(ids).backward()
    assert model.config._attn_implementation == "sdpa"
    model(input_ids=ids)  # ordinary use of the model keeps working


def test_oomb_attention_outside_a_step_says_what_to_do():
    register_attention()
    model = build_causal_lm("llama", dtype=torch.float32, attn_implementation="oomb")
    with pytest.raises(OOMBConfigError, match="attn_implementation='sdpa'"):
        model(input_ids=torch.randint(0, 97, (1, 8)))


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        (dict(chunk_size=100, page_size=64), "multiple of page_size"),
        (dict(chunk_size=4090, page_size=128), r"use e\.g\. chunk_size=4096\.$"),  # the nearest multiple
        (dict(page_size=0), "positive integer"),
        (dict(kv_grad_dtype="float16"), "kv_grad_dtype"),
        (dict(attention_backend="cuda"), "backend"),
    ],
)
def test_bad_config_is_rejected(kwargs, match):
    with pytest.raises(OOMBConfigError, match=match):
        OOMBConfig(**kwargs)


def test_no_target_tokens_give_zero_loss_and_zero_gradients():
    model = build_causal_lm("qwen2")
    engine = OOMBEngine(HFChunkModel(model), OOMBConfig(16, 8))
    ids = torch.randint(0, 97, (1, 24))
    loss = engine.loss(ids, torch.full_like(ids, -100))
    loss.backward()
    assert loss.item() == 0.0
    assert all((p.grad == 0).all() for p in model.parameters() if p.grad is not None)


@pytest.mark.parametrize(
    ("labels", "match"),
    [
        (-1, r"labels contain \[-1\].*\[0, 97\) or -100"),
        (97, r"labels contain \[97\]"),
        (-7, r"labels contain \[-7\]"),
    ],
)
def test_labels_outside_the_vocabulary_are_refused_before_any_work(labels, match):
    """HF raises for such labels; silently training them as another token would be wrong."""
    engine = OOMBEngine(HFChunkModel(build_causal_lm("qwen2")), OOMBConfig(16, 8))
    ids = torch.randint(0, 97, (1, 24))
    bad = ids.clone()
    bad[0, 20] = labels
    with pytest.raises(OOMBConfigError, match=match):
        engine.loss(ids, bad)
    assert engine.pool.allocated_bytes == 0


def test_token_ids_outside_the_embedding_are_refused_before_any_work():
    engine = OOMBEngine(HFChunkModel(build_causal_lm("qwen2")), OOMBConfig(16, 8))
    ids = torch.randint(0, 97, (1, 40))
    ids[0, 30] = 97  # in the last chunk: without the check, chunk 1 would have run first
    with pytest.raises(
        OOMBConfigError, match=r"input_ids contain \[97\] outside the model's embedding \[0, 97\)"
    ):
        engine.loss(ids)
    with pytest.raises(OOMBConfigError, match="input_ids contain"):
        engine.evaluate(-ids)
    assert engine.pool.allocated_bytes == 0


@pytest.mark.parametrize(
    ("ids", "labels", "match"),
    [((1, 0), None, r"non-empty int64 \(or int32\) tensor"), ((40,), None, "non-empty int64"),
     ("float", None, r"int64 \(or int32\) tensor.*\.long\(\)"), ("int16", None, r"got \(1, 40\) torch.int16"),
     ((1, 40), "float", r"labels are torch.float32 .*int64 \(or int32\) labels"),
     ((1, 40), (1, 30), r"labels \(1, 30\) do not match input_ids \(1, 40\).*one label per input token")],
)  # fmt: skip
def test_malformed_batches_are_refused_before_any_work(ids, labels, match):
    """Float, int16, empty or unbatched ids, float or misshapen labels: named errors, not one from deep inside
    (float labels read "do not match input_ids", int16 ids "must be an integer tensor")."""
    engine = OOMBEngine(HFChunkModel(build_causal_lm("qwen2")), OOMBConfig(16, 8))
    tokens = {"float": torch.randn(1, 8), "int16": torch.randint(0, 97, (1, 40), dtype=torch.int16)}.get(ids)
    tokens = torch.randint(0, 97, ids) if tokens is None else tokens
    if labels == "float":
        labels = tokens.float()
    elif labels is not None:
        labels = torch.randint(0, 97, labels)
    with pytest.raises(OOMBConfigError, match=match):
        engine.loss(tokens, labels)
    assert engine.pool.allocated_bytes == 0


@pytest.mark.parametrize("checkpointing_before", [False, True])
def test_layer_checkpointing_is_on_only_while_the_engine_runs(checkpointing_before):
    model = build_causal_lm("qwen2")
    if checkpointing_before:  # the user's own choice is kept
        set_layer_checkpointing(model, True)
    adapter = HFChunkModel(model, layer_checkpointing=True)
    seen = []
    model.model.layers[0].register_forward_pre_hook(lambda m, a: seen.append(m.gradient_checkpointing))
    engine = OOMBEngine(adapter, OOMBConfig(16, 8, layer_checkpointing=True))
    engine.loss(torch.randint(0, 97, (1, 24))).backward()
    assert seen and all(seen)
    assert any(getattr(m, "gradient_checkpointing", False) for m in model.modules()) == checkpointing_before
    assert model.config._attn_implementation == "sdpa"


@pytest.mark.parametrize("input_grads_before", [False, True])
def test_layer_checkpointing_leaves_the_input_embeddings_hooks_as_they_were(input_grads_before):
    """transformers' checkpointing switch adds ``enable_input_require_grads``' hook on the embedding every time it
    turns on and takes it off only for peft models: two more per step piled up (8, 24, 48 after 4, 8, 12 steps)
    and the model no longer pickled. The user's own hook (``enable_input_require_grads`` before) stays."""
    import pickle

    model = build_causal_lm("qwen2")
    if input_grads_before:
        model.enable_input_require_grads()
    embedding, handles = model.get_input_embeddings(), dict(model.__dict__)
    hooks = dict(embedding._forward_hooks)
    engine = OOMBEngine(
        HFChunkModel(model, layer_checkpointing=True), OOMBConfig(16, 8, layer_checkpointing=True)
    )
    for _ in range(3):
        engine.loss(torch.randint(0, 97, (1, 40))).backward()
    assert dict(embedding._forward_hooks) == hooks
    assert {a: model.__dict__.get(a) for a in ("_require_grads_hooks", "_require_grads_hook")} == {
        a: handles.get(a) for a in ("_require_grads_hooks", "_require_grads_hook")
    }
    if not input_grads_before:  # (transformers' hook is a local function: a model holding it does not pickle)
        pickle.dumps(model)


def test_generation_inside_a_managed_call_says_where_it_belongs():
    adapter = HFChunkModel(build_causal_lm("qwen2", dtype=torch.float32))
    answering = adapter.answer_calls(lambda ids, labels: ids.sum().float())
    with answering, pytest.raises(OOMBConfigError, match="generate in predict_step"):
        adapter.model.generate(torch.randint(0, 97, (1, 5)), max_new_tokens=2, do_sample=False)
    assert adapter.model.generate(torch.randint(0, 97, (1, 5)), max_new_tokens=2, do_sample=False).shape == (
        1,
        7,
    )


def test_options_that_change_nothing_warn_once():
    model = build_causal_lm("qwen2", dtype=torch.float32)
    engine = OOMBEngine(HFChunkModel(model), OOMBConfig(16, 8, offload=True, kv_grad_dtype="bfloat16"))
    with pytest.warns(UserWarning) as caught:
        for _ in range(2):
            engine.loss(torch.randint(0, 97, (1, 24))).backward()
    messages = [str(w.message) for w in caught if "has no effect" in str(w.message)]
    assert len(messages) == 2  # one each, not one per step
    assert any("offload=True has no effect on a cpu device" in m for m in messages)
    assert any("kv_grad_dtype='bfloat16' has no effect with torch.float32 K/V" in m for m in messages)
    # a budget for the pages' device memory without offload
    engine = OOMBEngine(HFChunkModel(model), OOMBConfig(16, 8, offload=False, hbm_budget=1 << 20))
    with pytest.warns(
        UserWarning, match=r"hbm_budget=1048576 has no effect with offload=False.*offload=True"
    ):
        engine.loss(torch.randint(0, 97, (1, 24))).backward()


def test_full_layers_declare_no_window_even_if_the_module_keeps_the_attribute():
    """EXAONE 4 keeps ``sliding_window`` on every attention module and passes it only on sliding layers: the
    config's ``layer_types`` decides, and the chunked loss equals one chunk's (it used to be refused)."""
    config = tf.Exaone4Config(**{**TINY, "num_hidden_layers": 4}, num_key_value_heads=2, sliding_window=4,
                              layer_types=["sliding_attention"] * 3 + ["full_attention"])  # fmt: skip
    model = tf.Exaone4ForCausalLM(config).double()
    adapter = HFChunkModel(model)
    assert adapter.layer_windows == (4, 4, 4, None)
    ids = torch.randint(0, 64, (1, 40), generator=torch.Generator().manual_seed(0))
    whole = OOMBEngine(HFChunkModel(model), OOMBConfig(64, 8)).evaluate(ids)
    assert OOMBEngine(adapter, OOMBConfig(16, 8)).evaluate(ids).item() == pytest.approx(
        whole.item(), rel=1e-12
    )


def test_the_self_checks_twin_keeps_a_logit_softcap():
    """SDPA drops Gemma 2's attention-logit softcap in transformers 5.17 (the twin's own training would then be
    wrong and refuse an exact model): a soft-capped twin attends eagerly."""
    from lightning_oomb.integrations.hf.support import _twin
    from tests.helpers.models import build_family

    assert _twin(build_family("gemma2"))[0].config._attn_implementation == "eager"
    assert _twin(build_causal_lm("qwen2"))[0].config._attn_implementation == "sdpa"


def test_the_engines_layer_checkpointing_option_reaches_the_adapter():
    """``OOMBConfig(layer_checkpointing=True)`` checkpoints the layers without also passing it to the adapter
    (before, only ``HFChunkModel(..., layer_checkpointing=True)`` did, and the plan counted what did not happen)."""
    model = build_causal_lm("qwen2")
    seen = []
    model.model.layers[0].register_forward_pre_hook(lambda m, a: seen.append(m.gradient_checkpointing))
    engine = OOMBEngine(HFChunkModel(model), OOMBConfig(16, 8, layer_checkpointing=True))
    engine.loss(torch.randint(0, 97, (1, 24))).backward()
    assert seen and all(seen)
    seen.clear()
    OOMBEngine(HFChunkModel(model), OOMBConfig(16, 8)).loss(torch.randint(0, 97, (1, 24))).backward()
    assert seen and not any(seen)


def _published_shape(name: str):
    """A model of ``name`` at its default (published-size) config, on the meta device: nothing allocated."""
    with torch.device("meta"):
        return tf.AutoModelForCausalLM.from_config(tf.AutoConfig.for_model(name))


@pytest.mark.parametrize("family", ["gpt_neox", "gptj", "helium", "glm", "falcon", "gemma3n_text", "mllama"])
def test_the_self_check_runs_on_full_size_configs(family):
    """The twin shrinks full-size configs to a trainable tiny width: heads under other names (GPT-NeoX's 64 heads
    of 44 layers, GPT-J's ``n_head``), the rotated share of a head (``rotary_dim``), a width that is the heads'
    total (Helium), many query heads per KV head (GLM's 16:1; Falcon's 71:1 as 16:1, else 568 wide and unchecked),
    per-layer widths (Gemma 3n) — so the check runs
    rather than being skipped; and it passes: Mllama's text model too, whose ``get_decoder()`` returns the causal
    LM itself (the adapter drives its inner model)."""
    from lightning_oomb.integrations.hf.adapter import verify_exactness_of

    model = _published_shape(family)
    if not type(model)._can_set_attn_implementation():  # GPT-J before transformers 5.24: refused, rightly
        pytest.skip(
            f"transformers {tf.__version__}'s {family} attention does not dispatch through AttentionInterface"
        )
    assert verify_exactness_of(model) is True


def test_a_decoder_layer_that_attends_twice_has_pages_for_each_call():
    """LongCat-Flash's decoder layers each hold two attention sublayers (``self_attn`` a ``ModuleList``, layer
    indices 2i and 2i+1): the pool has a layer per attention call, and the self-check passes (before, the 29th
    call met a pool of 28 layers and the model was refused with the engine's internal message)."""
    from lightning_oomb.integrations.hf.adapter import verify_exactness_of

    if "longcat_flash" not in tf.CONFIG_MAPPING:
        pytest.skip(f"transformers {tf.__version__} has no LongCat-Flash")
    model = _published_shape("longcat_flash")
    assert HFChunkModel(model).num_layers == 2 * len(model.get_decoder().layers)
    assert verify_exactness_of(model) is True


def test_a_decoder_with_more_layers_than_its_config_counts_is_checked_whole():
    """Blenderbot's config counts its encoder's 2 layers, its causal LM runs the decoder's 24: every decoder
    layer gets pages, and the self-check refuses what chunks change (its positions come from a cache length)."""
    model = _published_shape("blenderbot")
    assert HFChunkModel(model, verify_exactness=False).num_layers == len(model.get_decoder().layers) == 24
    with pytest.raises(OOMBConfigError, match=r"self-check.*relative error"):
        HFChunkModel(model)
