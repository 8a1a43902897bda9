"""OOMBMonitor logs the engine's per-step numbers."""

from __future__ import annotations

import lightning as L
import pytest
from test_strategy import TinyLM, batches, oomb

from lightning_oomb import OOMBConfigError, OOMBStrategy
from lightning_oomb.callbacks import OOMBMonitor, OOMBOffload


class Recorder(L.pytorch.loggers.Logger):
    name, version = "recorder", 0

    def __init__(self):
        super().__init__()
        self.rows = []

    def log_metrics(self, metrics, step=None):
        self.rows.append(dict(metrics))

    def log_hyperparams(self, *args, **kwargs):
        pass


def fit(strategy, callbacks, steps=2):
    logger = Recorder()
    trainer = L.Trainer(
        strategy=strategy,
        accelerator="cpu",
        max_steps=steps,
        logger=logger,
        log_every_n_steps=1,
        callbacks=callbacks,
        enable_progress_bar=False,
        enable_checkpointing=False,
    )
    trainer.fit(TinyLM(), batches())
    return trainer, logger


def offloading():
    return OOMBStrategy(chunk_size=16, page_size=8, offload=True, hbm_budget=0, staging_buffers=4)


def test_monitor_logs_pool_bytes_and_throughput():
    _, logger = fit(oomb(), [OOMBMonitor()])
    logged = [r for r in logger.rows if "oomb/kv_bytes" in r]
    assert len(logged) == 2
    # 2 layers x 1 KV head x head_dim 8 x (K, V) x fp32, 2 rows x 40 tokens (5 pages of 8)
    assert logged[-1]["oomb/kv_bytes"] == 2 * 1 * 8 * 2 * 4 * 2 * 40
    assert logged[-1]["oomb/tokens_per_s"] > 0


def test_monitor_refuses_other_strategies():
    trainer = L.Trainer(
        strategy="auto", accelerator="cpu", max_steps=1, callbacks=[OOMBMonitor()], logger=False
    )
    with pytest.raises(OOMBConfigError, match="strategy='oomb'"):
        trainer.fit(TinyLM(), batches())


def test_offload_callback_tunes_the_streams_and_logs_the_traffic():
    trainer, logger = fit(offloading(), [OOMBOffload(staging_buffers=3, prefetch_depth=1)])
    pool = trainer.strategy.engine.pool
    assert (pool.staging_buffers, pool.prefetch_depth) == (3, 1)
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


@pytest.mark.parametrize(
    ("strategy", "callbacks", "match"),
    [
        (oomb, [OOMBOffload()], "offload=True"),
        (offloading, [OOMBOffload(), OOMBMonitor()], "keep only OOMBOffload"),
        (offloading, [OOMBOffload(staging_buffers=1)], "staging_buffers=1 must be an integer >= 2"),
        (offloading, [OOMBOffload(prefetch_depth=-1)], "prefetch_depth=-1"),
    ],
)
def test_offload_callback_refuses_what_it_cannot_do(strategy, callbacks, match):
    with pytest.raises(OOMBConfigError, match=match):
        fit(strategy(), callbacks, steps=1)
