"""Adapters from model libraries to the engine's model protocols (:mod:`lightning_oomb.engine.model`)."""

from __future__ import annotations

import contextlib

import torch

from lightning_oomb.engine.errors import OOMBConfigError
from lightning_oomb.engine.model import ManagedModel


def managed_model(
    module: torch.nn.Module,
    target_module: str | None,
    layer_checkpointing: bool,
    verify_exactness: bool = True,
) -> ManagedModel:
    """The model inside ``module`` (a LightningModule) that the OOMB strategies train, as a
    :class:`~lightning_oomb.engine.model.ManagedModel`: a submodule that implements the protocol itself (the
    outermost one; e.g. a plain torch model with :class:`~lightning_oomb.engine.model.ManagedModelMixin`), else the
    Hugging Face causal LM it holds, checked for exactness (:func:`lightning_oomb.integrations.hf.verify_exactness`)
    unless ``verify_exactness=False``. ``target_module``: the attribute path of the model when there are several."""
    from lightning_oomb.integrations.hf import HFChunkModel, find_causal_lm

    own = _own_managed_model(module, target_module)
    if own is not None:
        if hasattr(own, "layer_checkpointing"):
            own.layer_checkpointing = layer_checkpointing
        return own
    model = find_causal_lm(module, target_module)
    return HFChunkModel(model, layer_checkpointing=layer_checkpointing, verify_exactness=verify_exactness)


def _own_managed_model(module: torch.nn.Module, target_module: str | None) -> ManagedModel | None:
    """The outermost submodule that is a :class:`ManagedModel` itself (or the target, if it is one)."""
    if target_module is not None:
        with contextlib.suppress(AttributeError):
            target = module.get_submodule(target_module)
            return target if isinstance(target, ManagedModel) else None
        return None
    found = [(name, m) for name, m in module.named_modules() if isinstance(m, ManagedModel)]
    outermost = [(n, m) for n, m in found if not any(n.startswith(o + ".") for o, _ in found if o != n)]
    if len(outermost) > 1:
        raise OOMBConfigError(
            f"{type(module).__name__} holds {len(outermost)} models that implement OOMB's model protocol "
            f"({[n for n, _ in outermost]}) — the strategy trains exactly one — pass "
            "OOMBStrategy(target_module='<attribute path>')."
        )
    return outermost[0][1] if outermost else None
