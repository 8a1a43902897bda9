"""Carried states: what a model's recurrent, linear-attention and convolution layers hand from chunk to chunk.

A layer that mixes tokens through a state (a Mamba or gated-delta recurrence, a short causal convolution) sees the
past only through that state, so chunking is exact if each chunk starts from the state the previous one ended in,
and the state's gradient flows back the same way. The **forward sweep** keeps every such state at every chunk
boundary, detached: ``O(state)`` per chunk boundary and layer, never ``O(N)`` activations. The **backward sweep**
recomputes chunk ``c`` from its stored incoming states, made leaves that require grad, back-propagates the chunk's
loss together with the gradients that its outgoing states received from chunk ``c + 1``, and hands the incoming
leaves' gradients on to chunk ``c - 1`` — the pattern of the KV gradient pages, for a state instead of pages.

A model's layer reads :meth:`ChunkStates.incoming` (``None`` in the first chunk) and reports its final state with
:meth:`ChunkStates.outgoing`; keys are any hashable naming the layer's state, e.g. ``(layer_idx, "conv", 0)``. A
layer's second call in one chunk (the recompute of per-layer checkpointing) reads the same incoming leaves and
its report is ignored: the first is the one in the chunk's graph.
"""

from __future__ import annotations

from collections.abc import Hashable

import torch


class ChunkStates:
    """One chunk's incoming states and the outgoing states its layers report (:mod:`lightning_oomb.engine.states`)."""

    def __init__(self, incoming: dict[Hashable, torch.Tensor]) -> None:
        self._incoming = incoming
        self.reported: dict[Hashable, torch.Tensor] = {}

    @property
    def continues(self) -> bool:
        """Whether the chunk continues a sequence (it has incoming states; ``False`` in the first chunk)."""
        return bool(self._incoming)

    def incoming(self, key: Hashable) -> torch.Tensor | None:
        """The state ``key`` this chunk starts from (``None``: the sequence starts here, the layer's zero state)."""
        return self._incoming.get(key)

    def outgoing(self, key: Hashable, state: torch.Tensor) -> None:
        """Report the state ``key`` after the chunk's last token (the first report of a key in a chunk counts)."""
        self.reported.setdefault(key, state)


class CarriedStates:
    """One step's states at its chunk boundaries (see the module docstring).

    Args:
        keep: the forward sweep keeps every boundary's states for the backward sweep (``False``: evaluation, only
            the previous chunk's states are held).
    """

    def __init__(self, keep: bool = True) -> None:
        self.keep = keep
        self._stored: dict[int, dict[Hashable, torch.Tensor]] = {}
        self._grads: dict[Hashable, torch.Tensor] = {}
        self._leaves: dict[Hashable, torch.Tensor] = {}

    @property
    def nbytes(self) -> int:
        """Bytes of the storages the held states keep alive (every chunk boundary's after a forward sweep)."""
        return sum(t.untyped_storage().nbytes() for states in self._stored.values() for t in states.values())

    def forward_chunk(self, index: int) -> ChunkStates:
        """Chunk ``index`` of a forward sweep: its incoming states (without graph)."""
        incoming = self._stored.get(index, {}) if self.keep else self._stored.pop(index, {})
        return ChunkStates(incoming)

    def finish_forward(self, index: int, chunk: ChunkStates) -> None:
        """Keep what chunk ``index`` (not the last) reported as the next chunk's incoming states: copies, so a state
        that is a view (e.g. a convolution input's last columns) does not keep its whole base alive."""
        self._stored[index + 1] = {key: state.detach().clone() for key, state in chunk.reported.items()}

    def backward_chunk(self, index: int) -> ChunkStates:
        """Chunk ``index`` of the backward sweep: its stored incoming states as leaves that require grad (freed
        from the store)."""
        stored = self._stored.pop(index, {})
        self._leaves = {key: state.detach().requires_grad_(True) for key, state in stored.items()}
        return ChunkStates(self._leaves)

    def boundary_gradients(self, chunk: ChunkStates) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """The chunk's outgoing states and the gradients the next chunk handed them, to back-propagate with the
        chunk's loss."""
        pairs = [(chunk.reported[key], grad) for key, grad in self._grads.items() if key in chunk.reported]
        pairs = [(state, grad.to(state.dtype)) for state, grad in pairs if state.requires_grad]
        return [state for state, _ in pairs], [grad for _, grad in pairs]

    def finish_backward(self, chunk: ChunkStates) -> None:
        """Hand the incoming leaves' gradients on to the previous chunk, and drop the chunk's outgoing states: they
        hold its graph, whose nodes (a checkpoint's saved arguments) may hold the chunk's context and so these
        states — a cycle through autograd that Python's collector cannot see."""
        self._grads = {key: leaf.grad for key, leaf in self._leaves.items() if leaf.grad is not None}
        self._leaves = {}
        chunk.reported.clear()
