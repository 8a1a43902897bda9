"""The offload schedule: which blocks of which layers the sweeps will use next (pure Python, no tensors).

A *stream* is one attention call of one layer for chunk ``s`` (:class:`Visit`): it uses the chunk's own block ``s``
and the prefix blocks ``first .. s-1`` (``first > 0`` under a sliding window), each a :class:`Need`. Sweep order:
forward and eval sweeps climb the layers, chunk after chunk; the backward sweep recomputes each chunk climbing and
back-propagates it descending (a checkpointed layer's recompute reuses the climb's attention result and streams
nothing: :class:`~lightning_oomb.engine.attention.Kept`; under ``reuse_attention`` the climbs of the chunks from
``reused_from`` on take the forward sweep's results and stream nothing either). :meth:`OffloadSchedule.upcoming`
walks that order from the current position: what the staging cache should prefetch. Correctness never depends on it — a prediction that turns
out wrong only costs a copy.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from typing import NamedTuple

Selected = dict[int, frozenset[int]]  # a sparse stream's prefix blocks -> their selected pages (offsets)


def _every_block(layer: int, chunk: int) -> None:
    return None


class Visit(NamedTuple):
    """One stream of a layer: chunk ``chunk`` attends to blocks ``0 .. chunk``; ``grads``: the backward's."""

    layer: int
    chunk: int
    grads: bool


class Need(NamedTuple):
    """A block use: stage its K/V (``kv``) and/or gradient pages (``grads``); neither = hold a buffer for the
    chunk's own block, which the compute stream writes. ``pages``: only these pages of the block (offsets in it: a
    sparse call's selected ones); ``None``: all."""

    layer: int
    block: int
    kv: bool
    grads: bool
    pages: frozenset[int] | None = None


class OffloadSchedule:
    """The position in the sweeps and the predicted block uses from there.

    Args:
        num_layers: layers of the model (every layer's visit moves the position, HBM layers included).
        num_blocks: blocks (chunks) of the sequence.
        host_layers: the layers whose blocks are streamed (only their uses are predicted).
    """

    def __init__(self, num_layers: int, num_blocks: int, host_layers: Sequence[int]) -> None:
        self.num_layers, self.num_blocks = num_layers, num_blocks
        self.host_layers = frozenset(host_layers)
        self.selected = _every_block
        self.reused_from: int | None = None  # the backward sweep's climbs from this chunk on read no page
        self.sweep = "forward"
        self.written = [0] * num_layers  # leading blocks of each layer whose K/V are on the host
        self.begin_sweep("forward")

    def begin_sweep(self, kind: str) -> None:
        """``"forward"``/``"eval"``: a new step (no K/V on the host yet); ``"backward"``: K/V stay."""
        self.sweep, self.at, self._rest = kind, None, ((), 0)
        self.span = self.num_blocks  # prefix blocks a stream reads (fewer under a sliding window)
        if kind != "backward":
            self.written = [0] * self.num_layers

    def predict_selection(self, selected: Callable[[int, int], Selected | None] | None) -> None:
        """A sparse step's selected prefix blocks (and pages) of a ``(layer, chunk)`` stream — ``{}`` where not yet
        known (nothing of the prefix is predicted), ``None`` for a dense stream (every block) — or no
        ``selected``: a dense step."""
        self.selected = selected or _every_block

    def visit(self, layer: int, chunk: int, grads: bool = False) -> Visit:
        """Move to the start of ``layer``'s stream for chunk ``chunk``."""
        self.at = Visit(layer, chunk, grads)
        self._rest = ((), 0)
        return self.at

    def stream(
        self,
        layer: int,
        chunk: int,
        grads: bool,
        first: int = 0,
        blocks: Selected | None = None,
        own: bool = True,
    ) -> list[Need]:
        """Start ``layer``'s stream for chunk ``chunk`` over the prefix blocks ``first .. chunk-1`` (given
        ``blocks``, a sparse call's: only those, and only their selected pages); return its needs in use order: the
        chunk's own block (already on the device: its K/V were just written or restaged; ``own=False``: the chunk
        has no block here — a context-parallel rank without a slice of a short last chunk), then the prefix blocks
        from the host."""
        self.visit(layer, chunk, grads)
        self.span = chunk - first
        mine = [Need(layer, chunk, False, grads)] if own else []
        return [*mine, *_prefix(layer, range(first, chunk), grads, blocks)]

    def using(self, needs: Sequence[Need], i: int) -> None:
        """``needs[i]`` of the current stream is in use: the prediction continues with ``needs[i + 1:]``."""
        self._rest = (needs, i + 1)

    def wrote(self, layer: int, block: int) -> None:
        """``layer``'s block ``block`` has new K/V (forward and eval sweeps): later streams read it from the host."""
        self.written[layer] = block + 1

    def next_visit(self, v: Visit) -> Visit | None:
        """The stream after ``v`` in sweep order (``None``: the sweep ends)."""
        last = self.num_layers - 1
        if self.sweep != "backward":
            return Visit(v.layer + 1, v.chunk, False) if v.layer < last else Visit(0, v.chunk + 1, False)
        if v.grads:  # a layer's backward: the layer below's, or at the bottom the previous chunk's climb
            if v.layer == 0:
                return Visit(0, v.chunk - 1, False) if v.chunk > 0 else None
            return Visit(v.layer - 1, v.chunk, True)
        if v.layer < last:
            return Visit(v.layer + 1, v.chunk, False)
        return Visit(last, v.chunk, True)

    def upcoming(self) -> Iterator[Need]:
        """Predicted block uses after now, nearest first: the rest of this stream, then the next streams' (up to
        two passes over the layers ahead)."""
        needs, start = self._rest
        yield from needs[start:]
        visit = self.at
        for _ in range(2 * self.num_layers):
            visit = self.next_visit(visit) if visit is not None else None
            if visit is None or visit.chunk >= self.num_blocks:
                return
            if self._reads(visit) and visit.layer in self.host_layers:
                yield Need(visit.layer, visit.chunk, False, visit.grads)
                first = max(0, visit.chunk - self.span)  # a sliding window spans as many blocks as last time
                chosen = self.selected(visit.layer, visit.chunk)
                written = range(first, min(visit.chunk, self.written[visit.layer]))
                yield from _prefix(visit.layer, written, visit.grads, chosen)

    def _reads(self, v: Visit) -> bool:
        """Whether ``v`` reads pages (a backward sweep's climb of a chunk whose forward results it takes does not)."""
        reused = self.reused_from is not None and v.chunk >= self.reused_from
        return not (self.sweep == "backward" and not v.grads and reused)


def _prefix(layer: int, blocks: range, grads: bool, selected: Selected | None) -> Iterator[Need]:
    """The needs of a stream's prefix ``blocks`` (only the selected ones, with their pages, given ``selected``)."""
    for j in blocks:
        if selected is None:
            yield Need(layer, j, True, grads)
        elif j in selected:
            yield Need(layer, j, True, grads, selected[j])
