"""A backward sweep's gradients of 16-bit parameters, summed over its chunks in float32.

Autograd adds each chunk's parameter gradient into ``.grad`` in the parameter's dtype, so under ``bf16-true`` the
running sum is rounded to bf16 once per chunk and its error grows with the number of chunks (at 1024 chunks 3.7x
that of ordinary bf16 training, 32x on the final norm's weight: ``benchmarks/bf16_grad_fidelity.py``).
:class:`Float32GradSums` keeps one float32 sum per trainable 16-bit parameter in place of its ``.grad`` while the
sweep runs: a post-accumulate-grad hook moves each chunk's gradient into the sum as soon as autograd has made it,
and on exit the sum is written back into ``.grad``, rounded once — what ``.grad`` held before (earlier
micro-batches of gradient accumulation) added to it exactly once. Cost: during the sweep a parameter's gradient takes 4 bytes instead of 2, nothing outside it. (A
compensated bf16 pair — ``.grad`` plus a bf16 error term — would cost the same 2 bytes for fewer bits.)
Parameters of other dtypes (float32, float64, frozen ones) are left to autograd.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

HALF_DTYPES = (torch.bfloat16, torch.float16)


class Float32GradSums:
    """Context manager: inside it, the chunk gradients of ``params`` that are trainable and 16-bit are summed in
    float32 and ``.grad`` is ``None``; on exit ``.grad`` = previous ``.grad`` + the sum, rounded once to the
    parameter's dtype (a parameter that got no gradient keeps its ``.grad`` unchanged)."""

    def __init__(self, params: Iterable[torch.Tensor]):
        self.params = [p for p in dict.fromkeys(params) if p.requires_grad and p.dtype in HALF_DTYPES]
        self._sums: dict[int, torch.Tensor | None] = {}
        self._handles: list = []

    def __enter__(self) -> Float32GradSums:
        for p in self.params:  # the old .grad joins the sum with the first chunk's gradient
            self._sums[id(p)], p.grad = p.grad, None
            self._handles.append(p.register_post_accumulate_grad_hook(self._take))
        return self

    def _take(self, p: torch.Tensor) -> None:
        grad, p.grad = p.grad, None
        if grad is None:  # autograd got no gradient for it (e.g. one added in place into the sum)
            return
        held = self._sums[id(p)]
        if held is not None and held.dtype == torch.float32:
            held.add_(grad)
        else:
            self._sums[id(p)] = grad.float() if held is None else held.float().add_(grad)

    def accumulator(self, p: torch.Tensor) -> torch.Tensor | None:
        """``p``'s float32 sum, for a caller that adds a gradient into it in place (made now from the earlier
        ``.grad`` or zeros); ``None`` if ``p`` is not one of the summed parameters."""
        if id(p) not in self._sums:
            return None
        held = self._sums[id(p)]
        if held is None or held.dtype != torch.float32:
            held = self._sums[id(p)] = (
                torch.zeros_like(p, dtype=torch.float32) if held is None else held.float()
            )
        return held

    def __exit__(self, *exc) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        for p in self.params:  # one parameter at a time: at most one extra 16-bit copy exists at once
            total = self._sums.pop(id(p))
            p.grad = total if total is None or total.dtype == p.dtype else total.to(p.dtype)


def gradient_accumulator(p: torch.Tensor, sums: Float32GradSums | None) -> torch.Tensor | None:
    """Where a gradient of ``p`` may be added in place, as autograd would accumulate it: its float32 sum while
    ``sums`` runs for it, else ``.grad`` (made zero if ``None``); ``None`` for a tensor autograd would not
    accumulate into (frozen, or computed from others: not a leaf)."""
    if not (p.requires_grad and p.is_leaf):
        return None
    held = None if sums is None else sums.accumulator(p)
    if held is None:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
        held = p.grad
    return held
