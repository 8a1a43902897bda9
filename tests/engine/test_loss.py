"""Block-wise LM-head cross-entropy against materialised logits; its memory per block."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from lightning_oomb.engine import OOMBConfig, OOMBEngine, activation_bytes, step_setup
from lightning_oomb.engine import loss as loss_module
from lightning_oomb.engine.loss import LMHead, linear_cross_entropy, shift_labels
from lightning_oomb.engine.model_shape import ModelShape
from lightning_oomb.integrations.hf import HFChunkModel
from tests.helpers.memory import cross_entropy_peak
from tests.helpers.models import build_causal_lm

# (scale, softcap): none, Cohere's / Granite's scale, Gemma's soft cap, both
TRANSFORMS = [(1.0, None), (0.25, None), (1.0, 3.0), (2.0, 1.5)]


def reference(h, head: LMHead, t):
    """Hugging Face's causal-LM loss on materialised logits: ``softcap(scale * logits)`` in float32 (or float64)."""
    z = F.linear(h, head.weight, head.bias)
    z = z.double() if z.dtype == torch.float64 else z.float()
    z = z * head.scale
    if head.softcap is not None:
        z = torch.tanh(z / head.softcap) * head.softcap
    return F.cross_entropy(z.reshape(-1, z.shape[-1]), t.reshape(-1), reduction="sum")


def random_inputs(seed, dtype=torch.float64, vocab=29, hidden=16, bias=False, frozen=False):
    """Fresh ``h [3, 11, hidden]``, ``w [vocab, hidden]``, ``b`` and targets with ignored ones (``-100``)."""
    gen = torch.Generator().manual_seed(seed)
    h = torch.randn(3, 11, hidden, dtype=torch.float64, generator=gen)
    w = torch.randn(vocab, hidden, dtype=torch.float64, generator=gen) * hidden**-0.5 * 3
    b = torch.randn(vocab, dtype=torch.float64, generator=gen) if bias else None
    t = torch.randint(0, vocab, (3, 11), generator=gen)
    t[0, :4] = t[2, -1] = -100
    leaves = [None if x is None else x.to(dtype).requires_grad_(x is h or not frozen) for x in (h, w, b)]
    return (*leaves, t)


def loss_and_grads(fn, h, head: LMHead, t, grad=1.0, **kwargs):
    """``fn``'s loss and the gradients of ``h``, the weight and the bias (``None`` where none is wanted)."""
    leaves = (h, head.weight, head.bias)
    for x in leaves:
        if x is not None:
            x.grad = None
    loss = fn(h, head, t, **kwargs)
    loss.backward(torch.as_tensor(grad, dtype=loss.dtype))
    return loss.detach(), [None if x is None or x.grad is None else x.grad.clone() for x in leaves]


@pytest.mark.parametrize(("scale", "softcap"), TRANSFORMS)
@pytest.mark.parametrize("frozen", [False, True], ids=["trained-head", "frozen-head"])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("block", [1, 7, 1024])
def test_float64_loss_and_gradients_equal_materialised_logits(block, bias, frozen, scale, softcap):
    """Float64, fresh inputs: loss and gradients equal HF's on materialised logits; a frozen head (tied to a frozen
    embedding, LoRA) gets none; the value alone (no grad: the forward and eval sweeps) is the same number."""
    h, w, b, t = random_inputs(block * 31 + bias * 7 + frozen, bias=bias, frozen=frozen)
    head = LMHead(w, b, scale, softcap)
    got, got_grads = loss_and_grads(linear_cross_entropy, h, head, t, block=block)
    want, want_grads = loss_and_grads(reference, h, head, t)
    with torch.no_grad():
        assert torch.equal(linear_cross_entropy(h, head, t, block), got)
    assert frozen == (got_grads[1] is None)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=0)
    for g, r in zip(got_grads, want_grads, strict=True):
        assert (g is None) == (r is None)
        if g is not None:
            torch.testing.assert_close(g, r, rtol=1e-12, atol=1e-14)


@pytest.mark.parametrize("expected", [None, 0.37, 0.0, 2.0])
def test_the_expected_gradient_only_sets_the_scale_the_gradients_are_made_at(expected):
    """Told the gradient it will receive or not (or told wrong: 2 where 0.37 comes), backward hands out the same
    gradients (float64)."""
    h, w, b, t = random_inputs(3, bias=True)
    head = LMHead(w, b, 0.5, 4.0)
    grad = 0.0 if expected == 0.0 else 0.37
    kwargs = {
        "block": 5,
        "expected_grad": None if expected is None else torch.tensor(expected, dtype=h.dtype),
    }
    got, got_grads = loss_and_grads(linear_cross_entropy, h, head, t, grad, **kwargs)
    want, want_grads = loss_and_grads(reference, h, head, t, grad)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=0)
    for g, r in zip(got_grads, want_grads, strict=True):
        torch.testing.assert_close(g, r, rtol=1e-12, atol=1e-14)


@pytest.mark.parametrize("softcap", [None, 30.0])
@pytest.mark.parametrize("precision", ["bf16-true", "bf16-mixed"])
def test_bfloat16_is_as_close_to_float64_as_materialised_logits(precision, softcap):
    """bf16 weights, or float32 ones under bf16 autocast: the loss in float32 and the gradients in the leaves'
    dtypes; loss and gradients as close to float64 on the same inputs as HF's loss on materialised logits."""
    dtype = torch.bfloat16 if precision == "bf16-true" else torch.float32
    leaves = random_inputs(5, dtype, vocab=211, hidden=48, bias=True)
    head, t = LMHead(leaves[1], leaves[2], 0.5, softcap), leaves[3]
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision == "bf16-mixed"):
        got, got_grads = loss_and_grads(linear_cross_entropy, leaves[0], head, t, block=7)
        plain, plain_grads = loss_and_grads(reference, leaves[0], head, t)
    exact = [x.detach().bfloat16().double().requires_grad_() for x in leaves[:3]]  # what the bf16 matmuls see
    want, want_grads = loss_and_grads(reference, exact[0], LMHead(exact[1], exact[2], 0.5, softcap), t)
    assert got.dtype == torch.float32
    assert [g.dtype for g in got_grads] == [dtype] * 3
    assert abs(got.double() - want) <= 2 * abs(plain.double() - want) + 1e-6 * abs(want)
    for g, p, r in zip(got_grads, plain_grads, want_grads, strict=True):
        error, plain_error = ((x.double() - r).norm() / r.norm() for x in (g, p))
        assert error <= 2 * plain_error, (error, plain_error)


def test_shift_labels_crosses_chunk_boundaries():
    labels = torch.tensor([[5, 6, 7, 8]])
    assert shift_labels(labels).tolist() == [[6, 7, 8, -100]]


def test_backward_holds_one_blocks_logits_and_one_bf16_weight_gradient():
    """bf16 weights: the peak is one block's logits (float32 + their bf16 cast, 6 bytes per logit) + one [V, H]
    accumulator in bf16 (the gradient autograd receives) + per token the hidden states, ``dh`` (2 + 2 bytes per
    feature) and the target, + the block's bf16 hidden rows (ignored ones zeroed) — no float32 copy of the vocabulary
    matrix (one alone, 4VH, would exceed it) — and it grows with the tokens only by the per-token part: earlier
    blocks leave nothing."""
    vocab, hidden, block = 1024, 64, 4
    per_token = 4 * hidden + 8
    bound = {
        n: 6 * block * vocab + 2 * block * hidden + 2 * vocab * hidden + per_token * n
        for n in (block, 8 * block)
    }
    peaks = {n: cross_entropy_peak(vocab, hidden, n, block) for n in bound}
    for n, peak in peaks.items():
        assert bound[n] <= peak <= bound[n] + 256, (
            n,
            peak,
            bound[n],
        )  # + a block's per-row vectors (lse, ...)
        assert peak < 4 * vocab * hidden
    assert abs(peaks[8 * block] - peaks[block] - per_token * 7 * block) <= 256


@pytest.mark.parametrize("scale", [1.0, 0.37, 0.0])
@pytest.mark.parametrize("into", [torch.float64, torch.float32], ids=["same-dtype", "wider"])
def test_weight_gradient_added_in_place_into_a_given_tensor(scale, into):
    """``weight_grad``: the weight's gradient is added into that tensor (a wider one too) at the promised scale —
    zero included — autograd gets none for the weight, ``dh`` and the bias as without it; a backward with another
    gradient than the promised one is an error, as is ``weight_grad`` without ``expected_grad``."""
    dtype = torch.float64 if into == torch.float64 else torch.float32
    h, w, b, t = random_inputs(11, dtype=dtype, bias=True)
    head = LMHead(w, b, 0.5, 2.0)
    _, (dh, dw, db) = loss_and_grads(linear_cross_entropy, h, head, t, scale, block=5)
    earlier = torch.randn(w.shape, dtype=into, generator=torch.Generator().manual_seed(2))
    target = earlier.clone()
    expected = torch.tensor(scale, dtype=dtype)
    _, grads = loss_and_grads(
        linear_cross_entropy, h, head, t, scale, block=5, expected_grad=expected, weight_grad=target
    )
    tol = 1e-12 if dtype == torch.float64 else 1e-5
    assert grads[1] is None and torch.allclose(target - earlier, dw.to(into), atol=tol, rtol=0)
    torch.testing.assert_close(grads[0], dh, atol=tol, rtol=0)
    torch.testing.assert_close(grads[2], db, atol=tol, rtol=0)
    with pytest.raises(RuntimeError, match="expected_grad"):
        loss_and_grads(
            linear_cross_entropy,
            h,
            head,
            t,
            2.0,
            block=5,
            expected_grad=torch.tensor(1.0),
            weight_grad=target,
        )
    with pytest.raises(ValueError, match="needs expected_grad"):
        linear_cross_entropy(h, head, t, 5, weight_grad=target)


def test_a_nan_loss_gradient_is_the_nan_promised():
    """A NaN reaching the loss (a diverged batch's loss squared) gives NaN gradients, as autograd would, instead of
    failing the check that the gradient is the promised one (on CUDA a device-side assert)."""
    h, w, _, t = random_inputs(12)
    nan = torch.tensor(float("nan"), dtype=h.dtype)
    target = torch.zeros_like(w)
    linear_cross_entropy(h, LMHead(w), t, 5, expected_grad=nan, weight_grad=target).backward(nan)
    assert h.grad.isnan().all() and target.isnan().all()


def test_an_overflowed_logit_gives_a_nan_loss_as_cross_entropy():
    """A +inf logit at a non-target (fp16 logits past 65504) makes the loss NaN, as ``F.cross_entropy`` does (it
    was +inf)."""
    h, w, t = torch.randn(2, 3, 8), torch.randn(5, 8), torch.zeros(2, 3, dtype=torch.long)
    head = LMHead(w, torch.tensor([0.0, 0.0, float("inf"), 0.0, 0.0]))
    assert reference(h, head, t).isnan() and linear_cross_entropy(h, head, t, 4).isnan()


def test_no_weight_gradient_tensor_is_made_when_it_goes_in_place():
    """bf16: with ``weight_grad`` the peak is the block's logits and the per-token part only (no [V, H] tensor), and
    what the plan counts for it; into a float32 sum plus one bf16 slab of the product (at most the logits' size)."""
    vocab, hidden, block, n = 1024, 64, 4, 32
    shape = ModelShape(1, hidden, hidden, 1, 1, hidden, vocab, vocab)
    dtypes = step_setup.Dtypes(torch.bfloat16, torch.bfloat16, torch.bfloat16)
    for into in (torch.bfloat16, torch.float32):
        target = torch.zeros(vocab, hidden, dtype=into)

        def in_place(h, head, t, blk, target=target):
            return linear_cross_entropy(h, head, t, blk, torch.ones((), dtype=torch.float32), target)

        peak = cross_entropy_peak(vocab, hidden, n, block, loss_fn=in_place, exclude=[target])
        predicted = activation_bytes.loss_backward_bytes(shape, dtypes, n, block, True, into)
        assert 0 <= peak - predicted <= 8 * block * hidden, (into, peak, predicted)
        slab = 2 * block * vocab if into == torch.float32 else 0
        assert peak <= 6 * block * vocab + slab + 2 * block * hidden + (4 * hidden + 8) * n + 256, (
            into,
            peak,
        )


def test_gradients_are_made_once_and_handed_out_once():
    gen = torch.Generator().manual_seed(0)
    h = torch.randn(6, 8, dtype=torch.float64, generator=gen, requires_grad=True)
    w = torch.randn(13, 8, dtype=torch.float64, generator=gen, requires_grad=True)
    loss = linear_cross_entropy(h, LMHead(w), torch.randint(0, 13, (6,), generator=gen), 4)
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="already handed out"):
        loss.backward()
    with pytest.raises(ValueError, match="positive number of tokens"):
        linear_cross_entropy(h, LMHead(w), torch.zeros(6, dtype=torch.long), 0)


def test_the_engine_makes_the_gradients_at_the_scale_autograd_hands_them(monkeypatch):
    """The backward sweep tells the cross-entropy the gradient it will back-propagate: the one autograd's division
    by the target count gives, bit for bit, so backward rescales by exactly 1 and the logit gradient is scaled
    before its cast to the compute dtype (as in HF)."""
    ratios = []
    backward = loss_module.LinearCrossEntropy.backward

    def spy(ctx, grad_total):
        ratios.append(float(grad_total / ctx.grads.scale))
        return backward(ctx, grad_total)

    monkeypatch.setattr(loss_module.LinearCrossEntropy, "backward", staticmethod(spy))
    model = build_causal_lm("qwen2", dtype=torch.bfloat16)
    # no self-check: its twin's steps would be spied on too (run alone, before any test cached its verdict)
    engine = OOMBEngine(HFChunkModel(model, verify_exactness=False), OOMBConfig(chunk_size=16, page_size=16))
    ids = torch.randint(0, 97, (1, 40), generator=torch.Generator().manual_seed(1))
    (engine.loss(ids) * 0.37).backward()  # 39 targets: 0.37 / 39 is no power of two
    assert ratios == [1.0, 1.0, 1.0]


@pytest.mark.parametrize("poison", [float("inf"), float("nan")], ids=["inf-logits", "nan-hidden"])
@pytest.mark.parametrize("bias", [False, True])
def test_ignored_rows_add_nothing_whatever_their_logits(poison, bias):
    """Rows whose label is ignored (right padding) with +inf logits (or a NaN hidden state) add exactly nothing, as
    ``F.cross_entropy(ignore_index=-100)`` skips them: float64 loss equal to torch's on the materialised logits, and
    gradients equal to torch's on the valid rows alone, zero at the ignored rows, finite everywhere (the loss was
    NaN; torch's own logit gradient is NaN at such a row, and so its weight gradient)."""
    h, w, b, t = random_inputs(21, bias=bias)
    t[1, 7:] = -100  # a right-padded row: its padding has no target
    with torch.no_grad():
        h[1, 8:] = 0.0
        h[1, 8:, 3] = poison  # +inf x w[:, 3]: +inf and -inf logits; or NaN ones
        h[0, 2] = poison  # an ignored row inside a row (t[0, :4] = -100)
    head = LMHead(w, b, 1.0, None)
    ignored = t == -100
    if poison == float("inf"):
        assert reference(h.detach(), head, t).isfinite()  # torch skips the ignored rows' +inf logits
    for block in (1, 5, 1024):
        got, got_grads = loss_and_grads(linear_cross_entropy, h, head, t, 0.37, block=block)
        with torch.no_grad():
            assert torch.equal(linear_cross_entropy(h, head, t, block), got)  # the sweeps' value alone
        kept = h.detach()[~ignored].clone().requires_grad_()
        want, (want_dh, *want_rest) = loss_and_grads(reference, kept, head, t[~ignored], 0.37)
        torch.testing.assert_close(got, want, rtol=1e-12, atol=0)
        assert all(g.isfinite().all() for g in got_grads if g is not None)
        assert torch.equal(got_grads[0][ignored], torch.zeros_like(got_grads[0][ignored]))
        torch.testing.assert_close(got_grads[0][~ignored], want_dh, rtol=1e-12, atol=1e-14)
        for g, r in zip(got_grads[1:], want_rest, strict=True):
            torch.testing.assert_close(g, r, rtol=1e-12, atol=1e-14)
