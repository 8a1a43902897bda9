"""Llama 4: chunked attention (its local layers see only the keys of their own span of ``attention_chunk_size``
tokens), the query temperature of its layers without RoPE (a function of the token index, read from the cache's
length) and interleaved MoE layers — against transformers' own eager attention, which builds the chunked mask."""

from __future__ import annotations

from unittest import mock

import pytest
import torch

from lightning_oomb.engine import OOMBConfig, OOMBConfigError, OOMBEngine
from lightning_oomb.integrations.hf import HFChunkModel
from lightning_oomb.integrations.hf.attention import TokensBefore, counts_tokens_before
from tests.helpers.models import (
    _cross_entropy,
    assert_triton_matches_torch,
    float64_norms,
    grads_of,
    max_relative_error,
    oomb_step,
)

tf = pytest.importorskip("transformers")


def llama4(block: int, tuning: bool = True, layers: int = 4):
    """A tiny Llama 4 text model: chunked layers of span ``block`` beside full layers without RoPE whose queries
    are scaled by the token index's temperature from index 3 on (``floor_scale`` 4), MoE every other layer."""
    if not hasattr(tf, "Llama4TextConfig"):
        pytest.skip(f"transformers {tf.__version__} has no Llama 4")
    config = tf.Llama4TextConfig(
        hidden_size=32, intermediate_size=32, intermediate_size_mlp=48, num_attention_heads=4, num_key_value_heads=2,
        head_dim=8, vocab_size=64, num_hidden_layers=layers, num_local_experts=4, num_experts_per_tok=1,
        interleave_moe_layer_step=2, no_rope_layer_interval=2, attention_chunk_size=block, floor_scale=4,
        attn_scale=0.5, attn_temperature_tuning=tuning, initializer_range=0.2, attention_dropout=0.0, pad_token_id=0,
        bos_token_id=1, eos_token_id=2,
    )  # fmt: skip
    torch.manual_seed(0)
    model = tf.Llama4ForCausalLM(config).double()
    model.config._experts_implementation = "eager"
    float64_norms(model)  # they normalise in float32
    return model


def hf_eager(model, ids, labels=None, **kwargs):
    """Loss and gradients of full-sequence training with transformers' eager attention and its own masks."""
    previous = model.config._attn_implementation
    model.config._attn_implementation = "eager"
    try:
        loss = _cross_entropy(model(input_ids=ids, **kwargs).logits, ids, labels)
    finally:
        model.config._attn_implementation = previous
    loss.backward()
    grads = grads_of(model)
    model.zero_grad()
    return loss.detach(), grads


@pytest.mark.parametrize("checkpointing", [False, True])
@pytest.mark.parametrize("block", [8, 12, 64])
def test_llama4_trains_exactly(block, checkpointing):
    """Spans of 8 (OOMB's chunks of 16 hold two), 12 (spans across chunk boundaries) and 64 (longer than the
    sequence: causal), 37 tokens in ragged chunks, temperature tuning past the first chunk: fp64 1e-10."""
    model = llama4(block)
    assert model.config.layer_types[0] == "chunked_attention"
    ids = torch.randint(0, 64, (2, 37), generator=torch.Generator().manual_seed(2))
    want_loss, want = hf_eager(model, ids)
    loss, grads, engine = oomb_step(model, ids, checkpointing, chunk=16, page=8)
    assert abs(loss.item() - want_loss.item()) <= 1e-10 * want_loss.item()
    assert max_relative_error(grads, want) <= 1e-10
    # the chunked layers keep a window's pages: the span's
    assert engine.model.layer_windows == (block, None, block, None)


@pytest.mark.parametrize(
    "options",
    [dict(offload=True, hbm_budget=0, staging_buffers=3), dict(reuse_attention=True), dict(page_budget=100)],
    ids=["offload", "reuse_attention", "sparse_whole_budget"],
)
def test_llama4_trains_exactly_with_the_engines_options(options):
    """Every layer's pages in host memory, the forward sweep's results reused, a page budget that selects every
    page a span reaches: fp64 1e-10."""
    model = llama4(12)
    ids = torch.randint(0, 64, (2, 45), generator=torch.Generator().manual_seed(4))
    want_loss, want = hf_eager(model, ids)
    loss, grads, _ = oomb_step(model, ids, True, chunk=16, page=8, **options)
    assert abs(loss.item() - want_loss.item()) <= 1e-10 * want_loss.item()
    assert max_relative_error(grads, want) <= 1e-10


def test_the_spans_matter():
    """Without the spans (every layer causal over the whole row) or without the chunks' token offsets (each
    chunk's temperature counted from 0) the same step differs from transformers': both are needed."""
    model = llama4(8)
    ids = torch.randint(0, 64, (1, 40), generator=torch.Generator().manual_seed(3))
    want_loss, _ = hf_eager(model, ids)
    causal = llama4(8)
    causal.config.layer_types = ["full_attention"] * 4
    with torch.no_grad():
        engine = OOMBEngine(HFChunkModel(causal, verify_exactness=False), OOMBConfig(16, 8))
        assert abs(engine.loss(ids).item() - want_loss.item()) > 1e-6 * want_loss.item()
    attention = [m for m in model.modules() if counts_tokens_before(m)]
    assert len(attention) == 2  # the full layers, without RoPE
    from_zero = mock.patch.object(TokensBefore, "get_seq_length", lambda self, layer_idx=0: 0)
    with torch.no_grad(), from_zero:  # every chunk's attention told that no token comes before it
        engine = OOMBEngine(HFChunkModel(model, verify_exactness=False), OOMBConfig(16, 8))
        assert abs(engine.loss(ids).item() - want_loss.item()) > 1e-6 * want_loss.item()


def test_packed_documents_train_as_apart():
    """Packed rows (positions restarting): a chunked layer's spans count from its document's start, so each
    document trains as it would alone (as OOMB packs every model) — fp64 1e-10."""
    model = llama4(8, tuning=False)
    lengths = [11, 20, 9]
    docs = [torch.randint(0, 64, (1, n), generator=torch.Generator().manual_seed(n)) for n in lengths]
    ids = torch.cat(docs, 1)
    positions = torch.cat([torch.arange(n) for n in lengths]).unsqueeze(0)
    previous = model.config._attn_implementation
    model.config._attn_implementation = "eager"
    sums = [_cross_entropy(model(input_ids=d).logits, d) * (d.shape[1] - 1) for d in docs]
    model.config._attn_implementation = previous
    want_loss = sum(sums) / (sum(lengths) - len(lengths))
    want_loss.backward()
    want = grads_of(model)
    model.zero_grad()
    engine = OOMBEngine(HFChunkModel(model), OOMBConfig(16, 8))
    loss = engine.loss(ids, position_ids=positions)
    loss.backward()
    tol = rope_tolerance(model)
    assert abs(loss.item() - want_loss.item()) <= tol * want_loss.item()
    assert max_relative_error(grads_of(model), want) <= tol


def rope_tolerance(model) -> float:
    """1e-10, or 1e-6 where transformers rotates Llama 4's queries and keys in complex64 (5.17: a float32 island,
    whose rounding float64 inputs that differ in their last bits — the documents' attention sums in another order
    — cross once in a while: measured 4e-7)."""
    x = torch.zeros(1, 1, model.config.hidden_size, dtype=torch.float64)
    rotation = model.model.rotary_emb(x, torch.zeros(1, 1, dtype=torch.long))
    rotation = rotation[0] if isinstance(rotation, tuple) else rotation
    return 1e-10 if rotation.dtype in (torch.float64, torch.complex128) else 1e-6


def test_packed_documents_are_refused_where_queries_count_the_tokens_before():
    """Llama 4's temperature reads the token's index in the row (its cache's length), not its position: a packed
    row's documents cannot each start from 0 — refused before any work, naming the fix."""
    model = llama4(8)
    positions = torch.cat([torch.arange(n) for n in (20, 20)]).unsqueeze(0)
    ids = torch.randint(0, 64, (1, 40))
    engine = OOMBEngine(HFChunkModel(model), OOMBConfig(16, 8))
    with pytest.raises(OOMBConfigError, match="attn_temperature_tuning"):
        engine.loss(ids, position_ids=positions)


@pytest.mark.slow
def test_chunked_attention_with_the_triton_kernels():
    """The Triton backend (interpreted on CPU) gives the torch backend's loss and gradients."""
    model = llama4(12, layers=2).float()  # (heads of 8: zero-padded to the kernels' 16)
    ids = torch.randint(0, 64, (1, 40), generator=torch.Generator().manual_seed(6))
    assert_triton_matches_torch(model, ids)


def _context_parallel_step(rank, world, checkpointing):
    import torch.distributed as dist

    from lightning_oomb.engine.context import ContextGroup

    model = llama4(12)
    ids = torch.randint(0, 64, (2, 45), generator=torch.Generator().manual_seed(7))
    engine = OOMBEngine(HFChunkModel(model, layer_checkpointing=checkpointing), OOMBConfig(16, 8),
                        context=ContextGroup.of())  # fmt: skip
    loss = engine.loss(ids)
    loss.backward()
    grads = grads_of(model)
    for g in grads.values():
        dist.all_reduce(g)
    return {"loss": loss.detach(), "grads": grads}


@pytest.mark.slow
@pytest.mark.parametrize("checkpointing", [False, True])
def test_two_context_parallel_ranks_equal_transformers(tmp_path, checkpointing):
    """Two ranks, each a slice of every chunk: the spans and each slice's token offset (its temperature) as one
    process has them — fp64 1e-10 against transformers' eager training."""
    from tests.helpers.distributed import run_ranks

    results = run_ranks(_context_parallel_step, 2, tmp_path, checkpointing)
    model = llama4(12)
    ids = torch.randint(0, 64, (2, 45), generator=torch.Generator().manual_seed(7))
    want_loss, want = hf_eager(model, ids)
    for r in results:
        assert abs(r["loss"].item() - want_loss.item()) <= 1e-10 * want_loss.item()
        assert max_relative_error(r["grads"], want) <= 1e-10
