"""Callbacks for the OOMB strategies (optional observers; the strategy does all mandatory work)."""

from __future__ import annotations

import math
import numbers
import time
from typing import Any

import torch
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities import rank_zero_warn
from typing_extensions import override

from lightning_oomb.engine.errors import OOMBConfigError
from lightning_oomb.engine.sparse import check_budget

# what OOMBMonitor shows in the progress bar as well (the rest goes to the loggers only)
PROGRESS_BAR = ("oomb/tokens_per_s", "oomb/pool_bytes")
# OOMBSparseBudget checks a callable schedule's budget at this many first steps (~0.1 s)
CHECKED_STEPS = 100_000


class OOMBMonitor(Callback):
    """Log what each OOMB step did: tokens/s, KV-pool bytes and the engine's offload counters.

    Logged per optimizer step under ``oomb/``: ``tokens_per_s`` (every position of the batch, right padding
    included, as HF Trainer's ``num_input_tokens_seen`` by default), ``pool_bytes`` (arenas held), ``kv_bytes`` and
    ``grad_bytes`` (what the step needed), every numeric entry of ``engine.stats.extra`` (offload: bytes moved each
    way, time the compute stream waited on copies, HBM/host pool bytes, ``hosted_tail_layers``: the window layers
    whose tails wait in host memory), and on CUDA ``peak_device_bytes``.
    ``tokens_per_s`` and ``pool_bytes`` are shown in the progress bar too. Under ``oomb_cp`` the byte counts are
    rank 0's (its share of the group's pages; Lightning's loggers write rank 0's values), ``tokens_per_s`` the
    group's step.
    """

    @override
    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        if getattr(trainer.strategy, "engine", None) is None and not hasattr(trainer.strategy, "oomb_config"):
            raise OOMBConfigError(
                f"OOMBMonitor observes the OOMB engine but the strategy is {type(trainer.strategy).__name__} — "
                "there is nothing to monitor — use Trainer(strategy='oomb') or drop the callback."
            )

    @override
    def on_train_batch_start(self, trainer: Trainer, *_: Any) -> None:
        if trainer.strategy.root_device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(trainer.strategy.root_device)
        self._start = time.perf_counter()

    @override
    def on_train_batch_end(self, trainer: Trainer, pl_module: LightningModule, outputs: Any, *_: Any) -> None:
        if outputs is None:  # a skipped batch (training_step returned None): no step to report
            return
        device = trainer.strategy.root_device
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        stats = trainer.strategy.engine.stats
        metrics = {
            "tokens_per_s": stats.tokens / max(time.perf_counter() - self._start, 1e-9),
            "pool_bytes": stats.pool_bytes,
            "kv_bytes": stats.kv_bytes,
            "grad_bytes": stats.grad_bytes,
        }
        metrics.update({k: v for k, v in stats.extra.items() if isinstance(v, (int, float))})
        if device.type == "cuda":
            metrics["peak_device_bytes"] = torch.cuda.max_memory_allocated(device)
        logged = {f"oomb/{k}": float(v) for k, v in metrics.items()}
        shown = {k: logged.pop(k) for k in PROGRESS_BAR}
        pl_module.log_dict(shown, on_step=True, on_epoch=False, prog_bar=True)
        pl_module.log_dict(logged, on_step=True, on_epoch=False)


class OOMBOffload(OOMBMonitor):
    """Log what the offload streams of the OOMB strategy move (an observer: offload is configured on the strategy,
    ``OOMBStrategy(offload=True, staging_buffers=..., prefetch_depth=...)`` or ``strategy="oomb_offload"``).

    Logs everything :class:`OOMBMonitor` logs, in particular per step ``oomb/h2d_bytes``, ``oomb/d2h_bytes``,
    ``oomb/copy_wait_s`` (time the compute stream waited on copies), ``oomb/prefetch_copies``,
    ``oomb/demand_copies`` (copies a prefetch did not foresee), ``oomb/copy_runs`` (tensor copies issued, one per
    run of consecutive pages), ``oomb/parked_bytes`` (with layer checkpointing:
    what the backward sweep's chunk recomputes parked in host memory, each byte copied out and back once),
    ``oomb/hbm_pool_bytes``, ``oomb/staging_bytes``, ``oomb/host_pool_bytes`` (the host tier and the window layers'
    tails in host memory) and ``oomb/hosted_tail_layers`` (window layers whose tails wait there: each tail group's
    K/V crosses once each way, counted in ``h2d_bytes`` / ``d2h_bytes``); use it instead of the monitor.
    Refuses a run whose strategy does not offload (``offload=False``); with ``"auto"`` its memory plan decides, and
    a plan that keeps every page on the device (they fit) is warned about once (the offload counters stay 0).
    """

    _warned = False

    @override
    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        super().setup(trainer, pl_module, stage)
        if trainer.strategy.oomb_config.offload is False:
            name = type(trainer.strategy).__name__
            raise OOMBConfigError(
                f"OOMBOffload logs offload traffic but the strategy keeps every page on the device (offload=False) — "
                f"turn it on with {name}(offload=True) (YAML: strategy.init_args.offload: true; strategy='oomb_offload' "
                "on one device), or log with OOMBMonitor instead."
            )
        if any(type(c) is OOMBMonitor for c in trainer.callbacks):
            raise OOMBConfigError(
                "OOMBOffload already logs everything OOMBMonitor logs — keep only OOMBOffload in callbacks."
            )

    @override
    def on_train_batch_end(self, trainer: Trainer, pl_module: LightningModule, outputs: Any, *_: Any) -> None:
        super().on_train_batch_end(trainer, pl_module, outputs, *_)
        # offload="auto", decided off by the plan
        if not self._warned and trainer.strategy.engine.config.offload is False:
            self._warned = True
            rank_zero_warn(
                "OOMBOffload: the memory plan keeps every page on the device (offload='auto': the pages fit), so "
                "nothing is offloaded and its offload counters stay 0 — set offload=True to offload anyway."
            )


class OOMBSparseBudget(Callback):
    """Steer sparse attention's page budget during training and log what the selection keeps.

    Args:
        schedule: the page budget per global step: a dict ``{step: budget}`` (each budget holds from its step on;
            before the first key the strategy's ``page_budget``) or a callable ``step -> budget`` (a number it
            returns is rounded to the nearest page count, so a float ramp works; with ``max_steps`` set, ``fit``
            checks its budget at every step — the first 100,000 — before training); a budget is a positive number
            of past pages per query block or ``None`` (dense). ``{0: None, 1000: 64}`` starts dense and goes
            sparse; ``lambda step: max(8, 256 - step)`` ramps down.
        recall_every: measure ``oomb/selection_recall`` every this many steps (``0``: never). The probe attends one
            query block per sparse layer call a second time, densely: a few percent of a step's attention work.

    Logs per step: ``oomb/page_budget`` (0 when dense), ``oomb/attended_fraction`` (pages attended / pages visible,
    over every layer, chunk, row and query block; 1.0 when dense) and, on the measured steps only,
    ``oomb/selection_recall``: the mean share, over the probed query blocks' real rows (not right padding) and
    heads, of their dense attention mass that falls on the keys they attend (the selected pages and the chunk's own
    pages; 1.0 when every page is attended: a dense step or a budget that covers them all; under offload measured
    on the layers whose pages are on the GPU — a host layer's call stages only its selected pages — and not logged
    when every layer is on the host). The recall goes straight to the loggers, as
    ``LearningRateMonitor`` logs (at the step's index, whatever ``log_every_n_steps``; CSV: a row of its own): a
    value given to ``self.log`` would be repeated on every later row of the epoch. So loggers show it only on the
    steps that measured it; it is not in the progress bar or ``trainer.callback_metrics``.
    """

    def __init__(self, schedule, recall_every: int = 50) -> None:
        if isinstance(schedule, dict):
            for step in schedule:
                if isinstance(step, bool) or not isinstance(step, numbers.Integral) or step < 0:
                    raise OOMBConfigError(
                        f"OOMBSparseBudget schedule key {step!r} is not a global step — use non-negative ints, "
                        "e.g. {0: None, 1000: 64}."
                    )
            schedule = {int(step): _page_count(budget, "schedule maps step " + str(step) + " to {}", DICT_FIX)
                        for step, budget in schedule.items()}  # fmt: skip
        elif not callable(schedule):
            raise OOMBConfigError(
                f"OOMBSparseBudget schedule {schedule!r} must be a dict {{step: budget}} or a callable step -> "
                "budget."
            )
        if isinstance(recall_every, bool) or not isinstance(recall_every, int) or recall_every < 0:
            raise OOMBConfigError(f"recall_every={recall_every!r} must be a non-negative int (0: never).")
        self.schedule, self.recall_every = schedule, recall_every
        self._initial: int | None = None

    def budget_at(self, step: int) -> int | None:
        """The budget of global step ``step``."""
        if callable(self.schedule):
            return _page_count(self.schedule(step), "schedule gave {} at global step " + str(step), RAMP_FIX)
        started = [s for s in self.schedule if s <= step]
        return self.schedule[max(started)] if started else self._initial

    @override
    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        config = getattr(trainer.strategy, "oomb_config", None)
        if config is None:
            raise OOMBConfigError(
                f"OOMBSparseBudget steers the OOMB engine's sparse attention but the strategy is "
                f"{type(trainer.strategy).__name__} — use Trainer(strategy='oomb') or drop the callback."
            )
        count = sum(isinstance(c, OOMBSparseBudget) for c in trainer.callbacks)
        if count > 1:
            raise OOMBConfigError(
                f"callbacks hold {count} OOMBSparseBudget — each sets the page budget at every step, so only the "
                "last one's schedule would hold — keep one (YAML: a `--trainer.callbacks+=` may have added another)."
            )
        self._initial = config.page_budget
        self._loaded_step: int | None = None  # the global step of a checkpoint this run loads
        # a ramp going bad at step 700 is refused now, not then; the strategy's memory plan (after this setup)
        # checks that the schedule's dense steps and its widest sparse ones fit too
        steps = trainer.max_steps if stage == "fit" else 0
        trainer.strategy.scheduled_budgets = self.budgets(config.page_budget, steps)

    def budgets(self, initial: int | None, max_steps: int) -> frozenset[int | None] | None:
        """The budgets the schedule sets in a run of ``max_steps`` steps whose strategy's budget is ``initial``: a
        dict's values (and ``initial``, before its first key); a callable's over its steps (the first
        :data:`CHECKED_STEPS`; each checked); ``None`` for a callable without ``max_steps`` (not known)."""
        if not callable(self.schedule):
            return frozenset({initial, *self.schedule.values()})
        if max_steps <= 0:
            return None
        return frozenset(self.budget_at(step) for step in range(min(max_steps, CHECKED_STEPS)))

    @override
    def on_load_checkpoint(
        self, trainer: Trainer, pl_module: LightningModule, checkpoint: dict[str, Any]
    ) -> None:
        self._loaded_step = checkpoint.get("global_step")

    @override
    def on_train_batch_start(self, trainer: Trainer, *_: Any) -> None:
        engine, step = trainer.strategy.engine, trainer.global_step
        engine.global_step = step  # the recall probe's draws follow the step (a resume restores it)
        engine.page_budget = self.budget_at(step)
        engine.probe_recall = bool(self.recall_every) and step % self.recall_every == 0

    @override
    def on_validation_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._evaluate_at_trained_budget(trainer)

    @override
    def on_test_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._evaluate_at_trained_budget(trainer)

    def _evaluate_at_trained_budget(self, trainer: Trainer) -> None:
        """Validation and test attend with the budget of the last step trained (step 0's before any), inside
        ``fit`` as in a later ``trainer.validate`` / ``test`` (whose engine starts at the strategy's budget) — of
        the checkpoint's steps when they load one (``ckpt_path``: Lightning restores the trainer's step only to fit);
        no recall probe."""
        engine = trainer.strategy.engine
        fitting = trainer.state.fn == TrainerFn.FITTING
        steps = trainer.global_step if fitting or self._loaded_step is None else self._loaded_step
        engine.page_budget = self.budget_at(max(steps - 1, 0))
        engine.probe_recall = False

    @override
    def on_train_batch_end(self, trainer: Trainer, pl_module: LightningModule, outputs: Any, *_: Any) -> None:
        if outputs is None:  # a skipped batch (training_step returned None): the stats are the last step's
            return
        engine = trainer.strategy.engine
        sparse = engine.stats.sparse
        metrics = {"oomb/page_budget": 0.0, "oomb/attended_fraction": 1.0}
        recall = 1.0 if engine.probe_recall else None  # a dense step attends everything
        if sparse is not None:
            metrics = {
                "oomb/page_budget": float(sparse.page_budget),
                "oomb/attended_fraction": sparse.attended_fraction,
            }
            recall = sparse.selection_recall
        pl_module.log_dict(metrics, on_step=True, on_epoch=False)
        # only on the row of the optimizer step, with its last micro-batch's value (as self.log's rows)
        if recall is None or (
            trainer.fit_loop.epoch_loop._should_accumulate() and pl_module.automatic_optimization
        ):
            return
        step = trainer.fit_loop.epoch_loop._batches_that_stepped  # the row self.log writes this step to
        for logger in trainer.loggers:
            logger.log_metrics({"oomb/selection_recall": float(recall)}, step=step)


# the fix a refused budget's message names: a dict's (YAML's), a callable's
DICT_FIX = "Map each step to null/None (dense) or a finite page count of 1 or more, e.g. {0: null, 1000: 64}."
RAMP_FIX = "A ramp: keep it finite and at 1 or more, e.g. lambda step: max(1, ...)."


def _page_count(budget, where: str, fix: str) -> int | None:
    """A schedule's budget as a page count: ``None`` (dense), or a number rounded to the nearest page count (a
    ramp's float, a NumPy integer) that must be 1 or more; anything else is refused, saying ``where`` (its ``{}``:
    the value) it came from and ``fix``."""
    given = budget
    if isinstance(budget, numbers.Real) and not isinstance(budget, bool):
        budget = round(budget) if math.isfinite(budget) else budget
    try:
        check_budget(budget)
    except OOMBConfigError as err:
        raise OOMBConfigError(f"OOMBSparseBudget's {where.format(repr(given))} — {err} {fix}") from None
    return budget
