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
its report is ignored: the first is the one in the chunk's graph. A state reported with ``grad=False`` is carried
forward but takes no gradient (a stop-gradient by design, e.g. a Transformer-XL memory): the next chunk gets it as
a leaf without grad and the engine back-propagates nothing into it. What would train silently wrong is refused: a
later chunk reading a key the previous one did not report; a reported state whose shape or dtype differs from the
one the chunk started from (the next chunk would compute with a broadcast or recast state) or that has no
dimension of the batch size; a read state cut from the graph (no gradient reaches its leaf); and a reported state
without grad that the next chunk's gradient should flow into — when the chunk read a state that carries grad, or
every parameter trains (else it may depend on nothing trainable, e.g. a frozen layer's convolution input in the
first chunk).

With ``offload=True`` the kept states wait in page-locked host memory (:class:`HostStates`, one buffer for all of
a step's boundaries): the forward sweep copies each boundary's states out once and keeps on the device only those
the next chunk starts from; the backward sweep copies a chunk's back before its recompute. The copies are
asynchronous on the current stream, which orders each after the state it reads and before the recompute reading
it; the buffer is only rewritten by the next step's forward sweep, after every copy back.
"""

from __future__ import annotations

import math
from collections.abc import Hashable

import torch

from lightning_oomb.engine.errors import OOMBConfigError
from lightning_oomb.engine.pages import page_locked_bytes

BOUNDARY_ALIGN = 8  # bytes: every boundary's states start at a multiple, so each dtype's view is aligned


class ChunkStates:
    """One chunk's incoming states (``None``: the first chunk, which has none) and the outgoing states its layers
    report (:mod:`lightning_oomb.engine.states`)."""

    def __init__(self, incoming: dict[Hashable, torch.Tensor] | None, batch: int | None = None) -> None:
        self._incoming = incoming
        self._batch = batch  # the step's batch size (None: not checked)
        self.reported: dict[Hashable, torch.Tensor] = {}
        self.stopped: set[Hashable] = set()  # the reported keys that take no gradient (grad=False)
        self.read: set[Hashable] = set()  # the keys its layers asked for

    @property
    def continues(self) -> bool:
        """Whether the chunk continues a sequence (``False`` in the first chunk)."""
        return self._incoming is not None

    def incoming(self, key: Hashable) -> torch.Tensor | None:
        """The state ``key`` this chunk starts from (``None``: the sequence starts here, the layer's zero state).

        A later chunk asking for a key the previous chunk did not report is refused: the layer would restart from
        its zero state in mid-sequence."""
        if self._incoming is None:
            return None
        state = self._incoming.get(key)
        if state is None:
            reported = ", ".join(sorted(map(repr, self._incoming))) or "none"
            raise OOMBConfigError(
                f"a chunk reads the carried state {key!r}, which the previous chunk did not report (it reported "
                f"{reported}) — the layer would restart from its zero state in mid-sequence and train silently "
                "wrong — report the state after each chunk's last token with "
                f"chunk.states.outgoing({key!r}, state), under the key the next chunk reads (only a sequence's "
                "first chunk gets None from incoming)."
            )
        self.read.add(key)
        return state

    def outgoing(self, key: Hashable, state: torch.Tensor, grad: bool = True) -> None:
        """Report the state ``key`` after the chunk's last token (the first report of a key in a chunk counts), in
        the shape and dtype the chunk got it in. ``grad=False``: the model stops the state's gradient by design
        (e.g. a Transformer-XL memory): the next chunk gets it without grad, and nothing is back-propagated into
        it (nor is it refused for having no grad)."""
        if key in self.reported:
            return
        self._check_shape(key, state)
        self.reported[key] = state
        if not grad:
            self.stopped.add(key)

    def _check_shape(self, key: Hashable, state: torch.Tensor) -> None:
        """Refuse a state whose shape or dtype differs from the incoming one, or with no batch-size dimension."""
        fix = (
            f"report the whole state after the chunk's last token, e.g. chunk.states.outgoing({key!r}, h) with h "
            "of shape [batch, ...], in the same shape and dtype in every chunk (no slice or broadcastable view "
            "of it; cast it back to the dtype it came in)."
        )
        before = None if self._incoming is None else self._incoming.get(key)
        if before is not None and (before.shape, before.dtype) != (state.shape, state.dtype):
            raise OOMBConfigError(
                f"a chunk reports the carried state {key!r} as {tuple(state.shape)} {state.dtype}, but started from "
                f"it as {tuple(before.shape)} {before.dtype} (what the previous chunk reported) — the next chunk "
                "would compute with a broadcast or recast state and train silently wrong — " + fix
            )
        if self._batch is not None and self._batch > 1 and self._batch not in state.shape:
            raise OOMBConfigError(
                f"the carried state {key!r} is reported as {tuple(state.shape)}, with no dimension of the batch size "
                f"{self._batch} — every sequence carries its own state, so this one would be broadcast over the "
                "batch and train silently wrong — " + fix
            )


def boundary_bytes(states: dict[Hashable, torch.Tensor]) -> int:
    """Bytes one boundary's states take in :class:`HostStates` (their sum, rounded up to ``BOUNDARY_ALIGN``)."""
    total = sum(t.numel() * t.element_size() for t in states.values())
    return math.ceil(total / BOUNDARY_ALIGN) * BOUNDARY_ALIGN


class HostStates:
    """Chunk boundaries' states in one page-locked host buffer, ``boundaries x boundary_bytes``; a boundary's states
    lie back to back, widest dtype first (so each view is aligned). The buffer only grows, across steps."""

    def __init__(self) -> None:
        self._storage: torch.Tensor | None = None
        self._unpin = None
        self._layout: dict[Hashable, tuple[int, torch.Size, torch.dtype]] = {}
        self._stride = 0
        self.device: torch.device | None = None

    @property
    def nbytes(self) -> int:
        return 0 if self._storage is None else self._storage.numel()

    def reserve(self, boundaries: int, states: dict[Hashable, torch.Tensor]) -> None:
        """Lay out ``states`` (one boundary's, as every boundary of the step reports them) for ``boundaries``."""
        offset, self._layout = 0, {}
        for key, t in sorted(states.items(), key=lambda kv: -kv[1].element_size()):
            self._layout[key] = (offset, t.shape, t.dtype)
            offset += t.numel() * t.element_size()
        self._stride, self.device = boundary_bytes(states), next(iter(states.values())).device
        if self._storage is None or self._storage.numel() < boundaries * self._stride:
            self.free()
            self._storage, self._unpin = page_locked_bytes(boundaries * self._stride, self, self.device)

    def fits(self, states: dict[Hashable, torch.Tensor]) -> bool:
        """Whether ``states`` have the reserved layout (every boundary of a step has)."""
        return states.keys() == self._layout.keys() and all(
            (t.shape, t.dtype, t.device) == (*self._layout[k][1:], self.device) for k, t in states.items()
        )

    def put(self, boundary: int, states: dict[Hashable, torch.Tensor]) -> None:
        """Copy boundary ``boundary``'s states (the ones chunk ``boundary`` starts from) out."""
        for key, state in states.items():
            self._view(boundary, key).copy_(state, non_blocking=True)

    def get(self, boundary: int) -> dict[Hashable, torch.Tensor]:
        """Boundary ``boundary``'s states, copied back to the device they came from."""
        return {
            key: self._view(boundary, key).to(self.device, non_blocking=True, copy=True)
            for key in self._layout
        }

    def _view(self, boundary: int, key: Hashable) -> torch.Tensor:
        offset, shape, dtype = self._layout[key]
        start = (boundary - 1) * self._stride + offset
        return self._storage[start : start + math.prod(shape) * dtype.itemsize].view(dtype).view(shape)

    def free(self) -> None:
        """Unpin and drop the buffer (the next :meth:`reserve` makes a new one)."""
        if self._unpin is not None:
            self._unpin()  # synchronizes first: no copy may still use it
        self._storage = self._unpin = None


class CarriedStates:
    """One step's states at its chunk boundaries (see the module docstring).

    Args:
        keep: the forward sweep keeps every boundary's states for the backward sweep (``False``: evaluation, only
            the previous chunk's states are held).
        host: where the kept states wait for the backward sweep (``offload=True``); ``None``: on their device.
        boundaries: the step's chunk boundaries (chunks - 1), what ``host`` is reserved for.
    """

    def __init__(
        self, keep: bool = True, host: HostStates | None = None, boundaries: int = 0, batch: int | None = None
    ) -> None:
        self.keep, self.host, self.boundaries, self.batch = keep, host, boundaries, batch
        self._stored: dict[int, dict[Hashable, torch.Tensor]] = {}
        self._stopped: dict[int, frozenset] = {}  # per boundary, the keys reported with grad=False
        self._on_host: set[int] = set()
        self._grads: dict[Hashable, torch.Tensor] = {}
        self._leaves: dict[Hashable, torch.Tensor] = {}
        # backward sweep: the running chunk's stopped keys (grad=False), incoming and outgoing (None: the last chunk)
        self._in_stopped: frozenset | None = None
        self._out_stopped: frozenset | None = None

    @property
    def nbytes(self) -> int:
        """Bytes of the storages the held states keep alive on their device (after a forward sweep every chunk
        boundary's, none with ``host``)."""
        return sum(t.untyped_storage().nbytes() for states in self._stored.values() for t in states.values())

    @property
    def host_nbytes(self) -> int:
        """Bytes of the host buffer holding this step's states (0 without ``host``)."""
        return self.host.nbytes if self._on_host else 0

    def forward_chunk(self, index: int) -> ChunkStates:
        """Chunk ``index`` of a forward sweep: its incoming states (without graph)."""
        later = self.keep and index not in self._on_host  # the backward sweep reads them from here
        return ChunkStates(
            None if index == 0 else self._stored.get(index) if later else self._stored.pop(index), self.batch
        )

    def finish_forward(self, index: int, chunk: ChunkStates) -> None:
        """Keep what chunk ``index`` (not the last) reported as the next chunk's incoming states: copies, so a state
        that is a view (e.g. a convolution input's last columns) does not keep its whole base alive; with ``host``,
        copied out too, for the backward sweep."""
        states = {key: state.detach().clone() for key, state in chunk.reported.items()}
        self._stored[index + 1] = states
        if self.keep:
            self._stopped[index + 1] = frozenset(chunk.stopped)
        if self.host is None or not self.keep or not states:
            return
        if index == 0:
            self.host.reserve(self.boundaries, states)
        if self.host.fits(states):
            self.host.put(index + 1, states)
            self._on_host.add(index + 1)

    def backward_chunk(self, index: int) -> ChunkStates:
        """Chunk ``index`` of the backward sweep: its stored incoming states as leaves that require grad (freed
        from the store), but those reported with ``grad=False``."""
        stored = self.host.get(index) if index in self._on_host else self._stored.pop(index, {})
        self._on_host.discard(index)
        stopped = self._stopped.pop(index, frozenset())
        self._out_stopped, self._in_stopped = self._in_stopped, stopped
        self._leaves = {
            key: state.detach().requires_grad_(key not in stopped) for key, state in stored.items()
        }
        return ChunkStates(None if index == 0 else self._leaves, self.batch)

    def boundary_gradients(
        self, chunk: ChunkStates, all_trainable: bool
    ) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """The chunk's outgoing states and the gradients the next chunk handed them, to back-propagate with the
        chunk's loss. A state without grad would drop its gradient: refused when the chunk read a state that
        carries grad (the recurrence was cut: detached, or computed under ``no_grad``) or every parameter of the
        model trains (``all_trainable``); else it may depend on nothing trainable (e.g. a frozen layer's
        convolution input in the first chunk), and is left alone. States reported with ``grad=False`` take none."""
        if self._out_stopped is not None:
            for key in chunk.reported:
                if (key in chunk.stopped) != (key in self._out_stopped):
                    raise OOMBConfigError(
                        f"the carried state {key!r} was reported with grad={key not in self._out_stopped} in the "
                        f"forward sweep but grad={key not in chunk.stopped} when the backward sweep recomputed the "
                        "chunk — the engine would carry its gradient one way and back-propagate it the other — "
                        "report each state with the same grad= whether or not grad is enabled."
                    )
        read = sorted(repr(key) for key in chunk.read if self._leaves[key].requires_grad)
        states, grads = [], []
        for key, grad in self._grads.items():
            state = chunk.reported.get(key)
            if state is None:
                raise OOMBConfigError(
                    f"the carried state {key!r} was reported in the forward sweep but not when the backward sweep "
                    "recomputed the chunk — its gradient from the next chunk has nowhere to go — report the same "
                    "states whether or not grad is enabled (the recompute must repeat the forward computation)."
                )
            if state.requires_grad:
                states.append(state)
                grads.append(grad.to(state.dtype))
            elif read or all_trainable:
                why = (
                    "every parameter trains"
                    if all_trainable
                    else f"the chunk read the incoming state{'s' * (len(read) > 1)} {', '.join(read)} (with grad)"
                )
                raise OOMBConfigError(
                    f"the carried state {key!r} was reported without grad (detached, or computed under "
                    f"torch.no_grad or inside a reentrant checkpoint) although {why} — the gradient the next "
                    "chunk hands it would be dropped and the earlier chunks' gradients would be silently wrong — "
                    "report the state as computed, in the graph: no .detach(), and checkpoint(..., "
                    "use_reentrant=False) (a frozen layer's convolution state: the last columns of "
                    "torch.cat([incoming, inputs], -1)); if the model stops its gradient by design (a "
                    f"Transformer-XL memory), report it with chunk.states.outgoing({key!r}, state, grad=False)."
                )
        return states, grads

    def finish_backward(self, chunk: ChunkStates) -> None:
        """Hand the incoming leaves' gradients on to the previous chunk, and drop the chunk's outgoing states: they
        hold its graph, whose nodes (a checkpoint's saved arguments) may hold the chunk's context and so these
        states — a cycle through autograd that Python's collector cannot see. A state the chunk read whose leaf
        got no gradient (but one reported with ``grad=False``) is refused: the model cut it from the graph, so none
        flows back to the earlier chunks."""
        for key in chunk.read:
            if self._leaves[key].requires_grad and self._leaves[key].grad is None:
                raise OOMBConfigError(
                    f"the chunk read the carried state {key!r} but no gradient reached it (detached after "
                    "chunk.states.incoming, or used under torch.no_grad) — the earlier chunks would get none "
                    "through it and train silently wrong — compute from the state as incoming returns it."
                )
        self._grads = {key: leaf.grad for key, leaf in self._leaves.items() if leaf.grad is not None}
        self._leaves = {}
        chunk.reported.clear()
