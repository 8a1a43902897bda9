"""Streaming host-tier layers through device staging buffers: streams, events, prefetch and write-back.

The pool (:mod:`lightning_oomb.engine.kv_pool`) places whole layers in the HBM tier or the host tier. A host
layer is used through one of ``staging_buffers`` device **staging buffers**, each with room for every page of one
layer (K, V, dK, dV). The attention op never sees the host: it gets the staging arena and the layer's page table
remapped into its buffer.

**Why one whole layer per buffer.** The kernels take one page table per call and attend from key 0; a view that
does not fit would need key-range kernels and an LSE merge. A layer-sized buffer keeps the op unchanged and also
holds the chunk's own gradient pages, so the backward kernel adds into every page of its view in place and
``read_grad`` reads the chunk's gradients from the buffer. Memory math (``B`` rows, ``N`` tokens, ``Hkv`` KV heads,
head dim ``D``, itemsizes ``s_kv``/``s_grad``): ``layer_bytes = 2 * B * N * Hkv * D * (s_kv + s_grad)``. Qwen2.5-7B
(``Hkv=4, D=128``, bf16 K/V, fp32 gradients) needs 6 KiB per token per layer (168 KiB over its 28 layers): a
buffer is 1.5 GiB at 256K tokens and 6 GiB at 1M (4 GiB with bf16 gradient pages). The pool's device bytes are
``(hbm_layers + staging_buffers) * layer_bytes``, so with everything on the host they still grow by
``staging_buffers * 61 MB`` per 10K tokens; below that needs key-block streaming (kernels with a key range).

**Traffic per host layer and chunk** (prefix = pages of the chunks before it): forward sweep — K/V of the prefix
in, the chunk's new K/V pages out (right after the write; nothing else is ever written back in this sweep).
Backward sweep — K/V of the prefix and the chunk in for the recompute and again for the backward unless the layer
is still staged; gradient pages in (zero-filled on the device instead while the host holds no gradients yet: the
first chunk of the sweep copies none, and no host memset is needed per step); gradient pages of the prefix out
once, at ``read_grad``. K/V pages are never dirty in the backward sweep, so they are never written back, and the
chunk's own gradient pages are handed to autograd, not written back.

**Ordering** (CUDA; on CPU the same steps run synchronously and events are ``None``). Compute runs on the current
stream; copies run on two side streams, ``h2d`` and ``d2h``, so both directions move at once. Events:

- ``buffer.ready`` (h2d): copies into a buffer are done — compute waits before any use of the buffer.
- ``buffer.flushed`` (d2h): copies out of a buffer are done — compute waits before writing into it (K/V write,
  gradient adds), and a refill waits before overwriting it.
- a compute event recorded when a buffer is refilled — h2d waits on it, so the kernels that used the old content
  (all enqueued before the refill is decided) are done; likewise one recorded right before a write-back — d2h
  waits on it, so pages are sent only after the writes or adds into them completed.
- per host layer, the last copy into (``host_written``) and out of (``host_read``) its host pages — a copy in
  waits for pending write-backs of the same layer, a write-back waits for pending reads of its pages.
Only persistent arenas cross streams; the staging arena is ``record_stream``-ed on both side streams, so the
caching allocator cannot hand it out while a copy is in flight even if the pool is dropped without ``release()``.

**Prefetch.** At every pool access (HBM layers included) the next ``staging_buffers - 1`` host layers in sweep
order are staged into free buffers (least recently used first; the current and upcoming layers are protected).
Forward sweep: layers ascending, cyclic (after the last layer comes the next chunk's first). Backward sweep: the
recompute climbs the layers and the backward descends them, so the order of distinct layers is a walk that bounces
at both ends; with per-layer checkpointing a layer's forward is recomputed right before its backward (the same
layer twice), which leaves the walk unchanged. The direction is read from the accesses (a gradient access or a
lower layer means descending). Layers reached while descending, and the top layer (its backward follows its
recompute at once), are staged with their gradient pages. Correctness never depends on a prediction: a miss
stages on demand, a wrong guess costs bandwidth.
"""

from __future__ import annotations

import contextlib
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


@dataclass
class _Buffer:
    """One staging buffer: room for every page of one layer, at slots ``[index * layer_slots, ...)``."""

    index: int
    layer: int | None = None
    kv_pages: int = 0  # leading K/V pages (per row) valid here
    grad_pages: int = -1  # leading gradient pages valid here; -1: gradients not staged
    dirty: bool = False  # gradient adds may have landed since the last write-back
    last_use: int = 0
    ready: torch.cuda.Event | None = None
    flushed: torch.cuda.Event | None = None

    def clear(self) -> None:
        self.layer, self.kv_pages, self.grad_pages, self.dirty = None, 0, -1, False


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
    """Stages host-tier layers into device buffers for the pool (see the module docstring).

    Args:
        shape: the step's pool shape.
        host_layers: layers in the host tier; layer ``host_layers[i]`` owns host slots ``[i * layer_slots, ...)``.
        host: the host-tier arena; staging: the device arena of ``len(tables)`` layer-sized buffers.
        tables: int32 ``[buffers, batch, pages_per_row]``, each buffer's page table into ``staging``.
        sweep: the sweep in progress (the pool is reserved during a forward or eval sweep).
    """

    def __init__(
        self,
        shape: PoolShape,
        host_layers,
        host: Arena,
        staging: Arena,
        tables: torch.Tensor,
        sweep: str = "forward",
    ):
        self.shape = shape
        self._rank = {layer: i for i, layer in enumerate(host_layers)}
        self._host, self._staging, self._tables = host, staging, tables
        self._buffers = [_Buffer(i) for i in range(len(tables))]
        self._depth = len(tables) - 1
        self._streams = _Streams(staging.device, staging.k)  # one allocation: k covers all four views
        layers = shape.num_layers
        self._host_read: list = [None] * layers
        self._host_written: list = [None] * layers
        self._page_bytes = {
            "kv": 2 * shape.batch * shape.page_numel * shape.dtype.itemsize,
            "grad": 2 * shape.batch * shape.page_numel * shape.grad_dtype.itemsize,
        }
        self._new_step()
        self.begin_sweep(sweep)

    # ------------------------------------------------------------------------------------------------ sweeps
    def begin_sweep(self, kind: str) -> None:
        """``"forward"``/``"eval"``: a new step (nothing staged is valid, gradients are zero, stats restart);
        ``"backward"``: K/V stay staged, gradients restart at zero; the first host layers are prefetched."""
        self._sweep, self._cursor, self._down, self._tick = kind, -1, False, 0
        self._grad_valid = [0] * self.shape.num_layers  # leading gradient pages whose host copy is current
        if kind == "backward":
            self._live = list(self._kv_valid)  # pages the rest of the sweep reads; shrinks chunk by chunk
            for buf in self._buffers:
                buf.grad_pages, buf.dirty = -1, False
        else:
            self._new_step()
        self._prefetch()

    def _new_step(self) -> None:
        self._kv_valid = [0] * self.shape.num_layers  # leading K/V pages written in this step
        self._live = self._kv_valid  # the forward sweep reads everything written so far
        self._holder: dict[int, _Buffer] = {}
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
                buf.dirty = False

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
    def access(
        self, layer: int, pages: int, grads: bool = False, writes: bool = False
    ) -> torch.Tensor | None:
        """Note a use of ``layer``'s first ``pages`` pages and prefetch what comes next. For a host layer, stage
        what is missing (its gradient pages too if ``grads``), order the compute stream after the copies (and after
        write-backs if the caller ``writes``) and return the buffer's page table ``[batch, pages_per_row]``;
        ``None`` for an HBM layer."""
        self._tick += 1
        if self._sweep == "backward":
            if grads or layer < self._cursor:
                self._down = True
            elif layer > self._cursor:
                self._down = False
        self._cursor = layer
        table = None
        if layer in self._rank:
            buf = self._stage(layer, pages, pages if grads else None, "demand", {layer})
            self._use(buf, writes)
            buf.dirty |= grads and writes
            table = self._tables[buf.index]
        self._prefetch()
        return table

    def written(self, layer: int, first: int, end: int) -> None:
        """The compute stream wrote K/V pages ``[first, end)`` of ``layer`` into its buffer: the layer now ends
        there, its gradients there are zero, and the new pages go to the host at once."""
        buf = self._holder[layer]
        buf.kv_pages = end
        buf.grad_pages = min(buf.grad_pages, first)
        self._kv_valid[layer] = end
        self._grad_valid[layer] = min(self._grad_valid[layer], first)
        self._flush(buf, "kv", first, end)

    def consumed(self, layer: int, keep: int) -> None:
        """Backward sweep: the chunk starting at page ``keep`` took its gradients of ``layer``; pages from
        ``keep`` on are free. The prefix's gradient pages are written back now (their adds are enqueued)."""
        if layer not in self._rank:
            return
        self._live[layer] = keep
        buf = self._holder.get(layer)
        if buf is not None and buf.dirty:
            self._write_back(buf, min(keep, buf.grad_pages))

    # ------------------------------------------------------------------------------------------------ schedule
    def _upcoming(self) -> list[tuple[int, bool]]:
        """The next ``depth`` host layers after the cursor in sweep order, with whether to stage gradients."""
        layers, out, seen = self.shape.num_layers, [], {self._cursor}
        layer, down = self._cursor, self._down
        for _ in range(2 * layers):
            if len(out) >= self._depth:
                break
            if self._sweep != "backward":
                layer, grads = (layer + 1) % layers, False
            else:
                if layers == 1:
                    break
                if down and layer <= 0:
                    down = False
                elif not down and layer >= layers - 1:
                    down = True
                layer += -1 if down else 1
                grads = down or layer == layers - 1
            if layer not in seen and layer in self._rank:
                seen.add(layer)
                out.append((layer, grads))
        return out

    def _prefetch(self) -> None:
        protect = {self._cursor}
        for layer, grads in self._upcoming():
            protect.add(layer)
            pages = self._live[layer]
            if pages and self._stage(layer, pages, pages if grads else None, "prefetch", protect) is None:
                break

    def _stage(
        self, layer: int, kv_pages: int, grad_pages: int | None, cause: str, protect
    ) -> _Buffer | None:
        """The buffer holding ``layer`` with at least ``kv_pages`` K/V pages (and ``grad_pages`` gradient pages);
        evicts the least recently used unprotected buffer if the layer is not staged; ``None`` if none is free."""
        buf = self._holder.get(layer)
        if buf is None:
            free = [b for b in self._buffers if b.layer not in protect]
            if not free:
                return None
            buf = min(free, key=lambda b: (b.layer is not None, b.last_use))
            self._evict(buf)
            buf.layer = layer
            self._holder[layer] = buf
        buf.last_use = self._tick
        self._fill(buf, kv_pages, grad_pages, cause)
        return buf

    def _fill(self, buf: _Buffer, kv_pages: int, grad_pages: int | None, cause: str) -> None:
        layer, s = buf.layer, self._streams
        need_kv = kv_pages > buf.kv_pages
        need_grad = grad_pages is not None and grad_pages > buf.grad_pages
        if not (need_kv or need_grad):
            return
        released = s.record(s.compute())
        with s.on(s.h2d):
            s.wait(s.h2d, released, buf.flushed, self._host_written[layer])
            if need_kv:
                self._move("h2d", buf, "kv", buf.kv_pages, kv_pages, cause)
                buf.kv_pages = kv_pages
            if need_grad:
                start, valid = max(buf.grad_pages, 0), self._grad_valid[layer]
                if min(grad_pages, valid) > start:
                    self._move("h2d", buf, "grad", start, min(grad_pages, valid), cause)
                if grad_pages > max(start, valid):  # never written back: still zero
                    self._zero_grads(buf, max(start, valid), grad_pages)
                buf.grad_pages = grad_pages
            buf.ready = self._host_read[layer] = s.record(s.h2d)

    def _use(self, buf: _Buffer, writes: bool) -> None:
        """Make the compute stream wait for the buffer's copies in (and out, before it writes into the buffer)."""
        events = [e for e in (buf.ready, buf.flushed if writes else None) if e is not None]
        if events:
            s = self._streams
            compute = s.compute()
            start = s.record(compute, timing=True)
            s.wait(compute, *events)
            self._waits.append((start, s.record(compute, timing=True)))
        # later compute work follows these waits in stream order; later copies wait on newer compute events
        buf.ready = None
        if writes:
            buf.flushed = None

    def _evict(self, buf: _Buffer) -> None:
        if buf.layer is None:
            return
        if buf.dirty:
            self._write_back(buf, min(buf.grad_pages, self._live[buf.layer]))
        del self._holder[buf.layer]
        buf.clear()

    def _write_back(self, buf: _Buffer, end: int) -> None:
        """Send gradient pages ``[0, end)`` to the host; from now on the host copy of exactly those is current."""
        if end > 0:
            self._flush(buf, "grad", 0, end)
        self._grad_valid[buf.layer] = end
        buf.dirty = False

    def _flush(self, buf: _Buffer, what: str, first: int, end: int) -> None:
        s, layer = self._streams, buf.layer
        written = s.record(s.compute())
        with s.on(s.d2h):
            s.wait(s.d2h, written, self._host_read[layer])
            self._move("d2h", buf, what, first, end, "writeback")
            buf.flushed = self._host_written[layer] = s.record(s.d2h)

    def _slots(self, base: int, first: int, end: int) -> slice:
        """Slots of pages ``[first, end)`` (all rows) of the layer at slot ``base * layer_slots`` (page-major)."""
        rows, offset = self.shape.batch, base * self.shape.layer_slots
        return slice(offset + first * rows, offset + end * rows)

    def _zero_grads(self, buf: _Buffer, first: int, end: int) -> None:
        """Zero gradient pages ``[first, end)`` of ``buf``, on the current stream."""
        for part in _PARTS["grad"]:
            getattr(self._staging, part)[self._slots(buf.index, first, end)].zero_()

    def _move(self, direction: str, buf: _Buffer, what: str, first: int, end: int, cause: str) -> None:
        """Copy pages ``[first, end)`` of ``buf``'s layer between host and buffer, on the current stream."""
        staged = self._slots(buf.index, first, end)
        hosted = self._slots(self._rank[buf.layer], first, end)
        for part in _PARTS[what]:
            stage, host = getattr(self._staging, part)[staged], getattr(self._host, part)[hosted]
            dst, src = (stage, host) if direction == "h2d" else (host, stage)
            dst.copy_(src, non_blocking=self._streams.cuda)
        nbytes = (end - first) * self._page_bytes[what]
        self.trace.append(Transfer(self._sweep, direction, buf.layer, what, first, end, nbytes, cause))
