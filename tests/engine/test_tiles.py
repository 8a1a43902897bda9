"""MLP tiles (``mlp_tile``, ``lightning_oomb.engine.tiles``): exact, the RNG replayed, and only dense MLPs."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from lightning_oomb.engine import OOMBConfig, OOMBEngine
from lightning_oomb.engine import tiles as tiles_module
from lightning_oomb.engine.tiles import tiled
from lightning_oomb.integrations.hf import HFChunkModel
from tests.helpers.models import build_causal_lm, full_sequence_loss, grads_of, max_relative_error


@pytest.mark.parametrize("checkpointing", [False, True])
def test_tiled_mlps_train_exactly(checkpointing, monkeypatch):
    """float64 against full-sequence training, with and without layer checkpointing; the MLPs are tiled and
    restored after the step."""
    calls = []
    apply = tiles_module._Tiled.apply
    monkeypatch.setattr(tiles_module._Tiled, "apply", lambda *args: calls.append(1) or apply(*args))
    model = build_causal_lm("qwen2")
    ids = torch.randint(0, 97, (2, 50), generator=torch.Generator().manual_seed(4))
    want_loss = full_sequence_loss(model, ids)
    want_loss.backward()
    want = grads_of(model)
    model.zero_grad()
    config = OOMBConfig(16, 8, layer_checkpointing=checkpointing, mlp_tile=5)
    engine = OOMBEngine(HFChunkModel(model), config)
    loss = engine.loss(ids)
    loss.backward()
    assert abs(loss.item() - want_loss.item()) <= 1e-10 * want_loss.item()
    assert max_relative_error(grads_of(model), want) <= 1e-10
    assert len(calls) == 2 * 3 * (
        2 if checkpointing else 1
    )  # layers x chunks longer than a tile (x checkpoints)
    assert all("forward" not in m.__dict__ for m in model.modules())


def test_only_dense_mlps_are_tiled():
    """A layer's ``mlp`` whose class name ends in ``MLP`` and that routes nothing: Qwen2's are, Qwen3-MoE's sparse
    blocks are not, nor GPT-OSS's router + experts block named ``GptOssMLP`` (tiling it crashed the step)."""
    from lightning_oomb.integrations.hf.adapter import dense_mlps
    from tests.helpers.models import build_family

    assert [type(m).__name__ for m in dense_mlps(build_causal_lm("qwen2"))] == ["Qwen2MLP"] * 2
    assert dense_mlps(build_family("qwen3_moe")) == []
    model = build_family("gpt_oss")
    assert dense_mlps(model) == []
    ids = torch.randint(0, 64, (1, 40), generator=torch.Generator().manual_seed(0))
    OOMBEngine(HFChunkModel(model), OOMBConfig(16, 8, mlp_tile=5)).loss(ids).backward()


def test_the_recompute_replays_the_forwards_dropout_and_autocast():
    """Each tile's recompute draws the forward's dropout masks (the gradient is that of the output returned) and
    runs under the forward's autocast."""
    torch.manual_seed(0)
    mlp = nn.Sequential(nn.Linear(6, 12), nn.GELU(), nn.Dropout(0.5), nn.Linear(12, 6)).double()
    x = torch.randn(2, 11, 6, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(2, 11, 6, dtype=torch.float64)
    torch.manual_seed(1)
    out = tiled(mlp, x, 4, tuple(mlp.parameters()))
    (out * weight).sum().backward()
    got = [x.grad, *(p.grad for p in mlp.parameters())]
    x.grad = None
    mlp.zero_grad()
    torch.manual_seed(1)  # the same draws, tile by tile, with grad
    want_out = torch.cat([mlp(x[:, s]) for s in (slice(0, 4), slice(4, 8), slice(8, 11))], 1)
    (want_out * weight).sum().backward()
    assert torch.equal(out, want_out.detach())
    for g, w in zip(got, [x.grad, *(p.grad for p in mlp.parameters())], strict=True):
        torch.testing.assert_close(g, w, rtol=1e-12, atol=1e-12)

    lin = nn.Linear(6, 6)
    xs = torch.randn(1, 9, 6, requires_grad=True)
    seen = []
    lin.register_forward_hook(lambda m, a, o: seen.append(o.dtype))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = tiled(lin, xs, 4, tuple(lin.parameters()))
    y.float().sum().backward()
    assert set(seen) == {torch.bfloat16} and len(seen) == 6  # 3 tiles forward, 3 recomputed


def test_mlp_tile_must_be_a_positive_token_count():
    from lightning_oomb.engine import OOMBConfigError

    for bad in (0, -4, 2.5, True):
        with pytest.raises(OOMBConfigError, match="mlp_tile"):
            OOMBConfig(mlp_tile=bad)
