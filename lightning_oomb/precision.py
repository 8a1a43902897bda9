"""``OOMBPrecision``: wraps whatever stock precision plugin the Trainer builds.

The accelerator connector assigns a stock ``Precision`` to every custom strategy (even at the default
precision), so the strategy's setter converts instead of rejecting (docs/design.md, "Lightning"). Every
hook is delegated to the wrapped plugin: loss scaling, ``on_before/after_backward`` (once per batch), unscale →
clip → step → update, autocast in ``forward_context``. The engine re-enters the autocast state of the forward
sweep by itself for the recompute, because autocast is off during backward.
"""

from __future__ import annotations

from collections.abc import Generator
from contextlib import contextmanager
from typing import Any

from lightning.pytorch.plugins.precision import DoublePrecision, HalfPrecision, MixedPrecision, Precision
from lightning.pytorch.utilities import GradClipAlgorithmType
from typing_extensions import override

from lightning_oomb.engine.errors import OOMBConfigError

_SUPPORTED = (Precision, MixedPrecision, HalfPrecision, DoublePrecision)
_FLAGS = "'32-true', '64-true', 'bf16-mixed', '16-mixed', 'bf16-true', '16-true'"


class OOMBPrecision(Precision):
    """Precision plugin of the OOMB strategies: a transparent wrapper around a stock plugin.

    Args:
        plugin: the stock plugin to wrap (``Precision()`` = 32-true when omitted).
    """

    def __init__(self, plugin: Precision | None = None) -> None:
        plugin = plugin if plugin is not None else Precision()
        if isinstance(plugin, OOMBPrecision):
            plugin = plugin.inner
        if type(plugin) not in _SUPPORTED:
            raise OOMBConfigError(
                f"the precision plugin {type(plugin).__name__} cannot be combined with the OOMB strategy — it is "
                f"tied to another strategy or quantises weights — use precision= one of {_FLAGS}."
            )
        self.inner = plugin
        self.precision = plugin.precision

    @classmethod
    def wrap(cls, plugin: Precision | None) -> OOMBPrecision | None:
        """``None`` stays ``None``; an ``OOMBPrecision`` is kept; stock plugins are wrapped."""
        if plugin is None or isinstance(plugin, OOMBPrecision):
            return plugin
        return cls(plugin)

    @property
    def scaler(self):
        """The wrapped plugin's GradScaler (``16-mixed``), else ``None``."""
        return getattr(self.inner, "scaler", None)

    # ---- delegation: every hook behaves exactly as the wrapped plugin's ------------------------------------
    @override
    def connect(self, model, optimizers, lr_schedulers):
        return self.inner.connect(model, optimizers, lr_schedulers)

    @override
    def convert_module(self, module):
        return self.inner.convert_module(module)

    @override
    def tensor_init_context(self):
        return self.inner.tensor_init_context()

    @override
    def module_init_context(self):
        return self.inner.module_init_context()

    @override
    @contextmanager
    def forward_context(self) -> Generator[None, None, None]:
        with self.inner.forward_context():
            yield

    @override
    def convert_input(self, data: Any) -> Any:
        return self.inner.convert_input(data)

    @override
    def convert_output(self, data: Any) -> Any:
        return self.inner.convert_output(data)

    @override
    def pre_backward(self, tensor, module):
        return self.inner.pre_backward(tensor, module)

    @override
    def backward(self, tensor, model, optimizer, *args: Any, **kwargs: Any) -> None:
        self.inner.backward(tensor, model, optimizer, *args, **kwargs)

    @override
    def post_backward(self, tensor, module):
        return self.inner.post_backward(tensor, module)

    @override
    def optimizer_step(self, optimizer, model, closure, **kwargs: Any) -> Any:
        return self.inner.optimizer_step(optimizer, model, closure, **kwargs)

    @override
    def clip_gradients(
        self, optimizer, clip_val=0.0, gradient_clip_algorithm=GradClipAlgorithmType.NORM
    ) -> None:
        self.inner.clip_gradients(optimizer, clip_val, gradient_clip_algorithm)

    @override
    def main_params(self, optimizer):
        return self.inner.main_params(optimizer)

    @override
    def state_dict(self) -> dict[str, Any]:
        return self.inner.state_dict()

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.inner.load_state_dict(state_dict)

    # Lightning files plugin state under the plugin's class name: keep the wrapped plugin's key too, so that
    # checkpoints move both ways between strategy="oomb" and the stock strategies (e.g. the 16-mixed scaler).
    @override
    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        state = self.inner.state_dict()
        if state:
            checkpoint[type(self.inner).__qualname__] = state
        self.inner.on_save_checkpoint(checkpoint)

    @override
    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        self.inner.on_load_checkpoint(checkpoint)
        key = type(self.inner).__qualname__
        if type(self).__qualname__ not in checkpoint and key in checkpoint:
            self.inner.load_state_dict(checkpoint[key])

    @override
    def teardown(self) -> None:
        self.inner.teardown()
