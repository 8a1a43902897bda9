"""lightning_oomb: exact long-context training of Hugging Face LLMs as a PyTorch Lightning strategy.

``import lightning_oomb`` registers the strategy names ``"oomb"`` (``Trainer(strategy="oomb")``), ``"oomb_offload"``
and ``"oomb_cp"`` (context parallelism across devices).
"""

from lightning.pytorch.strategies import StrategyRegistry

from lightning_oomb.context_parallel import OOMBContextParallelStrategy
from lightning_oomb.engine import OOMBConfig, OOMBConfigError, OOMBEngine, OOMBOutOfMemoryError
from lightning_oomb.engine.planner import plan  # lightning_oomb.plan(...): a step's memory, before allocating
from lightning_oomb.integrations import hf  # noqa: F401  (the planner reads a Hugging Face model as its adapter)
from lightning_oomb.strategy import OOMBStrategy

__version__ = "0.1.0.dev0"

OOMBStrategy.register_strategies(StrategyRegistry)
OOMBContextParallelStrategy.register_strategies(StrategyRegistry)

__all__ = [
    "OOMBConfig",
    "OOMBConfigError",
    "OOMBOutOfMemoryError",
    "OOMBContextParallelStrategy",
    "OOMBEngine",
    "OOMBStrategy",
    "__version__",
    "plan",
]
