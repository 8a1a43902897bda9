"""A plain PyTorch model (``examples/custom_model.py``) trained by ``Trainer(strategy="oomb")``: exact in float64
against its own full-sequence training, with ragged lengths, one and several chunks, with and without
checkpointing; and the example script runs."""

from __future__ import annotations

import types

import pytest
import torch

from lightning_oomb.engine import (
    OOMBConfig,
    OOMBConfigError,
    OOMBEngine,
    check,
    check_chunking,
    paged_attention,
)
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


def _variant(example, **overrides):
    """A TinyGPT whose methods ``overrides`` replace (a class of its own per variant)."""
    return type("UserGPT", (example.TinyGPT,), overrides)(vocab=61, dim=32, heads=4, kv_heads=2, hidden=48)


def _fit(model):
    ids = torch.randint(0, 61, (2, 53), generator=torch.Generator().manual_seed(1))
    return oomb_step_through_trainer(model.double(), ids, OOMBConfig(16, 8), loss_of=lambda m, b: m(b, b))


def _normed_in_forward(self, input_ids, labels=None):
    """A norm that forward applies and hidden_states does not return."""
    positions = torch.arange(input_ids.shape[1])[None]
    logits = self.head(torch.nn.functional.rms_norm(self.hidden_states(input_ids, positions), (32,)))[:, :-1]
    return torch.nn.functional.cross_entropy(logits.reshape(-1, 61), labels[:, 1:].reshape(-1))


def _bypass(self, input_ids, position_ids, chunk=None):
    """Attends without paged_attention: each chunk sees only itself."""
    return type(self).__mro__[1].hidden_states(self, input_ids, position_ids, None)


def _declaring_five_layers(self, *args, **kwargs):
    """Two blocks (two attention calls) declared as five layers."""
    type(self).__mro__[1].__init__(self, *args, **kwargs)
    self.num_layers = 5


def _logits(self, input_ids, labels=None):
    positions = torch.arange(input_ids.shape[1])[None]
    return self.head(self.hidden_states(input_ids, positions))


@pytest.mark.parametrize(
    ("overrides", "match"),
    [
        ({"hidden_states": _bypass}, "in chunks of 16 tokens than in one chunk.*paged_attention"),
        ({"forward": _normed_in_forward}, "than by its own forward.*final normed hidden states"),
        ({"lm_head": lambda self: example_head(self, scale=0.5)}, "than by its own forward.*LMHead"),
        ({"forward": _logits}, r"returns a tensor of shape \[2, 53, 61\], not the loss.*answer_calls"),
        (
            {"__init__": _declaring_five_layers},
            r"declares num_layers=5 but its forward never calls paged_attention with layer 2, 3, 4 "
            r"\(3 of them\).*set num_layers to the number of paged_attention calls in a chunk \(2\)",
        ),
    ],
    ids=[
        "attention-bypassing-the-op",
        "a-norm-only-forward-applies",
        "undeclared-head-scale",
        "forward-returns-logits",
        "layers-never-called",
    ],
)
def test_a_custom_model_that_would_train_wrong_is_refused_at_setup(example, overrides, match):
    """``verify_exactness`` (the default) checks a custom model on a float64 copy: several chunks against one, one
    against the model's own forward. (These trained silently wrong: gradients off by up to 1.7× relative; a
    ``num_layers`` above the calls trained right, with pages for layers never called.)"""
    with pytest.raises(OOMBConfigError, match=f"self-check.*{match}.*verify_exactness=False"):
        _fit(_variant(example, **overrides))


def example_head(model, scale):
    from lightning_oomb.engine import LMHead

    return LMHead(model.head.weight, scale=scale)


def test_a_large_custom_model_is_not_copied_but_warned_about(example, monkeypatch):
    monkeypatch.setattr(check, "CHECK_MAX_PARAMETERS", 10)
    with pytest.warns(UserWarning, match="did not check UserGPT.*check_chunking"):
        _fit(_variant(example, hidden_states=_bypass))


def test_a_mixin_model_missing_a_shape_attribute_is_named(example):
    """(It was searched for a Hugging Face model: "holds 0 Hugging Face causal LMs".)"""

    def init(self, *args, **kwargs):
        example.TinyGPT.__init__(self, *args, **kwargs)
        del self.num_embeddings

    with pytest.raises(OOMBConfigError, match="inherits ManagedModelMixin but has no num_embeddings"):
        _fit(_variant(example, __init__=init))


def _attention(example, scale: str):
    """TinyGPT's attention forward with ``scale=None`` and a key bias added after RoPE (its gradient is zero in
    exact arithmetic: softmax ignores a constant per row)."""

    def forward(self, x, cos, sin, chunk=None):
        b, n, _ = x.shape
        q = self.q(x).view(b, n, self.heads, self.head_dim).transpose(1, 2)
        k, v = self.kv(x).view(b, n, 2, self.kv_heads, self.head_dim).permute(2, 0, 3, 1, 4)
        q, k = example.rotate(q, cos, sin), example.rotate(k, cos, sin) + self.k_bias
        if chunk is None:
            out = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        else:
            out = paged_attention(q, k, v, chunk, self.layer_idx, scale)
        return self.out(out.transpose(1, 2).reshape(b, n, -1))

    return forward


def _with_key_bias(example, scale=None):
    torch.manual_seed(0)
    model = example.TinyGPT(vocab=61, dim=32, heads=4, kv_heads=2, hidden=48)
    for block in model.blocks:
        block.attn.k_bias = torch.nn.Parameter(torch.randn(2, 1, 8))
        block.attn.forward = types.MethodType(_attention(example, scale), block.attn)
    return model.double()


def test_check_chunking_floors_gradients_that_are_zero_in_exact_arithmetic(example):
    """A key bias's gradient is rounding noise on both sides: compared relative to itself it refused a correct
    model (relative error 1.1)."""
    ids = torch.randint(0, 61, (2, 53), generator=torch.Generator().manual_seed(1))
    assert check_chunking(_with_key_bias(example, scale=8**-0.5), ids) <= 1e-10


def test_paged_attention_takes_scale_none_as_sdpa_does(example):
    """``scale=None`` is ``1/sqrt(head_dim)`` on every backend (the torch reference raised a TypeError)."""
    model = _with_key_bias(example)
    ids = torch.randint(0, 61, (2, 53), generator=torch.Generator().manual_seed(1))
    model(ids).backward()
    want = {n: p.grad.clone() for n, p in model.named_parameters() if "k_bias" not in n}
    for backend in ("torch", "cpu"):
        model.zero_grad()
        OOMBEngine(model, OOMBConfig(16, 8, attention_backend=backend)).loss(ids).backward()
        assert max_relative_error({n: model.get_parameter(n).grad for n in want}, want) <= 1e-10


def test_a_call_with_other_keywords_is_refused_naming_them(example):
    """(``model(x, targets=y)`` raised "forward() got an unexpected keyword argument 'targets'" from the mixin.)"""
    model = example.TinyGPT(vocab=61, dim=32, heads=4, kv_heads=2, hidden=48).double()
    ids = torch.randint(0, 61, (2, 53), generator=torch.Generator().manual_seed(1))
    with pytest.raises(OOMBConfigError, match=r"called with \['targets'\].*override answer_calls"):
        oomb_step_through_trainer(model, ids, OOMBConfig(16, 8), loss_of=lambda m, b: m(b, targets=b))
