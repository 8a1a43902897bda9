"""Hooks on the trained model that chunked training runs differently, checked before a step allocates anything.

The engine runs the model a chunk at a time: a module's forward and forward-pre hooks run once per chunk in the
forward sweep and again when the backward sweep recomputes the chunk, each seeing that chunk; its backward hooks
and a parameter's tensor hooks (``p.register_hook``) run once per chunk, with the chunk's share of the gradient
(the sum over chunks is the step's gradient, so a hook linear in it, a mask or a scale, is exact). The LM head
module is never called (the fused cross-entropy reads its weight): the forward-pre hooks that recompute its
parameters from their parts — torch's pruning masks and ``torch.nn.utils.weight_norm``, pure functions of
parameters and buffers — are run before every read (:func:`refresh_parameters`), as its forward would run them; its
other hooks never run (warned about, whatever package set them); a tensor hook on the head's weight (the
embedding's when tied) sees the head's gradient: the cross-entropy then hands it to autograd
(:func:`gradient_hooks`) instead of adding it in place.

:class:`UserHooks` refuses what would silently train differently: a post-accumulate-grad hook on a trainable
parameter (it would act on every chunk's partial sum: an optimizer step fused into backward would step once per
chunk) and NEFTune (``transformers.integrations.neftune``: its noise is scaled by ``1/sqrt(tokens * hidden)`` of
the call, so per chunk it would be ``sqrt(seq_len / chunk_size)`` times too large). It warns once about user
tensor hooks on trainable parameters and module hooks (global ones included) on the model's submodules. Hooks the
stack installs (torch, transformers, peft, accelerate, Lightning, this package: e.g. ``enable_input_require_grads``'
hook on the embedding) and the engine's own (:func:`engine_hook`) are left alone.
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Iterable

import torch
from torch.nn.utils.prune import BasePruningMethod
from torch.nn.utils.weight_norm import WeightNorm

from lightning_oomb.engine.errors import OOMBConfigError

STACK = ("torch", "transformers", "peft", "accelerate", "lightning", "lightning_fabric", "pytorch_lightning",
         "lightning_oomb")  # fmt: skip
_MARK = "_oomb_engine_hook"
_MODULE_HOOKS = {
    "_forward_pre_hooks": "forward-pre",
    "_forward_hooks": "forward",
    "_backward_pre_hooks": "backward-pre",
    "_backward_hooks": "backward",
}
_SHOWN = 3  # names a message lists


def engine_hook(fn):
    """``fn`` as a hook marked the engine's own: never refused nor warned about."""

    def hook(*args):
        return fn(*args)

    setattr(hook, _MARK, True)
    return hook


def gradient_hooks(t: torch.Tensor) -> list:
    """The tensor hooks (``register_hook``) on ``t`` other than the engine's."""
    return [fn for fn in (t._backward_hooks or {}).values() if not getattr(fn, _MARK, False)]


def _recomputes_parameters(fn) -> bool:
    """Whether forward-pre hook ``fn`` only recomputes its module's parameters from their parts (torch's pruning:
    ``weight = weight_orig * weight_mask``; ``torch.nn.utils.weight_norm``: ``weight = g * v / |v|``)."""
    return isinstance(fn, (BasePruningMethod, WeightNorm))


def _not_run(fn) -> bool:
    """Whether hook ``fn`` on the LM head never runs (it is not the engine's, nor run by :func:`refresh_parameters`)."""
    return not (getattr(fn, _MARK, False) or _recomputes_parameters(fn))


def refresh_parameters(module: torch.nn.Module) -> torch.nn.Module:
    """``module`` with its parameters recomputed by their forward-pre hooks (:func:`_recomputes_parameters`), as its
    forward would first do: for a module whose parameters are read without calling it (the LM head). Without such
    hooks nothing runs."""
    for fn in list(module._forward_pre_hooks.values()):
        if _recomputes_parameters(fn):
            fn(module, ())
    return module


def _post_accumulate_hooks(t: torch.Tensor) -> list:
    hooks = getattr(t, "_post_accumulate_grad_hooks", None) or {}
    return [fn for fn in hooks.values() if not getattr(fn, _MARK, False)]


def _unwrap(fn):
    while isinstance(fn, functools.partial):
        fn = fn.func
    return getattr(fn, "__func__", fn)  # a bound method's function


def _of_stack(fn) -> bool:
    """Whether hook ``fn`` is the engine's or defined by a package of the stack (:data:`STACK`)."""
    if getattr(fn, _MARK, False):
        return True
    package = (getattr(_unwrap(fn), "__module__", None) or "").split(".")[0]
    return package in STACK


def _label(fn) -> str:
    fn = _unwrap(fn)
    return getattr(fn, "__qualname__", None) or type(fn).__qualname__


def _listed(items: list[str]) -> str:
    more = len(items) - _SHOWN
    return ", ".join(items[:_SHOWN]) + (f" and {more} more" if more > 0 else "")


def module_of(model) -> torch.nn.Module | None:
    """The ``nn.Module`` behind an engine's model: the model itself, or its ``.model`` (``HFChunkModel``)."""
    for candidate in (model, getattr(model, "model", None)):
        if isinstance(candidate, torch.nn.Module):
            return candidate
    return None


class UserHooks:
    """The engine's check of its model's hooks (module docstring): :meth:`check` before every sweep (a look at
    each module's and parameter's hook dictionaries); each warning is shown once per engine."""

    def __init__(self) -> None:
        self._warned: set[str] = set()

    def check(self, model, parameters: Iterable[torch.Tensor], training: bool) -> None:
        """Refuse (``training``: before a training step) or warn about the hooks of ``model`` and ``parameters``."""
        root = module_of(model)
        if training:
            self._check_parameters(root, [p for p in dict.fromkeys(parameters) if p.requires_grad])
        if root is not None and (training or "module" not in self._warned):
            self._check_modules(root, training)

    def _warn(self, kind: str, message: str) -> None:
        self._warned.add(kind)
        warnings.warn(message, UserWarning, stacklevel=5)  # at the engine.loss / evaluate call

    def _check_parameters(self, root: torch.nn.Module | None, trainable: list[torch.Tensor]) -> None:
        fused = [p for p in trainable if _post_accumulate_hooks(p)]
        hooked = [p for p in trainable if any(not _of_stack(fn) for fn in gradient_hooks(p))]
        if not fused and ("tensor" in self._warned or not hooked):
            return
        names = {} if root is None else {id(p): n for n, p in root.named_parameters()}
        name = lambda p: names.get(id(p), f"a {tuple(p.shape)} parameter")  # noqa: E731
        if fused:
            hook = _label(_post_accumulate_hooks(fused[0])[0])
            raise OOMBConfigError(
                f"parameter {name(fused[0])} has a post-accumulate-grad hook ({hook}): OOMB back-propagates the "
                "step chunk by chunk, so it would run once per chunk on a partial gradient (an optimizer step fused "
                "into backward would step on every chunk) — remove the hook and step the optimizer after "
                "backward (transform gradients in on_before_optimizer_step), or train with strategy='auto'."
            )
        self._warn(
            "tensor",
            f"gradient hooks (register_hook) on trainable parameters {_listed([name(p) for p in hooked])}: OOMB "
            "back-propagates the step chunk by chunk, so they fire once per chunk with the chunk's partial "
            "gradient — exact for hooks linear in the gradient (masks, scaling), not for others (clipping, "
            "normalising): transform gradients in on_before_optimizer_step instead. (Shown once.)",
        )

    def _check_modules(self, root: torch.nn.Module, training: bool) -> None:
        """One walk over the modules: NEFTune refused (``training``), the other hooks collected to warn about."""
        warn = "module" not in self._warned
        found = [
            f"global {kind}"
            for attr, kind in _MODULE_HOOKS.items()
            if warn
            and any(not _of_stack(fn) for fn in getattr(torch.nn.modules.module, "_global" + attr).values())
        ]
        hooked = []
        head = getattr(root, "get_output_embeddings", lambda: None)()
        for name, module in root.named_modules():
            if training and module.training:
                _refuse_neftune(name or type(module).__name__, module)
            # (the root is called once per model call, with the step's answer)
            if warn and module is not root and any(getattr(module, attr) for attr in _MODULE_HOOKS):
                # the head's hooks never run, whoever set them, but those the engine runs itself
                warned = _not_run if module is head else (lambda fn: not _of_stack(fn))
                kinds = [
                    kind
                    for attr, kind in _MODULE_HOOKS.items()
                    if any(warned(fn) for fn in getattr(module, attr).values())
                ]
                hooked += [(name, module, kinds)] if kinds else []
        if hooked:
            found += [f"{n} ({'/'.join(k)}{'; never runs' if m is head else ''})" for n, m, k in hooked]
        if found:
            self._warn(
                "module",
                f"hooks on the model's modules: {_listed(found)}. OOMB runs the model a chunk at a time: forward "
                "and forward-pre hooks run once per chunk in the forward sweep and again when the backward sweep "
                "recomputes it, backward hooks once per chunk, each seeing that chunk only (hooks on the LM head "
                "module never run: the fused loss reads its weight) — exact for hooks that act token by token and "
                "alike in both runs; compute sequence-wide statistics from the step's outputs, or train with "
                "strategy='auto'. (Shown once.)",
            )


def _refuse_neftune(name: str, module: torch.nn.Module) -> None:
    """Refuse NEFTune on ``module`` (in training mode): its ``neftune_noise_alpha``, or its forward hook."""
    alpha = module.__dict__.get(
        "neftune_noise_alpha"
    )  # (getattr on a module raises inside when missing: slow)
    if alpha is not None or any(
        _label(fn) == "neftune_post_forward_hook" for fn in module._forward_hooks.values()
    ):
        raise OOMBConfigError(
            f"NEFTune is on for {name} (neftune_noise_alpha={alpha}): its noise is scaled by 1/sqrt(tokens x "
            "hidden size) of each call, and OOMB runs the embedding once per chunk, so the noise would be "
            "sqrt(sequence length / chunk_size) times larger than in full-sequence training — turn NEFTune off "
            "(deactivate_neftune, or remove the hook and neftune_noise_alpha) or train with strategy='auto'."
        )
