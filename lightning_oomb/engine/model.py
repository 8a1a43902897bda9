"""What a model must offer to be trained by OOMB: the engine's part and the strategies' part.

:class:`ChunkModel` is what :class:`~lightning_oomb.engine.recurrence.OOMBEngine` drives: the model's shape, one
chunk's final hidden states (its attention modules call :func:`~lightning_oomb.engine.attention.paged_attention`
with their layer index and the :class:`~lightning_oomb.engine.attention.ChunkContext` the engine passes), and the
LM head. :class:`ManagedModel` adds what the Lightning strategies need: answering the user's own model calls inside
``training_step`` / ``validation_step`` / ``test_step`` with the engine's loss. ``integrations.hf.HFChunkModel``
implements both for Hugging Face causal LMs; any other model can implement them too.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Protocol, runtime_checkable

import torch

from lightning_oomb.engine.attention import ChunkContext
from lightning_oomb.engine.loss import LMHead

# (input_ids [B, N], labels [B, N] | None) -> the loss the call returns
Respond = Callable[[torch.Tensor, torch.Tensor | None], torch.Tensor]


@runtime_checkable
class ChunkModel(Protocol):
    """What the engine needs from a model."""

    num_layers: int
    kv_heads: int
    head_dim: int
    vocab_size: int  # rows of the LM head: labels lie in [0, vocab_size)
    num_embeddings: int  # rows of the input embedding: token ids lie in [0, num_embeddings)

    def hidden_states(
        self, input_ids: torch.Tensor, position_ids: torch.Tensor, chunk: ChunkContext
    ) -> torch.Tensor:
        """Final (normed) hidden states ``[B, L, H]`` of one chunk at absolute positions ``position_ids``."""

    def lm_head(self) -> LMHead:
        """The LM head: weight, bias and the transform of the logits (scale, softcap) that the model applies."""

    def engaged(self, num_tokens: int) -> contextlib.AbstractContextManager:
        """While the block runs, the model's attention goes through the engine (and whatever else a sweep over a
        ``num_tokens``-token sequence needs, e.g. per-layer checkpointing, RoPE pinned to that length);
        everything is restored afterwards."""


@runtime_checkable
class ManagedModel(ChunkModel, Protocol):
    """A :class:`ChunkModel` whose calls the OOMB strategies can answer."""

    def answer_calls(self, respond: Respond) -> contextlib.AbstractContextManager:
        """While the block runs, a call of the model (as the user's step makes it) is checked, reduced to
        ``respond(input_ids, labels)`` and returned in the model's own output type with that loss."""
