"""Families beyond Llama's attention, exact in float64 through ``Trainer(strategy="oomb")`` against full-sequence
training: Gemma 2 (softcaps, windows), Gemma 3 (5:1 local/global, QK-norm, two RoPE bases), GPT-OSS (sinks, windows,
MoE), Phi-3 longrope past its original context, dynamic NTK RoPE past its base length, Cohere and Granite (logit
scales). Ragged lengths, one and several chunks, with and without layer checkpointing."""

from __future__ import annotations

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import Callback
from torch.utils.data import DataLoader

from lightning_oomb.engine import OOMBConfig, OOMBEngine
from lightning_oomb.integrations.hf import HFChunkModel
from tests.helpers.lightning import fit, oomb
from tests.helpers.models import (
    build_family,
    exact_full_sequence_loss,
    float64_norms,
    grads_of,
    max_relative_error,
)

FAMILIES = ("gemma2", "gemma3", "gpt_oss", "phi3_longrope", "llama_dynamic", "cohere", "granite")
SEQ = 53  # past Phi-3's original context (16) and the dynamic RoPE's base length (16); not a multiple of 8 or 16


class _LM(L.LightningModule):
    def __init__(self, model):
        super().__init__()
        self.model = model

    def training_step(self, batch):
        return self.model(input_ids=batch, labels=batch).loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.0)


class _Grads(Callback):
    """The step's loss and gradients as the optimizer would see them."""

    def on_train_batch_end(self, trainer, module, outputs, *_):
        self.loss = outputs["loss"].detach().clone()

    def on_before_optimizer_step(self, trainer, module, optimizer):
        self.grads = grads_of(module.model)


def trainer_loss_and_grads(model, ids, chunk_size: int, checkpointing: bool):
    capture = _Grads()
    strategy = oomb(layer_checkpointing=checkpointing)
    strategy.oomb_config = OOMBConfig(chunk_size, 8, layer_checkpointing=checkpointing)
    fit(strategy, _LM(model), DataLoader(list(ids), batch_size=len(ids)), steps=1, precision="64-true",
        callbacks=[capture])  # fmt: skip
    return capture.loss, capture.grads


@pytest.mark.parametrize("checkpointing", [False, True])
@pytest.mark.parametrize("chunk_size", [64, 16], ids=["1-chunk", "4-chunks"])
@pytest.mark.parametrize("family", FAMILIES)
def test_family_is_exact_through_the_trainer(family, chunk_size, checkpointing):
    model = build_family(family)
    float64_norms(model)
    ids = torch.randint(0, 64, (2, SEQ), generator=torch.Generator().manual_seed(len(family)))
    want_loss = exact_full_sequence_loss(model, ids)
    want_loss.backward()
    want = grads_of(model)
    model.zero_grad()
    loss, grads = trainer_loss_and_grads(model, ids, chunk_size, checkpointing)
    assert abs(loss.item() - want_loss.item()) <= 1e-10 * want_loss.item()
    assert max_relative_error(grads, want) <= 1e-10
    if family == "gpt_oss":  # the sinks learn: their gradient is part of the comparison, and not zero
        assert all(grads[n].abs().max() > 0 for n in grads if n.endswith("sinks"))


@pytest.mark.parametrize("family", ["phi3_longrope", "llama_dynamic"])
def test_length_dependent_rope_is_wrong_unless_pinned(family):
    """Negative control: with the RoPE left to each chunk's own length (a fresh model: dynamic RoPE keeps state),
    the chunked loss is not the full one; pinned, it is."""
    ids = torch.randint(0, 64, (1, SEQ), generator=torch.Generator().manual_seed(0))
    want = exact_full_sequence_loss(build_family(family), ids).item()
    unpinned = HFChunkModel(build_family(family))
    assert unpinned._rotaries  # found
    unpinned._rotaries = []
    wrong = OOMBEngine(unpinned, OOMBConfig(16, 8)).evaluate(ids).item()
    pinned = OOMBEngine(HFChunkModel(build_family(family)), OOMBConfig(16, 8)).evaluate(ids).item()
    assert abs(pinned - want) <= 1e-10 * want and abs(wrong - want) > 1e-4 * want


@pytest.mark.slow
@pytest.mark.parametrize("family", ["gemma2", "gpt_oss"])
def test_softcap_and_sinks_with_the_triton_kernels(family):
    """The Triton backend (interpreted on CPU) gives the torch backend's loss and gradients with softcaps and sinks."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    model = build_family(family, dtype=torch.float32, head_dim=16).to(device)
    ids = torch.randint(0, 64, (2, 45), generator=torch.Generator().manual_seed(1)).to(device)
    results = {}
    for backend in ("torch", "triton"):
        model.zero_grad()
        engine = OOMBEngine(HFChunkModel(model), OOMBConfig(16, 16, attention_backend=backend))
        loss = engine.loss(ids)
        loss.backward()
        results[backend] = loss.detach(), grads_of(model)
    (loss_t, grads_t), (loss_k, grads_k) = results["torch"], results["triton"]
    assert torch.allclose(loss_k, loss_t, rtol=1e-5, atol=0)
    assert max_relative_error(grads_k, grads_t) <= 1e-4
