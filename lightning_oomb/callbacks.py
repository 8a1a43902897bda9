"""Callbacks for the OOMB strategies (optional observers; the strategy does all mandatory work)."""

from __future__ import annotations

import time
from typing import Any

import torch
from lightning.pytorch import Callback, LightningModule, Trainer
from typing_extensions import override

from lightning_oomb.engine.errors import OOMBConfigError

# what OOMBMonitor shows in the progress bar as well (the rest goes to the loggers only)
PROGRESS_BAR = ("oomb/tokens_per_s", "oomb/pool_bytes")


class OOMBMonitor(Callback):
    """Log what each OOMB step did: tokens/s, KV-pool bytes and the engine's offload counters.

    Logged per optimizer step under ``oomb/``: ``tokens_per_s``, ``pool_bytes`` (arenas held), ``kv_bytes`` and
    ``grad_bytes`` (what the step needed), every numeric entry of ``engine.stats.extra`` (offload: bytes moved each
    way, time the compute stream waited on copies, HBM/host pool bytes), and on CUDA ``peak_device_bytes``.
    ``tokens_per_s`` and ``pool_bytes`` are shown in the progress bar too.
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
    def on_train_batch_end(self, trainer: Trainer, pl_module: LightningModule, *_: Any) -> None:
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
    ``oomb/demand_copies`` (copies a prefetch did not foresee), ``oomb/hbm_pool_bytes``, ``oomb/staging_bytes`` and
    ``oomb/host_pool_bytes``; use it instead of the monitor. Refuses a run whose strategy does not offload.
    """

    @override
    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        super().setup(trainer, pl_module, stage)
        if not trainer.strategy.oomb_config.offload:
            raise OOMBConfigError(
                "OOMBOffload logs offload traffic but the strategy keeps every page on the device (offload=False) — "
                "turn it on with OOMBStrategy(offload=True) or strategy='oomb_offload' (YAML: "
                "strategy.init_args.offload: true)."
            )
        if any(type(c) is OOMBMonitor for c in trainer.callbacks):
            raise OOMBConfigError(
                "OOMBOffload already logs everything OOMBMonitor logs — keep only OOMBOffload in callbacks."
            )
