"""What a model must offer to be trained by OOMB: the engine's part and the strategies' part.

:class:`ChunkModel` is what :class:`~lightning_oomb.engine.recurrence.OOMBEngine` drives: the model's shape, one
chunk's final hidden states (its attention modules call :func:`~lightning_oomb.engine.attention.paged_attention`
with their layer index and the :class:`~lightning_oomb.engine.attention.ChunkContext` the engine passes), and the
LM head; ``parameters()``, where a model has it (an ``nn.Module``'s own), is how the engine finds the 16-bit
parameters whose chunk gradients it sums in float32 (``grad_accumulation``). :class:`ManagedModel` adds what the
Lightning strategies need: answering the user's own model calls inside ``training_step`` / ``validation_step`` /
``test_step`` with the engine's loss. ``integrations.hf.HFChunkModel`` implements both for Hugging Face causal LMs;
any other ``nn.Module`` can implement them too — with :class:`ManagedModelMixin` it only adds the shape attributes,
``hidden_states`` and ``lm_head`` (see ``examples/custom_model.py``), and the strategies train it directly.

A model with layers that carry a state along the sequence (a recurrence, a causal convolution) sets
``carries_states = True``: the engine then passes each chunk's :class:`~lightning_oomb.engine.states.ChunkStates`
as ``chunk.states``, whose ``incoming(key)`` the layer starts from and ``outgoing(key, state)`` it reports, and
carries states and gradients across chunks (:mod:`lightning_oomb.engine.states`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Protocol, runtime_checkable

import torch

from lightning_oomb.engine.attention import ChunkContext
from lightning_oomb.engine.loss import LMHead

# respond(input_ids [B, N], labels [B, N] | None, position_ids=None, attention_mask=None) -> the loss of the call
Respond = Callable[..., torch.Tensor]


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
        """While the block runs, the model's attention goes through the engine (and whatever else a sweep needs,
        e.g. per-layer checkpointing, a length-dependent RoPE pinned to ``num_tokens``: the step's largest position
        + 1, the sequence length unless packed documents restart positions); everything is restored afterwards."""


class StepLoss(Protocol):
    """An extra loss term that couples the tokens of a step only through constants of the forward sweep (e.g. an
    MoE router's load balancing): a model that has one returns a fresh one per step from ``new_step_loss()``, and
    records its per-chunk inputs into ``chunk.step_loss`` while it runs a chunk."""

    def value(self) -> torch.Tensor:
        """The term's value for the step, after the forward sweep (added to the step's loss)."""

    def chunk_term(self) -> torch.Tensor:
        """Backward sweep: the recomputed chunk's differentiable share (the shares' gradients sum to the term's)."""

    def reduce(self, sum_) -> None:
        """Context parallelism, after the forward sweep: make the collected constants the group's (``sum_(t)``
        sums a tensor over the group's ranks, in place, and returns it)."""


@runtime_checkable
class ManagedModel(ChunkModel, Protocol):
    """A :class:`ChunkModel` whose calls the OOMB strategies can answer."""

    def answer_calls(self, respond: Respond) -> contextlib.AbstractContextManager:
        """While the block runs, a call of the model (as the user's step makes it) is checked, reduced to
        ``respond(input_ids, labels, position_ids=..., attention_mask=...)`` and returned in the model's own output
        type with that loss."""


class ManagedModelMixin:
    """Defaults for a plain ``nn.Module`` that is its own :class:`ManagedModel`.

    The model still defines ``num_layers``, ``kv_heads``, ``head_dim``, ``vocab_size``, ``num_embeddings``,
    ``hidden_states`` (its attention modules call :func:`~lightning_oomb.engine.attention.paged_attention` with
    their layer index when a chunk context is given) and ``lm_head``. This mixin adds: ``engaged`` (nothing to
    switch), ``answer_calls`` (inside the strategy's steps, ``model(input_ids, labels=None, position_ids=None,
    attention_mask=None)`` returns the engine's loss tensor — override it if your ``forward`` differs), and ``layer_checkpointing``, which
    the strategy sets from its option, as an engine does whose config says ``True`` (checkpoint your blocks in
    ``hidden_states`` when it is on).
    """

    layer_checkpointing: bool = False

    def engaged(self, num_tokens: int) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext()

    @contextlib.contextmanager
    def answer_calls(self, respond: Respond):
        def forward(input_ids, labels=None, position_ids=None, attention_mask=None):
            return respond(input_ids, labels, position_ids=position_ids, attention_mask=attention_mask)

        self.forward = forward
        try:
            yield
        finally:
            del self.forward
