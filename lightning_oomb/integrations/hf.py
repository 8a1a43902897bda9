"""Hugging Face adapter: drives a ``*ForCausalLM`` chunk by chunk through the engine.

``"oomb"`` is registered in transformers' ``AttentionInterface`` **without** a mask function, so transformers
skips mask creation (``attention_mask=None``, no O(N²) mask). The chunk context travels as the extra model-call
keyword ``oomb_chunk``; positions go in ``position_ids`` (offset by the chunk start). The model's own attention
implementation is switched to ``"oomb"`` only while the engine runs it (:meth:`HFChunkModel.oomb_attention`), so
the same model behaves unchanged everywhere else (generation, ordinary evaluation).

Models the adapter cannot drive exactly are refused at construction (:func:`check_supported`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

from lightning_oomb.engine.attention import ChunkContext, paged_attention
from lightning_oomb.engine.errors import OOMBConfigError

ATTN_NAME = "oomb"
_UNSTABLE_ROPE = ("longrope", "dynamic")


def oomb_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    sliding_window: int | None = None,
    softcap: float | None = None,
    s_aux: torch.Tensor | None = None,
    oomb_chunk: ChunkContext | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """The ``AttentionInterface`` function: post-RoPE ``query [B, Hq, L, D]``, ``key/value [B, Hkv, L, D]``."""
    if oomb_chunk is None:
        raise OOMBConfigError(
            "the 'oomb' attention implementation was called outside an OOMB step — it needs the chunk context "
            "that the engine passes — load the model with attn_implementation='sdpa' (or 'eager'); the OOMB "
            "strategy switches attention to 'oomb' by itself while it trains."
        )
    if softcap is not None or s_aux is not None or dropout:
        raise OOMBConfigError(
            f"{type(module).__name__} asks for attention softcap/sinks/dropout, which the OOMB attention op does "
            "not compute — results would be wrong — use a supported model family (Llama, Qwen2/3, Mistral)."
        )
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    out = paged_attention(query, key, value, oomb_chunk, module.layer_idx, scale, sliding_window)
    return out.transpose(1, 2), None


def register_attention() -> None:
    """Register ``"oomb"`` in ``AttentionInterface`` (idempotent; no mask function on purpose)."""
    from transformers import AttentionInterface

    AttentionInterface.register(ATTN_NAME, oomb_attention_forward)


def _rope_types(config) -> set[str]:
    params = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    nested = [p for p in params.values() if isinstance(p, dict)] if isinstance(params, dict) else []
    found = {p.get("rope_type", p.get("type")) for p in [params, *nested] if isinstance(p, dict)}
    return {t for t in found if t}


def check_supported(model: torch.nn.Module) -> None:
    """Raise :class:`OOMBConfigError` if the adapter cannot train ``model`` exactly; say why and what to do."""
    from transformers import PreTrainedModel

    name = type(model).__name__
    if not isinstance(model, PreTrainedModel) or model.get_output_embeddings() is None:
        raise OOMBConfigError(
            f"{name} is not a Hugging Face causal LM with an LM head — the OOMB adapter drives "
            "`*ForCausalLM` models — load the model with AutoModelForCausalLM."
        )
    config = model.config
    reasons = []
    if not type(model)._can_set_attn_implementation():
        reasons.append("its attention does not dispatch through transformers' AttentionInterface")
    if bad := _rope_types(config) & set(_UNSTABLE_ROPE):
        reasons.append(
            f"its RoPE type {sorted(bad)} picks frequencies from each call's length, so chunks differ"
        )
    if getattr(config, "kv_lora_rank", None) or getattr(config, "q_lora_rank", None):
        reasons.append("it uses multi-head latent attention (DeepSeek-style MLA)")
    if getattr(config, "attn_logit_softcapping", None) is not None:
        reasons.append("it soft-caps attention logits")
    if getattr(config, "final_logit_softcapping", None) is not None:
        reasons.append("it soft-caps the final logits")
    if getattr(config, "logit_scale", None) not in (None, 1.0) or getattr(
        config, "logits_scaling", None
    ) not in (
        None,
        1.0,
    ):
        reasons.append("it rescales its logits")
    if any(hasattr(m, "sinks") for m in model.modules()):
        reasons.append("its attention has sink logits")
    if getattr(config, "attention_dropout", 0.0):
        reasons.append(f"attention_dropout={config.attention_dropout} (set it to 0)")
    if getattr(config, "output_router_logits", False):
        reasons.append(
            "its router auxiliary loss is not separable by chunks (set output_router_logits=False)"
        )
    if getattr(config, "is_causal", True) is False or getattr(config, "use_bidirectional_attention", False):
        reasons.append("its attention is not causal")
    if reasons:
        raise OOMBConfigError(
            f"OOMB cannot train {name} exactly: {'; '.join(reasons)}. Supported today: Llama, Qwen2, Qwen3, "
            "Mistral (and families with the same attention); train this model with another strategy."
        )


class HFChunkModel:
    """Adapter from a transformers ``*ForCausalLM`` to the engine's ``ChunkModel`` protocol."""

    def __init__(self, model: torch.nn.Module, layer_checkpointing: bool = False):
        check_supported(model)
        register_attention()
        self.model = model
        config = model.config
        self.num_layers = config.num_hidden_layers
        heads = config.num_attention_heads
        self.kv_heads = getattr(config, "num_key_value_heads", None) or heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
        if layer_checkpointing:
            enable = getattr(model, "activation_checkpointing_enable", None)
            if enable is not None:  # transformers >= 5.24
                enable(activation_checkpointing_kwargs={"use_reentrant": False})
            else:
                model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})

    @contextlib.contextmanager
    def oomb_attention(self) -> Iterator[None]:
        """Route the model's attention through the engine for the duration of the block."""
        config = self.model.config
        previous = config._attn_implementation
        config._attn_implementation = ATTN_NAME
        try:
            yield
        finally:
            config._attn_implementation = previous

    def hidden_states(
        self, input_ids: torch.Tensor, position_ids: torch.Tensor, chunk: ChunkContext
    ) -> torch.Tensor:
        """Final normed hidden states ``[B, L, H]`` of one chunk."""
        out = self.model.get_decoder()(
            input_ids=input_ids, position_ids=position_ids, use_cache=False, oomb_chunk=chunk
        )
        return out.last_hidden_state

    def lm_head(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        head = self.model.get_output_embeddings()
        return head.weight, head.bias
