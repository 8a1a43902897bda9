"""Context parallelism: the ranks of a *context group* share one sequence, each owning an equal slice of every chunk.

**Layout** (:class:`Layout`). Every chunk's pages are split evenly across the ``R`` ranks in rank order: rank ``r``
runs the tokens of its slice through every layer that is not attention, and keeps the K/V (and gradient) pages of
its slices — of every chunk — in its own pool, laid out in its *local* token space (its slices one after another:
a full chunk's slice is ``chunk_size / R`` tokens, one offload block). A short last chunk is split the same way, so
a rank may have nothing of it (it then runs a one-token stand-in whose keys are never stored and whose loss is
zero: every rank makes the same collective calls).

**Attention** (:func:`attend_forward`, :func:`attend_backward`, used by the attention op). Per layer and chunk the
queries of the whole chunk are all-gathered; each rank attends all of them to its own pages (the pages it owns
before the chunk, listed as a page selection, and its slice of the chunk, causally), and the partial softmax states
are merged by log-sum-exp: the row maxima are all-reduced, the rescaled accumulators and normalisers summed and
scattered back to the queries' owners. Backward mirrors it: dO, the rows' log-sum-exp and ``delta`` are
all-gathered, each rank adds dK/dV into its own gradient pages and the partial dQ are summed and scattered. Bytes
per layer and chunk are ``O(chunk x heads x head_dim)``, independent of the sequence length and of the number of KV
heads (:attr:`ContextGroup.sent_bytes` counts them).

**Sparse steps** (``page_budget``): each rank summarises its slice's pages and the group all-gathers each chunk's
new summaries (:class:`SharedSummaries`: every page's summary on every rank), so every rank selects with the
gathered queries exactly what one process would; each attends the selected pages it owns.

Collectives are ``torch.distributed``'s (NCCL on GPUs, gloo on CPU); ``reduce_scatter`` where the backend has it,
else an all-reduce and the rank's own rows.
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from lightning_oomb.engine.config import OOMBConfig
from lightning_oomb.engine.errors import OOMBConfigError
from lightning_oomb.engine.lse import State, add_sinks, finish_state, init_state
from lightning_oomb.engine.pages import PagedKV
from lightning_oomb.engine.sparse import Probe, Selection, SparseStep, select_pages, summarize

FAILED_KEY = "lightning_oomb/failed_rank"


class RankFailure(RuntimeError):
    """Another rank of the job failed; this one stopped waiting for it."""


def check_context(config: OOMBConfig, size: int, seq_len: int | None = None) -> None:
    """Refuse options (and a sequence length) context parallelism cannot honour, before any work."""
    page = config.page_size
    pages = config.chunk_size // page
    if pages % size:
        raise OOMBConfigError(
            f"chunk_size={config.chunk_size} is {pages} pages of {page}, which do not split into "
            f"{size} equal slices of whole pages (one per rank of the context group) — use a chunk_size that is a "
            f"multiple of {size * page} (e.g. {max(1, pages // size) * size * page})."
        )
    first = (
        None if seq_len is None else -(-min(seq_len, config.chunk_size) // page)
    )  # its first chunk's pages
    if first is not None and first < size:
        raise OOMBConfigError(
            f"a sequence of {seq_len} tokens has {first} pages of {page} in its first chunk, fewer than the "
            f"{size} ranks of the context group — every rank needs a page of it — use longer sequences, "
            "a smaller page_size or a smaller context_parallel_size."
        )


@dataclass
class ContextGroup:
    """A context group: ``size`` ranks (this one is ``rank``) of the process group ``group`` sharing one sequence.

    ``sent`` counts, per collective, the bytes of the buffers this rank contributes to the attention's
    collectives (tests and ``benchmarks/cp_model.py`` read it); :attr:`sent_bytes` is their sum."""

    group: object
    rank: int
    size: int
    sent: dict[str, int] = field(default_factory=dict)

    @property
    def sent_bytes(self) -> int:
        return sum(self.sent.values())

    def _count(self, op: str, x: torch.Tensor) -> None:
        self.sent[op] = self.sent.get(op, 0) + x.numel() * x.element_size()

    @classmethod
    def of(cls, group=None) -> ContextGroup:
        """The context group of ``group`` (default: the whole world); torch.distributed must be initialised."""
        return cls(group, dist.get_rank(group), dist.get_world_size(group))

    # ------------------------------------------------------------------------------------------- collectives
    def gather_rows(self, x: torch.Tensor, lengths: list[int]) -> torch.Tensor:
        """Own rows ``x [..., L_own, last]`` (dim -2) of every rank, concatenated in rank order:
        ``[..., sum(lengths), last]``."""
        padded = _pad_rows(x, max(lengths))
        parts = [torch.empty_like(padded) for _ in range(self.size)]
        self._count("all_gather", padded)
        dist.all_gather(parts, padded, group=self.group)
        return torch.cat([p[..., :n, :] for p, n in zip(parts, lengths, strict=True)], -2)

    def sum_rows(self, x: torch.Tensor, lengths: list[int]) -> torch.Tensor:
        """Sum over the ranks of ``x [..., sum(lengths), last]`` (rows of every rank), returning this rank's rows."""
        longest = max(lengths)
        starts = [sum(lengths[:r]) for r in range(self.size)]
        blocks = torch.stack(
            [_pad_rows(x[..., s : s + n, :], longest) for s, n in zip(starts, lengths, strict=True)]
        )
        self._count("reduce_scatter", blocks)
        if dist.get_backend(self.group) == "nccl":
            mine = torch.empty_like(blocks[0])
            dist.reduce_scatter_tensor(mine, blocks.contiguous(), group=self.group)
        else:
            dist.all_reduce(blocks, group=self.group)
            mine = blocks[self.rank]
        return mine[..., : lengths[self.rank], :]

    def max_(self, x: torch.Tensor) -> torch.Tensor:
        """Elementwise maximum over the ranks (in place)."""
        self._count("all_reduce_max", x)
        dist.all_reduce(x, op=dist.ReduceOp.MAX, group=self.group)
        return x

    def sum_(self, x: torch.Tensor) -> torch.Tensor:
        """Sum over the ranks (in place; not counted: a step's loss, not attention traffic)."""
        dist.all_reduce(x, group=self.group)
        return x

    def logsumexp(self, x: torch.Tensor) -> torch.Tensor:
        """``log(sum over the ranks of exp(x))``, elementwise (not counted: the selection-recall probe's)."""
        top = x.clone()
        dist.all_reduce(top, op=dist.ReduceOp.MAX, group=self.group)
        shift = torch.where(torch.isinf(top), torch.zeros_like(top), top)
        return shift + torch.log(self.sum_(torch.exp(x - shift)))

    @contextlib.contextmanager
    def reporting(self):
        """Name the failing rank: the first rank whose step raises records itself in the job's store; a rank that
        then fails too (a collective timing out waiting for it) raises :class:`RankFailure` naming it."""
        try:
            yield
        except RankFailure:
            raise
        except BaseException as error:
            store = _store()
            if store is None:
                raise
            me = dist.get_rank()
            if store.check([FAILED_KEY]):
                origin = store.get(FAILED_KEY).decode()
                if not origin.startswith(f"rank {me}:"):
                    raise RankFailure(
                        f"{origin} — so rank {me} stopped waiting for it ({type(error).__name__}: {str(error)[:200]})"
                    ) from error
            else:
                store.set(FAILED_KEY, f"rank {me}: {type(error).__name__}: {error}"[:2000])
            raise

    def check_same(self, fingerprint: torch.Tensor, what: str) -> None:
        """Refuse, on every rank, a ``what`` that differs across the group (``fingerprint``: int64 ``[n]``)."""
        parts = [torch.empty_like(fingerprint) for _ in range(self.size)]
        dist.all_gather(parts, fingerprint, group=self.group)
        differ = [r for r, p in enumerate(parts) if not torch.equal(p, parts[0])]
        if differ:
            raise OOMBConfigError(
                f"the {what} of context-group ranks {differ} differs from rank 0's — the ranks of a context group "
                "train one sequence together — give every rank of the group the same batch (shard the data over "
                "the 'data' mesh dimension only)."
            )


def _store():
    """The default process group's key-value store (``None`` where it cannot be reached)."""
    try:
        return dist.distributed_c10d._get_default_store()
    except (AttributeError, RuntimeError, ValueError):
        return None


def _pad_rows(x: torch.Tensor, rows: int) -> torch.Tensor:
    pad = rows - x.shape[-2]
    return torch.nn.functional.pad(x, (0, 0, 0, pad)).contiguous() if pad else x.contiguous()


# ------------------------------------------------------------------------------------------------------- layout
@dataclass(frozen=True)
class Layout:
    """Where rank ``rank`` of ``size`` sits in a step whose chunks are ``bounds`` (absolute token ranges).

    ``slices[c][r]``: rank ``r``'s tokens ``(lo, hi)`` of chunk ``c`` (``lo == hi``: none); ``local_starts[c]``:
    where this rank's slice of chunk ``c`` starts in its local token space; ``abs_pages``: the absolute page of each
    local page."""

    rank: int
    size: int
    page: int
    slices: tuple[tuple[tuple[int, int], ...], ...]
    local_starts: tuple[int, ...]
    local_len: int
    abs_pages: torch.Tensor = field(compare=False)
    _on_device: dict = field(default_factory=dict, compare=False, repr=False)  # device -> abs_pages there

    @classmethod
    def plan(cls, bounds: list[tuple[int, int]], page: int, rank: int, size: int) -> Layout:
        slices, starts, pages, local = [], [], [], 0
        for lo, hi in bounds:
            n = math.ceil((hi - lo) / page)
            cuts = [min(hi, lo + (r * n // size) * page) for r in range(size + 1)]
            chunk = tuple((cuts[r], cuts[r + 1]) for r in range(size))
            slices.append(chunk)
            starts.append(local)
            mine = chunk[rank]
            pages.extend(range(mine[0] // page, math.ceil(mine[1] / page)))
            local += mine[1] - mine[0]
        abs_pages = torch.tensor(pages, dtype=torch.long)
        return cls(rank, size, page, tuple(slices), tuple(starts), local, abs_pages)

    def lengths(self, chunk: int) -> list[int]:
        """Tokens of each rank's slice of ``chunk``."""
        return [hi - lo for lo, hi in self.slices[chunk]]

    def mine(self, chunk: int) -> tuple[int, int]:
        return self.slices[chunk][self.rank]

    def absolute_table(self, local_table: torch.Tensor, num_pages: int) -> torch.Tensor:
        """A page table over absolute pages ``[B, num_pages]`` from one over local pages (entries of pages this
        rank does not own: 0, never read)."""
        table = local_table.new_zeros(local_table.shape[0], num_pages)
        n = min(local_table.shape[1], int((self.abs_pages < num_pages).sum()))
        device = table.device
        if device not in self._on_device:  # one copy per step and device: a copy from host memory syncs
            self._on_device[device] = self.abs_pages.to(device)
        table[:, self._on_device[device][:n]] = local_table[:, :n]
        return table

    def owned_ranges(self, local_keys: tuple[int, int], upto_chunk: int) -> list[tuple[int, int]]:
        """The absolute key ranges of this rank's slices (chunks ``<= upto_chunk``) inside local keys
        ``[lo, hi)``."""
        lo, hi = local_keys
        ranges = []
        for c in range(upto_chunk + 1):
            a, b = self.mine(c)
            start = self.local_starts[c]
            x, y = max(lo, start), min(hi, start + b - a)
            if x < y:
                ranges.append((a + x - start, a + y - start))
        return ranges


def fingerprint(*tensors: torch.Tensor | None) -> torch.Tensor:
    """int64 ``[n]``: shapes and position-weighted sums of the tensors (equal batches give equal fingerprints)."""
    values = []
    for t in tensors:
        if t is None:
            values.append(-1)
            continue
        flat = t.reshape(-1).long().cpu()
        weights = torch.arange(1, flat.numel() + 1, dtype=torch.long) % 1_000_003
        values.extend([*t.shape, int((flat * weights).sum()), int(flat.sum())])
    return torch.tensor(values, dtype=torch.long)


# ---------------------------------------------------------------------------------------------------- attention
@dataclass
class ContextChunk:
    """What the attention op needs to attend one chunk across the group: the group, the step's layout and the
    chunk's index (travels in :class:`~lightning_oomb.engine.attention.ChunkContext`); ``tokens``: right padding,
    the whole chunk's real tokens ``[B, L]`` (``None``: all)."""

    group: ContextGroup
    layout: Layout
    index: int
    summaries: SharedSummaries | None = None
    tokens: torch.Tensor | None = None

    @property
    def lengths(self) -> list[int]:
        return self.layout.lengths(self.index)

    @property
    def own(self) -> int:
        """Tokens of this rank's slice of the chunk (0: it runs a stand-in token)."""
        return self.lengths[self.layout.rank]

    @property
    def local_start(self) -> int:
        return self.layout.local_starts[self.index]

    @property
    def rows(self) -> slice:
        """This rank's rows among the chunk's queries."""
        lengths, rank = self.lengths, self.layout.rank
        return slice(sum(lengths[:rank]), sum(lengths[: rank + 1]))

    def own_parts(self, pool, layer: int, num_keys: int, grads: bool = False, first_key: int = 0):
        """This rank's pages of ``layer`` up to the chunk's end as ``(part, absolute key ranges)``: the pool's
        parts (local token space) with page tables over absolute pages. Pages wholly before ``first_key`` (no query
        of the chunk sees them: a sliding window, packed documents) are left out."""
        layout = self.layout
        local = self.local_start + self.own
        if local == 0:
            return
        num_pages = math.ceil(num_keys / layout.page)
        floor = first_key // layout.page * layout.page
        for kv in pool.parts(layer, local, grads, own=self.own > 0):
            owned = layout.owned_ranges(kv.keys or (0, local), self.index)
            ranges = [(max(lo, floor), hi) for lo, hi in owned if hi > floor]
            if ranges:
                table = layout.absolute_table(kv.page_table, num_pages)
                yield PagedKV(kv.k, kv.v, kv.dk, kv.dv, table), ranges


def _pages(ranges: list[tuple[int, int]], page: int, device, dtype=torch.int32) -> torch.Tensor:
    """The pages of key ``ranges``, made on ``device`` (no copy from host memory, which would sync)."""
    return torch.cat(
        [torch.arange(a // page, math.ceil(b / page), device=device, dtype=dtype) for a, b in ranges]
    )


def _listed(ranges: list[tuple[int, int]], page: int, batch: int, blocks: int, device) -> torch.Tensor:
    """``page_select [B, blocks, K]`` listing the pages of ``ranges`` for every query block."""
    return _pages(ranges, page, device).expand(batch, blocks, -1).contiguous()


def _owned(selected: torch.Tensor, ranges: list[tuple[int, int]], page: int) -> torch.Tensor:
    """The pages of ``ranges`` among each query block's ``selected`` pages (``[B, blocks, K]``, ascending,
    ``-1``-padded), in the same form."""
    keep = torch.isin(selected, _pages(ranges, page, selected.device, selected.dtype))
    last = torch.iinfo(selected.dtype).max
    kept = torch.where(keep, selected, last).sort(-1).values
    return torch.where(kept == last, -1, kept)


def _calls(kv: PagedKV, ranges: list[tuple[int, int]], q: torch.Tensor, q_start: int, selected=None):
    """The kernel calls covering ``ranges``: ``(key_range, page_select)`` — the rank's slice of the chunk (keys
    from ``q_start`` on) as a plain key range, its pages before the chunk in one call listing them (those of them
    ``selected`` in a sparse step)."""
    for lo, hi in ranges:
        if lo >= q_start:
            yield (lo, hi), None
    past = [r for r in ranges if r[0] < q_start]
    if past:
        page = kv.page_size
        blocks = math.ceil(q.shape[2] / page)
        listed = (
            _listed(past, page, q.shape[0], blocks, q.device)
            if selected is None
            else _owned(selected, past, page)
        )
        yield (past[0][0], past[-1][1]), listed


def attend_forward(ops, cp: ContextChunk, pool, layer, q, k, q_start, scale, window, softcap, sinks, docs,
                   sparse: SparseStep | None = None, sweep: str = "forward", backend: str = "torch",
                   first_key: int = 0):  # fmt: skip
    """This rank's rows ``(out, lse)`` of the attention of the whole chunk's queries over every rank's pages (the
    module docstring), and the chunk's page selection (a sparse step; ``None``: dense); ``q``, ``k``: this rank's
    rows (none for a stand-in); ``first_key``: no query sees a key before it (its pages are not read)."""
    group = cp.group
    queries = group.gather_rows(q, cp.lengths)
    selected = probe = None
    if sparse is not None:
        selection = select_across_group(cp, sparse, layer, queries, k, q_start, window, docs, sweep, backend)
        selected = selection.pages
        probe = sparse.probe_rows(selection, cp.layout.page, queries.shape[2], sweep, pool.streams(layer))
    num_keys = q_start + queries.shape[2]
    state = init_state(queries)
    dense = None if probe is None else init_state(queries[:, :, probe.lo : probe.hi])
    terms = {"softcap": softcap, "doc_start": docs}
    for kv, ranges in cp.own_parts(pool, layer, num_keys, first_key=first_key):
        for keys, select in _calls(kv, ranges, queries, q_start, selected):
            ops.paged_attention_forward(queries, kv.k, kv.v, kv.page_table, q_start, scale, window, key_range=keys,
                                        state=state, page_select=select, **terms)  # fmt: skip
        if probe is not None:
            _probe_part(ops, kv, ranges, queries, q_start, probe, dense, scale, window, softcap, docs)
    # the group's log-sum-exps of the probed rows, over the attended and all visible keys
    if probe is not None:
        probe.sparse_lse = group.logsumexp(_lse(state)[..., probe.lo : probe.hi])
        probe.dense_lse = group.logsumexp(_lse(dense))
        real = None if cp.tokens is None else cp.tokens[:, probe.lo : probe.hi]
        sparse.add_recall(probe.sparse_lse, probe.dense_lse, real)
    merged = merge_states(group, state, cp.lengths)
    if sinks is not None:
        add_sinks(merged, sinks)
    return (*finish_state(merged, q.dtype), selected)


def _probe_part(ops, kv: PagedKV, ranges, queries, q_start, probe: Probe, dense: State, scale, window, softcap,
                docs):  # fmt: skip
    """Fold this rank's keys of ``ranges`` that the ``probe``'s rows can see into their dense state."""
    end = q_start + probe.hi
    seen = [(lo, min(hi, end)) for lo, hi in ranges if lo < end]
    rows = queries[:, :, probe.lo : probe.hi].contiguous()
    rows_docs = None if docs is None else docs[:, probe.lo : probe.hi].contiguous()
    for keys, listed in _calls(kv, seen, rows, q_start):
        ops.paged_attention_forward(rows, kv.k, kv.v, kv.page_table, q_start + probe.lo, scale, window,
                                    key_range=keys, state=dense, page_select=listed, softcap=softcap,
                                    doc_start=rows_docs)  # fmt: skip


def _lse(state: State) -> torch.Tensor:
    _, m, l_sum = state
    return m + torch.log(l_sum)


def attend_backward(
    ops,
    cp: ContextChunk,
    pool,
    layer,
    q,
    lse,
    dout,
    delta,
    q_start,
    scale,
    window,
    softcap,
    docs,
    selected=None,
    first_key: int = 0,
):
    """This rank's rows of dQ, adding dK/dV of every chunk query into this rank's gradient pages; ``lse`` and
    ``delta`` are this rank's rows' final ones; ``selected``: the chunk's page selection (sparse); ``first_key``:
    as for :func:`attend_forward`."""
    group, lengths = cp.group, cp.lengths
    queries = group.gather_rows(q, lengths)
    grads_out = group.gather_rows(dout, lengths)
    rows = group.gather_rows(torch.stack([lse, delta], -1).to(delta.dtype), lengths)
    lse_all, delta_all = rows[..., 0].contiguous(), rows[..., 1].contiguous()
    dq = torch.zeros(queries.shape, dtype=delta.dtype, device=q.device)
    terms = {"softcap": softcap, "doc_start": docs}
    for kv, ranges in cp.own_parts(pool, layer, q_start + queries.shape[2], True, first_key):
        pages = (kv.k, kv.v, kv.dk, kv.dv, kv.page_table)
        for keys, select in _calls(kv, ranges, queries, q_start, selected):
            # ``out`` is only read to compute ``delta``, which is given: dO stands in for it
            ops.paged_attention_backward(queries, grads_out, lse_all, grads_out, *pages, q_start, scale, window,
                                         key_range=keys, delta=delta_all, dq=dq, page_select=select,
                                         **terms)  # fmt: skip
    return group.sum_rows(dq, lengths)


def merge_states(group: ContextGroup, state: State, lengths: list[int]) -> State:
    """This rank's rows of the log-sum-exp merge of every rank's partial ``state`` over all the chunk's rows."""
    acc, m, l_sum = state
    top = group.max_(m.clone())
    shift = torch.where(torch.isinf(top), torch.zeros_like(top), top)
    weight = torch.exp(m - shift)  # 0 where this rank saw nothing
    packed = torch.cat([acc * weight[..., None], (l_sum * weight)[..., None]], -1)
    mine = group.sum_rows(packed, lengths)
    rank = group.rank
    rows = slice(sum(lengths[:rank]), sum(lengths[: rank + 1]))
    return mine[..., :-1].contiguous(), top[..., rows].contiguous(), mine[..., -1].contiguous()


# ------------------------------------------------------------------------------------------------------- sparse
class SharedSummaries:
    """Every page's summary (:func:`~lightning_oomb.engine.sparse.summarize`) in absolute page order, the same on
    each rank of the group: each rank summarises the pages of its slice and the group all-gathers them, chunk by
    chunk (``O(chunk)`` bytes per layer and chunk), so every rank selects exactly what one process would —
    ``pages``: layer -> ``[B, pages, vectors, kv_heads, head_dim]`` (the layer's own KV heads) once its first chunk is
    summarised."""

    def __init__(self, score: str) -> None:
        self.score = score
        self.pages: dict[int, torch.Tensor] = {}

    def add(self, cp: ContextChunk, layer: int, k: torch.Tensor) -> None:
        """Summarise this rank's rows ``k [B, Hkv, own, D]`` of chunk ``cp.index`` and gather the chunk's."""
        layout, page = cp.layout, cp.layout.page
        own = summarize(k, page, self.score) if k.shape[2] else None
        vectors = 1 if self.score == "mean" else 2
        b, heads, _, d = k.shape
        if own is None:
            own = k.new_zeros((b, 0, vectors, heads, d))
        lengths = [math.ceil((hi - lo) / page) for lo, hi in layout.slices[cp.index]]
        rows = own.permute(0, 2, 3, 1, 4)  # pages at dim -2, as gather_rows wants
        chunk = cp.group.gather_rows(rows, lengths).permute(0, 3, 1, 2, 4)
        if layer not in self.pages:
            total = math.ceil(layout.slices[-1][-1][1] / page)
            self.pages[layer] = k.new_zeros((b, total, vectors, heads, d))
        first = layout.slices[cp.index][0][0] // page
        self.pages[layer][:, first : first + chunk.shape[1]] = chunk


def select_across_group(
    cp: ContextChunk, sparse: SparseStep, layer, queries, k, q_start, window, docs, sweep, backend="torch"
):
    """The chunk's page selection from the gathered ``queries`` and every rank's summaries (made in the forward and
    eval sweeps, the stored one in the backward sweep: :meth:`SparseStep.select`)."""

    def make() -> Selection:
        with torch.no_grad():
            cp.summaries.add(cp, layer, k)
            page = cp.layout.page
            past = cp.summaries.pages[layer][:, : q_start // page]
            return select_pages(queries, past, q_start, page, sparse.budget, window, docs, backend, cp.tokens)

    return sparse.select(layer, q_start, sweep, make)
