"""A custom model's exactness check, in float64: one OOMB step in several chunks against the same step in one
chunk, and that against the model's own training step (its ``forward(input_ids, labels)``).

A step in one chunk carries nothing from chunk to chunk — it is the model's own computation over the whole
sequence — so where the two differ beyond float64 rounding the model's chunk protocol is wrong: a state reported
one token early or late, a layer that reads past its chunk or attends without ``paged_attention``, a position that
restarts per chunk. Where the one-chunk step differs from the model's own ``forward``, what the engine was told
differs from what the model computes: ``hidden_states`` before the final norm, an LM head's scale or softcap not
declared in :class:`~lightning_oomb.engine.loss.LMHead`, labels the forward takes already shifted. (Hugging Face
models get this check from the strategy at setup on a tiny twin of their config; a custom model has no config to
shrink, so the check runs on a float64 copy of the instance: :func:`verify_chunk_model` at the strategies' setup
for models of up to :data:`CHECK_MAX_PARAMETERS`, :func:`check_chunking` on a small instance otherwise.)
"""

from __future__ import annotations

import copy
import warnings
from collections.abc import Mapping

import torch

from lightning_oomb.engine.config import OOMBConfig
from lightning_oomb.engine.errors import OOMBConfigError
from lightning_oomb.engine.model import ManagedModelMixin
from lightning_oomb.engine.recurrence import OOMBEngine

CHECK_MAX_PARAMETERS = 20_000_000  # larger models are not copied for the setup check (memory, time)
_CHECK_TOKENS = 53  # with pages of 16: three chunks of 16 and a ragged fourth


def check_chunking(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    chunk_size: int | None = None,
    page_size: int = 16,
    layer_checkpointing: bool = False,
    tolerance: float = 1e-10,
    own_forward: bool = True,
) -> float:
    """Train a float64 CPU copy of ``model`` one step on ``input_ids [B, N]`` in chunks of ``chunk_size`` tokens
    (default: the largest multiple of ``page_size`` that makes at least three chunks, the last one ragged where
    ``N`` allows), in one chunk and — with ``own_forward`` — by its own ``forward(input_ids, labels=input_ids)``
    (the call the strategies answer with the engine's loss; skipped where that call fails), and compare the losses
    and every parameter's gradient. Returns the largest relative difference; raises :class:`OOMBConfigError`
    naming the worst parameter when it exceeds ``tolerance``, or when the forward returns something else than the
    loss (the strategies' answer would break the code reading it). ``model`` is left as it was: its copy trains, in
    eval mode (dropout off: its masks would follow each chunking's draws); keep it small — the copy is float64."""
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
    name = type(model).__name__
    # eval: no dropout, whose masks would follow each run's draws
    twin = copy.deepcopy(model).to("cpu", torch.float64).eval()
    input_ids = input_ids.cpu()
    whole, _ = _step(twin, input_ids, page_size * -(-seq_len // page_size), page_size, layer_checkpointing)
    own = _own_step(twin, input_ids) if own_forward else None
    own_error = 0.0 if own is None else _compare(
        name, whole, own, tolerance, "through OOMB (one chunk) than by its own forward(input_ids, labels)",
        "what the engine is told differs from what forward computes: hidden_states must return the final normed "
        "hidden states forward feeds to its head, lm_head() must declare the head's bias, scale and softcap (LMHead), "
        "and labels are taken unshifted (the engine shifts them, as Hugging Face models do; a forward taking targets "
        "already shifted needs its own answer_calls)",
    )  # fmt: skip
    chunked, called = _step(twin, input_ids, chunk_size, page_size, layer_checkpointing)
    error = _compare(
        name, chunked, whole, tolerance, f"in chunks of {chunk_size} tokens than in one chunk",
        "its chunk protocol is wrong (an attention not going through paged_attention, a carried state reported "
        "before the chunk's last token or not declared, a layer reading past its chunk, positions that restart per "
        "chunk) — see the ChunkModel rules in lightning_oomb/engine/model.py",
    )  # fmt: skip
    _check_layers_called(twin, called)
    return max(error, own_error)


def verify_chunk_model(model: torch.nn.Module) -> bool:
    """The strategies' setup check of a custom model (``verify_exactness``): :func:`check_chunking` on a float64
    copy at a few tokens (3.3 chunks of 16), to 1e-5 (a model may norm or softmax in float32 even then; a protocol
    error is orders of magnitude larger). Returns whether it ran: a model of more than :data:`CHECK_MAX_PARAMETERS`
    parameters is not copied, with a warning. It runs at every setup (a fraction of a second for small models;
    nothing is cached: one class may compute differently per instance); the random state is left as it was."""
    params = sum(p.numel() for p in model.parameters())
    if params > CHECK_MAX_PARAMETERS:
        warnings.warn(
            f"OOMB's self-check did not check {type(model).__name__}: its {params:,} parameters are more than the "
            f"{CHECK_MAX_PARAMETERS:,} it copies to float64 — run lightning_oomb.engine.check_chunking(model, "
            "input_ids) on a small instance of the same architecture before a long run (verify_exactness=False "
            "skips the check and this warning).",
            UserWarning,
            stacklevel=2,
        )
        return False
    vocab = min(model.vocab_size, model.num_embeddings)
    ids = torch.randint(0, vocab, (2, _CHECK_TOKENS), generator=torch.Generator().manual_seed(0))
    try:
        with torch.random.fork_rng(devices=[]):
            check_chunking(model, ids, tolerance=1e-5, own_forward=_answers_as_forward(model))
    except OOMBConfigError as err:
        raise OOMBConfigError(
            f"OOMB's self-check (a float64 copy trained at {_CHECK_TOKENS} tokens) refused the model: "
            f"{str(err).rstrip('.')} — or pass verify_exactness=False to train it anyway."
        ) from None
    return True


def _answers_as_forward(model: torch.nn.Module) -> bool:
    """Whether the strategies answer ``model``'s calls as its ``forward(input_ids, labels)`` is called: with
    :class:`~lightning_oomb.engine.model.ManagedModelMixin`'s ``answer_calls`` (an own one has its own convention)."""
    return isinstance(model, ManagedModelMixin) and type(model).answer_calls is ManagedModelMixin.answer_calls


def relative_errors(got: Mapping[str, torch.Tensor], want: Mapping[str, torch.Tensor]) -> dict[str, float]:
    """Each entry's largest difference relative to its own size (``"loss"``: the loss), the gradients' floored by
    1e-6 of the largest one: a gradient that is zero in exact arithmetic (e.g. a key bias: softmax ignores a
    constant per row) is rounding noise on both sides. A gradient ``want`` has and ``got`` lacks is an error of 1."""
    grads = [g.abs().max().item() for n, g in want.items() if n != "loss" and g.numel()]
    floor = 1e-6 * max(grads, default=0.0)
    return {
        n: 1.0
        if n not in got
        else (
            (got[n] - w).abs().max() / max(w.abs().max().item(), 0.0 if n == "loss" else floor, 1e-30)
        ).item()
        for n, w in want.items()
    }


def _compare(name: str, got, want, tolerance: float, differs: str, cause: str) -> float:
    """The largest relative error of ``got`` against ``want``; beyond ``tolerance`` refused, naming the entry (the
    loss where it is beyond: it names the cause best), how the two steps ``differs`` and the likely ``cause``."""
    errors = relative_errors(got, want)
    worst = "loss" if errors.get("loss", 0.0) > tolerance else max(errors, key=errors.get)
    if errors[worst] > tolerance:
        where = "the loss" if worst == "loss" else f"{worst}'s gradient"
        raise OOMBConfigError(
            f"{name} trains differently {differs}: a relative error of {errors[worst]:.1e} in {where} (float64, "
            f"tolerance {tolerance:.0e}) — {cause}."
        )
    return max(errors.values())


def _step(
    model, input_ids, chunk_size: int, page_size: int, layer_checkpointing: bool
) -> tuple[dict[str, torch.Tensor], frozenset[int]]:
    """One step's loss and gradients (``None`` gradients as zeros: both steps see the same parameters), and the layer
    indices its first chunk attended with."""
    model.zero_grad(set_to_none=True)
    config = OOMBConfig(chunk_size=chunk_size, page_size=page_size, layer_checkpointing=layer_checkpointing)
    engine = OOMBEngine(model, config)
    loss = engine.loss(input_ids)
    loss.backward()
    return {"loss": loss.detach(), **_grads(model)}, engine.layers_called


def _check_layers_called(model, called: frozenset[int]) -> None:
    """Refuse a ``num_layers`` above the layer indices the forward attends with (``called``: a chunk's): the pool and
    the memory plan would hold pages for layers that are never called."""
    idle = sorted(set(range(model.num_layers)) - called)
    if idle:
        raise OOMBConfigError(
            f"{type(model).__name__} declares num_layers={model.num_layers} but its forward never calls "
            f"paged_attention with layer {', '.join(map(str, idle[:8]))}{' ...' if len(idle) > 8 else ''} "
            f"({len(idle)} of them) — the pool and the memory plan hold K/V and gradient pages for every declared "
            f"layer, so those would be GPU memory spent on nothing — set num_layers to the number of paged_attention "
            f"calls in a chunk ({len(called)}) and number them 0..{len(called) - 1}."
        )


def _own_step(model: torch.nn.Module, input_ids: torch.Tensor) -> dict[str, torch.Tensor] | None:
    """The model's own full-sequence step, ``forward(input_ids, labels=input_ids)`` (``None`` where that call
    fails); a forward returning anything but a scalar loss tensor is refused: the strategies answer the call with
    the engine's loss, so code reading the forward's other outputs would break."""
    model.zero_grad(set_to_none=True)
    try:
        out = model(input_ids, input_ids)
    except Exception:  # another calling convention: nothing to compare with
        return None
    if not (isinstance(out, torch.Tensor) and out.dim() == 0):
        shape = (
            f"a tensor of shape {list(out.shape)}" if isinstance(out, torch.Tensor) else type(out).__name__
        )
        raise OOMBConfigError(
            f"{type(model).__name__}.forward(input_ids, labels) returns {shape}, not the loss — the OOMB strategies "
            "answer that call (in training, validation and test steps) with the engine's loss tensor, so code "
            "reading other outputs would break — return the mean next-token loss when labels are given (as "
            "examples/custom_model.py), or override answer_calls to return your output type."
        )
    out.backward()
    return {"loss": out.detach(), **_grads(model)}


def _grads(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: torch.zeros_like(p) if p.grad is None else p.grad.clone() for n, p in model.named_parameters()
            if p.requires_grad}  # fmt: skip
