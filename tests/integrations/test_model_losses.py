"""A model whose own training loss is not the next-token cross-entropy OOMB computes in its place is refused, not
trained silently on another loss: a loss function set on the model, a ``loss_type`` naming another loss, a
subclass's ``forward`` or ``loss_function`` (a z-loss, label smoothing); the self-check compares the twin's own
loss with OOMB's. And the self-check leaves the user's random state as it found it, and says why where it
cannot run."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
import transformers as tf

from lightning_oomb.engine import OOMBConfigError
from lightning_oomb.integrations.hf import HFChunkModel, check_supported, support
from tests.helpers.models import build_causal_lm


def smoothed(logits, labels, vocab_size, num_items_in_batch=None, ignore_index=-100, **kwargs):
    """Label smoothing through transformers' ``loss_function`` hook."""
    labels = F.pad(labels, (0, 1), value=ignore_index)[..., 1:]
    return F.cross_entropy(logits.reshape(-1, vocab_size), labels.reshape(-1), ignore_index=ignore_index,
                           label_smoothing=0.3)  # fmt: skip


class ZLossLlama(tf.LlamaForCausalLM):
    """A subclass whose forward adds a z-loss to transformers' loss."""

    def forward(self, input_ids=None, labels=None, **kwargs):
        out = super().forward(input_ids=input_ids, labels=labels, **kwargs)
        if labels is not None:
            out.loss = out.loss + 0.5 * torch.logsumexp(out.logits, -1).pow(2).mean()
        return out


class SmoothedLlama(tf.LlamaForCausalLM):
    """A subclass that replaces the loss function itself."""

    @property
    def loss_function(self):
        return smoothed


class HelperLlama(tf.LlamaForCausalLM):
    """A subclass that adds a method, not a loss: transformers' forward and loss."""

    def parameter_count(self) -> int:
        return sum(p.numel() for p in self.parameters())


def build(cls=tf.LlamaForCausalLM):
    model = build_causal_lm("llama")
    torch.manual_seed(0)
    return cls(model.config).double()


def test_a_loss_function_set_on_the_model_is_refused():
    model = build()
    model.loss_function = smoothed
    with pytest.raises(OOMBConfigError, match=r"own loss \(model.loss_function = smoothed.*strategy='auto'"):
        check_supported(model)
    del model._loss_function
    check_supported(model)


@pytest.mark.parametrize(
    ("cls", "match"),
    [
        (ZLossLlama, r"its forward, defined by .*ZLossLlama"),
        (SmoothedLlama, r"its loss_function, defined by .*Smoothed"),
    ],
)
def test_a_subclass_that_computes_its_own_loss_is_refused(cls, match):
    with pytest.raises(OOMBConfigError, match=match + r".*training_step"):
        check_supported(build(cls))


def test_a_subclass_with_transformers_forward_and_loss_is_accepted():
    check_supported(build(HelperLlama))
    assert HFChunkModel(build(HelperLlama), verify_exactness=True).num_layers == 2


@pytest.mark.parametrize(("loss_type", "refused"), [("ForMaskedLM", True), ("ForCausalLM", False),
                                                    ("ForConditionalGeneration", False), (None, False)])  # fmt: skip
def test_a_loss_type_naming_another_loss_is_refused(loss_type, refused):
    model = build()
    model.loss_type = loss_type  # transformers' loss_function reads it (None: its causal-LM loss)
    if refused:
        with pytest.raises(OOMBConfigError, match=r"loss_type='ForMaskedLM'.*ForMaskedLMLoss"):
            check_supported(model)
    else:
        check_supported(model)


def test_the_self_check_refuses_a_twin_whose_own_loss_differs(monkeypatch):
    """What a static reading cannot see — transformers' causal-LM loss replaced for every model, or a subclass
    past the static rules — the twin's own loss shows: refused with the measured difference."""
    from transformers.loss.loss_utils import LOSS_MAPPING

    monkeypatch.setattr(support, "_verdicts", {})
    monkeypatch.setitem(LOSS_MAPPING, "ForCausalLM", smoothed)
    with pytest.raises(OOMBConfigError, match=r"self-check.*its own training loss .* relative error of"):
        support.verify_exactness(build(), HFChunkModel)
    monkeypatch.setattr(support, "_verdicts", {})
    monkeypatch.setitem(
        LOSS_MAPPING, "ForCausalLM", LOSS_MAPPING["ForConditionalGeneration"]
    )  # the plain one
    assert support.verify_exactness(build(), HFChunkModel) is True
    monkeypatch.setattr(support, "_own_loss", lambda model: None)  # a subclass the static rules do not see
    with pytest.raises(OOMBConfigError, match=r"self-check.*its own training loss"):
        support.verify_exactness(build(ZLossLlama), HFChunkModel)


@pytest.mark.parametrize("cached", [False, True], ids=["first-check", "cached-verdict"])
def test_the_self_check_leaves_the_random_state_as_it_was(cached, monkeypatch):
    """Under ``seed_everything(s)`` the draws after setup (shuffles, dropout masks) follow ``s``, whether the
    check builds its twin (seeding it) or finds its verdict cached: the same draws as without the check."""
    model = build()
    monkeypatch.setattr(support, "_verdicts", {})
    if cached:
        assert support.verify_exactness(model, HFChunkModel) is True
    draws = {}
    for seed in (1, 2):
        torch.manual_seed(seed)
        want = torch.rand(4)
        torch.manual_seed(seed)
        assert HFChunkModel(model, verify_exactness=True) is not None
        draws[seed] = torch.rand(4)
        assert torch.equal(draws[seed], want)
    assert not torch.equal(draws[1], draws[2])


def test_a_cached_verdict_builds_no_twin(monkeypatch):
    """The verdict is looked up before the twin is built: a second model of the architecture costs no twin."""
    monkeypatch.setattr(support, "_verdicts", {})
    assert support.verify_exactness(build(), HFChunkModel) is True

    def no_twin(*args, **kwargs):
        raise AssertionError("a twin was built for a cached verdict")

    monkeypatch.setattr(support, "_twin", no_twin)
    assert support.verify_exactness(build(), HFChunkModel) is True


@pytest.mark.parametrize("cause", ["twin-too-big", "twin-cannot-train"])
def test_a_model_the_self_check_cannot_check_is_accepted_with_a_warning_naming_why(cause, monkeypatch):
    """Where no twin can be checked, the model passes on the static rules alone, and the user is told so and why
    (not silently): here a twin over the size limit, and a twin whose own training fails (Xmod's without a
    default language)."""
    monkeypatch.setattr(support, "_verdicts", {})
    if cause == "twin-too-big":
        monkeypatch.setattr(support, "_TWIN_MAX_PARAMETERS", 10)
        why = r"no tiny twin could be built: ValueError: the twin would have \d+ parameters"
        model = build()
    else:
        why = r"its tiny twin cannot train itself: ValueError: Input language unknown"
        config = tf.XmodConfig(vocab_size=96, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                               intermediate_size=32, is_decoder=True, attention_probs_dropout_prob=0.0)  # fmt: skip
        model = tf.XmodForCausalLM(config)
    with pytest.warns(UserWarning, match=rf"could not check \w+ \({why}.*unverified.*verify_exactness=False"):
        assert support.verify_exactness(model, HFChunkModel) is False
    with pytest.warns(UserWarning, match=why):  # through the adapter the strategy builds, the verdict cached
        HFChunkModel(model, verify_exactness=True)
