"""``HFChunkModel``: drives a transformers ``*ForCausalLM`` chunk by chunk through the engine.

The chunk context travels as the extra model-call keyword ``oomb_chunk``; positions go in ``position_ids`` (offset
by the chunk start). The model's own attention implementation is switched to ``"oomb"`` — and, with
``layer_checkpointing``, HF's per-layer checkpointing turned on, and a length-dependent RoPE pinned to the step's
position span — only while the engine runs it (:meth:`HFChunkModel.engaged`), so the same model behaves unchanged
everywhere else (generation, ordinary evaluation, other strategies after a fit).

:class:`HFChunkModel` implements the engine's :class:`~lightning_oomb.engine.model.ManagedModel`: besides driving
chunks it answers the user's own ``model(**batch)`` calls inside the strategy's steps with a
``CausalLMOutputWithPast`` whose ``loss`` is the engine's (:meth:`HFChunkModel.answer_calls`).
:func:`find_causal_lm` finds the model inside a LightningModule.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import sys
import warnings
from collections.abc import Iterator

import torch

from lightning_oomb.engine.attention import ChunkContext
from lightning_oomb.engine.errors import OOMBConfigError
from lightning_oomb.engine.loss import LMHead
from lightning_oomb.engine.model import Respond, answered_by
from lightning_oomb.engine.model_shape import (
    Mixer,
    config_kv_heads,
    decoder_of,
    layer_head_dims,
    layer_kv_heads,
    layer_kv_sources,
    paged_head_dim,
)
from lightning_oomb.engine.tiles import tiled
from lightning_oomb.engine.user_hooks import refresh_parameters
from lightning_oomb.integrations.hf.attention import (
    ATTN_NAME,
    ENGAGED,
    RUNNING,
    TokensBefore,
    attention_chunk,
    counts_tokens_before,
    register_attention,
)
from lightning_oomb.integrations.hf.calls import answer, read_call
from lightning_oomb.integrations.hf.latent import check_latent_modules, keeping_latents, latent_width
from lightning_oomb.integrations.hf.moe import RouterBalanceLoss
from lightning_oomb.integrations.hf.rope import length_dependent_rotaries, pinned_rope
from lightning_oomb.integrations.hf.states import (
    CARRIED_MIXERS,
    carried_mixers,
    carrying_states,
    mixer_shape,
    passing_cache,
    state_elements,
)
from lightning_oomb.integrations.hf.support import check_supported, logit_transform, verify_exactness


def find_causal_lm(module: torch.nn.Module, target_module: str | None = None) -> torch.nn.Module:
    """The HF causal LM to drive inside ``module`` (e.g. a LightningModule): ``target_module`` (attribute path) or
    the unique outermost one found. A peft prompt-learning model around it is refused
    (:func:`_refuse_prompt_learning`)."""
    from transformers import PreTrainedModel

    _refuse_prompt_learning(module)
    if target_module is not None:
        try:
            return module.get_submodule(target_module)
        except AttributeError as err:
            raise OOMBConfigError(
                f"target_module={target_module!r} is not a submodule of {type(module).__name__} — the strategy "
                "cannot find the model to drive — pass the attribute path of the HF model, e.g. 'model'."
            ) from err
    found = [
        (name, m)
        for name, m in module.named_modules()
        if isinstance(m, PreTrainedModel) and m.get_output_embeddings() is not None
    ]
    outermost = [(n, m) for n, m in found if not any(n.startswith(o + ".") for o, _ in found if o != n)]
    if len(outermost) != 1:
        names = [n for n, _ in outermost] or "none"
        raise OOMBConfigError(
            f"{type(module).__name__} holds {len(outermost)} Hugging Face causal LMs ({names}) — the OOMB strategy "
            "drives exactly one — pass OOMBStrategy(target_module='<attribute path>')."
        )
    return outermost[0][1]


def _refuse_prompt_learning(module: torch.nn.Module) -> None:
    """Refuse, at setup, a peft model whose active adapter learns prompts (prompt tuning, p-tuning, prefix tuning,
    multitask prompt tuning, ...): peft passes its virtual tokens to the causal LM as ``inputs_embeds`` or as a
    ``past_key_values`` prefix, neither of which the engine's chunks can take — refused at the first step before,
    with an error about a call the user never made (no input_ids; a generate call)."""
    peft = sys.modules.get("peft")  # (a peft model exists only once peft is imported)
    if peft is None:
        return
    for name, found in module.named_modules():
        if not isinstance(found, peft.PeftModel):
            continue
        config = found.peft_config.get(found.active_adapter)
        if getattr(config, "is_prompt_learning", False):
            kind = getattr(config.peft_type, "value", config.peft_type)
            raise OOMBConfigError(
                f"{name or type(module).__name__} ({type(found).__name__}) is a peft model whose adapter "
                f"{found.active_adapter!r} is "
                f"{kind} (prompt learning) — peft feeds its virtual tokens to the causal LM as inputs_embeds or a "
                "past_key_values prefix, and OOMB's chunks embed their own token ids and keep their keys and values "
                "in its paged pool, so they cannot take either — train adapters on the model's weights instead "
                "(LoRA, IA3, LoHa, LoKr, VeRA, OFT train exactly), or train this model with strategy='auto'."
            )


def _layer_windows(model: torch.nn.Module, attention: list[torch.nn.Module] | None = None):
    """Each attention layer's sliding window as it passes it: the module's ``sliding_window`` (Qwen2/3, Gemma,
    GPT-OSS: ``None`` on full layers) or, without one, the config's (Mistral, Phi-3: every layer); ``None`` on a
    layer the config's ``layer_types`` calls ``full_attention``; a chunked-attention layer's span (Llama 4: the
    keys it keeps are a window's). ``attention``:
    the attention modules in pool order (default: every decoder layer's ``self_attn``, each of a ``ModuleList``'s
    in turn: LongCat-Flash's layers attend twice). ``None`` when the layers cannot be read; the engine checks every
    call against what this declares."""
    if attention is None:
        layers = getattr(decoder_of(model), "layers", None)
        if layers is None:
            return None
        attention = [getattr(layer, "self_attn", None) for layer in layers]
        attention = [m for a in attention for m in (a if isinstance(a, torch.nn.ModuleList) else [a])]
        if any(module is None for module in attention):
            return None
    config = model.config.get_text_config(decoder=True)
    types = list(getattr(config, "layer_types", None) or [])
    windows = []
    for module in attention:
        window = getattr(module, "sliding_window", getattr(config, "sliding_window", None))
        index = getattr(module, "layer_idx", None)
        # EXAONE 4 keeps the attribute on full layers too
        full = isinstance(index, int) and types[index : index + 1] == ["full_attention"]
        block = attention_chunk(module, config)
        windows.append(block if block else window if isinstance(window, int) and not full else None)
    return tuple(windows)


def _attention_modules(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The decoder's attention modules (``*Attention`` or LongCat-Flash's ``*MLA``, with a ``layer_idx``), in
    layer order: a hybrid's layers that have pages (a recurrent or convolution layer has none)."""
    found = {}
    for module in decoder_of(model).modules():
        name = type(module).__name__
        # (a carried mixer named like attention, Kimi-Linear's KimiLinearDeltaAttention, has no pages)
        routed = name.endswith(("Attention", "MLA")) and name not in CARRIED_MIXERS
        if routed and isinstance(getattr(module, "layer_idx", None), int):
            found.setdefault(module.layer_idx, module)
    return [found[i] for i in sorted(found)]


def dense_mlps(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The decoder layers' dense MLPs: a layer's ``mlp`` whose class name ends in ``MLP`` and that routes nothing
    (MoE blocks are not, whatever their name: GPT-OSS's ``GptOssMLP`` has a router and experts)."""
    return [m for name, m in decoder_of(model).named_modules()
            if name.rsplit(".", 1)[-1] == "mlp" and type(m).__name__.endswith("MLP")
            and not any(hasattr(m, part) for part in ("router", "experts"))]  # fmt: skip


@contextlib.contextmanager
def tiled_mlps(mlps: list[torch.nn.Module], tile: int | None) -> Iterator[None]:
    """While the block runs, each MLP's call runs ``tile`` tokens at a time with grad (:mod:`~lightning_oomb.engine.
    tiles`); ``None``: unchanged."""
    if tile is None:
        yield
        return
    own = [mlp.__dict__.get("forward") for mlp in mlps]  # a forward set on the instance (kept, restored)
    for mlp in mlps:
        mlp.forward = functools.partial(tiled, mlp.forward, tile=tile, params=tuple(mlp.parameters()))
    try:
        yield
    finally:
        for mlp, forward in zip(mlps, own, strict=True):
            if forward is None:
                del mlp.forward
            else:
                mlp.forward = forward


def adapter_for_planning(module: torch.nn.Module) -> HFChunkModel | None:
    """The adapter the memory planner reads a Hugging Face causal LM through (a hybrid's attention layers and
    carried states, its windows, as the strategies' plans read them; no self-check); ``None`` for another module or
    a model the adapter refuses (the plan reads its config alone)."""
    from transformers import PreTrainedModel

    if not isinstance(module, PreTrainedModel) or module.get_output_embeddings() is None:
        return None
    try:
        return HFChunkModel(module, verify_exactness=False)
    except OOMBConfigError:
        return None


def verify_exactness_of(model: torch.nn.Module, mla_pages: str = "expanded") -> bool:
    """The self-check of :func:`~lightning_oomb.integrations.hf.support.verify_exactness` for ``model`` (its latent
    attention layers' pages as ``mla_pages`` says): raises on a mismatch, returns whether the check could run."""
    return verify_exactness(model, HFChunkModel, mla_pages)


def _support_inputs(model: torch.nn.Module) -> tuple:
    """What :func:`~lightning_oomb.integrations.hf.support.check_supported` reads that can change after setup,
    cheaply compared: the LM head module, its class and a ``forward`` set on it, the model's class, its
    ``loss_function`` set on it, its ``loss_type``."""
    head = model.get_output_embeddings()
    return (
        head,
        type(head),
        vars(head).get("forward") if isinstance(head, torch.nn.Module) else None,
        type(model),
        getattr(model, "_loss_function", None),
        getattr(model, "loss_type", None),
    )


def _checkpointing_on(model: torch.nn.Module) -> bool:
    return any(getattr(m, "gradient_checkpointing", False) for m in model.modules())


def set_layer_checkpointing(model: torch.nn.Module, enabled: bool) -> None:
    """HF per-layer activation checkpointing (non-reentrant) on or off; transformers >= 5.24 renamed the API."""
    if enabled:
        enable = getattr(model, "activation_checkpointing_enable", None)
        if enable is not None:
            enable(activation_checkpointing_kwargs={"use_reentrant": False})
        else:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    else:
        disable = (
            getattr(model, "activation_checkpointing_disable", None) or model.gradient_checkpointing_disable
        )
        disable()


_GRAD_HOOK_ATTRS = ("_require_grads_hooks", "_require_grads_hook")  # transformers' enable_input_require_grads


def _input_grad_hooks(model: torch.nn.Module) -> list:
    """The handles of the hooks ``enable_input_require_grads`` put on the input embeddings (a list since transformers
    5.2x, one handle before)."""
    hooks = model.__dict__.get("_require_grads_hooks")
    if hooks is None:
        one = model.__dict__.get("_require_grads_hook")
        hooks = [] if one is None else [one]
    return list(hooks)


@contextlib.contextmanager
def checkpointed_layers(model: torch.nn.Module) -> Iterator[None]:
    """HF per-layer checkpointing on for the block, then off with the input embeddings' hooks as they were:
    transformers' enable adds ``enable_input_require_grads``' hook at every call and its disable removes it only from
    a peft model (two more hooks a step piled up, and a model holding them does not pickle)."""
    kept = {a: model.__dict__[a] for a in _GRAD_HOOK_ATTRS if a in model.__dict__}
    before = _input_grad_hooks(model)
    set_layer_checkpointing(model, True)
    added = [h for h in _input_grad_hooks(model) if all(h is not b for b in before)]
    try:
        yield
    finally:
        set_layer_checkpointing(model, False)
        for hook in added:
            hook.remove()
        for attr in _GRAD_HOOK_ATTRS:
            if attr in kept:
                setattr(model, attr, kept[attr])
            else:
                model.__dict__.pop(attr, None)


class HFChunkModel:
    """Adapter from a transformers ``*ForCausalLM`` to the engine's :class:`~lightning_oomb.engine.model.ManagedModel`.

    Args:
        model: the causal LM (a ``PreTrainedModel`` with an LM head; refused with the reason if OOMB cannot train
            it exactly, see :mod:`lightning_oomb.integrations.hf.support`).
        layer_checkpointing: turn on HF's per-layer checkpointing while the engine runs the model (if the model
            does not have it on already); restored afterwards.
        verify_exactness: also run the self-check (a float64 twin of the architecture trained in chunks against
            full-sequence training; well under a second to a few seconds on the CPU, once per architecture) and
            refuse a mismatch — on by default, as in the strategies (it was off here: the engine trained a model
            the strategies refuse, e.g. one whose LM head is more than a linear layer, silently wrong).
    """

    def __init__(
        self, model: torch.nn.Module, layer_checkpointing: bool = False, verify_exactness: bool = True
    ):
        check_supported(model)
        self._supported = _support_inputs(model)
        register_attention()
        if verify_exactness:
            verify_exactness_of(model)
        self._verify = verify_exactness
        self.model = model
        config = model.config.get_text_config(decoder=True)  # a multimodal wrapper's decoder (Gemma 3)
        layers = getattr(decoder_of(model), "layers", None)  # Blenderbot's config counts its encoder's
        self.num_layers = config.num_hidden_layers if layers is None else len(layers)
        self._routed = _attention_modules(model)  # each finds the running chunk in RUNNING
        # attention that reads the tokens before its chunk from its cache: given TokensBefore as one
        self._counting = [m for m in self._routed if counts_tokens_before(m)]
        if self._routed:  # the pool has a layer per attention call: LongCat-Flash's layers hold two
            self.num_layers = max(self.num_layers, self._routed[-1].layer_idx + 1)
        self._mixers = carried_mixers(model)
        # no attention at all (pure Mamba2): carried states only, an empty pool
        if self._mixers and not self._routed:
            self.kv_heads, self.head_dim = 1, 16
        else:
            self.kv_heads = config_kv_heads(config)
            self.head_dim = paged_head_dim(config)
        self.layer_checkpointing = layer_checkpointing
        self.mlp_tile: int | None = None  # OOMBConfig.mlp_tile, set by the engine
        self._mlps = dense_mlps(model)
        self.logit_scale, self.logit_softcap = logit_transform(config)
        self._rotaries = length_dependent_rotaries(model)
        self._balances_experts = bool(getattr(config, "output_router_logits", False))
        # a hybrid: its recurrent / convolution layers' states are carried across chunks, and only its attention
        # layers have pages (each gets its rank among them as its pool layer)
        self.carries_states = bool(self._mixers)
        self._attention = self._routed if self.carries_states else []
        if self.carries_states:
            self.num_layers = len(self._attention)
        self.layer_windows = _layer_windows(model, self._attention or None)
        # Gemma 4's layers: sliding ones with narrower heads than the global ones (and in its 31B and 26B-A4B more
        # KV heads); each layer's pages at its own (PoolShape.for_layers)
        self.layer_kv_heads, self.layer_head_dims = layer_kv_heads(config), layer_head_dims(config)
        per_layer = [n for n in (self.layer_kv_heads, self.layer_head_dims) if n is not None]
        if any(len(n) != self.num_layers or self.carries_states for n in per_layer):
            if self.layer_kv_heads is not None:
                raise OOMBConfigError(
                    f"{type(model).__name__}'s layers differ in their KV heads and its attention calls are not one "
                    "per layer (a hybrid, or a layer attending twice): OOMB's pool cannot tell which heads a call "
                    "has — train this model with another strategy."
                )
            self.layer_head_dims = None  # (its narrower heads zero-padded to the widest)
        # Gemma 4's / 3n's KV-sharing layers read an earlier layer's pages (one attention call per layer: indices
        # agree), where they take its very K/V (transformers' shared_kv_states; else each keeps its own copy)
        sources = layer_kv_sources(config)
        passes = any("shared_kv_states" in inspect.signature(m.forward).parameters for m in self._routed)
        self.layer_kv_sources = sources if sources and passes and len(sources) == self.num_layers else None
        self._expanded = (self.kv_heads, self.head_dim, self.layer_kv_heads, self.layer_head_dims)
        self._mla_pages = "expanded"
        self._states = None  # the running chunk's carried states
        self._chunk: ChunkContext | None = None  # the running chunk (also in a checkpoint's recompute)
        self._answered = 0  # the causal LM's calls answered in the running answer_calls block

    @property
    def mla_pages(self) -> str:
        """What the pages of latent attention layers hold (``OOMBConfig.mla_pages``, set by the engine):
        ``"expanded"`` every head's keys and values, ``"latent"`` one head of latents
        (:mod:`~lightning_oomb.integrations.hf.latent`) — the pool's geometry follows."""
        return self._mla_pages

    @mla_pages.setter
    def mla_pages(self, mode: str) -> None:
        mode = "expanded" if mode == "auto" else mode  # (undecided: a bare engine's)
        if mode == self._mla_pages:
            return
        if mode == "latent":
            check_latent_modules(self._routed, type(self.model).__name__)
            if len({latent_width(m) for m in self._routed}) > 1:
                raise OOMBConfigError(
                    f"mla_pages='latent' with {type(self.model).__name__}'s layers of latents of different widths: "
                    "OOMB's pool holds one width — use mla_pages='expanded'."
                )
            if self._verify:
                verify_exactness_of(self.model, "latent")
            self.kv_heads, self.head_dim = 1, latent_width(self._routed[0])
            self.layer_kv_heads = self.layer_head_dims = None
        else:
            self.kv_heads, self.head_dim, self.layer_kv_heads, self.layer_head_dims = self._expanded
        self._mla_pages = mode

    @property
    def values_are_keys(self) -> bool:
        """Whether every attention call passes its keys as its values (over latents: one page holds both)."""
        return self._mla_pages == "latent"

    @property
    def vocab_size(self) -> int:
        """Rows of the LM head, read at each step (``resize_token_embeddings`` may run after setup)."""
        return self.model.get_output_embeddings().weight.shape[0]

    @property
    def num_embeddings(self) -> int:
        """Rows of the input embedding, read at each step."""
        return self.model.get_input_embeddings().weight.shape[0]

    @property
    def packing_refused(self) -> str | None:
        """Why packed documents cannot train exactly (the engine refuses them, before any work), or ``None``."""
        if not self._counting:
            return None
        return (
            "its queries are scaled by a temperature of the token's index in the row (Llama 4's layers without RoPE, "
            "attn_temperature_tuning), which the chunks pass as the tokens before them, so a packed document would "
            "not start from 0 — pad the documents to a common length instead of packing them (or set "
            "attn_temperature_tuning=False, a different model)."
        )

    def carried_mixer_shapes(self) -> tuple[Mixer, ...]:
        """A hybrid's carried mixers as the planner reads them (:func:`~lightning_oomb.integrations.hf.states.
        mixer_shape`)."""
        return tuple(map(mixer_shape, self._mixers))

    def carried_state_elements(self) -> tuple[int, int]:
        """A hybrid's carried states per batch row and chunk boundary: ``(convolution, recurrent)`` elements (the
        planner's input; :func:`~lightning_oomb.integrations.hf.states.state_elements`)."""
        return state_elements(self._mixers)

    def parameters(self) -> Iterator[torch.nn.Parameter]:
        """The wrapped model's parameters (the engine sums 16-bit ones' chunk gradients in float32)."""
        return self.model.parameters()

    @property
    def training(self) -> bool:
        """The wrapped model's train / eval mode (the engine checks it is the same in both sweeps)."""
        return self.model.training

    def adapter_state(self) -> tuple:
        """What switches the model's adapters: each peft tuner layer's ``disable_adapters``, active and merged
        adapters (the engine checks they are the same in both sweeps: a loss computed under peft's
        ``disable_adapter()`` and back-propagated after it would recompute with the adapters on)."""
        return tuple(
            (m.disable_adapters, tuple(m.active_adapters), tuple(m.merged_adapters))
            for m in self.model.modules()
            if hasattr(m, "_disable_adapters") and hasattr(m, "merged_adapters")
        )

    def new_step_loss(self) -> RouterBalanceLoss | None:
        """The step's MoE load-balancing term when the model trains with one (``output_router_logits=True``)."""
        if not self._balances_experts:
            return None
        model = self.model
        return RouterBalanceLoss(model.num_experts, model.num_experts_per_tok, model.router_aux_loss_coef)

    @contextlib.contextmanager
    def engaged(self, num_tokens: int) -> Iterator[None]:
        """Route the model's attention through the engine, pin a length-dependent RoPE to ``num_tokens`` (the
        step's largest position + 1, as HF's full-sequence call reads it) and turn per-layer checkpointing on if
        asked, for the duration of the block; what was changed is restored."""
        config = self.model.config
        previous = config._attn_implementation
        checkpointing = self.layer_checkpointing and not _checkpointing_on(self.model)
        config._attn_implementation = ATTN_NAME
        ENGAGED.add(id(self.model))
        for rank, module in enumerate(self._attention):
            module.oomb_layer = rank
        RUNNING.update((id(module), self._running_chunk) for module in self._routed)
        try:
            with (
                checkpointed_layers(self.model) if checkpointing else contextlib.nullcontext(),
                pinned_rope(self._rotaries, num_tokens),
                carrying_states(self._mixers, lambda: self._states),
                passing_cache(self._counting, lambda _: TokensBefore(self._chunk)),
                tiled_mlps(self._mlps, self.mlp_tile),
                keeping_latents(self._routed) if self._mla_pages == "latent" else contextlib.nullcontext(),
            ):
                yield
        finally:
            config._attn_implementation = previous
            ENGAGED.discard(id(self.model))
            for module in self._attention:
                del module.oomb_layer
            for module in self._routed:
                RUNNING.pop(id(module), None)
            self._chunk = None

    def hidden_states(
        self, input_ids: torch.Tensor, position_ids: torch.Tensor, chunk: ChunkContext
    ) -> torch.Tensor:
        """Final normed hidden states ``[B, L, H]`` of one chunk (and its router logits, into ``chunk.step_loss``)."""
        routed = {"output_router_logits": True} if chunk.step_loss is not None else {}
        self._states = chunk.states  # read by the carried mixers, also in a checkpoint's recompute
        self._chunk = chunk
        out = decoder_of(self.model)(
            input_ids=input_ids, position_ids=position_ids, use_cache=False, oomb_chunk=chunk, **routed
        )
        if routed:
            chunk.step_loss.record(chunk, out.router_logits)
        return out.last_hidden_state

    def _running_chunk(self) -> ChunkContext | None:
        return self._chunk

    def lm_head(self) -> LMHead:
        """The head as it is now; the model is checked again (:func:`~lightning_oomb.integrations.hf.support.
        check_supported`) if its head or loss changed since (a LoRA adapter injected on ``lm_head``, a
        ``loss_function`` set, in ``on_fit_start``): OOMB's loss reads the head's weight and nothing else."""
        if (inputs := _support_inputs(self.model)) != self._supported:
            check_supported(self.model)
            self._supported = inputs
        head = refresh_parameters(self.model.get_output_embeddings())  # e.g. a pruning mask applied
        return LMHead(head.weight, head.bias, self.logit_scale, self.logit_softcap)

    @contextlib.contextmanager
    def answer_calls(self, respond: Respond) -> Iterator[None]:
        """While the block runs, the model's calls (read as its own ``forward`` reads them:
        :func:`~lightning_oomb.integrations.hf.calls.read_call`) return what HF would, with the engine's loss
        (``respond``) and a logits stand-in that refuses every use (the whole sequence's logits are never
        materialised). ``position_ids`` that restart mark packed documents, an ``attention_mask`` right padding
        (:mod:`lightning_oomb.engine.batch`). A forward set on the model instance is kept, or refused if it does
        more than run the model (:func:`~lightning_oomb.engine.model.answered_by`). A call of the base model
        itself (``model.model(...)``: not answered) runs the whole sequence at once: with grad enabled before the
        causal LM's call (a training step that trains through the base model alone) it is refused before it runs,
        otherwise it warns (:func:`_check_a_direct_call`)."""
        self._answered = 0

        # never traced: under torch.compile(model) dynamo would trace the engine's forward sweep (hundreds of frames,
        # graph breaks) and inductor's rounding there would differ from the backward sweep's eager recompute
        @torch.compiler.disable
        def forward(*args, **kwargs):
            call = read_call(self.model, args, kwargs, self._balances_experts)
            self._answered += 1
            loss = respond(
                call.input_ids,
                call.labels,
                position_ids=call.position_ids,
                attention_mask=call.attention_mask,
                **(
                    {} if call.num_items_in_batch is None else {"num_items_in_batch": call.num_items_in_batch}
                ),
            )
            return answer(call, loss)

        decoder = decoder_of(self.model)
        _GUARDED[id(decoder)] = self
        guard = decoder.register_forward_pre_hook(_check_a_direct_call)
        try:
            with answered_by(self.model, forward):
                yield
        finally:
            guard.remove()
            _GUARDED.pop(id(decoder), None)


# base models (by id) whose adapter answers calls now: a direct call of one is checked (:func:`_check_a_direct_call`)
_GUARDED: dict[int, HFChunkModel] = {}


def _check_a_direct_call(module: torch.nn.Module, args) -> None:
    """Forward pre-hook of a guarded base model: a call outside the engine's chunks (the user's ``model.model(...)``
    inside a managed step) runs the whole sequence at once. With grad enabled and no call of the causal LM answered
    yet in the step, it is refused before it runs: the step would train through the base model alone — after an
    unchunked forward that keeps the whole sequence's activations (an out-of-memory on a long sequence), to be refused
    only after it for not calling the causal LM. Otherwise (beside the causal LM's call, or without grad: a
    validation step) it warns. Module-level, so a copy made during the step (which copies the hook) stays picklable;
    on a copy (another id) it does nothing."""
    adapter = _GUARDED.get(id(module))
    if adapter is None or adapter._chunk is not None:  # not guarded, or the engine's call of a chunk
        return
    name = type(module).__name__
    if torch.is_grad_enabled() and not adapter._answered:
        raise OOMBConfigError(
            f"the base model ({name}) was called directly in a training step, before the causal LM — it would run "
            "the whole sequence at once, outside OOMB's chunks, keeping its activations for backward (out of memory "
            "on a long sequence), and OOMB trains only through the causal LM's call — return "
            "`self.model(**batch).loss` (labels default to input_ids; -100 marks positions to ignore); to add a "
            "term from the base model's outputs, call the causal LM first (that call still runs unchunked), or "
            "train with strategy='auto'."
        )
    warnings.warn(
        f"the base model ({name}) was called directly inside a managed step — it runs the whole sequence at once, "
        "outside OOMB's chunks (its activations grow with the sequence) — call the causal LM itself "
        "(`self.model(**batch)`), whose call the engine answers.",
        UserWarning,
        stacklevel=2,
    )
