"""Window layers' tails in host memory between the sweeps (:attr:`~lightning_oomb.engine.pages.PoolShape.host_tails`).

A recycling window layer keeps, besides one chunk's transient pages, its *tails*: tail group ``g`` — the last pages
of chunk ``g``, holding the ``window - 1`` keys before chunk ``g + 1`` starts — is read by chunk ``g + 1`` only, in
the forward sweep and again in the backward sweep, which adds into its gradients before chunk ``g``'s backward takes
them. On the device such a layer keeps two groups, in a ring (group ``g`` at place ``g % 2``,
:meth:`~lightning_oomb.engine.pages.PoolShape.ring_slots`); the host keeps every group's K and V (no gradients):

- forward sweep, chunk ``c``: its write waits until group ``c - 2`` (the same place) has reached the host; group
  ``c`` goes there once written (an eval sweep sends nothing: no backward follows it);
- backward sweep: after chunk ``c``'s backward took group ``c``'s gradients (:meth:`HostTails.consumed`), group
  ``c - 2`` comes back into that place with zero gradients; chunk ``c - 1``'s first read waits for it.

The forward sweep leaves groups ``n - 2`` and ``n - 3`` (of ``n`` chunks) on the device, the first two the backward
sweep needs. Each group crosses once each way per step: a window layer's traffic is its tails' K/V, twice, where a
host-tier layer's is every earlier block's pages every chunk.
"""

from __future__ import annotations

import math

import torch

from lightning_oomb.engine.offload.transport import Transport
from lightning_oomb.engine.pages import PoolShape, Region, page_locked_bytes


class HostBytes:
    """Grow-only page-locked host bytes (:func:`~lightning_oomb.engine.pages.page_locked_bytes`)."""

    def __init__(self, nbytes: int, device: torch.device) -> None:
        self.storage, self._unpin = page_locked_bytes(nbytes, self, device)
        self.nbytes = nbytes

    def free(self) -> None:
        """Unpin and drop the memory; the caller made sure no copy still uses it."""
        if self._unpin is not None:
            self._unpin()
        self.storage = None


class HostTails:
    """The host side of the :attr:`~lightning_oomb.engine.pages.PoolShape.hosted_tails` (see the module docstring).

    Args:
        shape: the step's pool shape (``host_tails`` set).
        regions: each HBM layer's device pages (:meth:`~lightning_oomb.engine.pages.Arena.region`).
        host: at least :attr:`~lightning_oomb.engine.pages.PoolShape.tail_host_bytes` of page-locked bytes.
        transport: the pool's copy streams.
    """

    def __init__(self, shape: PoolShape, regions: dict[int, Region], host: HostBytes, transport: Transport):
        self.shape, self.regions, self.transport = shape, regions, transport
        self.layers = frozenset(shape.hosted_tails)
        self.kv: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        offset = 0
        for layer in shape.hosted_tails:  # each layer's K then V, its tails page-major (as the device ring)
            heads, dim = shape.geometry(layer)
            numel = shape.batch * len(shape.tails[layer]) * heads * shape.page_size * dim
            nbytes = numel * shape.dtype.itemsize
            k, v = (
                host.storage[start : start + nbytes].view(shape.dtype).view(-1, heads, shape.page_size, dim)
                for start in (offset, offset + (shape.parts - 1) * nbytes)  # (values are keys: one tensor)
            )
            self.kv[layer] = (k, v)
            offset += shape.parts * nbytes
        self._held: dict[tuple[int, int], int] = {}  # (layer, ring place) -> the group it holds
        self._sent: dict[tuple[int, int], object] = {}  # (layer, group) -> its copy to the host
        self._fetched: dict[int, object] = {}  # layer -> the copy of the group its next chunk reads
        self._sweep = "forward"
        self.d2h_bytes = self.h2d_bytes = 0
        self.wait_s = 0.0

    def begin_sweep(self, kind: str) -> None:
        if kind != "backward":
            self.d2h_bytes = self.h2d_bytes = 0
            self.wait_s = 0.0
        self._sweep = kind

    def end_sweep(self) -> None:
        self.wait_s += self.transport.finish()

    def _groups(self) -> int:
        return self.shape.num_blocks - 1  # every chunk but the last has a tail group

    def before_write(self, layer: int, block: int) -> None:
        """Forward or eval sweep: chunk ``block`` is about to write its pages (its tail group into the place of
        group ``block - 2``: that group's copy to the host must be done)."""
        if block < self._groups():
            group = self.shape.ring_slots(layer, block)
            region = self.regions[layer]
            self.transport.acquire(
                [self._sent.pop((layer, block - 2), None), self._fetched.pop(layer, None)],
                writes=(region.k[group], region.v[group]),
            )

    def wrote(self, layer: int, block: int) -> None:
        """Forward or eval sweep: chunk ``block`` wrote its pages; a forward sweep sends its tail group to the
        host."""
        if block >= self._groups():
            return
        self._held[layer, block % 2] = block
        if self._sweep != "forward":
            return
        device, host = self.shape.ring_slots(layer, block), self.shape.host_tail_slots(layer, block)
        region, (k, v) = self.regions[layer], self.kv[layer]
        pairs = [(k[host], region.k[device]), (v[host], region.v[device])][: self.shape.parts]
        self._sent[layer, block] = self.transport.copy("d2h", pairs, [self.transport.mark()])
        self.d2h_bytes += self.shape.parts * k[host].nbytes

    def before_read(self, layer: int) -> None:
        """Backward sweep: the chunk's read of its layer's pages waits for the group it reads."""
        event = self._fetched.pop(layer, None)
        if event is not None:
            region = self.regions[layer]
            self.transport.acquire([event], reads=(region.k, region.v), writes=(region.dk, region.dv))

    def consumed(self, layer: int, block: int) -> None:
        """Backward sweep: chunk ``block`` took its gradients; group ``block - 2`` comes into the freed place."""
        group = block - 2
        if group < 0 or self._held.get((layer, group % 2)) == group:
            return
        device, host = self.shape.ring_slots(layer, group), self.shape.host_tail_slots(layer, group)
        region, (k, v) = self.regions[layer], self.kv[layer]
        after = [self.transport.mark(), self._sent.pop((layer, group), None)]
        parts = self.shape.parts
        self.transport.copy("h2d", [(region.k[device], k[host]), (region.v[device], v[host])][:parts], after)
        self._fetched[layer] = self.transport.zero([region.dk[device], region.dv[device]][:parts], ())
        self._held[layer, group % 2] = group
        self.h2d_bytes += parts * k[host].nbytes


def host_tail_bytes(shape: PoolShape) -> int:
    """Page-locked bytes :class:`HostTails` needs for ``shape`` (0 without hosted tails), rounded up to a page of
    host memory."""
    return math.ceil(shape.tail_host_bytes / 4096) * 4096
