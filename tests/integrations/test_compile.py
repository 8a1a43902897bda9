"""``torch.compile`` on a model's decoder layers: the paged attention op runs outside the compiled graphs
(``torch.compiler.disable``), so a layer compiles into a few graphs once and later chunks and steps reuse them —
exact as uncompiled training."""

from __future__ import annotations

import pytest
import torch
from torch._dynamo.utils import counters

from tests.helpers.models import build_causal_lm, full_sequence_loss, grads_of, max_relative_error, oomb_step

IDS = torch.randint(0, 97, (1, 48), generator=torch.Generator().manual_seed(3))


@pytest.fixture
def fresh_dynamo():
    torch._dynamo.reset()
    counters.clear()
    yield
    torch._dynamo.reset()


@pytest.mark.parametrize("checkpointing", [False, True], ids=["plain", "layer-checkpointing"])
def test_compiled_layers_train_exactly_and_compile_once(fresh_dynamo, checkpointing):
    model = build_causal_lm("qwen2")
    want = full_sequence_loss(model, IDS)
    want.backward()
    want_grads = grads_of(model)
    for layer in model.model.layers:
        layer.compile(backend="eager")  # dynamo's tracing, without a C++ compiler

    loss, grads, _ = oomb_step(model, IDS, checkpointing, chunk=16, page=8)
    frames = counters["frames"]["total"]
    assert (
        counters["frames"]["ok"] == frames
    )  # no frame given up on (recompile limit, untraceable engine code)
    assert counters["stats"]["unique_graphs"] <= 8 * len(
        model.model.layers
    )  # pieces around the op, per grad mode
    assert abs(loss.item() - want.item()) < 1e-12
    assert max_relative_error(grads, want_grads) < 1e-10

    oomb_step(model, IDS, checkpointing, chunk=16, page=8)  # the next step: nothing new to compile
    assert counters["frames"]["total"] == frames
