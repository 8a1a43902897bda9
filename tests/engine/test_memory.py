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


def test_device_memory_is_asked_of_an_indexed_device(monkeypatch):
    """``torch.device("cuda")`` (no index) is what users and the strategy pass; torch <= 2.11's
    ``get_per_process_memory_fraction`` refuses it (the first H200 run failed there), so the current device's index
    is passed instead."""
    from unittest import mock

    from lightning_oomb.engine.kv_pool import device_memory_available

    def fraction(device):
        if not isinstance(device, int):
            raise ValueError("Expected a torch.device with a specified index or an integer")
        return 0.5

    with (
        mock.patch.object(torch.cuda, "current_device", return_value=3),
        mock.patch.object(torch.cuda, "mem_get_info", return_value=(60, 100)) as info,
        mock.patch.object(torch.cuda, "memory_reserved", return_value=10),
        mock.patch.object(torch.cuda, "memory_allocated", return_value=4),
        mock.patch.object(torch.cuda, "get_per_process_memory_fraction", side_effect=fraction),
    ):
        assert device_memory_available(torch.device("cuda")) == (50 - 4, 100)  # min(60 + 10, 0.5 * 100) - 4
        assert info.call_args.args == (3,)
        assert device_memory_available(torch.device("cuda", 1)) == (46, 100)
        assert info.call_args.args == (1,)
