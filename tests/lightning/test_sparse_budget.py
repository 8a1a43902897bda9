"""Sparse attention from Lightning: the strategy option and the OOMBSparseBudget callback (schedule, metrics)."""

from __future__ import annotations

import pytest

from lightning_oomb import OOMBConfig, OOMBConfigError, OOMBStrategy
from lightning_oomb.callbacks import OOMBSparseBudget
from lightning_oomb.engine import OOMBOutOfMemoryError
from lightning_oomb.engine.config import STRATEGY_DEFAULTS
from tests.helpers.lightning import TinyLM, batches, make_trainer, oomb
from tests.helpers.lightning import fit as fit_tiny
from tests.lightning.test_callbacks import Recorder


def fit(strategy, callbacks, steps=3, with_recalls=False, **kwargs):
    """The trainer and the rows with the step's budget (and ``{step: logged recall}``)."""
    logger = Recorder()
    _, trainer = fit_tiny(
        strategy, steps=steps, logger=logger, log_every_n_steps=1, callbacks=callbacks, **kwargs
    )
    rows = [r for r in logger.rows if "oomb/page_budget" in r]
    if not with_recalls:
        return trainer, rows
    assert [s for s, r in zip(logger.steps, logger.rows) if "oomb/page_budget" in r] == list(range(steps))
    recalls = {
        s: r["oomb/selection_recall"]
        for s, r in zip(logger.steps, logger.rows)
        if "oomb/selection_recall" in r
    }
    return trainer, rows, recalls


def test_strategy_option_reaches_the_engine():
    assert OOMBStrategy(page_budget=64).oomb_config == OOMBConfig(page_budget=64, **STRATEGY_DEFAULTS)
    with pytest.raises(OOMBConfigError, match="page_budget=0"):
        OOMBStrategy(page_budget=0)
    trainer, _ = fit(oomb(page_budget=2), [], steps=1)
    assert trainer.strategy.engine.stats.sparse.page_budget == 2


def test_schedule_switches_budgets_and_logs_by_hand():
    """40-token rows, chunk 16, page 8 (chunks of 2, 2 and 1 query blocks; 2, 4 past pages before the last two).
    Step 0 dense; step 1 budget 1: attended (1 + 2) + (2 + 3) + 2 = 10 of visible 1 + 2 + 3 + 4 + 5 = 15 pages;
    step 2 budget 3: the second chunk is dense, the last block attends 3 + 1 of 5: 14 of 15."""
    trainer, rows, recalls = fit(
        oomb(), [OOMBSparseBudget({0: None, 1: 1, 2: 3}, recall_every=2)], with_recalls=True
    )
    assert [r["oomb/page_budget"] for r in rows] == [0.0, 1.0, 3.0]
    assert [r["oomb/attended_fraction"] for r in rows] == pytest.approx([1.0, 10 / 15, 14 / 15], rel=1e-6)
    # recall on steps 0 and 2; step 0 is dense: all the attention mass kept
    assert set(recalls) == {0, 2} and recalls[0] == 1.0
    assert 0.0 < recalls[2] <= 1.0
    assert trainer.strategy.engine.page_budget == 3


def test_validation_and_test_attend_with_the_last_trained_budget(tmp_path):
    """Inside fit, in a later ``trainer.validate`` / ``test`` (which rebuild the engine at the strategy's budget:
    they ran dense after a sparse schedule) and from a checkpoint: the budget of the last step trained, step 1's."""

    class Tested(TinyLM):
        test_step = TinyLM.validation_step

    callback = OOMBSparseBudget({0: None, 1: 1, 2: None}, recall_every=1)
    module, trainer = fit_tiny(oomb(), Tested(), steps=2, callbacks=[callback])
    for run in (trainer.validate, trainer.test):
        run(module, batches(n=2), verbose=False)
        engine = trainer.strategy.engine
        assert engine.page_budget == 1 and engine.stats.sparse.page_budget == 1 and not engine.probe_recall
    # a new Trainer validating a checkpoint (its step is not restored outside fit: it attended at step 0's budget)
    path = tmp_path / "two_steps.ckpt"
    trainer.save_checkpoint(path)
    fresh = make_trainer(oomb(), callbacks=[OOMBSparseBudget({0: None, 1: 1, 2: None})])
    fresh.validate(Tested(), batches(n=2), ckpt_path=path, verbose=False)
    assert fresh.global_step == 0 and fresh.strategy.engine.page_budget == 1


def test_recall_is_logged_only_on_the_steps_it_measures():
    """Steps 0-1 budget 1, 2-3 budget 9 (a row has 5 pages: all attended), 4 dense; recall on the even steps, one
    epoch. Lightning repeats a value given to self.log on every later row of the epoch: steps 1-4 showed step 0's
    recall, and steps 2 and 4 measured none (the budget covering every page had recall None)."""
    callback = OOMBSparseBudget({0: 1, 2: 9, 4: None}, recall_every=2)
    _, rows, recalls = fit(oomb(), [callback], 5, True, data=batches(n=10))
    assert not any("oomb/selection_recall" in r for r in rows)  # never on the rows of self.log
    assert set(recalls) == {0, 2, 4}
    assert 0.0 < recalls[0] < 1.0 and recalls[2] == recalls[4] == 1.0


def test_nothing_is_logged_for_a_skipped_batch():
    """A training_step that returns None made no OOMB step: the engine's stats are the previous step's."""
    from unittest import mock

    module = mock.Mock()
    OOMBSparseBudget({0: 1}).on_train_batch_end(mock.MagicMock(), module, None, {}, 1)
    assert not module.log_dict.called


def test_callable_schedule_and_initial_budget():
    trainer, rows = fit(oomb(page_budget=2), [OOMBSparseBudget(lambda step: None if step == 1 else 1)])
    assert [r["oomb/page_budget"] for r in rows] == [1.0, 0.0, 1.0]
    # a dict schedule keeps the strategy's budget before its first step
    _, rows = fit(oomb(page_budget=2), [OOMBSparseBudget({2: None}, recall_every=0)])
    assert [r["oomb/page_budget"] for r in rows] == [2.0, 2.0, 0.0]
    assert not any("oomb/selection_recall" in r for r in rows)


@pytest.mark.parametrize(
    ("schedule", "match"),
    [
        ({-1: 4}, "schedule key -1"),
        ({0: 0}, r"page_budget=0 .*Map each step to null/None \(dense\) or a finite page count"),
        ({"a": 4}, "schedule key 'a'"),
        (8, "callable"),
    ],
)
def test_bad_schedules_are_refused(schedule, match):
    with pytest.raises(OOMBConfigError, match=match):
        OOMBSparseBudget(schedule)


def test_a_callables_numbers_are_rounded_to_page_counts():
    """A float ramp (or a NumPy integer) is a budget, rounded: it was refused at the step it first returned one."""
    import numpy as np

    ramp = OOMBSparseBudget(lambda step: max(2, 8 - 2.5 * step))
    assert [ramp.budget_at(s) for s in range(4)] == [8, 6, 3, 2]  # 8.0, 5.5 (to even: 6), 3.0, 2
    assert OOMBSparseBudget(lambda step: np.int64(4)).budget_at(0) == 4
    # a dict takes what a callable takes (it refused 2.0 and NumPy integers as "not a positive number")
    assert OOMBSparseBudget({np.int64(0): 2.0, 3: np.int64(4)}).schedule == {0: 2, 3: 4}


@pytest.mark.parametrize("value", [float("nan"), float("inf")])
def test_a_schedule_giving_no_finite_number_is_refused_naming_it(value):
    """(A bare "cannot convert float NaN to integer" / OverflowError.)"""
    with pytest.raises(OOMBConfigError, match=f"schedule gave {value} at global step 2 .*finite"):
        OOMBSparseBudget(lambda step: value).budget_at(2)
    with pytest.raises(OOMBConfigError, match=f"schedule maps step 5 to {value} .*finite"):
        OOMBSparseBudget({5: value})


def test_callable_returning_a_bad_budget_is_refused():
    with pytest.raises(OOMBConfigError, match="page_budget=-3"):
        fit(oomb(), [OOMBSparseBudget(lambda step: -3)], steps=1)
    # a ramp rounding to 0 at step 1: the schedule and the step named (the message named neither)
    with pytest.raises(OOMBConfigError, match=r"schedule gave 0.25 at global step 1 .*page_budget=0.*max\(1"):
        fit(oomb(), [OOMBSparseBudget(lambda step: 1.25 - step)], steps=2)


def test_refuses_other_strategies():
    with pytest.raises(OOMBConfigError, match="strategy='oomb'"):
        fit("auto", [OOMBSparseBudget({0: 4})], steps=1)


def test_two_schedules_are_refused():
    """Each sets the engine's budget at every step: the last one's schedule held, silently."""
    with pytest.raises(OOMBConfigError, match="2 OOMBSparseBudget .*keep one"):
        fit(oomb(), [OOMBSparseBudget({0: 1}), OOMBSparseBudget({0: 3})], steps=1)


def test_example_config_is_sparse():
    from lightning_oomb.cli import build_cli
    from tests.lightning.test_cli import EXAMPLES

    path = EXAMPLES / "configs" / "qwen2.5-7b-256k-sparse.yaml"
    cli = build_cli(["--config", str(path), "--trainer.accelerator=cpu"], run=False)
    config = cli.trainer.strategy.oomb_config
    assert (config.chunk_size, config.page_budget, config.offload) == (4096, 64, True)
    (budget,) = [c for c in cli.trainer.callbacks if isinstance(c, OOMBSparseBudget)]
    assert budget.budget_at(0) is None and budget.budget_at(50) == 64


def test_a_ramp_going_bad_at_a_later_step_is_refused_before_training():
    """``lambda step: 3 - step`` gives 0 at step 3 of 5: refused at setup, naming the step (it was refused only
    when step 3 began, after three steps of training)."""

    class Untrainable(TinyLM):
        def training_step(self, batch):
            raise AssertionError("a step ran before the schedule was checked")

    with pytest.raises(OOMBConfigError, match=r"schedule gave 0 at global step 3 .*page_budget=0"):
        fit_tiny(oomb(), Untrainable(), steps=5, callbacks=[OOMBSparseBudget(lambda step: 3 - step)])


def test_the_setup_check_of_a_callable_stops_at_its_cap():
    """``max_steps=10**12`` (a run ended by epochs): the check stops after ``CHECKED_STEPS`` steps, not never."""
    from types import SimpleNamespace

    from lightning_oomb.callbacks import CHECKED_STEPS

    def ramp(step):
        assert step < CHECKED_STEPS, "checked past the cap"
        return 4

    trainer = SimpleNamespace(
        strategy=SimpleNamespace(oomb_config=OOMBConfig()), max_steps=10**12, callbacks=[]
    )
    OOMBSparseBudget(ramp).setup(trainer, None, "fit")


def test_a_schedules_dense_steps_must_fit_the_memory_plan_too():
    """The strategy plans its own ``page_budget``; a schedule's dense steps (more attention memory on the CPU's
    reference backend) are planned too, under the same decisions, and refused before training when they cannot
    fit (they were not planned: a run whose first steps are dense was checked as a sparse one). Device: 1.5 MiB
    past the host's reserve, as the plan sees it (a sparse step of 2 x 256 tokens takes ~1.2 MB, a dense one ~2)."""
    from lightning_oomb.engine.memory import HOST_RESERVE_BYTES
    from lightning_oomb.engine.planner import Machine

    class SmallCPU(OOMBStrategy):
        def _planning_machine(self, resident_bytes):
            return Machine("cpu", HOST_RESERVE_BYTES + (3 << 19), HOST_RESERVE_BYTES + (3 << 19))

    def strategy():
        return SmallCPU(chunk_size=16, page_size=8, page_budget=1, attention_backend="torch")

    data = batches(4, seq=256)
    trainer, _ = fit(strategy(), [OOMBSparseBudget({0: 1, 1: 1})], steps=1, data=data)  # sparse only: fits
    assert trainer.global_step == 1 and trainer.strategy.scheduled_budgets == {1}
    with pytest.raises(OOMBOutOfMemoryError, match="OOMBSparseBudget schedule's page_budget=None"):
        fit(strategy(), [OOMBSparseBudget({0: None, 2: 1})], steps=1, data=data)


@pytest.mark.parametrize(
    ("scheduled", "own", "planned"),
    [(None, 64, []), ({None, 64}, 64, [None]), ({None, 64}, None, [64]), ({8, 64}, 16, [64]), ({8}, 16, []),
     ({None, 8, 64}, 8, [None, 64])],
)  # fmt: skip
def test_the_other_budgets_planned_are_a_dense_steps_and_the_widest_sparse_ones(scheduled, own, planned):
    from lightning_oomb.strategy import widest_other_budgets

    assert widest_other_budgets(None if scheduled is None else frozenset(scheduled), own) == planned
