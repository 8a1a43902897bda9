"""The memory plan of layers beyond Llama's: MoE models whose first or every other layers are dense (AFMoE, Jamba,
LFM2-MoE, DeepSeek, Qwen-MoE, ERNIE), Gemma's and AFMoE's four norms a layer, AFMoE's gated attention and QK
norms, GPT-OSS's clamped experts — against what autograd saves in a CPU step, and a config's shape against the one
its built model shows."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from lightning_oomb.engine import KVPool, OOMBConfig
from lightning_oomb.engine.model_shape import _shape_of_config, model_shape
from lightning_oomb.engine.planner import plan
from tests.engine.test_planner import BIG_CPU, measure, one_thread  # noqa: F401  (one_thread: an autouse fixture)
from tests.helpers.models import build_family, build_hybrid


def build_llama4(family, dtype, vocab_size, **overrides):
    """A tiny Llama 4: chunked layers (span 48) beside full ones, MoE every other layer."""
    import transformers as tf

    if not hasattr(tf, "Llama4TextConfig"):
        pytest.skip(f"transformers {tf.__version__} has no Llama 4")
    config = tf.Llama4TextConfig(
        hidden_size=32, intermediate_size=32, intermediate_size_mlp=48, num_attention_heads=4, num_key_value_heads=2,
        head_dim=8, vocab_size=vocab_size, num_hidden_layers=4, num_local_experts=4, num_experts_per_tok=1,
        interleave_moe_layer_step=2, no_rope_layer_interval=2, attention_chunk_size=48, floor_scale=4,
        initializer_range=0.2, attention_dropout=0.0, pad_token_id=0, bos_token_id=1, eos_token_id=2, **overrides,
    )  # fmt: skip
    torch.manual_seed(0)
    model = tf.Llama4ForCausalLM(config).to(dtype)
    model.config._experts_implementation = "eager"
    return model


def build_tiny(family, dtype, vocab_size, **overrides):
    """A tiny model of ``family`` (:data:`BASE`'s fields; Gemma 4's layers' own inputs 256 wide)."""
    import transformers as tf

    if family not in tf.CONFIG_MAPPING:
        pytest.skip(f"transformers {tf.__version__} has no {family}")
    own = {"vocab_size_per_layer_input": vocab_size} if family.startswith("gemma4") else {}
    config = tf.AutoConfig.for_model(family, **{**BASE, "vocab_size": vocab_size, "initializer_range": 0.2, **own,
                                                **overrides})  # fmt: skip
    torch.manual_seed(0)
    return tf.AutoModelForCausalLM.from_config(config).to(dtype)


@pytest.mark.parametrize(
    ("family", "build"),
    [("afmoe", build_family), ("gemma2", build_family), ("gemma3", build_family), ("gpt_oss", build_family),
     ("jamba", build_hybrid), ("lfm2_moe", build_hybrid), ("llama4_text", build_llama4), ("nemotron_h", build_hybrid),
     ("lfm3", build_hybrid), ("lara_mini", build_hybrid), ("bailing_hybrid", build_hybrid),
     ("hunyuan_v1_dense", build_tiny), ("apertus", build_tiny), ("arcee", build_tiny),
     ("nemotron", build_tiny), ("stablelm", build_tiny)],
    ids=lambda v: v if isinstance(v, str) else "",
)  # fmt: skip
def test_activations_of_layers_beyond_llamas(family, build):
    """What autograd saves within 10 % (measured -3 % .. +4 %, LFM2-MoE's -9 % while its q_layernorm went unread;
    before: AFMoE 31 % under, Gemma 2/3 23-24 %,
    GPT-OSS 21 %, Llama 4 35 % (transformers runs every token through every expert), Jamba 9 % over with its dense
    layers counted as MoE, Nemotron-H 31 % over with an MLP counted in each of its single-block layers, LFM3 13 %
    under with its convolution layers' four norms counted as two, HunYuan 17 % under with its ``query_layernorm``
    unread; Apertus 9 % under and Arcee 23 % over with their ungated MLPs counted as gated, Nemotron 49 % and
    StableLM 16 % over with torch's LayerNorm counted as an RMSNorm), the step's peak at most 5 % below."""
    predicted, saved, measured = measure(family, "32-true", False, 64, seq_len=256, vocab=64, live=True,
                                         build=build)  # fmt: skip
    assert abs(predicted.device["activations"] / saved - 1) <= 0.10, (predicted.saved, saved)
    backward = max(v for k, v in predicted.phases.items() if k != "optimizer step")
    assert backward + predicted.device["carried_states"] >= 0.95 * measured, (predicted.phases, measured)


BASE = dict(hidden_size=32, intermediate_size=48, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
            vocab_size=64, num_hidden_layers=4)  # fmt: skip
MOE = dict(num_experts_per_tok=2, moe_intermediate_size=16)
CONFIGS = {  # model_type -> fields; (the layers that route to experts, dense MLP width, norms a layer)
    "qwen2_moe": (dict(MOE, num_experts=4, shared_expert_intermediate_size=24, decoder_sparse_step=2,
                       mlp_only_layers=[3]), 1),
    "qwen3_moe": (dict(MOE, num_experts=4, mlp_only_layers=[0]), 3),
    "mixtral": (dict(num_local_experts=4, num_experts_per_tok=2), 4),
    "deepseek_v3": (dict(MOE, n_routed_experts=4, n_shared_experts=1, first_k_dense_replace=1, n_group=1,
                         topk_group=1, q_lora_rank=None, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=8,
                         v_head_dim=8), 3),
    "glm4_moe": (dict(MOE, n_routed_experts=4, n_shared_experts=1, first_k_dense_replace=2, n_group=1,
                      topk_group=1), 2),
    "ernie4_5_moe": (dict(moe_num_experts=4, moe_k=2, moe_intermediate_size=16, moe_layer_start_index=1,
                          moe_layer_end_index=2), 2),
    "afmoe": (dict(MOE, num_experts=4, num_dense_layers=1, num_shared_experts=1), 3),
    "jamba": (dict(num_experts=4, num_experts_per_tok=2, expert_layer_period=2, expert_layer_offset=1,
                   attn_layer_period=2, attn_layer_offset=1, mamba_d_state=4, mamba_d_conv=4, mamba_expand=2,
                   mamba_dt_rank=4), 2),
    "llama4_text": (dict(num_local_experts=4, num_experts_per_tok=1, intermediate_size_mlp=64,
                         interleave_moe_layer_step=2, attention_chunk_size=16), 2),
    "kimi_linear": (dict(num_key_value_heads=4, linear_num_heads=2, linear_head_dim=8, kv_lora_rank=16,
                         q_lora_rank=None, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=8, num_experts=4,
                         num_experts_per_token=2, moe_intermediate_size=16, num_shared_experts=1,
                         mlp_layer_types=["dense", "sparse", "sparse", "dense"], pad_token_id=0), 2),
    "gemma2": (dict(), 0),
    "gemma3_text": (dict(), 0),
    "cohere": (dict(), 0),
    "hunyuan_v1_dense": (dict(), 0),
}  # fmt: skip
READ = ("num_experts", "experts_per_token", "shared_width", "moe_mlps", "dense_mlp_width", "mlp_width",
        "layer_norms", "gated_attention", "qk_norm", "windows", "float32_norms", "centered_norms")  # fmt: skip
# the parameter formula does not know these layers: Mamba, Kimi's delta rule
FORMULA_FAILS = ("jamba", "kimi_linear")


@pytest.mark.parametrize("family", list(CONFIGS))
def test_a_configs_layers_are_read_as_its_built_model_shows_them(family):
    """``oomb plan --model-config`` (a config alone) reads the layers that route to experts, the dense MLPs'
    width, shared experts, norms a layer and gated attention as the built model's modules show them (before: every
    MLP planned as MoE, DeepSeek's and ERNIE's experts not seen, Gemma's extra norms and AFMoE's gate not counted),
    and Llama 4's chunked layers as windows of their span;
    its parameter formula within 0.1 % of the built model's count."""
    import transformers as tf

    fields, routed = CONFIGS[family]
    config = tf.AutoConfig.for_model(family, **{**BASE, **fields})
    with torch.device("meta"):
        model = tf.AutoModelForCausalLM.from_config(config)
    from_config, from_model = model_shape(config), model_shape(model)
    assert {k: getattr(from_config, k) for k in READ} == {k: getattr(from_model, k) for k in READ}
    assert from_model.moe_mlps == routed
    norms = (
        4 if family.startswith("gemma") else 1 if family == "cohere" else 2
    )  # (Cohere's: a parallel block)
    assert from_model.layer_norms == norms + (family == "afmoe") * 2
    assert from_model.gated_attention == (family == "afmoe")
    if family == "llama4_text":  # its chunked layers keep a window's pages: their span's
        assert from_config.windows == tuple(
            16 if t == "chunked_attention" else None for t in config.layer_types
        )
        assert 16 in from_config.windows
    if family not in FORMULA_FAILS:  # (the formula a config transformers cannot build is planned with)
        assert abs(_shape_of_config(config).parameter_count() / from_model.params - 1) <= 1e-3


def config_and_meta_model(family):
    """``family``'s config of :data:`BASE`'s fields and its model built from it on the meta device (skipped where
    this transformers lacks the family)."""
    import transformers as tf

    try:
        config = tf.AutoConfig.for_model(family, **BASE)
    except ValueError as err:
        pytest.skip(str(err))
    with torch.device("meta"):
        return config, tf.AutoModelForCausalLM.from_config(config)


@pytest.mark.parametrize("family", ["arcee", "apertus", "nemotron", "starcoder2", "stablelm", "gemma4_text"])
def test_a_config_alone_is_planned_as_its_built_model(family):
    """A config alone (``lightning_oomb.plan(config, ...)``) is read as the model it builds on the meta device shows
    it: its ungated MLP (Arcee, Apertus, Nemotron, StarCoder2), torch's fused LayerNorm (Nemotron, StarCoder2,
    StableLM), Apertus's and Gemma 4's QK norms, Gemma 4's five norms a layer and its values' norm, and its
    parameters. Before, its activations were planned from -61 % (Gemma 4) to +67 % (Nemotron, StarCoder2) off the
    built model's plan; now they, the weights and every other term are the same."""
    config, model = config_and_meta_model(family)
    exact = ("weight_bytes", "grad_bytes", "half_trainable", "half_vectors")  # (a built model's own bytes)
    assert dataclasses.replace(model_shape(model), **dict.fromkeys(exact)) == model_shape(config)
    read = ("ungated_mlp", "native_norms", "norm_readers", "layer_norms", "qk_norm", "value_norm", "params")
    from_dict = model_shape({"model_type": family, **BASE})  # (a dict of its fields: its layers read alike)
    assert {k: getattr(from_dict, k) for k in read} == {k: getattr(model_shape(config), k) for k in read}
    options = OOMBConfig(chunk_size=64, page_size=16, loss_block=32, layer_checkpointing=False)
    for precision in ("32-true", "bf16-mixed", "bf16-true"):
        from_model = plan(model, 256, 2, options, precision, None, BIG_CPU)
        assert plan(config, 256, 2, options, precision, None, BIG_CPU).device == from_model.device


@pytest.mark.parametrize("checkpointing", [False, True], ids=["plain", "checkpointed"])
@pytest.mark.parametrize(
    ("seq_len", "types"),
    [(512, ["full_attention", "sliding_attention"]), (224, ["full_attention", "full_attention"])],
    ids=["full-below-windowed", "partial-last-chunk"],
)
def test_gemma2s_attention_backward_is_planned_at_its_largest_score_block(seq_len, types, checkpointing):
    """Gemma 2's soft cap takes the reference attention, whose backward makes score blocks of a chunk's rows over the
    keys they see. ``full-below-windowed`` (layers [full, sliding]): the keys are the widest any layer sees, not the
    last layer's window's — planned 79-82 % below the step's peak at 512 tokens (the last layer's window of 7), now
    within 5 % (measured -1 .. +3 %). ``partial-last-chunk``: at 224 tokens in chunks of 64 the last chunk's 32 rows
    see 224 keys, the last whole chunk's 64 rows 192 — the larger block is 64 x 192, not 64 x 224 (planned 15-17 %
    above the step's peak, now within 5 %: measured +1 .. +2 %)."""
    predicted, _, measured = measure("gemma2", "32-true", checkpointing, 64, seq_len=seq_len, vocab=64, live=True,
                                     build=build_family, layer_types=types)  # fmt: skip
    backward = max(v for k, v in predicted.phases.items() if k != "optimizer step")
    assert predicted.peak_phase == "attention backward" and abs(backward / measured - 1) <= 0.05, (
        predicted.phases,
        measured,
    )


@pytest.mark.parametrize("precision", ["32-true", "bf16-mixed"])
@pytest.mark.parametrize("checkpointing", [False, True], ids=["plain", "checkpointed"])
def test_coheres_parallel_block_reads_one_norm_that_saves_its_centred_input_twice(precision, checkpointing):
    """Cohere's layers run attention and the MLP side by side on one LayerNorm's output, and its LayerNorm saves
    its centred input twice (``(x - mean).pow(2)`` and ``(x - mean) * rsqrt``): planned as two RMSNorms a layer,
    +12 % above what autograd saves (32-true) and, with layer checkpointing, 19 % below (the final norm's second
    centred input); now within 1 % (measured: exact)."""
    predicted, saved, _ = measure(
        "cohere", precision, checkpointing, 64, seq_len=256, vocab=64, build=build_family
    )
    assert abs(predicted.device["activations"] / saved - 1) <= 0.01, (predicted.saved, saved)
    assert predicted.model.layer_norms == 1 and predicted.model.centered_norms


@pytest.mark.parametrize("precision", ["32-true", "bf16-true", "bf16-mixed"])
def test_gemma4s_per_layer_inputs_are_saved_before_the_first_layer(precision):
    """Gemma 4 makes every layer's own input (``hidden_size_per_layer_input`` wide) before the first layer: the
    embeddings projected, normed in float32 and added to per-layer embeddings. A checkpointed step saves the norm's
    input and output and the sum (under autocast also the projection's cast input and weight) beside the layers'
    inputs: planned 94-95 % below what autograd saves (the layers' inputs only), now within 1 % (measured:
    exact)."""
    predicted, saved, _ = measure("gemma4_text", precision, True, 64, seq_len=256, vocab=64, build=build_tiny)
    assert abs(predicted.device["activations"] / saved - 1) <= 0.01, (predicted.saved, saved)
    assert predicted.model.per_layer_inputs == 256


@pytest.mark.parametrize("precision", ["32-true", "bf16-true", "bf16-mixed"])
def test_gemma4s_layers_are_planned_at_their_own_head_dims(precision):
    """Gemma 4's global layers have wider heads (``per_layer_config``'s ``global_head_dim``: 512 here) than its
    sliding ones (8): each layer's projections, norms and o_proj input are planned at its own head dim, the op's
    saved q and output at the pages' (narrower heads zero-padded), its values' weightless norm and each layer's gate
    of its own input counted. Planned 56-80 % above what autograd saves (every layer at 512, the rest uncounted),
    now within 1 % (measured -0.3 .. -0.1 %); the pages stay the pool's: every layer at the widest head dim."""
    predicted, saved, _ = measure(
        "gemma4_text", precision, False, 64, seq_len=256, vocab=64, build=build_tiny
    )
    assert predicted.model.layer_head_dims == (8, 8, 8, 512) and predicted.model.value_norm
    assert abs(predicted.device["activations"] / saved - 1) <= 0.01, (predicted.saved, saved)
    assert predicted.pool.head_dim == 512
    pool = KVPool(OOMBConfig(chunk_size=64, page_size=16))
    pool.reserve(predicted.pool, torch.device("cpu"))
    assert predicted.device["kv_hbm"] == pool.stats()["hbm_pool_bytes"]
    pool.release()


@pytest.mark.parametrize("family", ["gemma2", "gemma3"])
def test_gemma_norms_keep_their_normed_input_in_float32(family):
    """Gemma's RMSNorm computes ``x * (1 + w)`` in float32 and casts only its result: under bf16-true the normed
    input its weight's gradient needs is saved in float32 (the layers' and the queries' and keys' norms) — planned
    16-17 % below what autograd saves (as Llama's, cast back first), now within 1 % (measured -0.3 %)."""
    predicted, saved, _ = measure(family, "bf16-true", False, 64, seq_len=256, vocab=64, build=build_family)
    assert predicted.model.float32_norms
    assert abs(predicted.device["activations"] / saved - 1) <= 0.01, (predicted.saved, saved)


@pytest.mark.parametrize(
    "family", ["gemma", "gemma2", "gemma3_text", "gemma4_text", "qwen3_next", "llama", "qwen3"]
)
def test_float32_norms_are_read_off_the_norms_forward_and_the_config_alike(family):
    """A model's norms are read by what their forward saves on a bfloat16 input (Gemma 2/3/4's, Qwen3-Next's:
    their normed input in float32; Llama's, Qwen3's: cast back), its config by its family, alike."""
    config, model = config_and_meta_model(family)
    want = family not in ("llama", "qwen3")
    assert model_shape(model).float32_norms == model_shape(config).float32_norms == want


def test_fused_projections_save_one_cast_copy_of_their_input_under_autocast():
    """Phi-3's fused ``qkv_proj`` and ``gate_up_proj`` each save one bfloat16 copy of their normed input under
    autocast, where q, k, v and gate, up save one each: the projections reading a norm are read off the layers
    (Phi-3 was planned 11.6 % above what autograd saves under bf16-mixed, now exactly)."""
    predicted, saved, _ = measure("phi3_longrope", "bf16-mixed", False, 16, seq_len=48, vocab=64,
                                  build=build_family)  # fmt: skip
    assert predicted.model.norm_readers[:2] == (1, 1)
    assert abs(predicted.device["activations"] / saved - 1) <= 0.02, (predicted.saved, saved)


@pytest.mark.parametrize(
    ("family", "precision", "build"),
    [("hunyuan_v1_dense", "bf16-mixed", build_tiny), ("ernie4_5", "bf16-true", build_tiny),
     ("ernie4_5", "32-true", build_tiny), ("lfm3", "32-true", build_hybrid), ("lfm3", "bf16-mixed", build_hybrid)],
    ids=lambda v: v if isinstance(v, str) else "",
)  # fmt: skip
def test_rope_tables_qk_norms_after_rope_and_head_gates(family, precision, build):
    """HunYuan norms its queries and keys after RoPE, whose float32 tables promote them under autocast: the norms'
    normed inputs are float32 (planned 4.7 % below what autograd saves, in the compute dtype); ERNIE 4.5 interleaves
    the RoPE tables in each layer, in float32 (planned 1.2-2.3 % below, one shared table in the activations' dtype);
    LFM3 gates its attention output per head (``g_proj``: a sigmoid per head, the op's output copied) and its full and
    sliding layers have RoPE tables of their own (planned 2.1-2.9 % below). Now within 0.2 % (measured: exact)."""
    predicted, saved, _ = measure(family, precision, False, 64, seq_len=256, vocab=64, build=build)
    assert abs(predicted.device["activations"] / saved - 1) <= 0.002, (predicted.saved, saved)


@pytest.mark.parametrize("precision", ["32-true", "bf16-mixed"])
def test_llama4s_layers_are_read_off_its_decoder_stack(precision):
    """Llama 4's ``get_decoder()`` returns the model itself, so its layers went unread: its weightless QK norm,
    only in its RoPE layers, and the projections reading its norms; and its experts save each one's copy of the
    input times its score and a cast copy, not an output. Planned +4.1 % (32-true) and -5.0 % (bf16-mixed) off what
    autograd saves, then +0.2 % and -1.0 %: under autocast the router reads its own cast copy of the normed input
    beside the shared expert's two (``norm_readers[2]``, 3, was dropped: the experts read scaled copies), and the
    router saves its top-k indices and a float32 sigmoid (counted as two float32 score rows). Now within 0.5 %
    (measured +0.1 % both)."""
    predicted, saved, _ = measure(
        "llama4_text", precision, False, 64, seq_len=256, vocab=64, build=build_llama4
    )
    shape = predicted.model
    assert (shape.qk_norm_layers, shape.weightless_qk_norms, shape.norm_readers) == (2, True, (3, 2, 3))
    assert abs(predicted.device["activations"] / saved - 1) <= 0.005, (predicted.saved, saved)


def build_latent(family, dtype, vocab_size):
    """A tiny latent attention model of ``family`` (``tests/integrations/test_latent_pages.py``'s: 2 layers, 4
    heads of ``qk_nope_head_dim`` 8 + ``qk_rope_head_dim`` 4, a latent of 16; vocabulary 64)."""
    from tests.integrations.test_latent_pages import _model

    assert vocab_size == 64
    return _model(family, dtype=dtype)


@pytest.mark.parametrize(
    ("family", "precision"),
    [("glm4_moe_lite", "bf16-true"), ("minicpm3", "32-true"), ("minicpm3", "bf16-mixed")],
)
def test_latent_attention_is_planned_from_its_own_projections(family, precision):
    """Multi-head latent attention over expanded pages (GLM-4.7-Flash's, MiniCPM3's) saves its queries' low-rank
    projection and norm, its latent's norm (its float32 input: under float32 the whole ``kv_a_proj_with_mqa``
    output), ``kv_b_proj``'s input, ``o_proj``'s at ``num_heads x v_head_dim`` and RoPE's tables at
    ``qk_rope_head_dim``, and a DeepSeek-style router its float32 input: planned as plain attention of ``head_dim =
    max(qk_nope + qk_rope, v_head_dim)`` 7.6-17.7 % below what autograd saves (GLM-4.7-Flash -17.7 %, MiniCPM3
    -13.8 % and -7.6 %), now within 3 % (measured: MiniCPM3 exact, GLM-4.7-Flash -1.7 %: its routed experts')."""
    predicted, saved, _ = measure(family, precision, False, 32, seq_len=96, vocab=64, build=build_latent)
    shape = predicted.model
    assert (shape.latent_width, shape.q_lora_rank, shape.v_head_dim) == (20, 16, 8)
    assert abs(predicted.device["activations"] / saved - 1) <= 0.03, (predicted.saved, saved)


@pytest.mark.parametrize("family", ["deepseek_v3", "deepseek_v2"])
def test_a_latent_attention_config_is_planned_as_its_built_model(family):
    """A latent attention config alone reads the latent's and heads' widths (``q_lora_rank``: V2's none,
    ``qk_rope_head_dim``, ``v_head_dim``), V2's complex RoPE table and DeepSeek's float32 router as the built model
    shows them: the same activations and every other term in both modes and precisions."""
    import transformers as tf

    from tests.integrations.test_hf_adapter import TINY
    from tests.integrations.test_latent_pages import FAMILIES, LATENT

    fields = {**TINY, **LATENT, **FAMILIES[family], "pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2}
    config = tf.AutoConfig.for_model(family, **fields)
    with torch.device("meta"):
        model = tf.AutoModelForCausalLM.from_config(config)
    latent = ("latent_width", "q_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim", "complex_rope",
              "float32_router", "norm_readers", "params")  # fmt: skip
    want = (
        20,
        16 if family == "deepseek_v3" else 0,
        8,
        4,
        LATENT["v_head_dim"] if family == "deepseek_v3" else 16,
    )
    assert tuple(getattr(model_shape(config), k) for k in latent[:5]) == want
    assert {k: getattr(model_shape(config), k) for k in latent} == {
        k: getattr(model_shape(model), k) for k in latent
    }
    for mode in ("expanded", "latent"):
        options = OOMBConfig(chunk_size=32, page_size=16, loss_block=32, mla_pages=mode)
        for precision in ("32-true", "bf16-mixed", "bf16-true"):
            from_model = plan(model, 96, 2, options, precision, None, BIG_CPU)
            assert plan(config, 96, 2, options, precision, None, BIG_CPU).device == from_model.device
