"""OOMBMonitor and OOMBOffload log the engine's per-step numbers."""

from __future__ import annotations

import warnings

import lightning as L
import pytest

from lightning_oomb import OOMBConfigError
from lightning_oomb.callbacks import OOMBMonitor, OOMBOffload
from tests.helpers.lightning import fit as fit_tiny
from tests.helpers.lightning import oomb


class Recorder(L.pytorch.loggers.Logger):
    name, version = "recorder", 0

    def __init__(self):
        super().__init__()
        self.rows, self.steps = [], []

    def log_metrics(self, metrics, step=None):
        self.rows.append(dict(metrics))
        self.steps.append(step)

    def log_hyperparams(self, *args, **kwargs):
        pass


def fit(strategy, callbacks, steps=2):
    logger = Recorder()
    _, trainer = fit_tiny(strategy, steps=steps, logger=logger, log_every_n_steps=1, callbacks=callbacks)
    return trainer, logger


def offloading(**options):
    return oomb(offload=True, hbm_budget=0, **{"staging_buffers": 4, **options})


def test_monitor_logs_pool_bytes_and_throughput():
    trainer, logger = fit(oomb(), [OOMBMonitor()])
    logged = [r for r in logger.rows if "oomb/kv_bytes" in r]
    assert len(logged) == 2
    # 2 layers x 1 KV head x head_dim 8 x (K, V) x fp32, 2 rows x 40 tokens (5 pages of 8)
    assert logged[-1]["oomb/kv_bytes"] == 2 * 1 * 8 * 2 * 4 * 2 * 40
    assert logged[-1]["oomb/tokens_per_s"] > 0
    # throughput and pool size are in the progress bar too (and still go to the loggers), the rest is not
    shown = trainer.progress_bar_metrics
    assert set(shown) == {"oomb/tokens_per_s", "oomb/pool_bytes"}
    assert shown["oomb/tokens_per_s"] > 0
    assert (
        shown["oomb/pool_bytes"]
        == logged[-1]["oomb/pool_bytes"]
        == trainer.strategy.engine.stats.pool_bytes
        > 0
    )


def test_monitor_reports_nothing_for_a_skipped_batch():
    """A training_step that returns None (the batch skipped) made no OOMB step: nothing is logged for it (it logged
    the previous step's tokens over the skip's tiny time: 60x the real throughput)."""
    from unittest import mock

    monitor, module = OOMBMonitor(), mock.Mock()
    monitor._start = 0.0
    monitor.on_train_batch_end(mock.MagicMock(), module, None, {}, 1)
    assert not module.log_dict.called


def test_monitor_refuses_other_strategies():
    with pytest.raises(OOMBConfigError, match="strategy='oomb'"):
        fit_tiny("auto", steps=1, callbacks=[OOMBMonitor()])


def test_offload_callback_logs_the_traffic_of_the_strategys_streams():
    trainer, logger = fit(offloading(staging_buffers=3, prefetch_depth=1), [OOMBOffload()])
    config = trainer.strategy.engine.pool.config  # the strategy's options reach the pool unchanged
    assert (config.staging_buffers, config.prefetch_depth) == (3, 1)
    logged = [r for r in logger.rows if "oomb/h2d_bytes" in r]
    assert len(logged) == 2
    last = logged[-1]
    assert last["oomb/h2d_bytes"] > 0 and last["oomb/d2h_bytes"] > 0 and last["oomb/copy_wait_s"] == 0.0
    assert (
        last["oomb/host_layers"] == 2
        and last["oomb/hbm_pool_bytes"] == 0
        and last["oomb/host_pool_bytes"] > 0
    )
    # 3 buffers of one 16-token chunk: 2 rows x 1 KV head x head_dim 8 x (K, V, dK, dV) x fp32
    assert last["oomb/staging_bytes"] == 3 * 2 * 16 * 8 * 4 * 4


def test_offload_callback_warns_once_when_the_plan_keeps_every_page_on_the_device():
    """``offload="auto"`` (the default) decided off by the plan (on a CPU: always): its counters stay 0 — said once
    (it logged zeros without a word); a strategy that offloads is not warned about."""
    with pytest.warns(UserWarning, match="keeps every page on the device") as record:
        fit(oomb(), [OOMBOffload()], steps=2)
    assert sum("keeps every page" in str(w.message) for w in record) == 1
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*keeps every page.*")
        fit(offloading(), [OOMBOffload()], steps=1)


@pytest.mark.parametrize(
    ("strategy", "callbacks", "match"),
    [
        (
            lambda: oomb(offload=False),
            [OOMBOffload()],
            r"OOMBStrategy\(offload=True\).*or log with OOMBMonitor",
        ),
        (offloading, [OOMBOffload(), OOMBMonitor()], "keep only OOMBOffload"),
    ],
)
def test_offload_callback_refuses_what_it_cannot_do(strategy, callbacks, match):
    with pytest.raises(OOMBConfigError, match=match):
        fit(strategy(), callbacks, steps=1)


@pytest.mark.parametrize(
    ("options", "match"),
    [
        ({"staging_buffers": 1}, "staging_buffers=1 must be an integer >= 2"),
        ({"prefetch_depth": -1}, "prefetch_depth=-1"),
    ],
)
def test_bad_offload_stream_options_fail_at_construction(options, match):
    with pytest.raises(OOMBConfigError, match=match):
        offloading(**options)


def test_oomb_offload_is_a_registered_preset():
    trainer = L.Trainer(strategy="oomb_offload", accelerator="cpu", logger=False)
    assert trainer.strategy.oomb_config.offload and trainer.strategy.oomb_config.chunk_size == 4096
