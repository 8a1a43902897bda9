"""The MoE router's load-balancing loss (``output_router_logits=True``), exact across chunks.

transformers' ``load_balancing_loss_func`` (Switch Transformer; Mixtral, Qwen-MoE, GPT-OSS, OLMoE, ...) is
``aux = E * sum_e (C_e / R) * (S_e / R)`` over all tokens of all layers: ``C_e`` the top-k assignments to expert
``e``, ``S_e`` its summed router probabilities, ``R`` the routed rows. It couples every token of the step, but only
through ``C`` and ``R``, which carry no gradient: the forward sweep collects them (and ``S``, for the value), and in
the backward sweep each chunk contributes ``coef * E / R^2 * sum_e C_e * S_chunk,e``, whose sum over chunks has
exactly the gradient of ``coef * aux``. The step's loss adds ``coef * aux`` as Hugging Face's does. Under context
parallelism each rank collects its own tokens' ``C``, ``S`` and ``R`` and the engine sums them over the group
(:meth:`RouterBalanceLoss.reduce`) before the value and the backward shares are made.
"""

from __future__ import annotations

import inspect
import sys

import torch

from lightning_oomb.engine.attention import ChunkContext


def balancing_loss_of(model: torch.nn.Module):
    """The model's ``load_balancing_loss_func`` if its ``forward`` adds it to the loss (else ``None``)."""
    module = sys.modules.get(type(model).__module__)
    func = getattr(module, "load_balancing_loss_func", None)
    try:
        uses = func is not None and "load_balancing_loss_func(" in inspect.getsource(type(model).forward)
    except (OSError, TypeError):
        uses = False
    return func if uses else None


class RouterBalanceLoss:
    """One step's load-balancing term (see the module docstring); the engine's ``StepLoss``."""

    def __init__(self, num_experts: int, top_k: int, coef: float) -> None:
        self.num_experts, self.top_k, self.coef = num_experts, top_k, coef
        self.counts = self.prob_sum = None
        self.rows = 0
        self._term = None

    def _stats(self, router_logits, tokens: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor, object]:
        """Top-k assignment counts ``[E]``, summed probabilities ``[E]`` (differentiable) and rows (an int, or an
        int64 tensor under padding) of one chunk; ``tokens``: the real tokens ``[B, L]`` under right padding
        (padded rows count nothing, as transformers' ``attention_mask`` makes them). No host sync: the counts are
        scattered into ``E`` bins (``bincount`` and boolean indexing would read sizes on the host)."""
        counts = probs_sum = None
        rows = 0
        real = None if tokens is None else tokens.reshape(-1)
        for logits in router_logits:
            dtype = torch.float64 if logits.dtype == torch.float64 else torch.float32
            probs = torch.softmax(logits, dim=-1)
            chosen = torch.topk(probs, self.top_k, dim=-1).indices
            weight = probs.new_ones((), dtype=dtype) if real is None else real[:, None].to(dtype)
            layer_counts = probs.new_zeros(self.num_experts, dtype=dtype).scatter_add_(
                0, chosen.reshape(-1), weight.expand(chosen.shape).reshape(-1)
            )
            counts = layer_counts if counts is None else counts + layer_counts
            layer_sum = (probs.to(dtype) * weight).sum(0)  # padded rows add exact zeros
            probs_sum = layer_sum if probs_sum is None else probs_sum + layer_sum
            rows = rows + (probs.shape[0] if real is None else real.sum())
        return counts, probs_sum, rows

    def record(self, chunk: ChunkContext, router_logits) -> None:
        """A chunk's router logits (one ``[rows, E]`` tensor per layer), in every sweep (a context-parallel
        rank's stand-in token routes nothing: its share is zero)."""
        counts, probs_sum, rows = self._stats(router_logits, chunk.tokens)
        if chunk.context is not None and not chunk.context.own:
            counts, probs_sum, rows = counts * 0, probs_sum * 0, 0
        if chunk.sweep != "backward":
            self.counts = counts if self.counts is None else self.counts + counts
            self.prob_sum = (
                probs_sum.detach() if self.prob_sum is None else self.prob_sum + probs_sum.detach()
            )
            self.rows += rows
        else:  # C and R are the whole step's (the forward sweep's), the probabilities this chunk's
            self._term = self.coef * self.num_experts * (self.counts * probs_sum).sum() / self.rows**2

    def reduce(self, sum_) -> None:
        """Context parallelism, after the forward sweep: the group's ``C``, ``S`` and ``R`` (``sum_`` sums a tensor
        over the group in place)."""
        self.counts = sum_(self.counts.clone())
        self.prob_sum = sum_(self.prob_sum.clone())
        self.rows = sum_(torch.as_tensor(self.rows, dtype=torch.int64, device=self.counts.device).reshape(1))[
            0
        ]

    def value(self) -> torch.Tensor:
        """``coef * aux`` of the step (after the forward sweep)."""
        return self.coef * self.num_experts * ((self.counts / self.rows) * (self.prob_sum / self.rows)).sum()

    def chunk_term(self) -> torch.Tensor:
        """The recomputed chunk's differentiable share (backward sweep, after :meth:`record`)."""
        term, self._term = self._term, None
        return term
