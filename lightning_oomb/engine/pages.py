"""Pages: the pool's shape, its arenas, the slot arithmetic and token views of pages (a leaf module).

**Pages.** One *page* holds ``page_size`` consecutive tokens of K (and V) for one layer and one batch row, laid out
``[kv_heads, page_size, head_dim]``. Gradient pages mirror the K/V pages (same slots) in the gradient dtype:
float32 by default, bfloat16 opt-in; never narrower than the K/V dtype (float64 models get float64 gradient pages,
which the exactness tests use).

**Arenas.** A tier keeps all its pages in one :class:`Arena`: one allocation viewed as K, V, dK, dV
``[slots, kv_heads, page_size, head_dim]`` (never one tensor per page). In the host tier, layer rank ``i`` owns slots
``[i * layer_slots, (i + 1) * layer_slots)`` laid out page-major: page ``j`` of row ``b`` is slot
``i * layer_slots + j * batch + b``, so the pages of a block (one chunk, all rows) are one contiguous slot range that
a single copy moves. In the HBM tier layers follow each other the same way, each with its own slot count.

**Window layers keep only their tails.** A sliding-window layer (window ``W`` at most a chunk) never needs a key
more than ``W - 1`` tokens before a chunk's start: the pages holding the last ``W - 1`` keys before each later
chunk's start are the layer's *tails*, kept for the whole step (the next chunk's backward reads them and adds into
their gradients); every other page of a chunk lives in a *transient* region of one chunk's pages, reused by every
chunk (the backward sweep restages a chunk's own K/V there and zeroes their gradients). Qwen2.5-style models have no
window layers; GPT-OSS (window 128, chunk 4096) keeps 1 page in 32 of its window layers. Where the device budget is
short, tails wait in host memory and the device keeps a ring of two tail groups (:attr:`PoolShape.hosted_tails`,
:mod:`lightning_oomb.engine.offload.tails`). A layer that reads another's K/V (:attr:`PoolShape.layer_sources`)
has no pages: its page table is its source's. Staging buffer ``i`` (offload) owns ``[i * block_slots, (i + 1) * block_slots)`` laid out the
same way for whichever block it holds. A page table ``int32 [batch, pages] -> slot`` addresses one layer's pages;
kernels index pages through it and know nothing about tiers.

Everything here is arithmetic on :class:`PoolShape` plus plain tensor views; the pool
(:mod:`lightning_oomb.engine.kv_pool`), the offload schedule (:mod:`lightning_oomb.engine.offload`) and the torch
reference of the kernels (:mod:`lightning_oomb.engine.reference`) all import it, and it imports none of them.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import weakref
from dataclasses import dataclass
from typing import Literal

import torch

from lightning_oomb.engine.errors import OOMBConfigError

GRAD_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
PAGE_SCORES = {"bound": 2, "mean": 1}  # sparse attention's page score -> summary vectors per page and KV head
_ALIGN = 512  # byte alignment of the four views inside an arena (DMA friendly, divisible by every itemsize)

Part = Literal["kv", "grad"]  # the K and V pages, or the dK and dV pages


def resolve_grad_dtype(name: str, kv_dtype: torch.dtype) -> torch.dtype:
    """The gradient-page dtype for option ``name`` (``"auto"`` not yet decided: float32), never narrower than the
    K/V dtype."""
    name = "float32" if name == "auto" else name
    if name not in GRAD_DTYPES:
        raise OOMBConfigError(
            f"kv_grad_dtype={name!r} is not supported — gradient pages are accumulated in place — "
            f"use one of {sorted(GRAD_DTYPES)}."
        )
    grad = GRAD_DTYPES[name]
    return kv_dtype if kv_dtype.itemsize > grad.itemsize else grad


@dataclass(frozen=True)
class PoolShape:
    """What the pool must hold for one step.

    ``chunk_size``: tokens per chunk = per offload block (a multiple of ``page_size``; 0: the whole sequence).
    ``dtype``: the K/V dtype, which the first chunk written decides (:meth:`for_dtype`); ``None`` until then.
    ``kv_grad_dtype``: the gradient-page option; :attr:`grad_dtype` is what it resolves to for ``dtype``.
    ``windows``: each layer's sliding window as the model declares it (``None``: unknown, every layer full).
    ``page_score``: the step attends sparsely, so every page also keeps its summary for this page score on the
    device (:mod:`lightning_oomb.engine.sparse`); ``None``: dense. ``model_head_dim``: the head dim of the model's
    attention calls where the pages are wider (zero-padded for the kernels,
    :func:`~lightning_oomb.engine.attention.stored_head_dim`); ``None``: ``head_dim``.

    ``layer_kv_heads``, ``layer_head_dims`` and ``layer_call_dims``: each layer's KV heads, its pages' head dim and its
    calls' where layers differ (Gemma 4: its sliding layers' heads narrower than its global layers', and in its 31B
    and 26B-A4B more of them); ``None``: ``kv_heads``, ``head_dim`` and :attr:`call_head_dim` for every layer. Those
    are then the geometry of the pool's slots — the host tier's and the staging buffers' pages: build the shape with
    :meth:`for_layers` — and a layer of another geometry is :attr:`device_only`: its pages live in the HBM tier at
    its own geometry (:meth:`hbm_slots_of`).

    ``host_tails``: the window layers' tails wait in host memory between the sweeps (:attr:`hosted_tails`): ``True``
    every window layer's, or those of the layers listed (set by :func:`~lightning_oomb.engine.kv_pool.place_layers`
    when the device budget is short).

    ``layer_sources``: per layer, the earlier layer whose K/V its call passes (Gemma 4's KV-sharing layers,
    ``num_kv_shared_layers``): it reads that layer's pages, adds into their gradients and stores none of its own
    (:meth:`source_of`); ``None``: every layer its own.

    ``values_are_keys``: every call passes its keys as its values (latent attention over its latents,
    ``mla_pages="latent"``): one page holds both and one gradient page both gradients, summed (:attr:`parts`: the
    page tensors a page has, 1 instead of 2 — an :class:`Arena`'s ``v`` and ``dv`` are its ``k`` and ``dk``).
    """

    num_layers: int
    batch: int
    seq_len: int
    kv_heads: int
    head_dim: int
    page_size: int
    chunk_size: int = 0
    kv_grad_dtype: str = "float32"
    dtype: torch.dtype | None = None
    windows: tuple[int | None, ...] | None = None  # per layer: its sliding window (None: full attention)
    page_score: str | None = None
    model_head_dim: int | None = None
    layer_kv_heads: tuple[int, ...] | None = None
    layer_head_dims: tuple[int, ...] | None = None
    layer_call_dims: tuple[int, ...] | None = None
    host_tails: bool | tuple[int, ...] = False
    layer_sources: tuple[int | None, ...] | None = None
    values_are_keys: bool = False

    @classmethod
    def for_layers(
        cls,
        batch: int,
        seq_len: int,
        heads: tuple[int, ...],
        head_dims: tuple[int, ...],
        call_dims: tuple[int, ...],
        page_size: int,
        windows: tuple[int | None, ...] | None = None,
        **options,
    ) -> PoolShape:
        """The shape of layers of their own KV ``heads``, pages' ``head_dims`` and calls' ``call_dims``: its slots
        take the geometry most layers without a window have (they hold the most pages, and may go to host memory),
        the larger on a tie; among all layers if every one has a window."""
        layers = range(len(heads))
        stored = [
            i for i in layers if options.get("layer_sources") is None or options["layer_sources"][i] is None
        ]
        full = [i for i in stored if windows is None or windows[i] is None] or stored or list(layers)
        geometries = [(heads[i], head_dims[i], call_dims[i]) for i in full]
        # (no layer — a model without attention, pure Mamba2 — has no pages: any geometry)
        slot = max(set(geometries), key=lambda g: (geometries.count(g), g[0] * g[1]), default=(1, 16, 16))
        uniform = len({(heads[i], head_dims[i], call_dims[i]) for i in layers}) <= 1
        return cls(
            len(heads), batch, seq_len, slot[0], slot[1], page_size, windows=windows, model_head_dim=slot[2],
            layer_kv_heads=None if uniform else tuple(heads), layer_head_dims=None if uniform else tuple(head_dims),
            layer_call_dims=None if uniform else tuple(call_dims), **options,
        )  # fmt: skip

    @property
    def parts(self) -> int:
        """Page tensors per page and tier part: K and V (dK and dV), or one where :attr:`values_are_keys`."""
        return 1 if self.values_are_keys else 2

    @property
    def call_head_dim(self) -> int:
        """The head dim of the model's ``q, k, v``."""
        return self.head_dim if self.model_head_dim is None else self.model_head_dim

    def for_dtype(self, dtype: torch.dtype) -> PoolShape:
        """This shape with K/V in ``dtype``."""
        return self if dtype == self.dtype else dataclasses.replace(self, dtype=dtype)

    @property
    def grad_dtype(self) -> torch.dtype:
        return resolve_grad_dtype(self.kv_grad_dtype, self.dtype)

    # ------------------------------------------------------------------------------------------ counts
    @functools.cached_property
    def pages_per_row(self) -> int:
        return math.ceil(self.seq_len / self.page_size)

    @property
    def layer_slots(self) -> int:
        """Pages of one full layer, all rows."""
        return self.batch * self.pages_per_row

    @functools.cached_property
    def tails(self) -> tuple[tuple[int, ...] | None, ...]:
        """Per layer, the pages (per row) a window layer keeps for the whole step — those holding keys within
        ``window - 1`` before a later chunk's start — or ``None`` for a layer that keeps every page (full attention,
        no window declared, or no saving)."""
        return tuple(self._tails(layer) for layer in range(self.num_layers))

    def _tails(self, layer: int) -> tuple[int, ...] | None:
        window = self.windows[layer] if self.windows is not None else None
        # (a layer other layers read keeps every page: its readers' backward runs before its own, which would
        # restage a recycled chunk's K/V and zero the gradients they added)
        if window is None or not self.chunk_size or layer in self.aliases or layer in self._sources:
            return None
        keep: set[int] = set()
        for boundary in range(self.chunk_size, self.seq_len, self.chunk_size):
            keep.update(
                range(max(0, boundary - window + 1) // self.page_size, (boundary - 1) // self.page_size + 1)
            )
        if len(keep) + self.block_pages >= self.pages_per_row:
            return None
        return tuple(sorted(keep))

    @property
    def recycling(self) -> tuple[int, ...]:
        """The window layers that keep only their tails (and one chunk's transient pages)."""
        return tuple(layer for layer, tails in enumerate(self.tails) if tails is not None)

    def tail_group(self, layer: int) -> int:
        """Pages (per row) of one chunk's tail group in a recycling layer: those holding the ``window - 1`` keys
        before the next chunk's start — the last pages of every chunk but the last (a window at most a chunk long:
        groups of one size, each read by the next chunk only)."""
        return math.ceil((self.windows[layer] - 1) / self.page_size)

    @functools.cached_property
    def hosted_tails(self) -> tuple[int, ...]:
        """With :attr:`host_tails`, the recycling layers whose tails wait in host memory: the device holds two
        tail groups of such a layer — the one its chunk reads and the one it writes (the backward sweep: the one it
        adds into, and its chunk's own) — in a ring (:meth:`layer_table`), the host all of them
        (:mod:`lightning_oomb.engine.offload.tails`); layers with at most two groups keep theirs on the device."""
        if not self.host_tails:
            return ()
        chosen = self.recycling if self.host_tails is True else self.host_tails
        return tuple(
            layer
            for layer in self.recycling
            if layer in chosen and len(self.tails[layer]) > 2 * self.tail_group(layer)
        )

    def device_tail_pages(self, layer: int) -> int:
        """Tail pages per row a recycling layer keeps on the device: all its tails, or a ring of two groups."""
        return 2 * self.tail_group(layer) if layer in self.hosted_tails else len(self.tails[layer])

    @functools.cached_property
    def tail_host_bytes(self) -> int:
        """Bytes of the K and V of the :attr:`hosted_tails` in host memory (no gradient: a group's gradients are
        made and handed over while its chunk and the next are back-propagated)."""
        return (
            sum(
                self.parts
                * self.batch
                * len(self.tails[layer])
                * self.page_size
                * math.prod(self.geometry(layer))
                for layer in self.hosted_tails
            )
            * self.dtype.itemsize
        )

    def source_of(self, layer: int) -> int:
        """The layer whose pages ``layer`` reads: its :attr:`layer_sources` entry, or itself."""
        source = None if self.layer_sources is None else self.layer_sources[layer]
        return layer if source is None else source

    @functools.cached_property
    def aliases(self) -> tuple[int, ...]:
        """The layers that read another layer's pages (:attr:`layer_sources`): they hold none."""
        return tuple(layer for layer in range(self.num_layers) if self.source_of(layer) != layer)

    @functools.cached_property
    def _sources(self) -> frozenset[int]:
        return frozenset(self.source_of(layer) for layer in self.aliases)

    def heads_of(self, layer: int) -> int:
        """The layer's KV heads."""
        return self.kv_heads if self.layer_kv_heads is None else self.layer_kv_heads[layer]

    def head_dim_of(self, layer: int) -> int:
        """The head dim of the layer's pages."""
        return self.head_dim if self.layer_head_dims is None else self.layer_head_dims[layer]

    def call_head_dim_of(self, layer: int) -> int:
        """The head dim of the layer's ``q, k, v``."""
        return self.call_head_dim if self.layer_call_dims is None else self.layer_call_dims[layer]

    def geometry(self, layer: int) -> tuple[int, int]:
        """The layer's pages' ``(KV heads, head dim)``."""
        return self.heads_of(layer), self.head_dim_of(layer)

    @functools.cached_property
    def device_only(self) -> tuple[int, ...]:
        """Layers whose pages always stay in the HBM tier: the recycling window layers (small), the layers of
        another geometry than the slots' (``kv_heads``, ``head_dim``), and the :attr:`aliases` (no pages) with the
        layers they read (their pages are read twice a chunk: a host layer's stream would be too)."""
        slot = (self.kv_heads, self.head_dim)
        return tuple(
            layer
            for layer in range(self.num_layers)
            if self.tails[layer] is not None
            or self.geometry(layer) != slot
            or layer in self.aliases
            or layer in self._sources
        )

    def hbm_slots_of(self, layer: int) -> int:
        """Slots (of :attr:`page_numel` elements) the layer's pages take in the HBM tier, all rows: its pages at its
        own geometry, rounded up to whole slots."""
        heads, dim = self.geometry(layer)
        return math.ceil(self.batch * self.layer_pages(layer) * heads * dim / (self.kv_heads * self.head_dim))

    def layer_pages(self, layer: int) -> int:
        """Pages per row the layer stores: every page, or its tails plus one chunk's transient pages (an alias:
        none)."""
        if layer in self.aliases:
            return 0
        tails = self.tails[layer]
        return self.pages_per_row if tails is None else self.device_tail_pages(layer) + self.block_pages

    @property
    def num_slots(self) -> int:
        return sum(self.hbm_slots_of(layer) for layer in range(self.num_layers))

    @property
    def page_numel(self) -> int:
        return self.kv_heads * self.page_size * self.head_dim

    def num_pages(self, num_tokens: int) -> int:
        """Pages per row holding ``num_tokens`` tokens."""
        return math.ceil(num_tokens / self.page_size)

    # ------------------------------------------------------------------------------------------- bytes
    def page_bytes(self, part: Part) -> int:
        """Bytes of one page's K and V (``"kv"``) or dK and dV (``"grad"``), all rows of a page index."""
        dtype = self.dtype if part == "kv" else self.grad_dtype
        return self.parts * self.batch * self.page_numel * dtype.itemsize

    @property
    def kv_bytes(self) -> int:
        """Bytes of the K and V pages."""
        return self.parts * self.num_slots * self.page_numel * self.dtype.itemsize

    @property
    def grad_bytes(self) -> int:
        """Bytes of the dK and dV gradient pages."""
        return self.parts * self.num_slots * self.page_numel * self.grad_dtype.itemsize

    @property
    def summary_bytes(self) -> int:
        """Bytes of the page summaries (key-sized vectors per page and KV head, every layer; 0 when dense)."""
        if self.page_score is None:
            return 0
        return math.prod(self.summary_shape) * self.dtype.itemsize

    @property
    def summary_shape(self) -> tuple[int, ...]:
        """``[layers, batch, pages, vectors, kv_heads, head_dim]`` of the page summaries (a sparse step)."""
        vectors = PAGE_SCORES[self.page_score]
        heads = self.kv_heads if self.layer_kv_heads is None else max(self.layer_kv_heads)
        return (self.num_layers, self.batch, self.pages_per_row, vectors, heads, self.widest_head_dim)

    @property
    def widest_head_dim(self) -> int:
        """The widest layer's pages' head dim (what the op's results are as wide as, at most)."""
        return self.head_dim if self.layer_head_dims is None else max(self.layer_head_dims)

    @property
    def layer_bytes(self) -> int:
        """Bytes of one full layer's K, V, dK and dV pages (the unit of tier placement)."""
        return (
            self.parts * self.layer_slots * self.page_numel * (self.dtype.itemsize + self.grad_dtype.itemsize)
        )

    def bytes_of(self, layer: int) -> int:
        """Bytes of the layer's K, V, dK and dV pages (a window layer's tails and transient pages) in the HBM tier."""
        return (
            self.parts
            * self.hbm_slots_of(layer)
            * self.page_numel
            * (self.dtype.itemsize + self.grad_dtype.itemsize)
        )

    # ------------------------------------------------------------------------------------------ blocks
    @functools.cached_property  # (read per staged page run: a sparse step's offload asks thousands of times)
    def block_pages(self) -> int:
        """Pages per row of one offload block (one chunk)."""
        return min(math.ceil((self.chunk_size or self.seq_len) / self.page_size), self.pages_per_row)

    @property
    def block_tokens(self) -> int:
        return self.block_pages * self.page_size

    @property
    def block_slots(self) -> int:
        """Slots of one block, all rows: the size of one staging buffer in pages."""
        return self.block_pages * self.batch

    @property
    def num_blocks(self) -> int:
        return math.ceil(self.pages_per_row / self.block_pages)

    @property
    def block_bytes(self) -> int:
        """Bytes of one staging buffer: one block's K, V, dK and dV pages, all rows."""
        return self.layer_bytes // self.pages_per_row * self.block_pages

    def block_of(self, token: int) -> int:
        """The offload block holding ``token``."""
        return token // self.block_tokens

    def block_pages_range(self, block: int) -> tuple[int, int]:
        """Pages ``[first, end)`` (per row) of block ``block``."""
        first = block * self.block_pages
        return first, min(first + self.block_pages, self.pages_per_row)

    def block_keys(self, block: int, num_tokens: int) -> tuple[int, int]:
        """Key positions ``[lo, hi)`` of block ``block`` among the first ``num_tokens`` tokens."""
        lo = block * self.block_tokens
        return lo, min(lo + self.block_tokens, num_tokens)

    # ------------------------------------------------------------------------------------------- slots
    def layer_block_slots(self, rank: int, block: int) -> slice:
        """Slots of ``block``'s pages (all rows) of the layer with tier rank ``rank``."""
        first, end = self.block_pages_range(block)
        offset = rank * self.layer_slots
        return slice(offset + first * self.batch, offset + end * self.batch)

    def buffer_block_slots(self, buffer: int, block: int) -> slice:
        """Slots of ``block``'s pages (all rows) in staging buffer ``buffer``."""
        first, end = self.block_pages_range(block)
        offset = buffer * self.block_slots
        return slice(offset, offset + (end - first) * self.batch)

    def layer_table(self, layer: int, device: torch.device) -> torch.Tensor:
        """int32 ``[batch, pages_per_row]``: page ``j`` of row ``b`` of an HBM layer, in its own pages
        (:meth:`Arena.region`), page-major: a full layer's page ``j`` at ``j * batch + b``; a window layer's ``i``-th
        tail page at ``i * batch + b`` (hosted tails: group ``g``'s ``i``-th page at ``(g % 2) * group + i``, a ring
        of two) and its other pages in the transient region after the tails, ``p % block_pages``)."""
        pages = torch.arange(self.pages_per_row)
        tails = self.tails[layer]
        if tails is not None:
            tail = torch.full((self.pages_per_row,), -1, dtype=torch.long)
            tail[list(tails)] = torch.arange(len(tails))
            if layer in self.hosted_tails:
                group = self.tail_group(layer)
                tail = torch.where(tail >= 0, tail // group % 2 * group + tail % group, tail)
            pages = torch.where(tail >= 0, tail, self.device_tail_pages(layer) + pages % self.block_pages)
        return (pages[None] * self.batch + torch.arange(self.batch)[:, None]).to(device, torch.int32)

    def transient_slots(self, layer: int) -> slice:
        """The pages of a window layer's transient region (one chunk's pages, all rows, after its tails) in
        :meth:`layer_table`'s layout."""
        first = self.device_tail_pages(layer) * self.batch
        return slice(first, first + self.block_slots)

    def ring_slots(self, layer: int, group: int) -> slice:
        """The device pages of a hosted-tails layer's tail group ``group`` (all rows) in :meth:`layer_table`'s
        layout; :meth:`host_tail_slots`: the same group in the layer's host pages."""
        size = self.tail_group(layer) * self.batch
        return slice(group % 2 * size, (group % 2 + 1) * size)

    def host_tail_slots(self, layer: int, group: int) -> slice:
        size = self.tail_group(layer) * self.batch
        return slice(group * size, (group + 1) * size)

    def page_tables(self, count: int, device: torch.device, blocks: bool = False) -> torch.Tensor:
        """int32 ``[count, batch, pages_per_row]``: layer rank ``i`` of a tier -> its slots, or with ``blocks``
        staging buffer ``i`` -> its slots for whichever block it holds."""
        pages = torch.arange(self.pages_per_row)
        per = self.layer_slots
        if blocks:
            pages, per = pages % self.block_pages, self.block_slots
        grid = pages[None] * self.batch + torch.arange(self.batch)[:, None]
        base = torch.arange(count)[:, None, None] * per
        return (base + grid).to(device=device, dtype=torch.int32)


@dataclass
class PagedKV:
    """What the attention op reads for one layer: arenas, the page table and the keys it covers.

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


# ------------------------------------------------------------------------------------------------ arenas
@dataclass
class Region:
    """One layer's pages in an arena (:meth:`Arena.region`): ``k, v, dk, dv [pages, heads, P, D]``."""

    k: torch.Tensor
    v: torch.Tensor
    dk: torch.Tensor
    dv: torch.Tensor


class Arena:
    """One tier's pages: a single byte allocation viewed as ``k, v [slots, H, P, D]`` (K/V dtype) and
    ``dk, dv`` (gradient dtype).

    Device arenas start zeroed (a masked key of a ragged page is never NaN). The ``host`` arena lives in CPU
    memory, uninitialised (its pages are always written before they are read) and, when CUDA is available,
    page-locked with ``cudaHostRegister`` — not ``pin_memory=True``, whose caching allocator rounds sizes up to a
    power of two (a 70 GiB tier would lock 128 GiB); ``mapped``: also mapped into the devices' address space, for
    kernels that copy pages to and from it (``OOMB_OFFLOAD_GATHER``; ``self.mapped``: whether it is).
    """

    def __init__(
        self, slots: int, shape: PoolShape, device: torch.device, host: bool = False, mapped: bool = False
    ):
        page = (shape.kv_heads, shape.page_size, shape.head_dim)
        sizes = _arena_sizes(slots, shape)
        offsets = [0]
        for size in sizes[:-1]:
            offsets.append(offsets[-1] + math.ceil(size / _ALIGN) * _ALIGN)
        total = offsets[-1] + sizes[-1]
        self._unpin = None
        if host:
            storage, self._unpin = page_locked_bytes(total, self, device, mapped)
        else:
            storage = torch.zeros(total, dtype=torch.uint8, device=device)
        dtypes = (shape.dtype,) * shape.parts + (shape.grad_dtype,) * shape.parts
        views = [
            storage[o : o + n].view(t).view(slots, *page)
            for o, n, t in zip(offsets, sizes, dtypes, strict=True)
        ]
        if shape.values_are_keys:  # v is k, dv is dk
            views = [views[0], views[0], views[1], views[1]]
        self.k, self.v, self.dk, self.dv = views
        self.slots, self.nbytes, self.device = slots, total, storage.device
        self.storage, self.mapped = storage, self._unpin is not None and mapped

    def pages(self, part: Part) -> tuple[torch.Tensor, ...]:
        """``(k, v)`` for ``"kv"``, ``(dk, dv)`` for ``"grad"`` — ``(k,)``, ``(dk,)`` where values are keys: the
        tensors a copy of the part moves."""
        pages = (self.k, self.v) if part == "kv" else (self.dk, self.dv)
        return pages[:1] if self.v is self.k else pages

    def region(self, first: int, slots: int, heads: int, head_dim: int) -> Region:
        """Slots ``[first, first + slots)`` viewed as pages of ``heads`` KV heads of ``head_dim`` (one layer's:
        ``slots * H * D / (heads * head_dim)`` pages, whole, numbered from 0)."""
        p = self.k.shape[2]
        numel = heads * p * head_dim

        def view(pages: torch.Tensor) -> torch.Tensor:
            flat = pages[first : first + slots].view(-1)
            return flat[: flat.numel() // numel * numel].view(-1, heads, p, head_dim)

        return Region(view(self.k), view(self.v), view(self.dk), view(self.dv))

    def fits(self, slots: int, shape: PoolShape, device: torch.device) -> bool:
        return (
            self.device == device
            and self.k.dtype == shape.dtype
            and self.dk.dtype == shape.grad_dtype
            and self.k.shape[1:] == (shape.kv_heads, shape.page_size, shape.head_dim)
            and (self.v is self.k) == shape.values_are_keys
            and self.slots >= slots
        )

    def free(self) -> None:
        """Unpin and drop the memory; the caller made sure no copy still uses it."""
        if self._unpin is not None:
            self._unpin()
        self.k = self.v = self.dk = self.dv = self.storage = None


def arena_part_bytes(slots: int, shape: PoolShape, part: Part) -> int:
    """Bytes of one of an arena's K/V (``"kv"``) or gradient (``"grad"``) views over ``slots`` pages."""
    dtype = shape.dtype if part == "kv" else shape.grad_dtype
    return slots * shape.page_numel * dtype.itemsize


def _arena_sizes(slots: int, shape: PoolShape) -> tuple[int, ...]:
    """The bytes of an arena's views, in order: K and V, then dK and dV (one of each where values are keys)."""
    kv, grad = (arena_part_bytes(slots, shape, part) for part in ("kv", "grad"))
    return (kv,) * shape.parts + (grad,) * shape.parts


def arena_bytes(slots: int, shape: PoolShape) -> int:
    """Bytes :class:`Arena` allocates for ``slots`` pages (0 for none)."""
    if slots == 0:
        return 0
    sizes = _arena_sizes(slots, shape)
    return sum(math.ceil(s / _ALIGN) * _ALIGN for s in sizes[:-1]) + sizes[-1]


def page_locked_bytes(
    total: int, owner: object, device: torch.device | None = None, mapped: bool = False
) -> tuple[torch.Tensor, weakref.finalize | None]:
    """``total`` uninitialised CPU bytes, page-locked with ``cudaHostRegister`` (for every device; ``mapped``: also
    mapped into their address space, so kernels may read and write them) when CUDA is available, and the finalizer
    that unregisters them once ``device`` (the CUDA device whose copies use them; ``None``: the current one) has
    finished its work (called by the owner's ``free``, or when ``owner`` is collected; ``None`` without CUDA)."""
    storage = torch.empty(total, dtype=torch.uint8)
    if not torch.cuda.is_available():
        return storage, None
    flags = 1 | (2 if mapped else 0)  # cudaHostRegisterPortable: for every device; cudaHostRegisterMapped
    what = "cudaHostRegister" + (
        " (mapped, for OOMB_OFFLOAD_GATHER=1: unset it to page-lock only)" if mapped else ""
    )
    _check_cuda(torch.cuda.cudart().cudaHostRegister(storage.data_ptr(), total, flags), what)
    # unregister before the bytes go back to malloc, even if the owner is dropped without free()
    device = device if device is not None and device.type == "cuda" else None
    unpin = weakref.finalize(owner, _unregister, storage.data_ptr(), device)
    unpin.atexit = False
    return storage, unpin


def _check_cuda(code, what: str) -> None:
    if int(code) != 0:
        raise RuntimeError(f"{what} failed with cudaError {int(code)}")


def _unregister(ptr: int, device: torch.device | None) -> None:
    torch.cuda.synchronize(device)  # no copy may still read or write pages that stop being page-locked
    _check_cuda(torch.cuda.cudart().cudaHostUnregister(ptr), "cudaHostUnregister")


# ----------------------------------------------------------------------------------------- token views
def gather_tokens(pages: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """Pages ``slots [B, n]`` of ``pages [slots, H, P, D]`` as tokens ``[B, H, n * P, D]`` (a copy)."""
    b, n = slots.shape
    gathered = pages[slots.flatten().long()].view(b, n, *pages.shape[1:])
    return gathered.transpose(1, 2).reshape(b, pages.shape[1], n * pages.shape[2], pages.shape[3])


def _as_pages(tokens: torch.Tensor, page: int) -> torch.Tensor:
    """Tokens ``[B, H, n * P, D]`` as pages ``[B * n, H, P, D]`` (row-major over ``(b, page)``)."""
    b, h, length, d = tokens.shape
    return tokens.reshape(b, h, length // page, page, d).transpose(1, 2).reshape(-1, h, page, d)


def write_tokens(pages: torch.Tensor, slots: torch.Tensor, tokens: torch.Tensor) -> None:
    """Store ``tokens [B, H, L, D]`` (``L`` up to ``n * P``; the rest of the last page is zero-filled) into the
    pages ``slots [B, n]``, converted to the pages' dtype."""
    padded = slots.shape[1] * pages.shape[2]
    if padded != tokens.shape[2]:
        tokens = torch.nn.functional.pad(tokens, (0, 0, 0, padded - tokens.shape[2]))
    pages.index_copy_(0, slots.flatten().long(), _as_pages(tokens, pages.shape[2]).to(pages.dtype))


def add_tokens(pages: torch.Tensor, slots: torch.Tensor, tokens: torch.Tensor) -> None:
    """Add token gradients ``[B, H, n * P, D]`` into the pages ``slots [B, n]``."""
    pages.index_add_(0, slots.flatten().long(), _as_pages(tokens, pages.shape[2]).to(pages.dtype))
