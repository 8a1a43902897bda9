"""Copy transports: how the offload schedule's copies run and how the compute stream waits for them.

A transport moves pages between the host tier and the device staging buffers on two copy *streams*, ``"h2d"`` and
``"d2h"``, and orders them against the *compute* stream with opaque *events*:

- :meth:`Transport.copy` / :meth:`Transport.gather` / :meth:`Transport.zero` enqueue work on a copy stream after the
  given events and return an event that completes with it;
- :meth:`Transport.mark` returns an event at the compute stream's current position (copies that wait for it run
  after everything the compute stream was given so far);
- :meth:`Transport.acquire` makes the compute stream wait for events before it reads or writes the given tensors.

Implementations: :class:`SyncTransport` (CPU: copies run at once, events are ``None``), :class:`CudaTransport`
(side CUDA streams and events; the default on CUDA) and :func:`delaying_transport` (random delays on either; for
race checks). A transport is chosen per pool by a factory ``transport(device) -> Transport`` (the classes
themselves are such factories); :func:`default_transport` is the default.
"""

from __future__ import annotations

import os
import random
from collections.abc import Iterable, Sequence
from typing import Literal, Protocol

import torch

from csrc_triton.page_copy import copy_rows, copy_rows_reference

Stream = Literal["h2d", "d2h"]
Pairs = Sequence[tuple[torch.Tensor, torch.Tensor]]  # (destination, source)


def offload_gather() -> bool:
    """``OOMB_OFFLOAD_GATHER=1`` (experimental, off by default until a GPU has measured it): on CUDA, scattered pages
    (a sparse call's selection) move with one kernel per block and part (:func:`csrc_triton.page_copy.copy_rows`)
    that reads and writes the host tier mapped into the GPU's address space, instead of a copy call per run of
    consecutive pages — fewer host calls, but the bytes cross PCIe on the SMs, beside the attention kernels."""
    return os.environ.get("OOMB_OFFLOAD_GATHER", "0") not in ("", "0")


def copy_pairs(pairs: Pairs, non_blocking: bool = False) -> None:
    """``dst.copy_(src)`` for every ``(dst, src)`` pair in one call (``torch._foreach_copy_``: a loop in C++, not
    Python — a sparse call's scattered pages are thousands of pairs; between devices each pair is still its own
    copy)."""
    if pairs:
        dsts, srcs = zip(*pairs)
        torch._foreach_copy_(list(dsts), list(srcs), non_blocking=non_blocking)


def zero_all(tensors: Sequence[torch.Tensor]) -> None:
    """Zero-fill ``tensors`` in one call (``torch._foreach_zero_``)."""
    if tensors:
        torch._foreach_zero_(list(tensors))


class Transport(Protocol):
    """What the staging cache needs from streams and events (see the module docstring). ``gathers``: whether the
    cache should move scattered pages with :meth:`gather` (one call) rather than :meth:`copy` (a pair per run)."""

    gathers: bool

    def adopt(self, tensor: torch.Tensor) -> None:
        """``tensor`` (the staging arena) is used by copy streams: keep its memory from being reused while a copy
        may be in flight."""

    def copy(self, stream: Stream, pairs: Pairs, after: Iterable) -> object:
        """Enqueue ``dst.copy_(src)`` for every pair on ``stream`` once the events ``after`` (``None`` entries
        allowed) are done; return an event completing with the copies."""

    def gather(self, stream: Stream, pairs: Pairs, rows: torch.Tensor, after: Iterable) -> object:
        """Like :meth:`copy` for ``dst[rows[0]] = src[rows[1]]`` (rows of dim 0; ``rows`` int64 ``[2, n]`` on the
        CPU) of every pair, one or two pairs of one dtype and row size."""

    def zero(self, tensors: Sequence[torch.Tensor], after: Iterable) -> object:
        """Enqueue zero-filling ``tensors`` on the ``"h2d"`` stream after ``after``; return its event."""

    def mark(self) -> object:
        """An event at the compute stream's current position."""

    def acquire(
        self, events: Iterable, reads: Sequence[torch.Tensor] = (), writes: Sequence[torch.Tensor] = ()
    ):
        """The compute stream waits for ``events`` before it reads ``reads`` and writes ``writes``."""

    def finish(self) -> float:
        """Seconds the compute stream waited on copies since the last call (resolves pending timings)."""

    def synchronize(self) -> None:
        """Wait until every enqueued copy and kernel is done."""


class SyncTransport:
    """Copies run at once on the calling thread, in program order (CPU tensors); events are ``None``. ``gathers``:
    whether the staging cache uses :meth:`gather` (index copies; off: the copy per run, as on CUDA by default)."""

    def __init__(self, device: torch.device | None = None, gathers: bool = False) -> None:
        self.device, self.gathers = device, gathers

    def adopt(self, tensor: torch.Tensor) -> None:
        pass

    def copy(self, stream: Stream, pairs: Pairs, after: Iterable) -> None:
        copy_pairs(pairs)

    def gather(self, stream: Stream, pairs: Pairs, rows: torch.Tensor, after: Iterable) -> None:
        copy_rows_reference(pairs, rows)

    def zero(self, tensors: Sequence[torch.Tensor], after: Iterable) -> None:
        zero_all(tensors)

    def mark(self) -> None:
        return None

    def acquire(self, events: Iterable, reads=(), writes=()) -> None:
        pass

    def finish(self) -> float:
        return 0.0

    def synchronize(self) -> None:
        pass


class CudaTransport:
    """One side CUDA stream per copy direction (both directions move at once) ordered by CUDA events against the
    compute stream, which is whichever stream is current at each call (autograd's backward thread has its own).

    Waits of the compute stream on copies still in flight are timed with event pairs, resolved by
    :meth:`finish`; a wait on copies already done costs nothing and is not timed.
    """

    def __init__(self, device: torch.device) -> None:
        self.device, self.gathers = device, offload_gather()
        self.streams = {name: torch.cuda.Stream(device) for name in ("h2d", "d2h")}
        self._timings: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []

    def adopt(self, tensor: torch.Tensor) -> None:
        for stream in self.streams.values():  # the allocator must not reuse it while a copy may be in flight
            tensor.record_stream(stream)

    def _compute(self) -> torch.cuda.Stream:
        return torch.cuda.current_stream(self.device)

    @staticmethod
    def _record(stream, timing: bool = False) -> torch.cuda.Event:
        event = torch.cuda.Event(enable_timing=timing)
        event.record(stream)
        return event

    @staticmethod
    def _wait(stream, events: Iterable) -> None:
        for event in events:
            if event is not None:
                stream.wait_event(event)

    def delay(self, stream: torch.cuda.Stream) -> None:
        """Hook run on ``stream`` after its waits, before its work (:func:`delaying_transport` sleeps here)."""

    def copy(self, stream: Stream, pairs: Pairs, after: Iterable) -> torch.cuda.Event:
        side = self.streams[stream]
        with torch.cuda.stream(side):
            self._wait(side, after)
            self.delay(side)
            copy_pairs(pairs, non_blocking=True)
            return self._record(side)

    def gather(self, stream: Stream, pairs: Pairs, rows: torch.Tensor, after: Iterable) -> torch.cuda.Event:
        side = self.streams[stream]
        with torch.cuda.device(self.device), torch.cuda.stream(side):
            self._wait(side, after)
            self.delay(side)
            # (the page-locked copy of the rows is kept by torch until this copy is done; the device copy is
            # allocated on the side stream, so its memory is reused only by later work there)
            copy_rows(pairs, rows.pin_memory().to(self.device, non_blocking=True))
            return self._record(side)

    def zero(self, tensors: Sequence[torch.Tensor], after: Iterable) -> torch.cuda.Event:
        side = self.streams["h2d"]
        with torch.cuda.stream(side):
            self._wait(side, after)
            zero_all(tensors)
            return self._record(side)

    def mark(self) -> torch.cuda.Event:
        return self._record(self._compute())

    def acquire(self, events: Iterable, reads=(), writes=()) -> None:
        events = [e for e in events if e is not None]
        compute = self._compute()
        if events and all(e.query() for e in events):  # copies done: the wait costs nothing, no timing needed
            self._wait(compute, events)
        elif events:
            start = self._record(compute, timing=True)
            self._wait(compute, events)
            self._timings.append((start, self._record(compute, timing=True)))
        self.delay(compute)  # (also without events: then only a mark orders a later copy behind this compute)

    def finish(self) -> float:
        seconds = 0.0
        for start, end in self._timings:
            end.synchronize()  # the compute stream may differ between calls (autograd's thread)
            seconds += start.elapsed_time(end) / 1e3
        self._timings.clear()
        return seconds

    def synchronize(self) -> None:
        torch.cuda.synchronize(self.device)


def default_transport(device: torch.device) -> Transport:
    """:class:`CudaTransport` on CUDA devices, :class:`SyncTransport` elsewhere."""
    return CudaTransport(device) if device.type == "cuda" else SyncTransport(device)


# ------------------------------------------------------------------------------------------ race checking
class _Pending:
    """A copy-stream operation of :class:`_DeferredCopies` and the event completing with it."""

    __slots__ = ("run", "after", "stream", "seq")

    def __init__(self, run, after: list, stream: Stream, seq: int) -> None:
        self.run, self.after, self.stream, self.seq = run, after, stream, seq


class _DeferredCopies(SyncTransport):
    """CPU copy streams that run late: each operation waits in its stream's queue and runs at a random later call,
    but before anything waits for its event and after the events it waits for — any order CUDA could choose."""

    def __init__(self, device: torch.device | None, seed: int, chance: float, gathers: bool = False) -> None:
        super().__init__(device, gathers)
        self.rng, self.chance = random.Random(seed), chance
        self.queues: dict[str, list[_Pending]] = {"h2d": [], "d2h": []}
        self.done = {"h2d": 0, "d2h": 0}  # operations run so far, per stream
        self.issued = {"h2d": 0, "d2h": 0}

    def _enqueue(self, stream: Stream, run, after: Iterable) -> _Pending:
        self.issued[stream] += 1
        op = _Pending(run, [e for e in after if e is not None], stream, self.issued[stream])
        self.queues[stream].append(op)
        self._wander()
        return op

    def _run_until(self, event: _Pending) -> None:
        """Run ``event``'s stream up to and including its operation (and, first, whatever each waits for)."""
        queue = self.queues[event.stream]
        while self.done[event.stream] < event.seq:
            op = queue.pop(0)
            for dep in op.after:
                self._run_until(dep)
            op.run()
            self.done[op.stream] += 1

    def _wander(self) -> None:
        """With probability ``chance`` per stream, let it make some progress now."""
        for queue in self.queues.values():
            if queue and self.rng.random() < self.chance:
                self._run_until(queue[self.rng.randrange(len(queue))])

    def copy(self, stream: Stream, pairs: Pairs, after: Iterable) -> _Pending:
        pairs = list(pairs)
        return self._enqueue(stream, lambda: super(_DeferredCopies, self).copy(stream, pairs, ()), after)

    def gather(self, stream: Stream, pairs: Pairs, rows: torch.Tensor, after: Iterable) -> _Pending:
        pairs = list(pairs)
        return self._enqueue(
            stream, lambda: super(_DeferredCopies, self).gather(stream, pairs, rows, ()), after
        )

    def zero(self, tensors: Sequence[torch.Tensor], after: Iterable) -> _Pending:
        tensors = list(tensors)
        return self._enqueue("h2d", lambda: super(_DeferredCopies, self).zero(tensors, ()), after)

    def acquire(self, events: Iterable, reads=(), writes=()) -> None:
        for event in events:
            if event is not None:
                self._run_until(event)
        self._wander()

    def synchronize(self) -> None:
        for queue in self.queues.values():
            if queue:
                self._run_until(queue[-1])


class _SleepyCuda(CudaTransport):
    def __init__(self, device: torch.device, seed: int, max_cycles: int) -> None:
        super().__init__(device)
        self.rng, self.max_cycles = random.Random(seed), max_cycles

    def delay(self, stream: torch.cuda.Stream) -> None:
        torch.cuda._sleep(self.rng.randint(0, self.max_cycles))  # on the current stream: ``stream``


def delaying_transport(
    device: torch.device, seed: int = 0, max_cycles: int = 200_000, chance: float = 0.3, gathers: bool = False
) -> Transport:
    """A transport that delays every copy by a random amount, so that a missing event wait shows as wrong numbers
    (race checks: ``benchmarks/offload_stress.py``, the offload tests).

    On CUDA each copy, and the compute stream after each of its waits, sleep up to ``max_cycles`` GPU cycles. On
    CPU, where copies are otherwise synchronous, each copy runs at a random later call (each stream advances with
    probability ``chance`` per call) but no later than the first wait for it: any order the events allow.
    Use it as ``KVPool(config, transport=functools.partial(delaying_transport, seed=s))``. ``gathers`` (CPU; on
    CUDA :func:`offload_gather` decides): scattered pages move by :meth:`Transport.gather`.
    """
    if device.type == "cuda":
        return _SleepyCuda(device, seed, max_cycles)
    return _DeferredCopies(device, seed, chance, gathers)
