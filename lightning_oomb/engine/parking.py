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

import functools
import weakref
from collections.abc import Iterable

import torch

MIN_BYTES = 1 << 20  # smaller saved tensors stay where they are
DEVICE_TYPES = ("cuda",)  # where the engine parks (a CPU's host memory is its device memory)


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


class _Parked:
    """One saved tensor in host memory (page-locked from CUDA), with its way back."""

    def __init__(self, t: torch.Tensor, index: int) -> None:
        self.index, self.device, self.version = index, t.device, t._version
        self.host = torch.empty_strided(t.size(), t.stride(), dtype=t.dtype, pin_memory=t.is_cuda)
        self.copied = None  # from CUDA: the event after the copy out
        if t.is_cuda:
            self.copied = copy_aside(t.device, [(self.host, t)])
        else:
            self.host.copy_(t)
        self._ahead: tuple[torch.Tensor, torch.cuda.Event] | None = None
        self._back = lambda: None  # the device tensor handed out last (alive while autograd uses it)
        self._taken = False

    def prefetch(self) -> None:
        """Start the copy back (CUDA), unless under way or taken already."""
        if self.copied is None or self._ahead is not None or self._taken:
            return
        made = torch.empty_strided(
            self.host.size(), self.host.stride(), dtype=self.host.dtype, device=self.device
        )
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
        elif self.copied is not None:
            torch.cuda.current_stream(self.device).wait_event(self.copied)
            tensor = self.host.to(self.device, non_blocking=True, copy=True)
        else:  # a CPU device: the host copy is the tensor
            tensor = self.host
        self._back, self._taken = weakref.ref(tensor), True
        return tensor


class Parking:
    """The parked tensors of one :class:`ParkedSaves` and its hooks. The hooks are this object's methods, not the
    context manager's (whose ``pack_hook`` attribute would then point back at it): no reference cycle, so the host
    copies are freed with the graph that holds them, not at Python's next full garbage collection."""

    def __init__(self, device: torch.device, min_bytes: int) -> None:
        self.device, self.min_bytes = device, min_bytes
        self.parked: list[_Parked] = []  # in the order of parking
        self._by_tensor: dict[int, tuple[weakref.ref, _Parked]] = {}

    @property
    def nbytes(self) -> int:
        """Host bytes of the parked tensors."""
        return sum(p.host.numel() * p.host.element_size() for p in self.parked)

    def pack(self, t: torch.Tensor) -> torch.Tensor | _Parked:
        if not parkable(t, self.device, self.min_bytes):
            return t
        known = self._by_tensor.get(id(t))
        if known is not None and known[0]() is t and known[1].version == t._version:
            return known[1]
        parked = _Parked(t, len(self.parked))
        self.parked.append(parked)
        self._by_tensor[id(t)] = (weakref.ref(t), parked)
        return parked

    def unpack(self, packed: torch.Tensor | _Parked) -> torch.Tensor:
        if not isinstance(packed, _Parked):
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
