"""Cross-entropy on final hidden states through the LM head, a block of tokens at a time (fused linear CE).

Logits exist for at most ``block`` tokens at once. Arithmetic matches Hugging Face's causal-LM loss: logits in the
compute dtype (the autocast dtype when autocast is on), log-softmax in float32 (float64 for float64 models),
``ignore_index=-100``, summed (the caller divides by the global target count). An :class:`LMHead` may rescale the
logits (Cohere's ``logit_scale``, Granite's ``1 / logits_scaling``) and soft-cap them (Gemma 2/3's
``final_logit_softcapping``: ``c * tanh(z / c)``), both applied in the log-softmax dtype.

**Without grad** (the engine's forward and eval sweeps) only the value is computed. **With grad** (the backward
sweep's recompute, back-propagated at once) the forward computes the value *and* the gradients of the hidden
states, the weight and the bias from the same logits: each block's logits are computed once (not once for the
value and again in backward), the softmax and the logit gradient overwrite the float32 logits in place, and ``dh``
rows and the weight gradient are written in place into the tensors autograd receives. Backward only rescales them
by ``grad / expected_grad``: exactly 1 when the caller says which gradient it will back-propagate (the engine does),
so the logit gradient is scaled before its cast to the compute dtype, as in HF. Given ``weight_grad`` (the engine
passes the weight's ``.grad``, or its float32 sum under :class:`~lightning_oomb.engine.grads.Float32GradSums`), the
weight gradient is added into that tensor instead, so no ``[V, H]`` tensor is made per chunk (1 GiB at 7B) and
autograd gets none for the weight (the engine passes none when the weight has a gradient hook, which must see it).

The weight gradient accumulates in its target's dtype, one ``addmm_`` per block (its GEMM sums the block's tokens
in float32 or wider): a 16-bit target's running sum is rounded once per block, as a bf16 ``.grad`` is by autograd
once per chunk. A wider target (float32 weights under autocast, a float32 sum) gets each block's compute-dtype
product (as HF makes it), added in slabs of vocabulary rows no larger than the block's logits. The bias gradient
(``V`` numbers) is summed in float32. Memory with grad, beyond the inputs: ``dh``, the weight gradient (``VH`` in
the weight's dtype) unless ``weight_grad`` is given, under autocast one compute-dtype copy of the weight, one block's
hidden rows in the compute dtype, and one block's logits: float32 logits and their compute-dtype cast (or the soft
cap's derivative, if larger; plus a slab for a wider target) — what
:func:`~lightning_oomb.engine.activation_bytes.loss_backward_bytes` counts.

**Ignored targets** (``-100``) add exactly nothing, whatever their rows hold: each block's copy of its hidden rows has
the ignored ones zeroed before the logits, so a +inf or NaN there (a padded position's, logits that would overflow)
never reaches the loss or a gradient — ``F.cross_entropy(ignore_index=-100)`` skips those rows in the loss too,
though its logit gradient there is NaN and with it the weight's. The copy is ``H / V`` of the block's logits, and
zeroing rows of the logits themselves would cost a pass over them.
"""

from __future__ import annotations

import math
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


def linear_cross_entropy(
    hidden: torch.Tensor,
    head: LMHead,
    targets: torch.Tensor,
    block: int = 1024,
    expected_grad: torch.Tensor | None = None,
    weight_grad: torch.Tensor | None = None,
) -> torch.Tensor:
    """Summed CE of ``hidden [..., H]`` through the LM ``head`` against ``targets [...]``, ``block`` tokens at a time.

    With grad enabled and an input that requires it, the gradients are computed here, at once (module docstring);
    ``expected_grad``: the gradient the caller will back-propagate into the result, if known (the engine's backward
    sweep), so that they are computed at that scale. ``weight_grad``: where to add the weight's gradient in place
    (its ``.grad`` or a wider sum of it) instead of handing autograd a new ``[V, H]`` tensor; it needs
    ``expected_grad``, which the result's gradient must then equal (checked). Back-propagate once (``retain_graph``
    is refused)."""
    if block < 1:
        raise ValueError(f"block must be a positive number of tokens, got {block}")
    if weight_grad is not None and (expected_grad is None or weight_grad.shape != head.weight.shape):
        raise ValueError(
            "weight_grad is added into in place before backward runs, so it needs expected_grad (the gradient "
            f"that will reach the loss) and the weight's shape {tuple(head.weight.shape)}; got expected_grad="
            f"{expected_grad!r}, weight_grad of shape {tuple(weight_grad.shape)}."
        )
    hidden, targets = hidden.reshape(-1, hidden.shape[-1]), targets.reshape(-1)
    inputs = (hidden, head.weight, head.bias)
    if torch.is_grad_enabled() and any(x is not None and x.requires_grad for x in inputs):
        return LinearCrossEntropy.apply(
            *inputs, targets, block, head.scale, head.softcap, expected_grad, weight_grad
        )
    return _sweep(*inputs, targets, block, head.scale, head.softcap)


@dataclass
class _Grads:
    """Where a sweep adds its gradients (``None``: not wanted) and the factor of its logit gradient."""

    hidden: torch.Tensor | None
    weight: torch.Tensor | None
    bias: torch.Tensor | None
    scale: torch.Tensor


class LinearCrossEntropy(torch.autograd.Function):
    """``sum_i CE(hidden_i @ W^T + b, target_i)`` over non-ignored targets; gradients made in ``forward``."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, targets, block, scale, softcap, expected_grad, weight_grad):
        acc = _acc_dtype(_compute_dtype(hidden))
        factor = torch.ones((), dtype=acc, device=hidden.device)
        ctx.added = weight_grad is not None and ctx.needs_input_grad[1]  # the weight's gradient went in place
        if ctx.added:  # at exactly that scale: it cannot be rescaled later
            factor = expected_grad.to(acc)
        elif expected_grad is not None:  # a zero would lose the gradients: then rescale from 1
            factor = torch.where(expected_grad == 0, factor, expected_grad.to(acc))
        need, device = ctx.needs_input_grad, hidden.device
        ctx.bias_dtype = None if bias is None else bias.dtype
        if need[1] and not ctx.added:
            weight_grad = torch.zeros(weight.shape, dtype=weight.dtype, device=device)
        ctx.grads = _Grads(
            torch.empty(hidden.shape, dtype=hidden.dtype, device=device) if need[0] else None,
            weight_grad if need[1] else None,
            torch.zeros(bias.shape, dtype=acc, device=device) if need[2] else None,  # V floats: summed wide
            factor,
        )
        return _sweep(hidden, weight, bias, targets, block, scale, softcap, ctx.grads)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_total):
        grads, ctx.grads = ctx.grads, None  # handed out, not kept: autograd can adopt the weight gradient
        if grads is None:
            raise RuntimeError(
                "linear_cross_entropy's gradients were already handed out by an earlier backward — they are made "
                "once, in its forward — back-propagate through it once (without retain_graph), or call it again."
            )
        if ctx.added:  # made at the promised scale, the weight's already added: nothing to rescale
            torch._assert_async(  # (a NaN loss gradient, e.g. a NaN loss squared, is the NaN promised)
                (grad_total == grads.scale) | (grad_total.isnan() & grads.scale.isnan()),
                "linear_cross_entropy got another gradient than expected_grad, at whose scale the weight's gradient "
                "was already added into weight_grad — pass the gradient that will reach the loss",
            )
            dh, dw, db = grads.hidden, None, grads.bias
        else:
            ratio = grad_total / grads.scale
            dh, dw, db = (
                None if g is None else g.mul_(ratio) for g in (grads.hidden, grads.weight, grads.bias)
            )
        del grads
        return dh, dw, None if db is None else db.to(ctx.bias_dtype), None, None, None, None, None, None


def _compute_dtype(hidden: torch.Tensor) -> torch.dtype:
    device = hidden.device.type
    return torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else hidden.dtype


def _acc_dtype(dtype: torch.dtype) -> torch.dtype:
    """The log-softmax dtype: float64 for float64, else float32."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def _sweep(hidden, weight, bias, targets, block, scale, softcap, grads: _Grads | None = None) -> torch.Tensor:
    """The summed loss over blocks of ``block`` tokens; with ``grads``, each block also adds its gradients."""
    dtype = _compute_dtype(hidden)
    total = torch.zeros((), dtype=_acc_dtype(dtype), device=hidden.device)
    with torch.autocast(hidden.device.type, enabled=False):
        w = weight.to(dtype)  # under autocast: one compute-dtype copy for every block
        b = None if bias is None else bias.to(dtype)
        for start in range(0, hidden.shape[0], block):
            rows = slice(start, start + block)
            total += _block(hidden[rows], targets[rows], w, b, scale, softcap, grads, rows)
    return total


def _block(h, t, w, b, scale, softcap, grads: _Grads | None, rows: slice) -> torch.Tensor:
    """One block's summed loss; with ``grads``, adds its gradients into them. Its tensors die on return."""
    valid = t != IGNORE_INDEX
    # an ignored row's hidden state is zeroed first: whatever it holds (a +inf, a NaN, logits that would overflow)
    # adds exactly nothing to the loss or any gradient, as F.cross_entropy(ignore_index) skips the row (a [block, H]
    # copy and fill, against the block's [block, V] logits: ~H / V of one of their passes)
    hc = h.to(w.dtype, copy=True).masked_fill_(~valid[:, None], 0)
    z = torch.mm(hc, w.t()) if b is None else torch.addmm(b, hc, w.t())
    z = z.to(_acc_dtype(w.dtype))  # the compute-dtype logits die here
    chain = _transform_(z, scale, softcap, grads is not None)
    target = t.clamp_min(0)[:, None]
    picked = z.gather(1, target).squeeze(1)
    top = z.amax(1, keepdim=True)
    top.masked_fill_(top == -math.inf, 0)  # a row with a +inf logit: NaN, as F.cross_entropy's log_softmax
    z.sub_(top).exp_()
    sums = z.sum(1, keepdim=True)
    loss = torch.where(valid, sums.log().add_(top).squeeze(1) - picked, 0).sum()  # (ignored rows: exactly 0)
    if grads is None:
        return loss
    dz = z.div_(sums)  # the softmax, as torch.softmax makes it
    dz.scatter_add_(1, target, -valid[:, None].to(dz.dtype))
    dz.mul_((valid * grads.scale)[:, None])
    if chain is not None:
        dz.mul_(chain)
    del chain
    dzc = dz.to(w.dtype)  # the logit gradient in the compute dtype (an alias when it is float32/64 already)
    if grads.hidden is not None:
        out = grads.hidden[rows]
        if out.dtype == dzc.dtype:
            torch.mm(dzc, w, out=out)
        else:  # autocast: the compute-dtype product, cast into float32 rows
            out.copy_(dzc @ w)
    if grads.weight is not None:
        _add_weight_grad(grads.weight, dzc, hc)
    if grads.bias is not None:
        grads.bias.add_(dz.sum(0))
    return loss


def _add_weight_grad(gw: torch.Tensor, dz: torch.Tensor, h: torch.Tensor) -> None:
    """``gw += dz^T @ h`` in place: one ``addmm_`` in ``gw``'s dtype; a wider ``gw`` (float32 weights under autocast)
    gets the compute-dtype product, as HF makes it, slab by slab of vocabulary rows (each at most ``dz``'s size)."""
    if gw.dtype == dz.dtype:
        gw.addmm_(dz.t(), h)
        return
    slab = dz.new_empty((min(gw.shape[0], max(1, dz.numel() // h.shape[1])), h.shape[1]))
    for start in range(0, gw.shape[0], slab.shape[0]):
        rows = gw[start : start + slab.shape[0]]
        product = torch.mm(dz[:, start : start + rows.shape[0]].t(), h, out=slab[: rows.shape[0]])
        rows.add_(product)


def _transform_(z: torch.Tensor, scale: float, softcap: float | None, chain: bool):
    """In place ``z <- softcap(scale * z)``; with ``chain``, ``d out / d z`` (``None`` when it is 1)."""
    if scale != 1.0:
        z.mul_(scale)
    if softcap is None:
        return scale if chain and scale != 1.0 else None
    t = z.div_(softcap).tanh_()
    derivative = None
    if chain:  # (1 - t^2) * scale, in place
        derivative = (t * t).neg_().add_(1)
        if scale != 1.0:
            derivative.mul_(scale)
    t.mul_(softcap)
    return derivative
