"""Block-wise LM-head cross-entropy against materialised logits."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from lightning_oomb.engine.loss import LMHead, linear_cross_entropy, shift_labels


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("block", [1, 7, 1024])
def test_linear_cross_entropy_matches_torch(bias, block):
    gen = torch.Generator().manual_seed(block)
    h = torch.randn(3, 11, 16, dtype=torch.float64, generator=gen, requires_grad=True)
    w = torch.randn(29, 16, dtype=torch.float64, generator=gen, requires_grad=True)
    b = torch.randn(29, dtype=torch.float64, generator=gen, requires_grad=True) if bias else None
    t = torch.randint(0, 29, (3, 11), generator=gen)
    t[0, :4] = -100

    got = linear_cross_entropy(h, LMHead(w, b), t, block)
    got.backward()
    got_grads = [x.grad.clone() for x in (h, w, b) if x is not None]
    for x in (h, w, b):
        if x is not None:
            x.grad = None
    logits = F.linear(h, w, b)
    want = F.cross_entropy(logits.reshape(-1, 29), t.reshape(-1), reduction="sum")
    want.backward()
    torch.testing.assert_close(got, want, rtol=1e-12, atol=0)
    for g, x in zip(got_grads, (x for x in (h, w, b) if x is not None), strict=True):
        torch.testing.assert_close(g, x.grad, rtol=1e-12, atol=1e-14)


def test_bfloat16_autocast_follows_autocast_dtype():
    gen = torch.Generator().manual_seed(0)
    h = torch.randn(64, 32, generator=gen, requires_grad=True)
    w = torch.randn(50, 32, generator=gen, requires_grad=True)
    t = torch.randint(0, 50, (64,), generator=gen)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = linear_cross_entropy(h, LMHead(w), t, 16)
        want = F.cross_entropy(F.linear(h, w).float(), t, reduction="sum")
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, want, rtol=2e-3, atol=0)
    got.backward()
    assert h.grad.dtype == torch.float32 and w.grad.dtype == torch.float32


def test_shift_labels_crosses_chunk_boundaries():
    labels = torch.tensor([[5, 6, 7, 8]])
    assert shift_labels(labels).tolist() == [[6, 7, 8, -100]]


@pytest.mark.parametrize(("scale", "softcap"), [(0.25, None), (1.0, 3.0), (2.0, 1.5)])
def test_logit_scale_and_softcap_match_the_models_own_transform(scale, softcap):
    """Cohere multiplies the logits, Granite divides them, Gemma soft-caps them: same loss and gradients as
    materialising ``softcap(scale * logits)`` (float64)."""
    gen = torch.Generator().manual_seed(7)
    h = torch.randn(2, 9, 8, dtype=torch.float64, generator=gen, requires_grad=True)
    w = torch.randn(31, 8, dtype=torch.float64, generator=gen, requires_grad=True)
    t = torch.randint(0, 31, (2, 9), generator=gen)
    got = linear_cross_entropy(h, LMHead(w, None, scale, softcap), t, 5)
    got.backward()
    got_grads = h.grad.clone(), w.grad.clone()
    h.grad = w.grad = None
    z = F.linear(h, w) * scale
    if softcap is not None:
        z = torch.tanh(z / softcap) * softcap
    want = F.cross_entropy(z.reshape(-1, 31), t.reshape(-1), reduction="sum")
    want.backward()
    torch.testing.assert_close(got, want, rtol=1e-12, atol=0)
    for g, x in zip(got_grads, (h, w), strict=True):
        torch.testing.assert_close(g, x.grad, rtol=1e-12, atol=1e-14)
