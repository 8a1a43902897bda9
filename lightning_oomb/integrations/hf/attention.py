"""The ``"oomb"`` attention implementation registered in transformers' ``AttentionInterface``.

It is registered **without** a mask function, so transformers skips mask creation (``attention_mask=None``, no
O(N²) mask at any length). It receives post-RoPE ``query [B, Hq, L, D]``, ``key/value [B, Hkv, L, D]`` of the
current chunk (GQA not expanded) and the chunk context as the extra call keyword ``oomb_chunk`` (or, where a
decoder layer does not pass its keywords on, from :data:`RUNNING`), and takes
``scaling``, ``sliding_window``, ``softcap`` (Gemma 2) and ``s_aux`` (GPT-OSS sinks) from the keywords the model
passes — exactly what the model's eager attention would use — and a chunked-attention layer's span from its config
(Llama 4: :func:`attention_chunk`).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from lightning_oomb.engine.attention import ChunkContext, paged_attention
from lightning_oomb.engine.errors import OOMBConfigError
from lightning_oomb.integrations.hf.latent import LATENTS, attend_latent

ATTN_NAME = "oomb"
ENGAGED: set[int] = (
    set()
)  # ids of the models whose attention an OOMB sweep routes here now (HFChunkModel.engaged)
# id of an attention module -> its model's running chunk, while engaged: the context of a call whose decoder layer
# does not pass its keywords on (StableLM, Nemotron); an id, not a module attribute, so a copy does not carry it
RUNNING: dict[int, Callable[[], ChunkContext | None]] = {}


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
    """The ``AttentionInterface`` function: returns ``(out [B, L, Hq, D], None)``."""
    if oomb_chunk is None and (running := RUNNING.get(id(module))) is not None:
        oomb_chunk = running()
    if oomb_chunk is None and ENGAGED:
        raise OOMBConfigError(
            f"{type(module).__name__} was called without the chunk context the engine passes through the model's "
            "keyword arguments, and is not an attention module OOMB found in the decoder (a class named "
            "*Attention or *MLA with an integer layer_idx), so OOMB cannot route its attention — train this "
            "model with another strategy."
        )
    if oomb_chunk is None:
        raise OOMBConfigError(
            "the 'oomb' attention implementation was called outside an OOMB step — it needs the chunk context "
            "that the engine passes — load the model with attn_implementation='sdpa' (or 'eager'); the OOMB "
            "strategy switches attention to 'oomb' by itself while it trains."
        )
    if dropout:
        raise OOMBConfigError(
            f"{type(module).__name__} asks for attention dropout ({dropout}), which the OOMB attention op does not "
            "apply — results would differ from the model's — set attention_dropout=0 in the model config."
        )
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    layer = getattr(module, "oomb_layer", module.layer_idx)  # a hybrid's attention layers: their rank
    block = attention_chunk(module)
    if id(module) in LATENTS:  # mla_pages="latent": one head of latents serves as keys and values

        def attend(q: torch.Tensor, kv: torch.Tensor) -> torch.Tensor:
            return paged_attention(q, kv, kv, oomb_chunk, layer, scale, sliding_window, softcap, s_aux, block)

        check, shift_free = oomb_chunk.sweep == "forward", softcap is None and s_aux is None
        return attend_latent(module, query, key, value, attend, check, shift_free).contiguous(), None
    width = value.shape[-1]
    query, key, value = _one_head_dim(query, key, value, oomb_chunk.shape.call_head_dim_of(layer))
    out = paged_attention(query, key, value, oomb_chunk, layer, scale, sliding_window, softcap, s_aux, block)
    out = out[..., :width].transpose(1, 2).contiguous()  # as sdpa's and eager's: some models .view() it
    return out, None


def attention_chunk(module: torch.nn.Module, config=None) -> int | None:
    """The span of positions a chunked-attention layer attends within (Llama 4's ``chunked_attention`` layers:
    ``attention_chunk_size``; its mask, which OOMB does not build, says so), else ``None``."""
    config = config if config is not None else getattr(module, "config", None)
    types = getattr(config, "layer_types", None) or ()
    index = getattr(module, "layer_idx", None)
    if isinstance(index, int) and index < len(types) and types[index] == "chunked_attention":
        return config.attention_chunk_size
    return None


def counts_tokens_before(module: torch.nn.Module) -> bool:
    """Whether an attention module reads how many tokens come before its chunk from its cache (Llama 4's layers
    without RoPE scale their queries by a temperature of the token index: ``attn_temperature_tuning``)."""
    return bool(getattr(module, "attn_temperature_tuning", False)) and not getattr(module, "use_rope", True)


class TokensBefore:
    """The cache an attention module that :func:`counts_tokens_before` gets: as long as the tokens before its rows
    (the chunk's start; under context parallelism, this rank's slice's), passing the chunk's own K/V through (the
    engine's pages hold the others)."""

    def __init__(self, chunk: ChunkContext) -> None:
        self.start = chunk.start + (chunk.context.rows.start if chunk.context is not None else 0)

    def get_seq_length(self, layer_idx: int | None = 0) -> int:
        return self.start

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        return key_states, value_states


def _one_head_dim(query, key, value, head_dim: int):
    """``query, key, value`` zero-padded to the model's one paged ``head_dim`` where narrower — keys and values of
    different head dims (DeepSeek's multi-head latent attention: 192 and 128), or a layer's heads narrower than
    another's (Gemma 4's sliding layers: 256 beside 512) — as transformers pads them for flash attention: zero
    query and key columns add nothing to a score, zero value columns make output columns that are cut off (their
    gradient is dropped)."""
    if query.shape[-1] == key.shape[-1] == value.shape[-1] == head_dim:
        return query, key, value
    return tuple(
        F.pad(x, (0, head_dim - x.shape[-1])) if x.shape[-1] < head_dim else x for x in (query, key, value)
    )


def register_attention() -> None:
    """Register ``"oomb"`` in ``AttentionInterface`` (idempotent; no mask function on purpose)."""
    from transformers import AttentionInterface

    AttentionInterface.register(ATTN_NAME, oomb_attention_forward)
