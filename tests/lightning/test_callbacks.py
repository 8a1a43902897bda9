"""OOMBMonitor logs the engine's per-step numbers."""

from __future__ import annotations

import lightning as L
import pytest
from test_strategy import TinyLM, batches, oomb

from lightning_oomb import OOMBConfigError
from lightning_oomb.callbacks import OOMBMonitor


class Recorder(L.pytorch.loggers.Logger):
    name, version = "recorder", 0

    def __init__(self):
        super().__init__()
        self.rows = []

    def log_metrics(self, metrics, step=None):
        self.rows.append(dict(metrics))

    def log_hyperparams(self, *args, **kwargs):
        pass


def test_monitor_logs_pool_bytes_and_throughput():
    logger = Recorder()
    trainer = L.Trainer(
        strategy=oomb(),
        accelerator="cpu",
        max_steps=2,
        logger=logger,
        log_every_n_steps=1,
        callbacks=[OOMBMonitor()],
        enable_progress_bar=False,
        enable_checkpointing=False,
    )
    trainer.fit(TinyLM(), batches())
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
