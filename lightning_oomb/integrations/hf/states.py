"""Hugging Face hybrids: the states of their recurrent, linear-attention and short-convolution layers, carried
across chunks.

transformers' hybrid models let a token mixer continue a sequence through the cache object it is called with
(``get_conv_state`` / ``update_conv_state``, ``get_recurrent_state`` / ``update_recurrent_state``; transformers
5.17: ``has_previous_state`` and ``layers[i].recurrent_states``; 5.25: ``get_recurrent_states_to_keep``) — the path
of a prefill that continues a cached prompt. While the engine runs a chunk, every carried mixer is called with a
:class:`StateCache` over the chunk's :class:`~lightning_oomb.engine.states.ChunkStates` in place of the model's
(absent) cache: it reads the state the previous chunk ended in and reports the state it ends in, and the engine
carries both the states and their gradients (:mod:`lightning_oomb.engine.states`). Attention layers and masks are
untouched.

:data:`CARRIED_MIXERS` names the mixers whose multi-token call continues an incoming state exactly, each checked in
float64 against full-sequence training by the test suite; a stateful layer not named there is refused
(:mod:`lightning_oomb.integrations.hf.support`).
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Callable, Iterator

import torch
import torch.nn.functional as F

from lightning_oomb.engine.errors import OOMBConfigError
from lightning_oomb.engine.model_shape import OUTPUT_PROJECTIONS, Mixer, decoder_of
from lightning_oomb.engine.states import ChunkStates
from lightning_oomb.integrations.hf.selective_scan import SCANS_FROM_ZERO, continuing_scans

# token mixers (class names) that continue an incoming state exactly through their cache (tests/integrations/test_hybrids.py)
CARRIED_MIXERS = frozenset({
    "Qwen3NextGatedDeltaNet",  # Qwen3-Next: gated delta rule + short convolution
    "Qwen3_5GatedDeltaNet",  # Qwen3.5
    "Qwen3_5MoeGatedDeltaNet",  # Qwen3.5-MoE
    "OlmoHybridGatedDeltaNet",  # OLMo-Hybrid
    "Lfm2ShortConv",  # LFM2: gated short convolution
    "Lfm2MoeShortConv",  # LFM2-MoE
    "Lfm3ShortConv",  # LFM3
    "LaraMiniGatedDeltaNet",  # Lara-Mini: gated delta rule + short convolution
    "FalconH1Mixer",  # Falcon-H1: Mamba2 mixer beside attention in every layer
    "BambaMixer",  # Bamba: Mamba2
    "NemotronHMamba2Mixer",  # Nemotron-H: Mamba2
    "GraniteMoeHybridMambaLayer",  # Granite 4 hybrids: Mamba2
    "Mamba2Mixer",  # Mamba2 (pure): no attention layer
    "KimiLinearDeltaAttention",  # Kimi-Linear: delta rule with per-channel decay + short convolution
    "BailingHybridDeltaAttention",  # Ling/Ring hybrids (Bailing): Kimi's delta rule
    "ZayaCCAProjection",  # ZAYA: a causal convolution over q/k and a one-token delay of half of v, before attention
    *SCANS_FROM_ZERO,  # Mamba-1 (Mamba, Falcon-Mamba, Jamba): their scan continued by selective_scan
})  # fmt: skip


class _Slots:
    """``cache.layers[i].conv_states`` / ``.recurrent_states`` as transformers 5.17 reads them."""

    def __init__(self, cache: StateCache, layer: int, kind: str) -> None:
        self._cache, self._layer, self._kind = cache, layer, kind

    def __getitem__(self, index: int) -> torch.Tensor | None:
        return self._cache._incoming(self._layer, self._kind, index)


class _Layer:
    """``cache.layers[i]`` as transformers 5.17 reads it; ``record_past`` keeps mixers on the multi-token path."""

    record_past = True

    def __init__(self, cache: StateCache, layer: int) -> None:
        self.conv_states = _Slots(cache, layer, "conv")
        self.recurrent_states = _Slots(cache, layer, "recurrent")


class _Layers:
    def __init__(self, cache: StateCache) -> None:
        self._cache = cache

    def __getitem__(self, layer: int) -> _Layer:
        return _Layer(self._cache, layer)


class StateCache:
    """What a carried mixer gets as its ``cache``: the chunk's incoming states (a fresh copy per read, so a mixer
    that updates a state in place never touches the stored one) and the report of its outgoing states.

    ``is_recording_past`` answers ``True`` so that a mixer never takes its single-token decoding kernel (an
    in-place update without a backward); the engine pads a one-token last chunk for the same reason.
    """

    def __init__(self, states: ChunkStates) -> None:
        self._states = states

    @property
    def layers(self) -> _Layers:
        """``cache.layers[i]`` (transformers 5.17); made per access: no reference cycle keeps a chunk's states."""
        return _Layers(self)

    def _incoming(self, layer: int, kind: str, index: int) -> torch.Tensor | None:
        state = self._states.incoming((layer, kind, index))
        return None if state is None else state.clone()

    def has_previous_state(self, layer_idx: int | None = None, state_idx: int | None = None) -> bool:
        return self._states.continues

    def is_recording_past(self, layer_idx: int) -> bool:
        return True

    def get_recurrent_states_to_keep(self, layer_idx: int | None = None) -> int:
        """No per-token states (transformers >= 5.25 asks, for speculative decoding): the chunk's last one only."""
        return 0

    def get_conv_state(self, layer_idx: int, state_idx: int = 0) -> torch.Tensor | None:
        return self._incoming(layer_idx, "conv", state_idx)

    def get_recurrent_state(self, layer_idx: int, state_idx: int = 0) -> torch.Tensor | None:
        return self._incoming(layer_idx, "recurrent", state_idx)

    def update_conv_state(
        self, conv_states: torch.Tensor, layer_idx: int, state_idx: int = 0, conv_kernel_size=None, **kwargs
    ) -> torch.Tensor:
        """The chunk's convolution input with the previous chunk's last columns in front (what the causal
        convolution reads); reports its last ``conv_kernel_size`` columns as the outgoing state."""
        previous = self._incoming(layer_idx, "conv", state_idx)
        width = conv_kernel_size or (previous if previous is not None else conv_states).shape[-1]
        full = conv_states if previous is None else torch.cat([previous, conv_states.to(previous.dtype)], -1)
        if full.shape[-1] < width:  # a first chunk shorter than the kernel: zeros before the sequence
            full = F.pad(full, (width - full.shape[-1], 0))
        # a copy: a view would keep the whole chunk's convolution input alive as long as the state
        self._states.outgoing((layer_idx, "conv", state_idx), full[..., -width:].clone())
        return full

    def update_recurrent_state(
        self, recurrent_states: torch.Tensor, layer_idx: int, state_idx: int = 0, **kwargs
    ) -> torch.Tensor:
        self._states.outgoing((layer_idx, "recurrent", state_idx), recurrent_states)
        return recurrent_states


DELTA_BLOCK = (
    64  # the block of transformers' torch gated delta rule (torch_chunk_gated_delta_rule's chunk_size)
)


def mixer_shape(module: torch.nn.Module) -> Mixer:
    """The :class:`~lightning_oomb.engine.model_shape.Mixer` of a carried mixer: a gated delta-net (``num_v_heads``;
    Kimi-Linear's, with a ``forget_gate``), a
    Mamba-1 mixer (:data:`SCANS_FROM_ZERO`), a Mamba2 mixer (``ssm_state_size``) or a short convolution; its
    ``nn.Linear`` weights counted."""
    conv = next(m for m in module.modules() if isinstance(m, torch.nn.Conv1d))
    gated = any(type(m).__name__.endswith("RMSNormGated") for m in module.children())
    # ZAYA's two convolutions in a row keep conv_kernel_size columns between chunks
    kernel = getattr(module, "conv_kernel_size", conv.kernel_size[0])
    delayed = module.v_proj_delayed.out_features if hasattr(module, "v_proj_delayed") else 0  # ZAYA's values
    linears = [(n.rsplit(".", 1)[-1], m) for n, m in module.named_modules() if isinstance(m, torch.nn.Linear)]
    # the projections reading the mixer's input: as wide as its output projection's output
    hidden = next((m.out_features for n, m in linears if n in OUTPUT_PROJECTIONS), None)
    readers = sum(m.in_features == hidden and n not in OUTPUT_PROJECTIONS for n, m in linears)
    common = {"channels": conv.in_channels, "kernel": kernel, "gated_norm": gated, "delayed": delayed,
              "linear_weights": sum(m.weight.numel() for _, m in linears), "readers": readers}  # fmt: skip
    if hasattr(module, "num_v_heads"):
        return Mixer("delta", heads=module.num_v_heads, head_dim=module.head_v_dim, state=module.head_k_dim,
                     block=DELTA_BLOCK, **common)  # fmt: skip
    if hasattr(module, "forget_gate"):  # Kimi-Linear's delta rule: keys and values of head_dim per head
        return Mixer("kda", heads=module.num_heads, head_dim=module.head_dim, state=module.head_dim,
                     block=DELTA_BLOCK, **common)  # fmt: skip
    if type(module).__name__ in SCANS_FROM_ZERO:  # Mamba-1: a state of ssm_state_size per channel
        return Mixer(
            "mamba", heads=module.intermediate_size, head_dim=1, state=module.ssm_state_size, **common
        )
    if hasattr(module, "ssm_state_size"):  # (Falcon-H1's projection scaled by its mup_vector)
        scaled = isinstance(getattr(module, "mup_vector", None), torch.Tensor)
        return Mixer("mamba2", heads=module.num_heads, head_dim=module.head_dim, state=module.ssm_state_size,
                     block=module.chunk_size, scaled_projection=scaled, **common)  # fmt: skip
    return Mixer("conv", **common)


def state_elements(mixers: list[torch.nn.Module]) -> tuple[int, int]:
    """Elements of one batch row's carried states at one chunk boundary: ``(convolution, recurrent)`` — each
    mixer's causal convolution keeps ``channels x kernel`` inputs (in the activations' dtype; ZAYA's projection also
    the last token's delayed half of the values), a gated delta-net ``value heads x key dim x value dim``, a Mamba2
    mixer ``heads x head dim x state size``, a Mamba-1 mixer ``channels x state size`` (float32, as their rules
    compute)."""
    shapes = [mixer_shape(m) for m in mixers]
    conv = sum(m.channels * m.kernel + m.delayed for m in shapes)
    return conv, sum(m.heads * m.head_dim * m.state for m in shapes)


def float32_recurrences(model: torch.nn.Module) -> bool:
    """Whether a carried mixer of ``model`` runs a recurrence (gated delta rule, Mamba2 scan): transformers computes
    those in float32 whatever the model's dtype, so their chunkings differ by float32 rounding even in float64."""
    return any(mixer_shape(m).kind != "conv" for m in carried_mixers(model))


def carried_mixers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The decoder's token mixers named in :data:`CARRIED_MIXERS`."""
    return [m for m in decoder_of(model).modules() if type(m).__name__ in CARRIED_MIXERS]


# a module's cache argument, by transformers version
CACHE_NAMES = ("cache", "cache_params", "past_key_values")


def _cache_parameter(mixer: torch.nn.Module) -> tuple[str, int]:
    """The name and positional index (after ``self``) of the module's cache argument."""
    names = list(inspect.signature(inspect.unwrap(type(mixer).forward)).parameters)[1:]
    for name in CACHE_NAMES:
        if name in names:
            return name, names.index(name)
    raise OOMBConfigError(
        f"{type(mixer).__name__}.forward takes no cache argument, so OOMB cannot hand it what the chunks before "
        "it left — this transformers version is not supported for this model — use transformers >= 5.17."
    )


@contextlib.contextmanager
def carrying_states(mixers: list[torch.nn.Module], current: Callable[[], ChunkStates]) -> Iterator[None]:
    """While the block runs, each mixer is called with a :class:`StateCache` over ``current()`` (the running
    chunk's states) as its cache."""

    def make(module: torch.nn.Module) -> StateCache:
        cache = StateCache(current())
        if type(module).__name__ in SCANS_FROM_ZERO:
            arm(module, cache.get_recurrent_state(module.layer_idx))
        return cache

    with continuing_scans(mixers) as arm, passing_cache(mixers, make):
        yield


@contextlib.contextmanager
def passing_cache(
    modules: list[torch.nn.Module], make: Callable[[torch.nn.Module], object]
) -> Iterator[None]:
    """While the block runs, each module is called with ``make(module)`` as its cache argument (whichever of
    ``cache``, ``cache_params``, ``past_key_values`` it takes, positional or keyword)."""

    def hook(module, args, kwargs):
        name, index = parameters[module]
        cache = make(module)
        if len(args) > index:
            args = (*args[:index], cache, *args[index + 1 :])
        else:
            for alias in CACHE_NAMES:
                kwargs.pop(alias, None)
            kwargs[name] = cache
        return args, kwargs

    parameters = {m: _cache_parameter(m) for m in modules}
    handles = [m.register_forward_pre_hook(hook, with_kwargs=True) for m in modules]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()
