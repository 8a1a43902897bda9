"""Memory facts: host memory available (``MemAvailable``), and activation memory — bytes of tensors that autograd
holds for backward."""

from __future__ import annotations

import weakref
from collections.abc import Iterable

import torch

HOST_RESERVE_BYTES = 2 << 30  # host memory never pinned: left to the OS, the data loader and Python


def host_memory_available() -> int | None:
    """``MemAvailable`` of ``/proc/meminfo`` in bytes; ``None`` where it cannot be read (not Linux)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


class _Held:
    """What autograd keeps instead of a saved tensor while the meter watches, so its release is observed."""

    __slots__ = ("tensor", "__weakref__")

    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor = tensor


class SavedTensorMeter(torch.autograd.graph.saved_tensors_hooks):
    """Context manager: bytes autograd holds for backward, live (``current``) and at their maximum (``peak``).

    Each storage counts once, from when a graph first saves it until the last graph node holding it is freed;
    storages of ``exclude`` (e.g. the parameters) never count. Every model call inside the block is measured,
    including the recompute that the OOMB backward sweep runs when ``loss.backward()`` is called inside it.
    """

    def __init__(self, exclude: Iterable[torch.Tensor] = ()) -> None:
        super().__init__(self._pack, self._unpack)
        self.exclude = {t.untyped_storage().data_ptr() for t in exclude}
        self.holders: dict[int, int] = {}
        self.current = self.peak = 0

    def __enter__(self) -> SavedTensorMeter:
        super().__enter__()
        return self

    def _pack(self, tensor: torch.Tensor) -> object:
        storage = tensor.untyped_storage()
        ptr = storage.data_ptr()
        if ptr in self.exclude:
            return tensor
        if not self.holders.get(ptr):
            self.current += storage.nbytes()
            self.peak = max(self.peak, self.current)
        self.holders[ptr] = self.holders.get(ptr, 0) + 1
        held = _Held(tensor)
        weakref.finalize(held, self._release, ptr, storage.nbytes())
        return held

    def _release(self, ptr: int, nbytes: int) -> None:
        self.holders[ptr] -= 1
        if not self.holders[ptr]:
            del self.holders[ptr]
            self.current -= nbytes

    @staticmethod
    def _unpack(held: object) -> torch.Tensor:
        return held.tensor if isinstance(held, _Held) else held
