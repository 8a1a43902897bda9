"""Length-dependent RoPE made chunk-exact: the rotary embedding is pinned to the whole step's position span.

Two RoPE types pick their frequencies from the positions of the call they see: ``longrope`` (Phi-3/3.5: the long
or the short factors, by whether ``max(position_ids) + 1`` exceeds the original context) and ``dynamic`` (NTK
scaling grown to ``max(position_ids) + 1``). In full-sequence training that span is the batch's largest position
+ 1 (the sequence length, or with packed documents the longest document's); a chunk would show its own instead.
transformers implements both in one decorator around the rotary module's ``forward`` (``dynamic_rope_update``,
built with ``functools.wraps``): :func:`pinned_rope` runs that update once with the step's span — exactly what a
full-sequence step runs — and then lets the chunks call the undecorated ``forward``, so every chunk uses the full
step's frequencies.
"""

from __future__ import annotations

import contextlib
import inspect
import types
from collections.abc import Iterator

import torch

LENGTH_DEPENDENT = ("longrope", "dynamic")


def _length_dependent(rope_type: str | None) -> bool:
    return bool(rope_type) and any(kind in rope_type for kind in LENGTH_DEPENDENT)


def length_dependent_rotaries(model: torch.nn.Module) -> list[tuple[torch.nn.Module, list[str | None]]]:
    """The rotary modules of ``model`` whose frequencies depend on the call's length, each with the layer types
    (``None``: the module has one RoPE) that do."""
    found = []
    for module in model.modules():
        rope_type = getattr(module, "rope_type", None)
        if rope_type is None:
            continue
        kinds = rope_type if isinstance(rope_type, dict) else {None: rope_type}
        layer_types = [layer_type for layer_type, kind in kinds.items() if _length_dependent(kind)]
        if layer_types:
            found.append((module, layer_types))
    return found


def can_pin(module: torch.nn.Module) -> bool:
    """The module's ``forward`` is transformers' ``dynamic_rope_update`` wrapper (the undecorated one is there)."""
    return hasattr(type(module).forward, "__wrapped__")


@contextlib.contextmanager
def pinned_rope(rotaries: list[tuple[torch.nn.Module, list[str | None]]], num_tokens: int) -> Iterator[None]:
    """While the block runs, every rotary module in ``rotaries`` uses the frequencies of a call whose largest
    position is ``num_tokens - 1``, whatever positions a chunk passes. A ``forward`` set on a module's instance (an
    accelerate hook) is put back afterwards."""
    own = [vars(module).get("forward") for module, _ in rotaries]
    for module, layer_types in rotaries:
        decorated = type(module).forward
        probe = next(module.buffers(), None)
        device = probe.device if probe is not None else torch.device("cpu")
        x = torch.zeros(1, device=device)
        last = torch.full((1, 1), num_tokens - 1, device=device)
        with torch.no_grad():
            for (
                layer_type
            ) in layer_types:  # the full sequence's frequency update, as its own step would run it
                decorated(module, x, last, **({} if layer_type is None else {"layer_type": layer_type}))
        # undecorated: transformers 5.17 wraps the update in torch.no_grad() too
        module.forward = types.MethodType(inspect.unwrap(decorated), module)
    try:
        yield
    finally:
        for (module, _), forward in zip(rotaries, own, strict=True):
            if forward is None:
                del module.forward
            else:
                module.forward = forward
