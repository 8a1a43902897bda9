"""The precision plugins the OOMB strategies train with: Lightning's stock ones, checked and kept as they are.

The accelerator connector assigns a stock ``Precision`` to every custom strategy (even at the default precision),
so the strategy's setter checks it instead of rejecting it (docs/design.md, "Lightning"). The plugin is kept
unwrapped: loss scaling, ``on_before/after_backward`` (once per batch), unscale → clip → step → update, autocast in
``forward_context`` and its checkpoint state behave exactly as under the stock strategies, and whatever reads the
plugin's type (``ThroughputMonitor``'s compute dtype, a resume's scaler state) sees the stock class. The engine
re-enters the autocast state of the forward sweep by itself for the recompute, because autocast is off during
backward.
"""

from __future__ import annotations

from lightning.pytorch.plugins.precision import DoublePrecision, HalfPrecision, MixedPrecision, Precision

from lightning_oomb.engine.errors import OOMBConfigError

SUPPORTED = (Precision, MixedPrecision, HalfPrecision, DoublePrecision)
_FLAGS = "'32-true', '64-true', 'bf16-mixed', '16-mixed', 'bf16-true', '16-true'"


def checked_precision(plugin: Precision | None) -> Precision | None:
    """``plugin`` itself if the OOMB strategies can train with it (``None`` stays ``None``: 32-true), else a clear
    error: a plugin tied to another strategy (FSDP's, DeepSpeed's) or one that quantises weights (bitsandbytes,
    Transformer Engine)."""
    if plugin is not None and type(plugin) not in SUPPORTED:
        raise OOMBConfigError(
            f"the precision plugin {type(plugin).__name__} cannot be combined with the OOMB strategy — it is "
            f"tied to another strategy or quantises weights — use precision= one of {_FLAGS}."
        )
    return plugin
