"""Log-sum-exp merging of attention over disjoint key parts (shared by the attention backends).

Attention over keys split into parts (offload blocks, and later other ranks' pages) combines exactly: the forward
folds every part into one carried softmax state ``(acc, m, l)`` — ``acc`` the unnormalised ``sum exp(s - m) v``,
``m`` the running max of the scaled scores (any reference point at or above it does: the fused CPU path folds
whole parts with :func:`add_part`, at their log-sum-exp), ``l = sum exp(s - m)`` — in any order, and :func:`finish_state` turns
it into ``out = acc / l`` and ``lse = m + log(l)``; the backward of every part shares the final ``out``/``lse`` and
one ``delta = rowsum(dO * O)`` (:func:`attention_delta`), and adds its dQ into one accumulator.

Attention sinks (GPT-OSS: one learned logit per query head in every row's softmax denominator, attending to
nothing) are one more part of that merge: :func:`add_sinks` folds them into the state once, after every key part,
and the backward of the key parts uses the sink-inclusive ``out``/``lse`` unchanged; :func:`sink_grad` is the
sinks' own gradient.
"""

from __future__ import annotations

import math

import torch

State = tuple[torch.Tensor, torch.Tensor, torch.Tensor]


def compute_dtype(x: torch.Tensor) -> torch.dtype:
    """float64 for float64 inputs, float32 for everything else: the dtype of states, LSE and accumulators."""
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def init_state(q: torch.Tensor) -> State:
    """A fresh forward state for ``q [B, Hq, Lq, D]``: ``acc`` 0, ``m`` -inf, ``l`` 0 (float32; float64 for
    float64 ``q``)."""
    dtype = compute_dtype(q)
    acc = torch.zeros(q.shape, dtype=dtype, device=q.device)
    return acc, torch.full(q.shape[:-1], -math.inf, dtype=dtype, device=q.device), acc.new_zeros(q.shape[:-1])


def finish_state(state: State, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """``(out, lse)`` of a state that has seen every key: ``out = acc / l`` in ``dtype``, ``lse = m + log(l)``."""
    acc, m, l_sum = state
    return (acc / l_sum[..., None]).to(dtype), m + torch.log(l_sum)


def add_part(state: State, out: torch.Tensor, lse: torch.Tensor, first_row: int = 0) -> None:
    """Fold a part's normalised attention ``(out, lse)`` of the rows from ``first_row`` on into ``state``, in place
    (a part whose rows each see at least one key: ``lse`` finite)."""
    acc, m, l_sum = (x[:, :, first_row:] for x in state)
    m_new = torch.maximum(m, lse)
    alpha, beta = torch.exp(m - m_new), torch.exp(lse - m_new)
    acc.mul_(alpha[..., None]).add_(out * beta[..., None])
    l_sum.mul_(alpha).add_(beta)
    m.copy_(m_new)


def attention_delta(out: torch.Tensor, dout: torch.Tensor) -> torch.Tensor:
    """``delta = rowsum(dout * out)`` ``[B, Hq, Lq]`` (float32; float64 for float64), shared by the backward
    calls of every key part."""
    dtype = compute_dtype(out)
    return (dout.to(dtype) * out.to(dtype)).sum(-1)


def add_sinks(state: State, sinks: torch.Tensor) -> None:
    """Fold one logit per query head (``sinks [Hq]``) into a state that has seen every key, in place: the softmax
    denominator gains ``exp(sink)`` and the output nothing."""
    acc, m, l_sum = state
    sink = sinks.to(m.dtype).view(1, -1, 1).expand_as(m)
    m_new = torch.maximum(m, sink)
    alpha = torch.exp(m - m_new)
    acc.mul_(alpha[..., None])
    l_sum.mul_(alpha).add_(torch.exp(sink - m_new))
    m.copy_(m_new)


def sink_grad(sinks: torch.Tensor, lse: torch.Tensor, delta: torch.Tensor) -> torch.Tensor:
    """Gradient of the loss w.r.t. ``sinks [Hq]``: ``-sum_rows p_sink * delta`` with ``p_sink = exp(sink - lse)``
    (``lse`` sink-inclusive, ``delta = rowsum(dO * O)``), in the sinks' dtype."""
    p_sink = torch.exp(sinks.to(lse.dtype).view(1, -1, 1) - lse)
    return -(p_sink * delta).sum((0, 2)).to(sinks.dtype)
