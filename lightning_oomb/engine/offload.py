"""Streaming host-tier layers through fixed-size device staging buffers: streams, events, prefetch, write-back.

The pool (:mod:`lightning_oomb.engine.kv_pool`) places whole layers in the HBM tier or the host tier. A host layer
is cut into **blocks** of one chunk each (block ``j`` = the pages of chunk ``j``, tokens ``[j * C, (j + 1) * C)``)
and used through ``staging_buffers`` device **staging buffers** that each hold one block (K, V, dK, dV). The
attention op attends block by block and merges the parts by log-sum-exp, so the device memory of offload is
``staging_buffers * block_bytes``, fixed by the chunk size, whatever the sequence length: the Qwen2.5-7B shape
(4 KV heads, head dim 128, bf16 K/V, fp32 gradients) at C = 4096 needs 24 MiB per buffer. The rest on the device
is per-page metadata (page tables).

**A layer's stream** (one attention call, chunk ``s``): the chunk's own block ``s`` first — its K/V are written
by the compute stream (:meth:`Offloader.begin_write`), never copied in — then the prefix blocks ``0 .. s-1``
from the host. Forward and eval sweeps: each chunk's new K/V go to the host right after they are written (the
only write-back of K/V ever: they never change afterwards). Backward sweep: the recompute and the backward
restage the chunk's K/V from the op's saved tensors (no host traffic); a prefix block comes in with its gradient
pages, the kernel adds into them and they go back to the host at once (dirty tracking: a block's gradient pages
are written back only after adds, its K/V never). The chunk's own gradient pages come in (accumulated by later
chunks) or are zero-filled on the device while the host holds none, and are handed to autograd, not written back.

**Ordering** (CUDA; on CPU the same steps run synchronously and events are ``None``). Compute runs on the current
stream; copies run on two side streams, ``h2d`` and ``d2h``, so both directions move at once. Events:

- ``buffer.ready`` (h2d): copies into a buffer are done — compute waits before any use of the buffer.
- ``buffer.flushed`` (d2h): copies out of a buffer are done — compute waits before writing into it (K/V write,
  gradient adds), and a refill waits before overwriting it.
- a compute event recorded when a buffer is refilled — h2d waits on it, so the kernels that used the old content
  (all enqueued before the refill is decided: the block in use is never a refill target) are done; likewise one
  recorded right before a write-back — d2h waits on it, so pages leave only after the writes or adds into them.
- per host block, the last copy into (``host_written``) and out of (``host_read``) its host pages — a copy in
  waits for a pending write-back of the same block, a write-back for pending reads of its pages.
Only persistent arenas cross streams; the staging arena is ``record_stream``-ed on both side streams, so the
caching allocator cannot hand it out while a copy is in flight even if the pool is dropped without ``release()``.

**Prefetch.** At every pool access (HBM layers included) the offloader walks the predicted block accesses — the
rest of the current stream, then the next layers' streams — and stages them into buffers that nothing upcoming
needs, until none is free. Sweep order: forward and eval sweeps climb the layers, chunk after chunk; the backward
sweep recomputes climbing and back-propagates descending, and with ``layer_checkpointing`` each layer's forward is
recomputed right before its backward (so the same layer is streamed twice). Correctness never depends on a
prediction: a miss stages on demand, a wrong guess costs bandwidth. Two buffers work (the chunk's block and one
prefix block, copied on demand); three overlap copies in with compute; four (the default) also overlap
write-backs.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, NamedTuple

import torch

if TYPE_CHECKING:
    from lightning_oomb.engine.kv_pool import Arena, PoolShape

_PARTS = {"kv": ("k", "v"), "grad": ("dk", "dv")}


class Transfer(NamedTuple):
    """One copy between the host tier and a staging buffer (the schedule's trace; pages are per batch row)."""

    sweep: str  # "forward" | "eval" | "backward"
    direction: str  # "h2d" | "d2h"
    layer: int
    what: str  # "kv" (K and V pages) | "grad" (dK and dV pages)
    first: int  # first page
    end: int  # one past the last page
    nbytes: int
    cause: str  # "prefetch" | "demand" | "writeback"


class _Visit(NamedTuple):
    """One stream of a layer: chunk ``chunk`` attends to blocks ``0 .. chunk``; ``grads``: the backward's."""

    layer: int
    chunk: int
    grads: bool
    descending: bool = False  # backward sweep: the descending half (the layers' backward)


class _Need(NamedTuple):
    """A predicted block use: stage its K/V (``kv``) and/or gradient pages (``grads``); neither = hold a buffer
    for the chunk's own block, which the compute stream writes."""

    layer: int
    block: int
    kv: bool
    grads: bool


@dataclass
class _Buffer:
    """One staging buffer: room for one block (all rows) at slots ``[index * block_slots, ...)``."""

    index: int
    block: tuple[int, int] | None = None  # (layer, block) held here
    kv: bool = False  # the block's K/V pages are valid here
    grads: bool = False  # its gradient pages are valid here (staged or zero-filled)
    dirty: bool = False  # gradient adds landed since the last write-back
    last_use: int = 0
    ready: torch.cuda.Event | None = None
    flushed: torch.cuda.Event | None = None

    def clear(self) -> None:
        self.block, self.kv, self.grads, self.dirty = None, False, False, False


class _Streams:
    """The compute stream (current at each call) and one copy stream per direction for copies into and out of
    ``staging``; on CPU streams and events are ``None`` and everything runs in program order."""

    def __init__(self, device: torch.device, staging: torch.Tensor):
        self.cuda = device.type == "cuda"
        self.device = device
        self.h2d = torch.cuda.Stream(device) if self.cuda else None
        self.d2h = torch.cuda.Stream(device) if self.cuda else None
        for stream in (self.h2d, self.d2h):
            if stream is not None:  # the allocator must not reuse the arena while a copy may be in flight
                staging.record_stream(stream)

    def synchronize(self) -> None:
        if self.cuda:
            torch.cuda.synchronize(self.device)

    def compute(self):
        return torch.cuda.current_stream(self.device) if self.cuda else None

    @staticmethod
    def record(stream, timing: bool = False):
        if stream is None:
            return None
        event = torch.cuda.Event(enable_timing=timing)
        event.record(stream)
        return event

    @staticmethod
    def wait(stream, *events) -> None:
        for event in events:
            if event is not None:
                stream.wait_event(event)

    @staticmethod
    def on(stream):
        return torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext()


class Offloader:
    """Stages blocks of host-tier layers into device buffers for the pool (see the module docstring).

    Args:
        shape: the step's pool shape (``shape.block_pages`` pages per block).
        host_layers: layers in the host tier; layer ``host_layers[i]`` owns host slots ``[i * layer_slots, ...)``.
        host: the host-tier arena; staging: the device arena of ``len(tables)`` block-sized buffers.
        tables: int32 ``[buffers, batch, pages_per_row]``: buffer ``i``'s page table into ``staging``, valid for
            any block it holds (page ``p`` of row ``b`` -> slot ``(i * block_pages + p % block_pages) * batch + b``).
        sweep: the sweep in progress (the pool is reserved during a forward or eval sweep).
        layer_checkpointing: the backward sweep recomputes each layer right before its backward (prefetch order).
        prefetch_depth: predicted block uses staged ahead (``None``: as many as free buffers allow; 0: none).
    """

    def __init__(
        self,
        shape: PoolShape,
        host_layers,
        host: Arena,
        staging: Arena,
        tables: torch.Tensor,
        sweep: str = "forward",
        layer_checkpointing: bool = False,
        prefetch_depth: int | None = None,
    ):
        self.shape, self.layer_checkpointing = shape, layer_checkpointing
        self.prefetch_depth = len(tables) if prefetch_depth is None else prefetch_depth
        self._rank = {layer: i for i, layer in enumerate(host_layers)}
        self._host, self._staging, self._tables = host, staging, tables
        self._buffers = [_Buffer(i) for i in range(len(tables))]
        self._streams = _Streams(staging.device, staging.k)  # one allocation: k covers all four views
        self._host_read: dict[tuple[int, int], object] = {}
        self._host_written: dict[tuple[int, int], object] = {}
        self._page_bytes = {
            "kv": 2 * shape.batch * shape.page_numel * shape.dtype.itemsize,
            "grad": 2 * shape.batch * shape.page_numel * shape.grad_dtype.itemsize,
        }
        self._new_step()
        self.begin_sweep(sweep)

    # ------------------------------------------------------------------------------------------------ sweeps
    def begin_sweep(self, kind: str) -> None:
        """``"forward"``/``"eval"``: a new step (nothing staged is valid, stats restart); ``"backward"``: K/V
        stay staged, gradients restart at zero (no gradient page is on the host)."""
        self._sweep, self._at, self._rest, self._tick, self._fresh = kind, None, ([], 0), 0, None
        self._span = self.shape.num_blocks  # prefix blocks a stream reads (fewer under a sliding window)
        self._grads_on_host: set[tuple[int, int]] = set()
        if kind == "backward":
            for buf in self._buffers:
                buf.grads = buf.dirty = False
        else:
            self._new_step()

    def _new_step(self) -> None:
        self._written = [0] * self.shape.num_layers  # leading blocks of each layer whose K/V are on the host
        self._holder: dict[tuple[int, int], _Buffer] = {}
        for buf in self._buffers:
            buf.clear()  # contents are stale; events stay (copies may still be in flight)
        self.trace: list[Transfer] = []
        self._waits: list = []  # (start, end) timing events around compute-stream waits
        self._wait_s = 0.0

    def end_sweep(self) -> None:
        """Resolve the sweep's copy-wait timings (waits for the compute stream up to its last wait)."""
        for start, end in self._waits:
            end.synchronize()  # the compute stream may differ between calls (autograd's thread)
            self._wait_s += start.elapsed_time(end) / 1e3
        self._waits.clear()
        if self._sweep == "backward":
            for buf in self._buffers:  # every gradient page has been handed to autograd
                buf.grads = buf.dirty = False

    def stats(self) -> dict:
        """This step's traffic so far (see :meth:`lightning_oomb.engine.kv_pool.KVPool.stats`)."""
        return {
            "h2d_bytes": sum(t.nbytes for t in self.trace if t.direction == "h2d"),
            "d2h_bytes": sum(t.nbytes for t in self.trace if t.direction == "d2h"),
            "copy_wait_s": self._wait_s,
            "prefetch_copies": sum(t.cause == "prefetch" for t in self.trace),
            "demand_copies": sum(t.cause == "demand" for t in self.trace),
        }

    def synchronize(self) -> None:
        """Wait for every copy and kernel on the device (before arenas are replaced or freed)."""
        self._streams.synchronize()

    # ------------------------------------------------------------------------------------------------ access
    def visit(self, layer: int, chunk: int, grads: bool = False) -> None:
        """Note the start of ``layer``'s stream for chunk ``chunk`` (HBM layers too: it drives prefetch)."""
        self._tick += 1
        previous, descending = self._at, grads
        if self._sweep == "backward" and previous is not None and not grads:
            # after a layer's backward comes the layer below (recomputed first with checkpointing) or, at the
            # bottom, the next chunk's climb; the same layer twice is a checkpointed recompute
            descending = layer == previous.layer - 1 if previous.grads else layer == previous.layer
        self._at = _Visit(layer, chunk, grads, descending)
        self._rest = ([], 0)
        if layer not in self._rank:
            self._prefetch()

    def begin_write(self, layer: int, block: int) -> torch.Tensor:
        """Hold a buffer for ``layer``'s block ``block`` that the compute stream is about to write K/V into;
        returns its page table ``[batch, pages_per_row]`` (the compute stream waits for the buffer's copies)."""
        self._fresh = (layer, block)  # protected until its stream has started
        buf = self._stage(_Need(layer, block, False, False), "demand", self._protected())
        self._use(buf, writes=True)
        return self._tables[buf.index]

    def end_write(self, layer: int, block: int, persist: bool) -> None:
        """The compute stream wrote the block's K/V. ``persist``: they are new (forward and eval sweeps): send
        them to the host now; otherwise they are the recompute's identical copy of what the host holds."""
        buf = self._holder[(layer, block)]
        buf.kv = True
        if persist:
            self._written[layer] = block + 1
            self._grads_on_host.discard((layer, block))
            self._flush(buf, "kv")
        self._prefetch()

    def holds_kv(self, layer: int, block: int) -> bool:
        buf = self._holder.get((layer, block))
        return buf is not None and buf.kv

    def stream(
        self, layer: int, chunk: int, grads: bool = False, first: int = 0
    ) -> Iterator[tuple[int, torch.Tensor]]:
        """Yield ``(block, page table)`` for the blocks chunk ``chunk`` of ``layer`` attends to: its own block
        (already written or restaged) first, then the prefix ``first .. chunk-1`` (blocks before ``first`` are
        outside a sliding window), each staged (with its gradient pages if ``grads``) and ordered before the
        compute stream's next use. With ``grads`` the caller adds into the gradient pages before asking for the
        next block; a prefix block's are then written back."""
        self.visit(layer, chunk, grads)
        self._fresh, self._span = None, chunk - first
        # the chunk's own K/V are on the device already; the prefix comes from the host
        prefix = [_Need(layer, j, True, grads) for j in range(first, chunk)]
        needs = [_Need(layer, chunk, False, grads), *prefix]
        for i, need in enumerate(needs):
            self._rest = (needs, i + 1)  # what prefetch predicts first: needs[i + 1:]
            self._tick += 1
            buf = self._stage(need, "demand", self._protected(need))
            assert buf.kv, "the chunk's own block is written before it is streamed"
            self._use(buf, writes=grads)
            buf.dirty |= grads
            self._prefetch(current=need)
            yield need.block, self._tables[buf.index]
            if grads and need.block != chunk:
                self._write_back(buf)

    def grad_table(self, layer: int, block: int) -> torch.Tensor:
        """The page table of the buffer holding ``layer``'s block with its accumulated gradient pages (after
        the backward's stream); stages them again if they were evicted."""
        buf = self._stage(_Need(layer, block, False, True), "demand", self._protected())
        self._use(buf, writes=False)
        return self._tables[buf.index]

    def consumed(self, layer: int, block: int) -> None:
        """Backward sweep: the chunk took its gradients of ``layer``; its block's gradient pages are free."""
        buf = self._holder.get((layer, block))
        if buf is not None:
            buf.grads = buf.dirty = False
        self._prefetch()

    # ------------------------------------------------------------------------------------------------ schedule
    def _next(self, v: _Visit) -> _Visit | None:
        """The stream predicted after ``v`` (see the module docstring)."""
        last = self.shape.num_layers - 1
        if self._sweep != "backward":
            return _Visit(v.layer + 1, v.chunk, False) if v.layer < last else _Visit(0, v.chunk + 1, False)
        if v.grads:  # a layer's backward: the layer below, recomputed first with checkpointing
            if v.layer == 0:
                return _Visit(0, v.chunk - 1, False) if v.chunk > 0 else None
            return _Visit(v.layer - 1, v.chunk, not self.layer_checkpointing, True)
        if v.descending:  # checkpointing: a layer's recompute right before its backward
            return _Visit(v.layer, v.chunk, True, True)
        if v.layer < last:
            return _Visit(v.layer + 1, v.chunk, False)
        return _Visit(last, v.chunk, not self.layer_checkpointing, True)

    def _upcoming(self) -> Iterator[_Need]:
        """Predicted block uses after now, nearest first: the rest of this stream, then the next streams'."""
        needs, start = self._rest
        for i in range(start, len(needs)):
            yield needs[i]
        visit = self._at
        for _ in range(2 * self.shape.num_layers):
            visit = self._next(visit) if visit is not None else None
            if visit is None or visit.chunk >= self.shape.num_blocks:
                return
            if visit.layer in self._rank:
                yield _Need(visit.layer, visit.chunk, False, visit.grads)
                first = max(0, visit.chunk - self._span)  # a sliding window spans as many blocks as last time
                for j in range(first, min(visit.chunk, self._written[visit.layer])):
                    yield _Need(visit.layer, j, True, visit.grads)

    def _protected(self, current: _Need | None = None) -> set:
        """Blocks no staging may evict now: the block in use, the chunk's own block of the current stream (its
        gradient pages wait for ``read_grad``) and a block just written for the stream about to start."""
        keep = {self._fresh} if self._fresh is not None else set()
        if current is not None:
            keep.add((current.layer, current.block))
        if self._at is not None:
            keep.add((self._at.layer, self._at.chunk))
        return keep

    def _prefetch(self, current: _Need | None = None) -> None:
        protect = self._protected(current)
        for ahead, need in enumerate(
            self._upcoming()
        ):  # a protected block is never evicted, but may be filled
            if ahead >= self.prefetch_depth or self._stage(need, "prefetch", protect) is None:
                break
            protect.add((need.layer, need.block))
            if len(protect) >= len(self._buffers):
                break

    def _stage(self, need: _Need, cause: str, protect) -> _Buffer | None:
        """The buffer holding ``need``'s block with what it needs staged; evicts the least recently used
        unprotected buffer if the block is not held; ``None`` if none is free."""
        key = (need.layer, need.block)
        buf = self._holder.get(key)
        if buf is None:
            free = [b for b in self._buffers if b.block not in protect]
            if not free:
                return None
            buf = min(free, key=lambda b: (b.block is not None, b.last_use))
            self._evict(buf)
            buf.block = key
            self._holder[key] = buf
        buf.last_use = self._tick
        self._fill(buf, need, cause)
        return buf

    def _fill(self, buf: _Buffer, need: _Need, cause: str) -> None:
        need_kv = need.kv and not buf.kv
        need_grads = need.grads and not buf.grads
        if not (need_kv or need_grads):
            return
        s, key = self._streams, buf.block
        released = s.record(s.compute())
        with s.on(s.h2d):
            s.wait(s.h2d, released, buf.flushed, self._host_written.get(key))
            if need_kv:
                self._move("h2d", buf, "kv", cause)
                buf.kv = True
            if need_grads:
                if key in self._grads_on_host:
                    self._move("h2d", buf, "grad", cause)
                else:  # never written back in this sweep: still zero
                    self._zero_grads(buf)
                buf.grads = True
            buf.ready = self._host_read[key] = s.record(s.h2d)

    def _use(self, buf: _Buffer, writes: bool) -> None:
        """Make the compute stream wait for the buffer's copies in (and out, before it writes into the buffer)."""
        events = [e for e in (buf.ready, buf.flushed if writes else None) if e is not None]
        if events:
            s = self._streams
            compute = s.compute()
            if all(
                e.query() for e in events
            ):  # copies already done: the wait costs nothing, no timing needed
                s.wait(compute, *events)
            else:
                start = s.record(compute, timing=True)
                s.wait(compute, *events)
                self._waits.append((start, s.record(compute, timing=True)))
        # later compute work follows these waits in stream order; later copies wait on newer compute events
        buf.ready = None
        if writes:
            buf.flushed = None

    def _evict(self, buf: _Buffer) -> None:
        if buf.block is None:
            return
        if buf.dirty:
            self._write_back(buf)
        del self._holder[buf.block]
        buf.clear()

    def _write_back(self, buf: _Buffer) -> None:
        """Send the block's gradient pages to the host; from now on the host copy is current."""
        self._flush(buf, "grad")
        self._grads_on_host.add(buf.block)
        buf.dirty = False

    def _flush(self, buf: _Buffer, what: str) -> None:
        s, key = self._streams, buf.block
        written = s.record(s.compute())
        with s.on(s.d2h):
            s.wait(s.d2h, written, self._host_read.get(key))
            self._move("d2h", buf, what, "writeback")
            buf.flushed = self._host_written[key] = s.record(s.d2h)

    def _pages(self, block: int) -> tuple[int, int]:
        """Pages ``[first, end)`` (per row) of block ``block``."""
        first = block * self.shape.block_pages
        return first, min(first + self.shape.block_pages, self.shape.pages_per_row)

    def _slots(self, buffer: int, block: int) -> slice:
        """Staging slots of ``block``'s pages (all rows) in buffer ``buffer``."""
        first, end = self._pages(block)
        offset = buffer * self.shape.block_pages * self.shape.batch
        return slice(offset, offset + (end - first) * self.shape.batch)

    def _host_slots(self, layer: int, block: int) -> slice:
        first, end = self._pages(block)
        offset = self._rank[layer] * self.shape.layer_slots
        return slice(offset + first * self.shape.batch, offset + end * self.shape.batch)

    def _zero_grads(self, buf: _Buffer) -> None:
        """Zero the gradient pages of ``buf``'s block, on the current stream."""
        for part in _PARTS["grad"]:
            getattr(self._staging, part)[self._slots(buf.index, buf.block[1])].zero_()

    def _move(self, direction: str, buf: _Buffer, what: str, cause: str) -> None:
        """Copy the pages of ``buf``'s block between host and buffer, on the current stream."""
        layer, block = buf.block
        staged, hosted = self._slots(buf.index, block), self._host_slots(layer, block)
        for part in _PARTS[what]:
            stage, host = getattr(self._staging, part)[staged], getattr(self._host, part)[hosted]
            dst, src = (stage, host) if direction == "h2d" else (host, stage)
            dst.copy_(src, non_blocking=self._streams.cuda)
        first, end = self._pages(block)
        nbytes = (end - first) * self._page_bytes[what]
        self.trace.append(Transfer(self._sweep, direction, layer, what, first, end, nbytes, cause))
