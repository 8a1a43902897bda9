"""Sliding-window layers keep only the pages their window reaches (float64: exact, with less memory)."""

from __future__ import annotations

import functools

import pytest
import torch

from lightning_oomb.engine import OOMBConfig, OOMBConfigError, OOMBEngine
from lightning_oomb.engine.pages import PoolShape
from lightning_oomb.integrations.hf import HFChunkModel
from tests.helpers.models import (
    build_causal_lm,
    build_family,
    exact_full_sequence_loss,
    full_sequence_loss,
    grads_of,
    max_relative_error,
    oomb_step,
)

SEQ, CHUNK, PAGE = 200, 32, 8  # window 11 (Mistral) or 7 (GPT-OSS): 2 tail pages per chunk boundary


step = functools.partial(oomb_step, chunk=CHUNK, page=PAGE)


@pytest.mark.parametrize("checkpointing", [False, True])
@pytest.mark.parametrize("offload", [False, True])
@pytest.mark.parametrize(
    "family", ["mistral", "gpt_oss"]
)  # every layer a window layer / alternating with full ones
def test_window_layers_keep_their_tails_and_stay_exact(family, offload, checkpointing):
    model = build_causal_lm("mistral") if family == "mistral" else build_family("gpt_oss")
    oracle = full_sequence_loss if family == "mistral" else exact_full_sequence_loss
    ids = torch.randint(0, 64, (2, SEQ), generator=torch.Generator().manual_seed(0))
    want_loss = oracle(model, ids)
    want_loss.backward()
    want = grads_of(model)
    options = {"offload": True, "hbm_budget": 0, "staging_buffers": 3} if offload else {}
    loss, grads, engine = step(model, ids, checkpointing, **options)
    assert abs(loss.item() - want_loss.item()) <= 1e-10 * want_loss.item()
    assert max_relative_error(grads, want) <= 1e-10
    shape = engine.pool.shape
    windowed = [layer for layer, w in enumerate(shape.windows) if w is not None]
    assert windowed and all(shape.tails[layer] is not None for layer in windowed)
    group = {"mistral": 2, "gpt_oss": 1}[family]  # pages holding the window - 1 keys before a chunk
    assert all(shape.tail_group(layer) == group for layer in windowed)
    stats = engine.stats.extra
    if (
        offload
    ):  # full layers go to the host tier; window layers keep a ring of two tail groups, the host the rest
        assert stats["host_layers"] == shape.num_layers - len(windowed)
        assert shape.hosted_tails == tuple(windowed)
        assert all(shape.layer_pages(layer) == 2 * group + 4 for layer in windowed)
    else:
        assert all(shape.layer_pages(layer) == 6 * group + 4 for layer in windowed)  # 6 boundaries
    assert engine.stats.kv_bytes < shape.num_layers * shape.layer_slots * 2 * shape.page_numel * 8


def test_a_window_the_model_did_not_declare_is_refused():
    """The engine checks every attention call against the windows the adapter declared."""
    model = build_causal_lm("mistral")
    adapter = HFChunkModel(model)
    adapter.layer_windows = (5,) * 2
    with pytest.raises(OOMBConfigError, match="sliding_window=11 but the model declared 5"):
        OOMBEngine(adapter, OOMBConfig(CHUNK, PAGE)).loss(torch.randint(0, 97, (1, SEQ)))


def test_a_window_applied_by_the_mask_alone_is_refused_naming_it():
    """Qwen2-MoE with ``use_sliding_window`` declares a window its attention calls never pass (transformers applies
    it through the mask, which OOMB does not read): refused by the self-check, saying so (it said "correct the
    config, or train a model whose layers ignore it")."""
    import transformers as tf

    config = tf.Qwen2MoeConfig(vocab_size=97, hidden_size=32, intermediate_size=32, moe_intermediate_size=16,
                               shared_expert_intermediate_size=16, num_hidden_layers=2, num_attention_heads=4,
                               num_key_value_heads=2, num_experts=4, num_experts_per_tok=2, use_sliding_window=True,
                               sliding_window=40, max_window_layers=2)  # fmt: skip
    with pytest.raises(OOMBConfigError, match="passes no sliding_window.*through the attention mask alone"):
        HFChunkModel(tf.Qwen2MoeForCausalLM(config))


def test_gpt_oss_20b_pool_bytes_per_token():
    """gpt-oss-20b's shape (24 layers alternating window 128 / full, 8 KV heads of 64, bf16 K/V, fp32 gradient
    pages) at 128K tokens in chunks of 4096: window layers keep 1 page in 32 plus one chunk, so the pool needs
    76 KiB per token instead of 144 KiB."""
    windows = tuple(128 if layer % 2 == 0 else None for layer in range(24))
    common = dict(num_layers=24, batch=1, seq_len=131072, kv_heads=8, head_dim=64, page_size=128, chunk_size=4096,
                  dtype=torch.bfloat16)  # fmt: skip
    full, windowed = PoolShape(**common), PoolShape(**common, windows=windows)
    per_token = [(s.kv_bytes + s.grad_bytes) / s.seq_len / 1024 for s in (full, windowed)]
    assert per_token[0] == 144
    assert windowed.layer_pages(0) == 31 + 32 and 76 < per_token[1] < 77  # 31 tails + one chunk of 1024 pages


@pytest.mark.slow
def test_window_tails_with_the_triton_kernels():
    """The kernels read a window layer's tails and transient pages through its page table like any other (3
    chunks: 2 boundaries of tails; the interpreter is slow)."""
    model = build_causal_lm("mistral", dtype=torch.float32, head_dim=16)
    ids = torch.randint(0, 97, (1, 3 * CHUNK - 12), generator=torch.Generator().manual_seed(1))
    results = {}
    for backend in ("torch", "triton"):
        model.zero_grad()
        engine = OOMBEngine(HFChunkModel(model), OOMBConfig(CHUNK, 16, attention_backend=backend))
        loss = engine.loss(ids)
        loss.backward()
        assert engine.pool.shape.tails[0] is not None
        results[backend] = loss.detach(), grads_of(model)
    (loss_t, grads_t), (loss_k, grads_k) = results["torch"], results["triton"]
    assert torch.allclose(loss_k, loss_t, rtol=1e-5, atol=0)
    assert max_relative_error(grads_k, grads_t) <= 1e-4
