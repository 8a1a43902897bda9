"""``reuse_attention``: the forward sweep's attention results, kept in host memory for the backward sweep.

The backward sweep's chunk recompute attends with the same queries to the same pages as the forward sweep did, so
it would compute the same result again. With ``reuse_attention`` the forward sweep copies each layer's output and
log-sum-exp of the step's last chunks into one host buffer (page-locked under CUDA, copied on a side stream that
the compute stream does not wait for), and the backward sweep copies a chunk's results back — all its layers at
once, on the side stream, as the chunk's recompute starts; each layer's call waits only for its own — instead of
attending: a step attends once forward and once backward. The buffer holds one slot per kept chunk and layer, sized
for a whole chunk of the widest layer (a ragged last chunk, a narrower layer use its front), and only grows, across
steps.
"""

from __future__ import annotations

import math

import torch

from lightning_oomb.engine.pages import page_locked_bytes

ALIGN = 64  # bytes: each slot's output and log-sum-exp start on this boundary


def result_slot_bytes(
    batch: int, heads: int, tokens: int, head_dim: int, dtype: torch.dtype, lse: torch.dtype
) -> int:
    """Bytes of one chunk's result of one layer in the buffer: output ``[B, Hq, L, D]`` and log-sum-exp
    ``[B, Hq, L]``, each rounded up to :data:`ALIGN`."""
    out = batch * heads * tokens * head_dim * dtype.itemsize
    return _aligned(out) + _aligned(batch * heads * tokens * lse.itemsize)


def _aligned(n: int) -> int:
    return math.ceil(n / ALIGN) * ALIGN


class ForwardResults:
    """The kept results of the current step (see the module docstring); one per engine."""

    def __init__(self) -> None:
        self._storage: torch.Tensor | None = None
        self._unpin = None
        self.first: int | None = None  # the first kept chunk of the step (None: none kept)
        self._layers = self._tokens = 0
        self._slot = 0
        self._shape: tuple | None = None  # (batch, heads, out dtype, lse dtype)
        self._dims: tuple[int, ...] = ()  # each layer's output head dim
        self._select: dict[tuple[int, int], torch.Tensor | None] = {}
        self._fetched: dict[int, tuple[torch.Tensor, torch.Tensor, object]] = {}
        self._sides: dict[torch.device, torch.cuda.Stream] = {}  # a side stream per device

    @property
    def nbytes(self) -> int:
        return 0 if self._storage is None else self._storage.numel()

    def begin(self, first: int | None, chunk_tokens: int, head_dims: tuple[int, ...]) -> None:
        """A new step: chunks ``first ..`` keep their results (``None``: none), chunks of ``chunk_tokens``
        tokens, attention layers of outputs ``head_dims`` wide."""
        self.first, self._tokens, self._layers, self._dims = first, chunk_tokens, len(head_dims), head_dims
        self._shape = None
        self._select.clear()
        self._fetched.clear()

    def keeps(self, index: int) -> bool:
        """Whether chunk ``index``'s results are kept (forward sweep) or taken (backward sweep)."""
        return self.first is not None and index >= self.first

    def put(self, index: int, layer: int, out: torch.Tensor, lse: torch.Tensor, select, chunks: int) -> None:
        """Copy chunk ``index``'s result of ``layer`` out (``chunks``: the step's number of chunks)."""
        if self._shape is None:
            self._reserve(out, lse, chunks - self.first)
        host_out, host_lse = self._views(index, layer, out.shape[2])
        self._select[index, layer] = select
        if not out.is_cuda:
            host_out.copy_(out)
            host_lse.copy_(lse)
            return
        side = self._stream(out.device)
        side.wait_stream(torch.cuda.current_stream(out.device))
        with torch.cuda.stream(side):
            host_out.copy_(out, non_blocking=True)
            host_lse.copy_(lse, non_blocking=True)
        out.record_stream(side)  # their memory is not reused before the copies are done
        lse.record_stream(side)

    def fetch(self, index: int, tokens: int, device: torch.device) -> None:
        """Start copying chunk ``index``'s results (``tokens`` long) of every layer back to ``device`` (none: the
        model attended nowhere)."""
        if self._shape is None:
            return
        views = [self._views(index, layer, tokens) for layer in range(self._layers)]
        if device.type != "cuda":  # the buffer itself: nothing writes it before the next step's forward sweep
            self._fetched = {layer: (out, lse, None) for layer, (out, lse) in enumerate(views)}
            return
        made = [
            tuple(torch.empty(t.shape, dtype=t.dtype, device=device) for t in pair) for pair in views
        ]  # on the compute stream, which may still use their memory's last owner: the side stream waits for it
        side = self._stream(device)
        side.wait_stream(torch.cuda.current_stream(device))
        self._fetched = {}
        for layer, ((host_out, host_lse), (out, lse)) in enumerate(zip(views, made, strict=True)):
            with torch.cuda.stream(side):
                out.copy_(host_out, non_blocking=True)
                lse.copy_(host_lse, non_blocking=True)
                done = torch.cuda.Event()
                done.record(side)
            out.record_stream(side)
            lse.record_stream(side)
            self._fetched[layer] = (out, lse, done)

    def take(self, index: int, layer: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, tuple]:
        """``(out, lse, page selection, (host out, host lse))`` of chunk ``index``'s ``layer``, fetched (the
        current stream waits for its copy)."""
        out, lse, done = self._fetched.pop(layer)
        if done is not None:
            torch.cuda.current_stream(out.device).wait_event(done)
        return out, lse, self._select[index, layer], self._views(index, layer, out.shape[2])

    def free(self) -> None:
        """Unpin and drop the buffer (the next step makes a new one)."""
        if self._unpin is not None:
            self._unpin()
        self._storage = self._unpin = None
        self._fetched.clear()

    def _reserve(self, out: torch.Tensor, lse: torch.Tensor, kept: int) -> None:
        batch, heads = out.shape[:2]
        self._shape = (batch, heads, out.dtype, lse.dtype)
        self._slot = result_slot_bytes(batch, heads, self._tokens, max(self._dims), out.dtype, lse.dtype)
        total = kept * self._layers * self._slot
        if self._storage is None or self._storage.numel() < total:
            self.free()
            self._storage, self._unpin = page_locked_bytes(total, self, out.device)

    def _views(self, index: int, layer: int, tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
        batch, heads, dtype, lse_dtype = self._shape
        head_dim = self._dims[layer]
        start = ((index - self.first) * self._layers + layer) * self._slot
        out_bytes = batch * heads * tokens * head_dim * dtype.itemsize
        lse_at = start + _aligned(batch * heads * self._tokens * max(self._dims) * dtype.itemsize)
        out = self._storage[start : start + out_bytes].view(dtype).view(batch, heads, tokens, head_dim)
        lse = self._storage[lse_at : lse_at + batch * heads * tokens * lse_dtype.itemsize]
        return out, lse.view(lse_dtype).view(batch, heads, tokens)

    def _stream(self, device: torch.device) -> torch.cuda.Stream:
        if device not in self._sides:
            self._sides[device] = torch.cuda.Stream(device)
        return self._sides[device]
