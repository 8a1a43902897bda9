"""Paged KV + KV-gradient pool, in an HBM tier and (with offload) a pinned host tier.

Pages, arenas and their slot arithmetic are in :mod:`lightning_oomb.engine.pages`; this module places layers in
tiers and implements the access contract.

**Tiers.** Without offload every layer lives in the HBM tier (the device the model runs on). With offload,
:func:`plan_tiers` fills ``hbm_budget`` with whole layers; the other layers live in the host tier (pinned when CUDA
is available) and are streamed in **blocks** of one chunk's pages through ``staging_buffers`` device buffers
(:mod:`lightning_oomb.engine.offload` decides what is copied when). The pool's device bytes are at most
``max(hbm_budget, staging_buffers * block_bytes)``: with every layer on the host they do not depend on the
sequence length. Before anything is allocated, the bytes of every tier are checked against the memory available
to it (device memory on CUDA, ``MemAvailable`` for host memory).

**Access contract** (what the attention op does, once per layer and chunk; the order drives prefetch):
:meth:`KVPool.write` stores the chunk's post-RoPE K/V at its start (in the backward sweep the same call restages
the recomputed, identical K/V of a host layer on the device and changes nothing else); :meth:`KVPool.parts` then
hands out the pages of ``[0, num_tokens)`` as one :class:`~lightning_oomb.engine.pages.PagedKV` (HBM layer) or one
per group of staged blocks (host layer), each with the key range it covers — with ``grads=True`` the caller adds
into their gradient pages before taking the next part; :meth:`KVPool.read_grad` returns a chunk's accumulated gradients and,
in the backward sweep, frees the chunk's gradient pages. A write zeroes the new pages' gradients and, for a sparse
step, stores the new pages' summaries (:meth:`KVPool.summaries`; always on the device, counted in its bytes).
:meth:`KVPool.begin_sweep` / :meth:`KVPool.end_sweep` bracket each sweep. The pool is sized per step from the
sequence length and reused across steps: arenas only grow.
"""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

import torch

from lightning_oomb.engine.config import OOMBConfig
from lightning_oomb.engine.errors import OOMBConfigError
from lightning_oomb.engine.memory import HOST_RESERVE_BYTES, host_memory_available
from lightning_oomb.engine.offload import (
    HostBytes,
    HostTails,
    Offloader,
    StagingCache,
    Transfer,
    Transport,
    default_transport,
    host_tail_bytes,
    offload_gather,
)
from lightning_oomb.engine.pages import (
    Arena,
    PagedKV,
    PoolShape,
    Region,
    arena_bytes,
    gather_tokens,
    write_tokens,
)
from lightning_oomb.engine.sparse import summarize

AUTO_HEADROOM = 0.25  # hbm_budget="auto" leaves this fraction of the device for params, grads and activations


# ------------------------------------------------------------------------------------------------------ tiers
@dataclass(frozen=True)
class TierPlan:
    """Which layers live where for one step; ``staging_buffers`` is 0 when no layer is on the host."""

    hbm_layers: tuple[int, ...]
    host_layers: tuple[int, ...]
    staging_buffers: int


def plan_tiers(
    num_layers: int,
    layer_bytes: int,
    budget: int | None,
    staging_buffers: int,
    block_bytes: int,
    device_only: tuple[int, ...] = (),
) -> TierPlan:
    """Split layers between tiers so the pool's device bytes stay within ``budget`` (``None``: no limit).

    ``device_only`` layers (window layers that keep only their tails: small) always stay on the device; the caller
    takes their bytes out of the budget. The others are full layers: device bytes = ``layer_bytes`` per HBM layer
    plus, once a layer is on the host, ``staging_buffers * block_bytes``; the most HBM layers that fit win. Host
    layers are spread evenly over depth (not the last ones), so each host layer's copies overlap the compute of the
    HBM layers before it. A budget below the staging buffers puts every full layer on the host: they are the floor
    of offload's device memory.
    """
    everything = tuple(range(num_layers))
    full = tuple(i for i in everything if i not in device_only)
    if budget is None or len(full) * layer_bytes <= budget:
        return TierPlan(everything, (), 0)
    hbm = len(full) - 1
    while hbm > 0 and hbm * layer_bytes + staging_buffers * block_bytes > budget:
        hbm -= 1
    n_host = len(full) - hbm
    host = tuple(f for i, f in enumerate(full) if (i + 1) * n_host // len(full) > i * n_host // len(full))
    return TierPlan(tuple(i for i in everything if i not in host), host, staging_buffers)


def place_layers(
    shape: PoolShape, budget: int | None, staging_buffers: int, host_tails: bool | str = "auto"
) -> tuple[PoolShape, TierPlan, dict[str, int]]:
    """The tiers of ``shape``'s layers for a device ``budget`` (:func:`plan_tiers`; the device-only layers — window
    layers that keep only their tails, layers of another geometry — stay on the device, their bytes taken out of the
    budget first) and each arena's slots (``"hbm"``, ``"staging"``, ``"host"``): what :meth:`KVPool.reserve`
    allocates, and what the memory planner counts. Where every page does not fit the budget, window layers' tails
    wait in host memory before any full layer goes to the host tier (they move once each way, a full layer's pages
    every chunk): the fewest full layers, then the fewest layers' tails that fit (``shape`` comes back with
    ``host_tails``; :func:`_host_tails`; ``OOMBConfig.host_tails`` — ``True``: every window layer's whenever there
    is a budget, ``False``: never)."""
    if budget is not None:
        shape = _host_tails(shape, budget, host_tails, staging_buffers)
        budget = max(0, budget - sum(map(shape.bytes_of, shape.device_only)))
    plan = plan_tiers(
        shape.num_layers, shape.layer_bytes, budget, staging_buffers, shape.block_bytes, shape.device_only
    )
    slots = {
        "hbm": sum(map(shape.hbm_slots_of, plan.hbm_layers)),
        "staging": plan.staging_buffers * shape.block_slots,
        "host": len(plan.host_layers) * shape.layer_slots,
    }
    return shape, plan, slots


def _host_tails(shape: PoolShape, budget: int, option: bool | str, staging_buffers: int) -> PoolShape:
    """``shape`` with the window layers' tails that :func:`place_layers` puts in host memory for ``budget``: the
    fewest full layers in the host tier first (their pages stream in every chunk), then the fewest layers' tails
    (those saving the most device bytes first); all of them when even that does not fit."""
    every = dataclasses.replace(shape, host_tails=True)
    if option is not True and (option is False or not every.hosted_tails):
        return shape
    if option is True:
        return every
    full = shape.num_layers - len(shape.device_only)
    kept = sum(map(shape.bytes_of, shape.device_only))
    savings = sorted((every.bytes_of(layer) - shape.bytes_of(layer), layer) for layer in every.hosted_tails)
    for host in range(full + 1):  # full layers in the host tier (plan_tiers: staging buffers come with them)
        excess = (
            kept + (full - host) * shape.layer_bytes + (staging_buffers * shape.block_bytes if host else 0)
        )
        excess -= budget
        chosen = []
        for saving, layer in savings:  # (negative: most first)
            if excess <= 0:
                break
            chosen.append(layer)
            excess += saving
        if excess <= 0:
            return dataclasses.replace(shape, host_tails=tuple(sorted(chosen))) if chosen else shape
    return every


def device_memory_available(device: torch.device) -> tuple[int, int]:
    """``(bytes this process can still allocate, the device's total)`` on a CUDA device: the free memory plus the
    allocator's cached blocks, within the share ``torch.cuda.set_per_process_memory_fraction`` allows it (the
    allocator refuses more)."""
    index = torch.cuda.current_device() if device.index is None else device.index  # torch <= 2.11 needs one
    free, total = torch.cuda.mem_get_info(index)
    reserved, allocated = torch.cuda.memory_reserved(index), torch.cuda.memory_allocated(index)
    try:
        fraction = torch.cuda.get_per_process_memory_fraction(index)
    except RuntimeError:  # an allocator backend without one (cudaMallocAsync): the whole device
        fraction = 1.0
    return max(0, min(free + reserved, int(fraction * total)) - allocated), total


def _gib(n: int) -> str:
    return f"{n / 2**30:.2f} GiB"


# ------------------------------------------------------------------------------------------------------- pool
def hbm_budget(config: OOMBConfig, device_type: str, free: Callable[[], tuple[int, int]]) -> int | None:
    """The device bytes of the pool's pages at its first step (``None``: no limit — no offload, or ``"auto"`` off
    CUDA, where the device is host memory): the given ``hbm_budget``, or for ``"auto"`` the free device bytes less
    ``AUTO_HEADROOM`` of the device (``free() -> (free bytes, total bytes)``, asked only then)."""
    if not config.offloads:
        return None
    if config.hbm_budget != "auto":
        return int(config.hbm_budget)
    if device_type != "cuda":
        return None
    available, total = free()
    return max(0, available - int(AUTO_HEADROOM * total))


class KVPool:
    """Paged K/V and dK/dV storage for one sequence batch (see the module docstring).

    Args:
        config: the engine options; the pool reads ``offload``, ``hbm_budget`` (``"auto"``: on CUDA the free
            device memory, cached blocks and the pool's own arenas included, minus ``AUTO_HEADROOM`` of the device;
            elsewhere no limit: the device is host memory already), ``staging_buffers`` and ``prefetch_depth``.
        transport: a factory ``transport(device) -> Transport`` for the offload copies
            (:func:`~lightning_oomb.engine.offload.default_transport`: CUDA streams on CUDA, synchronous copies
            elsewhere).
    """

    def __init__(
        self,
        config: OOMBConfig | None = None,
        transport: Callable[[torch.device], Transport] = default_transport,
    ) -> None:
        self.config = config or OOMBConfig()
        self.transport = transport
        self.shape: PoolShape | None = None  # as placed (host_tails decided)
        self._requested: PoolShape | None = None
        self.plan: TierPlan | None = None
        self._hbm: Arena | None = None
        self._host: Arena | None = None
        self._staging: Arena | None = None
        self._summaries: torch.Tensor | None = None  # sparse steps: PoolShape.summary_shape
        self._tables: dict[int, torch.Tensor] = {}  # HBM layer -> its page table [batch, pages]
        self._regions: dict[int, Region] = {}  # HBM layer -> its pages (at its own KV heads and head dim)
        self._transient: dict[int, slice] = {}  # recycling window layer -> its transient slots
        self._offload: Offloader | None = None
        self._tail_host: HostBytes | None = None  # grow-only, like the arenas
        self._tails: HostTails | None = None  # the window layers' tails in host memory (PoolShape.host_tails)
        self._sweep = "forward"
        self._selected = None
        self._warned: set[str] = set()

    # ----------------------------------------------------------------------------------------------- sizing
    def reserve(self, shape: PoolShape, device: torch.device) -> None:
        """Place layers in tiers for ``shape`` and make room; an arena is reallocated only when it must grow (or
        change dtype, page geometry or device). Raises :class:`OOMBConfigError` before allocating if a tier would
        not fit in the memory available to it."""
        self._warn_no_effect(shape, device)
        requested = shape
        self._synchronize()  # copies in flight may still use arenas that get replaced below
        cfg = self.config
        shape, plan, slots = place_layers(
            shape, self._budget(device), cfg.staging_count(shape.block_bytes), cfg.host_tails
        )
        host_device = torch.device("cpu")
        self._check_memory(shape, plan, slots, device)
        self._hbm = self._grow(self._hbm, slots["hbm"], shape, device)
        self._staging = self._grow(self._staging, slots["staging"], shape, device)
        self._host = self._grow(
            self._host, slots["host"], shape, host_device, host=True, mapped=offload_gather()
        )
        if self._summaries_short(shape, device):
            self._summaries = None
            self._summaries = torch.zeros(shape.summary_shape, dtype=shape.dtype, device=device)
        self._tables, self._regions, self._transient, base = {}, {}, {}, 0
        # each layer's slots viewed at its own geometry; its table indexes that view (an alias has none: it reads
        # its source's)
        for layer in (layer for layer in plan.hbm_layers if layer not in shape.aliases):
            self._regions[layer] = self._hbm.region(base, shape.hbm_slots_of(layer), *shape.geometry(layer))
            self._tables[layer] = shape.layer_table(layer, device)
            if shape.tails[layer] is not None:
                self._transient[layer] = shape.transient_slots(layer)
            base += shape.hbm_slots_of(layer)
        self._offload = self._tails = None
        transport = self.transport(device) if plan.host_layers or shape.hosted_tails else None
        if plan.host_layers:
            cache = StagingCache(
                shape, plan.host_layers, self._host, self._staging, plan.staging_buffers, transport
            )
            self._offload = Offloader(cache, cfg, self._sweep)
            self._offload.schedule.predict_selection(self._selected)
        if shape.hosted_tails:
            needed = host_tail_bytes(shape)
            if self._tail_host is None or self._tail_host.nbytes < needed:
                if self._tail_host is not None:
                    self._tail_host.free()
                self._tail_host = HostBytes(needed, device)
            self._tails = HostTails(shape, self._regions, self._tail_host, transport)
            self._tails.begin_sweep(self._sweep)
        self.shape, self.plan, self._requested = shape, plan, requested

    def holds(self, shape: PoolShape) -> bool:
        """The pool is reserved for ``shape`` (as asked of :meth:`reserve`)."""
        return self._requested == shape

    def _warn_no_effect(self, shape: PoolShape, device: torch.device) -> None:
        """Options that silently change nothing for this step say so, once per pool."""
        cfg = self.config
        if cfg.offloads and cfg.hbm_budget == "auto" and device.type != "cuda":
            self._warn_once(
                "offload",
                f"offload=True has no effect on a {device.type} device: every page already lives in host memory "
                "(with hbm_budget='auto' nothing moves) — drop offload, or run on a CUDA device.",
            )
        if cfg.offload is False and cfg.hbm_budget != "auto":
            self._warn_once(
                "hbm_budget",
                f"hbm_budget={cfg.hbm_budget} has no effect with offload=False: every page stays on the device — "
                "set offload=True (or 'auto') to keep only that many bytes of pages there.",
            )
        if shape.kv_grad_dtype == "bfloat16" and shape.grad_dtype != torch.bfloat16:
            self._warn_once(
                "kv_grad_dtype",
                f"kv_grad_dtype='bfloat16' has no effect with {shape.dtype} K/V: gradient pages are never "
                f"narrower than K/V, so they stay {shape.grad_dtype} — it halves gradient memory only for bf16/fp16 "
                "models (e.g. precision='bf16-true').",
            )

    def _warn_once(self, key: str, message: str) -> None:
        if key not in self._warned:
            self._warned.add(key)
            warnings.warn(message, UserWarning, stacklevel=4)

    def _budget(self, device: torch.device) -> int | None:
        def free() -> tuple[int, int]:  # what this process can allocate, this pool's own arenas included
            available, total = device_memory_available(device)
            return available + self.device_bytes, total

        return hbm_budget(self.config, device.type, free)

    def _check_memory(self, shape: PoolShape, plan: TierPlan, slots: dict, device: torch.device) -> None:
        """Refuse a pool whose new arenas exceed the memory available to them (arenas they replace count as
        free): the host tier against host memory, then the device arenas (HBM tier + staging buffers) against
        device memory — or, on a CPU device, against the host memory the host tier leaves."""
        host = torch.device("cpu")
        new_host, freed_host = self._new_bytes(self._host, slots["host"], shape, host)
        held = self._tail_host.nbytes if self._tail_host is not None else 0
        if host_tail_bytes(shape) > held:
            new_host, freed_host = new_host + host_tail_bytes(shape), freed_host + held
        new_device, freed_device = (
            sum(x)
            for x in zip(
                self._new_bytes(self._hbm, slots["hbm"], shape, device),
                self._new_bytes(self._staging, slots["staging"], shape, device),
                strict=True,
            )
        )
        if self._summaries_short(shape, device):
            new_device += shape.summary_bytes
            freed_device += self._summary_bytes
        available = host_memory_available() if new_host or device.type == "cpu" else None
        host_usable = None if available is None else available + freed_host - HOST_RESERVE_BYTES
        if new_host and host_usable is not None:
            self._refuse_if_short(shape, plan, new_host, host_usable, None)
        if not new_device:
            return
        if device.type == "cuda":
            available, _ = device_memory_available(device)
            self._refuse_if_short(shape, plan, new_device, available + freed_device, device)
        elif device.type == "cpu" and host_usable is not None:
            self._refuse_if_short(shape, plan, new_device, host_usable - new_host + freed_device, device)

    def _summaries_short(self, shape: PoolShape, device: torch.device) -> bool:
        """A sparse step whose summaries do not fit the ones held (they only grow, like the arenas)."""
        if shape.page_score is None:
            return False
        held = self._summaries
        want = shape.summary_shape
        return not (
            held is not None
            and held.device == device
            and held.dtype == shape.dtype
            and held.shape[:2] + held.shape[3:] == want[:2] + want[3:]
            and held.shape[2] >= want[2]
        )

    @staticmethod
    def _new_bytes(arena: Arena | None, slots: int, shape: PoolShape, device) -> tuple[int, int]:
        """Bytes a step must newly allocate for an arena of ``slots`` pages, and the bytes that frees."""
        if slots == 0 or (arena is not None and arena.fits(slots, shape, device)):
            return 0, 0
        return arena_bytes(slots, shape), arena.nbytes if arena is not None else 0

    def _refuse_if_short(self, shape, plan, needed: int, usable: int, device: torch.device | None) -> None:
        """Raise if ``needed`` bytes exceed ``usable`` ones of ``device`` memory (``None``: the host tier)."""
        if needed <= usable:
            return
        ways = []
        kv_size, grad_size = shape.dtype.itemsize, shape.grad_dtype.itemsize
        if grad_size > max(2, kv_size):  # bfloat16 gradient pages are allowed (never narrower than K/V)
            smaller = needed * (kv_size + 2) // (kv_size + grad_size)
            ways.append(f"kv_grad_dtype='bfloat16' (needs {_gib(smaller)})")
        ways.append("a shorter context or a smaller batch")
        offload = self.config.offloads
        if device is None:
            ways.append("a larger hbm_budget (more layers stay on the device)")
        elif device.type == "cuda" and offload:
            ways.append("a smaller hbm_budget (or 'auto')")
        elif device.type == "cuda":
            ways.append("offload=True (pages beyond hbm_budget go to pinned host memory)")
        tokens = f"({shape.batch} x {shape.seq_len} tokens)"
        tails = f" and the tails of {len(shape.hosted_tails)} window layers" if shape.hosted_tails else ""
        if device is None:
            raise OOMBConfigError(
                f"offload needs {_gib(needed)} of host memory for the K/V and gradient pages of "
                f"{len(plan.host_layers)} host-tier layers{tails} {tokens} but only {_gib(max(usable, 0))} is available "
                f"(MemAvailable minus {_gib(HOST_RESERVE_BYTES)} kept for the system) — pinned pages cannot be "
                f"swapped out — use {', or '.join(ways)}."
            )
        where = "GPU memory" if device.type == "cuda" else "host memory (the model runs on the CPU)"
        raise OOMBConfigError(
            f"the KV pool needs {_gib(needed)} of {where} for the K/V and gradient pages of "
            f"{len(plan.hbm_layers)} layers{' and the staging buffers' if plan.host_layers else ''} {tokens} but "
            f"only {_gib(max(usable, 0))} is free — it would not fit — use {', or '.join(ways)}."
        )

    @staticmethod
    def _grow(
        arena: Arena | None, slots: int, shape: PoolShape, device, host: bool = False, mapped: bool = False
    ) -> Arena | None:
        mapped = mapped and torch.cuda.is_available()  # (host memory is page-locked only then)
        if slots == 0 or (arena is not None and arena.fits(slots, shape, device) and arena.mapped == mapped):
            return arena  # an arena this step does not need is kept: arenas only grow
        if arena is not None:
            arena.free()
        return Arena(slots, shape, device, host, mapped)

    def _synchronize(self) -> None:
        for user in (self._offload, self._tails):
            if user is not None:
                user.transport.synchronize()

    def release(self) -> None:
        """Free every arena, pinned host memory included (after an exception, or on teardown); the next
        :meth:`reserve` starts afresh."""
        self._synchronize()
        for arena in (self._hbm, self._staging, self._host, self._tail_host):
            if arena is not None:
                arena.free()
        self._hbm = self._host = self._staging = self._offload = self._summaries = None
        self._tail_host = self._tails = None
        self._tables, self._regions = {}, {}
        self.shape = self.plan = self._requested = None

    @property
    def device_bytes(self) -> int:
        """Bytes of the pool's device arenas (HBM tier + staging buffers) and page summaries."""
        return sum(a.nbytes for a in (self._hbm, self._staging) if a is not None) + self._summary_bytes

    @property
    def _summary_bytes(self) -> int:
        held = self._summaries
        return held.numel() * held.element_size() if held is not None else 0

    @property
    def host_bytes(self) -> int:
        """Bytes of the host-tier arena and of the window layers' tails in host memory."""
        return sum(held.nbytes for held in (self._host, self._tail_host) if held is not None)

    @property
    def allocated_bytes(self) -> int:
        """Bytes held by all arenas, including slack from earlier, longer steps."""
        return self.device_bytes + self.host_bytes

    def streams(self, layer: int) -> bool:
        """``layer`` lives in the host tier: it is streamed in blocks, and in the backward sweep
        :meth:`write` needs the chunk's K/V again."""
        return self._offload is not None and self.shape.source_of(layer) not in self._tables

    def recycles(self, layer: int) -> bool:
        """``layer`` keeps only its tails (a window layer): its chunk's other pages are rewritten from the
        chunk's own K/V in the backward sweep."""
        return self.shape is not None and self.shape.tails[layer] is not None

    def restages(self, layer: int) -> bool:
        """The backward sweep's :meth:`write` needs the chunk's K/V again (a host layer or a recycling one)."""
        return self.streams(layer) or self.recycles(layer)

    # ------------------------------------------------------------------------------------------------ sweeps
    def begin_sweep(
        self,
        kind: str,
        selected: Callable[[int, int], dict | None] | None = None,
        reused_from: int | None = None,
    ) -> None:
        """Start a ``"forward"``/``"eval"`` sweep (a new step: every page is rewritten, gradients zero) or the
        ``"backward"`` sweep (pages are read, gradient pages accumulated). ``selected(layer, chunk)``: a sparse
        step's selected prefix blocks of a stream where known (``None``: every block), for prefetch;
        ``reused_from``: the backward sweep's recompute of chunks from this one on reads no page
        (``reuse_attention``)."""
        self._sweep, self._selected = kind, selected
        if self._offload is not None:
            self._offload.begin_sweep(kind)
            self._offload.schedule.predict_selection(selected)
            self._offload.schedule.reused_from = reused_from
        if self._tails is not None:
            self._tails.begin_sweep(kind)

    def end_sweep(self) -> None:
        """Finish the sweep's bookkeeping (copy-wait timings; on CUDA this waits for the compute stream)."""
        for user in (self._offload, self._tails):
            if user is not None:
                user.end_sweep()

    def stats(self) -> dict:
        """Placement, arena bytes and this step's traffic: ``h2d_bytes``/``d2h_bytes`` (bytes copied host to
        device / device to host), ``copy_wait_s`` (seconds the compute stream waited for copies; 0 on CPU),
        ``prefetch_copies``/``demand_copies`` (host-to-device copies issued ahead of use / when needed),
        ``copy_runs`` (tensor copies issued both ways: one per tensor and run of consecutive pages — a sparse step's
        scattered pages make many, each a call with its own host-side cost)."""
        plan = self.plan
        out = {
            "offload": self.config.offloads,
            "hbm_layers": len(plan.hbm_layers) if plan else 0,
            "host_layers": len(plan.host_layers) if plan else 0,
            "hbm_pool_bytes": self._hbm.nbytes if self._hbm else 0,
            "staging_bytes": self._staging.nbytes if self._staging else 0,
            "host_pool_bytes": self.host_bytes,
            "hosted_tail_layers": len(self.shape.hosted_tails) if self.shape else 0,
            "summary_bytes": self._summary_bytes,
            "h2d_bytes": 0,
            "d2h_bytes": 0,
            "copy_wait_s": 0.0,
            "prefetch_copies": 0,
            "demand_copies": 0,
            "copy_runs": 0,
        }
        if self._offload is not None:
            out.update(self._offload.stats())
        if self._tails is not None:
            out["h2d_bytes"] += self._tails.h2d_bytes
            out["d2h_bytes"] += self._tails.d2h_bytes
            out["copy_wait_s"] += self._tails.wait_s
        return out

    @property
    def transfers(self) -> Sequence[Transfer]:
        """This step's copies between the host tier and the staging buffers, in issue order (empty without host
        layers; the last ``TRACE_LIMIT`` of a long step): the prefetch / write-back schedule, for monitoring and
        tests."""
        return self._offload.trace if self._offload is not None else ()

    # ------------------------------------------------------------------------------------------------ access
    def _layer_table(self, layer: int) -> torch.Tensor:
        return self._tables[layer]

    def write(
        self, layer: int, start: int, k: torch.Tensor, v: torch.Tensor, window: int | None = None
    ) -> None:
        """Store a chunk's post-RoPE ``k, v [B, kv_heads, L, head_dim]`` at token ``start`` (page aligned); the
        layer's content becomes tokens ``[0, start + L)`` with zero gradients for the new pages. In the backward
        sweep ``k, v`` are the recompute's identical copy: only a host layer or a recycling window layer needs
        them (its transient pages get them back with zero gradients; its tails keep theirs). ``window``: the
        call's sliding window, checked against the one the model declared."""
        shape = self.shape
        assert start % shape.page_size == 0, "chunks start on page boundaries"
        heads = shape.geometry(layer)
        if (k.shape[1], k.shape[3]) != heads or (v.shape[1], v.shape[3]) != heads:
            raise OOMBConfigError(
                f"layer {layer} attends with keys of {k.shape[1]} heads x {k.shape[3]} and values of {v.shape[1]} x "
                f"{v.shape[3]}, but the model declared {heads[0]} KV heads of {heads[1]} (a Hugging Face "
                "model: its config's num_key_value_heads and head_dim), the page pool's shape — correct the config "
                "(e.g. drop a num_key_value_heads the architecture ignores), or train this model with another strategy."
            )
        declared = None if shape.windows is None else shape.windows[layer]
        if declared is not None and window is None:  # (a mask-only window: Qwen2-MoE, PhiMoE)
            raise OOMBConfigError(
                f"layer {layer}'s attention call passes no sliding_window, but the model declares "
                f"{declared}: this architecture applies its window through the attention mask alone, "
                "which OOMB does not read (it lays out its own causal attention), so it cannot train it with the "
                "window — train it with another strategy, or without a window (e.g. config sliding_window=None or "
                "use_sliding_window=False) if your sequences are no longer than it or the model trains without it."
            )
        if shape.windows is not None and declared != window:
            raise OOMBConfigError(
                f"layer {layer} attends with sliding_window={window} but the model declared {declared} — "
                "window layers keep only the pages their window reaches, so this would read missing keys — make "
                "the model's `layer_windows` match its attention calls (or drop it: every page is then kept); a "
                "Hugging Face model declares its config's sliding_window / layer_types: correct the config, or train "
                "a model whose layers ignore it with another strategy."
            )
        if layer in shape.aliases:  # its call passes its source's K/V: stored there already
            return
        backward = self._sweep == "backward"
        if shape.page_score is not None and not backward:
            first = start // shape.page_size
            summary = summarize(k, shape.page_size, shape.page_score)
            self.summaries(layer, first + summary.shape[1])[:, first:] = summary
        if not self.streams(layer):
            table, pages = self._layer_table(layer), self._regions[layer]
            tails = self._tails if self._tails is not None and layer in self._tails.layers else None
            if not backward:
                if tails is not None:
                    tails.before_write(layer, shape.block_of(start))
                self._store(pages, table, start, k, v, zero_grads=True)
                if tails is not None:
                    tails.wrote(layer, shape.block_of(start))
            elif self.recycles(layer):
                self._store(pages, table, start, k, v, zero_grads=False)
                region = self._transient[layer]  # the last chunk that used it left its gradients there
                for grads in (pages.dk, pages.dv)[: shape.parts]:
                    grads[region].zero_()
            return
        block = shape.block_of(start)
        if backward and self._offload.holds_kv(layer, block):
            return
        table = self._offload.begin_write(layer, block)
        self._store(self._staging, table, start, k, v, zero_grads=False)  # host gradients start at zero
        self._offload.end_write(layer, block, persist=not backward)

    def _store(self, arena: Arena | Region, table: torch.Tensor, start: int, k, v, zero_grads: bool) -> None:
        first, end = start // self.shape.page_size, self.shape.num_pages(start + k.shape[2])
        slots = table[:, first:end]
        parts = self.shape.parts  # (values are keys: v is k, dv is dk)
        for pages, tokens in ((arena.k, k), (arena.v, v))[:parts]:
            write_tokens(pages, slots, tokens)
        if zero_grads:
            flat = slots.flatten().long()
            for pages in (arena.dk, arena.dv)[:parts]:
                pages.index_fill_(0, flat, 0)

    def parts(
        self, layer: int, num_tokens: int, grads: bool = False, first_key: int = 0,
        blocks: dict[int, frozenset[int]] | None = None, own: bool = True,
    ) -> Iterator[PagedKV]:  # fmt: skip
        """The pages of ``layer`` holding tokens ``[0, num_tokens)`` (the chunk ending there and everything
        before), for the attention op: one :class:`PagedKV` for an HBM layer, one per group of consecutive blocks
        for a host layer (:meth:`~lightning_oomb.engine.offload.Offloader.stream`; the chunk's own block first;
        blocks wholly before ``first_key`` — outside a sliding window — and, given ``blocks`` (block -> page
        offsets: a sparse call's selection), earlier blocks not in it are skipped and only the listed pages of the
        others staged). ``own=False``: the chunk has no tokens here (a
        context-parallel rank without a slice of a short last chunk): every block up to ``num_tokens`` (a block
        boundary) is an earlier one. ``grads=True``: the caller adds into each part's ``dk``/``dv`` before it takes
        the next part."""
        shape = self.shape
        layer = shape.source_of(layer)  # (an alias reads its source's pages and adds into their gradients)
        pages = shape.num_pages(num_tokens)
        chunk = shape.block_of(num_tokens - 1) if own else shape.block_of(num_tokens)
        if not self.streams(layer):
            if self._offload is not None:
                self._offload.visit(layer, chunk, grads)
            if self._tails is not None and layer in self._tails.layers:
                self._tails.before_read(layer)
            arena, table = self._regions[layer], self._layer_table(layer)
            yield PagedKV(arena.k, arena.v, arena.dk, arena.dv, table[:, :pages], (0, num_tokens))
            return
        arena = self._staging
        first = shape.block_of(first_key)
        for (lo, hi), table in self._offload.stream(layer, chunk, grads, first, blocks, own):
            keys = (shape.block_keys(lo, num_tokens)[0], shape.block_keys(hi - 1, num_tokens)[1])
            yield PagedKV(arena.k, arena.v, arena.dk, arena.dv, table[:, :pages], keys)

    def summaries(self, layer: int, num_pages: int) -> torch.Tensor:
        """The summaries ``[batch, num_pages, vectors, kv_heads, head_dim]`` of ``layer``'s first pages (a sparse
        step; :func:`~lightning_oomb.engine.sparse.summarize`; the layer's own KV heads)."""
        layer = self.shape.source_of(layer)
        heads, dim = self.shape.geometry(layer)
        return self._summaries[layer, :, :num_pages, :, :heads, :dim]

    def read_grad(self, layer: int, start: int, length: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Accumulated ``dk, dv [B, kv_heads, length, head_dim]`` of tokens ``[start, start + length)`` (one
        chunk). In the backward sweep this hands the chunk's gradient pages over: afterwards their content is
        undefined. ``None`` for an alias (:attr:`~lightning_oomb.engine.pages.PoolShape.aliases`): its adds are in
        its source's gradient pages, which the source's call hands over (its K/V are the source's)."""
        shape = self.shape
        if layer in shape.aliases:
            return None
        first, end = start // shape.page_size, shape.num_pages(start + length)
        if self.streams(layer):
            arena, table = self._staging, self._offload.grad_table(layer, shape.block_of(start))
        else:
            arena, table = self._regions[layer], self._layer_table(layer)
        slots = table[:, first:end]
        grads = tuple(gather_tokens(pages, slots)[:, :, :length] for pages in (arena.dk, arena.dv))
        if self.streams(layer) and self._sweep == "backward":
            self._offload.consumed(layer, shape.block_of(start))
        if self._tails is not None and layer in self._tails.layers and self._sweep == "backward":
            self._tails.consumed(layer, shape.block_of(start))
        return grads

    def read_kv(self, layer: int, start: int, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Stored ``k, v`` of tokens ``[start, start + length)`` (tests and debugging; waits for the copies). A window
        layer keeping its tails holds only those (hosted tails: the two in its ring) and the last chunk's pages."""
        shape = self.shape
        layer = shape.source_of(layer)
        first, end = start // shape.page_size, shape.num_pages(start + length)
        if self.streams(layer):
            self._synchronize()
            arena = self._host
            table = shape.page_tables(len(self.plan.host_layers), arena.device)
            table = table[self.plan.host_layers.index(layer)]
        else:
            arena, table = self._regions[layer], self._layer_table(layer)
        slots = table[:, first:end]
        return tuple(gather_tokens(pages, slots)[:, :, :length] for pages in (arena.k, arena.v))
