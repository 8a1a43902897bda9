"""What a custom model or its caller can get wrong around the engine, refused with a message that names the cause
and the fix instead of training silently wrong or failing obscurely: carried states forgotten, misnamed or cut
from the graph; ``engine.loss`` under inference mode; inputs edited in place by the model or between the sweeps;
a second backward of one step. The model is the carried-state test's recurrence (float64, two chunk boundaries)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from torch.utils.checkpoint import checkpoint

from lightning_oomb.engine import OOMBConfig, OOMBConfigError, OOMBEngine
from tests.engine.test_carried_states import RecurrentLM, model_and_ids
from tests.helpers.models import grads_of, max_relative_error


class FaultyStates:
    """A chunk's states as a faulty layer handles them: ``"forgotten"`` (never reported), ``"misnamed"`` (reported
    as ``"H"``), ``"detached"`` (reported without graph), ``"detached-incoming"`` (read, then detached),
    ``"only-without-grad"`` (reported in the forward sweep only)."""

    def __init__(self, states, fault: str) -> None:
        self.states, self.fault = states, fault

    def incoming(self, key):
        state = self.states.incoming(key)
        return state.detach() if self.fault == "detached-incoming" and state is not None else state

    def outgoing(self, key, state) -> None:
        if self.fault == "forgotten" or (self.fault == "only-without-grad" and torch.is_grad_enabled()):
            return
        state = state.detach() if self.fault == "detached" else state
        self.states.outgoing(key.upper() if self.fault == "misnamed" else key, state)


class FaultyLM(RecurrentLM):
    """The recurrence with one fault in how it carries its state (``"reentrant-checkpoint"``: it runs in a
    reentrant checkpoint, whose forward has no graph, so the state it reports has none)."""

    def __init__(self, fault: str) -> None:
        super().__init__()
        self.fault = fault

    def recur(self, x, chunk):
        faulty = None if chunk is None else SimpleNamespace(states=FaultyStates(chunk.states, self.fault))
        if self.fault == "reentrant-checkpoint" and torch.is_grad_enabled():
            return checkpoint(super().recur, x, faulty, use_reentrant=True)
        return super().recur(x, faulty)


def faulty_model_and_ids(fault: str):
    model, ids = model_and_ids()
    faulty = FaultyLM(fault).double()
    faulty.load_state_dict(model.state_dict())
    return faulty, ids


def engine_of(model) -> OOMBEngine:
    return OOMBEngine(model, OOMBConfig(16, 8, attention_backend="torch"))


@pytest.mark.parametrize("sweep", ["loss", "evaluate"])
@pytest.mark.parametrize("fault", ["forgotten", "misnamed"])
def test_a_state_the_previous_chunk_did_not_report_is_refused(fault, sweep):
    """The layer would restart from its zero state in mid-sequence; the first chunk legitimately reads None."""
    model, ids = faulty_model_and_ids(fault)
    reported = "'H'" if fault == "misnamed" else "none"
    with pytest.raises(OOMBConfigError, match=rf"state 'h', which the previous chunk did not report \(it reported {reported}\).*outgoing\('h', state\)"):  # fmt: skip
        getattr(engine_of(model), sweep)(ids)


CUT = {  # fault: what the backward sweep says
    "detached": "'h' was reported without grad.*use_reentrant=False",
    "reentrant-checkpoint": "'h' was reported without grad.*use_reentrant=False",
    "detached-incoming": "read the carried state 'h' but no gradient reached it",
    "only-without-grad": "'h' was reported in the forward sweep but not when the backward sweep recomputed",
}


@pytest.mark.parametrize("fault", CUT)
def test_a_state_cut_from_the_graph_is_refused(fault):
    """No gradient would flow back through the state to the earlier chunks: the forward sweep's loss is right,
    the gradients silently wrong — refused by the backward sweep."""
    model, ids = faulty_model_and_ids(fault)
    loss = engine_of(model).loss(ids)
    with pytest.raises(OOMBConfigError, match=CUT[fault]):
        loss.backward()


def test_a_state_without_grad_is_refused_only_when_every_parameter_trains():
    """With the recurrence frozen, the first chunk's state depends on no trainable parameter: it has no grad, and
    dropping the gradient the next chunk hands it is exact. With every parameter training, the same state without
    grad can only have been detached."""
    model, ids = model_and_ids()
    for frozen in (model.embed, model.inp):
        frozen.requires_grad_(False)
    model.decay.requires_grad_(False)
    want_loss = model.full_sequence_loss(ids)
    want_loss.backward()
    want = grads_of(model)
    model.zero_grad()
    loss = engine_of(model).loss(ids)
    loss.backward()
    assert abs(loss.item() - want_loss.item()) <= 1e-10 * want_loss.item()
    assert max_relative_error(grads_of(model), want) <= 1e-10

    model, ids = faulty_model_and_ids("detached")
    with pytest.raises(OOMBConfigError, match="without grad.*although every parameter trains"):
        engine_of(model).loss(ids).backward()


def test_loss_under_inference_mode_points_to_evaluate():
    model, ids = model_and_ids()
    engine = engine_of(model)
    with torch.inference_mode():
        with pytest.raises(OOMBConfigError, match=r"engine.loss under torch.inference_mode.*engine.evaluate"):
            engine.loss(ids)
        assert engine.evaluate(ids).item() == pytest.approx(model.full_sequence_loss(ids).item(), rel=1e-12)


class ClampingLM(RecurrentLM):
    """Maps its reserved top token ids onto one, in place on the ids it is given."""

    def hidden_states(self, input_ids, position_ids, chunk=None):
        input_ids.clamp_(max=self.vocab_size - 3)
        return super().hidden_states(input_ids, position_ids, chunk)


def test_an_in_place_edit_names_who_made_it():
    """The backward sweep recomputes from the inputs and weights as they are then: an edit by the model itself is
    refused when the forward sweep ends, one by the caller between the sweeps when the backward begins."""
    _, ids = model_and_ids()
    with pytest.raises(RuntimeError, match=r"input_ids was modified in place while engine.loss ran the model's forward sweep \(the model itself.*out-of-place"):  # fmt: skip
        engine_of(ClampingLM().double()).loss(ids)

    model, ids = model_and_ids()
    loss = engine_of(model).loss(ids)
    with torch.no_grad():
        model.decay.add_(0.1)
    with pytest.raises(RuntimeError, match=r"a parameter was modified in place between engine.loss and its backward \(by the caller, e.g. optimizer.step\(\)"):  # fmt: skip
        loss.backward()


def test_a_second_backward_of_one_step_names_the_fix():
    model, ids = model_and_ids()
    loss = engine_of(model).loss(ids)
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="a second time.*once per engine.loss.*engine.loss again for each micro-batch"):  # fmt: skip
        loss.backward()
