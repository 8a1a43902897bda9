"""Page-level top-K sparse attention (OOMB's sparse mode): page summaries, the selection rule, a step's selections.

**Summaries.** Every KV page keeps a summary of its post-RoPE keys per KV head (:func:`summarize`), written with
the page in the forward sweep and kept on the device by the pool (``[batch, pages, vectors, kv_heads, head_dim]``
per layer). ``page_score`` chooses what it is and how a query scores a page:

- ``"bound"`` (default): the elementwise max and min of the page's keys; a query ``g`` scores the page by the upper
  bound ``sum_d max(g_d max_d, g_d min_d) >= g . k`` of its dot product with any key of the page (computed as
  ``relu(g) . max + min(g, 0) . min``), so a page holding one key the query matches strongly scores high;
- ``"mean"`` (the OOMB paper's rule): the mean of the page's keys, scored by ``g . mean``.

**Rule** (:func:`select_pages`). For each query block of ``page_size`` queries of a chunk, in each layer: the
*candidates* are the pages before the chunk's start that some query of the block can see (none outside its sliding
window or before its document's start). A page's score is ``sum over KV heads and the block's queries`` of
``softmax over the candidates visible to the query`` of the score above, with ``g`` the sum of the query heads of
the KV head's group (no ``1 / sqrt(d)``). The block keeps its top ``page_budget`` candidates, ascending,
``-1``-padded — or all of them when it has at most ``page_budget``; a layer call where every block keeps all is
dense (no selection). The chunk's own pages are always attended, causally. Padded rows (right padding) score no
page: padding never steers the real rows' selection. The selection is per block: a query's pages are chosen with
its block's later queries (up to ``page_size - 1`` tokens ahead), so decoding token by token, which has no later
rows, can select differently than training did. On the needle-retrieval benchmark
(``benchmarks/sparse_quality.py``) the mean rule picks recent filler pages and loses the answer at every budget up to
8 pages where the bound keeps it at 1 page; hence the default.

**Reuse.** :class:`SparseStep` holds one step's selections, made once in the forward sweep and reused unchanged by
the backward sweep's recompute (its gradients are the exact gradients of the sparse loss); it also counts the
attended fraction and the selection recall (:class:`SparseStats`).
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, field

import torch

from lightning_oomb.engine.errors import OOMBConfigError
from lightning_oomb.engine.pages import PAGE_SCORES

SCORE_ELEMENTS = 1 << 24  # score-matrix elements at once in the selection (memory bound: 64 MiB of float32)


def check_budget(budget) -> None:
    """``None`` (dense) or a positive page count."""
    if budget is not None and (isinstance(budget, bool) or not isinstance(budget, int) or budget < 1):
        raise OOMBConfigError(
            f"page_budget={budget!r} must be None (dense attention) or a positive number of past pages each query "
            "block attends to (e.g. 64)."
        )


def check_page_score(score) -> None:
    if score not in PAGE_SCORES:
        raise OOMBConfigError(
            f"page_score={score!r} is unknown — choose 'bound' (per-page key max/min: a page holding one matching key "
            "scores high) or 'mean' (the mean key, the OOMB paper's rule)."
        )


def summarize(k: torch.Tensor, page: int, score: str = "bound") -> torch.Tensor:
    """Page summaries of post-RoPE keys ``k [B, Hkv, L, D]`` (a ragged last page summarises its tokens):
    ``[B, ceil(L / page), vectors, Hkv, D]`` in ``k``'s dtype — the keys' max and min (``"bound"``) or mean."""
    b, h, length, d = k.shape
    pages = math.ceil(length / page)
    pad = pages * page - length
    if score == "mean":
        x = k.float() if k.dtype != torch.float64 else k
        sums = torch.nn.functional.pad(x, (0, 0, 0, pad)).view(b, h, pages, page, d).sum(3)
        counts = torch.full((pages,), page, dtype=sums.dtype, device=k.device)
        counts[-1] = page - pad
        vectors = (sums / counts[:, None])[:, None]
    else:
        high = torch.nn.functional.pad(k, (0, 0, 0, pad), value=-math.inf).view(b, h, pages, page, d).amax(3)
        low = torch.nn.functional.pad(k, (0, 0, 0, pad), value=math.inf).view(b, h, pages, page, d).amin(3)
        vectors = torch.stack([high, low], 1)
    return vectors.permute(0, 3, 1, 2, 4).to(k.dtype)


def _page_scores(grouped: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    """``[B, Hkv, rows, past]`` scores of grouped queries ``[B, Hkv, rows, D]`` against summaries
    ``[B, Hkv, vectors, D, past]``: ``g . mean``, or the bound ``relu(g) . max + min(g, 0) . min``."""
    if keys.shape[2] == 1:
        return grouped @ keys[:, :, 0]
    positive = grouped.clamp(min=0)
    return positive @ keys[:, :, 0] + (grouped - positive) @ keys[:, :, 1]


def _first_keys(q_start: int, lq: int, batch: int, window: int | None, doc_start, device) -> torch.Tensor:
    """int64 ``[B, Lq]``: each query's first visible key (its window's and its document's start)."""
    positions = torch.arange(q_start, q_start + lq, device=device)
    first = torch.zeros(batch, lq, dtype=torch.long, device=device)
    if window is not None:
        first = torch.maximum(first, positions - window + 1)
    if doc_start is not None:
        first = torch.maximum(first, doc_start.long())
    return first


@dataclass
class Probe:
    """Query rows ``[lo, hi)`` of a call also attended densely (no selection, no sinks), to measure how much of their
    attention the selection keeps: the attention sets ``sparse_lse`` and ``dense_lse`` (``[B, Hq, hi - lo]``, the
    log-sum-exp over the keys attended and over every visible key)."""

    lo: int
    hi: int
    sparse_lse: torch.Tensor | None = None
    dense_lse: torch.Tensor | None = None


@dataclass
class Selection:
    """One layer call's selection: ``pages`` int32 ``[B, R, K]`` (``None``: dense) and its counts per query block,
    ``[B, R]`` each: ``selected`` past pages attended, ``candidates`` past pages visible, ``local`` own pages
    visible."""

    pages: torch.Tensor | None
    selected: torch.Tensor
    candidates: torch.Tensor
    local: torch.Tensor
    _blocks: dict = field(default_factory=dict, repr=False)

    def blocks(self, block_pages: int) -> dict[int, frozenset[int]] | None:
        """The offload blocks (of ``block_pages`` pages) holding a selected page, each with the offsets of its
        selected pages (``None``: dense); computed once."""
        if self.pages is None:
            return None
        if block_pages not in self._blocks:
            chosen: dict[int, set[int]] = {}
            for page in self.pages[self.pages >= 0].unique().tolist():
                chosen.setdefault(page // block_pages, set()).add(page % block_pages)
            self._blocks[block_pages] = {block: frozenset(p) for block, p in chosen.items()}
        return self._blocks[block_pages]


def select_pages(
    q: torch.Tensor,
    summaries: torch.Tensor,
    q_start: int,
    page: int,
    budget: int,
    window: int | None = None,
    doc_start: torch.Tensor | None = None,
    backend: str = "torch",
    real: torch.Tensor | None = None,
) -> Selection:
    """The rule of the module docstring for ``q [B, Hq, Lq, D]`` at ``q_start`` (page aligned) over the
    ``summaries [B, q_start / page, vectors, Hkv, D]`` of the pages before it (:func:`summarize`). ``real [B, Lq]``
    (right padding; ``None``: all real): padded rows add nothing to their block's scores, so padding never steers
    the real rows' selection. ``backend``: ``"triton"`` scores the pages with the kernel of
    ``csrc_triton.page_scores`` (float32; the torch scores here are its oracle, float64 for float64 queries)."""
    b, hq, lq, d = q.shape
    past, hkv = summaries.shape[1], summaries.shape[3]
    blocks = math.ceil(lq / page)
    first = _first_keys(q_start, lq, b, window, doc_start, q.device)
    page_last = torch.arange(past, device=q.device) * page + page - 1
    visible = page_last[None, None] >= first[..., None]  # [B, Lq, past]: the query sees a key of the page
    rows = torch.arange(lq, device=q.device)
    block_first = first.view(b, -1)[:, rows[::page]]  # first keys never decrease along a block's rows
    candidate = page_last[None, None] >= block_first[..., None]  # [B, R, past]
    local_first = torch.clamp(block_first, min=q_start) // page
    local = torch.arange(blocks, device=q.device) + q_start // page - local_first + 1
    counts = candidate.sum(-1)
    if past == 0 or int(counts.max()) <= budget:
        return Selection(None, counts, counts, local)
    if real is not None:  # a padded row sees no page before the chunk: it scores none
        first = torch.where(real, first, q_start)
        visible = page_last[None, None] >= first[..., None]
    dtype = torch.float64 if q.dtype == torch.float64 and backend != "triton" else torch.float32
    grouped = q.to(dtype).view(b, hkv, hq // hkv, lq, d).sum(2)  # [B, Hkv, Lq, D]
    keys = summaries.to(dtype).permute(0, 3, 2, 4, 1)  # [B, Hkv, vectors, D, past]
    if backend == "triton":
        from csrc_triton.page_scores import block_scores

        score = block_scores(grouped, keys, first, page)
    else:
        score = _block_scores(grouped, keys, visible, page, blocks)
    score = score.masked_fill(~candidate, -math.inf)
    top = score.topk(min(budget, past), -1)
    pages = torch.where(torch.isinf(top.values), past, top.indices).sort(-1).values
    pages = torch.where(pages == past, -1, pages).to(torch.int32)
    return Selection(pages, torch.clamp(counts, max=budget), counts, local)


def _block_scores(grouped, keys, visible, page: int, blocks: int) -> torch.Tensor:
    """``[B, blocks, past]``: per query block, the sum over KV heads and rows of each row's softmax over the pages
    it sees (``visible [B, Lq, past]``) of its page scores; in pieces of at most ``SCORE_ELEMENTS`` scores."""
    b, hkv, lq, _ = grouped.shape
    past = keys.shape[-1]
    score = torch.zeros(b, blocks, past, dtype=grouped.dtype, device=grouped.device)
    step = max(page, SCORE_ELEMENTS // max(1, b * hkv * past) // page * page)
    for lo in range(0, lq, step):
        hi = min(lo + step, lq)
        s = _page_scores(grouped[:, :, lo:hi], keys).masked_fill(~visible[:, None, lo:hi], -math.inf)
        p = torch.softmax(s, -1).nan_to_num_(0.0).sum(1)  # [B, rows, past]; a row seeing no page adds nothing
        block = torch.arange(lo, hi, device=grouped.device) // page
        score.index_add_(1, block, p)
    return score


@dataclass
class SparseStats:
    """What the sparse attention of a step did: ``attended_fraction`` = pages attended / pages visible, summed over
    layers, chunks, rows and query blocks (1.0 when dense); ``selection_recall`` = the mean, over the probed query
    blocks' real rows (not right padding) and heads, of the share of their dense attention mass on the keys they
    attend (1.0 when probing a step whose every call attended all its visible pages; ``None`` when not probing, or
    when no sparse call's probe had a real row on the device: under offload only the layers whose pages are on the
    device are probed — a host layer's call stages only its selected pages, so its dense mass is not there to
    measure)."""

    page_budget: int | None
    attended_fraction: float
    selection_recall: float | None


@dataclass
class SparseStep:
    """One step's selections and counters (see the module docstring).

    ``budget``: pages per query block; ``score``: the page score (``"bound"`` or ``"mean"``); ``probe``: measure the selection recall on one query block per sparse layer
    call of the forward (or eval) sweep (the block is drawn by ``seed``, never from the global RNG: dropout masks stay as in
    the dense step).
    """

    budget: int
    score: str = "bound"
    probe: bool = False
    seed: int = 0
    selections: dict[tuple[int, int], Selection] = field(default_factory=dict)
    _attended: list[torch.Tensor] = field(default_factory=list)
    _visible: list[torch.Tensor] = field(default_factory=list)
    _recall: list[torch.Tensor] = field(default_factory=list)
    _unprobed: int = 0  # sparse calls whose probe measured nothing: host-tier layers', blocks of padding only

    def __post_init__(self) -> None:
        self._draw = random.Random(self.seed)

    def select(self, layer: int, start: int, sweep: str, make) -> Selection:
        """The selection of ``(layer, start)``: made by ``make()`` in the forward and eval sweeps (counted, and kept
        by the forward sweep), the stored one in the backward sweep."""
        if sweep == "backward":
            return self.selections[(layer, start)]
        selection = make()
        if sweep == "forward":
            self.selections[(layer, start)] = selection
        self._attended.append((selection.selected + selection.local).sum())
        self._visible.append((selection.candidates + selection.local).sum())
        return selection

    def blocks_of(self, block_pages: int, chunk_tokens: int):
        """``selected(layer, chunk)`` for the offload prefetch: the stored selection's blocks and pages, where made
        (``{}`` where not yet: nothing of the prefix is predicted; ``None``: a dense call, every block)."""

        def selected(layer: int, chunk: int) -> dict[int, frozenset[int]] | None:
            selection = self.selections.get((layer, chunk * chunk_tokens))
            return {} if selection is None else selection.blocks(block_pages)  # {}: not made yet

        return selected

    def probe_rows(
        self, selection: Selection, page: int, lq: int, sweep: str, streamed: bool = False
    ) -> Probe | None:
        """The query block (of ``page`` of the call's ``lq`` rows) whose recall a sparse call of the forward or
        eval sweep measures, with probing on (else ``None``). ``streamed``: the call's layer is in host memory, where
        only the selected pages are staged — not probed (its block is drawn all the same, so the other layers' draws
        do not depend on the placement)."""
        if not self.probe or sweep == "backward" or selection.pages is None:
            return None
        block = self._draw.randrange(selection.pages.shape[1])
        if streamed:
            self._unprobed += 1
            return None
        return Probe(block * page, min((block + 1) * page, lq))

    def add_recall(
        self, sparse_lse: torch.Tensor, dense_lse: torch.Tensor, real: torch.Tensor | None = None
    ) -> None:
        """Record a probed block's recall from its rows' log-sum-exps over the attended and over all visible keys;
        ``real [B, rows]`` (right padding; ``None``: all real): padded rows are not counted (their queries, hence
        their share, depend on the padding's token ids), and a block of padding only records nothing."""
        share = torch.exp(sparse_lse - dense_lse)
        kept = torch.isfinite(share)
        if real is not None:
            if not bool(real.any()):
                self._unprobed += 1
                return
            kept &= real[:, None]
        self._recall.append(share[kept].mean())

    def stats(self) -> SparseStats:
        attended = float(torch.stack(self._attended).sum()) if self._attended else 0.0
        visible = float(torch.stack(self._visible).sum()) if self._visible else 0.0
        recall = float(torch.stack(self._recall).mean()) if self._recall else None
        if recall is None and self.probe and not self._unprobed:  # no call selected (the budget covered every
            recall = 1.0  # page): all mass kept
        return SparseStats(self.budget, attended / visible if visible else 1.0, recall)
