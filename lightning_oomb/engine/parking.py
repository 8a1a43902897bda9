"""Under ``offload`` with per-layer checkpointing, what a chunk's recompute holds for its backward waits in
page-locked host memory.

With per-layer checkpointing the backward sweep's chunk recompute holds, per decoder layer until that layer's
backward, its input (the checkpoint's recompute starts from it; torch's non-reentrant checkpoint saves it through
the saved-tensor hooks around it) and its attention result (:class:`~lightning_oomb.engine.attention.Kept`).
Under offload both are parked: copied out on a side stream as they are made (the compute stream does not wait),
and back on it one ahead of need — the backward takes them in the reverse order of their making — so the device
holds two at a time instead of every layer's (Qwen2.5-7B, chunk 4096: 28 inputs of 29 MB and the final norm's
87 MB, 0.9 GiB, besides the kept results' 0.8 GiB).
"""

from __future__ import annotations

import collections
import functools
import weakref
from collections.abc import Iterable

import torch

MIN_BYTES = 1 << 20  # smaller saved tensors stay where they are
DEVICE_TYPES = ("cuda",)  # where the engine parks (a CPU's host memory is its device memory)
_parked: collections.Counter = collections.Counter()  # bytes parked per device, ever (see parked_bytes)


def parked_bytes(device: torch.device) -> int:
    """Bytes this process has parked from ``device`` so far (each copied to host memory and back once); the engine
    reports a step's share."""
    return _parked[torch.device(device)]


def copy_aside(device: torch.device, pairs: Iterable[tuple[torch.Tensor, torch.Tensor]]) -> torch.cuda.Event:
    """Copy each ``(dst, src)`` pair on ``device``'s parking stream after the work queued so far on the current
    stream (the last user of a fresh tensor's memory); the device tensors' memory is not reused before the copies
    are done. Returns the event after them."""
    side = _parking_stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):
        for dst, src in pairs:
            dst.copy_(src, non_blocking=True)
            (dst if dst.is_cuda else src).record_stream(side)
    return side.record_event()


@functools.cache
def _parking_stream(device: torch.device) -> torch.cuda.Stream:
    """The side stream that parks tensors from ``device`` and brings them back (one per device)."""
    return torch.cuda.Stream(device)


def parkable(t: torch.Tensor, device: torch.device, min_bytes: int) -> bool:
    """Whether a saved ``t`` is parked: an activation on ``device`` (no leaf: not a parameter or an input) that
    owns its memory (not a view into a page arena or a bigger tensor) of at least ``min_bytes``."""
    nbytes = t.numel() * t.element_size()
    return (
        t.device == device
        and not t.is_leaf
        and nbytes >= min_bytes
        and t.untyped_storage().nbytes() == nbytes
    )


class ParkedTensor:
    """One tensor of ``device`` in host memory (page-locked from CUDA), with its way back: :meth:`prefetch` starts
    the copy back on the parking stream, :meth:`take` hands the tensor out on ``device`` again (the current stream
    waiting for its copy). ``copied``: the event after which the host copy is valid (``None``: valid now)."""

    def __init__(self, host: torch.Tensor, device: torch.device, copied=None, index: int = 0) -> None:
        self.host, self.device, self.copied, self.index = host, device, copied, index
        self.version = 0  # the parked tensor's in-place version when parked
        self._ahead: tuple[torch.Tensor, torch.cuda.Event] | None = None
        self._back = lambda: None  # the device tensor handed out last (alive while autograd uses it)
        self._taken = False

    @classmethod
    def out_of(cls, t: torch.Tensor, index: int = 0) -> ParkedTensor:
        """``t`` copied into host memory (from CUDA on the parking stream: the compute stream does not wait)."""
        host = torch.empty(t.shape, dtype=t.dtype, pin_memory=t.is_cuda)
        if t.is_cuda:
            parked = cls(host, t.device, copy_aside(t.device, [(host, t)]), index)
        else:
            parked = cls(host.copy_(t), t.device, None, index)
        parked.version = t._version
        _parked[t.device] += t.numel() * t.element_size()
        return parked

    def prefetch(self) -> None:
        """Start the copy back (CUDA), unless under way or taken already; it follows the host copy's ``copied``
        (recorded on the parking stream, or on the current stream, which the parking stream waits for)."""
        if self.device.type != "cuda" or self._ahead is not None or self._taken:
            return
        made = torch.empty(self.host.shape, dtype=self.host.dtype, device=self.device)
        self._ahead = made, copy_aside(self.device, [(made, self.host)])

    def take(self) -> torch.Tensor:
        """The tensor on its device again (the current stream waits for its copy back)."""
        tensor = self._back()
        if tensor is not None:
            return tensor
        if self._ahead is not None:
            tensor, done = self._ahead
            self._ahead = None
            torch.cuda.current_stream(self.device).wait_event(done)
        elif self.device.type == "cuda":
            if self.copied is not None:
                torch.cuda.current_stream(self.device).wait_event(self.copied)
            tensor = self.host.to(self.device, non_blocking=True, copy=True)
        else:  # a CPU device: a copy (the host tensor may be another owner's buffer)
            tensor = self.host.clone()
        self._back, self._taken = weakref.ref(tensor), True
        return tensor


class Parking:
    """The parked tensors of one :class:`ParkedSaves` and its hooks. The hooks are this object's methods, not the
    context manager's (whose ``pack_hook`` attribute would then point back at it): no reference cycle, so the host
    copies are freed with the graph that holds them, not at Python's next full garbage collection."""

    def __init__(self, device: torch.device, min_bytes: int) -> None:
        self.device, self.min_bytes = device, min_bytes
        self.parked: list[ParkedTensor] = []  # in the order of parking
        self._by_tensor: dict[int, tuple[weakref.ref, ParkedTensor]] = {}

    @property
    def nbytes(self) -> int:
        """Host bytes of the parked tensors."""
        return sum(p.host.numel() * p.host.element_size() for p in self.parked)

    def pack(self, t: torch.Tensor) -> torch.Tensor | ParkedTensor:
        if not parkable(t, self.device, self.min_bytes):
            return t
        known = self._by_tensor.get(id(t))
        if known is not None and known[0]() is t and known[1].version == t._version:
            return known[1]
        parked = ParkedTensor.out_of(t, len(self.parked))
        self.parked.append(parked)
        self._by_tensor[id(t)] = (weakref.ref(t), parked)
        return parked

    def unpack(self, packed: torch.Tensor | ParkedTensor) -> torch.Tensor:
        if not isinstance(packed, ParkedTensor):
            return packed
        if packed.index > 0:
            self.parked[packed.index - 1].prefetch()
        return packed.take()


class ParkedSaves(torch.autograd.graph.saved_tensors_hooks):
    """Context manager: the tensors autograd saves inside it that are :func:`parkable` wait in host memory until
    the backward takes them (see the module docstring); taking one starts bringing back the one parked before it.
    A tensor saved twice (e.g. by two ops) is parked once. ``state``: the parked tensors (:class:`Parking`). (While
    it runs, saved-tensor hooks entered before it — e.g. a :class:`~lightning_oomb.engine.memory.SavedTensorMeter` —
    see none of its saves: torch applies the innermost hooks only.)"""

    def __init__(self, device: torch.device, min_bytes: int | None = None) -> None:
        self.state = Parking(device, MIN_BYTES if min_bytes is None else min_bytes)
        super().__init__(self.state.pack, self.state.unpack)
