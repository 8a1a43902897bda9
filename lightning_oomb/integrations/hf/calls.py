"""The user's own ``model(...)`` calls inside the strategy's steps, read as the model's ``forward`` reads them.

:func:`read_call` binds a call's positional and keyword arguments to the model's own ``forward`` signature (so
``model(ids, mask, positions)`` means what it means to Hugging Face: GPT-2 takes its arguments in another order than
Llama) and keeps what the engine computes the loss from — ``input_ids``, ``labels``, ``position_ids``,
``attention_mask``, ``num_items_in_batch`` (the loss's divisor, as transformers' loss takes it) — after checking
every other argument: values that change nothing in the loss are accepted
(``use_cache``, ``output_attentions=False``, ``logits_to_keep=0``, a ``cache_position`` that counts the sequence,
``DataCollatorWithFlattening``'s ``cu_seq_lens_*`` / ``max_length_*`` / ``seq_idx`` when they say what the
``position_ids`` say), anything else is refused with its own reason. :func:`answer` builds the reply, a
``CausalLMOutputWithPast`` or, with ``return_dict=False``, HF's tuple.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Any

import torch

from lightning_oomb.engine.errors import OOMBConfigError

_ADVICE = "call it as `model(input_ids=..., labels=..., position_ids=..., attention_mask=...)`"
# DataCollatorWithFlattening(return_flash_attn_kwargs=True / return_seq_idx=True): the documents once more
_FLATTENING_KEYS = ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k", "seq_idx")


@dataclass
class Call:
    """What one model call gives the engine; ``tuple_reply``: HF would answer it with a tuple (``return_dict``)."""

    input_ids: torch.Tensor
    labels: torch.Tensor | None
    position_ids: torch.Tensor | None
    attention_mask: torch.Tensor | None
    num_items_in_batch: int | float | torch.Tensor | None
    tuple_reply: bool
    balances_experts: bool = False


def read_call(model: torch.nn.Module, args: tuple, kwargs: dict, balances_experts: bool) -> Call:
    """Bind ``model(*args, **kwargs)`` to the model class's ``forward`` and check it (see the module docstring);
    ``balances_experts``: the model trains with its router's load-balancing loss (the config's
    ``output_router_logits``)."""
    signature = inspect.signature(type(model).forward)  # through transformers' decorators (functools.wraps)
    try:
        bound = signature.bind(model, *args, **kwargs)
    except TypeError as err:
        raise OOMBConfigError(f"{type(model).__name__}: {err} — {_ADVICE}.") from err
    given: dict[str, Any] = {}
    for name, value in list(bound.arguments.items())[1:]:  # [0]: self
        if signature.parameters[name].kind is inspect.Parameter.VAR_KEYWORD:
            given.update(value)
        else:
            given[name] = value
    take = {k: given.pop(k, None) for k in ("input_ids", "labels", "position_ids", "attention_mask")}
    return_dict = given.pop("return_dict", None)
    num_items = given.pop("num_items_in_batch", None)
    given.pop("use_cache", None)
    if take["input_ids"] is None:
        raise OOMBConfigError(
            "the OOMB-managed model got no input_ids — the engine computes the loss itself from token ids"
            + (" (it embeds each chunk itself; inputs_embeds cannot be split into chunks)" if "inputs_embeds" in
               given else "") + f" — {_ADVICE}."
        )  # fmt: skip
    _check_rest(given, take["input_ids"], take["position_ids"], balances_experts)
    if return_dict is None:
        return_dict = getattr(model.config, "return_dict", True)
    if not return_dict and take["labels"] is None:
        raise OOMBConfigError(
            "the OOMB-managed model was called with return_dict=False (the call's or the config's) and no labels — "
            "Hugging Face then answers the logits alone, `(logits,)`, and the logits of the whole sequence are never "
            "materialised (the engine computes the loss chunk by chunk), so nothing in that answer could be used — "
            "pass labels (labels=input_ids for next-token prediction; -100 marks positions to ignore) and read the "
            "loss as `out[0]`, or drop return_dict=False and read `out.loss`."
        )
    return Call(
        **take, num_items_in_batch=num_items, tuple_reply=not return_dict, balances_experts=balances_experts
    )


def _check_rest(given: dict, input_ids: torch.Tensor, position_ids, balances_experts: bool) -> None:
    """Refuse every argument but those that change nothing in the loss (module docstring)."""
    given = {k: v for k, v in given.items() if v is not None}
    for key in ("cache", "past_key_values"):
        if key in given:
            raise OOMBConfigError(
                f"the OOMB-managed model was called with {key} (model.generate or cached decoding) inside "
                "training_step/validation_step/test_step — the strategy answers those calls with the chunked loss "
                "and never computes logits — generate in predict_step, or in a hook outside the step (e.g. "
                "on_validation_epoch_end)."
            )
    if "cache_position" in given:
        counted = torch.arange(input_ids.shape[-1], device=input_ids.device)
        if not torch.equal(given.pop("cache_position").reshape(-1), counted):
            raise OOMBConfigError(
                "the OOMB-managed model got cache_position that do not count the sequence from 0 — that is "
                "cached decoding, which the strategy does not answer inside training_step/validation_step/"
                "test_step — drop cache_position (the engine places the chunks itself), or decode in predict_step."
            )
    flattening = {k: given.pop(k) for k in _FLATTENING_KEYS if k in given}
    if flattening:
        _check_flattening(flattening, input_ids, position_ids)
    for key in ("output_attentions", "output_hidden_states"):
        if given.get(key) is False:
            del given[key]
    if isinstance(given.get("logits_to_keep"), int) and given["logits_to_keep"] == 0:
        del given["logits_to_keep"]
    if "output_router_logits" in given and bool(given["output_router_logits"]) == balances_experts:
        del given["output_router_logits"]
    if not given:
        return
    reasons = {
        "output_router_logits": "the router's load-balancing loss is trained as the model's config says "
        "(config.output_router_logits) — set it there, not in the call",
        "output_attentions": "the attention weights of the whole sequence are never materialised",
        "output_hidden_states": "the hidden states of the whole sequence are never kept (chunk by chunk)",
        "logits_to_keep": "the logits are never materialised; the loss covers every target",
        "inputs_embeds": "the engine embeds each chunk itself from input_ids",
    }
    named = [f"{k} ({reasons[k]})" for k in sorted(given) if k in reasons]
    other = sorted(k for k in given if k not in reasons)
    if other:
        named.append(
            f"{other} (the engine computes the loss from token ids, labels, positions and a right-padding mask "
            "only; drop such keys from the batch, e.g. a tokenizer's token_type_ids)"
        )
    raise OOMBConfigError(f"the OOMB-managed model cannot take {'; '.join(named)} — {_ADVICE}.")


def _check_flattening(keys: dict, input_ids: torch.Tensor, position_ids) -> None:
    """Accept ``DataCollatorWithFlattening``'s flash-attention keys and ``seq_idx`` when they mark the documents
    the ``position_ids`` mark (the engine reads them from there); refuse them otherwise."""
    if position_ids is None:
        raise OOMBConfigError(
            f"the OOMB-managed model got {sorted(keys)} without position_ids — the engine reads packed documents "
            "from position_ids that restart at each document — pass them too (DataCollatorWithFlattening("
            "return_position_ids=True), its default)."
        )
    flat = position_ids.expand(input_ids.shape[0], -1).reshape(-1)
    starts = torch.ones_like(flat, dtype=torch.bool)
    starts[1:] = flat[1:] <= flat[:-1]  # a restart (engine.batch's rule: a forward jump continues a document)
    starts.view(input_ids.shape)[:, 0] = True
    index = torch.nonzero(starts).flatten().cpu()
    bounds = torch.cat([index, torch.tensor([flat.numel()])])
    expected = {
        "cu_seq_lens_q": bounds,
        "cu_seq_lens_k": bounds,
        "max_length_q": int(bounds.diff().max()),
        "max_length_k": int(bounds.diff().max()),
        "seq_idx": (starts.cumsum(0) - 1).view(input_ids.shape).cpu(),
    }
    for key, value in keys.items():
        value = torch.as_tensor(value).cpu().long()
        want = torch.as_tensor(expected[key]).long()
        if value.numel() != want.numel() or not torch.equal(value.reshape(-1), want.reshape(-1)):
            raise OOMBConfigError(
                f"the OOMB-managed model got {key} that disagree with position_ids — the engine takes packed "
                "documents from position_ids (each restart begins a document) — make them agree, or drop "
                f"{key} from the batch."
            )


def answer(call: Call, loss: torch.Tensor):
    """The reply HF would give the call: ``CausalLMOutputWithPast(loss, logits stand-in)``, or with
    ``return_dict=False`` its tuple ``(loss, logits)`` (a tuple call without labels, HF's ``(logits,)``, is refused by
    :func:`read_call`: nothing in it could be used). A model training its router's balancing loss answers as HF's MoE
    models: ``MoeCausalLMOutputWithPast`` with stand-ins for ``aux_loss`` and ``router_logits`` too (tuple ``(loss,
    aux_loss, logits, router_logits)``): the balancing loss is in ``loss`` already, as HF's, and is never computed on
    its own."""
    from transformers.modeling_outputs import CausalLMOutputWithPast, MoeCausalLMOutputWithPast

    logits = NoLogits()
    if call.balances_experts:
        aux, router = NoLogits(_NO_AUX_LOSS), NoLogits(_NO_ROUTER_LOGITS)
        if not call.tuple_reply:
            return MoeCausalLMOutputWithPast(loss=loss, aux_loss=aux, logits=logits, router_logits=router)
        return loss, aux, logits, router
    if not call.tuple_reply:
        return CausalLMOutputWithPast(loss=loss, logits=logits)
    return loss, logits


_NO_AUX_LOSS = (
    "the router's load-balancing loss is already in the loss (router_aux_loss_coef x aux_loss, as Hugging Face "
    "adds it), summed chunk by chunk, and never computed on its own"
)
_NO_ROUTER_LOGITS = "the router logits of the whole sequence are never kept (chunk by chunk)"


class LogitsUnavailable(OOMBConfigError, AttributeError):
    """Raised on any use of :class:`NoLogits` (an ``AttributeError`` too, so ``hasattr`` probes stay quiet)."""


# the supported way to train on a loss of one's own: the engine's cross-entropy, shaped by labels and its divisor
_OWN_LOSS = (
    "; a loss computed from the logits (a cross-entropy of your own) cannot train under OOMB: return `output.loss`, "
    "the next-token cross-entropy over labels (labels default to input_ids; -100 marks positions to ignore; "
    "num_items_in_batch sets the divisor), adding any other term to it, or train with strategy='auto'"
)


class NoLogits:
    """Stands in for the logits of a model call the engine answers: ``[B, N, vocab]`` logits of a long sequence
    (80 GB at 128K tokens for Qwen2.5-7B in fp32) are exactly what OOMB never materialises. Any use raises — the
    attribute access, indexing, arithmetic, comparisons and torch functions of a tensor — naming the supported way to
    a loss of one's own. ``what``: why the value is not there (default: the logits'; an MoE model's ``aux_loss`` and
    ``router_logits`` have their own).

    The refusal comes at the first use, after the call's forward sweep, not at the call: a call without labels is a
    supported one (its labels default to ``input_ids``, and its ``output.loss`` trains), and nothing at the call says
    whether its loss or its logits will be read. The use comes before the step's backward, and the strategy frees the
    step's pages and state when its training step fails (:meth:`~lightning_oomb.engine.OOMBEngine.abandon`)."""

    def __init__(self, what: str | None = None):
        object.__setattr__(self, "_what", what)

    def _refuse(self, *args: Any, **kwargs: Any):
        what = object.__getattribute__(self, "_what")
        raise LogitsUnavailable(
            "the OOMB strategy answers the model call with the loss only — "
            f"{what or 'the logits of the whole sequence are never materialised (they would not fit)'} — compute "
            f"metrics from `output.loss`{'' if what else _OWN_LOSS}; or call the model outside training_step/"
            "validation_step/test_step (e.g. in predict_step) on a short input."
        )

    __hash__ = object.__hash__

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        stand_in = next((a for a in (*args, *(kwargs or {}).values()) if isinstance(a, NoLogits)), cls())
        stand_in._refuse()


# every use a tensor allows: attributes, indexing, iteration, arithmetic and comparisons with Python numbers
for _use in ("__getattr__", "__getitem__", "__iter__", "__len__", "__bool__", "__array__", "__add__", "__radd__",
             "__sub__", "__rsub__", "__mul__", "__rmul__", "__truediv__", "__rtruediv__", "__floordiv__",
             "__rfloordiv__", "__mod__", "__rmod__", "__pow__", "__rpow__", "__matmul__", "__rmatmul__", "__neg__",
             "__pos__", "__abs__", "__float__", "__int__", "__lt__", "__le__", "__gt__", "__ge__", "__eq__",
             "__ne__"):  # fmt: skip
    setattr(NoLogits, _use, NoLogits._refuse)
