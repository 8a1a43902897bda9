"""What a training step is made of beside its model, as the memory planner (:mod:`~lightning_oomb.engine.planner`)
reads it: a Lightning precision flag's dtypes (:func:`precision_dtypes`) and an optimizer's states
(:func:`optimizer_spec`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from lightning_oomb.engine.errors import OOMBConfigError

# Lightning precision flags -> (parameter dtype, autocast dtype or None)
PRECISIONS: dict[str, tuple[torch.dtype, torch.dtype | None]] = {
    "32-true": (torch.float32, None),
    "64-true": (torch.float64, None),
    "bf16-true": (torch.bfloat16, None),
    "16-true": (torch.float16, None),
    "bf16-mixed": (torch.float32, torch.bfloat16),
    "16-mixed": (torch.float32, torch.float16),
}
_ALIASES = {"32": "32-true", "64": "64-true", "16": "16-mixed", "bf16": "bf16-mixed"}
# Lightning converts the model's weights to these flags' dtype
_CONVERTING = ("64-true", "bf16-true", "16-true")


@dataclass(frozen=True)
class Dtypes:
    """``param``: weights, gradients and optimizer states; ``activation``: the residual stream, K/V and what
    layers save (the parameters' dtype); ``compute``: what matmuls produce (the autocast dtype under ``*-mixed``)."""

    param: torch.dtype
    activation: torch.dtype
    compute: torch.dtype

    @property
    def mixed(self) -> bool:
        return self.compute != self.activation

    @property
    def kv(self) -> torch.dtype:
        """Attention's ``q, k, v``, output and K/V pages: the compute dtype (autocast casts them, as it casts
        ``scaled_dot_product_attention``'s)."""
        return self.compute


def precision_dtypes(precision: str | int, param_dtype: torch.dtype | None = None) -> Dtypes:
    """The dtypes a Lightning ``precision`` flag gives (``param_dtype``: the model's own, when it is known; the
    flags that convert the weights — ``*-true`` but ``32-true`` — take theirs, e.g. a float32 module planned for
    ``bf16-true``; the others keep it, e.g. a bf16 checkpoint under ``32-true``)."""
    flag = _ALIASES.get(str(precision), str(precision))
    if flag not in PRECISIONS:
        raise OOMBConfigError(
            f"precision={precision!r} is not a precision the OOMB strategy runs — the planner needs the dtypes of "
            f"weights and compute — use one of {sorted(PRECISIONS)}."
        )
    param, autocast = PRECISIONS[flag]
    param = param if flag in _CONVERTING or param_dtype is None else param_dtype
    return Dtypes(param, param, autocast or param)


@dataclass(frozen=True)
class OptimizerSpec:
    """``states``: parameter-sized state tensors per trainable parameter; ``state_dtype``: their dtype (``None``:
    the parameter's, as torch's ``zeros_like``/``clone`` keep them); ``sqrt_copy``: a step makes a state-sized
    ``sqrt`` temporary (Adam's), of the largest parameter group with ``foreach`` (``None``: torch's default, on
    for CUDA) or of the largest parameter in the for-loop implementation, none when ``fused``; ``params``,
    ``state_bytes``, ``largest_group``: what an optimizer instance updates (``None``: every trainable parameter)."""

    name: str
    states: int
    state_dtype: torch.dtype | None = None
    sqrt_copy: bool = False
    foreach: bool | None = None
    fused: bool = False
    params: int | None = None
    state_bytes: int | None = None
    largest_group: int | None = None


_OPTIMIZERS = {"none": 0, "sgd": 0, "sgd-momentum": 1, "adam": 2, "adamw": 2, "adagrad": 1, "rmsprop": 1,
               "adam-fused": 2, "adamw-fused": 2}  # fmt: skip


def optimizer_spec(optimizer: Any) -> OptimizerSpec:
    """The :class:`OptimizerSpec` of ``optimizer``: ``None`` / ``"none"``, ``"sgd"``, ``"sgd-momentum"``,
    ``"adamw"``, ``"adam"`` (torch's default implementation: ``foreach`` on CUDA), ``"adamw-fused"``,
    ``"adam-fused"`` (``fused=True``), ..., an :class:`OptimizerSpec`, or a ``torch.optim.Optimizer`` (its type,
    options and parameter groups are read; an unknown type is assumed to keep two states per parameter, like
    Adam), or a list of torch optimizers (manual optimization's: their states summed)."""
    if isinstance(optimizer, OptimizerSpec):
        return optimizer
    if isinstance(optimizer, (list, tuple)):
        specs = [optimizer_spec(o) for o in optimizer]
        if len(specs) == 1:
            return specs[0]
        if not all(isinstance(o, torch.optim.Optimizer) for o in optimizer) or not specs:
            raise OOMBConfigError(
                f"optimizer={optimizer!r}: a list is read as the torch optimizers one step uses (their parameters "
                "and states are summed) — pass the torch.optim.Optimizer instances, or one name or OptimizerSpec."
            )
        copies = [s for s in specs if s.sqrt_copy and not s.fused]
        return OptimizerSpec(
            " + ".join(s.name for s in specs),
            max(s.states for s in specs),
            sqrt_copy=bool(copies),
            params=sum(s.params for s in specs),
            state_bytes=sum(s.state_bytes for s in specs),
            largest_group=max((s.largest_group for s in copies), default=0),
        )
    if optimizer is None:
        return OptimizerSpec("none", 0)
    if isinstance(optimizer, str):
        name = optimizer.lower().replace("_", "-")
        if name not in _OPTIMIZERS:
            raise OOMBConfigError(
                f"optimizer={optimizer!r} is unknown to the planner — it counts each optimizer's state tensors — "
                f"use one of {sorted(_OPTIMIZERS)}, an OptimizerSpec, or the torch optimizer itself."
            )
        fused = name.endswith("-fused")
        return OptimizerSpec(name, _OPTIMIZERS[name], sqrt_copy=name in ("adam", "adamw"), fused=fused)
    if isinstance(optimizer, torch.optim.Optimizer):
        return _spec_of_optimizer(optimizer)
    raise OOMBConfigError(
        f"optimizer={optimizer!r} is not an optimizer — the planner counts its states — pass a name such as "
        "'adamw', an OptimizerSpec, or a torch.optim.Optimizer."
    )


def _spec_of_optimizer(optimizer: torch.optim.Optimizer) -> OptimizerSpec:
    kind = type(optimizer).__name__.lower()
    d = optimizer.defaults
    if kind == "sgd":
        states = int(bool(d.get("momentum", 0)))
    elif kind in ("adam", "adamw"):
        states = 2 + int(bool(d.get("amsgrad", False)))
    elif kind == "rmsprop":
        states = 1 + int(bool(d.get("momentum", 0))) + int(bool(d.get("centered", False)))
    else:
        states = _OPTIMIZERS.get(kind, 2)
    groups = [[p for p in g["params"] if p.requires_grad] for g in optimizer.param_groups]
    params = [p for g in groups for p in g]
    # named as given: the planner's names of its options (SGD with momentum, a fused or AMSGrad Adam)
    name = kind if kind in _OPTIMIZERS else f"{type(optimizer).__name__} (assumed Adam-like)"
    if kind == "sgd" and states:
        name = "sgd-momentum"
    elif kind in ("adam", "adamw"):
        name += "-fused" * bool(d.get("fused")) + " (amsgrad)" * bool(d.get("amsgrad", False))
    return OptimizerSpec(
        name,
        states,
        sqrt_copy=kind in ("adam", "adamw"),
        foreach=d.get("foreach"),
        fused=bool(d.get("fused")),
        params=sum(p.numel() for p in params),
        state_bytes=states * sum(p.numel() * p.element_size() for p in params),
        largest_group=max((sum(p.numel() for p in g) for g in groups), default=0),
    )
