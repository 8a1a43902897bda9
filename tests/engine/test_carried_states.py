"""The engine's carried states (``lightning_oomb.engine.states``) with a plain-torch model: a gated linear
recurrence (its state crosses every chunk boundary) before one attention layer. float64, against the model's own
full-sequence training: loss and every gradient to 1e-10, with ragged chunks, per-layer checkpointing (the layer
reports its state twice per chunk; the first report counts) and evaluation (only the previous chunk's states
held)."""

from __future__ import annotations

import weakref

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from lightning_oomb.engine import (
    ChunkContext,
    LMHead,
    ManagedModelMixin,
    OOMBConfig,
    OOMBEngine,
    paged_attention,
)
from tests.helpers.models import grads_of, max_relative_error


class RecurrentLM(ManagedModelMixin, nn.Module):
    """Embedding -> h_t = sigmoid(a) * h_{t-1} + W x_t (a state carried across chunks) -> causal attention."""

    carries_states = True

    def __init__(self, vocab: int = 32, dim: int = 16) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.decay = nn.Parameter(torch.randn(dim))
        self.inp = nn.Linear(dim, dim)
        self.qkv = nn.Linear(dim, 3 * dim)
        self.head = nn.Linear(dim, vocab, bias=False)
        self.num_layers, self.kv_heads, self.head_dim = 1, 1, dim
        self.vocab_size = self.num_embeddings = vocab

    def recur(self, x: torch.Tensor, chunk: ChunkContext | None) -> torch.Tensor:
        h = None if chunk is None else chunk.states.incoming("h")
        h = x.new_zeros(x.shape[0], x.shape[2]) if h is None else h
        outs = []
        for t in range(x.shape[1]):
            h = torch.sigmoid(self.decay) * h + self.inp(x[:, t])
            outs.append(h)
        if chunk is not None:
            chunk.states.outgoing("h", h)
        return torch.stack(outs, 1)

    def embedded(self, input_ids: torch.Tensor, chunk: ChunkContext | None) -> torch.Tensor:
        return self.embed(input_ids)

    def hidden_states(self, input_ids, position_ids, chunk: ChunkContext | None = None) -> torch.Tensor:
        x = self.embedded(input_ids, chunk)
        if self.layer_checkpointing and torch.is_grad_enabled():
            y = checkpoint(self.recur, x, chunk, use_reentrant=False)
        else:
            y = self.recur(x, chunk)
        q, k, v = (t[:, None] for t in self.qkv(y).chunk(3, -1))  # one head
        scale = self.head_dim**-0.5
        if chunk is None:
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale)
        else:
            out = paged_attention(q, k, v, chunk, 0, scale)
        return y + out[:, 0]

    def lm_head(self) -> LMHead:
        return LMHead(self.head.weight)

    def full_sequence_loss(self, ids: torch.Tensor) -> torch.Tensor:
        logits = self.head(self.hidden_states(ids, None))[:, :-1]
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1))


def model_and_ids(seq: int = 45):
    torch.manual_seed(0)
    model = RecurrentLM().double()
    return model, torch.randint(0, 32, (2, seq), generator=torch.Generator().manual_seed(1))


@pytest.mark.parametrize("offload", [False, True], ids=["on-device", "host-buffer"])
@pytest.mark.parametrize("checkpointing", [False, True])
@pytest.mark.parametrize("chunk_size", [64, 16, 8])
def test_states_and_their_gradients_cross_chunk_boundaries_exactly(chunk_size, checkpointing, offload):
    """On the device or, under offload, through the host buffer (two steps: the second reuses it)."""
    model, ids = model_and_ids()
    want_loss = model.full_sequence_loss(ids)
    want_loss.backward()
    want = grads_of(model)
    model.layer_checkpointing = checkpointing
    engine = OOMBEngine(model, OOMBConfig(chunk_size, 8, attention_backend="torch", offload=offload))
    for _ in range(2):
        model.zero_grad()
        loss = engine.loss(ids)
        loss.backward()
        assert abs(loss.item() - want_loss.item()) <= 1e-10 * want_loss.item()
        assert max_relative_error(grads_of(model), want) <= 1e-10
    held = (-(-45 // chunk_size) - 1) * 2 * 16 * 8  # the boundaries' [B, dim] float64 states
    on_device, on_host = (0, held) if offload else (held, 0)
    assert engine.stats.extra["carried_state_bytes"] == on_device
    assert engine.stats.extra["carried_state_host_bytes"] == on_host
    assert engine.evaluate(ids).item() == pytest.approx(want_loss.item(), rel=1e-12)


class WatchedStates(RecurrentLM):
    """Counts, at each chunk's recompute in the backward sweep, how many states reported earlier in it are alive."""

    def recur(self, x: torch.Tensor, chunk: ChunkContext | None) -> torch.Tensor:
        if torch.is_grad_enabled() and chunk is not None:
            self.alive.append(sum(ref() is not None for ref in self.reported))
            states, report = chunk.states, chunk.states.outgoing

            def outgoing(name, state):
                self.reported.append(weakref.ref(state))
                return report(name, state)

            states.outgoing = outgoing
        return super().recur(x, chunk)


def test_a_chunks_outgoing_states_are_freed_before_the_next_chunks_recompute():
    """After a chunk's backward its outgoing states (the boundary its gradients flowed in through) are dropped: a
    Mamba2 layer's is a view of its whole scan, which stayed alive through the next chunk's recompute."""
    torch.manual_seed(0)
    _, ids = model_and_ids()
    model = WatchedStates().double()
    model.reported, model.alive = [], []
    OOMBEngine(model, OOMBConfig(16, 8, attention_backend="torch")).loss(ids).backward()
    assert model.alive == [
        0,
        0,
        0,
    ]  # chunks 2, 1, 0 (was [0, 0, 1]: chunk 1's states through chunk 0's recompute)


def test_right_padding_with_transformers_padded_positions_is_no_packing():
    """Positions as transformers makes them for a padded row (``mask.cumsum(-1) - 1``, the padding filled with 1s)
    restart inside the padding: they were read as packed documents, which a model carrying states refuses. A
    restart in a row's padding is none: the same loss as the mask alone."""
    model, ids = model_and_ids(32)
    mask = torch.ones_like(ids)
    mask[1, 20:] = 0
    positions = (mask.cumsum(-1) - 1).masked_fill(mask == 0, 1)
    engine = OOMBEngine(model, OOMBConfig(16, 8, attention_backend="torch"))
    want = engine.evaluate(ids, attention_mask=mask).item()
    assert engine.evaluate(ids, position_ids=positions, attention_mask=mask).item() == want


def test_a_boundary_that_does_not_fit_the_host_layout_stays_on_the_device():
    """The host buffer is laid out from the first boundary's states; a later boundary reporting others (a model
    whose states change shape) keeps them on the device, and both come back as they went."""
    from lightning_oomb.engine.states import CarriedStates, ChunkStates, HostStates

    states = CarriedStates(host=HostStates(), boundaries=2)
    first, second = (
        {"h": torch.randn(2, 3)},
        {"h": torch.randn(2, 5), "c": torch.randn(4, dtype=torch.float64)},
    )
    for index, reported in enumerate((first, second)):
        states.forward_chunk(index)
        chunk = ChunkStates({})
        chunk.reported.update(reported)
        states.finish_forward(index, chunk)
    states.forward_chunk(2)
    assert states.host_nbytes == 2 * 24 and states.nbytes == 2 * 5 * 4 + 4 * 8  # the second boundary's
    for index, reported in ((2, second), (1, first)):
        back = states.backward_chunk(index)
        assert all(torch.equal(back.incoming(key), value) for key, value in reported.items())


def test_without_carrying_the_state_the_gradients_are_wrong():
    """Negative control: the same model declaring no carried states starts every chunk from zeros."""
    model, ids = model_and_ids()
    want_loss = model.full_sequence_loss(ids)
    model.carries_states = False
    model.recur = lambda x, chunk: RecurrentLM.recur(model, x, None)  # the layer without the chunk's states
    loss = OOMBEngine(model, OOMBConfig(16, 8, attention_backend="torch")).loss(ids)
    assert abs(loss.item() - want_loss.item()) > 1e-3


def test_context_parallelism_is_refused_for_carried_states():
    """A state runs through a chunk token by token: a chunk cannot be split across ranks (checked at the step's
    planning, before any allocation)."""
    from lightning_oomb.engine.errors import OOMBConfigError
    from lightning_oomb.engine.recurrence import check_carried_states

    with pytest.raises(OOMBConfigError, match="context group.*context_parallel_size=1"):
        check_carried_states([(0, 16), (16, 32)], layout=object(), doc_start=None)
    check_carried_states([(0, 16), (16, 32)], layout=None, doc_start=None)  # one device: fine
    # and already when the engine is built (the strategy builds it at setup, before the optimizer and the sanity
    # validation): the model's adapter says it carries states
    from types import SimpleNamespace

    model = SimpleNamespace(carries_states=True)
    with pytest.raises(OOMBConfigError, match="context group.*context_parallel_size=1"):
        OOMBEngine(model, OOMBConfig(16, 8), context=SimpleNamespace(size=2))


# ------------------------------------------------------------------------------ how a model reports its state
class ReportingLM(RecurrentLM):
    """The recurrence reporting its state one way: ``"right"``; ``"broadcast"`` (``h[:1]``, broadcast over the
    batch by the next chunk); ``"recast"`` (the first chunk's in float32); ``"early"`` (the state after the chunk's
    second-to-last token); ``"detached"``; ``"stopped"`` (``grad=False``: a stop-gradient by design, whose
    full-sequence reference detaches ``h`` every ``stop_every`` tokens); ``"stopped-forward-only"`` (``grad=False``
    in the forward sweep only)."""

    def __init__(self, report: str, stop_every: int | None = None) -> None:
        super().__init__()
        self.report, self.stop_every = report, stop_every

    def recur(self, x: torch.Tensor, chunk: ChunkContext | None) -> torch.Tensor:
        h = None if chunk is None else chunk.states.incoming("h")
        h = x.new_zeros(x.shape[0], x.shape[2]) if h is None else h
        outs = []
        for t in range(x.shape[1]):
            if chunk is None and self.stop_every and t and t % self.stop_every == 0:
                h = h.detach()
            h = torch.sigmoid(self.decay) * h + self.inp(x[:, t])
            outs.append(h)
        if chunk is not None:
            states, report = chunk.states, self.report
            if report == "broadcast":
                states.outgoing("h", h[:1])
            elif report == "recast":
                states.outgoing("h", h if states.continues else h.float())
            elif report == "early":
                states.outgoing("h", outs[-2])
            elif report == "detached":
                states.outgoing("h", h.detach())
            elif report in ("stopped", "stopped-forward-only"):
                states.outgoing("h", h, grad=report == "stopped-forward-only" and torch.is_grad_enabled())
            else:
                states.outgoing("h", h)
        return torch.stack(outs, 1)


def reporting_model(report: str, stop_every: int | None = None) -> RecurrentLM:
    model, _ = model_and_ids()
    reporting = ReportingLM(report, stop_every).double()
    reporting.load_state_dict(model.state_dict())
    return reporting


def engine_step(model, ids, chunk_size: int = 16) -> tuple[torch.Tensor, dict]:
    model.zero_grad()
    loss = OOMBEngine(model, OOMBConfig(chunk_size, 8, attention_backend="torch")).loss(ids)
    loss.backward()
    return loss.detach(), grads_of(model)


def test_a_state_reported_in_another_shape_or_dtype_is_refused():
    """The next chunk would compute with a broadcast (``h[:1]`` for ``h [B, dim]``) or recast state: refused when
    reported (the forward sweep), naming the key, both shapes and the fix. The check compares each report with the
    state the chunk started from, and the batch size; the first chunk's report is what the second one starts
    from."""
    from lightning_oomb.engine import OOMBConfigError
    from lightning_oomb.engine.states import ChunkStates

    _, ids = model_and_ids()
    with pytest.raises(OOMBConfigError, match=r"'h' is reported as \(1, 16\), with no dimension of the batch size 2.*outgoing\('h', h\) with h of shape \[batch, \.\.\.\]"):  # fmt: skip
        engine_step(reporting_model("broadcast"), ids)
    with pytest.raises(OOMBConfigError, match=r"reports the carried state 'h' as \(2, 16\) torch.float64, but started from it as \(2, 16\) torch.float32.*cast it back"):  # fmt: skip
        engine_step(reporting_model("recast"), ids)
    chunk = ChunkStates({"h": torch.zeros(2, 3)}, batch=2)
    with pytest.raises(
        OOMBConfigError, match=r"'h' as \(2, 1, 3\) torch.float32, but started from it as \(2, 3\)"
    ):
        chunk.outgoing("h", torch.zeros(2, 1, 3))
    chunk.outgoing("h", torch.zeros(2, 3))  # the same shape and dtype: fine
    ChunkStates(None, batch=1).outgoing("h", torch.zeros(1, 3))  # one sequence: any shape has its batch


def test_a_detached_state_is_refused_when_the_chunk_read_one_with_grad():
    """With a frozen parameter the every-parameter-trains rule does not apply; the chunk read ``h`` as a leaf with
    grad, so an outgoing state without grad was cut from it (silently wrong gradients before this check)."""
    from lightning_oomb.engine import OOMBConfigError

    model, ids = reporting_model("detached"), model_and_ids()[1]
    model.qkv.requires_grad_(False)  # off the state's path
    with pytest.raises(OOMBConfigError, match=r"'h' was reported without grad .*although the chunk read the incoming state 'h' \(with grad\).*grad=False\)"):  # fmt: skip
        engine_step(model, ids)


class FrozenConvLM(RecurrentLM):
    """A frozen short causal convolution (kernel 3) on the frozen embedding before the trainable recurrence; its
    carried state is the last two convolution inputs, cut from ``cat([incoming, inputs])`` (``sliced=False``) or
    from the chunk's inputs alone (``sliced=True``: no grad, though the chunk read states with grad)."""

    def __init__(self, sliced: bool = False) -> None:
        super().__init__()
        self.sliced = sliced
        self.conv = nn.Conv1d(16, 16, 3, groups=16, bias=False)
        for frozen in (self.embed, self.conv):
            frozen.requires_grad_(False)

    def embedded(self, input_ids: torch.Tensor, chunk: ChunkContext | None) -> torch.Tensor:
        x = self.embed(input_ids)
        u = x.transpose(1, 2)  # [B, dim, L]
        past = None if chunk is None else chunk.states.incoming("conv")
        full = torch.cat([u.new_zeros(*u.shape[:2], 2) if past is None else past, u], -1)
        if chunk is not None:
            chunk.states.outgoing("conv", (u if self.sliced else full)[..., -2:])
        return x + self.conv(full).transpose(1, 2)


def test_a_frozen_layers_convolution_state_trains_exactly():
    """Legitimate states without grad pass: the first chunk's convolution state (frozen embedding and
    convolution) reads nothing and depends on nothing trainable; later chunks' come from the incoming state. One
    cut from the chunk's inputs alone has no grad in a chunk that read states with grad: refused, naming how to
    report it."""
    from lightning_oomb.engine import OOMBConfigError

    torch.manual_seed(0)
    model = FrozenConvLM().double()
    ids = model_and_ids()[1]
    want_loss = model.full_sequence_loss(ids)
    want_loss.backward()
    want = grads_of(model)
    loss, grads = engine_step(model, ids, 8)
    assert abs(loss.item() - want_loss.item()) <= 1e-10 * want_loss.item()
    assert max_relative_error(grads, want) <= 1e-10
    model.sliced = True
    with pytest.raises(OOMBConfigError, match=r"'conv' was reported without grad.*although the chunk read the incoming states 'conv', 'h' \(with grad\).*torch.cat\(\[incoming, inputs\], -1\)"):  # fmt: skip
        engine_step(model, ids, 8)


@pytest.mark.parametrize("checkpointing", [False, True])
@pytest.mark.parametrize("chunk_size", [16, 8])
def test_a_state_reported_with_grad_false_stops_its_gradient_exactly(chunk_size, checkpointing):
    """``outgoing(key, state, grad=False)`` (a Transformer-XL-style memory): neither refused nor back-propagated
    into — the step equals full-sequence training that detaches the state at every chunk boundary, in float64,
    and differs from training through it."""
    model = reporting_model("stopped", stop_every=chunk_size)
    _, ids = model_and_ids()
    want_loss = model.full_sequence_loss(ids)
    want_loss.backward()
    want = grads_of(model)
    model.layer_checkpointing = checkpointing
    loss, grads = engine_step(model, ids, chunk_size)
    assert abs(loss.item() - want_loss.item()) <= 1e-10 * want_loss.item()
    assert max_relative_error(grads, want) <= 1e-10
    model.zero_grad()
    model.stop_every = None
    model.full_sequence_loss(ids).backward()
    assert max_relative_error(grads_of(model), want) > 1e-3  # the stop changes the gradients


def test_a_state_reported_with_grad_false_in_one_sweep_only_is_refused():
    from lightning_oomb.engine import OOMBConfigError

    _, ids = model_and_ids()
    with pytest.raises(OOMBConfigError, match=r"'h' was reported with grad=False in the forward sweep but grad=True when the backward sweep recomputed"):  # fmt: skip
        engine_step(reporting_model("stopped-forward-only"), ids)


@pytest.mark.parametrize("checkpointing", [False, True])
def test_check_chunking_catches_a_state_reported_a_token_early(checkpointing):
    """No engine check can see a state reported after the chunk's second-to-last token; ``check_chunking``
    (a step in chunks against the same step in one chunk, no state carried, in float64) does, and passes the
    model that reports the right one. The checked model is left as it was."""
    from lightning_oomb.engine import OOMBConfigError, check_chunking

    _, ids = model_and_ids()
    right = reporting_model("right")
    before = {n: p.clone() for n, p in right.named_parameters()}
    assert (
        check_chunking(right.float(), ids, layer_checkpointing=checkpointing) <= 1e-10
    )  # a float64 copy trains
    assert all(p.dtype == torch.float32 and p.grad is None for p in right.parameters())
    assert all(torch.equal(p.double(), before[n]) for n, p in right.named_parameters())
    with pytest.raises(
        OOMBConfigError, match=r"trains differently in chunks of 8 tokens .* relative error of"
    ):
        check_chunking(
            reporting_model("early"), ids, chunk_size=8, page_size=8, layer_checkpointing=checkpointing
        )


def test_check_chunking_refuses_what_it_cannot_check():
    from lightning_oomb.engine import OOMBConfigError, check_chunking

    model, ids = model_and_ids()
    with pytest.raises(OOMBConfigError, match="makes one chunk of the 45 tokens"):
        check_chunking(model, ids, chunk_size=48)
    with pytest.raises(OOMBConfigError, match="takes an nn.Module"):
        check_chunking(object(), ids)
