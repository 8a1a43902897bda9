"""Activation memory does not grow with the sequence; the KV pool grows exactly linearly."""

from __future__ import annotations

import torch

from lightning_oomb.engine import OOMBConfig, OOMBEngine
from lightning_oomb.engine.memory import SavedTensorMeter
from lightning_oomb.integrations.hf import HFChunkModel
from tests.helpers.models import build_causal_lm, full_sequence_loss


def peak_saved_bytes(model, engine, seq_len):
    ids = torch.randint(0, 97, (1, seq_len), generator=torch.Generator().manual_seed(seq_len))
    with SavedTensorMeter(exclude=model.parameters()) as meter:
        engine.loss(ids).backward()
    return meter.peak


def test_activation_bytes_constant_in_sequence_length():
    model = build_causal_lm("qwen2", dtype=torch.float32)
    engine = OOMBEngine(HFChunkModel(model), OOMBConfig(chunk_size=64, page_size=16))
    short, long = peak_saved_bytes(model, engine, 256), peak_saved_bytes(model, engine, 1024)
    assert short > 0
    assert abs(long - short) <= 0.10 * short


def test_meter_sees_full_sequence_growth():
    """Control: ordinary training's saved bytes grow with the sequence, so the meter can tell."""
    model = build_causal_lm("qwen2", dtype=torch.float32)
    peaks = []
    for n in (256, 1024):
        with SavedTensorMeter(exclude=model.parameters()) as meter:
            full_sequence_loss(model, torch.randint(0, 97, (1, n))).backward()
        peaks.append(meter.peak)
    assert peaks[1] > 3 * peaks[0]


def test_pool_bytes_are_linear_and_match_the_formula():
    model = build_causal_lm("qwen2", dtype=torch.float32)  # 2 layers, 1 KV head, head_dim 8
    engine = OOMBEngine(HFChunkModel(model), OOMBConfig(chunk_size=32, page_size=16))
    for n in (64, 256):
        engine.loss(torch.randint(0, 97, (2, n))).backward()
        per_token_kv = 2 * 1 * 8 * 2 * 4  # layers x kv_heads x head_dim x (K, V) x fp32 bytes
        assert engine.stats.kv_bytes == 2 * n * per_token_kv  # batch 2, n a multiple of the page
        assert engine.stats.grad_bytes == 2 * n * per_token_kv  # fp32 gradient pages
    bf16 = OOMBEngine(HFChunkModel(model), OOMBConfig(chunk_size=32, page_size=16, kv_grad_dtype="bfloat16"))
    model.to(torch.bfloat16)
    bf16.loss(torch.randint(0, 97, (1, 64))).backward()
    assert bf16.stats.kv_bytes == bf16.stats.grad_bytes == 64 * 2 * 8 * 2 * 2
