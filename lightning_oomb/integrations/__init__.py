"""Adapters from model libraries to the engine's model protocols (:mod:`lightning_oomb.engine.model`)."""

from __future__ import annotations

import contextlib

import torch

from lightning_oomb.engine.check import verify_chunk_model
from lightning_oomb.engine.errors import OOMBConfigError
from lightning_oomb.engine.model import ManagedModel, ManagedModelMixin


def managed_model(
    module: torch.nn.Module,
    target_module: str | None,
    layer_checkpointing: bool,
    verify_exactness: bool = True,
) -> ManagedModel:
    """The model inside ``module`` (a LightningModule) that the OOMB strategies train, as a
    :class:`~lightning_oomb.engine.model.ManagedModel`: a submodule that implements the protocol itself (the outermost
    one; e.g. a plain torch model with :class:`~lightning_oomb.engine.model.ManagedModelMixin`), else the Hugging Face
    causal LM it holds; either checked for exactness unless ``verify_exactness=False``
    (:func:`~lightning_oomb.engine.check.verify_chunk_model` on a float64 copy of the model,
    :func:`lightning_oomb.integrations.hf.verify_exactness` on a tiny twin of its config). ``target_module``: the
    attribute path of the model when there are several."""
    from lightning_oomb.integrations.hf import HFChunkModel, find_causal_lm

    own = _own_managed_model(module, target_module)
    if own is not None:
        if verify_exactness:
            verify_chunk_model(own)
        if hasattr(own, "layer_checkpointing"):
            own.layer_checkpointing = layer_checkpointing
        return own
    model = find_causal_lm(module, target_module)
    return HFChunkModel(model, layer_checkpointing=layer_checkpointing, verify_exactness=verify_exactness)


# what a ManagedModelMixin model defines itself (ChunkModel's attributes and methods the mixin has no default for)
_OWN_PART = ("num_layers", "kv_heads", "head_dim", "vocab_size", "num_embeddings", "hidden_states", "lm_head")


def _own_managed_model(module: torch.nn.Module, target_module: str | None) -> ManagedModel | None:
    """The outermost submodule that is a :class:`ManagedModel` itself (or the target, if it is one)."""
    if target_module is not None:
        with contextlib.suppress(AttributeError):
            target = module.get_submodule(target_module)
            _refuse_incomplete(target_module, target)
            return target if isinstance(target, ManagedModel) else None
        return None
    for name, m in module.named_modules():
        _refuse_incomplete(name, m)
    found = [(name, m) for name, m in module.named_modules() if isinstance(m, ManagedModel)]
    outermost = [(n, m) for n, m in found if not any(n.startswith(o + ".") for o, _ in found if o != n)]
    if len(outermost) > 1:
        raise OOMBConfigError(
            f"{type(module).__name__} holds {len(outermost)} models that implement OOMB's model protocol "
            f"({[n for n, _ in outermost]}) — the strategy trains exactly one — pass "
            "OOMBStrategy(target_module='<attribute path>')."
        )
    return outermost[0][1] if outermost else None


def _refuse_incomplete(name: str, module: torch.nn.Module) -> None:
    """Refuse a :class:`ManagedModelMixin` model that lacks part of the protocol, naming what it lacks (it would
    otherwise be searched for a Hugging Face model, and refused for not being one)."""
    if isinstance(module, ManagedModelMixin) and not isinstance(module, ManagedModel):
        missing = [a for a in _OWN_PART if not hasattr(module, a)] or [
            a for a in ("engaged", "answer_calls") if not hasattr(module, a)
        ]
        raise OOMBConfigError(
            f"{type(module).__name__} ({name or 'the module'}) inherits ManagedModelMixin but has no "
            f"{', '.join(missing)} — the engine reads the model's shape and runs its chunks through these — define "
            "them (see examples/custom_model.py and ChunkModel in lightning_oomb/engine/model.py)."
        )
