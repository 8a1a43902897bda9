"""Lightning-free OOMB core: plain torch, usable without a Trainer."""

from lightning_oomb.engine.attention import ChunkContext, paged_attention
from lightning_oomb.engine.errors import OOMBConfigError
from lightning_oomb.engine.kv_pool import KVPool, PagedKV, PoolShape
from lightning_oomb.engine.recurrence import OOMBConfig, OOMBEngine

__all__ = [
    "ChunkContext",
    "KVPool",
    "OOMBConfig",
    "OOMBConfigError",
    "OOMBEngine",
    "PagedKV",
    "PoolShape",
    "paged_attention",
]
