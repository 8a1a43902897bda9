"""A custom model's chunking check: one OOMB step in several chunks against the same step in one chunk, in float64.

A step in one chunk carries nothing from chunk to chunk — it is the model's own computation over the whole
sequence — so where the two differ beyond float64 rounding the model's chunk protocol is wrong: a state reported
one token early or late, a layer that reads past its chunk, a position that restarts per chunk. (Hugging Face
models get this check from the strategy at setup, on a tiny twin of their config; a custom model has no config
to shrink, so the check runs on the instance it is given: build a small one of the same architecture.)
"""

from __future__ import annotations

import copy

import torch

from lightning_oomb.engine.config import OOMBConfig
from lightning_oomb.engine.errors import OOMBConfigError
from lightning_oomb.engine.recurrence import OOMBEngine


def check_chunking(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    chunk_size: int | None = None,
    page_size: int = 16,
    layer_checkpointing: bool = False,
    tolerance: float = 1e-10,
) -> float:
    """Train a float64 copy of ``model`` one step on ``input_ids [B, N]`` in chunks of ``chunk_size`` tokens
    (default: the largest multiple of ``page_size`` that makes at least three chunks, the last one ragged where
    ``N`` allows) and in one chunk, and compare the losses and every parameter's gradient. Returns the largest
    relative difference; raises :class:`OOMBConfigError` naming the worst parameter when it exceeds
    ``tolerance``. ``model`` is left as it was: its copy trains, in eval mode (dropout off: its masks would follow
    each chunking's draws); keep it small — the copy is float64."""
    if not isinstance(model, torch.nn.Module):
        raise OOMBConfigError(
            f"check_chunking takes an nn.Module (a ChunkModel built on ManagedModelMixin), not "
            f"{type(model).__name__} — it trains a float64 copy of it — pass the model itself."
        )
    seq_len = input_ids.shape[-1]
    if chunk_size is None:
        chunk_size = page_size * max(1, (seq_len - 1) // (3 * page_size))
    if chunk_size >= seq_len:
        raise OOMBConfigError(
            f"chunk_size={chunk_size} makes one chunk of the {seq_len} tokens — there would be nothing to compare — "
            f"pass longer input_ids (at least {2 * page_size + 1} tokens) or a smaller chunk_size."
        )
    twin = copy.deepcopy(model).double().eval()  # no dropout: its masks would follow each chunking's draws
    chunked = _step(twin, input_ids, chunk_size, page_size, layer_checkpointing)
    whole = _step(twin, input_ids, page_size * -(-seq_len // page_size), page_size, layer_checkpointing)
    errors = {name: _relative(chunked[name], whole[name]) for name in whole}
    worst = max(errors, key=errors.get)
    if errors[worst] > tolerance:
        where = "the loss" if worst == "loss" else f"{worst}'s gradient"
        raise OOMBConfigError(
            f"{type(model).__name__} trains differently in chunks of {chunk_size} tokens than in one chunk: a "
            f"relative error of {errors[worst]:.1e} in {where} (float64, tolerance {tolerance:.0e}) — its chunk "
            "protocol is wrong (a carried state reported before the chunk's last token, a layer reading past its "
            "chunk, positions that restart per chunk) — see the ChunkModel rules in lightning_oomb/engine/model.py."
        )
    return errors[worst]


def _step(
    model, input_ids, chunk_size: int, page_size: int, layer_checkpointing: bool
) -> dict[str, torch.Tensor]:
    """One step's loss and gradients (``None`` gradients as zeros: both steps see the same parameters)."""
    model.zero_grad(set_to_none=True)
    config = OOMBConfig(chunk_size=chunk_size, page_size=page_size, layer_checkpointing=layer_checkpointing)
    loss = OOMBEngine(model, config).loss(input_ids)
    loss.backward()
    grads = {n: torch.zeros_like(p) if p.grad is None else p.grad.clone() for n, p in model.named_parameters()
             if p.requires_grad}  # fmt: skip
    return {"loss": loss.detach(), **grads}


def _relative(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got - want).abs().max() / want.abs().max().clamp_min(1e-30)).item()
