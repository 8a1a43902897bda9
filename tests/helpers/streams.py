"""A recording transport: checks the offload schedule's stream ordering on CPU.

It stands in for the CUDA streams (copies still run at once), but logs every operation on the device — copies and
zero-fills on the copy streams, and every compute-stream access the staging cache announces (K/V writes, kernel
reads and gradient adds, gradient gathers) — with a vector clock: how many operations of each stream it is ordered
after, through program order and event waits. :meth:`RecordingTransport.hazards` then lists every pair of
conflicting operations (same bytes, one writing) on different streams that nothing orders.
"""

from __future__ import annotations

import torch

STREAMS = ("compute", "h2d", "d2h")


class _Event:
    def __init__(self, clock: dict) -> None:
        self.clock = clock


def _region(t: torch.Tensor) -> tuple[int, int]:
    assert t.is_contiguous(), "staging and host views are contiguous slot ranges"
    return t.data_ptr(), t.data_ptr() + t.numel() * t.element_size()


class RecordingTransport:
    """See the module docstring. ``ignore_waits_on``: a stream whose waits are dropped (a negative control)."""

    def __init__(self, device=None, ignore_waits_on: str | None = None, gathers: bool = False) -> None:
        self.clocks: dict[str, dict[str, int]] = {stream: {} for stream in STREAMS}
        self.ops: list[tuple[str, int, dict, list, list]] = []
        self.ignore, self.gathers, self.gathered = ignore_waits_on, gathers, 0

    def _wait(self, stream: str, events) -> None:
        if stream == self.ignore:
            return
        clock = self.clocks[stream]
        for event in events:
            if event is not None:
                for other, n in event.clock.items():
                    clock[other] = max(clock.get(other, 0), n)

    def _op(self, stream: str, reads=(), writes=()) -> None:
        clock = self.clocks[stream]
        clock[stream] = clock.get(stream, 0) + 1
        self.ops.append(
            (stream, clock[stream], dict(clock), [_region(t) for t in reads], [_region(t) for t in writes])
        )

    def _record(self, stream: str) -> _Event:
        return _Event(dict(self.clocks[stream]))

    def adopt(self, tensor: torch.Tensor) -> None:
        pass

    def copy(self, stream: str, pairs, after) -> _Event:
        self._wait(stream, after)
        for dst, src in pairs:
            dst.copy_(src)
        self._op(stream, reads=[src for _, src in pairs], writes=[dst for dst, _ in pairs])
        return self._record(stream)

    def gather(self, stream: str, pairs, rows, after) -> _Event:
        self._wait(stream, after)
        self.gathered += 1
        for dst, src in pairs:
            dst[rows[0]] = src[rows[1]]
        dst_rows = [dst[r : r + 1] for dst, _ in pairs for r in rows[0].tolist()]
        self._op(
            stream, reads=[src[r : r + 1] for _, src in pairs for r in rows[1].tolist()], writes=dst_rows
        )
        return self._record(stream)

    def zero(self, tensors, after) -> _Event:
        self._wait("h2d", after)
        for t in tensors:
            t.zero_()
        self._op("h2d", writes=tensors)
        return self._record("h2d")

    def mark(self) -> _Event:
        return self._record("compute")

    def acquire(self, events, reads=(), writes=()) -> None:
        self._wait("compute", events)
        self._op("compute", reads, writes)

    def finish(self) -> float:
        return 0.0

    def synchronize(self) -> None:
        pass

    def hazards(self) -> list[tuple[str, str]]:
        """Pairs (earlier, later) that touch the same bytes, one writing, on different streams, unordered."""

        def clash(xs, ys) -> bool:
            return any(a < d and c < b for a, b in xs for c, d in ys)

        found = []
        for i, (sa, na, _, ra, wa) in enumerate(self.ops):
            for sb, _, clock, rb, wb in self.ops[i + 1 :]:
                if sa != sb and clock.get(sa, 0) < na and (clash(wa, rb + wb) or clash(ra, wb)):
                    found.append((sa, sb))
        return found
