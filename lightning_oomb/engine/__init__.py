"""Lightning-free OOMB core: plain torch, usable without a Trainer (see docs/design.md for the rooms)."""

from lightning_oomb.engine.attention import ChunkContext, paged_attention
from lightning_oomb.engine.config import OOMBConfig
from lightning_oomb.engine.errors import OOMBConfigError
from lightning_oomb.engine.kv_pool import KVPool
from lightning_oomb.engine.model import ChunkModel, ManagedModel
from lightning_oomb.engine.pages import PagedKV, PoolShape
from lightning_oomb.engine.recurrence import OOMBEngine

__all__ = [
    "ChunkContext",
    "ChunkModel",
    "KVPool",
    "ManagedModel",
    "OOMBConfig",
    "OOMBConfigError",
    "OOMBEngine",
    "PagedKV",
    "PoolShape",
    "paged_attention",
]
