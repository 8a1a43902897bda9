"""A plain PyTorch model (``examples/custom_model.py``) trained by ``Trainer(strategy="oomb")``: exact in float64
against its own full-sequence training, with ragged lengths, one and several chunks, with and without
checkpointing; and the example script runs."""

from __future__ import annotations

import pytest
import torch

from lightning_oomb.engine import OOMBConfig
from tests.helpers.examples import load_example
from tests.helpers.lightning import oomb_step_through_trainer
from tests.helpers.models import max_relative_error


@pytest.fixture(scope="module")
def example():
    return load_example("custom_model")


@pytest.mark.parametrize("checkpointing", [False, True])
@pytest.mark.parametrize("chunk_size", [64, 16], ids=["1-chunk", "4-chunks"])
def test_custom_model_is_exact_through_the_trainer(example, chunk_size, checkpointing):
    torch.manual_seed(0)
    model = example.TinyGPT(vocab=61, dim=32, heads=4, kv_heads=2, hidden=48).double()
    ids = torch.randint(0, 61, (2, 53), generator=torch.Generator().manual_seed(1))
    want_loss = model(ids)
    want_loss.backward()
    want = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    config = OOMBConfig(chunk_size, 8, layer_checkpointing=checkpointing)
    loss, grads = oomb_step_through_trainer(
        model, ids, config, loss_of=lambda model, batch: model(batch, batch)
    )
    assert model.layer_checkpointing == checkpointing  # the strategy's option reached the model
    assert abs(loss.item() - want_loss.item()) <= 1e-10 * want_loss.item()
    assert max_relative_error(grads, want) <= 1e-10


@pytest.mark.slow
def test_the_example_runs(example, capsys):
    error = example.main(["--seq-len", "256", "--chunk-size", "64", "--steps", "2"])
    assert error <= 1e-10
    assert "held-out loss" in capsys.readouterr().out
