"""The OOMB training step as one ``torch.autograd.Function``.

``forward`` is the **forward sweep**: chunk by chunk, with no graph, each chunk's K/V go into the pool and its
loss is summed (the step's loss, exact). ``backward`` is the **backward sweep**: chunks in reverse, each recomputed
with grad (same RNG and autocast state as in the forward sweep) and back-propagated at once with the incoming
``grad_output`` (so AMP loss scale and ``1 / accumulate_grad_batches`` arrive for free). Parameter ``.grad``
accumulates as in ordinary training — 16-bit parameters' in a float32 sum written back once per sweep
(``grad_accumulation``, :mod:`lightning_oomb.engine.grads`); nothing of size O(N) is ever in autograd.

Chunk loss ``s`` = summed token CE over the chunk / number of target tokens in the whole batch (labels shifted
over the full sequence first), so the sum over chunks is the exact full-sequence mean. A batch without any
target token gives loss 0 and zero gradients (documented choice; Hugging Face would return NaN).
"""

from __future__ import annotations

import contextlib
import warnings
import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import torch

from lightning_oomb.engine import parking
from lightning_oomb.engine.attention import (
    ChunkContext,
    check_kernel_shapes,
    resolve_backend,
    stored_head_dim,
)
from lightning_oomb.engine.batch import key_floors, pad_a_lone_last_token, plan_layout
from lightning_oomb.engine.config import OOMBConfig
from lightning_oomb.engine.context import (
    ContextChunk,
    ContextGroup,
    Layout,
    SharedSummaries,
    check_context,
    fingerprint,
)
from lightning_oomb.engine.errors import OOMBConfigError
from lightning_oomb.engine.grads import (
    Float32GradSums,
    HostGradSums,
    earlier_sums,
    gradient_accumulator,
    half_trainable,
    restore_zeros,
)
from lightning_oomb.engine.kv_pool import KVPool
from lightning_oomb.engine.loss import IGNORE_INDEX, linear_cross_entropy
from lightning_oomb.engine.model import ChunkModel
from lightning_oomb.engine.offload import Transport, default_transport
from lightning_oomb.engine.pages import PoolShape
from lightning_oomb.engine.replay import AutocastState, RNGState
from lightning_oomb.engine.results import ForwardResults
from lightning_oomb.engine.sparse import SparseStats, SparseStep, check_budget
from lightning_oomb.engine.states import CarriedStates, ChunkStates, HostStates
from lightning_oomb.engine.user_hooks import UserHooks, gradient_hooks


@dataclass
class StepStats:
    """What the last step did (read by callbacks and the demo)."""

    tokens: int = 0
    chunks: int = 0
    pool_bytes: int = 0
    kv_bytes: int = 0
    grad_bytes: int = 0
    extra: dict = field(default_factory=dict)
    sparse: SparseStats | None = None  # a sparse step's budget, attended fraction and selection recall


@dataclass
class _Step:
    """One step's inputs, split in chunks."""

    input_ids: torch.Tensor
    targets: torch.Tensor
    denominator: (
        int | float
    )  # the loss's divisor: the batch's target tokens, or the caller's num_items_in_batch
    shape: PoolShape
    backend: str
    bounds: list[tuple[int, int]]
    positions: torch.Tensor  # RoPE positions [1 | B, N]
    doc_start: torch.Tensor | None  # packed documents: each token's document start [B, N]
    floors: list[int]  # per chunk, the first key its queries can see through their documents
    step_loss: object | None = None  # the model's StepLoss for this step
    sparse: SparseStep | None = None  # a sparse step's selections
    layout: Layout | None = None  # context parallelism: this rank's slices
    summaries: SharedSummaries | None = None  # context parallelism, sparse: every rank's page summaries
    states: CarriedStates | None = None  # a hybrid's recurrent / convolution states at chunk boundaries
    tokens: torch.Tensor | None = None  # right padding: the real tokens [B, N] (None: no padding)
    reused_from: int | None = None  # reuse_attention: the chunk from which the backward takes forward results
    position_span: int = 0  # the largest RoPE position + 1 (Layout.span): a length-dependent RoPE's length

    def rows(self, index: int) -> int:
        """Query rows this device runs of chunk ``index`` (its slice under context parallelism; 0: a stand-in)."""
        if self.layout is None:
            start, end = self.bounds[index]
            return end - start
        return self.layout.lengths(index)[self.layout.rank]


class OOMBEngine:
    """Chunk-recurrent exact training of a :class:`ChunkModel`; plain torch, usable without Lightning.

    ``engine.loss(input_ids, labels)`` returns the full-sequence mean token loss as a differentiable scalar;
    calling ``.backward()`` on it (or on anything computed from it) runs the backward sweep.

    Args:
        model: the model (see :class:`~lightning_oomb.engine.model.ChunkModel`).
        config: the options (:class:`~lightning_oomb.engine.config.OOMBConfig`).
        transport: a factory ``transport(device)`` for the offload copies (race checks inject
            :func:`~lightning_oomb.engine.offload.delaying_transport`).
        context: context parallelism: the :class:`~lightning_oomb.engine.context.ContextGroup` of ranks sharing
            each sequence (every rank of it calls ``loss`` with the same batch; each runs its slice of every chunk
            and keeps its slices' pages); ``None``: one device.

    ``page_budget`` (from the config; settable between steps, e.g. by ``OOMBSparseBudget``) makes the next steps
    sparse; ``probe_recall = True`` makes the next steps (and evaluations) measure their selection recall, on query
    blocks drawn by ``global_step``. The model's hooks are checked before every sweep (refused or warned about:
    :mod:`~lightning_oomb.engine.user_hooks`).
    """

    def __init__(
        self,
        model: ChunkModel,
        config: OOMBConfig | None = None,
        transport: Callable[[torch.device], Transport] = default_transport,
        context: ContextGroup | None = None,
    ):
        self.model = model
        self.config = config or OOMBConfig()
        self.context = context
        if context is not None:
            check_context(self.config, context.size)
            if getattr(model, "carries_states", False):
                refuse_split_states()
        self._apply_model_options(self.config)
        self.pool = KVPool(self.config, transport)
        self.host_states = HostStates()  # the carried states' host buffer under offload (grows on first use)
        self.host_grads = HostGradSums()  # grad_accumulation="float32-host": the host sums, kept across steps
        self.results = ForwardResults()  # reuse_attention: the forward sweep's attention results
        self._pending: weakref.ref | None = None  # the loss's autograd node whose step waits for its backward
        self.stats = StepStats()
        self._page_budget = None
        self.page_budget = self.config.page_budget
        self.probe_recall = False
        self._global_step: int | None = None  # the trainer's step (OOMBSparseBudget); None: the engine counts
        self._steps = 0  # training steps: of this global step, else of this engine
        self.user_hooks = UserHooks()  # the model's hooks, checked before every sweep
        # the layer indices the last step's first chunk attended with (the setup check's idle-layer test)
        self.layers_called: frozenset[int] = frozenset()

    def reconfigure(self, config: OOMBConfig) -> None:
        """Use ``config`` from the next step on (its ``"auto"`` options decided, e.g. by the strategy's memory plan);
        the context-parallel constraints are checked again."""
        if self.context is not None:
            check_context(config, self.context.size)
        self.config = self.pool.config = config
        self._apply_model_options(config)

    def _apply_model_options(self, config: OOMBConfig) -> None:
        """Options the model carries out: ``layer_checkpointing=True`` turns its per-layer checkpointing on
        (``"auto"`` is decided by the strategies' memory plan, which sets the model's flag; ``False`` leaves a
        model's own choice), ``mlp_tile`` its MLP tiles (a model without the attribute has none), ``mla_pages``
        what its latent attention layers' pages hold (refused for a model without the attribute)."""
        if config.layer_checkpointing is True and hasattr(self.model, "layer_checkpointing"):
            self.model.layer_checkpointing = True
        if hasattr(self.model, "mlp_tile"):
            self.model.mlp_tile = config.mlp_tile
        if hasattr(self.model, "mla_pages"):
            self.model.mla_pages = config.mla_pages
        elif config.mla_pages == "latent":
            raise OOMBConfigError(
                f"mla_pages={config.mla_pages!r} needs a model that attends over latents (a Hugging Face model with "
                f"multi-head latent attention layers); {type(self.model).__name__} does not — use mla_pages='expanded'."
            )

    @property
    def global_step(self) -> int | None:
        """The training step the next steps belong to (set by ``OOMBSparseBudget`` from the trainer's, which a
        resume restores), from which the selection-recall probe draws its blocks; ``None``: the engine counts its
        own training steps."""
        return self._global_step

    @global_step.setter
    def global_step(self, step: int | None) -> None:
        if step != self._global_step:
            self._global_step, self._steps = step, 0

    def _probe_seed(self, training: bool) -> int:
        """The seed of a sparse step's probe draws: its training step's (and micro-batch's) number, counted by
        training steps only (an evaluation uses the next one's without advancing)."""
        if training:
            self._steps += 1
        if self._global_step is None:
            return self._steps
        return self._global_step * 2**16 + self._steps

    @property
    def page_budget(self) -> int | None:
        """Past pages each query block attends to in the next steps (``None``: dense)."""
        return self._page_budget

    @page_budget.setter
    def page_budget(self, budget: int | None) -> None:
        check_budget(budget)
        if budget is not None and self._page_budget is None and getattr(self.model, "num_layers", 1) == 0:
            warnings.warn(
                f"page_budget={budget} has no effect: the model has no attention layers (its layers carry "
                "recurrent or convolution states only), so no page is selected — drop page_budget (and "
                "OOMBSparseBudget).",
                UserWarning,
                stacklevel=2,
            )
        self._page_budget = budget

    # ------------------------------------------------------------------------------------------ public API
    def loss(
        self,
        input_ids: torch.Tensor,
        labels: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        num_items_in_batch: int | float | torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Differentiable mean next-token loss of ``input_ids [B, N]`` (``labels`` default to ``input_ids``; packed
        documents by ``position_ids`` that restart, right padding by ``attention_mask``: see
        :mod:`lightning_oomb.engine.batch`). ``num_items_in_batch`` (as transformers' loss takes it): divide the
        summed token losses by this count instead of the batch's target tokens — e.g. the target tokens of every
        micro-batch of an accumulated step, so that each token weighs alike (a model's router loss is unaffected).

        One step at a time: the pool holds this step's pages until its backward sweep, so call ``backward`` on
        the result before the next ``loss`` or :meth:`evaluate` (refused otherwise, before any work: the earlier
        step's gradients would be silently wrong), and only once. Under ``torch.inference_mode`` (refused) use
        :meth:`evaluate`.
        """
        if torch.is_inference_mode_enabled():
            raise OOMBConfigError(
                "engine.loss under torch.inference_mode: it returns a differentiable loss whose backward sweep "
                "recomputes every chunk, which inference mode forbids — use engine.evaluate(...) for a loss without "
                "gradients (it runs under inference_mode), or call engine.loss outside inference mode to train."
            )
        self._check_nothing_pending("engine.loss")
        self.user_hooks.check(self.model, self._parameters(), training=True)
        with self.reporting():
            step = self._plan(
                input_ids, labels, position_ids, attention_mask, num_items_in_batch, training=True
            )
            kept = self.config.reused_chunks(len(step.bounds)) if torch.is_grad_enabled() else 0
            step.reused_from = len(step.bounds) - kept if kept else None
            weight = self.model.lm_head().weight
            anchor = weight.new_zeros((), dtype=torch.float32).requires_grad_(True)
            loss = _ChunkRecurrentStep.apply(anchor, self, step)
        if loss.requires_grad:
            self._pending = weakref.ref(loss.grad_fn)  # (the _ChunkRecurrentStep node: it holds the step)
        return loss

    def evaluate(
        self,
        input_ids: torch.Tensor,
        labels: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        num_items_in_batch: int | float | torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Mean next-token loss by the forward sweep alone (no gradient state kept); arguments as :meth:`loss`.

        Works under ``torch.inference_mode`` (Lightning's evaluation loop): the pool is kept out of inference
        mode so that the next training step can keep writing into it.
        """
        self._check_nothing_pending("engine.evaluate")
        self.user_hooks.check(self.model, (), training=False)
        with self.reporting():
            step = self._plan(input_ids, labels, position_ids, attention_mask, num_items_in_batch)
            with torch.inference_mode(False), torch.no_grad():  # leaving inference mode re-enables grad
                loss, _ = self.forward_sweep(step, sweep="eval")
        return loss

    def _check_nothing_pending(self, call: str) -> None:
        """Refuse a new sweep while an earlier step's loss (still alive) waits for its backward sweep."""
        node = None if self._pending is None else self._pending()
        if node is not None and node.step is not None:
            raise OOMBConfigError(
                f"{call} while an earlier step's loss still waits for its backward: the pool holds one step's "
                "pages until its backward sweep, so this sweep would overwrite them and that loss's gradients "
                "would be wrong — call backward on each loss before the next step (gradients accumulate in .grad "
                "as usual), put the sequences in one batch, or delete a loss you will not back-propagate."
            )

    def release(self) -> None:
        """Free the pool, pinned host memory included (after an exception or at teardown); the next step
        reallocates it."""
        self.pool.release()
        self.results.free()

    def abandon(self) -> None:
        """Give up the step whose loss waits for its backward sweep (what called :meth:`loss` failed after it, e.g.
        on the logits' stand-in, before any backward): free the pool and everything the step keeps — its carried
        states, selections, inputs — so that nothing of it outlives the failure (a traceback kept by a notebook or a
        test still holds the loss); a backward of that loss is refused. Without a pending step: :meth:`release`."""
        node = None if self._pending is None else self._pending()
        self._pending = None
        if node is not None and node.step is not None:
            node.step = node.rng = node.versions = None
            node.abandoned = True
        self.release()

    def reporting(self):
        """Context parallelism: a failure names the rank it started on (:meth:`ContextGroup.reporting`; the
        strategy's own collectives, e.g. the gradients' all-reduce across data replicas, run under it too)."""
        return self.context.reporting() if self.context is not None else contextlib.nullcontext()

    @contextlib.contextmanager
    def _sweep(self, kind: str, step: _Step):
        """Bracket a sweep for the pool; an exception frees the pool, so the next step starts clean."""
        sparse = step.sparse if step.layout is None else None
        selected = (
            None if sparse is None else sparse.blocks_of(step.shape.block_pages, self.config.chunk_size)
        )
        self.pool.begin_sweep(kind, selected, step.reused_from if kind == "backward" else None)
        try:
            yield
        except BaseException:
            self.release()
            raise
        self.pool.end_sweep()

    # -------------------------------------------------------------------------------------------- internals
    def check_device(self, device: torch.device) -> str:
        """The attention backend for ``device``; refuses (before any work) a backend or page size that cannot run
        there."""
        backend = resolve_backend(self.config.attention_backend, device)
        check_kernel_shapes(backend, self.config.page_size)
        return backend

    def _plan(
        self,
        input_ids,
        labels,
        position_ids=None,
        attention_mask=None,
        num_items=None,
        training: bool = False,
    ) -> _Step:
        """Validate the inputs and cut the step into chunks, before any work (under context parallelism, first
        check that every rank of the group has the same batch); ``num_items``: the loss's divisor, if not the
        batch's target count; ``training``: a training step's."""
        if self.context is not None:
            self.context.check_same(fingerprint(input_ids, labels, position_ids, attention_mask), "batch")
        if input_ids.dim() != 2 or input_ids.dtype not in (torch.int32, torch.int64) or 0 in input_ids.shape:
            raise OOMBConfigError(
                f"input_ids must be a non-empty int64 (or int32) tensor [batch, tokens], got "
                f"{tuple(input_ids.shape)} {input_ids.dtype} — pass token ids, batched (convert others with .long())."
            )
        if labels is None:
            labels = input_ids
        elif labels.shape != input_ids.shape:
            raise OOMBConfigError(
                f"labels {tuple(labels.shape)} do not match input_ids {tuple(input_ids.shape)} — give one label per "
                "input token, unshifted (use -100 to ignore a position)."
            )
        elif labels.dtype not in (torch.int32, torch.int64):
            raise OOMBConfigError(
                f"labels are {labels.dtype} — the engine takes token ids as labels — pass int64 (or int32) labels "
                "(convert with .long(); use -100 to ignore a position)."
            )
        self._check_ranges(input_ids, labels)
        backend = self.check_device(input_ids.device)
        carried = getattr(self.model, "carries_states", False)
        padded = carried and pad_a_lone_last_token(
            self.config.chunk_size, input_ids, labels, position_ids, attention_mask
        )
        if padded:
            input_ids, labels, position_ids, attention_mask = padded
        batch_layout = plan_layout(input_ids, labels, position_ids, attention_mask)
        if padded:  # a full-sequence call's length-dependent RoPE reads the unpadded positions
            batch_layout.span -= 1
        targets = batch_layout.targets
        batch, seq_len = input_ids.shape
        cfg, model = self.config, self.model
        layout = self._layout(input_ids, labels, position_ids, attention_mask)
        sparse = None
        if self.page_budget is not None:
            seed = self._probe_seed(training)
            sparse = SparseStep(self.page_budget, cfg.page_score, probe=self.probe_recall, seed=seed)
        layers = model.num_layers
        calls = getattr(model, "layer_head_dims", None) or (model.head_dim,) * layers
        shape = PoolShape.for_layers(
            batch,
            seq_len if layout is None else layout.local_len,
            getattr(model, "layer_kv_heads", None) or (model.kv_heads,) * layers,
            tuple(stored_head_dim(backend, d) for d in calls),
            tuple(calls),
            cfg.page_size,
            getattr(model, "layer_windows", None),
            chunk_size=cfg.chunk_size if layout is None else cfg.chunk_size // layout.size,
            kv_grad_dtype=cfg.kv_grad_dtype,
            page_score=None if sparse is None or layout is not None else sparse.score,
            layer_sources=getattr(model, "layer_kv_sources", None),
            values_are_keys=getattr(model, "values_are_keys", False),
        )
        bounds = chunk_bounds(seq_len, cfg.chunk_size)
        denominator = (
            int((targets != IGNORE_INDEX).sum()) if num_items is None else _count(num_items, targets)
        )
        floors = key_floors(batch_layout.doc_start, [start for start, _ in bounds])
        if batch_layout.doc_start is not None and (why := getattr(model, "packing_refused", None)):
            raise OOMBConfigError(f"packed documents (position_ids that restart) with this model: {why}")
        new_step_loss = getattr(model, "new_step_loss", None)
        step_loss = new_step_loss() if new_step_loss is not None else None
        if step_loss is not None and layout is not None and not hasattr(step_loss, "reduce"):
            raise OOMBConfigError(
                f"the model's step loss {type(step_loss).__name__} has no reduce(sum_) — under context parallelism "
                "each rank collects its own tokens' share and the group must sum it — implement StepLoss.reduce."
            )
        shared = SharedSummaries(sparse.score) if sparse and layout else None
        states = None
        if carried:
            check_carried_states(bounds, layout, batch_layout.doc_start)
            host = self.host_states if self.config.offloads else None
            states = CarriedStates(host=host, boundaries=len(bounds) - 1, batch=batch)
        return _Step(input_ids, targets, denominator, shape, backend, bounds, batch_layout.positions,
                     batch_layout.doc_start, floors, step_loss, sparse, layout, shared, states,
                     batch_layout.tokens, position_span=batch_layout.span)  # fmt: skip

    def _layout(self, input_ids, labels, position_ids, attention_mask) -> Layout | None:
        """Context parallelism: this rank's slices of the step (``None`` on one device)."""
        group = self.context
        if group is None:
            return None
        seq_len = input_ids.shape[1]
        check_context(self.config, group.size, seq_len)
        return Layout.plan(
            chunk_bounds(seq_len, self.config.chunk_size), self.config.page_size, group.rank, group.size
        )

    def _check_ranges(self, input_ids: torch.Tensor, labels: torch.Tensor) -> None:
        """Token ids inside the embedding, labels inside the LM head's vocabulary or ``IGNORE_INDEX``."""
        tokens, vocab = self.model.num_embeddings, self.model.vocab_size
        bad_ids = input_ids[(input_ids < 0) | (input_ids >= tokens)]
        if bad_ids.numel():
            raise OOMBConfigError(
                f"input_ids contain {sorted(set(bad_ids[:8].tolist()))} outside the model's embedding [0, {tokens}) "
                "— the embedding lookup would fail — check that the tokenizer belongs to the model (or resize the "
                "token embeddings)."
            )
        bad = labels[(labels != IGNORE_INDEX) & ((labels < 0) | (labels >= vocab))]
        if bad.numel():
            raise OOMBConfigError(
                f"labels contain {sorted(set(bad[:8].tolist()))}: a label must be a token id in [0, {vocab}) or "
                f"{IGNORE_INDEX} (ignored) — other values would train on a wrong target — set the positions to "
                f"ignore to {IGNORE_INDEX}."
            )

    def _chunk_loss(
        self,
        step: _Step,
        index: int,
        sweep: str,
        grad_output=None,
        states: ChunkStates | None = None,
        sums: Float32GradSums | HostGradSums | None = None,
    ) -> torch.Tensor:
        """The chunk's loss; ``grad_output``: what the backward sweep will back-propagate into the step's loss (the
        cross-entropy then makes its gradients at once, at the scale autograd's division gives them, and adds the
        LM head's weight gradient in place into ``.grad`` or its float32 sum in ``sums``); ``states``: the chunk's
        carried states (:mod:`lightning_oomb.engine.states`)."""
        start, end = step.bounds[index]
        docs = None if step.doc_start is None else step.doc_start[:, start:end]
        chunk = ChunkContext(
            self.pool,
            step.shape,
            start,
            sweep,
            step.backend,
            step.step_loss,
            docs,
            step.floors[index],
            step.sparse,
            kept={} if sweep == "backward" else None,
            park_kept=sweep == "backward" and self.config.offloads and self._checkpointed(),
            states=states,
            results=self.results if sweep != "eval" and self.results.keeps(index) else None,
            index=index,
            chunks=len(step.bounds),
        )
        lo, hi = start, end
        targets = step.targets[:, lo:hi]
        # this rank's slice; a rank without one runs a stand-in token with no target
        if step.layout is not None:
            whole = None if step.tokens is None else step.tokens[:, start:end]
            chunk.context = ContextChunk(self.context, step.layout, index, step.summaries, whole)
            lo, hi = step.layout.mine(index)
            targets = (
                step.targets[:, lo:hi] if hi > lo else torch.full_like(step.targets[:, :1], IGNORE_INDEX)
            )
            lo, hi = (lo, hi) if hi > lo else (start, start + 1)
        chunk.tokens = None if step.tokens is None else step.tokens[:, lo:hi]
        hidden = self.model.hidden_states(step.input_ids[:, lo:hi], step.positions[:, lo:hi], chunk)
        if index == 0 and sweep != "backward":
            self.layers_called = frozenset(chunk.written)
        denominator = step.denominator or 1  # (a batch without targets: loss 0)
        # the gradient autograd will hand the cross-entropy: the division's backward, the same op
        expected = None if grad_output is None else grad_output / denominator
        head = self.model.lm_head()
        # a gradient hook on the head's weight (the embedding's, when tied) must see the head's gradient: then the
        # cross-entropy hands it to autograd instead of adding it in place
        into = (
            None
            if expected is None or gradient_hooks(head.weight)
            else gradient_accumulator(head.weight, sums)
        )
        total = linear_cross_entropy(hidden, head, targets, self.config.loss_block, expected, into)
        loss = total / denominator
        if step.step_loss is not None and sweep == "backward":
            loss = loss + step.step_loss.chunk_term()
        return loss

    def forward_sweep(self, step: _Step, sweep: str = "forward") -> tuple[torch.Tensor, list[RNGState]]:
        """Run every chunk without a graph; return the summed loss and each chunk's RNG state."""
        device = step.input_ids.device
        rng, losses = [], []
        carried = step.states
        if carried is not None:
            carried.keep = sweep != "eval"
        kept = step.reused_from if sweep == "forward" else None
        dims = tuple(map(step.shape.head_dim_of, range(step.shape.num_layers)))
        self.results.begin(kept, max(map(step.rows, range(len(step.bounds)))), dims)
        with self._sweep(sweep, step), self.model.engaged(step.position_span), self._own_stream(device):
            for index in range(len(step.bounds)):
                rng.append(RNGState(device))
                states = None if carried is None else carried.forward_chunk(index)
                losses.append(self._chunk_loss(step, index, sweep, states=states))
                if carried is not None and index + 1 < len(step.bounds):
                    carried.finish_forward(index, states)
        self._record(step)
        loss = torch.stack(losses).sum()
        # every rank returns the group's loss; each back-propagates its own chunks
        if self.context is not None:
            loss = self.context.sum_(loss.clone())
        if step.step_loss is not None and self.context is not None:  # each rank has its own tokens' share
            step.step_loss.reduce(self.context.sum_)
        if step.step_loss is not None:  # a term coupling all tokens: its value is known once every chunk ran
            loss = loss + step.step_loss.value().to(loss.dtype)
        return loss, rng

    @contextlib.contextmanager
    def _own_stream(self, device: torch.device) -> Iterator[None]:
        """Under context parallelism, each rank's chunk slices draw their dropout masks from a stream of its own
        (seeded from the shared stream, which every rank advances alike and gets back after the sweep): with the
        shared one, token ``i`` of every rank's slice had the same mask. The chunks' recorded states replay it."""
        if self.context is None or self.context.size == 1:
            yield
            return
        seed = int(torch.randint(0, 2**62, (1,)))
        with torch.random.fork_rng(
            devices=[device] if device.type == "cuda" else [], device_type=device.type
        ):
            torch.default_generator.manual_seed(seed + self.context.rank)
            if device.type == "cuda":
                torch.cuda.manual_seed(seed + self.context.rank)
            yield

    def backward_sweep(self, step: _Step, rng: list[RNGState], autocast: AutocastState, grad_output) -> None:
        """Recompute chunks in reverse with grad and back-propagate each at once (16-bit parameters' gradients
        summed in float32 unless ``grad_accumulation="native"``: :mod:`lightning_oomb.engine.grads`)."""
        device = step.input_ids.device
        devices = [device] if device.type == "cuda" else []
        fork = torch.random.fork_rng(devices=devices, device_type=device.type)
        params = self._parameters()
        accumulating, cleared = earlier_sums(half_trainable(params))
        mode = self.config.grad_summing(len(step.bounds), accumulating)
        sums = (
            None
            if mode == "native"
            else self.host_grads.sweep(params)
            if mode == "float32-host"
            else Float32GradSums(params)
        )
        engaged = self.model.engaged(step.position_span)
        parked = parking.parked_bytes(device)
        with (
            self.reporting(),
            fork,
            sums or contextlib.nullcontext(),
            self._sweep("backward", step),
            engaged,
        ):
            carried = step.states
            # every parameter trains: then each carried state depends on trainable ones and must carry grad (as
            # must one of a chunk that read an incoming state with grad: CarriedStates.boundary_gradients)
            all_trainable = bool(params) and all(p.requires_grad for p in params)
            for index in reversed(range(len(step.bounds))):
                rng[index].restore()
                if self.results.keeps(index):  # its forward results start back to the device now
                    self.results.fetch(index, step.rows(index), device)
                with torch.enable_grad(), autocast(), self._parked_saves(device):
                    states = None if carried is None else carried.backward_chunk(index)
                    loss = self._chunk_loss(step, index, "backward", grad_output, states, sums)
                # with carried states, their gradients from the next chunk flow in with the loss's
                boundary, grads = (
                    ([], []) if carried is None else carried.boundary_gradients(states, all_trainable)
                )
                torch.autograd.backward([loss, *boundary], [grad_output, *grads])
                if carried is not None:
                    carried.finish_backward(states)
                loss = states = boundary = grads = None  # (the next chunk's recompute runs without them)
                if sums is not None:
                    sums.chunk_done(more=index > 0)
        restore_zeros(cleared)
        self.stats.extra.update(self.pool.stats(), parked_bytes=parking.parked_bytes(device) - parked)

    def input_versions(self, step: _Step) -> dict[str, object]:
        """What the backward sweep recomputes from, by name: the in-place version counters of the parameters, token
        ids, positions and padding mask (an inference tensor has none, and cannot be edited outside inference mode),
        the model's train / eval mode (dropout) and, from a model that has the optional ``adapter_state()``, what
        switches its adapters (peft's ``disable_adapter()``, ``set_adapter``: the HF adapter's)."""
        tensors = {
            "a parameter": self._parameters(),
            "input_ids": [step.input_ids],
            "position_ids": [step.positions],
            "attention_mask": [] if step.tokens is None else [step.tokens],
        }
        versions = {
            name: tuple(None if t.is_inference() else t._version for t in group)
            for name, group in tensors.items()
        }
        adapter_state = getattr(self.model, "adapter_state", None)
        return versions | {
            "mode": getattr(self.model, "training", None),
            "adapters": adapter_state() if callable(adapter_state) else None,
        }

    def check_unchanged(self, step: _Step, versions: dict[str, object], sweep: str) -> None:
        """Refuse a step whose weights, ids or mode changed since its forward sweep began (as autograd refuses a
        modified saved tensor): the backward sweep's recompute would not be the loss's computation. ``sweep``: the
        one that just ran: ``"forward"`` (the model itself changed them), or ``"backward"`` (about to run: changed
        between the sweeps)."""
        now = self.input_versions(step)
        when = (
            "while engine.loss ran the model's forward sweep (the model itself did it, in hidden_states or "
            "lm_head)"
            if sweep == "forward"
            else "between engine.loss and its backward (by the caller, e.g. optimizer.step() or an edit of the "
            "batch before loss.backward(), or by a call of the model in between)"
        )
        if now["mode"] != versions["mode"]:
            before, after = ("train" if mode else "eval" for mode in (versions["mode"], now["mode"]))
            raise RuntimeError(
                f"the model went from {before} to {after} mode {when}: the backward sweep recomputes every chunk, "
                "with dropout as the mode says, so its gradients would not be this loss's — switch the mode before "
                "engine.loss or after its backward."
            )
        if now["adapters"] != versions["adapters"]:
            raise RuntimeError(
                f"the model's adapters were switched (e.g. peft's disable_adapter() or set_adapter) {when}: the "
                "backward sweep recomputes every chunk with the adapters as they are now, so its gradients would "
                "not be this loss's (a loss computed under `with model.disable_adapter():` has no gradient at all: "
                "under strategy='auto' its backward fails) — switch adapters outside the training step, and "
                "back-propagate a loss computed with the adapters that train."
            )
        changed = [
            name for name in versions if name not in ("mode", "adapters") and now[name] != versions[name]
        ]
        if changed:
            fix = (
                "use out-of-place ops on the model's inputs and parameters (e.g. input_ids = input_ids.clamp(...), "
                "not input_ids.clamp_(...))"
                if sweep == "forward"
                else "call backward before changing the weights or the batch"
            )
            what = f"{' and '.join(changed)} {'was' if len(changed) == 1 else 'were'}"
            raise RuntimeError(
                f"{what} modified in place {when}: the backward sweep recomputes every chunk from them as they are "
                f"now, so its gradients would not be this loss's — {fix}."
            )

    def _parked_saves(self, device: torch.device):
        """Where a chunk recompute's saved activations wait: under offload with layer checkpointing on a CUDA
        device in host memory (:class:`~lightning_oomb.engine.parking.ParkedSaves`), else where autograd keeps
        them."""
        if self.config.offloads and self._checkpointed() and device.type in parking.DEVICE_TYPES:
            return parking.ParkedSaves(device)
        return contextlib.nullcontext()

    def _checkpointed(self) -> bool:
        """Whether the model checkpoints its layers (then kept attention results wait for the checkpoint)."""
        return bool(getattr(self.model, "layer_checkpointing", False))

    def _parameters(self) -> list[torch.Tensor]:
        """The model's parameters (``parameters()``, an ``nn.Module``'s own; none for a model without it)."""
        parameters = getattr(self.model, "parameters", None)
        return list(parameters()) if callable(parameters) else []

    def _record(self, step: _Step) -> None:
        shape = self.pool.shape
        self.stats = StepStats(
            tokens=step.input_ids.numel(),
            chunks=len(step.bounds),
            pool_bytes=self.pool.allocated_bytes,
            kv_bytes=shape.kv_bytes if shape else 0,
            grad_bytes=shape.grad_bytes if shape else 0,
            extra=self.pool.stats()
            | {"parked_bytes": 0}
            | ({"reused_attention_bytes": self.results.nbytes} if step.reused_from is not None else {})
            | (
                {}
                if step.states is None
                else {
                    "carried_state_bytes": step.states.nbytes,
                    "carried_state_host_bytes": step.states.host_nbytes,
                }
            ),
            sparse=None if step.sparse is None else step.sparse.stats(),
        )


def chunk_bounds(seq_len: int, chunk_size: int) -> list[tuple[int, int]]:
    """The step's chunks: ``[start, end)`` token ranges of ``chunk_size`` (the last one ragged)."""
    return [(a, min(a + chunk_size, seq_len)) for a in range(0, seq_len, chunk_size)]


def refuse_split_states() -> None:
    """A model with carried states cannot run under context parallelism (refused when the engine is built)."""
    raise OOMBConfigError(
        "the model has recurrent / convolution layers whose state runs through each chunk token by token, so "
        "a chunk cannot be split across a context group — train it with strategy='oomb', or with "
        "context_parallel_size=1 (data parallelism only)."
    )


def check_carried_states(bounds: list[tuple[int, int]], layout: Layout | None, doc_start) -> None:
    """Refuse, before any work, what a model with carried states cannot chunk exactly."""
    if layout is not None:
        refuse_split_states()
    if doc_start is not None:
        raise OOMBConfigError(
            "packed documents (position_ids that restart) with a model whose recurrent / convolution layers carry "
            "a state: the state would run across document boundaries (the model resets it only through "
            "flash-attention's varlen keywords) — pad the documents to a common length instead of packing them."
        )
    # a last chunk of one token after others: chunk_size 1 (a lone last token of longer chunks is padded)
    if len(bounds) > 1 and bounds[-1][1] - bounds[-1][0] == 1:
        raise OOMBConfigError(
            "chunks of one token with a model whose recurrent layers take a single token with a state as a "
            "decoding step (an in-place update, not differentiable) — use chunk_size >= 2."
        )


def _count(num_items, targets: torch.Tensor) -> int | float:
    """``num_items_in_batch`` as a positive number (a tensor is read once) — or 0 for a batch whose ``targets`` are
    all ignored (transformers' count for a window with none: its loss is 0 here, as without the count)."""
    value = num_items.item() if isinstance(num_items, torch.Tensor) and num_items.numel() == 1 else num_items
    number = not isinstance(value, bool) and isinstance(value, int | float)
    none = number and value == 0 and not bool((targets != IGNORE_INDEX).any())  # read only for a count of 0
    if not number or not (0 < value < float("inf") or none):
        raise OOMBConfigError(
            f"num_items_in_batch={num_items!r} is not a positive count — it divides the summed token losses "
            "(transformers' convention) — pass the number of target tokens the loss is averaged over, or None for "
            "this batch's."
        )
    return value


class _ChunkRecurrentStep(torch.autograd.Function):
    """forward = forward sweep, backward = backward sweep (see the module docstring)."""

    @staticmethod
    def forward(ctx, anchor, engine: OOMBEngine, step: _Step):
        ctx.engine, ctx.step = engine, step
        ctx.autocast = AutocastState(step.input_ids.device)
        ctx.versions = engine.input_versions(step)
        loss, ctx.rng = engine.forward_sweep(step)
        engine.check_unchanged(step, ctx.versions, "forward")
        return loss

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_output):
        if getattr(ctx, "abandoned", False):
            raise RuntimeError(
                "the loss of an engine.loss call whose step was abandoned (engine.abandon: what called it failed "
                "after its forward sweep, and its pages and states were freed) was back-propagated — there is "
                "nothing left to recompute from — call the model again for a new loss."
            )
        if ctx.step is None:
            raise RuntimeError(
                "the loss of one engine.loss call was back-propagated a second time (e.g. "
                "backward(retain_graph=True), then backward again): its backward sweep already ran and freed the "
                "step's pages and carried states, so there is nothing left to recompute from — call backward once "
                "per engine.loss (add up the terms computed from one loss and back-propagate their sum); to "
                "accumulate gradients, call engine.loss again for each micro-batch and back-propagate each loss "
                "once (.grad adds up)."
            )
        try:
            ctx.engine.check_unchanged(ctx.step, ctx.versions, "backward")
            ctx.engine.backward_sweep(ctx.step, ctx.rng, ctx.autocast, grad_output)
        finally:  # done, or failed (the pool is released): either way no longer pending
            ctx.step = ctx.rng = ctx.engine._pending = None
        return None, None, None
