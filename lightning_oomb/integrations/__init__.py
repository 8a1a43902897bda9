"""Adapters from model libraries to the engine's model protocols (:mod:`lightning_oomb.engine.model`)."""

from __future__ import annotations

import torch

from lightning_oomb.engine.model import ManagedModel


def managed_model(
    module: torch.nn.Module, target_module: str | None, layer_checkpointing: bool, verify_exactness: bool = True
) -> ManagedModel:
    """The model inside ``module`` (a LightningModule) that the OOMB strategies train, as a
    :class:`~lightning_oomb.engine.model.ManagedModel`: today the Hugging Face causal LM it holds
    (``target_module``: its attribute path when there are several), checked for exactness
    (:func:`lightning_oomb.integrations.hf.verify_exactness`) unless ``verify_exactness=False``."""
    from lightning_oomb.integrations.hf import HFChunkModel, find_causal_lm

    model = find_causal_lm(module, target_module)
    return HFChunkModel(model, layer_checkpointing=layer_checkpointing, verify_exactness=verify_exactness)
