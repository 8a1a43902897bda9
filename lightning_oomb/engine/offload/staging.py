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

from array import array
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


@dataclass
class Buffer:
    """One staging buffer: room for one block (all rows). ``kv_pages`` / ``grad_pages``: the pages (offsets in the
    held block of ``size`` pages) whose K/V / gradient pages are valid here — all of them, or those a sparse stream
    staged."""

    index: int
    block: tuple[int, int] | None = None  # (layer, block) held here
    size: int = 0
    kv_pages: frozenset[int] = frozenset()
    grad_pages: frozenset[int] = frozenset()  # staged or zero-filled
    dirty: bool = False  # gradient adds landed since the last write-back
    last_use: int = 0
    ready: object = None  # transport events (see the module docstring)
    flushed: object = None

    @property
    def kv(self) -> bool:
        """Every K/V page of the held block is valid here."""
        return self.size > 0 and len(self.kv_pages) == self.size

    def clear(self) -> None:
        self.block, self.size, self.kv_pages = None, 0, frozenset()
        self.drop_grads()

    def drop_grads(self) -> None:
        self.grad_pages, self.dirty = frozenset(), False


def run_views(tensors, start: int, batch: int, runs: list[tuple[int, int]]) -> list[torch.Tensor]:
    """Each run ``[first, end)`` of pages (all ``batch`` rows) of the block whose slots begin at ``start``, a view per
    tensor (in run order, each run's tensors in turn)."""
    return [t[start + a * batch : start + b * batch] for a, b in runs for t in tensors]


class _RunViews(dict):
    """One staging buffer's views of the runs of pages asked for so far (:func:`run_views`), kept for the cache's
    life: a buffer's slots are the same for any block it holds, a sparse call asks for thousands of runs, and
    making a view costs about a microsecond. At most ``limit`` runs are kept, the first ones asked for (mostly
    single pages, short runs and whole blocks), so that memory stays bounded however many different runs come."""

    def __init__(self, tensors, start: int, batch: int, limit: int) -> None:
        super().__init__()
        self.tensors, self.start, self.batch, self.limit = tensors, start, batch, limit

    def __missing__(self, run: tuple[int, int]) -> list[torch.Tensor]:
        views = run_views(self.tensors, self.start, self.batch, [run])
        if len(self) < self.limit:
            self[run] = views
        return views


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
        # a transport written before gathers existed has no such attribute: copies per run for it
        self._gathers = getattr(transport, "gathers", False)
        self._rank = {layer: i for i, layer in enumerate(host_layers)}
        self._host, self._staging = host, staging
        self.tables = shape.page_tables(buffers, staging.device, blocks=True)
        self.buffers = [Buffer(i) for i in range(buffers)]
        transport.adopt(staging.storage)
        self._staged = {
            (i, part): _RunViews(
                staging.pages(part), shape.buffer_block_slots(i, 0).start, shape.batch, 4 * shape.block_pages
            )
            for i in range(buffers)
            for part in ("kv", "grad")
        }
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
        self._moves: deque[tuple] = deque(maxlen=TRACE_LIMIT)  # one per _move: its transfers, unexpanded
        self.counts = {
            "h2d_bytes": 0,
            "d2h_bytes": 0,
            "prefetch_copies": 0,
            "demand_copies": 0,
            "copy_runs": 0,
        }

    @property
    def trace(self) -> list[Transfer]:
        """This step's copies in issue order, one per run of pages (the last ``TRACE_LIMIT``)."""
        page_bytes = {part: self.shape.page_bytes(part) for part in ("kv", "grad")}
        transfers = [
            Transfer(sweep, direction, layer, part, first + a, first + b, (b - a) * page_bytes[part], cause)
            for sweep, direction, layer, part, first, runs, cause in self._moves
            for a, b in runs
        ]
        return transfers[-TRACE_LIMIT:]

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

    def group_table(self, bufs: Sequence[Buffer]) -> torch.Tensor:
        """One page table for the blocks ``bufs`` hold (in block order): each block's pages map into its buffer (a
        new table, made on the device, for more than one; the other pages' entries point into the first buffer)."""
        if len(bufs) == 1:
            return self.table(bufs[0])
        table = self.table(bufs[0]).clone()
        for buf in bufs[1:]:
            first, end = self.shape.block_pages_range(buf.block[1])
            table[:, first:end] = self.tables[buf.index][:, first:end]
        return table

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
            first, end = self.shape.block_pages_range(need.block)
            buf.block, buf.size = key, end - first
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
        buf.kv_pages = frozenset(range(buf.size))
        if persist:
            self._grads_on_host.pop(buf.block, None)
            self._flush(buf, "kv")

    def added_grads(self, buf: Buffer) -> None:
        buf.dirty = True

    def write_back(self, buf: Buffer) -> None:
        """Send the block's valid gradient pages to the host; from now on the host copy of them is current."""
        self._flush(buf, "grad", buf.grad_pages)
        self._grads_on_host[buf.block] = self._grads_on_host.get(buf.block, frozenset()) | buf.grad_pages
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
        want = frozenset(range(buf.size)) if need.pages is None else need.pages
        kv = want - buf.kv_pages if need.kv else frozenset()
        grads = want - buf.grad_pages if need.grads else frozenset()
        if not (kv or grads):
            return
        key = buf.block
        after = [self.transport.mark(), buf.flushed, self._host_written.get(key)]
        if kv:
            event, after = self._move("h2d", buf, "kv", cause, after, kv), []
            buf.kv_pages |= kv
        if grads:
            hosted = grads & self._grads_on_host.get(key, frozenset())
            if grads - hosted:  # never written back in this sweep: still zero
                # a buffer without a valid gradient page zeroes its whole block, one fill per tensor however
                # scattered the pages (device memory: cheap), before the hosted pages come in over it
                zeroed = None if not buf.grad_pages else grads - hosted
                event, after = self.transport.zero(self._views(buf, "grad", zeroed), after), []
            if hosted:
                event = self._move("h2d", buf, "grad", cause, after, hosted)
            buf.grad_pages |= grads
        buf.ready = self._host_read[key] = event

    def _flush(self, buf: Buffer, part: Part, pages: frozenset[int] | None = None) -> None:
        key = buf.block
        after = [self.transport.mark(), self._host_read.get(key)]
        buf.flushed = self._host_written[key] = self._move("d2h", buf, part, "writeback", after, pages)

    @staticmethod
    def _runs(buf: Buffer, pages: frozenset[int] | None) -> list[tuple[int, int]]:
        """Runs ``[first, end)`` of consecutive page offsets of ``pages`` (``None``: the whole block) in the block."""
        if pages is None or len(pages) == buf.size:
            return [(0, buf.size)]
        runs: list[tuple[int, int]] = []
        for p in sorted(pages):
            if runs and runs[-1][1] == p:
                runs[-1] = (runs[-1][0], p + 1)
            else:
                runs.append((p, p + 1))
        return runs

    def _views(self, buf: Buffer, part: Part, pages: frozenset[int] | None = None) -> list[torch.Tensor]:
        """``buf``'s pages (``None``: all, or those offsets) of its block: K and V, or dK and dV — a view per run and
        tensor."""
        return self._staged_views(buf, part, self._runs(buf, pages))

    def _staged_views(self, buf: Buffer, part: Part, runs: list[tuple[int, int]]) -> list[torch.Tensor]:
        """:meth:`_views` of ``runs`` (views kept by the buffer's :class:`_RunViews`)."""
        kept = self._staged[buf.index, part]
        return [view for run in runs for view in kept[run]]

    def _move(self, direction: str, buf: Buffer, part: Part, cause: str, after, pages=None) -> object:
        """Copy ``part`` of ``buf``'s block (``None``: all its pages, or those offsets) between its buffer and its host
        pages — a copy per tensor and run of consecutive pages, or one gather of them all (a transport that
        ``gathers``, more than one run); return the copy's event."""
        layer, block = buf.block
        runs = self._runs(buf, pages)
        host_start = self.shape.layer_block_slots(self._rank[layer], block).start
        if self._gathers and len(runs) > 1:
            # slots of (page, row), page-major: destination rows, then source rows (``torch.tensor`` of a list
            # takes ~2.5x as long as ``frombuffer``)
            batch = self.shape.batch
            offsets = [o for a, b in runs for o in range(a * batch, b * batch)]
            staged_start = self.shape.buffer_block_slots(buf.index, block).start
            slots = [staged_start + o for o in offsets], [host_start + o for o in offsets]
            tensors = self._staging.pages(part), self._host.pages(part)
            if direction == "d2h":
                slots, tensors = slots[::-1], tensors[::-1]
            rows = torch.frombuffer(array("q", slots[0] + slots[1]), dtype=torch.int64).view(2, -1)
            event = self.transport.gather(direction, list(zip(*tensors)), rows, after)
            self.counts["copy_runs"] += 1
        else:
            staged = self._staged_views(buf, part, runs)
            host = run_views(self._host.pages(part), host_start, self.shape.batch, runs)
            pairs = list(zip(staged, host) if direction == "h2d" else zip(host, staged))
            event = self.transport.copy(direction, pairs, after)
            self.counts["copy_runs"] += len(pairs)
        first = self.shape.block_pages_range(block)[0]
        moved = buf.size if pages is None else len(pages)
        self.counts[f"{direction}_bytes"] += moved * self.shape.page_bytes(part)
        self._moves.append((self.sweep, direction, layer, part, first, runs, cause))
        if cause in ("prefetch", "demand"):
            self.counts[f"{cause}_copies"] += 1
        return event
