"""Measure activation memory: bytes of tensors that autograd holds for backward."""

from __future__ import annotations

import weakref

import torch


class _Saved:
    """Holder autograd keeps instead of the tensor, so its release can be observed."""

    __slots__ = ("tensor", "__weakref__")

    def __init__(self, tensor: torch.Tensor):
        self.tensor = tensor


class SavedTensorMeter(torch.autograd.graph.saved_tensors_hooks):
    """Context manager: tracks bytes saved by autograd (``current``) and their maximum (``peak``).

    Every model call inside the block is measured, including the recompute that the OOMB backward sweep runs
    when ``loss.backward()`` is called inside the block. Tensors are counted once per save (a tensor saved by
    two ops counts twice), which is what autograd keeps referencing.
    """

    def __init__(self) -> None:
        self.current = 0
        self.peak = 0
        super().__init__(self._pack, self._unpack)

    def __enter__(self) -> SavedTensorMeter:
        super().__enter__()
        return self

    def _pack(self, tensor: torch.Tensor) -> _Saved:
        nbytes = tensor.numel() * tensor.element_size()
        self.current += nbytes
        self.peak = max(self.peak, self.current)
        holder = _Saved(tensor)
        weakref.finalize(holder, self._free, nbytes)
        return holder

    def _free(self, nbytes: int) -> None:
        self.current -= nbytes

    @staticmethod
    def _unpack(holder: _Saved) -> torch.Tensor:
        return holder.tensor
