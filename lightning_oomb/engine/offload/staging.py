"""The staging-buffer cache: fixed-size device buffers holding blocks of host-tier layers, and their copies.

Each of the ``staging_buffers`` buffers holds one block (one chunk's K, V, dK, dV pages of one layer, all rows),
or some of its pages (a sparse call stages only its selected ones; copies move runs of consecutive pages).
The cache stages a block into a buffer (evicting the least recently used one that nothing protects), tracks what
each buffer holds (K/V valid, gradient pages valid, *dirty* = gradient adds since the last write-back), writes
back K/V (once, right after they are written) and gradient pages (only after adds), and orders every copy with
events of its :class:`~lightning_oomb.engine.offload.transport.Transport`:

- ``buffer.ready``: copies into a buffer are done — the compute stream waits before any use of the buffer;
- ``buffer.flushed``: copies out of a buffer are done — the compute stream waits before writing into it (K/V
  write, gradient adds), and a refill waits before overwriting it;
- a compute mark taken when a buffer is refilled — the refill waits for it, so the kernels that used the old
  content (all enqueued before the refill is decided: a buffer in use is never a refill target) are done;
  likewise one taken right before a write-back, so pages leave only after the writes or adds into them;
- per host block, the last copy into (``host_written``) and out of (``host_read``) its host pages — a copy in
  waits for a pending write-back of the same block, a write-back for pending reads of its pages.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

import torch

from lightning_oomb.engine.offload.schedule import Need
from lightning_oomb.engine.offload.transport import Transport
from lightning_oomb.engine.pages import Arena, Part, PoolShape

TRACE_LIMIT = 100_000  # transfers kept per step for inspection; counters cover everything


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


ALL: frozenset[int] | None = None  # a page set meaning every page of the block


@dataclass
class Buffer:
    """One staging buffer: room for one block (all rows). A sparse stream stages only some pages of a block:
    ``kv_pages`` / ``grad_pages`` are the valid ones while ``kv`` / ``grads`` (every page valid) are not set."""

    index: int
    block: tuple[int, int] | None = None  # (layer, block) held here
    kv: bool = False  # the block's K/V pages are valid here
    grads: bool = False  # its gradient pages are valid here (staged or zero-filled)
    dirty: bool = False  # gradient adds landed since the last write-back
    last_use: int = 0
    ready: object = None  # transport events (see the module docstring)
    flushed: object = None
    kv_pages: frozenset[int] = frozenset()
    grad_pages: frozenset[int] = frozenset()

    def clear(self) -> None:
        self.block, self.kv, self.grads, self.dirty = None, False, False, False
        self.kv_pages = self.grad_pages = frozenset()

    def drop_grads(self) -> None:
        self.grads = self.dirty = False
        self.grad_pages = frozenset()


class StagingCache:
    """Staging buffers for the blocks of ``host_layers`` (see the module docstring).

    Args:
        shape: the step's pool shape. host_layers: layer ``host_layers[i]`` owns host slots
            ``[i * layer_slots, ...)``. host: the host-tier arena. staging: the device arena of ``buffers`` blocks.
        buffers: number of staging buffers. transport: moves the pages (see its module).
    """

    def __init__(
        self,
        shape: PoolShape,
        host_layers: Sequence[int],
        host: Arena,
        staging: Arena,
        buffers: int,
        transport: Transport,
    ) -> None:
        self.shape, self.transport, self.host_layers = shape, transport, tuple(host_layers)
        self._rank = {layer: i for i, layer in enumerate(host_layers)}
        self._host, self._staging = host, staging
        self.tables = shape.page_tables(buffers, staging.device, blocks=True)
        self.buffers = [Buffer(i) for i in range(buffers)]
        transport.adopt(staging.storage)
        self._host_read: dict[tuple[int, int], object] = {}
        self._host_written: dict[tuple[int, int], object] = {}
        self.sweep, self._now = "forward", 0
        self.new_step()

    # ------------------------------------------------------------------------------------------------ state
    def new_step(self) -> None:
        """Nothing staged is valid any more (events stay: copies may still be in flight); counters restart."""
        self._holder: dict[tuple[int, int], Buffer] = {}
        for buf in self.buffers:
            buf.clear()
        self._grads_on_host: dict[
            tuple[int, int], frozenset[int] | None
        ] = {}  # pages written back (None: all)
        self.trace: deque[Transfer] = deque(maxlen=TRACE_LIMIT)
        self.counts = {"h2d_bytes": 0, "d2h_bytes": 0, "prefetch_copies": 0, "demand_copies": 0}

    def begin_sweep(self, kind: str) -> None:
        """A sweep starts: the clock restarts; a forward/eval sweep is a new step, the backward sweep keeps the
        staged K/V but no gradient page (they restart at zero; the host holds none)."""
        self.sweep, self._now = kind, 0
        self._grads_on_host = {}
        if kind != "backward":
            self.new_step()
        self.drop_grads()

    def drop_grads(self) -> None:
        """Every staged gradient page has been handed over (end of the backward sweep) or is stale."""
        for buf in self.buffers:
            buf.drop_grads()

    def tick(self) -> None:
        """Advance the clock of least-recently-used eviction."""
        self._now += 1

    def holder(self, key: tuple[int, int]) -> Buffer | None:
        return self._holder.get(key)

    def table(self, buf: Buffer) -> torch.Tensor:
        """``buf``'s page table ``[batch, pages_per_row]`` into the staging arena, valid for any block it holds."""
        return self.tables[buf.index]

    # ------------------------------------------------------------------------------------------------ staging
    def stage(self, need: Need, cause: str, protect) -> Buffer | None:
        """The buffer holding ``need``'s block with what it needs staged; evicts the least recently used
        unprotected buffer if the block is not held; ``None`` if none is free."""
        key = (need.layer, need.block)
        buf = self._holder.get(key)
        if buf is None:
            free = [b for b in self.buffers if b.block not in protect]
            if not free:
                return None
            buf = min(free, key=lambda b: (b.block is not None, b.last_use))
            self._evict(buf)
            buf.block = key
            self._holder[key] = buf
        buf.last_use = self._now
        self._fill(buf, need, cause)
        return buf

    def use(self, buf: Buffer, reads: tuple[Part, ...] = (), writes: tuple[Part, ...] = ()) -> None:
        """The compute stream is about to read ``reads`` and write ``writes`` of ``buf``'s block: it waits for the
        copies into the buffer (and, before writing, out of it)."""
        events = (buf.ready, buf.flushed if writes else None)
        self.transport.acquire(
            events,
            [t for p in reads for t in self._views(buf, p)],
            [t for p in writes for t in self._views(buf, p)],
        )
        # later compute work follows these waits in stream order; later copies wait on newer compute marks
        buf.ready = None
        if writes:
            buf.flushed = None

    def wrote_kv(self, buf: Buffer, persist: bool) -> None:
        """The compute stream wrote the block's K/V into ``buf``. ``persist``: they are new (forward and eval
        sweeps) — send them to the host now (the only write-back of K/V ever: they never change afterwards)."""
        buf.kv = True
        if persist:
            self._grads_on_host.pop(buf.block, None)
            self._flush(buf, "kv")

    def added_grads(self, buf: Buffer) -> None:
        buf.dirty = True

    def write_back(self, buf: Buffer) -> None:
        """Send the block's valid gradient pages to the host; from now on the host copy of them is current."""
        pages = ALL if buf.grads else buf.grad_pages
        self._flush(buf, "grad", pages)
        self._grads_on_host[buf.block] = _union(self._grads_on_host.get(buf.block, frozenset()), pages)
        buf.dirty = False

    def consumed(self, key: tuple[int, int]) -> None:
        """The block's gradient pages were handed to autograd: they are free."""
        buf = self._holder.get(key)
        if buf is not None:
            buf.drop_grads()

    # ------------------------------------------------------------------------------------------------ copies
    def _evict(self, buf: Buffer) -> None:
        if buf.block is None:
            return
        if buf.dirty:
            self.write_back(buf)
        del self._holder[buf.block]
        buf.clear()

    def _fill(self, buf: Buffer, need: Need, cause: str) -> None:
        kv = self._missing(buf, buf.kv, buf.kv_pages, need.pages) if need.kv else frozenset()
        grads = self._missing(buf, buf.grads, buf.grad_pages, need.pages) if need.grads else frozenset()
        if kv == frozenset() and grads == frozenset():
            return
        key = buf.block
        after = [self.transport.mark(), buf.flushed, self._host_written.get(key)]
        if kv != frozenset():
            event, after = self._move("h2d", buf, "kv", cause, after, kv), []
            buf.kv, buf.kv_pages = self._merged(buf, buf.kv_pages, kv)
        if grads != frozenset():
            hosted = self._grads_on_host.get(key, frozenset())
            copied, zeroed = _split(grads, hosted, self._block_range(buf))
            if copied != frozenset():
                event, after = self._move("h2d", buf, "grad", cause, after, copied), []
            if zeroed != frozenset():  # never written back in this sweep: still zero
                event = self.transport.zero(self._views(buf, "grad", zeroed), after)
            buf.grads, buf.grad_pages = self._merged(buf, buf.grad_pages, grads)
        buf.ready = self._host_read[key] = event

    def _block_range(self, buf: Buffer) -> range:
        first, end = self.shape.block_pages_range(buf.block[1])
        return range(end - first)

    def _missing(self, buf: Buffer, full: bool, some: frozenset[int], want) -> frozenset[int] | None:
        """The pages of ``want`` (``ALL``: every page) not valid in ``buf`` (``ALL`` when none is)."""
        if full:
            return frozenset()
        if want is ALL:
            return ALL if not some else frozenset(self._block_range(buf)) - some
        return want - some

    def _merged(self, buf: Buffer, some: frozenset[int], added) -> tuple[bool, frozenset[int]]:
        """``(every page valid, the valid pages otherwise)`` after ``added`` pages were staged."""
        pages = frozenset(self._block_range(buf)) if added is ALL else some | added
        full = len(pages) == len(self._block_range(buf))
        return full, frozenset() if full else pages

    def _flush(self, buf: Buffer, part: Part, pages=ALL) -> None:
        key = buf.block
        after = [self.transport.mark(), self._host_read.get(key)]
        buf.flushed = self._host_written[key] = self._move("d2h", buf, part, "writeback", after, pages)

    def _runs(self, buf: Buffer, pages) -> list[tuple[int, int]]:
        """Runs ``[first, end)`` of consecutive page offsets of ``pages`` (``ALL``: the whole block) in the block."""
        if pages is ALL:
            return [(0, len(self._block_range(buf)))]
        runs: list[tuple[int, int]] = []
        for p in sorted(pages):
            if runs and runs[-1][1] == p:
                runs[-1] = (runs[-1][0], p + 1)
            else:
                runs.append((p, p + 1))
        return runs

    def _views(self, buf: Buffer, part: Part, pages=ALL) -> list[torch.Tensor]:
        """``buf``'s pages (``ALL``, or those offsets) of its block: K and V, or dK and dV — a view per run."""
        slots = self.shape.buffer_block_slots(buf.index, buf.block[1])
        return [t[slots][a * self.shape.batch : b * self.shape.batch] for a, b in self._runs(buf, pages)
                for t in self._staging.pages(part)]  # fmt: skip

    def _move(self, direction: str, buf: Buffer, part: Part, cause: str, after, pages=ALL) -> object:
        """Copy ``part`` of ``buf``'s block (``ALL`` its pages, or those offsets) between its buffer and its host
        pages; return the copy's event."""
        layer, block = buf.block
        hosted = self.shape.layer_block_slots(self._rank[layer], block)
        host = [t[hosted][a * self.shape.batch : b * self.shape.batch] for a, b in self._runs(buf, pages)
                for t in self._host.pages(part)]  # fmt: skip
        staged = self._views(buf, part, pages)
        pairs = list(zip(staged, host)) if direction == "h2d" else list(zip(host, staged))
        event = self.transport.copy(direction, pairs, after)
        first = self.shape.block_pages_range(block)[0]
        for a, b in self._runs(buf, pages):
            nbytes = (b - a) * self.shape.page_bytes(part)
            self.counts[f"{direction}_bytes"] += nbytes
            self.trace.append(
                Transfer(self.sweep, direction, layer, part, first + a, first + b, nbytes, cause)
            )
        if cause in ("prefetch", "demand"):
            self.counts[f"{cause}_copies"] += 1
        return event


def _union(a: frozenset[int] | None, b: frozenset[int] | None) -> frozenset[int] | None:
    return ALL if a is ALL or b is ALL else a | b


def _split(pages, hosted, block: range) -> tuple[frozenset[int], frozenset[int]]:
    """``pages`` (``ALL``: the block's) split into those the host holds (``hosted``; ``ALL``: every one) and the
    rest."""
    pages = frozenset(block) if pages is ALL else pages
    if hosted is ALL:
        return pages, frozenset()
    return pages & hosted, pages - hosted
