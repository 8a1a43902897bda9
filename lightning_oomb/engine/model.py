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
as ``chunk.states``, whose ``incoming(key)`` the layer starts from (``None`` in the first chunk: its zero state)
and ``outgoing(key, state)`` it reports, and carries states and gradients across chunks
(:mod:`lightning_oomb.engine.states`). Every chunk must report every key, the whole state after its last token,
with the same shapes and dtypes (the next chunk starts from what was reported; a shape with no batch-size
dimension, a changed shape or dtype is refused), and each reported state must stay attached to the chunk's graph —
computed from the incoming state and the chunk's inputs, neither detached nor made under ``no_grad`` — so that its
gradient reaches the earlier chunks. A state whose gradient the model stops by design (a Transformer-XL memory) is
reported with ``outgoing(key, state, grad=False)``: carried forward, never back-propagated into.
"""

from __future__ import annotations

import contextlib
import functools
import types
from collections.abc import Callable, Iterator
from typing import Protocol, runtime_checkable

import torch

from lightning_oomb.engine.attention import ChunkContext
from lightning_oomb.engine.errors import OOMBConfigError
from lightning_oomb.engine.loss import LMHead

# respond(input_ids [B, N], labels [B, N] | None, position_ids=None, attention_mask=None) -> the loss of the call
Respond = Callable[..., torch.Tensor]
_ANSWERS = "_oomb_answers_calls"  # marks the temporary forward of answered_by


def runs_class_forward(module: torch.nn.Module, forward: Callable) -> bool:
    """Whether ``forward``, set on ``module`` itself, only runs its class's forward: that forward bound to it,
    ``torch.compile(module.forward)``, accelerate's hook around such (``_hf_hook``: device placement, offload), or
    :func:`answered_by`'s forward left on a copy (it runs the copy's class forward)."""
    if isinstance(forward, types.MethodType):
        function = forward.__func__
        return forward.__self__ is module and (
            function is type(module).forward or hasattr(function, _ANSWERS)
        )
    if (compiled := getattr(forward, "_torchdynamo_orig_callable", None)) is not None:
        return runs_class_forward(module, compiled)
    if (
        isinstance(forward, functools.partial)
        and getattr(forward.func, "__module__", None) == "accelerate.hooks"
        and getattr(module, "_hf_hook", None) is not None
        and (inner := getattr(module, "_old_forward", None)) is not forward
    ):
        return runs_class_forward(module, inner)
    return False


@contextlib.contextmanager
def answered_by(module: torch.nn.Module, answer: Callable) -> Iterator[None]:
    """While the block runs, ``module(...)`` returns ``answer(...)``; a copy made meanwhile (``copy.deepcopy``
    rebinds the temporary method to the copy) runs its class's forward, as a plain model. A ``forward`` set on the
    instance is put back afterwards; one that does more than run the class's forward (:func:`runs_class_forward`:
    a wrapper adding a loss term) is refused, since the answer never runs it. ``torch.compile(module.forward)`` is
    accepted: the engine runs the model a chunk at a time, uncompiled."""
    own = vars(module).get("forward")
    if own is not None and not runs_class_forward(module, own):
        raise OOMBConfigError(
            f"{type(module).__name__}'s forward is replaced on the instance "
            f"({getattr(own, '__qualname__', type(own).__name__)}) — the OOMB strategy answers the model's calls "
            "in its steps with the engine's chunked loss and never runs that forward, so whatever it adds would be "
            "silently lost — compute an extra term in training_step and add it to the loss the model call "
            "returns, or remove the instance forward (`del model.forward`)."
        )

    def forward(self, *args, **kwargs):
        if self is not module:  # a copy made while the block runs
            return type(self).forward(self, *args, **kwargs)
        return answer(*args, **kwargs)

    setattr(forward, _ANSWERS, True)
    module.forward = types.MethodType(forward, module)
    try:
        yield
    finally:
        if own is None:
            vars(module).pop("forward", None)
        else:
            module.forward = own


@runtime_checkable
class ChunkModel(Protocol):
    """What the engine needs from a model.

    **Attention calls.** ``num_layers`` counts :func:`~lightning_oomb.engine.attention.paged_attention` call slots,
    not blocks: each call in a chunk's forward takes its own ``layer`` index in ``0 .. num_layers - 1`` (a block that
    attends twice takes two; only a checkpoint's recompute calls an index again; an index never called is refused by
    the setup check, :func:`~lightning_oomb.engine.check.check_chunking`). Every layer's ``k, v`` have the
    same dtype and shape, ``[B, kv_heads, L, head_dim]`` (one pool holds them all; with ``layer_kv_heads``, below,
    each layer its own heads and head dim). The op is causal attention with
    the engine's document masks (packed sequences) and, per call, a sliding ``window``, a ``softcap``, ``sinks`` and
    a ``block`` (chunked attention: each query sees its own span of ``block`` tokens); there is no additive score
    bias (ALiBi, relative-position bias) and no custom mask.

    **Optional attributes.** ``layer_windows``: per layer index, the ``window`` its call passes (``None``: full
    attention); window layers then keep only the pages their window reaches, and a call passing another window is
    refused (without it every page is kept); a chunked-attention layer's ``window`` is its ``block``.
    ``layer_kv_heads`` and ``layer_head_dims``: per layer index, its KV heads and its calls' head dim where layers
    differ (each layer's pages then hold its own; the geometry most layers without a window have is the pool's slots',
    which may go to host memory, and a layer of another keeps its pages on the device). ``layer_kv_sources``: per
    layer index, the earlier layer whose very ``k, v`` its call passes (Gemma 4's KV-sharing layers), or ``None``:
    such a layer reads that layer's pages and stores none (a call passing other K/V is refused).
    ``carries_states`` (the module docstring); ``new_step_loss()`` (:class:`StepLoss`); ``packing_refused``: why
    packed documents cannot train exactly (the engine refuses them before any work), or ``None``.

    **Memory plan** (:mod:`~lightning_oomb.engine.planner`: the strategies' setup check, ``oomb plan``). An
    ``nn.Module`` model's parameters are counted exactly, its activations with the Llama-style layer formula read
    off its modules: the hidden size from the LM head, one attention per call slot, one MLP per ``nn.Linear`` that
    projects a wider input back to the hidden size (its down projection; the widest such input is the MLP width),
    so MLP-only blocks count with nothing declared. A model that carries states declares their size with
    ``carried_state_elements() -> (elements in the activations' dtype, float32 elements)`` per batch row and chunk
    boundary (without it they are not counted: the plan's notes say so), and may describe its carried layers with
    ``carried_mixer_shapes()`` (:class:`~lightning_oomb.engine.model_shape.Mixer`: gated delta-net, Mamba2, gated short
    convolution); a carried layer it does not describe saves activations the plan does not count.
    """

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
    ``hidden_states`` (its attention modules call :func:`~lightning_oomb.engine.attention.paged_attention` with their
    layer index when a chunk context is given) and ``lm_head``, and what :class:`ChunkModel` says of attention calls,
    optional attributes and the memory plan applies. This mixin adds: ``engaged`` (nothing to switch), ``answer_calls``
    (inside the strategy's steps, ``model(input_ids, labels=None, position_ids=None, attention_mask=None)`` returns the
    engine's loss tensor — ``forward(input_ids, labels)`` must return that same mean next-token loss, labels unshifted,
    as the setup check verifies; override ``answer_calls`` if it differs), and ``layer_checkpointing``, which the
    strategy sets from its option, as an engine does whose config says ``True`` (checkpoint your blocks in
    ``hidden_states`` when it is on).
    """

    layer_checkpointing: bool = False

    def engaged(self, num_tokens: int) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext()

    @contextlib.contextmanager
    def answer_calls(self, respond: Respond):
        def forward(input_ids, labels=None, position_ids=None, attention_mask=None, **others):
            if others:
                raise OOMBConfigError(
                    f"{type(self).__name__} was called with {sorted(others)} — inside the OOMB strategy's steps "
                    "ManagedModelMixin answers model(input_ids, labels=None, position_ids=None, "
                    "attention_mask=None) with the engine's loss — call it so, or override answer_calls."
                )
            return respond(input_ids, labels, position_ids=position_ids, attention_mask=attention_mask)

        with answered_by(self, forward):
            yield
