"""The engine's carried states (``lightning_oomb.engine.states``) with a plain-torch model: a gated linear
recurrence (its state crosses every chunk boundary) before one attention layer. float64, against the model's own
full-sequence training: loss and every gradient to 1e-10, with ragged chunks, per-layer checkpointing (the layer
reports its state twice per chunk; the first report counts) and evaluation (only the previous chunk's states
held)."""

from __future__ import annotations

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

    def hidden_states(self, input_ids, position_ids, chunk: ChunkContext | None = None) -> torch.Tensor:
        x = self.embed(input_ids)
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
