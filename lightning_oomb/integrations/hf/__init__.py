"""Hugging Face transformers: the ``"oomb"`` attention backend, the causal-LM adapter and what OOMB trains exactly.

- :mod:`.attention` — the ``AttentionInterface`` function (registered with no mask function: no O(N²) masks);
- :mod:`.adapter` — :class:`HFChunkModel` (the engine's ``ManagedModel`` for a ``*ForCausalLM``) and
  :func:`find_causal_lm`;
- :mod:`.support` — static inspection of a model, its logit transform, and the float64 self-check;
- :mod:`.rope` — length-dependent RoPE pinned to the step's length.

All Hugging Face knowledge of the project lives in this package.
"""

from lightning_oomb.engine.model_shape import ADAPTER_READERS
from lightning_oomb.integrations.hf.adapter import (
    HFChunkModel,
    adapter_for_planning,
    find_causal_lm,
    set_layer_checkpointing,
)
from lightning_oomb.integrations.hf.attention import ATTN_NAME, oomb_attention_forward, register_attention
from lightning_oomb.integrations.hf.support import check_supported, verify_exactness

if (
    adapter_for_planning not in ADAPTER_READERS
):  # the planner reads a Hugging Face model as its adapter shows it
    ADAPTER_READERS.append(adapter_for_planning)

__all__ = [
    "ATTN_NAME",
    "HFChunkModel",
    "check_supported",
    "find_causal_lm",
    "oomb_attention_forward",
    "register_attention",
    "set_layer_checkpointing",
    "verify_exactness",
]
