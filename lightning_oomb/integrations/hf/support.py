"""Which Hugging Face models OOMB trains exactly: static inspection, the LM-head transform, and a self-check.

:func:`check_supported` reads the model before anything is allocated and refuses, naming the feature, what chunks
cannot reproduce: layers that carry state along the sequence (Mamba/SSM mixers, linear attention, short
convolutions, recurrent blocks) other than the mixers whose state OOMB carries across chunks
(:mod:`lightning_oomb.integrations.hf.states`), layer types other than attention and those hybrids' layers, attention that does not dispatch through ``AttentionInterface``, multi-head latent
attention, attention dropout, the MoE router's auxiliary loss, non-causal attention, length-dependent RoPE
that cannot be pinned, an LM head that is not a plain linear layer (a LoRA adapter on it) and attention shapes that
differ between layers, and a training loss of the model's own that OOMB, which computes the next-token
cross-entropy in its place and never calls the model's forward, would silently drop (a loss function set on the
model, a ``loss_type`` naming another loss, a ``forward`` or ``loss_function`` defined outside transformers: a
subclass adding a z-loss). :func:`logit_transform` reads the logit scale and softcap the model's head applies.

:func:`verify_exactness` is the safety net for what a reading cannot see: it builds a *twin* of the model — the
same class and config at a tiny width, in float64, on the CPU — and checks that the model's own head turns final
hidden states into the logits OOMB's loss computes from them (1e-6), then that OOMB's loss and every parameter
gradient agree between three chunks and one chunk (1e-6) and between one chunk and the twin's own full-sequence
training (its ``logits`` with a cross-entropy: 1e-5) — float64 (a hybrid's recurrences too, which transformers
computes in float32: :mod:`~lightning_oomb.integrations.hf.float64_rules`), but some models norm or softmax in
float32 even then, while a chunking error is orders of magnitude larger — as the test suite does, to 1e-10, for the
families it names — and that the twin's own loss, given labels, is that cross-entropy (1e-5: transformers computes
it in float32). A mismatch or a failure refuses the model with the measured error; a twin that cannot be built,
or cannot train itself, skips the check. The check leaves the global random state as it found it (the twin seeds
its own weights), and a verdict cached for the architecture builds no twin.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import re
import warnings

import torch

from lightning_oomb.engine.check import relative_errors
from lightning_oomb.engine.errors import OOMBConfigError
from lightning_oomb.engine.model import runs_class_forward
from lightning_oomb.engine.model_shape import decoder_of, layer_kv_heads
from lightning_oomb.integrations.hf.float64_rules import float32_rules_of, float64_recurrences
from lightning_oomb.integrations.hf.moe import balancing_loss_of
from lightning_oomb.integrations.hf.rope import can_pin, length_dependent_rotaries
from lightning_oomb.integrations.hf.states import CARRIED_MIXERS, float32_recurrences

SUPPORTED_LAYER_TYPES = frozenset({"full_attention", "sliding_attention", "chunked_attention"})
# a hybrid's other layer types, accepted when every stateful layer is one OOMB carries (token-wise MLP/MoE layers)
HYBRID_LAYER_TYPES = frozenset(
    {"linear_attention", "conv", "hybrid", "hybrid_sliding", "mamba", "mlp", "moe", "attention"}
)  # ZAYA's "hybrid_sliding": attention with a window, its module's sliding_window
# words (of CamelCase class names) that name token mixers carrying state along the sequence
_STATEFUL_WORDS = frozenset({"mamba", "ssm", "rglru", "rwkv", "hyena", "lstm", "mlstm", "slstm", "deltanet"})
_STATEFUL_PAIRS = frozenset({("gated", "delta"), ("delta", "net"), ("linear", "attention"), ("lightning", "attention"),
                             ("short", "conv"), ("recurrent", "block"), ("recurrent", "layer")})  # fmt: skip
_LAYER_TYPE_FIELDS = ("layer_types", "layers_block_type", "block_types", "layer_block_types")


def _configs(config) -> list:
    """The config and its text sub-config (multimodal wrappers keep the decoder's fields there)."""
    text = getattr(config, "text_config", None)
    return [config] if text is None or text is config else [config, text]


def _layer_types(config) -> set[str]:
    found = set()
    for c in _configs(config):
        for field in _LAYER_TYPE_FIELDS:
            values = getattr(c, field, None)
            if isinstance(values, (list, tuple)):
                found |= {str(v) for v in values}
    return found


def is_hybrid(config) -> bool:
    """Whether the config declares layers other than attention (a hybrid's recurrent or convolution layers)."""
    return bool(_layer_types(config) - SUPPORTED_LAYER_TYPES)


def _words(name: str) -> list[str]:
    """``"Qwen3NextGatedDeltaNet"`` -> ``["qwen3", "next", "gated", "delta", "net"]``."""
    return [w.lower() for w in re.findall(r"[A-Z]+(?![a-z])|[A-Z]?[a-z0-9]+", name)]


def _mixes_with_state(module: torch.nn.Module) -> bool:
    """Whether ``module`` may mix tokens through a state: a convolution over time, or a class named like a
    recurrent / linear-attention mixer — but no norm, whatever its name (``MambaRMSNorm``), and no module that
    attends through transformers' ``AttentionInterface`` (Kimi-Linear's ``KimiLinearAttention``: OOMB routes it)."""
    words = _words(type(module).__name__)
    return (
        words[-1:] != ["norm"]
        and not _attends(type(module))
        and bool(
            isinstance(module, (torch.nn.Conv1d, torch.nn.Conv2d))
            or _STATEFUL_WORDS.intersection(words)
            or _STATEFUL_PAIRS.intersection(zip(words, words[1:]))
        )
    )


@functools.cache
def _attends(cls: type) -> bool:
    """Whether ``cls.forward`` calls transformers' ``AttentionInterface`` (what OOMB routes to its attention op)."""
    try:
        return "ALL_ATTENTION_FUNCTIONS" in inspect.getsource(cls.forward)
    except (OSError, TypeError):
        return False


def _stateful_mixers(model: torch.nn.Module) -> tuple[list[str], list[str]]:
    """Class names of the decoder's modules that mix tokens with a state — convolutions over time and the known
    recurrent / linear-attention mixers (a vision tower's patch convolution is outside the decoder) — split into
    those whose state OOMB carries across chunks (:data:`CARRIED_MIXERS`, their insides included) and the rest."""
    decoder = decoder_of(model) if callable(getattr(model, "get_decoder", None)) else None
    named = list((decoder or model).named_modules())
    carried = [name + "." for name, m in named if type(m).__name__ in CARRIED_MIXERS]

    def settled(name: str) -> bool:  # a carried mixer, its own convolution, or a module around it (its layer)
        path = name + "." if name else ""
        return any(path.startswith(c) or c.startswith(path) for c in carried)

    refused = {type(m).__name__ for name, m in named if not settled(name) and _mixes_with_state(m)}
    mixers = {type(m).__name__ for _, m in named if type(m).__name__ in CARRIED_MIXERS}
    return sorted(mixers), sorted(refused)[:4]


# model types whose head multiplies its logits by ``logits_scaling`` (Granite's divide by it)
_MULTIPLIED_LOGITS_SCALING = frozenset({"hyperclovax"})
# divide the logits by logits_scaling as Granite does (MiniCPM3 divides the hidden states; its head has no bias)
_DIVIDED_LOGITS_SCALING = frozenset({"minicpm3"})


def _scales_logits(c) -> bool:
    return getattr(c, "logits_scaling", None) not in (None, 1.0)


def _logits_scaling_known(c) -> bool:
    kind = str(getattr(c, "model_type", ""))
    return "granite" in kind or kind in _MULTIPLIED_LOGITS_SCALING | _DIVIDED_LOGITS_SCALING


def logit_transform(config) -> tuple[float, float | None]:
    """``(scale, softcap)`` the model's head applies to its logits: Cohere's ``logit_scale``, Granite's and
    MiniCPM3's ``1 / logits_scaling`` (HyperCLOVAX: ``logits_scaling``), Falcon-H1's ``lm_head_multiplier``, Gemma's
    ``final_logit_softcapping``."""
    scale, softcap = 1.0, None
    for c in _configs(config):
        if getattr(c, "logit_scale", None) not in (None, 1.0):
            scale *= float(c.logit_scale)
        if getattr(c, "lm_head_multiplier", None) not in (None, 1.0):
            scale *= float(c.lm_head_multiplier)
        if _scales_logits(c) and c.model_type in _MULTIPLIED_LOGITS_SCALING:
            scale *= float(c.logits_scaling)
        elif _scales_logits(c):
            scale /= float(c.logits_scaling)
        if getattr(c, "final_logit_softcapping", None) is not None:
            softcap = float(c.final_logit_softcapping)
    return scale, softcap


def _plain_linear(module: torch.nn.Module) -> bool:
    """Whether ``module`` computes ``x @ weight.T + bias`` and nothing else (peft's ``modules_to_save`` wrapper
    of such layers too: its ``weight`` is the trained copy's); a ``forward`` set on the instance may only run the
    class's (an accelerate hook)."""
    inner = getattr(module, "modules_to_save", None)
    if isinstance(inner, torch.nn.ModuleDict):
        return all(_plain_linear(m) for m in (module.original_module, *inner.values()))
    own = vars(module).get("forward")
    return type(module).forward is torch.nn.Linear.forward and (
        own is None or runs_class_forward(module, own)
    )


def _per_layer_shapes(config) -> list[str]:
    """Attention shape fields that differ between layers (transformers refuses to read them as one value); the head
    dims and KV heads a ``per_layer_config`` gives each layer are not (the pool keeps each layer's pages at its own:
    ``layer_head_dims``, ``layer_kv_heads``)."""
    differ = []
    for c in _configs(config):
        for field in ("num_attention_heads", "num_key_value_heads"):
            try:
                getattr(c, field, None)
            except Exception:  # transformers' AmbiguousGlobalPerLayerAttributeError
                if field != "num_key_value_heads" or layer_kv_heads(c) is None:
                    differ.append(field)
    return differ


def _defined_by(cls: type, attribute: str) -> type | None:
    """The first class of ``cls``'s MRO that defines ``attribute`` itself."""
    return next((c for c in cls.__mro__ if attribute in vars(c)), None)


def _outside_transformers(cls: type | None) -> bool:
    return cls is not None and not cls.__module__.startswith("transformers.")


def _own_loss(model: torch.nn.Module) -> str | None:
    """What makes ``model``'s training loss other than the next-token cross-entropy of its logits (its MoE router's
    balancing loss aside) that OOMB computes in its place — OOMB never calls the model's forward or its
    ``loss_function`` — or ``None``: a loss function set on the model (``model.loss_function = ...``, or a
    ``loss_type`` that names another of transformers' losses), a ``loss_function`` or ``forward`` defined outside
    transformers (a subclass that adds a term: a z-loss, a regulariser). A subclass that overrides neither, and a
    peft model (the strategy trains the transformers model inside it), are plain."""
    from transformers.loss.loss_utils import LOSS_MAPPING, ForCausalLMLoss

    cls = type(model)
    if hasattr(model, "_loss_function"):  # what transformers' loss_function property returns first
        function = model._loss_function
        return f"model.loss_function = {getattr(function, '__name__', function)}, set on the model"
    if _outside_transformers(owner := _defined_by(cls, "loss_function")):
        return f"its loss_function, defined by {owner.__module__}.{owner.__qualname__}"
    loss_type = getattr(model, "loss_type", None)
    if loss_type is not None and LOSS_MAPPING.get(loss_type, ForCausalLMLoss) not in (
        ForCausalLMLoss,
        LOSS_MAPPING.get("ForCausalLM"),
    ):
        return f"its loss_type={loss_type!r} (transformers' {LOSS_MAPPING[loss_type].__name__})"
    if _outside_transformers(owner := _defined_by(cls, "forward")):
        return f"its forward, defined by {owner.__module__}.{owner.__qualname__}"
    return None


def check_supported(model: torch.nn.Module) -> None:
    """Raise :class:`OOMBConfigError` if the adapter cannot train ``model`` exactly; say why and what to do."""
    from transformers import PreTrainedModel

    name = type(model).__name__
    if not isinstance(model, PreTrainedModel) or model.get_output_embeddings() is None:
        raise OOMBConfigError(
            f"{name} is not a Hugging Face causal LM with an LM head — the OOMB adapter drives "
            "`*ForCausalLM` models — load the model with AutoModelForCausalLM."
        )
    if own := _own_loss(model):
        raise OOMBConfigError(
            f"OOMB cannot train {name} with its own loss ({own}): OOMB replaces the model's forward and computes "
            "the plain next-token cross-entropy (mean over the labels) itself, so anything else the model's loss "
            "does would be silently lost — compute an extra term of the parameters in "
            "training_step and add it to the loss the model call returns; leave the forward and loss_function "
            "transformers' own (a subclass that does not override them; del model._loss_function); or train with "
            "strategy='auto' for a loss that needs the logits (label smoothing, z-loss)."
        )
    config = model.config
    reasons = []
    if "shared_kv_states" in inspect.signature(model.forward).parameters:  # Gemma 4's assistants
        reasons.append(
            "it is a speculative-decoding drafter: its forward reads its main model's embeddings and key/value "
            "states (inputs_embeds, shared_kv_states), which a causal-LM training step does not have"
        )
    if not type(model)._can_set_attn_implementation():
        reasons.append("its attention does not dispatch through transformers' AttentionInterface")
    carried, refused = _stateful_mixers(model)
    known = SUPPORTED_LAYER_TYPES | (HYBRID_LAYER_TYPES if carried and not refused else frozenset())
    if other := _layer_types(config) - known:
        reasons.append(
            f"it has layers of type {sorted(other)} (full and sliding-window attention chunk exactly, and the "
            "recurrent and convolution layers whose state OOMB carries)"
        )
    if refused:
        reasons.append(
            f"its layers carry state along the sequence ({', '.join(refused)}) by a rule OOMB cannot continue from "
            "one chunk to the next (it carries the states of: " + ", ".join(sorted(CARRIED_MIXERS)) + ")"
        )
    head = model.get_output_embeddings()
    if type(head).__name__ == "TrainableTokensWrapper":  # peft's trainable_token_indices with tied embeddings
        reasons.append(
            "peft's trainable tokens (trainable_token_indices) wrap its LM head, which shares the embedding's weight "
            "— OOMB's chunked cross-entropy applies the head's weight itself, without the wrapper's new rows — "
            "train those embedding rows with a LoRA adapter on the embedding instead (target_modules including "
            "'embed_tokens', exact with tied weights too), or untie the head (tie_word_embeddings=False) first"
        )
    elif not _plain_linear(head):
        reasons.append(
            f"its LM head ({type(head).__name__}) is not a plain linear layer — OOMB's chunked cross-entropy applies "
            "the head's weight and bias itself; a LoRA adapter on lm_head: leave it out of target_modules "
            "(modules_to_save=['lm_head'] trains the head whole); a forward set on the head's instance: remove it"
        )
    if differ := _per_layer_shapes(config):
        reasons.append(
            f"its layers differ in {', '.join(differ)} (OOMB's attention op takes one count of query heads)"
        )
    if unknown := [
        c.model_type for c in _configs(config) if _scales_logits(c) and not _logits_scaling_known(c)
    ]:
        reasons.append(
            f"its head scales logits by logits_scaling by a rule OOMB does not know ({unknown[0]})"
        )
    if unpinnable := [type(m).__name__ for m, _ in length_dependent_rotaries(model) if not can_pin(m)]:
        reasons.append(f"its RoPE ({', '.join(unpinnable)}) picks frequencies from each call's length")
    for field in ("attention_dropout", "attention_probs_dropout_prob", "attn_pdrop"):
        if getattr(config, field, 0.0):
            reasons.append(f"{field}={getattr(config, field)} (set it to 0)")
    if getattr(config, "output_router_logits", False) and balancing_loss_of(model) is None:
        reasons.append("its router auxiliary loss is not transformers' load_balancing_loss_func (set "
                       "output_router_logits=False)")  # fmt: skip
    if getattr(config, "is_causal", True) is False or getattr(config, "use_bidirectional_attention", False):
        reasons.append("its attention is not causal")
    # Falcon-RW: ALiBi's bias on the scores comes in the attention mask, which the paged attention does not read
    if getattr(config, "alibi", False) is True:
        reasons.append("it adds ALiBi position biases to its attention scores (alibi=True), which OOMB's paged "
                       "attention does not apply")  # fmt: skip
    if getattr(config, "logits_soft_cap", None) is not None:
        reasons.append("it soft-caps its logits by a rule OOMB does not know (logits_soft_cap)")
    if reasons:
        raise OOMBConfigError(
            f"OOMB cannot train {name} exactly: {'; '.join(reasons)}. Train this model with another strategy "
            "(see the README's list of exact families)."
        )


# ------------------------------------------------------------------------------------------- self-check
_WIDTHS = {  # config field -> tiny value (ints only; only fields the config has)
    "intermediate_size": 32,
    "ffn_dim": 32,
    "decoder_ffn_dim": 32,
    "encoder_ffn_dim": 32,
    "n_inner": 32,
    "moe_intermediate_size": 16,
    "shared_expert_intermediate_size": 16,
    "shared_intermediate_size": 16,
    "dense_intermediate_size": 32,
    "ffn_hidden_size": 32,
    "vocab_size": 96,
    "num_experts": 4,
    "num_local_experts": 4,
    "n_routed_experts": 4,
    "expert_ffn_hidden_size": 16,  # LongCat-Flash's experts and its identity ("zero") experts
    "zero_expert_num": 2,
    "n_group": 1,
    "num_expert_group": 1,  # (the Bailing hybrids' name)
    "topk_group": 1,
    "mamba_d_state": 8,
    "linear_key_head_dim": 8,  # gated delta-net mixers
    "linear_value_head_dim": 8,
    "linear_num_heads": 2,  # Kimi-Linear's delta rule
    "linear_head_dim": 8,
    "q_lora_rank": 16,  # multi-head latent attention
    "kv_lora_rank": 16,
    "qk_nope_head_dim": 8,
    "qk_rope_head_dim": 8,
    "v_head_dim": 16,
    "vocab_size_per_layer_input": 96,  # Gemma 3n's per-layer embeddings
    "hidden_size_per_layer_input": 8,
    "attention_chunk_size": 12,  # Llama 4's chunked attention: spans within and across the twin's chunks
    "floor_scale": 4,  # Llama 4's query temperature: past 1 from the twin's fourth token on
}
_HEAD_FIELDS = ("num_attention_heads", "n_head", "num_heads", "n_heads", "decoder_attention_heads",
                "encoder_attention_heads")  # fmt: skip
_WIDTH_FIELDS = ("hidden_size", "d_model", "n_embd")  # the model width, under its usual names
_TWIN_CHUNK, _TWIN_TOKENS = 16, 53  # three chunks and a ragged fourth
_TWIN_MAX_PARAMETERS = 20_000_000  # a config that does not shrink below this is not checked (memory, time)
_verdicts: dict = {}  # a twin's config JSON -> None (exact), the error found, or why it could not run (_Unchecked)
_NO_FLOAT64_RULE = (
    "its recurrences compute in float32 and OOMB has no float64 version of them: only its LM head was checked"
)


def _fewer_heads(d: dict, heads: str, kv_heads: str) -> None:
    """At most 2 KV heads, the query/KV ratio kept up to 16 (Falcon's 71:1 would keep the twin 568 wide: many query
    heads per KV head is what counts); multi-head attention (no separate KV heads) at most 2."""
    h, kv = d.get(heads), d.get(kv_heads)
    if not isinstance(h, int):
        return
    if isinstance(kv, int) and kv > 2 and h % kv == 0:
        d[heads], d[kv_heads] = 2 * h // kv, 2
    elif kv is None:
        d[heads] = min(h, 2)
    if isinstance(d.get(kv_heads), int) and d[kv_heads] > 0 and d[heads] % d[kv_heads] == 0:
        d[heads] = min(d[heads], 16 * d[kv_heads])


def _first_int(d: dict, fields: tuple[str, ...]) -> int | None:
    return next((d[f] for f in fields if isinstance(d.get(f), int)), None)


def _tiny(d: dict) -> None:
    """Shrink a config dict in place to a tiny width, keeping its structure: the layers and their types, the
    ratio of query to KV heads (at most 2 KV heads), the share of each head that rotates, and whether the width is
    the heads' total."""
    heads, width = _first_int(d, _HEAD_FIELDS), _first_int(d, _WIDTH_FIELDS)
    head_dim = d.get("head_dim") if isinstance(d.get("head_dim"), int) else heads and width and width // heads
    rope_head = isinstance(d.get("qk_rope_head_dim"), int) and d.get("head_dim") == d["qk_rope_head_dim"]
    for field in _HEAD_FIELDS:  # under each name a config uses (GPT-2's n_head, an encoder-decoder's two)
        _fewer_heads(d, field, "num_key_value_heads")
    _fewer_heads(d, "linear_num_value_heads", "linear_num_key_heads")  # gated delta-net mixers
    tiny_heads = _first_int(d, _HEAD_FIELDS)
    if isinstance(d.get("head_dim"), int):  # 16, less where many query heads share 2 KV heads (GLM's 16:1)
        d["head_dim"] = min(d["head_dim"], 16, max(4, 256 // (tiny_heads or 1)))
    tiny_width = 8 * tiny_heads if tiny_heads else 64
    if heads and width == heads * (head_dim or 0) and isinstance(d.get("head_dim"), int):
        tiny_width = tiny_heads * d["head_dim"]  # the width stays the heads' total
    for field in _WIDTH_FIELDS:
        if isinstance(d.get(field), int):
            d[field] = tiny_width
    if isinstance(d.get("rotary_dim"), int) and head_dim:  # GPT-J, CodeGen: the rotated share of each head
        tiny_head_dim = d.get("head_dim") if isinstance(d.get("head_dim"), int) else tiny_width // tiny_heads
        d["rotary_dim"] = max(2, d["rotary_dim"] * tiny_head_dim // head_dim // 2 * 2)
    if isinstance(d.get("mamba_n_heads"), int) and isinstance(d.get("mamba_d_head"), int):  # Mamba2 mixers
        d["mamba_n_heads"], d["mamba_n_groups"] = 4, 1
        d["mamba_d_head"] = d.get("mamba_expand", 2) * tiny_width // 4
        if isinstance(d.get("mamba_d_ssm"), int):
            d["mamba_d_ssm"] = 4 * d["mamba_d_head"]
    for field, value in _WIDTHS.items():
        if isinstance(d.get(field), int):
            d[field] = min(d[field], value)
        elif isinstance(d.get(field), list) and all(isinstance(v, int) for v in d[field]):  # one per layer
            d[field] = [min(v, value) for v in d[field]]
    if d.get("model_type") == "mamba2":  # pure Mamba2: its heads span expand x hidden
        d.update(num_heads=4, head_dim=16, n_groups=1, state_size=8, hidden_size=4 * 16 // d.get("expand", 2))
    if d.get("residual_in_fp32"):  # (Mamba's) the twin's residual stream in its own float64
        d["residual_in_fp32"] = False
    if isinstance(d.get("qk_nope_head_dim"), int) and isinstance(d.get("qk_rope_head_dim"), int):  # MLA
        d["qk_head_dim"] = d["qk_nope_head_dim"] + d["qk_rope_head_dim"]
        if rope_head:  # DeepSeek's head_dim names the rotated share (its RoPE's size)
            d["head_dim"] = d["qk_rope_head_dim"]
    for top_k in (
        "num_experts_per_tok",
        "moe_topk",
        "num_experts_per_token",
    ):  # (LongCat-Flash's, Kimi's names)
        if isinstance(d.get(top_k), int):
            d[top_k] = min(d[top_k], 2)
    for field in ("pad_token_id", "bos_token_id", "eos_token_id"):
        if isinstance(d.get(field), int) and d[field] >= d.get("vocab_size", 96):
            d[field] = d.get("vocab_size", 96) - 1  # an id of the tiny vocabulary (some configs refuse None)
    d["torch_dtype"] = d["dtype"] = "float64"
    for sub in ("text_config", "vision_config", "audio_config"):  # a multimodal wrapper's towers
        if isinstance(d.get(sub), dict):
            _tiny(d[sub])


def _tiny_config(model: torch.nn.Module):
    """The twin's config: ``model``'s shrunk by :func:`_tiny`."""
    config = model.config
    d = config.to_dict()
    _tiny(d)
    tiny = type(config).from_dict(d)
    with contextlib.suppress(Exception):  # MoE experts looped in eager torch: grouped matmuls refuse float64
        tiny._experts_implementation = "eager"
    return tiny


@contextlib.contextmanager
def _own_rng():
    """The random state as it was, afterwards: the twin's weights come from a seed of their own, and the user's
    ``seed_everything`` (shuffles, dropout masks) must go on as if no check had run. The CPU generator, and the
    current CUDA device's when CUDA is running (nothing here starts it, or seeds any other device's)."""
    cuda = torch.cuda.is_available() and torch.cuda.is_initialized()
    with torch.random.fork_rng(devices=[torch.cuda.current_device()] if cuda else []):
        yield


def _twin(model: torch.nn.Module, tiny=None):
    """A float64 CPU twin of ``model`` of the config ``tiny`` (default: :func:`_tiny_config`), and that config.
    Seeds the CPU generator: call it under :func:`_own_rng`."""
    tiny = _tiny_config(model) if tiny is None else tiny
    with torch.device("meta"):  # its size first, allocating nothing
        size = sum(p.numel() for p in type(model)(tiny).parameters())
    if size > _TWIN_MAX_PARAMETERS:
        raise ValueError(f"the twin would have {size} parameters")
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        # not torch.manual_seed: it would also seed CUDA's generators (or queue their seeding until CUDA starts)
        torch.default_generator.manual_seed(0)
        with torch.device("cpu"):
            twin = type(model)(tiny)
    finally:
        torch.set_default_dtype(previous)
    # float64 end to end (eager softmaxes in float32), unless SDPA would drop a logit softcap (transformers 5.17)
    if any(getattr(c, "attn_logit_softcapping", None) for c in _configs(twin.config)):
        twin.config._attn_implementation = "eager"
    elif getattr(twin, "_supports_sdpa", False):
        twin.config._attn_implementation = "sdpa"
    return twin.double().eval(), tiny


def _relative(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got - want).abs().max() / want.abs().max().clamp_min(1e-30)).item()


def _loss_and_grads(twin, ids, step) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    twin.zero_grad()
    loss = step(ids)
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in twin.named_parameters() if p.grad is not None}


def _difference(got, want, tolerance: float, what: str) -> str | None:
    (got_loss, got_grads), (want_loss, want_grads) = got, want
    if missing := sorted(set(want_grads) - set(got_grads)):
        return f"parameters that get no gradient through OOMB ({', '.join(missing[:3])})"
    errors = relative_errors({"loss": got_loss, **got_grads}, {"loss": want_loss, **want_grads})
    loss_error = errors.pop("loss")
    worst, grad_error = max(errors.items(), key=lambda kv: kv[1])
    if loss_error > tolerance or grad_error > tolerance:
        return f"a relative error of {loss_error:.1e} in the loss and {grad_error:.1e} in {worst}'s gradient {what}"
    return None


def _mismatch(twin: torch.nn.Module, adapter_cls, mla_pages: str = "expanded") -> str | None:
    """``None`` if OOMB trains ``twin`` exactly: three chunks equal one chunk to 1e-6 and one chunk equals the
    model's own full-sequence training to 1e-5 (float64, but some models norm or softmax in float32 even then; a
    chunking error — a dropped state, a wrong position, a missing gradient — is orders of magnitude larger)."""
    from lightning_oomb.engine import OOMBConfig, OOMBEngine

    vocab = twin.get_output_embeddings().weight.shape[0]
    ids = torch.randint(0, vocab, (1, _TWIN_TOKENS), generator=torch.Generator().manual_seed(0))

    def oomb(chunk: int):
        engine = OOMBEngine(
            adapter_cls(twin, verify_exactness=False),
            OOMBConfig(chunk, _TWIN_CHUNK, attention_backend="torch", mla_pages=mla_pages),
        )
        return engine.loss

    def full_sequence(ids):
        out = twin(input_ids=ids, use_cache=False)
        logits = out.logits[:, :-1]
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1))
        aux = getattr(out, "aux_loss", None)  # the MoE router's load balancing, when the model trains with it
        return loss if aux is None else loss + twin.router_aux_loss_coef * aux

    try:  # a twin that cannot even train itself says nothing about the model (its shrunk config may be invalid)
        reference = _loss_and_grads(twin, ids, full_sequence)
    except Exception as err:
        raise _UnusableTwin from err
    chunked = _loss_and_grads(twin, ids, oomb(_TWIN_CHUNK))
    whole = _loss_and_grads(twin, ids, oomb(_TWIN_CHUNK * 4))
    return (
        _difference(whole, reference, 1e-5, "against the model's own training")
        or _difference(chunked, whole, 1e-6, "between three chunks and one")
        or _own_loss_difference(twin, ids, reference[0])
    )


def _own_loss_difference(twin: torch.nn.Module, ids: torch.Tensor, want: torch.Tensor) -> str | None:
    """``None`` if the loss the twin's forward computes itself, given labels, is the loss the reference computes
    from its logits (the next-token cross-entropy, plus the router's balancing loss) — else what differs: a loss
    function or a term transformers' class (or a global ``LOSS_MAPPING`` entry) adds, that OOMB would not compute,
    or labels it takes as already shifted (``WhisperForCausalLM``: OOMB would shift them again).
    Only the value is compared, to 1e-5: transformers computes its cross-entropy in float32, whose rounding a
    gradient comparison could not tell from an error; a different loss differs by far more. ``None`` too if the
    forward has no loss or fails given labels."""
    from transformers.utils import logging as hf_logging

    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()  # a subclass's loss_type=None warning: about the twin, not the user's model
    try:
        with torch.no_grad():
            got = twin(input_ids=ids, labels=ids, use_cache=False).loss
    except Exception:
        return None
    finally:
        hf_logging.set_verbosity(verbosity)
    if not isinstance(got, torch.Tensor) or got.numel() != 1:
        return None
    error = _relative(got.detach().to(want.dtype).reshape(()), want)
    if error > 1e-5:
        return (
            f"that its own training loss (its forward given labels) differs from the next-token cross-entropy of "
            f"its logits, which OOMB computes, by a relative error of {error:.1e} (a loss function or a term OOMB "
            "does not compute, or labels the model does not shift: WhisperForCausalLM's)"
        )
    return None


def _head_mismatch(twin: torch.nn.Module, adapter_cls) -> str | None:
    """``None`` if the model's own ``*ForCausalLM`` forward turns given final hidden states into the logits that
    OOMB's loss computes from them (the adapter's :class:`~lightning_oomb.engine.loss.LMHead`: weight, bias, scale,
    softcap), else what differs; ``None`` too if the forward cannot be probed so (it does not call its decoder)."""
    from transformers.modeling_outputs import MoeModelOutputWithPast

    head = adapter_cls(twin, verify_exactness=False).lm_head()
    hidden = torch.randn(1, 5, head.weight.shape[1], dtype=head.weight.dtype,
                         generator=torch.Generator().manual_seed(0))  # fmt: skip
    decoder, called = decoder_of(twin), []

    def stub(*args, **kwargs):
        called.append(True)
        return MoeModelOutputWithPast(last_hidden_state=hidden)

    decoder.forward = stub
    try:
        with torch.no_grad():
            got = twin(input_ids=torch.zeros(1, 5, dtype=torch.long)).logits
    except Exception:
        return None
    finally:
        del decoder.forward
    want = torch.nn.functional.linear(hidden, head.weight, head.bias) * head.scale
    if head.softcap is not None:
        want = head.softcap * torch.tanh(want / head.softcap)
    if not called or got.shape != want.shape:
        return None
    error = _relative(got, want)
    if error > 1e-6:
        return (
            f"that its LM head makes other logits than OOMB's loss computes from the same hidden states (a "
            f"relative error of {error:.1e}: a scale, cap or layer of the head that OOMB does not read)"
        )
    return None


class _UnusableTwin(Exception):
    """The twin's own full-sequence training fails: the check is skipped."""


class _Unchecked(str):
    """The verdict of a check that could not run: why."""


def verify_exactness(model: torch.nn.Module, adapter_cls, mla_pages: str = "expanded") -> bool:
    """Refuse ``model`` if OOMB does not train a float64 twin of its architecture exactly (see the module
    docstring); ``adapter_cls`` builds the adapter of the twin. Returns whether the check ran; where it could not
    (no twin could be built, or it could not train itself, or it is a hybrid with a float32 recurrence OOMB has no
    float64 version of: only its head checked), warns with the reason — the model is accepted by the static rules
    alone. Verdicts are cached per architecture and ``mla_pages`` (what latent attention layers' pages hold).

    A hybrid's recurrences (gated delta rule, Mamba2 scan), which transformers computes in float32 whatever the
    dtype, run in float64 in the twin (:mod:`~lightning_oomb.integrations.hf.float64_rules`): else its chunkings
    would differ by float32 rounding (up to 4e-2 in ``A_log``'s gradient of a tiny Qwen3-Next twin) and the check
    could not tell rounding from an error."""
    verdict = _verdict(model, adapter_cls, mla_pages)
    if isinstance(verdict, _Unchecked):
        warnings.warn(
            f"OOMB's self-check could not check {type(model).__name__} ({verdict}): the model passed OOMB's "
            "static rules only, so its exactness under chunking is unverified — compare a few steps with "
            "strategy='auto' on short sequences before a long run (verify_exactness=False skips the check and "
            "this warning).",
            UserWarning,
            stacklevel=2,
        )
        return False
    if verdict is not None:
        raise OOMBConfigError(
            f"OOMB cannot train {type(model).__name__} exactly: its self-check (a float64 twin of the architecture "
            f"trained in chunks and whole) found {verdict} — this architecture needs support OOMB does not have "
            "yet — train it with another strategy (or pass verify_exactness=False to train it anyway)."
        )
    return True


def _verdict(model: torch.nn.Module, adapter_cls, mla_pages: str) -> str | _Unchecked | None:
    """The self-check's verdict on ``model``'s architecture: ``None`` (exact), the error found, or why it could not
    run (:class:`_Unchecked`); cached per architecture."""
    with _own_rng():  # the twin's seed and the check's draws leave the user's random state as it was
        try:
            tiny = _tiny_config(model)
            key = f"{type(model).__qualname__}:{mla_pages}:{tiny.to_json_string()}"
        except Exception as err:  # a config that does not shrink: nothing to check against
            return _Unchecked(f"its config could not be shrunk to a tiny twin's: {type(err).__name__}: {err}")
        if key not in _verdicts:  # once per architecture: no twin is built for a verdict already known
            try:
                twin, _ = _twin(model, tiny)
            except Exception as err:  # nothing to check against
                return _Unchecked(f"no tiny twin could be built: {type(err).__name__}: {err}")
            # float32 recurrences the twin cannot compute in float64 (an unknown rule's name): only its head checked
            unknown = float32_recurrences(model) and not float32_rules_of(twin)
            try:
                with float64_recurrences(twin):
                    _verdicts[key] = _head_mismatch(twin, adapter_cls) or (
                        _Unchecked(_NO_FLOAT64_RULE) if unknown else _mismatch(twin, adapter_cls, mla_pages)
                    )
            except _UnusableTwin as err:
                cause = err.__cause__
                _verdicts[key] = _Unchecked(
                    f"its tiny twin cannot train itself: {type(cause).__name__}: {cause}"
                )
            except OOMBConfigError as err:
                _verdicts[key] = str(err)
            except Exception as err:
                _verdicts[key] = f"that running it in chunks fails ({type(err).__name__}: {err})"
    return _verdicts[key]
