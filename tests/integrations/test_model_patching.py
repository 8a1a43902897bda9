"""What the user (or a library) changes on the model after setup or inside a step: a LoRA adapter or a loss put
on the model late is refused as at setup, a forward set on the instance is kept (or refused when OOMB would skip
what it adds), and a copy made inside a step is a plain model."""

from __future__ import annotations

import copy
import functools
import types

import pytest
import torch

from lightning_oomb.engine import OOMBConfig, OOMBConfigError, OOMBEngine
from lightning_oomb.engine.model import ManagedModelMixin
from lightning_oomb.integrations.hf import HFChunkModel
from tests.helpers.models import build_causal_lm, full_sequence_loss

IDS = torch.randint(0, 97, (1, 40), generator=torch.Generator().manual_seed(1))


def lora_on_the_head(model):
    peft = pytest.importorskip("peft")
    peft.inject_adapter_in_model(peft.LoraConfig(r=4, target_modules=["q_proj", "lm_head"]), model)


def a_loss_function(model):
    model.loss_function = lambda logits, labels, **kwargs: logits.sum()


def another_loss_type(model):
    model.loss_type = "ForMaskedLM"


@pytest.mark.parametrize(
    ("change", "match"),
    [
        (lora_on_the_head, "not a plain linear layer.*leave it out of target_modules"),
        (a_loss_function, "its own loss .*model.loss_function = <lambda>"),
        (another_loss_type, "its own loss .*loss_type='ForMaskedLM'"),
    ],
    ids=["lora-on-lm_head", "loss_function", "loss_type"],
)
def test_a_head_or_loss_changed_after_setup_is_refused_at_the_next_step(change, match):
    """As in ``on_fit_start``: the adapter exists (setup passed) when the model changes."""
    model = build_causal_lm("qwen2")
    engine = OOMBEngine(HFChunkModel(model), OOMBConfig(16, 8))
    engine.loss(IDS).backward()
    change(model)
    with pytest.raises(OOMBConfigError, match=match):
        engine.loss(IDS)


class CustomLM(ManagedModelMixin, torch.nn.Module):
    """The mixin's ``answer_calls`` (its other parts are not used here)."""

    def __init__(self):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.ones(()))

    def forward(self, input_ids, labels=None):
        return self.weight * 0.0


def answering(model):
    """``model``'s calls answered with a marker loss, as the strategy's steps answer them."""
    managed = model if isinstance(model, ManagedModelMixin) else HFChunkModel(model)
    return managed.answer_calls(lambda ids, labels, **layout: torch.tensor(-1.0))


def call_loss(model, ids):
    out = model(ids, labels=ids)
    return out if isinstance(out, torch.Tensor) else out.loss


def the_class_forward(model):
    return model.forward


def compiled(model):
    return torch.compile(model.forward)


def accelerate_hook(model):
    hooks = pytest.importorskip("accelerate.hooks")
    hooks.add_hook_to_module(model, hooks.ModelHook())
    return vars(model)["forward"]


def adding_a_term(model):
    inner = model.forward

    def forward_with_penalty(*args, **kwargs):
        return inner(*args, **kwargs) + 1.0

    return forward_with_penalty


def hooked_adding_a_term(model):
    model.forward = adding_a_term(model)
    return accelerate_hook(model)


MODELS = {"hf": lambda: build_causal_lm("qwen2"), "custom": CustomLM}


@pytest.mark.parametrize("kind", MODELS)
@pytest.mark.parametrize(
    "forward_of", [the_class_forward, compiled, accelerate_hook], ids=["bound", "compiled", "accelerate"]
)
def test_a_forward_that_runs_the_model_is_answered_and_kept(kind, forward_of):
    model = MODELS[kind]()
    model.forward = forward = forward_of(model)
    with answering(model):
        assert call_loss(model, IDS).item() == -1.0
    assert vars(model)["forward"] is forward


@pytest.mark.parametrize("kind", MODELS)
@pytest.mark.parametrize(
    "forward_of", [adding_a_term, hooked_adding_a_term], ids=["wrapper", "hooked-wrapper"]
)
def test_a_forward_that_adds_to_the_model_is_refused_and_kept(kind, forward_of):
    model = MODELS[kind]()
    model.forward = forward = forward_of(model)
    with (
        pytest.raises(
            OOMBConfigError, match="forward is replaced on the instance.*forward_with_penalty.*training_step"
        ),
        answering(model),
    ):
        pass
    assert vars(model)["forward"] is forward


@pytest.mark.parametrize("kind", MODELS)
def test_a_copy_made_inside_a_step_is_a_plain_model(kind):
    """An EMA copy made lazily in ``training_step``: its calls run its own forward, then and afterwards."""
    model = MODELS[kind]()
    with answering(model):
        assert call_loss(model, IDS).item() == -1.0
        ema = copy.deepcopy(model)
        with torch.no_grad():
            for p in ema.parameters():
                p.zero_()
        inside = call_loss(ema, IDS)
    assert "forward" not in vars(model)
    want = call_loss(functools.partial(type(ema).forward, ema), IDS)
    assert inside.item() == want.item() != -1.0
    assert call_loss(ema, IDS).item() == want.item()
    if kind == "hf":
        assert inside.item() == pytest.approx(torch.log(torch.tensor(97.0)).item())
        assert call_loss(model, IDS).item() == pytest.approx(full_sequence_loss(model, IDS).item())


def test_a_forward_on_a_pinned_rotary_module_is_put_back():
    """Length-dependent RoPE is pinned per step by an instance forward of the rotary module; one already there (an
    accelerate hook of a device_map dispatch) is put back after the step, not deleted."""
    from tests.helpers.models import build_family

    model = build_family("llama_dynamic")
    adapter = HFChunkModel(model)
    (rotary, _), *_ = adapter._rotaries
    hook = functools.partial(type(rotary).forward, rotary)
    rotary.forward = hook
    OOMBEngine(adapter, OOMBConfig(16, 8)).evaluate(IDS % 64)
    assert vars(rotary)["forward"] is hook


def test_a_forward_set_on_the_lm_head_is_refused_unless_it_runs_the_linear():
    """The fused loss reads the head's weight and never calls it: a forward set on the head's instance that adds
    something is refused (at setup, and when set later), an accelerate-style hook that runs the linear is not."""
    model = build_causal_lm("qwen2")
    head = model.lm_head
    head.forward = lambda x: torch.nn.functional.linear(x, head.weight) * 2
    with pytest.raises(OOMBConfigError, match="not a plain linear layer.*forward set on the head"):
        HFChunkModel(model)
    del head.forward
    engine = OOMBEngine(HFChunkModel(model), OOMBConfig(16, 8))
    head.forward = types.MethodType(torch.nn.Linear.forward, head)  # runs the linear: fine
    engine.evaluate(IDS)
    head.forward = lambda x: torch.nn.functional.linear(x, head.weight) * 2
    with pytest.raises(OOMBConfigError, match="not a plain linear layer"):
        engine.evaluate(IDS)
