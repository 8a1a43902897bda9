"""``torch.compile`` on a model's decoder layers: the paged attention op runs outside the compiled graphs
(``torch.compiler.disable``), so a layer compiles into a few graphs once and later chunks and steps reuse them —
exact as uncompiled training."""

from __future__ import annotations

from pathlib import Path

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


def kernel_routed(layer: torch.nn.Module) -> int:
    """Module classes of ``layer`` whose forward is the ``kernels`` package's routing wrapper (transformers >= 5.25
    wraps the attention this way): a ``try``/``finally`` that dynamo gives up on at the op's graph break, tracing the
    forward inside it on its own, so each costs one frame run eagerly (dict updates, no tensor work)."""
    return len(
        {type(m) for m in layer.modules() if "kernels" in Path(type(m).forward.__code__.co_filename).parts}
    )


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
    # no frame given up on (recompile limit, untraceable engine code) but the kernels package's routing wrappers
    assert frames - counters["frames"]["ok"] <= kernel_routed(model.model.layers[0])
    assert counters["stats"]["unique_graphs"] <= 8 * len(
        model.model.layers
    )  # pieces around the op, per grad mode
    assert abs(loss.item() - want.item()) < 1e-12
    assert max_relative_error(grads, want_grads) < 1e-10

    oomb_step(model, IDS, checkpointing, chunk=16, page=8)  # the next step: nothing new to compile
    assert counters["frames"]["total"] == frames


@pytest.mark.filterwarnings("ignore:hooks on the model")
def test_a_compiled_model_is_answered_uncompiled_under_the_strategy(fresh_dynamo):
    """``torch.compile(model)`` (the whole model, as users compile it for other strategies): the strategy's answer to
    its call runs outside dynamo, so the engine's forward sweep is never traced (it was: 410 frames, 48 graph breaks,
    and inductor's rounding in the forward sweep differed from the eager backward recompute, 9e-7 off in float64)
    and training equals the uncompiled model's."""
    from lightning_oomb.engine import OOMBConfig
    from tests.helpers.lightning import oomb_step_through_trainer

    ids = IDS.repeat(2, 1)
    traced = []
    model = build_causal_lm("qwen2")
    model.model.layers[0].register_forward_pre_hook(lambda *_: traced.append(torch.compiler.is_compiling()))
    config = OOMBConfig(16, 8)
    want_loss, want = oomb_step_through_trainer(model, ids, config)
    calls = len(traced)
    traced.clear()

    compiled = torch.compile(model, backend="eager")
    loss, grads = oomb_step_through_trainer(compiled, ids, config)
    grads = {name.removeprefix("_orig_mod."): g for name, g in grads.items()}
    assert len(traced) == calls and not any(traced)  # every chunk call of the layer ran eagerly
    assert loss.item() == want_loss.item()
    assert max_relative_error(grads, want) == 0
