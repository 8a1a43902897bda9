"""``Offloader``: what the pool calls for host-tier layers — block streams, writes, gradient hand-over, prefetch.

It joins the three parts of offload: the :class:`~.schedule.OffloadSchedule` (where the sweeps are and what they
use next), the :class:`~.staging.StagingCache` (which buffer holds what, copies and their events) and the
transport (streams). At every pool access (HBM layers included, they move the position) it stages the predicted
block uses into buffers that nothing upcoming needs, until none is free or ``prefetch_depth`` uses are staged.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import torch

from lightning_oomb.engine.config import OOMBConfig
from lightning_oomb.engine.offload.schedule import Need, OffloadSchedule, Selected
from lightning_oomb.engine.offload.staging import StagingCache, Transfer


class Offloader:
    """Streams the blocks of host-tier layers through the staging buffers (see the package docstring).

    Args:
        cache: the staging buffers of the step's host-tier layers (their shape, layers and transport).
        config: ``prefetch_depth``.
        sweep: the sweep in progress (the pool is reserved during a forward or eval sweep).
    """

    def __init__(self, cache: StagingCache, config: OOMBConfig, sweep: str = "forward") -> None:
        self.cache, self.shape, self.transport = cache, cache.shape, cache.transport
        depth = config.prefetch_depth
        self.prefetch_depth = len(cache.buffers) if depth is None else depth
        self.group = group_size(len(cache.buffers))
        self._host_layers = frozenset(cache.host_layers)
        self.schedule = OffloadSchedule(self.shape.num_layers, self.shape.num_blocks, cache.host_layers)
        self._fresh: tuple[int, int] | None = None  # a block just written for the stream about to start
        self._wait_s = 0.0
        self.begin_sweep(sweep)

    # ------------------------------------------------------------------------------------------------ sweeps
    def begin_sweep(self, kind: str) -> None:
        """``"forward"``/``"eval"``: a new step (nothing staged is valid, stats restart); ``"backward"``: K/V
        stay staged, gradients restart at zero (no gradient page is on the host)."""
        if kind != "backward":
            self._wait_s = 0.0
        self._fresh = None
        self.schedule.begin_sweep(kind)
        self.cache.begin_sweep(kind)

    def end_sweep(self) -> None:
        """Resolve the sweep's copy-wait timings (waits for the compute stream up to its last wait)."""
        self._wait_s += self.transport.finish()
        if self.schedule.sweep == "backward":
            self.cache.drop_grads()  # every gradient page has been handed to autograd

    @property
    def trace(self) -> Sequence[Transfer]:
        """This step's copies in issue order (the last ``TRACE_LIMIT`` of them)."""
        return self.cache.trace

    def stats(self) -> dict:
        """This step's traffic so far (see :meth:`lightning_oomb.engine.kv_pool.KVPool.stats`)."""
        return {**self.cache.counts, "copy_wait_s": self._wait_s}

    def synchronize(self) -> None:
        """Wait for every copy and kernel on the device (before arenas are replaced or freed)."""
        self.transport.synchronize()

    # ------------------------------------------------------------------------------------------------ access
    def visit(self, layer: int, chunk: int, grads: bool = False) -> None:
        """Note the start of ``layer``'s stream for chunk ``chunk`` (HBM layers too: it drives prefetch)."""
        self.cache.tick()
        self.schedule.visit(layer, chunk, grads)
        if layer not in self._host_layers:
            self._prefetch()

    def begin_write(self, layer: int, block: int) -> torch.Tensor:
        """Hold a buffer for ``layer``'s block ``block`` that the compute stream is about to write K/V into;
        returns its page table ``[batch, pages_per_row]`` (the compute stream waits for the buffer's copies)."""
        self._fresh = (layer, block)  # protected until its stream has started
        buf = self.cache.stage(Need(layer, block, False, False), "demand", self._protected())
        self.cache.use(buf, writes=("kv",))
        return self.cache.table(buf)

    def end_write(self, layer: int, block: int, persist: bool) -> None:
        """The compute stream wrote the block's K/V. ``persist``: they are new (forward and eval sweeps): send
        them to the host now; otherwise they are the recompute's identical copy of what the host holds."""
        if persist:
            self.schedule.wrote(layer, block)
        self.cache.wrote_kv(self.cache.holder((layer, block)), persist)
        self._prefetch()

    def holds_kv(self, layer: int, block: int) -> bool:
        buf = self.cache.holder((layer, block))
        return buf is not None and buf.kv

    def stream(
        self,
        layer: int,
        chunk: int,
        grads: bool = False,
        first: int = 0,
        blocks: Selected | None = None,
        own: bool = True,
    ) -> Iterator[tuple[tuple[int, int], torch.Tensor]]:
        """Yield ``((first block, end block), page table)`` for the blocks chunk ``chunk`` of ``layer`` attends to:
        its own block (already written or restaged; none if not ``own``) alone first, then the prefix ``first ..
        chunk-1`` (blocks before ``first`` are outside a sliding window; only ``blocks``, if given: a sparse call's
        selected ones, and only their selected pages) in groups of up to :attr:`group` consecutive blocks, each
        group staged together (with its gradient pages if ``grads``), ordered before the compute stream's next use
        and attended by one kernel call over its page table. With ``grads`` the caller adds into the gradient pages
        before asking for the next group; a prefix group's are then written back."""
        self.cache.tick()
        needs = self.schedule.stream(layer, chunk, grads, first, blocks, own)
        self._fresh = None
        parts = ("kv", "grad") if grads else ("kv",)
        used = 0
        for group in _groups(needs, own, self.group):
            bufs = []
            for need in group:
                self.schedule.using(needs, used)  # what prefetch predicts first: needs[used + 1:]
                used += 1
                self.cache.tick()
                buf = self.cache.stage(need, "demand", self._protected(group))
                assert buf.kv or need.pages is not None, "the own block is written before it is streamed"
                bufs.append(buf)
            for buf in bufs:
                self.cache.use(buf, reads=parts, writes=parts[1:])
                if grads:
                    self.cache.added_grads(buf)
            self._prefetch(group)
            yield (group[0].block, group[-1].block + 1), self.cache.group_table(bufs)
            if grads:
                for need, buf in zip(group, bufs, strict=True):
                    if need.block != chunk:
                        self.cache.write_back(buf)

    def grad_table(self, layer: int, block: int) -> torch.Tensor:
        """The page table of the buffer holding ``layer``'s block with its accumulated gradient pages (after
        the backward's stream); stages them again if they were evicted."""
        buf = self.cache.stage(Need(layer, block, False, True), "demand", self._protected())
        self.cache.use(buf, reads=("grad",))
        return self.cache.table(buf)

    def consumed(self, layer: int, block: int) -> None:
        """Backward sweep: the chunk took its gradients of ``layer``; its block's gradient pages are free."""
        self.cache.consumed((layer, block))
        self._prefetch()

    # ---------------------------------------------------------------------------------------------- prefetch
    def _protected(self, current: Sequence[Need] = ()) -> set:
        """Blocks no staging may evict now: the group in use (``current``), the chunk's own block of the current
        stream (its gradient pages wait for ``read_grad``) and a block just written for the stream about to
        start."""
        keep = {self._fresh} if self._fresh is not None else set()
        keep.update((need.layer, need.block) for need in current)
        at = self.schedule.at
        if at is not None:
            keep.add((at.layer, at.chunk))
        return keep

    def _prefetch(self, current: Sequence[Need] = ()) -> None:
        protect = self._protected(current)
        for ahead, need in enumerate(self.schedule.upcoming()):
            # a protected block is never evicted, but may be filled
            if ahead >= self.prefetch_depth or self.cache.stage(need, "prefetch", protect) is None:
                break
            protect.add((need.layer, need.block))
            if len(protect) >= len(self.cache.buffers):
                break


def group_size(buffers: int) -> int:
    """Prefix blocks one kernel call attends to with ``buffers`` staging buffers: as many as leave room for the
    chunk's own block and the next group's copies (``(buffers - 1) // 2``, at least 1)."""
    return max(1, (buffers - 1) // 2)


def _groups(needs: Sequence[Need], own: bool, size: int) -> Iterator[Sequence[Need]]:
    """A stream's needs in the groups one kernel call each attends to: the chunk's own block (``own``: the first
    need) alone, then runs of up to ``size`` consecutive prefix blocks (a sparse stream leaves out the blocks
    without a selected page: such a gap ends a group, so that a group's key range holds only its own blocks)."""
    start = 1 if own and needs else 0
    if start:
        yield needs[:1]
    for end in range(start + 1, len(needs) + 1):
        if end == len(needs) or end - start == size or needs[end].block != needs[end - 1].block + 1:
            yield needs[start:end]
            start = end
