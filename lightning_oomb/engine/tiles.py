"""A token-wise module (an MLP) run a tile of tokens at a time, keeping only its input (``mlp_tile``).

A decoder layer's MLP acts on every token alone, so its output is the same computed over a chunk or over tiles of
it. :func:`tiled` runs ``fn(x)`` tile by tile without a graph and saves only ``x``; its backward recomputes each
tile with grad and back-propagates it at once (the parameters' gradients accumulate into ``.grad``, hooks
included), so what the MLP holds for its backward shrinks from ``chunk x (4 x intermediate)`` values to one
tile's. The recompute re-enters the forward's autocast state and replays its RNG (dropout). Cost: one more MLP
forward per step.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from lightning_oomb.engine.replay import AutocastState, RNGState


def tiled(fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor, tile: int, params) -> torch.Tensor:
    """``fn(x)`` for ``x [B, T, H]``, ``tile`` tokens at a time (``T > tile``; without grad too, so no sweep holds
    more than a tile's intermediates); ``params``: the trainable parameters ``fn`` uses (their gradients are made
    in the backward)."""
    if x.shape[-2] <= tile:
        return fn(x)
    if not torch.is_grad_enabled():
        return _by_tiles(fn, x, tile)
    trainable = [p for p in params if p.requires_grad]
    return _Tiled.apply(x, fn, tile, *trainable)


def _by_tiles(fn, x: torch.Tensor, tile: int) -> torch.Tensor:
    """``fn`` of each tile of ``x``'s tokens, into one output (each tile's intermediates die with it)."""
    return torch.cat([fn(x[..., s, :]) for s in _tile_slices(x.shape[-2], tile)], dim=-2)


def _tile_slices(length: int, tile: int) -> list[slice]:
    return [slice(start, min(start + tile, length)) for start in range(0, length, tile)]


class _Tiled(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, fn, tile, *params):
        ctx.fn, ctx.tile, ctx.num_params = fn, tile, len(params)
        ctx.autocast = AutocastState(x.device)
        ctx.rng = RNGState(x.device)
        ctx.save_for_backward(x)
        with torch.no_grad():  # detached: a no-grad view of x would still say it requires grad (module hooks)
            return _by_tiles(fn, x.detach(), tile)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad):
        (x,) = ctx.saved_tensors
        dx = torch.empty_like(x) if ctx.needs_input_grad[0] else None
        with torch.random.fork_rng(devices=[x.device] if x.is_cuda else [], device_type=x.device.type):
            ctx.rng.restore()
            for s in _tile_slices(x.shape[-2], ctx.tile):
                xs = x[..., s, :].detach().requires_grad_(dx is not None)
                with torch.enable_grad(), ctx.autocast():
                    out = ctx.fn(xs)
                torch.autograd.backward(out, grad[..., s, :])
                if dx is not None:
                    dx[..., s, :] = xs.grad
        return dx, None, None, *([None] * ctx.num_params)
