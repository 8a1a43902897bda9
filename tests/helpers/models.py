"""Tiny Hugging Face causal LMs built from config classes (no downloads) and the full-sequence oracle."""

from __future__ import annotations

import contextlib
import functools

import pytest
import torch
import torch.nn.functional as F

FAMILIES = ("qwen2", "llama", "mistral", "qwen3")


def build_causal_lm(family: str = "qwen2", dtype=torch.float64, seed: int = 0, **overrides):
    """A 2-layer model with GQA ratio 7 (7 query heads per KV head, like Qwen2.5-7B's 28:4)."""
    import transformers as tf

    config_cls, model_cls = {
        "qwen2": (tf.Qwen2Config, tf.Qwen2ForCausalLM),
        "llama": (tf.LlamaConfig, tf.LlamaForCausalLM),
        "mistral": (tf.MistralConfig, tf.MistralForCausalLM),
        "qwen3": (tf.Qwen3Config, tf.Qwen3ForCausalLM),
    }[family]
    kwargs = dict(
        hidden_size=56,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=7,
        num_key_value_heads=1,
        head_dim=8,
        vocab_size=97,
        initializer_range=0.2,  # attention far from uniform, so position errors show
        attn_implementation="sdpa",
    )
    if family == "mistral":
        kwargs["sliding_window"] = 11  # active: shorter than every test sequence
    kwargs.update(overrides)
    torch.manual_seed(seed)
    return model_cls(config_cls(**kwargs)).to(dtype)


def full_sequence_loss(model, input_ids, labels=None):
    """Plain full-sequence training loss in the model's dtype (HF's own loss upcasts to fp32 only)."""
    labels = input_ids if labels is None else labels
    hidden = model.get_decoder()(input_ids=input_ids).last_hidden_state
    logits = model.get_output_embeddings()(hidden)[:, :-1]
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels[:, 1:].reshape(-1), ignore_index=-100)


def grads_of(model) -> dict[str, torch.Tensor]:
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


def oomb_step(model, input_ids, checkpointing: bool = False, *, chunk: int, page: int, **options):
    """One OOMB step of a Hugging Face ``model`` (gradients zeroed first; ``options``: more ``OOMBConfig`` fields):
    ``(loss, gradients, engine)``."""
    from lightning_oomb.engine import OOMBConfig, OOMBEngine
    from lightning_oomb.integrations.hf import HFChunkModel

    model.zero_grad()
    config = OOMBConfig(chunk, page, layer_checkpointing=checkpointing, **options)
    engine = OOMBEngine(HFChunkModel(model, layer_checkpointing=checkpointing), config)
    loss = engine.loss(input_ids)
    loss.backward()
    return loss.detach(), grads_of(model), engine


def assert_triton_matches_torch(
    model, input_ids, chunk: int = 16, page: int = 16, options: dict | None = None, **batch
) -> None:
    """One step of ``model`` on the Triton backend (interpreted on a CPU) gives the torch backend's loss (1e-5) and
    gradients (1e-4); ``options``: more ``OOMBConfig`` fields; ``batch``: more ``engine.loss`` arguments (e.g.
    ``position_ids``)."""
    from lightning_oomb.engine import OOMBConfig, OOMBEngine
    from lightning_oomb.integrations.hf import HFChunkModel

    results = {}
    for backend in ("torch", "triton"):
        model.zero_grad()
        config = OOMBConfig(chunk, page, attention_backend=backend, **(options or {}))
        loss = OOMBEngine(HFChunkModel(model), config).loss(input_ids, **batch)
        loss.backward()
        results[backend] = loss.detach(), grads_of(model)
    (loss_t, grads_t), (loss_k, grads_k) = results["torch"], results["triton"]
    assert torch.allclose(loss_k, loss_t, rtol=1e-5, atol=0)
    assert max_relative_error(grads_k, grads_t) <= 1e-4


def relative_errors(got: dict, want: dict) -> dict[str, float]:
    assert set(got) == set(want), "every parameter gets a gradient"
    return {n: ((got[n] - w).abs().max() / w.abs().max().clamp_min(1e-30)).item() for n, w in want.items()}


def max_relative_error(got: dict, want: dict) -> float:
    return max(relative_errors(got, want).values())


# ---------------------------------------------------------------------------------- more families, float64 oracle
TINY = dict(hidden_size=32, intermediate_size=32, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
            vocab_size=64, initializer_range=0.2, attention_dropout=0.0)  # fmt: skip


def build_family(family: str, dtype=torch.float64, seed: int = 0, **overrides):
    """Tiny models of the families beyond Llama's attention, each with the feature that makes it special:
    Gemma 2 (attention and final-logit softcaps, alternating sliding windows), Gemma 3 (5 local : 1 global layers,
    QK-norm, two RoPE bases; also as the multimodal ``Gemma3ForConditionalGeneration`` that
    ``AutoModelForCausalLM`` loads, trained on text), GPT-OSS (attention sinks, alternating windows, MoE), Phi-3 with longrope past its
    original context, Llama with dynamic NTK RoPE past its base length, Cohere (logit scale), Granite (logit
    scaling and multipliers), HyperCLOVAX (logits multiplied by ``logits_scaling``), AFMoE (a gated attention
    output it views: OOMB's must be contiguous; MoE, windows). A family this transformers lacks is skipped."""
    import transformers as tf

    builders = {
        "gemma2": lambda o: tf.Gemma2ForCausalLM(tf.Gemma2Config(**{**TINY, "num_hidden_layers": 2, "sliding_window": 7,
            "attn_logit_softcapping": 5.0, "final_logit_softcapping": 3.0, "query_pre_attn_scalar": 8, **o})),
        "gemma3": lambda o: tf.Gemma3ForCausalLM(tf.Gemma3TextConfig(**{**TINY, "num_hidden_layers": 6, "sliding_window": 7,
            "rope_parameters": {"sliding_attention": {"rope_type": "default", "rope_theta": 10.0},
                                "full_attention": {"rope_type": "default", "rope_theta": 1000.0}}, **o})),
        "gemma3_multimodal": lambda o: tf.Gemma3ForConditionalGeneration(tf.Gemma3Config(mm_tokens_per_image=4,
            text_config={**TINY, "num_hidden_layers": 6, "sliding_window": 7, **o}, vision_config=dict(hidden_size=16,
            intermediate_size=16, num_hidden_layers=1, num_attention_heads=2, image_size=28, patch_size=14))),
        "gpt_oss": lambda o: tf.GptOssForCausalLM(tf.GptOssConfig(**{**TINY, "num_hidden_layers": 2, "sliding_window": 7,
            "num_local_experts": 4, "num_experts_per_tok": 2, "experts_implementation": "eager", **o})),
        "phi3_longrope": lambda o: tf.Phi3ForCausalLM(tf.Phi3Config(**{**TINY, "num_hidden_layers": 2,
            "max_position_embeddings": 64, "original_max_position_embeddings": 16, "pad_token_id": 0,
            "eos_token_id": 0, "bos_token_id": 0, "rope_parameters": {"rope_type": "longrope",
            "short_factor": [1.0] * 4, "long_factor": [2.0, 3.0, 4.0, 5.0], "rope_theta": 1e4}, **o})),
        "llama_dynamic": lambda o: tf.LlamaForCausalLM(tf.LlamaConfig(**{**TINY, "num_hidden_layers": 2,
            "max_position_embeddings": 16, "rope_parameters": {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 1e4},
            **o})),
        "qwen3_moe": lambda o: tf.Qwen3MoeForCausalLM(tf.Qwen3MoeConfig(**{**TINY, "num_hidden_layers": 2,
            "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 16, "experts_implementation": "eager",
            **o})),
        "cohere": lambda o: tf.CohereForCausalLM(tf.CohereConfig(**{**TINY, "num_hidden_layers": 2, "logit_scale": 0.5,
            **o})),
        "granite": lambda o: tf.GraniteForCausalLM(tf.GraniteConfig(**{**TINY, "num_hidden_layers": 2, "logits_scaling": 4.0,
            "embedding_multiplier": 2.0, "residual_multiplier": 0.5, "attention_multiplier": 0.3, **o})),
        "hyperclovax": lambda o: tf.HyperCLOVAXForCausalLM(tf.HyperCLOVAXConfig(**{**TINY, "num_hidden_layers": 2,
            "logits_scaling": 0.25, "pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2, **o})),
        "afmoe": lambda o: tf.AfmoeForCausalLM(tf.AfmoeConfig(**{**TINY, "num_hidden_layers": 2, "sliding_window": 7,
            "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 16, "num_dense_layers": 1,
            "pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2, **o})),
    }  # fmt: skip
    torch.manual_seed(seed)
    try:
        model = builders[family](overrides)
    except AttributeError as err:  # a family newer than this transformers
        pytest.skip(f"{family}: {err}")
    if hasattr(model.config, "_experts_implementation"):
        model.config._experts_implementation = "eager"  # float64: grouped matmuls refuse it
    return model.to(dtype)


def _reference_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, sliding_window=None,
                         softcap=None, s_aux=None, masks=None, **kwargs):  # fmt: skip
    """Textbook attention over the whole sequence in the inputs' dtype (the float64 oracle's attention); ``masks``:
    per layer index, a bool ``[B, N, N]`` narrowing what each query sees (sparse selections, documents)."""
    from tests.helpers.attention import dense_attention

    mask = None if masks is None else masks[module.layer_idx]
    out = dense_attention(
        query, key, value, 0, scaling, sliding_window, softcap=softcap, sinks=s_aux, mask=mask
    )
    return out.transpose(1, 2).contiguous(), None  # as transformers' own: some models view it


def _reference_forward(model, input_ids, masks=None, **kwargs):
    """The model's own forward with textbook attention in the model's dtype (the float64 oracle's forward)."""
    import transformers as tf

    tf.AttentionInterface.register(
        "oomb_test_reference", functools.partial(_reference_attention, masks=masks)
    )
    previous = model.config._attn_implementation
    model.config._attn_implementation = "oomb_test_reference"
    try:
        return model(input_ids=input_ids, **kwargs)
    finally:
        model.config._attn_implementation = previous


def _cross_entropy(logits, input_ids, labels=None):
    labels = input_ids if labels is None else labels
    logits = logits[:, :-1]
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels[:, 1:].reshape(-1), ignore_index=-100)


def exact_full_sequence_loss(model, input_ids, labels=None):
    """Full-sequence training loss of ``model`` as a float64 oracle: the model's own forward (with its logit scale
    and softcap) with textbook attention in the model's dtype, and a cross-entropy in it."""
    return _cross_entropy(_reference_forward(model, input_ids).logits, input_ids, labels)


def masked_full_sequence_loss(model, input_ids, masks, labels=None, **kwargs):
    """:func:`exact_full_sequence_loss` with each layer's attention narrowed by ``masks[layer]`` (bool
    ``[B, N, N]``); ``kwargs`` go to the model (e.g. ``position_ids``)."""
    return _cross_entropy(_reference_forward(model, input_ids, masks, **kwargs).logits, input_ids, labels)


def _cohere_norm(x, m):
    centred = x - x.mean(-1, keepdim=True)
    return m.weight * centred * torch.rsqrt(centred.pow(2).mean(-1, keepdim=True) + m.variance_epsilon)


def _gated_norm(x, gate, m):
    return m.weight * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + m.variance_epsilon) * F.silu(gate)


# RMSNorms that scale by (1 + weight) and compute in float32
_ONE_PLUS_NORMS = ("Qwen3NextRMSNorm", "Qwen3_5RMSNorm", "Qwen3_5MoeRMSNorm")


def float64_norms(model) -> None:
    """Gemma's (Gemma 4's scaling by its weight), Qwen3-Next's and Lara-Mini's (also the gated one of their linear
    attention) and
    Falcon-Mamba's and Llama 4's weightless RMSNorms and Cohere's LayerNorm compute
    in float32 whatever the model's dtype (a float32 reduction over tokens in their weight gradient, which chunking
    reorders: ~1e-7), Llama's normalises in float32 (:func:`_is_llama_norm`); make them compute in the model's dtype
    so float64 tests can ask 1e-10."""
    for module in model.modules():
        name = type(module).__name__
        if name == "Gemma4RMSNorm":  # scales by weight (if it has one)
            module.forward = lambda x, m=module: m._norm(x) * (m.weight if m.with_scale else 1.0)
        elif (name.startswith("Gemma") and name.endswith("RMSNorm")) or name in _ONE_PLUS_NORMS:
            module.forward = lambda x, m=module: m._norm(x) * (1.0 + m.weight)
        elif name.endswith("RMSNormGated") and name.startswith(("Qwen3", "LaraMini")):
            module.forward = lambda x, gate, m=module: _gated_norm(x, gate, m)
        elif name == "CohereLayerNorm":
            module.forward = lambda x, m=module: _cohere_norm(x, m)
        elif name.endswith(
            ("WeightlessRMSNorm", "L2Norm")
        ):  # Falcon-Mamba's (an unused weight), Llama 4's QK norm
            module.forward = module._norm
        elif name.endswith("RMSNorm") and _is_llama_norm(module):
            module.forward = lambda x, m=module: m.weight * _rms(x, m.variance_epsilon)


def _rms(x, eps):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)


def _is_llama_norm(module) -> bool:
    """Whether ``module`` is Llama's RMSNorm — ``weight * x / rms(x)``, normalised in float32 whatever the model's
    dtype — by its output on a probe. Its float32 island rounds each normalised value: float64 inputs that differ in
    their last bits (the step's attention sums in another order than the oracle's) round apart once in about a
    thousand cases, a float32 ulp (~1e-8) in that layer's gradients."""
    weight, eps = getattr(module, "weight", None), getattr(module, "variance_epsilon", None)
    if not isinstance(weight, torch.Tensor) or weight.dim() != 1 or eps is None:
        return False
    probe = torch.randn(3, weight.shape[0], dtype=weight.dtype, generator=torch.Generator().manual_seed(0))
    probe = probe.to(weight.device)
    with torch.no_grad():
        return torch.allclose(module(probe), weight * _rms(probe, eps), rtol=1e-5, atol=1e-6)


def switch_balancing_loss(router_logits, num_experts: int, top_k: int, tokens=None) -> torch.Tensor:
    """Switch Transformer load balancing over all tokens of all layers at once, in the logits' dtype (the oracle of
    the chunked term): ``E * sum_{k,e} mean_t(mask_tke) * mean_t(p_te)``; ``tokens [B, N]``: only those rows (right
    padding excluded, as transformers' ``attention_mask`` excludes it)."""
    logits = torch.cat(list(router_logits), 0)
    if tokens is not None:
        logits = logits[tokens.reshape(-1).repeat(len(router_logits))]
    probs = torch.softmax(logits, -1)
    mask = F.one_hot(torch.topk(probs, top_k, -1).indices, num_experts).to(probs.dtype)
    return num_experts * (mask.mean(0) * probs.mean(0)).sum()


def exact_moe_loss(model, input_ids, attention_mask=None):
    """Full-sequence training loss of an MoE model trained with its router's load balancing (float64 oracle); a
    right-padding ``attention_mask`` removes padded tokens from both terms (they come last: real ones never see
    them)."""
    out = _reference_forward(model, input_ids, output_router_logits=True)
    tokens = None if attention_mask is None else attention_mask.bool()
    aux = switch_balancing_loss(out.router_logits, model.num_experts, model.num_experts_per_tok, tokens)
    labels = None if tokens is None else input_ids.masked_fill(~tokens, -100)
    return _cross_entropy(out.logits, input_ids, labels) + model.router_aux_loss_coef * aux


# ------------------------------------------------------------------------------------------- hybrids, float64 oracle
_HYBRID = dict(hidden_size=32, intermediate_size=32, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
               vocab_size=64, num_hidden_layers=4, initializer_range=0.2, attention_dropout=0.0)  # fmt: skip
_DELTA_NET = dict(linear_num_value_heads=4, linear_num_key_heads=2, linear_key_head_dim=8, linear_value_head_dim=8,
                  linear_conv_kernel_dim=4, layer_types=["linear_attention", "linear_attention", "full_attention",
                  "linear_attention"])  # fmt: skip
_MOE = dict(
    num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16, shared_expert_intermediate_size=16
)
_MAMBA2 = dict(
    mamba_n_heads=4, mamba_d_head=16, mamba_d_state=8, mamba_d_conv=4, mamba_expand=2, mamba_n_groups=1
)
_MAMBA1 = dict(state_size=4, conv_kernel=4, expand=2, time_step_rank=4, residual_in_fp32=False)
HYBRIDS = {  # model_type -> the tiny config's fields (every layer kind of the family present)
    "qwen3_next": {**_DELTA_NET, **_MOE},
    "qwen3_5_text": _DELTA_NET,
    "qwen3_5_moe_text": {**_DELTA_NET, **_MOE},
    "olmo_hybrid": dict(_DELTA_NET, pad_token_id=None, eos_token_id=None, bos_token_id=None),
    "lfm2": dict(layer_types=["conv", "full_attention", "conv", "full_attention"], conv_L_cache=3, block_ff_dim=32),
    "lfm2_moe": dict(layer_types=["conv", "full_attention", "conv", "full_attention"], conv_L_cache=3,
                     num_dense_layers=1, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16),
    "falcon_h1": dict(_MAMBA2, mamba_d_ssm=64, mamba_chunk_size=8, lm_head_multiplier=0.5),
    "bamba": dict(_MAMBA2, attn_layer_indices=[1, 3], mamba_chunk_size=8),
    "granitemoehybrid": dict(_MAMBA2, layer_types=["mamba", "attention", "mamba", "attention"], mamba_chunk_size=8,
                             num_local_experts=4, num_experts_per_tok=2, shared_intermediate_size=16),
    "nemotron_h": dict(mamba_num_heads=4, mamba_head_dim=16, ssm_state_size=8, conv_kernel=4, n_groups=1,
                       expand=2, chunk_size=8, layers_block_type=["mamba", "attention", "mamba", "moe"],
                       n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=16,
                       moe_shared_expert_intermediate_size=16, n_group=1, topk_group=1),
    "mamba2": dict(num_heads=4, head_dim=16, state_size=8, conv_kernel=4, expand=2, n_groups=1, chunk_size=8,
                   residual_in_fp32=False),  # float64 residuals (the default keeps them in float32)
    "mamba": _MAMBA1,  # Mamba-1: no attention layer
    "falcon_mamba": _MAMBA1,
    "lfm3": dict(layer_types=["conv", "full_attention", "conv", "sliding_attention"], conv_L_cache=3,
                 sliding_window=7, pad_token_id=0, bos_token_id=1, eos_token_id=2),
    "lara_mini": {**_DELTA_NET, **_MOE, "sliding_window": 7,
                  "layer_types": ["linear_attention", "sliding_attention", "linear_attention", "full_attention"]},
    "kimi_linear": dict(num_key_value_heads=4, linear_num_heads=2, linear_head_dim=8, linear_conv_kernel_dim=4,
                        kv_lora_rank=16, q_lora_rank=None, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=8,
                        num_experts=4, num_experts_per_token=2, moe_intermediate_size=16, num_shared_experts=1,
                        mlp_layer_types=["dense", "sparse", "sparse", "sparse"], pad_token_id=0, bos_token_id=1,
                        eos_token_id=2, layer_types=["linear_attention", "linear_attention", "full_attention",
                        "linear_attention"]),  # multi-head latent attention beside Kimi's delta rule, MoE
    "bailing_hybrid": dict(num_key_value_heads=4, linear_num_heads=2, linear_head_dim=8, linear_conv_kernel_dim=4,
                           kv_lora_rank=16, q_lora_rank=None, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=8,
                           num_experts=4, num_experts_per_token=2, moe_intermediate_size=16, num_shared_experts=1,
                           num_expert_group=1, topk_group=1, first_k_dense_replace=1, pad_token_id=0,
                           bos_token_id=1, eos_token_id=2, expert_swiglu_limit_list=[0] * 4,
                           share_expert_swiglu_limit_list=[0] * 4, mlp_layer_types=["dense", "sparse", "sparse",
                           "sparse"], layer_types=["linear_attention", "linear_attention", "full_attention",
                           "linear_attention"]),  # Kimi's delta rule (a safe gate) beside latent attention, MoE
    "zaya": dict(num_key_value_heads=2, cca_time0=3, cca_time1=2, num_experts=4, num_experts_per_tok=1,
                 moe_intermediate_size=16, router_hidden_size=16, sliding_window=7, pad_token_id=0, bos_token_id=1,
                 eos_token_id=2, layer_types=["hybrid", "hybrid_sliding", "hybrid", "hybrid"]),  # q/k convolved,
    # v delayed in the attention's projection; MoE
    "jamba": dict(mamba_d_state=4, mamba_d_conv=4, mamba_expand=2, mamba_dt_rank=4, attn_layer_period=2,
                  attn_layer_offset=1, expert_layer_period=2, expert_layer_offset=1, num_experts=4,
                  num_experts_per_tok=2, use_mamba_kernels=False),
}  # fmt: skip


def build_hybrid(family: str, dtype=torch.float64, seed: int = 0, **overrides):
    """A tiny hybrid of ``family`` (a key of :data:`HYBRIDS`): attention layers beside recurrent, gated-delta or
    short-convolution layers, MoE where the family has it (eager experts: float64)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(family, **{**_HYBRID, **HYBRIDS[family], **overrides})
    config._experts_implementation = "eager"
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config).to(dtype)
    model.config._attn_implementation = "sdpa"
    return model


@contextlib.contextmanager
def float64_hybrid(model):
    """While the block runs, ``model``'s gated delta rule / Mamba2 scan and norms compute in its dtype (the
    product's :func:`~lightning_oomb.integrations.hf.float64_rules.float64_recurrences`, :func:`float64_norms`)."""
    from lightning_oomb.integrations.hf.float64_rules import float64_recurrences

    float64_norms(model)
    with float64_recurrences(model):
        yield model


# parameters the mixers themselves cast to float32 whatever the model's dtype: exp(A_log); Mamba-1's D and its time
# step's bias; Lara-Mini's router (the gradients: float32 sums over tokens, which chunking reorders)
FLOAT32_INSIDE = ("A_log", ".D", "dt_proj.bias", "mlp.gate.weight")  # name endings


def hybrid_full_sequence(model, ids, labels=None):
    """A hybrid's own training step on the whole sequence: loss and gradients (Mamba2 casts its logits to
    float32: in a float64 model they are taken from its head, as its forward computes them before the cast)."""
    logits = model(input_ids=ids).logits[:, :-1]
    if logits.dtype != model.dtype:
        logits = model.get_output_embeddings()(model.get_decoder()(input_ids=ids).last_hidden_state)[:, :-1]
    labels = ids if labels is None else labels
    loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels[:, 1:].reshape(-1), ignore_index=-100)
    loss.backward()
    grads = grads_of(model)
    model.zero_grad()
    return loss.detach(), grads


def assert_hybrid_exact(got_loss, got, want_loss, want, tolerance=1e-10):
    """Loss and gradients equal to ``tolerance``; :data:`FLOAT32_INSIDE`'s (float32 sums inside the mixers) to
    1e-6."""
    assert abs(got_loss.item() - want_loss.item()) <= tolerance * want_loss.item()
    err = relative_errors(got, want)
    assert max(e for n, e in err.items() if not n.endswith(FLOAT32_INSIDE)) <= tolerance, max(
        err.items(), key=lambda x: x[1]
    )
    assert max(err.values()) <= 1e-6
