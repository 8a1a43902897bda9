"""What ``paged_attention`` does with the calls a custom model makes: any head-dim stride on the fused CPU backend is
exact, and a call the pool cannot serve — a layer index out of range or used twice in a chunk, K/V of another dtype
than the step's, tensors that do not fit the chunk or the model's shape — is refused with an ``OOMBConfigError``
before it overwrites pages or reads past them."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from lightning_oomb.engine import (
    LMHead,
    ManagedModelMixin,
    OOMBConfig,
    OOMBConfigError,
    OOMBEngine,
    cpu_attention,
    paged_attention,
)
from tests.helpers.attention import dense_attention, from_pages, shuffled_pages
from tests.helpers.models import max_relative_error

VOCAB, SEQ, PAGE = 53, 40, 8
TOL = 1e-12  # float64


def head_dim_strided(x: torch.Tensor) -> torch.Tensor:
    """``x``'s values with a head-dim stride other than 1 (as ``(W @ x^T)^T`` makes them)."""
    return x.transpose(-1, -2).contiguous().transpose(-1, -2)


def every_other_column(x: torch.Tensor) -> torch.Tensor:
    """``x``'s values read from every other column of a twice wider tensor (head-dim stride 2)."""
    return torch.stack([x, torch.full_like(x, 7.0)], -1)[..., 0]


class TinyCalls(ManagedModelMixin, nn.Module):
    """A float64 model of ``calls`` causal attention calls on the residual stream (no positions needed: the causal
    mask orders the tokens). ``edit(i, q, k, v) -> (q, k, v, layer)`` makes call ``i``'s tensors and the layer index
    it passes (default: as projected, ``i``); the full-sequence reference (``chunk=None``) attends the edited tensors
    with the textbook oracle. Each call is checkpointed when ``layer_checkpointing`` is on."""

    def __init__(
        self, calls: int = 2, edit=None, num_layers: int | None = None, heads=4, kv_heads=2, head_dim=8
    ):
        super().__init__()
        torch.manual_seed(0)
        dim = 32
        self.embed = nn.Embedding(VOCAB, dim)
        self.qkv = nn.ModuleList(nn.Linear(dim, (heads + 2 * kv_heads) * head_dim) for _ in range(calls))
        self.out = nn.ModuleList(nn.Linear(heads * head_dim, dim) for _ in range(calls))
        self.head = nn.Linear(dim, VOCAB, bias=False)
        self.split = (heads, kv_heads, kv_heads)
        self.edit = edit or (lambda i, q, k, v: (q, k, v, i))
        self.num_layers = calls if num_layers is None else num_layers
        self.kv_heads, self.head_dim, self.vocab_size, self.num_embeddings = kv_heads, head_dim, VOCAB, VOCAB
        self.double()

    def attend(self, i: int, x: torch.Tensor, chunk) -> torch.Tensor:
        b, n, _ = x.shape
        q, k, v = self.qkv[i](x).view(b, n, -1, self.head_dim).transpose(1, 2).split(self.split, 1)
        q, k, v, layer = self.edit(i, q, k, v)
        scale = self.head_dim**-0.5
        out = (
            dense_attention(q, k, v, 0, scale)
            if chunk is None
            else paged_attention(q, k, v, chunk, layer, scale)
        )
        return x + self.out[i](out.to(x.dtype).transpose(1, 2).reshape(b, n, -1))

    def hidden_states(self, input_ids, position_ids, chunk=None):
        x = self.embed(input_ids)
        for i in range(len(self.qkv)):
            if self.layer_checkpointing and torch.is_grad_enabled():
                x = checkpoint(self.attend, i, x, chunk, use_reentrant=False)
            else:
                x = self.attend(i, x, chunk)
        return x

    def lm_head(self) -> LMHead:
        return LMHead(self.head.weight)

    def reference_loss(self, ids: torch.Tensor) -> torch.Tensor:
        logits = self.head(self.hidden_states(ids, None))[:, :-1]
        return F.cross_entropy(logits.reshape(-1, VOCAB), ids[:, 1:].reshape(-1))


def token_ids(seq: int = SEQ) -> torch.Tensor:
    return torch.randint(0, VOCAB, (2, seq), generator=torch.Generator().manual_seed(1))


def assert_exact(model: TinyCalls, config: OOMBConfig) -> OOMBEngine:
    """One OOMB step of ``model`` equals its full-sequence training in float64 (loss and every gradient)."""
    ids = token_ids()
    model.zero_grad()
    want_loss = model.reference_loss(ids)
    want_loss.backward()
    want = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    engine = OOMBEngine(model, config)
    loss = engine.loss(ids)
    loss.backward()
    assert abs(loss.item() - want_loss.item()) <= TOL * want_loss.item()
    assert max_relative_error({n: p.grad for n, p in model.named_parameters()}, want) <= TOL
    return engine


# ---------------------------------------------------------------------------------------- strides (CPU backend)
@pytest.mark.parametrize("layout", [head_dim_strided, every_other_column])
@pytest.mark.parametrize("odd", ["q", "out"])
def test_cpu_backend_reads_any_head_dim_stride(odd, layout):
    """The fused kernels read the head dim as dense: a ``q`` (forward and backward) or an ``out`` (backward) with
    another stride gives the plain reference's output and gradients, over a past part and the chunk's own keys."""
    b, hq, hkv, lq, q_start, d = 2, 4, 2, 21, 16, 8
    gen = torch.Generator().manual_seed(0)
    q, dout = (torch.randn(b, hq, lq, d, generator=gen, dtype=torch.float64) for _ in "qd")
    k, v = (torch.randn(b, hkv, q_start + lq, d, generator=gen, dtype=torch.float64) for _ in "kv")
    kv, _ = shuffled_pages(k, v, PAGE, gen)
    leaves = [x.clone().requires_grad_() for x in (q, k, v)]
    want = dense_attention(*leaves, q_start, 0.3)
    want.backward(dout)
    out, lse = cpu_attention.paged_attention_forward(
        layout(q) if odd == "q" else q, kv.k, kv.v, kv.page_table, q_start, 0.3
    )
    assert (out - want).abs().max() <= TOL
    out = layout(out) if odd == "out" else out
    dk, dv = kv.dk.clone(), kv.dv.clone()
    dq = cpu_attention.paged_attention_backward(
        layout(q) if odd == "q" else q, out, lse, dout, kv.k, kv.v, dk, dv, kv.page_table, q_start, 0.3
    )
    n = q_start + lq
    got = (dq, from_pages(dk - kv.dk, kv.page_table, n), from_pages(dv - kv.dv, kv.page_table, n))
    for x, leaf in zip(got, leaves):
        assert (x - leaf.grad).abs().max() <= TOL * leaf.grad.abs().max()


@pytest.mark.parametrize("chunk_size", [SEQ, 16], ids=["1-chunk", "3-chunks"])
def test_a_model_with_strided_q_k_v_is_exact_on_the_cpu_backend(chunk_size):
    """A custom model's ``q, k, v`` with head-dim strides other than 1 train exactly (the pool copies K/V into its
    pages; the backend takes ``q`` as it comes)."""
    model = TinyCalls(
        edit=lambda i, q, k, v: (head_dim_strided(q), every_other_column(k), head_dim_strided(v), i)
    )
    assert_exact(model, OOMBConfig(chunk_size, PAGE, attention_backend="cpu"))


# ------------------------------------------------------------------------------------------------ layer indices
@pytest.mark.parametrize("layers", [(0, 0), (0, 1, 0)], ids=["every-call-0", "non-adjacent"])
@pytest.mark.parametrize("chunk_size", [SEQ, 16], ids=["1-chunk", "3-chunks"])
def test_a_layer_index_used_twice_in_a_chunk_is_refused(layers, chunk_size):
    """Two calls with one index would share pages (the second overwrites the first's K/V and gradients)."""
    model = TinyCalls(len(layers), lambda i, q, k, v: (q, k, v, layers[i]))
    with pytest.raises(OOMBConfigError, match=r"twice with layer=0 in one chunk .* its own layer index"):
        OOMBEngine(model, OOMBConfig(chunk_size, PAGE)).loss(token_ids())


@pytest.mark.parametrize("options", [{}, {"layer_checkpointing": True, "reuse_attention": True}])
def test_distinct_indices_pass_every_sweep(options):
    """The guard refuses only a repeat within one pass over a chunk: the backward sweep's recompute (with the
    checkpoint's second forward and the forward sweep's reused results) and an evaluation of the same chunks pass —
    and the same model with one index reused is refused (the guard is on)."""
    model = TinyCalls(3)
    engine = assert_exact(model, OOMBConfig(16, PAGE, **options))
    with torch.no_grad():
        assert abs(engine.evaluate(token_ids()).item() - model.reference_loss(token_ids()).item()) <= 1e-12
    model.edit = lambda i, q, k, v: (q, k, v, min(i, 1))
    with pytest.raises(OOMBConfigError, match="twice with layer=1"):
        engine.loss(token_ids())


@pytest.mark.parametrize("layer", [2, -1])
def test_a_layer_index_out_of_range_is_refused(layer):
    model = TinyCalls(2, lambda i, q, k, v: (q, k, v, layer if i else 0))
    with pytest.raises(OOMBConfigError, match=rf"layer={layer} but the model declares num_layers=2"):
        OOMBEngine(model, OOMBConfig(16, PAGE)).loss(token_ids())


# ----------------------------------------------------------------------------------------------------- K/V dtype
@pytest.mark.parametrize("chunk_size", [SEQ, 16], ids=["1-chunk", "3-chunks"])
def test_kv_of_another_dtype_than_the_steps_is_refused(chunk_size):
    """The pool is sized once per step by its first call's K/V dtype: a layer attending in float32 after float64
    layers would re-size it mid-sweep (dropping their pages). A whole model in another dtype next step is fine."""
    engine = OOMBEngine(TinyCalls(2), OOMBConfig(chunk_size, PAGE))
    engine.loss(token_ids()).backward()
    engine.model.float()
    engine.loss(token_ids()).backward()  # a new step sizes the pool for float32
    assert engine.pool.shape.dtype == torch.float32
    engine.model.double()
    engine.model.edit = lambda i, q, k, v: (q, k, v, i) if i == 0 else (q.float(), k.float(), v.float(), i)
    with pytest.raises(OOMBConfigError, match="layer 1 passes torch.float32 keys .* passed torch.float64"):
        engine.loss(token_ids())


# ------------------------------------------------------------------------------------------------------- shapes
BAD_CALLS = {
    "q-3d": (lambda q, k, v: (q[0], k, v), "it takes q \\[batch, heads, tokens, head_dim\\]"),
    "k-v-differ": (lambda q, k, v: (q, k, v[:, :1]), "keys and values of different shapes"),
    "kv-batch": (lambda q, k, v: (q, k[:1], v[:1]), "the chunk has batch 2"),
    "q-tokens": (lambda q, k, v: (q[:, :, 1:], k, v), "batch 2 and 16 tokens"),
    "q-head-dim": (lambda q, k, v: (q[..., :4], k, v), "declares head_dim=8"),
    "heads-not-grouped": (lambda q, k, v: (q[:, :3], k, v), "3 query heads and 2 KV heads"),
    "q-dtype": (lambda q, k, v: (q.float(), k, v), "q torch.float32 on cpu, k torch.float64"),
    "v-dtype": (lambda q, k, v: (q, k, v.float()), "v torch.float32 on cpu .* of one dtype"),
}


@pytest.mark.parametrize("name", BAD_CALLS)
def test_a_call_that_does_not_fit_the_chunk_is_refused(name):
    """Shapes the kernels would read past (NaN on the CPU backend) or fail on deep inside (the Triton launcher on
    q of another dtype than K/V) are named at the call."""
    bad, message = BAD_CALLS[name]
    model = TinyCalls(2, lambda i, q, k, v: (*(bad(q, k, v) if i else (q, k, v)), i))
    with pytest.raises(OOMBConfigError, match=message):
        OOMBEngine(model, OOMBConfig(16, PAGE)).loss(token_ids())
