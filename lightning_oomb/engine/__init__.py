"""Lightning-free OOMB core: plain torch, usable without a Trainer (see docs/design.md for the rooms)."""

from lightning_oomb.engine.attention import ChunkContext, paged_attention
from lightning_oomb.engine.check import check_chunking
from lightning_oomb.engine.config import OOMBConfig
from lightning_oomb.engine.errors import OOMBConfigError, OOMBOutOfMemoryError
from lightning_oomb.engine.kv_pool import KVPool
from lightning_oomb.engine.loss import LMHead
from lightning_oomb.engine.model import ChunkModel, ManagedModel, ManagedModelMixin, StepLoss
from lightning_oomb.engine.pages import PagedKV, PoolShape
from lightning_oomb.engine.recurrence import OOMBEngine
from lightning_oomb.engine.states import ChunkStates

__all__ = [
    "ChunkContext",
    "ChunkModel",
    "ChunkStates",
    "KVPool",
    "LMHead",
    "ManagedModel",
    "ManagedModelMixin",
    "OOMBConfig",
    "OOMBConfigError",
    "OOMBOutOfMemoryError",
    "OOMBEngine",
    "PagedKV",
    "PoolShape",
    "StepLoss",
    "check_chunking",
    "paged_attention",
]
