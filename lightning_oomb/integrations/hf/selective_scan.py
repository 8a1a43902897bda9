"""Mamba-1 mixers (Mamba, Falcon-Mamba, Jamba): their selective scan continued from the previous chunk's state.

transformers' multi-token selective scan (``mamba_selective_scan`` of each model's module: its torch loop, or
mamba_ssm's kernel) starts from a zero state whatever the cache holds, so a chunk's call alone cannot continue the
sequence. The scan is linear in its state: from an incoming ``h0`` (``[B, I, N]``, per channel ``i`` and state
column ``n``),

    h_t = h_t|0 + exp(A Σ_{s<=t} Δ_s) ⊙ h0
    y_t = y_t|0 + silu(z_t) Σ_n C_t[n] exp(A[:, n] Σ_{s<=t} Δ_s) h0[:, n]

(``|0``: the scan from zero; ``Δ = softplus(dt + bias)``). While a carried Mamba-1 mixer runs a chunk that
continues a sequence, its model's module scans with :func:`continued_scan`: the model's own scan from zero plus
``h0``'s share, which :class:`IncomingShare` computes one state column at a time (nothing ``[B, I, L, N]``
is held for the backward).
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import importlib.util
import warnings
from collections.abc import Callable, Iterator
from unittest import mock

import torch
import torch.nn.functional as F

SCANS_FROM_ZERO = frozenset({"MambaMixer", "FalconMambaMixer", "JambaMambaMixer"})
SCAN = "mamba_selective_scan"  # the module-level function their forwards call
# tokens per call above which transformers' torch scan (no mamba_ssm) is warned about: its backward takes time
# growing faster than the square of a call's tokens (benchmarks/hybrid_memory.py --family mamba)
SLOW_TORCH_SCAN_TOKENS = 512


class IncomingShare(torch.autograd.Function):
    """``out[b, i, t] = Σ_n exp(A[i, n] c[b, i, t]) h0[b, i, n] C[b, n, t]`` for ``c [B, I, L]`` (the running sum
    of Δ), ``A [I, N]``, ``h0 [B, I, N]``, ``C [B, N, L]``, all of one dtype; the backward recomputes the decays
    column by column."""

    @staticmethod
    def forward(ctx, c, A, h0, C):
        ctx.save_for_backward(c, A, h0, C)
        out = torch.zeros_like(c)
        for n in range(A.shape[1]):
            out += torch.exp(c * A[:, n, None]) * h0[..., n, None] * C[:, None, n]
        return out

    @staticmethod
    def backward(ctx, grad):
        c, A, h0, C = ctx.saved_tensors
        dc, dA, dh0, dC = (torch.zeros_like(x) for x in (c, A, h0, C))
        for n in range(A.shape[1]):
            weighted = grad * torch.exp(c * A[:, n, None])  # [B, I, L]
            dh0[..., n] = (weighted * C[:, None, n]).sum(-1)
            dC[:, n] = (weighted * h0[..., n, None]).sum(1)
            full = weighted * h0[..., n, None] * C[:, None, n]  # d out / d (A[i, n] c[b, i, t]) times grad
            dc += full * A[:, n, None]
            dA[:, n] = (full * c).sum((0, 2))
        return dc, dA, dh0, dC


def continued_scan(scan: Callable, h0: torch.Tensor, hidden_states, dt, A, B, C, D=None, z=None, delta_bias=None,
                   delta_softplus=False, return_last_state=False, **kwargs):  # fmt: skip
    """``scan`` (transformers' ``mamba_selective_scan``, same arguments) from ``h0`` instead of zeros."""
    result = scan(hidden_states, dt, A, B, C, D=D, z=z, delta_bias=delta_bias, delta_softplus=delta_softplus,
                  return_last_state=return_last_state, **kwargs)  # fmt: skip
    out, last = result if return_last_state else (result, None)
    compute = torch.promote_types(dt.dtype, torch.float32)
    # Δ as transformers' torch scan takes it
    delta = dt if delta_bias is None else dt + delta_bias.to(dt.dtype)[..., None]
    delta = F.softplus(delta) if delta_softplus else delta
    c = delta.to(compute).cumsum(-1)
    A, h0 = A.to(compute), h0.to(compute)
    share = IncomingShare.apply(c, A, h0, C.to(compute))
    if z is not None:
        share = share * F.silu(z.to(compute))
    out = out + share.to(out.dtype)
    if last is None:
        return out
    return out, last + (torch.exp(c[..., -1, None] * A) * h0).to(last.dtype)


@contextlib.contextmanager
def continuing_scans(
    mixers: list[torch.nn.Module],
) -> Iterator[Callable[[torch.nn.Module, torch.Tensor | None], None]]:
    """While the block runs, the models' modules of ``mixers`` in :data:`SCANS_FROM_ZERO` scan with
    :func:`continued_scan` once armed: the block gets ``arm(mixer, h0)``, to call as such a mixer's forward starts;
    its module's next scan starts from ``h0`` (``None``: from zero, a sequence's first chunk)."""
    modules = {
        importlib.import_module(type(m).__module__) for m in mixers if type(m).__name__ in SCANS_FROM_ZERO
    }
    armed: dict[object, torch.Tensor] = {}

    def scan_of(module, original):
        def scan(*args, **kwargs):
            warn_if_slow(args[0])
            h0 = armed.pop(module, None)
            return original(*args, **kwargs) if h0 is None else continued_scan(original, h0, *args, **kwargs)

        return scan

    def arm(mixer: torch.nn.Module, h0: torch.Tensor | None) -> None:
        module = importlib.import_module(type(mixer).__module__)
        armed.pop(module, None)
        if h0 is not None:
            armed[module] = h0

    with contextlib.ExitStack() as patches:
        for module in modules:
            patches.enter_context(mock.patch.object(module, SCAN, scan_of(module, getattr(module, SCAN))))
        yield arm


def warn_if_slow(hidden_states: torch.Tensor) -> None:
    """Warn (once) when a chunk of more than :data:`SLOW_TORCH_SCAN_TOKENS` tokens goes through transformers' torch
    Mamba-1 scan, which it takes when mamba_ssm is not installed."""
    if hidden_states.shape[-1] > SLOW_TORCH_SCAN_TOKENS and not _mamba_ssm_installed():
        warnings.warn(
            f"Mamba-1 layers on transformers' torch selective scan (mamba_ssm is not installed) with chunks of "
            f"{hidden_states.shape[-1]} tokens: its backward takes time growing faster than the square of a "
            f"chunk's tokens (a 768-token step of a small Mamba: 21 s whole, 3 s in chunks of 128) — use "
            f"chunk_size <= {SLOW_TORCH_SCAN_TOKENS}, or install mamba_ssm on a CUDA machine.",
            UserWarning,
            stacklevel=2,
        )


@functools.cache
def _mamba_ssm_installed() -> bool:
    return importlib.util.find_spec("mamba_ssm") is not None
