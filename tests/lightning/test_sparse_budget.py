"""Sparse attention from Lightning: the strategy option and the OOMBSparseBudget callback (schedule, metrics)."""

from __future__ import annotations

import pytest

from lightning_oomb import OOMBConfig, OOMBConfigError, OOMBStrategy
from lightning_oomb.callbacks import OOMBSparseBudget
from tests.helpers.lightning import fit as fit_tiny
from tests.helpers.lightning import oomb
from tests.lightning.test_callbacks import Recorder


def fit(strategy, callbacks, steps=3):
    logger = Recorder()
    _, trainer = fit_tiny(strategy, steps=steps, logger=logger, log_every_n_steps=1, callbacks=callbacks)
    return trainer, [r for r in logger.rows if "oomb/page_budget" in r]


def test_strategy_option_reaches_the_engine():
    assert OOMBStrategy(page_budget=64).oomb_config == OOMBConfig(page_budget=64)
    with pytest.raises(OOMBConfigError, match="page_budget=0"):
        OOMBStrategy(page_budget=0)
    trainer, _ = fit(oomb(page_budget=2), [], steps=1)
    assert trainer.strategy.engine.stats.sparse.page_budget == 2


def test_schedule_switches_budgets_and_logs_by_hand():
    """40-token rows, chunk 16, page 8 (chunks of 2, 2 and 1 query blocks; 2, 4 past pages before the last two).
    Step 0 dense; step 1 budget 1: attended (1 + 2) + (2 + 3) + 2 = 10 of visible 1 + 2 + 3 + 4 + 5 = 15 pages;
    step 2 budget 3: the second chunk is dense, the last block attends 3 + 1 of 5: 14 of 15."""
    trainer, rows = fit(oomb(), [OOMBSparseBudget({0: None, 1: 1, 2: 3}, recall_every=2)])
    assert [r["oomb/page_budget"] for r in rows] == [0.0, 1.0, 3.0]
    assert [r["oomb/attended_fraction"] for r in rows] == pytest.approx([1.0, 10 / 15, 14 / 15], rel=1e-6)
    # recall on steps 0 and 2; step 0 is dense (nothing to measure)
    assert ["oomb/selection_recall" in r for r in rows] == [False, False, True]
    assert 0.0 < rows[2]["oomb/selection_recall"] <= 1.0
    assert trainer.strategy.engine.page_budget == 3


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
        ({0: 0}, "page_budget=0"),
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


def test_callable_returning_a_bad_budget_is_refused():
    with pytest.raises(OOMBConfigError, match="page_budget=-3"):
        fit(oomb(), [OOMBSparseBudget(lambda step: -3)], steps=1)


def test_refuses_other_strategies():
    with pytest.raises(OOMBConfigError, match="strategy='oomb'"):
        fit("auto", [OOMBSparseBudget({0: 4})], steps=1)


def test_example_config_is_sparse():
    from lightning_oomb.cli import build_cli
    from tests.lightning.test_cli import EXAMPLES

    path = EXAMPLES / "configs" / "qwen2.5-7b-256k-sparse.yaml"
    cli = build_cli(["--config", str(path), "--trainer.accelerator=cpu"], run=False)
    config = cli.trainer.strategy.oomb_config
    assert (config.chunk_size, config.page_budget, config.offload) == (4096, 64, True)
    (budget,) = [c for c in cli.trainer.callbacks if isinstance(c, OOMBSparseBudget)]
    assert budget.budget_at(0) is None and budget.budget_at(50) == 64
