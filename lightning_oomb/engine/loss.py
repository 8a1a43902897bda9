"""Cross-entropy on final hidden states, computing logits for a block of tokens at a time.

Never materialises ``[tokens, vocab]`` logits for more than ``block`` tokens: forward keeps only the hidden
states, backward recomputes each block's logits. Arithmetic matches Hugging Face's causal-LM loss: logits in the
compute dtype (the autocast dtype when autocast is on), log-softmax in float32 (float64 for float64 models),
``ignore_index=-100``, summed (the caller divides by the global target count). An :class:`LMHead` may rescale the
logits (Cohere's ``logit_scale``, Granite's ``1 / logits_scaling``) and soft-cap them (Gemma 2/3's
``final_logit_softcapping``: ``c * tanh(z / c)``), both applied in the log-softmax dtype.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

IGNORE_INDEX = -100


@dataclass(frozen=True)
class LMHead:
    """The LM head as the loss uses it: logits = ``softcap(scale * (h @ weight^T + bias))``.

    ``weight [V, H]``, ``bias [V]`` or ``None``; ``scale`` multiplies the logits (1: none); ``softcap`` ``c`` caps
    them at ``c * tanh(z / c)`` (``None``: none)."""

    weight: torch.Tensor
    bias: torch.Tensor | None = None
    scale: float = 1.0
    softcap: float | None = None


def shift_labels(labels: torch.Tensor) -> torch.Tensor:
    """Targets over the **whole** sequence: position ``i`` predicts ``labels[i + 1]``; the last predicts nothing."""
    return torch.nn.functional.pad(labels[:, 1:], (0, 1), value=IGNORE_INDEX)


def _compute_dtype(hidden: torch.Tensor) -> torch.dtype:
    device = hidden.device.type
    return torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else hidden.dtype


class LinearCrossEntropy(torch.autograd.Function):
    """``sum_i CE(hidden_i @ W^T + b, target_i)`` over non-ignored targets."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, targets, block: int, scale: float, softcap: float | None):
        dtype = _compute_dtype(hidden)
        acc_dtype = torch.float64 if dtype == torch.float64 else torch.float32
        total = torch.zeros((), dtype=acc_dtype, device=hidden.device)
        with torch.autocast(hidden.device.type, enabled=False):
            for i in range(0, hidden.shape[0], block):
                logits, _ = _transformed(_logits(hidden[i : i + block], weight, bias, dtype).to(acc_dtype), scale,
                                         softcap)  # fmt: skip
                t = targets[i : i + block]
                valid = t != IGNORE_INDEX
                picked = logits.gather(1, t.clamp_min(0)[:, None]).squeeze(1)
                total += ((torch.logsumexp(logits, 1) - picked) * valid).sum()
        ctx.save_for_backward(hidden, weight, bias, targets)
        ctx.args = (block, dtype, scale, softcap)
        return total

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_total):
        hidden, weight, bias, targets = ctx.saved_tensors
        block, dtype, scale, softcap = ctx.args
        acc_dtype = grad_total.dtype
        dh = torch.empty_like(hidden)
        dw = (
            torch.zeros(weight.shape, dtype=acc_dtype, device=weight.device)
            if ctx.needs_input_grad[1]
            else None
        )
        db = torch.zeros(bias.shape, dtype=acc_dtype, device=bias.device) if ctx.needs_input_grad[2] else None
        with torch.autocast(hidden.device.type, enabled=False):
            for i in range(0, hidden.shape[0], block):
                h = hidden[i : i + block]
                t = targets[i : i + block]
                valid = (t != IGNORE_INDEX)[:, None]
                logits, chain = _transformed(_logits(h, weight, bias, dtype).to(acc_dtype), scale, softcap)
                probs = torch.softmax(logits, 1)
                probs.scatter_add_(1, t.clamp_min(0)[:, None], -valid.to(acc_dtype))
                dlogits = probs * valid * grad_total
                dlogits = (dlogits if chain is None else dlogits * chain).to(dtype)
                dh[i : i + block] = (dlogits @ weight.to(dtype)).to(hidden.dtype)
                if dw is not None:
                    dw += (dlogits.t() @ h.to(dtype)).to(acc_dtype)
                if db is not None:
                    db += dlogits.sum(0).to(acc_dtype)
        return (
            dh,
            None if dw is None else dw.to(weight.dtype),
            None if db is None else db.to(bias.dtype),
            None,
            None,
            None,
            None,
        )


def _logits(h, weight, bias, dtype):
    logits = h.to(dtype) @ weight.to(dtype).t()
    return logits if bias is None else logits + bias.to(dtype)


def _transformed(logits: torch.Tensor, scale: float, softcap: float | None):
    """``softcap(scale * logits)`` and ``d out / d logits`` (``None`` when it is 1: no transform)."""
    if scale == 1.0 and softcap is None:
        return logits, None
    z = logits * scale if scale != 1.0 else logits
    if softcap is None:
        return z, scale
    t = torch.tanh(z / softcap)
    return t * softcap, (1 - t * t) * scale


def linear_cross_entropy(
    hidden: torch.Tensor, head: LMHead, targets: torch.Tensor, block: int = 1024
) -> torch.Tensor:
    """Summed CE of ``hidden [..., H]`` through the LM ``head`` against ``targets [...]``."""
    return LinearCrossEntropy.apply(
        hidden.reshape(-1, hidden.shape[-1]), head.weight, head.bias, targets.reshape(-1), block, head.scale,
        head.softcap,
    )  # fmt: skip
