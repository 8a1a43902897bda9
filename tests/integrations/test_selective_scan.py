"""Mamba-1's selective scan continued from an incoming state (``lightning_oomb.integrations.hf.selective_scan``):
against one scan over both chunks in float64, forward and backward, and its hand-written backward against
autograd's. (The models trained through it: ``tests/integrations/test_hybrids.py``.)"""

from __future__ import annotations

import warnings

import pytest
import torch
from transformers.models.mamba import modeling_mamba

from lightning_oomb.integrations.hf.float64_rules import float64_selective_scan
from lightning_oomb.integrations.hf.selective_scan import IncomingShare, continued_scan


def scan_inputs(seed: int, batch=2, channels=6, states=4, length=11, dtype=torch.float64):
    """``(u, dt, A, B, C)`` and the keywords of transformers' ``mamba_selective_scan``, each a leaf."""
    g = torch.Generator().manual_seed(seed)

    def leaf(*shape, scale=1.0):
        return (torch.randn(*shape, generator=g, dtype=dtype) * scale).requires_grad_()

    A = (
        -torch.rand(channels, states, generator=g, dtype=dtype) - 0.1
    ).requires_grad_()  # -exp(A_log): decays
    args = (leaf(batch, channels, length), leaf(batch, channels, length, scale=0.5), A, leaf(batch, states, length),
            leaf(batch, states, length))  # fmt: skip
    keywords = dict(D=leaf(channels), z=leaf(batch, channels, length), delta_bias=leaf(channels, scale=0.5),
                    delta_softplus=True)  # fmt: skip
    return args, keywords


def split(args, keywords, at):
    """The scan's per-token inputs before and after token ``at`` (``A``, ``D`` and the bias shared)."""
    u, dt, A, B, C = args
    z = keywords["z"]
    first = ((u[..., :at], dt[..., :at], A, B[..., :at], C[..., :at]), {**keywords, "z": z[..., :at]})
    second = ((u[..., at:], dt[..., at:], A, B[..., at:], C[..., at:]), {**keywords, "z": z[..., at:]})
    return first, second


@pytest.mark.parametrize("at", [1, 5, 10])
def test_a_scan_continued_from_the_first_chunks_state_is_one_scan_over_both(at):
    args, keywords = scan_inputs(at)
    leaves = [*args, *(v for v in keywords.values() if isinstance(v, torch.Tensor))]
    weights = torch.randn(args[0].shape, dtype=torch.float64, generator=torch.Generator().manual_seed(99))

    whole, state = float64_selective_scan(*args, **keywords, return_last_state=True)
    want = torch.autograd.grad((whole * weights).sum() + state.sum(), leaves)
    (first_args, first_kw), (second_args, second_kw) = split(args, keywords, at)
    first, h = float64_selective_scan(*first_args, **first_kw, return_last_state=True)
    second, last = continued_scan(
        float64_selective_scan, h, *second_args, **second_kw, return_last_state=True
    )
    assert torch.allclose(torch.cat([first, second], -1), whole, rtol=0, atol=1e-12)
    assert torch.allclose(last, state, rtol=0, atol=1e-12)
    got = torch.autograd.grad((torch.cat([first, second], -1) * weights).sum() + last.sum(), leaves)
    for g, w in zip(got, want, strict=True):
        assert torch.allclose(g, w, rtol=1e-10, atol=1e-12)
    # without the final state (a model that keeps no cache would not ask for it)
    alone = continued_scan(float64_selective_scan, h, *second_args, **second_kw)
    assert torch.equal(alone, second)


def test_dropping_the_incoming_state_is_wrong():
    """Negative control: transformers' own multi-token scan restarts from zero, far from the whole scan."""
    args, keywords = scan_inputs(0)
    whole = float64_selective_scan(*args, **keywords)
    _, (second_args, second_kw) = split(args, keywords, 5)
    restarted = float64_selective_scan(*second_args, **second_kw)
    assert (restarted - whole[..., 5:]).abs().max() > 1e-2


def test_the_incoming_shares_backward_is_autograds():
    g = torch.Generator().manual_seed(0)
    c = torch.rand(2, 3, 5, dtype=torch.float64, generator=g).cumsum(-1).requires_grad_()
    A = (-torch.rand(3, 4, dtype=torch.float64, generator=g)).requires_grad_()
    h0, C = (
        torch.randn(*s, dtype=torch.float64, generator=g).requires_grad_() for s in ((2, 3, 4), (2, 4, 5))
    )
    assert torch.autograd.gradcheck(IncomingShare.apply, (c, A, h0, C))


def test_the_float64_rule_is_transformers_scan():
    """The float64 rule the self-check and the tests swap in computes what transformers' torch scan does (float32
    inside: to its rounding)."""
    args, keywords = scan_inputs(3, dtype=torch.float32)
    ours, our_state = float64_selective_scan(*args, **keywords, return_last_state=True)
    theirs, their_state = modeling_mamba.mamba_selective_scan(*args, **keywords, return_last_state=True)
    assert torch.allclose(ours, theirs, rtol=1e-5, atol=1e-5)
    assert torch.allclose(our_state, their_state, rtol=1e-5, atol=1e-5)


def test_long_chunks_on_the_torch_scan_are_warned_about():
    """transformers' torch scan (mamba_ssm absent here) is warned about for chunks above SLOW_TORCH_SCAN_TOKENS."""
    from lightning_oomb.integrations.hf import selective_scan

    mixer = modeling_mamba.MambaMixer(modeling_mamba.MambaConfig(hidden_size=8, state_size=2), layer_idx=0)
    tokens = selective_scan.SLOW_TORCH_SCAN_TOKENS
    with selective_scan.continuing_scans([mixer]):
        for length in (tokens, tokens + 1):
            args, keywords = scan_inputs(0, batch=1, channels=2, states=2, length=length, dtype=torch.float32)
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                modeling_mamba.mamba_selective_scan(*args, **keywords)
            slow = [w for w in caught if f"chunk_size <= {tokens}" in str(w.message)]
            assert len(slow) == (length > tokens)
