"""Paged KV + KV-gradient pool, in an HBM tier and (with offload) a pinned host tier.

**Pages.** One *page* holds ``page_size`` consecutive tokens of K (and V) for one layer and one batch row, laid out
``[kv_heads, page_size, head_dim]``. Gradient pages mirror the K/V pages (same slots) in ``grad_dtype``: float32 by
default, bfloat16 opt-in; never narrower than the K/V dtype (float64 models get float64 gradient pages, which the
exactness tests use).

**Arenas.** A tier keeps all its pages in one :class:`Arena`: one allocation viewed as K, V, dK, dV
``[slots, kv_heads, page_size, head_dim]`` (never one tensor per page). Within a tier, layer ``i`` owns slots
``[i * layer_slots, (i + 1) * layer_slots)`` laid out page-major: page ``j`` of row ``b`` is slot
``i * layer_slots + j * batch + b``, so the first ``n`` pages of a layer (all rows) are one contiguous range that a
single copy moves. A page table ``[batch, pages] -> slot`` (int32) addresses a layer's pages; kernels index pages
through it and know nothing about tiers.

**Tiers.** Without offload every layer lives in the HBM tier (the device the model runs on). With offload,
:func:`plan_tiers` fills ``hbm_budget`` with whole layers; the other layers live in the host tier (pinned when CUDA
is available) and are streamed in **blocks** of one chunk's pages through ``staging_buffers`` device buffers
(:mod:`lightning_oomb.engine.offload` decides what is copied when). The pool's device bytes are at most
``max(hbm_budget, staging_buffers * block_bytes)``: with every layer on the host they do not depend on the
sequence length. See :class:`PoolShape` for ``layer_bytes`` and ``block_bytes``.

**Access contract** (what the attention op does, once per layer and chunk; the order drives prefetch):
:meth:`KVPool.write` stores the chunk's post-RoPE K/V at its start (in the backward sweep the same call restages
the recomputed, identical K/V of a host layer on the device and changes nothing else); :meth:`KVPool.parts` then
hands out the pages of ``[0, num_tokens)`` as one :class:`PagedKV` (HBM layer) or one per block (host layer), each
with the key range it covers — with ``grads=True`` the caller adds into their gradient pages before taking the
next part; :meth:`KVPool.read_grad` returns a chunk's accumulated gradients and, in the backward sweep, frees the
chunk's gradient pages. A write zeroes the new pages' gradients. :meth:`KVPool.begin_sweep` /
:meth:`KVPool.end_sweep` bracket each sweep. The pool is sized per step from the sequence length and reused across
steps: arenas only grow.
"""

from __future__ import annotations

import math
import weakref
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from lightning_oomb.engine.errors import OOMBConfigError
from lightning_oomb.engine.offload import Offloader, Transfer

GRAD_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
AUTO_HEADROOM = 0.25  # hbm_budget="auto" leaves this fraction of the device for params, grads and activations
HOST_RESERVE_BYTES = 2 << 30  # host memory never pinned: left to the OS, the data loader and Python
_ALIGN = 512  # byte alignment of the four views inside an arena (DMA friendly, divisible by every itemsize)


@dataclass(frozen=True)
class PoolShape:
    """What the pool must hold for one step."""

    num_layers: int
    batch: int
    seq_len: int
    kv_heads: int
    head_dim: int
    page_size: int
    dtype: torch.dtype
    grad_dtype: torch.dtype
    # tokens per chunk = per offload block (a multiple of page_size); 0: the whole sequence
    chunk_size: int = 0

    @property
    def pages_per_row(self) -> int:
        return math.ceil(self.seq_len / self.page_size)

    @property
    def layer_slots(self) -> int:
        """Pages of one layer, all rows."""
        return self.batch * self.pages_per_row

    @property
    def num_slots(self) -> int:
        return self.num_layers * self.layer_slots

    @property
    def page_numel(self) -> int:
        return self.kv_heads * self.page_size * self.head_dim

    @property
    def kv_bytes(self) -> int:
        """Bytes of the K and V pages."""
        return 2 * self.num_slots * self.page_numel * self.dtype.itemsize

    @property
    def grad_bytes(self) -> int:
        """Bytes of the dK and dV gradient pages."""
        return 2 * self.num_slots * self.page_numel * self.grad_dtype.itemsize

    @property
    def layer_bytes(self) -> int:
        """Bytes of one layer's K, V, dK and dV pages (the unit of tier placement)."""
        return (self.kv_bytes + self.grad_bytes) // self.num_layers

    @property
    def block_pages(self) -> int:
        """Pages per row of one offload block (one chunk)."""
        return min(math.ceil((self.chunk_size or self.seq_len) / self.page_size), self.pages_per_row)

    @property
    def num_blocks(self) -> int:
        return math.ceil(self.pages_per_row / self.block_pages)

    @property
    def block_bytes(self) -> int:
        """Bytes of one staging buffer: one block's K, V, dK and dV pages, all rows."""
        return self.layer_bytes // self.pages_per_row * self.block_pages


@dataclass
class PagedKV:
    """What the attention op reads for one layer: arenas, the page table and how many tokens are valid.

    ``k``/``v``: ``[slots, kv_heads, page_size, head_dim]``; ``dk``/``dv``: the same in the gradient dtype;
    ``page_table``: int32 ``[batch, pages]`` (row ``b``'s page ``j`` lives in slot ``page_table[b, j]``);
    ``keys``: the key positions ``[lo, hi)`` this part holds (``None``: all of them) — the table's entries for
    pages outside are not valid.
    """

    k: torch.Tensor
    v: torch.Tensor
    dk: torch.Tensor
    dv: torch.Tensor
    page_table: torch.Tensor
    keys: tuple[int, int] | None = None

    @property
    def page_size(self) -> int:
        return self.k.shape[2]


def resolve_grad_dtype(name: str, kv_dtype: torch.dtype) -> torch.dtype:
    """The gradient-page dtype for option ``name``, never narrower than the K/V dtype."""
    if name not in GRAD_DTYPES:
        raise OOMBConfigError(
            f"kv_grad_dtype={name!r} is not supported — gradient pages are accumulated in place — "
            f"use one of {sorted(GRAD_DTYPES)}."
        )
    grad = GRAD_DTYPES[name]
    return kv_dtype if kv_dtype.itemsize > grad.itemsize else grad


# ------------------------------------------------------------------------------------------------------ tiers
@dataclass(frozen=True)
class TierPlan:
    """Which layers live where for one step; ``staging_buffers`` is 0 when no layer is on the host."""

    hbm_layers: tuple[int, ...]
    host_layers: tuple[int, ...]
    staging_buffers: int


def plan_tiers(
    num_layers: int, layer_bytes: int, budget: int | None, staging_buffers: int, block_bytes: int
) -> TierPlan:
    """Split layers between tiers so the pool's device bytes stay within ``budget`` (``None``: no limit).

    Device bytes = ``len(hbm_layers) * layer_bytes`` plus, once a layer is on the host, ``staging_buffers *
    block_bytes``; the most HBM layers that fit win. Host layers are spread evenly over depth (not the last ones),
    so each host layer's copies overlap the compute of the HBM layers before it. A budget below the staging
    buffers puts every layer on the host: they are the floor of offload's device memory.
    """
    everything = tuple(range(num_layers))
    if budget is None or num_layers * layer_bytes <= budget:
        return TierPlan(everything, (), 0)
    hbm = num_layers - 1
    while hbm > 0 and hbm * layer_bytes + staging_buffers * block_bytes > budget:
        hbm -= 1
    n_host = num_layers - hbm
    host = tuple(i for i in everything if (i + 1) * n_host // num_layers > i * n_host // num_layers)
    return TierPlan(tuple(i for i in everything if i not in host), host, staging_buffers)


def host_memory_available() -> int | None:
    """``MemAvailable`` of ``/proc/meminfo`` in bytes; ``None`` where it cannot be read (not Linux)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def _gib(n: int) -> str:
    return f"{n / 2**30:.2f} GiB"


# ----------------------------------------------------------------------------------------------------- arenas
class Arena:
    """One tier's pages: a single byte allocation viewed as ``k, v [slots, H, P, D]`` (K/V dtype) and
    ``dk, dv`` (gradient dtype).

    Device arenas start zeroed (a masked key of a ragged page is never NaN). The ``host`` arena lives in CPU
    memory, uninitialised (its pages are always written before they are read) and, when CUDA is available,
    page-locked with ``cudaHostRegister`` — not ``pin_memory=True``, whose caching allocator rounds sizes up to a
    power of two (a 70 GiB tier would lock 128 GiB).
    """

    def __init__(self, slots: int, shape: PoolShape, device: torch.device, host: bool = False):
        page = (shape.kv_heads, shape.page_size, shape.head_dim)
        kv, grad = (slots * shape.page_numel * t.itemsize for t in (shape.dtype, shape.grad_dtype))
        sizes = (kv, kv, grad, grad)
        offsets = [0]
        for size in sizes[:-1]:
            offsets.append(offsets[-1] + math.ceil(size / _ALIGN) * _ALIGN)
        total = offsets[-1] + sizes[-1]
        if host:
            storage = torch.empty(total, dtype=torch.uint8)
        else:
            storage = torch.zeros(total, dtype=torch.uint8, device=device)
        self._unpin = None
        if host and torch.cuda.is_available():
            _check_cuda(
                torch.cuda.cudart().cudaHostRegister(storage.data_ptr(), total, 0), "cudaHostRegister"
            )
            # unregister before the bytes go back to malloc, even if the arena is dropped without free()
            self._unpin = weakref.finalize(self, _unregister, storage.data_ptr())
            self._unpin.atexit = False
        dtypes = (shape.dtype, shape.dtype, shape.grad_dtype, shape.grad_dtype)
        self.k, self.v, self.dk, self.dv = (
            storage[o : o + n].view(t).view(slots, *page)
            for o, n, t in zip(offsets, sizes, dtypes, strict=True)
        )
        self.slots, self.nbytes, self.device = slots, total, storage.device
        self._storage = storage

    def fits(self, slots: int, shape: PoolShape, device: torch.device) -> bool:
        return (
            self.device == device
            and self.k.dtype == shape.dtype
            and self.dk.dtype == shape.grad_dtype
            and self.k.shape[1:] == (shape.kv_heads, shape.page_size, shape.head_dim)
            and self.slots >= slots
        )

    def free(self) -> None:
        """Unpin and drop the memory; the caller made sure no copy still uses it."""
        if self._unpin is not None:
            self._unpin()
        self.k = self.v = self.dk = self.dv = self._storage = None


def _check_cuda(code, what: str) -> None:
    if int(code) != 0:
        raise RuntimeError(f"{what} failed with cudaError {int(code)}")


def _unregister(ptr: int) -> None:
    torch.cuda.synchronize()  # no copy may still read or write pages that stop being page-locked
    _check_cuda(torch.cuda.cudart().cudaHostUnregister(ptr), "cudaHostUnregister")


def _page_tables(shape: PoolShape, count: int, device: torch.device, block_pages: int | None = None):
    """int32 ``[count, batch, pages_per_row]`` (page-major, see above): layer ``i`` of a tier -> its slots, or
    with ``block_pages`` staging buffer ``i`` -> its slots for whichever block it holds."""
    pages = torch.arange(shape.pages_per_row)
    per = shape.layer_slots
    if block_pages is not None:
        pages, per = pages % block_pages, block_pages * shape.batch
    grid = pages[None] * shape.batch + torch.arange(shape.batch)[:, None]
    base = torch.arange(count)[:, None, None] * per
    return (base + grid).to(device=device, dtype=torch.int32)


# ------------------------------------------------------------------------------------------------------- pool
class KVPool:
    """Paged K/V and dK/dV storage for one sequence batch (see the module docstring).

    Args:
        offload: keep layers beyond ``hbm_budget`` in the host tier.
        hbm_budget: device bytes for pages (int) or ``"auto"``: on CUDA the free device memory (cached blocks
            and the pool's own arenas included) minus ``AUTO_HEADROOM`` of the device; elsewhere no limit (the
            device is host memory already).
        staging_buffers: device buffers of one block (one chunk's pages of one layer) each, through which host
            layers stream; at least 2.
        layer_checkpointing: the backward sweep recomputes each layer right before its backward (prefetch order).
        prefetch_depth: predicted block uses staged ahead (``None``: as many as free buffers allow).
    """

    def __init__(
        self,
        offload: bool = False,
        hbm_budget: int | str = "auto",
        staging_buffers: int = 4,
        layer_checkpointing: bool = False,
        prefetch_depth: int | None = None,
    ) -> None:
        self.offload, self.hbm_budget, self.staging_buffers = offload, hbm_budget, staging_buffers
        self.layer_checkpointing, self.prefetch_depth = layer_checkpointing, prefetch_depth
        self.shape: PoolShape | None = None
        self.plan: TierPlan | None = None
        self._hbm: Arena | None = None
        self._host: Arena | None = None
        self._staging: Arena | None = None
        self._tables: torch.Tensor | None = None  # HBM layers' page tables [hbm layers, batch, pages]
        self._rank: dict[int, int] = {}  # layer -> its index in the HBM tier
        self._offload: Offloader | None = None
        self._sweep = "forward"

    # ----------------------------------------------------------------------------------------------- sizing
    def reserve(self, shape: PoolShape, device: torch.device) -> None:
        """Place layers in tiers for ``shape`` and make room; an arena is reallocated only when it must grow (or
        change dtype, page geometry or device). Raises :class:`OOMBConfigError` before allocating if the host tier
        would not fit in the available host memory."""
        self._synchronize()  # copies in flight may still use arenas that get replaced below
        plan = plan_tiers(
            shape.num_layers,
            shape.layer_bytes,
            self._budget(device),
            self.staging_buffers,
            shape.block_bytes,
        )
        host_device = torch.device("cpu")
        host_slots = len(plan.host_layers) * shape.layer_slots
        if host_slots and not (self._host and self._host.fits(host_slots, shape, host_device)):
            self._check_host_memory(shape, plan)
        self._hbm = self._grow(self._hbm, len(plan.hbm_layers) * shape.layer_slots, shape, device)
        staging_slots = plan.staging_buffers * shape.block_pages * shape.batch
        self._staging = self._grow(self._staging, staging_slots, shape, device)
        self._host = self._grow(self._host, host_slots, shape, host_device, host=True)
        self._rank = {layer: i for i, layer in enumerate(plan.hbm_layers)}
        self._tables = _page_tables(shape, len(plan.hbm_layers), device)
        self._offload = None
        if plan.host_layers:
            tables = _page_tables(shape, plan.staging_buffers, device, shape.block_pages)
            self._offload = Offloader(
                shape,
                plan.host_layers,
                self._host,
                self._staging,
                tables,
                self._sweep,
                self.layer_checkpointing,
                self.prefetch_depth,
            )
        self.shape, self.plan = shape, plan

    def _budget(self, device: torch.device) -> int | None:
        if not self.offload:
            return None
        if self.hbm_budget != "auto":
            return int(self.hbm_budget)
        if device.type != "cuda":
            return None
        free, total = torch.cuda.mem_get_info(device)
        cached = torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
        return max(0, free + cached + self.device_bytes - int(AUTO_HEADROOM * total))

    def _check_host_memory(self, shape: PoolShape, plan: TierPlan) -> None:
        available = host_memory_available()
        if available is None:
            return
        available += self._host.nbytes if self._host else 0  # freed before the new arena is allocated
        usable = available - HOST_RESERVE_BYTES
        needed = len(plan.host_layers) * shape.layer_bytes
        if needed <= usable:
            return
        ways = []
        kv_size, grad_size = shape.dtype.itemsize, shape.grad_dtype.itemsize
        if grad_size > max(2, kv_size):  # bfloat16 gradient pages are allowed (never narrower than K/V)
            smaller = needed * (kv_size + 2) // (kv_size + grad_size)
            ways.append(f"kv_grad_dtype='bfloat16' (needs {_gib(smaller)})")
        ways += [
            "a shorter context or a smaller batch",
            "a larger hbm_budget (more layers stay on the device)",
            "sparse attention once available",
        ]
        raise OOMBConfigError(
            f"offload needs {_gib(needed)} of host memory for the K/V and gradient pages of "
            f"{len(plan.host_layers)} host-tier layers ({shape.batch} x {shape.seq_len} tokens) but only "
            f"{_gib(max(usable, 0))} is available (MemAvailable minus {_gib(HOST_RESERVE_BYTES)} kept for the "
            f"system) — pinned pages cannot be swapped out — use {', or '.join(ways)}."
        )

    @staticmethod
    def _grow(arena: Arena | None, slots: int, shape: PoolShape, device, host: bool = False) -> Arena | None:
        if slots == 0 or (arena is not None and arena.fits(slots, shape, device)):
            return arena  # an arena this step does not need is kept: arenas only grow
        if arena is not None:
            arena.free()
        return Arena(slots, shape, device, host)

    def _synchronize(self) -> None:
        if self._offload is not None:
            self._offload.synchronize()

    def release(self) -> None:
        """Free every arena, pinned host memory included (after an exception, or on teardown); the next
        :meth:`reserve` starts afresh."""
        self._synchronize()
        for arena in (self._hbm, self._staging, self._host):
            if arena is not None:
                arena.free()
        self._hbm = self._host = self._staging = self._tables = self._offload = None
        self.shape = self.plan = None

    @property
    def device_bytes(self) -> int:
        """Bytes of the pool's device arenas (HBM tier + staging buffers)."""
        return sum(a.nbytes for a in (self._hbm, self._staging) if a is not None)

    @property
    def host_bytes(self) -> int:
        """Bytes of the host-tier arena."""
        return self._host.nbytes if self._host is not None else 0

    @property
    def allocated_bytes(self) -> int:
        """Bytes held by all arenas, including slack from earlier, longer steps."""
        return self.device_bytes + self.host_bytes

    def streams(self, layer: int) -> bool:
        """``layer`` lives in the host tier: it is streamed in blocks, and in the backward sweep
        :meth:`write` needs the chunk's K/V again."""
        return self._offload is not None and layer not in self._rank

    # ------------------------------------------------------------------------------------------------ sweeps
    def begin_sweep(self, kind: str) -> None:
        """Start a ``"forward"``/``"eval"`` sweep (a new step: every page is rewritten, gradients zero) or the
        ``"backward"`` sweep (pages are read, gradient pages accumulated)."""
        self._sweep = kind
        if self._offload is not None:
            self._offload.begin_sweep(kind)

    def end_sweep(self) -> None:
        """Finish the sweep's bookkeeping (copy-wait timings; on CUDA this waits for the compute stream)."""
        if self._offload is not None:
            self._offload.end_sweep()

    def stats(self) -> dict:
        """Placement, arena bytes and this step's traffic: ``h2d_bytes``/``d2h_bytes`` (bytes copied host to
        device / device to host), ``copy_wait_s`` (seconds the compute stream waited for copies; 0 on CPU),
        ``prefetch_copies``/``demand_copies`` (host-to-device copies issued ahead of use / when needed)."""
        plan = self.plan
        out = {
            "offload": self.offload,
            "hbm_layers": len(plan.hbm_layers) if plan else 0,
            "host_layers": len(plan.host_layers) if plan else 0,
            "hbm_pool_bytes": self._hbm.nbytes if self._hbm else 0,
            "staging_bytes": self._staging.nbytes if self._staging else 0,
            "host_pool_bytes": self.host_bytes,
            "h2d_bytes": 0,
            "d2h_bytes": 0,
            "copy_wait_s": 0.0,
            "prefetch_copies": 0,
            "demand_copies": 0,
        }
        if self._offload is not None:
            out.update(self._offload.stats())
        return out

    @property
    def transfers(self) -> list[Transfer]:
        """This step's copies between the host tier and the staging buffers, in issue order (empty without host
        layers): the prefetch / write-back schedule, for monitoring and tests."""
        return self._offload.trace if self._offload is not None else []

    # ------------------------------------------------------------------------------------------------ access
    def _num_pages(self, num_tokens: int) -> int:
        return math.ceil(num_tokens / self.shape.page_size)

    def _block(self, token: int) -> int:
        """The offload block holding ``token``."""
        return token // (self.shape.block_pages * self.shape.page_size)

    def _token_view(self, arena: torch.Tensor, slots: torch.Tensor, length: int) -> torch.Tensor:
        """Gather pages ``slots [B, n]`` into ``[B, kv_heads, length, head_dim]`` (a copy)."""
        b, n = slots.shape
        pages = arena[slots.flatten().long()].view(b, n, *arena.shape[1:])
        tokens = pages.transpose(1, 2).reshape(b, arena.shape[1], n * self.shape.page_size, arena.shape[3])
        return tokens[:, :, :length]

    def write(self, layer: int, start: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store a chunk's post-RoPE ``k, v [B, kv_heads, L, head_dim]`` at token ``start`` (page aligned); the
        layer's content becomes tokens ``[0, start + L)`` with zero gradients for the new pages. In the backward
        sweep ``k, v`` are the recompute's identical copy: only a host layer needs them (on the device again)."""
        page = self.shape.page_size
        assert start % page == 0, "chunks start on page boundaries"
        backward = self._sweep == "backward"
        if not self.streams(layer):
            if not backward:
                self._store(self._hbm, self._tables[self._rank[layer]], start, k, v, zero_grads=True)
            return
        block = self._block(start)
        if backward and self._offload.holds_kv(layer, block):
            return
        table = self._offload.begin_write(layer, block)
        self._store(self._staging, table, start, k, v, zero_grads=False)  # host gradients start at zero
        self._offload.end_write(layer, block, persist=not backward)

    def _store(self, arena: Arena, table: torch.Tensor, start: int, k, v, zero_grads: bool) -> None:
        page, length = self.shape.page_size, k.shape[2]
        first, end = start // page, self._num_pages(start + length)
        slots = table[:, first:end].flatten().long()
        b, h, _, d = k.shape
        padded = (end - first) * page
        for dst, x in ((arena.k, k), (arena.v, v)):
            if padded != length:
                x = torch.nn.functional.pad(x, (0, 0, 0, padded - length))
            dst.index_copy_(
                0, slots, x.reshape(b, h, -1, page, d).transpose(1, 2).reshape(-1, h, page, d).to(dst.dtype)
            )
        if zero_grads:
            arena.dk.index_fill_(0, slots, 0)
            arena.dv.index_fill_(0, slots, 0)

    def parts(
        self, layer: int, num_tokens: int, grads: bool = False, first_key: int = 0
    ) -> Iterator[PagedKV]:
        """The pages of ``layer`` holding tokens ``[0, num_tokens)`` (the chunk ending there and everything
        before), for the attention op: one :class:`PagedKV` for an HBM layer, one per block for a host layer
        (the chunk's own block first; blocks wholly before ``first_key`` — outside a sliding window — are
        skipped). ``grads=True``: the caller adds into each part's ``dk``/``dv`` before it takes the next part."""
        pages = self._num_pages(num_tokens)
        chunk = self._block(num_tokens - 1)
        if not self.streams(layer):
            if self._offload is not None:
                self._offload.visit(layer, chunk, grads)
            arena, table = self._hbm, self._tables[self._rank[layer]]
            yield PagedKV(arena.k, arena.v, arena.dk, arena.dv, table[:, :pages], (0, num_tokens))
            return
        arena, block_tokens = self._staging, self.shape.block_pages * self.shape.page_size
        for block, table in self._offload.stream(layer, chunk, grads, self._block(first_key)):
            lo = block * block_tokens
            keys = (lo, min(lo + block_tokens, num_tokens))
            yield PagedKV(arena.k, arena.v, arena.dk, arena.dv, table[:, :pages], keys)

    def read_grad(self, layer: int, start: int, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Accumulated ``dk, dv [B, kv_heads, length, head_dim]`` of tokens ``[start, start + length)`` (one
        chunk). In the backward sweep this hands the chunk's gradient pages over: afterwards their content is
        undefined."""
        first, end = start // self.shape.page_size, self._num_pages(start + length)
        if self.streams(layer):
            arena, table = self._staging, self._offload.grad_table(layer, self._block(start))
        else:
            arena, table = self._hbm, self._tables[self._rank[layer]]
        slots = table[:, first:end]
        grads = self._token_view(arena.dk, slots, length), self._token_view(arena.dv, slots, length)
        if self.streams(layer) and self._sweep == "backward":
            self._offload.consumed(layer, self._block(start))
        return grads

    def read_kv(self, layer: int, start: int, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Stored ``k, v`` of tokens ``[start, start + length)`` (tests and debugging; waits for the copies)."""
        first, end = start // self.shape.page_size, self._num_pages(start + length)
        if self.streams(layer):
            self._synchronize()
            arena = self._host
            table = _page_tables(self.shape, len(self.plan.host_layers), arena.device)
            table = table[self.plan.host_layers.index(layer)]
        else:
            arena, table = self._hbm, self._tables[self._rank[layer]]
        slots = table[:, first:end]
        return self._token_view(arena.k, slots, length), self._token_view(arena.v, slots, length)
