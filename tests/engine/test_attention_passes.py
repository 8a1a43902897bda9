"""A step attends twice forward (forward sweep, chunk recompute) and once backward, with or without per-layer
checkpointing: the checkpoint's recompute reuses the chunk recompute's attention result — and stays exact."""

from __future__ import annotations

import pytest
import torch

from lightning_oomb.engine import OOMBConfig, OOMBEngine, reference
from lightning_oomb.integrations.hf import HFChunkModel
from tests.helpers.models import build_causal_lm, full_sequence_loss, grads_of, max_relative_error

SEQ, CHUNK, PAGE = 45, 16, 8  # 3 chunks, the last ragged


def counted_step(checkpointing: bool, **options):
    """Loss, gradients and the number of reference forward / backward kernel calls of one step (the torch backend)."""
    calls = {"forward": 0, "backward": 0}
    with pytest.MonkeyPatch.context() as patch:
        for name in calls:
            original = getattr(reference, f"paged_attention_{name}")

            def counting(*args, _original=original, _name=name, **kwargs):
                calls[_name] += 1
                return _original(*args, **kwargs)

            patch.setattr(reference, f"paged_attention_{name}", counting)
        return (*_step(checkpointing, options), calls)


def _step(checkpointing: bool, options: dict):
    model = build_causal_lm("mistral" if options.pop("window", False) else "qwen2")
    ids = torch.randint(0, 97, (2, SEQ), generator=torch.Generator().manual_seed(0))
    config = OOMBConfig(CHUNK, PAGE, layer_checkpointing=checkpointing, attention_backend="torch", **options)
    # (no self-check: its twin's attention calls would be counted)
    engine = OOMBEngine(
        HFChunkModel(model, layer_checkpointing=checkpointing, verify_exactness=False), config
    )
    loss = engine.loss(ids)
    loss.backward()
    return loss.detach(), grads_of(model), model, ids, engine.pool.stats()


@pytest.mark.parametrize(
    "options",
    [{}, {"window": True}, {"offload": True, "hbm_budget": 0, "staging_buffers": 4}, {"page_budget": 1}],
    ids=["dense", "window", "offload", "sparse"],
)
def test_checkpointing_adds_no_attention_pass(options):
    loss, grads, _, _, stats, plain = counted_step(False, **dict(options))
    got_loss, got_grads, model, ids, got_stats, checkpointed = counted_step(True, **dict(options))
    assert checkpointed == plain and plain["forward"] > 0 and plain["backward"] > 0
    traffic = ("h2d_bytes", "d2h_bytes", "prefetch_copies", "demand_copies", "copy_runs")
    assert [got_stats.get(k) for k in traffic] == [stats.get(k) for k in traffic]  # offload: no page twice
    assert abs(got_loss.item() - loss.item()) <= 1e-12 * loss.item()
    assert max_relative_error(got_grads, grads) <= 1e-10
    if not options:  # and both equal full-sequence training
        model.zero_grad()
        want = full_sequence_loss(model, ids)
        want.backward()
        assert max_relative_error(got_grads, grads_of(model)) <= 1e-10
