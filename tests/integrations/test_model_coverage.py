"""Families beyond Llama's attention, exact in float64 through ``Trainer(strategy="oomb")`` against full-sequence
training: Gemma 2 (softcaps, windows), Gemma 3 (5:1 local/global, QK-norm, two RoPE bases; also its multimodal wrapper, on text), GPT-OSS (sinks, windows,
MoE), Phi-3 longrope past its original context, dynamic NTK RoPE past its base length, Cohere, Granite and HyperCLOVAX
(logit scales), AFMoE (views the attention output). Ragged lengths, one and several chunks, with and without layer checkpointing."""

from __future__ import annotations

import pytest
import torch

from lightning_oomb.engine import OOMBConfig, OOMBEngine
from lightning_oomb.integrations.hf import HFChunkModel
from tests.helpers.lightning import oomb_step_through_trainer
from tests.helpers.models import (
    assert_triton_matches_torch,
    build_family,
    exact_full_sequence_loss,
    exact_moe_loss,
    float64_norms,
    grads_of,
    max_relative_error,
)

FAMILIES = (
    "gemma2",
    "gemma3",
    "gemma3_multimodal",
    "gpt_oss",
    "qwen3_moe",
    "phi3_longrope",
    "llama_dynamic",
    "cohere",
    "granite",
    "hyperclovax",
    "afmoe",
)
SEQ = 53  # past Phi-3's original context (16) and the dynamic RoPE's base length (16); not a multiple of 8 or 16


def trainer_loss_and_grads(model, ids, chunk_size: int, checkpointing: bool):
    return oomb_step_through_trainer(model, ids, oomb_config(chunk_size, checkpointing))


def oomb_config(chunk_size: int, checkpointing: bool) -> OOMBConfig:
    return OOMBConfig(chunk_size, 8, layer_checkpointing=checkpointing)


@pytest.mark.parametrize("checkpointing", [False, True])
@pytest.mark.parametrize("chunk_size", [64, 16], ids=["1-chunk", "4-chunks"])
@pytest.mark.parametrize("family", FAMILIES)
def test_family_is_exact_through_the_trainer(family, chunk_size, checkpointing):
    model = build_family(family)
    float64_norms(model)
    ids = torch.randint(0, 64, (2, SEQ), generator=torch.Generator().manual_seed(len(family)))
    want_loss = exact_full_sequence_loss(model, ids)
    want_loss.backward()
    want = grads_of(model)
    model.zero_grad()
    loss, grads = trainer_loss_and_grads(model, ids, chunk_size, checkpointing)
    assert abs(loss.item() - want_loss.item()) <= 1e-10 * want_loss.item()
    assert max_relative_error(grads, want) <= 1e-10
    if family == "gpt_oss":  # the sinks learn: their gradient is part of the comparison, and not zero
        assert all(grads[n].abs().max() > 0 for n in grads if n.endswith("sinks"))


@pytest.mark.parametrize("family", ["phi3_longrope", "llama_dynamic"])
def test_length_dependent_rope_is_wrong_unless_pinned(family):
    """Negative control: with the RoPE left to each chunk's own length (a fresh model: dynamic RoPE keeps state),
    the chunked loss is not the full one; pinned, it is."""
    ids = torch.randint(0, 64, (1, SEQ), generator=torch.Generator().manual_seed(0))
    want = exact_full_sequence_loss(build_family(family), ids).item()
    unpinned = HFChunkModel(build_family(family))
    assert unpinned._rotaries  # found
    unpinned._rotaries = []
    wrong = OOMBEngine(unpinned, OOMBConfig(16, 8)).evaluate(ids).item()
    pinned = OOMBEngine(HFChunkModel(build_family(family)), OOMBConfig(16, 8)).evaluate(ids).item()
    assert abs(pinned - want) <= 1e-10 * want and abs(wrong - want) > 1e-4 * want


@pytest.mark.parametrize("family", ["phi3_longrope", "llama_dynamic"])
def test_length_dependent_rope_of_packed_documents_reads_the_longest_document(family):
    """Packed documents shorter than the RoPE's base length in a row longer than it: transformers picks the
    frequencies from the largest position + 1 (here the short ones), so the row trains like its documents apart;
    pinned to the row's length it took the long ones (a loss 5e-3 off, gradients 1.5 relative)."""
    from tests.engine.test_packing import apart

    lengths, gen = (13, 9, 15), torch.Generator().manual_seed(5)
    docs = [torch.randint(0, 64, (1, n), generator=gen) for n in lengths]
    ids, positions = torch.cat(docs, 1), torch.cat([torch.arange(n) for n in lengths])[None]
    want_loss, want = apart(build_family(family), docs)
    model = build_family(family)
    loss = OOMBEngine(HFChunkModel(model), OOMBConfig(16, 8)).loss(ids, position_ids=positions)
    loss.backward()
    assert abs(loss.item() - want_loss.item()) <= 1e-10 * want_loss.item()
    assert max_relative_error(grads_of(model), want) <= 1e-10


def test_pinning_reaches_the_undecorated_forward_under_more_decorators():
    """transformers 5.17 wraps the RoPE update in ``torch.no_grad()`` as well: pinning still calls the bare forward
    (no per-chunk update), so the chunked loss stays the full one."""
    import functools

    ids = torch.randint(0, 64, (1, SEQ), generator=torch.Generator().manual_seed(0))
    model = build_family("phi3_longrope")
    want = exact_full_sequence_loss(model, ids).item()
    rotary = model.model.rotary_emb
    decorated = type(rotary).forward

    class Rewrapped(type(rotary)):
        forward = functools.wraps(decorated)(torch.no_grad()(decorated))  # the 5.17 layout

    rotary.__class__ = Rewrapped
    loss = OOMBEngine(HFChunkModel(model), OOMBConfig(16, 8)).evaluate(ids).item()
    assert abs(loss - want) <= 1e-10 * want


@pytest.mark.slow
@pytest.mark.parametrize("family", ["gemma2", "gpt_oss"])
def test_softcap_and_sinks_with_the_triton_kernels(family):
    """The Triton backend (interpreted on CPU) gives the torch backend's loss and gradients with softcaps and sinks."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    model = build_family(family, dtype=torch.float32, head_dim=16).to(device)
    ids = torch.randint(0, 64, (2, 45), generator=torch.Generator().manual_seed(1)).to(device)
    assert_triton_matches_torch(model, ids)


@pytest.mark.parametrize("checkpointing", [False, True])
@pytest.mark.parametrize("chunk_size", [64, 16], ids=["1-chunk", "4-chunks"])
@pytest.mark.parametrize("family", ["gpt_oss", "qwen3_moe"])
def test_router_balancing_loss_is_exact_across_chunks(family, chunk_size, checkpointing):
    """MoE models trained with their router's load-balancing loss (``output_router_logits=True``): the step's loss
    includes the term as Hugging Face's does, and the router gets the exact gradient of the whole step's term."""
    model = build_family(family, output_router_logits=True, router_aux_loss_coef=0.5)
    ids = torch.randint(0, 64, (2, SEQ), generator=torch.Generator().manual_seed(3))
    want_loss = exact_moe_loss(model, ids)
    want_loss.backward()
    want = grads_of(model)
    without_aux = exact_full_sequence_loss(model, ids).item()
    model.zero_grad()
    loss, grads = trainer_loss_and_grads(model, ids, chunk_size, checkpointing)
    assert abs(loss.item() - want_loss.item()) <= 1e-10 * want_loss.item()
    assert abs(loss.item() - without_aux) > 1e-3  # the term is there
    assert max_relative_error(grads, want) <= 1e-10


@pytest.mark.parametrize("chunk_size", [64, 16], ids=["1-chunk", "4-chunks"])
def test_router_balancing_loss_skips_right_padding_as_transformers_does(chunk_size):
    """Under right padding transformers' ``attention_mask`` keeps padded tokens out of the balancing term; so does
    OOMB (it used to count them: 7e-3 off in the loss, 0.36 in the gradients)."""
    model = build_family("qwen3_moe", output_router_logits=True, router_aux_loss_coef=0.5)
    ids = torch.randint(0, 64, (2, SEQ), generator=torch.Generator().manual_seed(4))
    mask = torch.ones_like(ids)
    mask[1, 30:] = 0
    want_loss = exact_moe_loss(model, ids, mask)
    want_loss.backward()
    want = grads_of(model)
    model.zero_grad()
    loss = OOMBEngine(HFChunkModel(model), oomb_config(chunk_size, False)).loss(ids, attention_mask=mask)
    loss.backward()
    assert abs(loss.item() - want_loss.item()) <= 1e-10 * want_loss.item()
    assert max_relative_error(grads_of(model), want) <= 1e-10


def test_the_chunked_balancing_term_is_transformers_own():
    """Our term's value equals transformers' ``load_balancing_loss_func`` on the same router logits."""
    from transformers.models.gpt_oss.modeling_gpt_oss import load_balancing_loss_func

    from lightning_oomb.integrations.hf.moe import RouterBalanceLoss

    gen = torch.Generator().manual_seed(0)
    layers = [torch.randn(37, 6, generator=gen) for _ in range(3)]
    term = RouterBalanceLoss(num_experts=6, top_k=2, coef=1.0)
    chunk = type("Chunk", (), {"sweep": "forward", "context": None, "tokens": None})()
    for part in (slice(0, 16), slice(16, 37)):  # two chunks
        term.record(chunk, [layer[part] for layer in layers])
    torch.testing.assert_close(term.value(), load_balancing_loss_func(tuple(layers), 6, 2), rtol=1e-6, atol=0)
