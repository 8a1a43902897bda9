"""The ``"oomb"`` attention implementation registered in transformers' ``AttentionInterface``.

It is registered **without** a mask function, so transformers skips mask creation (``attention_mask=None``, no
O(N²) mask at any length). It receives post-RoPE ``query [B, Hq, L, D]``, ``key/value [B, Hkv, L, D]`` of the
current chunk (GQA not expanded) and the chunk context as the extra call keyword ``oomb_chunk``, and takes
``scaling``, ``sliding_window``, ``softcap`` (Gemma 2) and ``s_aux`` (GPT-OSS sinks) from the keywords the model
passes — exactly what the model's eager attention would use.
"""

from __future__ import annotations

import torch

from lightning_oomb.engine.attention import ChunkContext, paged_attention
from lightning_oomb.engine.errors import OOMBConfigError

ATTN_NAME = "oomb"
ENGAGED: set[int] = (
    set()
)  # ids of the models whose attention an OOMB sweep routes here now (HFChunkModel.engaged)


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
    if oomb_chunk is None and ENGAGED:
        raise OOMBConfigError(
            f"{type(module).__name__} was called without the chunk context the engine passes through the model's "
            "keyword arguments: the model's decoder layers do not pass their keyword arguments on to attention "
            "(transformers' StableLM and Nemotron, for example), so OOMB cannot route its attention — train this "
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
    out = paged_attention(query, key, value, oomb_chunk, layer, scale, sliding_window, softcap, s_aux)
    return out.transpose(1, 2).contiguous(), None  # as sdpa's and eager's: some models .view() it


def register_attention() -> None:
    """Register ``"oomb"`` in ``AttentionInterface`` (idempotent; no mask function on purpose)."""
    from transformers import AttentionInterface

    AttentionInterface.register(ATTN_NAME, oomb_attention_forward)
