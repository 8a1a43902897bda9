"""What the memory planner needs of a model (:class:`ModelShape`), read off a transformers config, a module that holds
one, a ChunkModel adapter around one, or any ChunkModel ``nn.Module`` (:func:`model_shape`)."""

from __future__ import annotations

import copy
import dataclasses
from collections import Counter
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from lightning_oomb.engine.errors import OOMBConfigError
from lightning_oomb.engine.grads import HALF_DTYPES
from lightning_oomb.engine.user_hooks import gradient_hooks

# families whose activations the formula was checked on, against what autograd saves in CPU steps (within 10 %:
# tests/engine/test_planner.py, test_planner_hybrids.py, test_planner_families.py)
CALIBRATED = ("llama", "qwen2", "qwen3", "mistral", "qwen3_moe", "gemma2", "gemma3", "gemma3_text", "gpt_oss",
              "afmoe", "jamba", "lfm2_moe", "llama4", "llama4_text", "qwen3_next", "kimi_linear", "bamba",
              "falcon_h1", "lfm2", "nemotron_h", "lfm3", "lara_mini", "bailing_hybrid", "cohere",
              "hunyuan_v1_dense", "apertus", "arcee", "nemotron", "stablelm", "gemma4_text",
              "ernie4_5", "deepseek_v3", "deepseek_v2", "glm4_moe_lite", "minicpm3")  # fmt: skip
NORM_BYTES = 4  # HF's RMSNorm computes in float32 whatever the model's dtype
# model types whose decoder layers norm the attention's and the MLP's outputs too (4 hidden-wide norms a layer)
SANDWICH_NORMS = ("gemma2", "gemma3", "gemma3_text", "afmoe", "lfm3")
# model types (prefixes) whose RMSNorms keep their normed input in float32 (multiplied by the weight before the
# cast back), as transformers' modules show it (:func:`float32_norms`): Gemma's ``x * (1 + w)`` and the like
FLOAT32_NORM_TYPES = ("gemma", "vaultgemma", "recurrent_gemma", "qwen3_next", "qwen3_5", "gpt_oss", "afmoe", "olmo2",
                      "olmo3", "flex_olmo", "helium", "nemotron_h", "lara_mini", "cohere")  # fmt: skip
# model types whose embeddings are biased and scaled into a float32 residual stream, each layer handing the next its
# router's states (``router_hidden_size`` per token) beside it
SCALED_EMBEDDINGS = ("zaya",)
# model types whose decoder layers run attention and the MLP side by side on one norm's output (a LayerNorm that
# saves its centred input twice)
PARALLEL_BLOCKS = ("cohere", "cohere2")
# model types whose RoPE multiplies by one complex64 table (ModelShape.complex_rope)
COMPLEX_ROPE = ("deepseek_v2",)
# latent attention model types whose MoE router computes in float32 (ModelShape.float32_router)
FLOAT32_ROUTERS = ("deepseek_v2", "deepseek_v3", "glm4_moe_lite", "longcat_flash", "axk1", "kimi_linear")
# model types whose queries' and keys' norms read them after RoPE (ModelShape.rotated_qk_norms)
ROTATED_QK_NORMS = ("hunyuan",)
# model types whose layers each make float32 copies of the RoPE tables (ModelShape.layer_rope)
LAYER_ROPE = ("ernie4_5",)
# model types whose attention output is gated by the sigmoid of a projection of the layer's input
GATED_ATTENTION = ("afmoe",)
# config fields of the experts a token is routed to
EXPERTS_PER_TOKEN = ("num_experts_per_tok", "num_experts_per_token", "moe_k")
# config fields of the number of shared experts (each as wide as a routed one)
SHARED_EXPERTS = ("n_shared_experts", "num_shared_experts", "moe_num_shared_experts")
# names of attention's norms of its queries (Llama 4's of both; LFM2's q_layernorm; HunYuan's query_layernorm)
QK_NORMS = ("q_norm", "qk_norm", "q_layernorm", "query_layernorm")
# names of a decoder layer's MLP child (Llama's, LFM2's and Jamba's, others')
MLP_NAMES = ("mlp", "feed_forward", "ffn")
# names of attention's and an MLP's output projections (which read no norm)
OUTPUT_PROJECTIONS = (
    "o_proj",
    "out_proj",
    "dense",
    "wo",
    "c_proj",
    "down_proj",
    "w2",
    "fc2",
    "dense_4h_to_h",
)
# model types whose routed experts add biases to their projections (their [experts, width] bias parameters)
EXPERT_BIASES = ("gpt_oss",)
# config fields of the number of routed experts
EXPERT_COUNTS = ("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts")
# config fields of the width of an MoE layer's shared experts
SHARED_WIDTHS = (
    "shared_expert_intermediate_size",
    "shared_intermediate_size",
    "moe_shared_expert_intermediate_size",
)


@dataclass(frozen=True)
class Mixer:
    """One carried token mixer of a hybrid (:func:`~lightning_oomb.engine.activation_bytes.mixer_bytes`): ``kind``
    ``"delta"`` (gated delta-net), ``"kda"`` (Kimi-Linear's delta rule, its decay per key channel), ``"mamba2"``,
    ``"mamba"`` (Mamba-1: ``heads`` its channels, ``head_dim`` 1) or ``"conv"`` (gated short convolution); ``channels`` and ``kernel`` of its causal convolution;
    ``heads`` x ``head_dim``: the values its rule mixes (a delta-net's value heads, Mamba2's heads); ``state``: a
    delta-net's key head dim, Mamba2's state size; ``block``: the rule's block (a delta rule's 64, Mamba2's
    ``chunk_size``); ``gated_norm``: a gated RMSNorm on its output (else Falcon-H1's plain gate); ``delayed``:
    elements of its input it hands to the next token besides the convolution's (ZAYA's delayed half values);
    ``scaled_projection``: its input projection is scaled by a buffer of the model's dtype (Falcon-H1's
    ``mup_vector``), so under autocast it stays in that dtype; ``linear_weights``: elements of its ``nn.Linear``
    weights (its projections: each saved once more as a cast copy under autocast; 0: not known); ``readers``: its
    projections reading its input (under autocast each saves its own cast copy of it; 0: not known, one)."""

    kind: str
    channels: int
    kernel: int
    heads: int = 0
    head_dim: int = 0
    state: int = 0
    block: int = 1
    gated_norm: bool = False
    delayed: int = 0
    scaled_projection: bool = False
    linear_weights: int = 0
    readers: int = 0


@dataclass(frozen=True)
class ModelShape:
    """What the planner needs of a model. ``params`` / ``trainable``: parameter counts (``None``: from the
    Llama-style formula); ``weight_bytes`` / ``grad_bytes``: exact bytes when a module was read (else counts x the
    precision's dtype); ``largest_param``: elements of the largest parameter; ``head_trainable`` /
    ``embedding_trainable``: whether the LM head / input embedding get gradients (not under LoRA); ``half_trainable``:
    trainable elements in a 16-bit dtype (``None``: all trainable ones when the precision's parameters are 16-bit),
    ``half_vectors`` those of them in 1-D parameters (``None``: :meth:`vector_params`);
    ``mlp_width``: MLP width a token passes through (``experts_per_token x`` the expert width for MoE, plus
    ``shared_width``: its shared experts');
    ``moe_layers``: the MLPs that route to experts (``None``: all, with ``num_experts``; Jamba's every other,
    DeepSeek's after the first dense ones), the others dense, ``dense_width`` wide (0: ``intermediate_size``);
    ``layer_norms``: hidden-wide norms per decoder layer (Gemma 2/3, AFMoE: 4, the attention's and the MLP's
    outputs normed too); ``gated_attention``: the attention output is multiplied by a sigmoid gate (AFMoE);
    ``clamped_experts``: the experts' GLU clamps its inputs (GPT-OSS's, ``swiglu_limit``: it saves more);
    ``dense_experts``: every token passes through every expert, weighted 0 where not routed (Llama 4's transformers
    implementation: ``num_experts`` times a routed expert's memory and FLOPs);
    ``logit_softcap``: the head soft-caps its logits (Gemma 2/3); ``attention_softcap``: attention soft-caps its
    scores (Gemma 2); ``eager_experts``: MoE experts run in a Python loop (transformers' ``"eager"`` experts
    implementation; the default ``grouped_mm`` holds less in its backward). A hybrid (recurrent / convolution
    layers beside attention): ``kv_layers``, the layers that have KV pages (``None``: all), and per batch row, the elements of the
    states carried at each chunk boundary — ``conv_state_elements`` (in the compute dtype: a mixer's input projection
    makes them, under autocast in the autocast dtype) and
    ``recurrent_state_elements`` (float32, as the recurrences compute them), and its ``mixers`` (one per layer that
    has one: :class:`Mixer`). ``adapters``: trainable LoRA adapters (peft) as ``(in_features, rank, itemsize,
    count)``; ``frozen_layers``: the decoder's own weights get no gradients (LoRA). ``windows``: each paged layer's
    sliding window (``None`` in it: full attention; ``None``: every layer full), so window layers keep only their
    tails. ``mlp_layers``: the layers' MLPs (``None``: one per layer; a ChunkModel: those its modules show,
    :func:`_shape_of_chunk_model`); ``linear_weights``: elements of the decoder's ``nn.Linear`` weights, each saved once more
    as a compute-dtype copy under autocast (``None``: the Llama-style layers'); ``unsized_states``: the model
    carries states but does not say their size (not counted); ``head_grad_hooked``: a user's gradient hook on the LM
    head's weight (the tied embedding's), so the loss hands autograd a new ``[V, H]`` gradient per chunk;
    ``float32_norms``: its RMSNorms keep their normed input in float32 (torch's ``nn.RMSNorm``, Gemma's, which cast
    only their result; Llama's casts it back to the activations' dtype first: :func:`float32_norms`);
    ``float32_residual``: the residual stream is float32 from the first layer's output on (Mamba's
    ``residual_in_fp32``), as are the later layers' inputs, the final norm's and the loss's hidden states;
    ``centered_norms``: its norms subtract the mean and save the centred input twice (Cohere's LayerNorm: a float32
    hidden-wide tensor more than an RMSNorm); ``layer_norms`` 1: one norm a layer, read by its attention and MLP
    alike (Cohere's parallel block); ``per_layer_inputs``: the width of each layer's own input beside the hidden
    states (Gemma 4's ``hidden_size_per_layer_input``; 0: none), made for all layers before the first — the
    embeddings projected, normed (its float32 input and output saved) and added to per-layer embeddings (the sum
    saved); ``scaled_embeddings``: the embeddings are biased and scaled into a float32 residual stream before the
    first layer (ZAYA's): the scale's input saved, every layer's input float32; ``layer_carry``: elements per token
    each layer but the first takes from the one before besides the hidden states (ZAYA's router states: a
    checkpointed layer's input too; its router, a norm and an MLP of that width, saves what
    ``activation_bytes.router_mlp_bytes`` counts); ``scaled_residuals``: sums a layer makes of its biased and scaled
    output and residual stream (ZAYA's two, each saving both biased inputs); ``l2_qk_norms``: the QK norms divide by
    each head's L2 norm and scale the keys (ZAYA's, no float32 copy); ``ungated_mlp``: the dense MLPs have no gate, and their activation saves
    ``(width-wide tensors, bytes per element beside them)`` (:func:`ungated_mlp`; ``None``: gated);
    ``native_norms``: its norms are torch's fused LayerNorm, which saves its input as it is (:func:`native_norms`);
    ``norm_readers``: the projections reading the attention's, a dense MLP's and an MoE layer's input norms (each
    saves its own cast copy under autocast; ``None`` or 0: q, k, v (and a gate), gate and up, gate and up — Phi-3's
    fused ``qkv_proj`` and ``gate_up_proj``: one each; an MoE layer of ``uncast_experts``: its router's and shared
    experts'); ``uncast_experts``: the routed experts run transformers' ``grouped_mm`` (its default), which autocast
    casts on no device (``aten::_grouped_mm`` has no autocast kernel; transformers casts the input to the weights'
    dtype): under ``*-mixed`` they compute in the weights' dtype and their weights get no cast copies;
    ``expert_biases``: the routed experts add biases to their projections (GPT-OSS's ``gate_up_proj_bias``: float32
    under autocast, so are the sums); ``layer_head_dims``: each paged layer's own head dim where they differ (Gemma 4's
    global layers' wider heads; ``None``: all ``head_dim``) — its projections, norms and o_proj input are that wide,
    the op's saved queries and output ``head_dim`` wide (narrower heads zero-padded to the pages');
    ``value_norm``: attention norms its values without a weight (Gemma 4's ``v_norm``: their float32 copy saved);
    ``rotated_qk_norms``: the queries' and keys' norms read them after RoPE (HunYuan's), whose float32 tables promote
    them under autocast: their normed input in the activations' dtype; ``layer_rope``: each layer makes its own
    float32 copies of the RoPE tables (ERNIE 4.5's interleaved ones), the shared ones not saved; ``head_gate``:
    attention's output is gated per head (LFM3's ``g_proj``: a sigmoid per head, the output copied to be gated);
    ``rope_tables``: RoPE tables the layers share (one per attention layer type with its own RoPE parameters: LFM3's,
    Gemma 3's); ``qk_norm_layers``: the paged layers whose attention norms q and k (``None``: all, with
    ``qk_norm``; Llama 4's RoPE layers), ``weightless_qk_norms``: those norms have no weight (Llama 4's L2 norm:
    no normed input saved); ``latent_width``: multi-head latent attention's latent, ``kv_lora_rank +
    qk_rope_head_dim`` (0: none), the one KV head its layers attend over under ``mla_pages="latent"``
    (:meth:`attending`); its layers' own widths (0 without latent attention): ``q_lora_rank`` (the queries'
    low-rank projection and norm, ``q_a_proj`` / ``q_a_layernorm``; 0: one ``q_proj``), ``qk_nope_head_dim`` and
    ``qk_rope_head_dim`` (a query head's columns without and with RoPE; the keys' rotated part, one head shared),
    ``v_head_dim`` (a value head's: ``o_proj`` reads ``num_heads x v_head_dim``); ``complex_rope``: RoPE
    multiplies by one complex64 table (DeepSeek-V2's ``freqs_cis``), not a cos and a sin table; ``float32_router``:
    the MoE router casts its input to float32 (DeepSeek's: a copy saved where the activations are not float32 and
    autocast does not cast it back)."""

    num_layers: int
    hidden_size: int
    intermediate_size: int
    num_heads: int
    kv_heads: int
    head_dim: int
    vocab_size: int
    num_embeddings: int
    tied_embeddings: bool = False
    qk_norm: bool = False
    qkv_bias: bool = False
    family: str = "llama"
    num_experts: int = 0
    experts_per_token: int = 0
    shared_width: int = 0
    params: int | None = None
    trainable: int | None = None
    weight_bytes: int | None = None
    grad_bytes: int | None = None
    largest_param: int | None = None
    head_trainable: bool = True
    embedding_trainable: bool = True
    logit_softcap: bool = False
    attention_softcap: bool = False
    eager_experts: bool = False
    half_trainable: int | None = None
    half_vectors: int | None = None
    kv_layers: int | None = None
    conv_state_elements: int = 0
    recurrent_state_elements: int = 0
    mixers: tuple[Mixer, ...] = ()
    adapters: tuple[tuple[int, int, int, int], ...] = ()
    frozen_layers: bool = False
    windows: tuple[int | None, ...] | None = None
    mlp_layers: int | None = None
    linear_weights: int | None = None
    unsized_states: bool = False
    head_grad_hooked: bool = False
    float32_norms: bool = False
    moe_layers: int | None = None
    dense_width: int = 0
    layer_norms: int = 2
    gated_attention: bool = False
    clamped_experts: bool = False
    dense_experts: bool = False
    float32_residual: bool = False
    centered_norms: bool = False
    per_layer_inputs: int = 0
    ungated_mlp: tuple[int, int] | None = None
    native_norms: bool = False
    scaled_embeddings: bool = False
    layer_carry: int = 0
    scaled_residuals: int = 0
    l2_qk_norms: bool = False
    norm_readers: tuple[int, int, int] | None = None
    uncast_experts: bool = False
    expert_biases: bool = False
    layer_head_dims: tuple[int, ...] | None = None
    layer_kv_heads: tuple[int, ...] | None = None
    layer_kv_sources: tuple[int | None, ...] | None = None
    value_norm: bool = False
    rotated_qk_norms: bool = False
    layer_rope: bool = False
    head_gate: bool = False
    rope_tables: int = 1
    qk_norm_layers: int | None = None
    weightless_qk_norms: bool = False
    latent_width: int = 0
    q_lora_rank: int = 0
    qk_nope_head_dim: int = 0
    qk_rope_head_dim: int = 0
    v_head_dim: int = 0
    complex_rope: bool = False
    float32_router: bool = False

    @property
    def kv_lora_rank(self) -> int:
        """Latent attention's latent without its rotated key part (``kv_b_proj``'s input; 0 without)."""
        return self.latent_width - self.qk_rope_head_dim if self.latent_width else 0

    def attending(self, mla_pages: str) -> ModelShape:
        """The shape the attention op sees: under ``mla_pages="latent"`` a latent attention model's one KV head of
        :attr:`latent_width` — its pages, and its op's queries and output that wide — else this one."""
        if mla_pages != "latent" or not self.latent_width:
            return self
        return dataclasses.replace(
            self, kv_heads=1, head_dim=self.latent_width, layer_head_dims=None, layer_kv_heads=None
        )

    @property
    def own_head_dims(self) -> tuple[int, ...]:
        """Each paged layer's own head dim (``layer_head_dims``; ``head_dim`` for all when it is not given, or not
        one per paged layer)."""
        dims = self.layer_head_dims
        if dims is None or len(dims) != self.paged_layers:
            return (self.head_dim,) * self.paged_layers
        return dims

    @property
    def own_kv_heads(self) -> tuple[int, ...]:
        """Each paged layer's own KV heads (``layer_kv_heads``; ``kv_heads`` for all when it is not given, or not one
        per paged layer)."""
        heads = self.layer_kv_heads
        if heads is None or len(heads) != self.paged_layers:
            return (self.kv_heads,) * self.paged_layers
        return heads

    @property
    def own_kv_sources(self) -> tuple[int | None, ...] | None:
        """Each paged layer's source of K/V (``layer_kv_sources``), or ``None`` (not given, or not one per paged
        layer: every layer keeps its own pages)."""
        sources = self.layer_kv_sources
        return sources if sources is not None and len(sources) == self.paged_layers else None

    @property
    def mlps(self) -> int:
        """Layers' MLPs (a ChunkModel's MLP-only blocks included)."""
        return self.num_layers if self.mlp_layers is None else self.mlp_layers

    @property
    def mixing_layers(self) -> int:
        """Layers with a token mixer — attention, or a hybrid's carried mixer (whose projections the FLOP model
        counts as attention's) — all but a ChunkModel's MLP-only blocks."""
        if self.mixers:
            return min(self.num_layers, self.paged_layers + len(self.mixers))
        carries = self.conv_state_elements or self.recurrent_state_elements or self.unsized_states
        return self.num_layers if carries else min(self.paged_layers, self.num_layers)

    @property
    def mlp_width(self) -> int:
        """MLP width a token passes through (in an MoE layer: its routed and shared experts')."""
        return self.intermediate_size * (self.routed_per_token or 1) + self.shared_width

    @property
    def routed_per_token(self) -> int:
        """Experts a token passes through: ``experts_per_token``, every expert with ``dense_experts``."""
        return self.num_experts if self.dense_experts else self.experts_per_token

    @property
    def moe_mlps(self) -> int:
        """MLPs that route to experts (0 without experts)."""
        if not self.num_experts:
            return 0
        return self.mlps if self.moe_layers is None else min(self.moe_layers, self.mlps)

    @property
    def dense_mlp_width(self) -> int:
        """Width of the dense MLPs (an MoE model's layers without experts)."""
        return self.dense_width or self.intermediate_size

    @property
    def mean_mlp_width(self) -> float:
        """MLP width a token passes through, averaged over the MLPs (dense and MoE)."""
        dense = self.mlps - self.moe_mlps
        return (self.moe_mlps * self.mlp_width + dense * self.dense_mlp_width) / max(self.mlps, 1)

    @property
    def attention_params(self) -> int:
        """Elements of the widest decoder layer's q, k, v and o projection weights (and its output gate's)."""
        return self.attention_params_of(self.head_dim)

    def attention_params_of(self, head_dim: int, kv_heads: int | None = None) -> int:
        """Elements of q, k, v and o projection weights (and an output gate's) of a layer of heads ``head_dim``
        (and ``kv_heads`` KV heads; default ``self.kv_heads``); a latent attention layer's (whatever the pages'
        heads): ``q_a_proj`` and ``q_b_proj`` (or ``q_proj``), ``kv_a_proj_with_mqa``, ``kv_b_proj`` and ``o_proj``."""
        if self.latent_width:
            h, heads, rank = self.hidden_size, self.num_heads, self.q_lora_rank
            queries = heads * (self.qk_nope_head_dim + self.qk_rope_head_dim)
            q = (h + queries) * rank if rank else h * queries
            kv = h * self.latent_width + self.kv_lora_rank * heads * (self.qk_nope_head_dim + self.v_head_dim)
            return q + kv + heads * self.v_head_dim * h
        q, kv = self.num_heads * head_dim, (kv_heads or self.kv_heads) * head_dim
        gate = self.hidden_size * self.num_heads * self.head_gate
        return (2 + self.gated_attention) * self.hidden_size * q + 2 * self.hidden_size * kv + gate

    @property
    def mlp_params(self) -> int:
        """Elements of one MLP's weights (an MoE layer's: every expert's and its shared experts')."""
        if not self.num_experts:
            return 3 * self.hidden_size * self.intermediate_size
        return 3 * self.hidden_size * (self.intermediate_size * self.num_experts + self.shared_width)

    @property
    def expert_loop(self) -> bool:
        """Whether the routed experts run transformers' ``"eager"`` loop: one expert at a time, each indexing its
        slice of the ``[experts, ...]`` weights (``eager_experts``; not Llama 4's batched experts)."""
        return bool(self.num_experts) and self.eager_experts and not self.dense_experts

    @property
    def uncast_expert_params(self) -> int:
        """Elements of one MoE layer's routed experts' weights that autocast does not cast (``uncast_experts``)."""
        return 3 * self.hidden_size * self.intermediate_size * self.num_experts if self.uncast_experts else 0

    @property
    def linear_params(self) -> int:
        """Elements of the decoder's projection weights: every layer's attention, its MLPs (MoE and dense)."""
        dense = (self.mlps - self.moe_mlps) * 3 * self.hidden_size * self.dense_mlp_width
        experts = self.moe_mlps * self.mlp_params if self.num_experts else 0
        own = self.own_head_dims  # (the layers without pages: a hybrid's, counted as the widest)
        attention = (
            sum(map(self.attention_params_of, own, self.own_kv_heads))
            + (self.num_layers - len(own)) * self.attention_params
        )
        return attention + experts + dense

    def parameter_count(self) -> int:
        """Parameters of a Llama-style causal LM of this shape (exact for Llama, Qwen2/3, Mistral)."""
        if self.params is not None:
            return self.params
        h, q, kv = self.hidden_size, self.num_heads * self.head_dim, self.kv_heads * self.head_dim
        layer = self.layer_norms * h + (q + 2 * kv if self.qkv_bias else 0)
        layer += 2 * self.head_dim if self.qk_norm else 0
        layer += self.q_lora_rank + self.kv_lora_rank  # (latent attention's own norms)
        routers = self.moe_mlps * h * self.num_experts
        head = 0 if self.tied_embeddings else self.vocab_size * h
        return self.num_embeddings * h + self.num_layers * layer + self.linear_params + routers + h + head

    def vector_params(self) -> int:
        """Elements of the 1-D parameters (norm weights, biases) of a Llama-style causal LM of this shape."""
        q, kv = self.num_heads * self.head_dim, self.kv_heads * self.head_dim
        layer = (
            self.layer_norms * self.hidden_size
            + (q + 2 * kv if self.qkv_bias else 0)
            + (2 * self.head_dim if self.qk_norm else 0)
            + self.q_lora_rank
            + self.kv_lora_rank
        )
        return self.num_layers * layer + self.hidden_size

    @property
    def calibrated(self) -> bool:
        """Whether the layers' activations are counted by a formula checked on the family (:data:`CALIBRATED`),
        or a model of carried mixers only (pure Mamba2, Mamba-1: their mixers' formula, fitted to CPU steps)."""
        all_mixers = bool(self.mixers) and self.paged_layers == 0 and self.mlps == 0
        return self.family in CALIBRATED or all_mixers

    @property
    def paged_layers(self) -> int:
        """Layers with KV pages (a hybrid's attention layers)."""
        return self.num_layers if self.kv_layers is None else self.kv_layers

    def stream_dtype(self, activation: torch.dtype) -> torch.dtype:
        """The residual stream's dtype after the first layer: float32 at least with ``float32_residual``."""
        return torch.float32 if self.float32_residual and activation.itemsize < 4 else activation

    def norm_bytes(self, activation: torch.dtype) -> int:
        """Bytes per token a hidden-wide norm saves on an input of ``activation`` (:meth:`norm_tensors`)."""
        return sum(self.norm_tensors(activation))

    def norm_tensors(self, activation: torch.dtype) -> list[int]:
        """Bytes per token of each tensor a hidden-wide norm saves on an input of ``activation``: an RMSNorm its
        float32 input (``centered_norms``: the centred input, twice), 1/rms and normed input; torch's fused LayerNorm
        (``native_norms``) its input as it is, a mean and 1/std."""
        if self.native_norms:
            return [activation.itemsize * self.hidden_size, NORM_BYTES, NORM_BYTES]
        inputs = [NORM_BYTES * self.hidden_size] * (1 + self.centered_norms)
        return [*inputs, NORM_BYTES, self.normed_bytes(activation)]

    def normed_bytes(self, activation: torch.dtype) -> int:
        """Bytes per token of an RMSNorm's normed input, saved for its weight's gradient (none when frozen)."""
        if self.frozen_layers:
            return 0
        return (NORM_BYTES if self.float32_norms else activation.itemsize) * self.hidden_size

    def carried_state_bytes(self, compute: torch.dtype) -> int:
        """One batch row's carried states at one chunk boundary (0 without recurrent / convolution layers): the
        convolution states in the ``compute`` dtype (what the engine keeps is what the model reported: a projection's
        output, under autocast in the autocast dtype), the recurrent ones in float32."""
        return self.conv_state_elements * compute.itemsize + self.recurrent_state_elements * 4


# how an integration adapts a model of its kind for the engine (the Hugging Face adapter: registered by
# ``lightning_oomb.integrations.hf``; the engine imports no integration): a model, or the model a config builds, is
# read through its adapter — a hybrid's attention layers and carried states, windows, KV heads — as the strategies'
# plans read it; a reader returns ``None`` for a model it does not adapt
ADAPTER_READERS: list[Callable[[torch.nn.Module], Any]] = []


def model_shape(model: Any, *, adapted: bool = True) -> ModelShape:
    """The :class:`ModelShape` of ``model``: a :class:`ModelShape`, a transformers config (a multimodal one's
    decoder config; or a ``{"model_type": ...}``-style dict of its fields: read as the model it builds shows it,
    :func:`_with_built_model`), an ``nn.Module`` holding one (its parameters are counted exactly), a ChunkModel
    adapter around one, or any ChunkModel ``nn.Module`` (its parameters counted exactly, its MLPs, widths and head
    count read off its modules, its carried states as it declares them: :func:`_shape_of_chunk_model`). A model
    (built or from a config) is read through its adapter where an :data:`ADAPTER_READERS` entry makes one
    (``adapted``)."""
    if isinstance(model, ModelShape):
        return model
    if isinstance(model, Mapping):
        return _with_built_model(_shape_of_config(_AttrDict(model)), model)
    config = _text_config(getattr(model, "config", None))
    model = _text_config(model)
    if isinstance(model, torch.nn.Module) and _is_config(config):
        shape = _with_parameters(_with_layers(_shape_of_config(config), model), model)
        return _adapted(shape, model) if adapted else shape
    inner = getattr(model, "model", None)  # e.g. the Hugging Face adapter around a PreTrainedModel
    if not isinstance(model, torch.nn.Module) and isinstance(inner, torch.nn.Module):
        return _with_adapter(model_shape(inner, adapted=False), model)
    if _is_config(model):
        return _with_built_model(_shape_of_config(model), model)
    if isinstance(model, torch.nn.Module) and hasattr(model, "num_layers") and hasattr(model, "lm_head"):
        return _with_parameters(_shape_of_chunk_model(model), model)
    raise OOMBConfigError(
        f"cannot read a model shape from {type(model).__name__} — the planner needs layers, widths, heads and the "
        "vocabulary — pass a transformers config, the model itself, or a lightning_oomb.engine.model_shape.ModelShape."
    )


def _with_built_model(shape: ModelShape, config: Any) -> ModelShape:
    """``shape`` (a config's) as the model the config builds shows it, as a built model's plan reads it: its layers
    (:func:`_with_layers`: ungated MLPs, torch's fused LayerNorms, the projections reading a norm, ...) and its
    parameter counts (their bytes stay the precision's). The model is built on the meta device (nothing allocated;
    its modules' forwards are what a config's fields do not say); ``shape`` as it is where transformers cannot
    build it (a config of no causal LM it knows, or not a transformers config)."""
    try:
        from transformers import AutoConfig, AutoModelForCausalLM

        if isinstance(config, Mapping):
            fields = dict(config)
            config = AutoConfig.for_model(fields.pop("model_type"), **fields)
        config = copy.deepcopy(config)  # (building sets its attention's and experts' implementations)
        with torch.device("meta"):
            module = AutoModelForCausalLM.from_config(config)
    except Exception:  # noqa: BLE001  (the config's fields alone)
        return shape
    counted = _with_parameters(shape, module)
    built = dataclasses.replace(_with_layers(shape, module), params=counted.params, trainable=counted.trainable,
                                largest_param=counted.largest_param)  # fmt: skip
    return _adapted(built, module)


def _adapted(shape: ModelShape, module: torch.nn.Module) -> ModelShape:
    """``shape`` with what ``module``'s adapter declares (:data:`ADAPTER_READERS`, :func:`_with_adapter`), if one
    adapts it."""
    for read in ADAPTER_READERS:
        adapter = read(module)
        if adapter is not None:
            return _with_adapter(shape, adapter)
    return shape


class _AttrDict(dict):
    """A dict of config fields read like a config object."""

    def __getattr__(self, name: str) -> Any:
        try:
            return self[name]
        except KeyError as err:
            raise AttributeError(name, name=name, obj=self) from err


def _is_config_field_error(err: AttributeError) -> bool:
    """Whether ``err`` is a config (or a dict of its fields) lacking a field, not some other object's attribute."""
    return isinstance(err.obj, _AttrDict) or hasattr(err.obj, "to_dict")


def _text_config(obj: Any) -> Any:
    """A multimodal wrapper's decoder config (Gemma 3's text config); anything else as it is."""
    text = getattr(obj, "get_text_config", None)
    return text(decoder=True) if callable(text) and not isinstance(obj, torch.nn.Module) else obj


def _is_config(obj: Any) -> bool:
    return obj is not None and all(hasattr(obj, k) for k in ("num_hidden_layers", "hidden_size"))


def _fields(config: Any) -> dict[str, Any]:
    """A config's fields as a dict (a transformers config's ``to_dict()``, a dict of them, an object's attributes)."""
    if hasattr(config, "to_dict"):
        return config.to_dict()
    return dict(config) if isinstance(config, Mapping) else dict(vars(config))


def paged_head_dim(config: Any) -> int:
    """The head dim of a Hugging Face config's K/V pages: the widest of the keys' (multi-head latent attention's
    ``qk_nope_head_dim + qk_rope_head_dim``, else ``head_dim`` — the widest of a ``per_layer_config``'s, Gemma 4's
    global layers' — else hidden / heads) and the values' (``v_head_dim`` where given); narrower heads are
    zero-padded to it."""
    nope, rope = getattr(config, "qk_nope_head_dim", None), getattr(config, "qk_rope_head_dim", None)
    if isinstance(nope, int) and isinstance(rope, int):
        keys = nope + rope
    else:
        fields = _fields(config)
        layers = (fields.get("per_layer_config") or {}).values()
        dims = [
            d for d in (fields.get("head_dim"), *(c.get("head_dim") for c in layers)) if isinstance(d, int)
        ]
        keys = max(dims) if dims else config.hidden_size // config.num_attention_heads
    return max(keys, getattr(config, "v_head_dim", None) or keys)


def layer_head_dims(config: Any) -> tuple[int, ...] | None:
    """Each layer's own head dim where a config's ``per_layer_config`` makes them differ (Gemma 4's global layers'
    ``global_head_dim`` beside its sliding layers' ``head_dim``), else ``None``."""
    fields = _fields(config)
    layers = fields.get("per_layer_config") or {}
    default = fields.get("head_dim")
    if not layers or not isinstance(default, int):
        return None
    dims = tuple((layers.get(str(i)) or layers.get(i) or {}).get("head_dim", default)
                 for i in range(fields["num_hidden_layers"]))  # fmt: skip
    return dims if len(set(dims)) > 1 else None


def layer_kv_heads(config: Any) -> tuple[int, ...] | None:
    """Each layer's KV heads where a config's ``per_layer_config`` makes them differ (Gemma 4's global layers'
    ``num_global_key_value_heads`` beside its sliding layers' ``num_key_value_heads``), else ``None``."""
    fields = _fields(config)
    layers = fields.get("per_layer_config") or {}
    default = fields.get("num_key_value_heads") or fields.get("num_attention_heads")
    if not layers or not isinstance(default, int):
        return None
    heads = tuple((layers.get(str(i)) or layers.get(i) or {}).get("num_key_value_heads", default)
                  for i in range(fields["num_hidden_layers"]))  # fmt: skip
    return heads if len(set(heads)) > 1 else None


def layer_kv_sources(config: Any) -> tuple[int | None, ...] | None:
    """Each layer's source of K/V where a config's layers share them (Gemma 4's ``num_kv_shared_layers``: each of
    the last layers reuses the K/V of the last earlier layer of its ``layer_types`` entry), else ``None``."""
    fields = _fields(config)
    shared, layers, types = (
        fields.get(k) for k in ("num_kv_shared_layers", "num_hidden_layers", "layer_types")
    )
    if not shared or not isinstance(layers, int) or not types or shared >= layers:
        return None
    first = layers - shared
    last = {kind: i for i, kind in enumerate(types[:first])}  # each type's last layer before the shared ones
    return tuple(None if i < first else last.get(types[i]) for i in range(layers))


def config_kv_heads(cfg: Any) -> int:
    """A config's KV heads (read off its dict: a config whose layers differ in them — ``layer_kv_heads`` — refuses
    the attribute; its own value, the layers' without an override)."""
    return _fields(cfg).get("num_key_value_heads") or cfg.num_attention_heads


def _rope_tables(config: Any) -> int:
    """RoPE tables a config's layers share: one per layer type its ``rope_parameters`` gives its own (LFM3's,
    Gemma 3's full and sliding layers), else one."""
    params = getattr(config, "rope_parameters", None)
    if (
        not isinstance(params, Mapping)
        or not params
        or not all(isinstance(v, Mapping) for v in params.values())
    ):
        return 1
    types = set(getattr(config, "layer_types", None) or params)
    return max(sum(t in types for t in params), 1)


MAMBA1_TYPES = ("mamba", "falcon_mamba")
ATTENTION_FREE = (*MAMBA1_TYPES, "mamba2")  # model types without attention layers


def _shape_of_config(cfg: Any) -> ModelShape:
    """The shape a transformers config (or an :class:`_AttrDict` of its fields) describes; a missing field is
    refused by name."""
    free = (
        getattr(cfg, "model_type", None) in ATTENTION_FREE
        or getattr(cfg, "num_attention_heads", None) is None
    )
    try:
        return _shape_of_attention_free(cfg) if free else _shape_of_attention_config(cfg)
    except AttributeError as err:
        if not _is_config_field_error(err):  # a planner bug, not a missing field: its own traceback
            raise
        field = getattr(err, "name", None) or str(err)
        read = " (read as an attention-free Mamba config: it has no num_attention_heads)" if free else ""
        raise OOMBConfigError(
            f"the model config has no {field!r}{read} — the planner reads the layers, widths, heads and vocabulary "
            "of a complete transformers config — pass one (e.g. AutoConfig.from_pretrained on a local model "
            "directory, or a dict with model_type and that config's fields)."
        ) from err


def _shape_of_attention_config(cfg: Any) -> ModelShape:
    heads = cfg.num_attention_heads
    head_dim = paged_head_dim(cfg)
    experts = _first_field(cfg, EXPERT_COUNTS)
    family = getattr(cfg, "model_type", None) or "llama"
    shared, shared_experts = _first_field(cfg, SHARED_WIDTHS), _first_field(cfg, SHARED_EXPERTS)
    if family.startswith("llama4"):  # one shared expert, as wide as a routed one
        shared_experts = 1
    if not shared and shared_experts:  # DeepSeek's, AFMoE's, ERNIE's: as wide as a routed expert each
        shared = shared_experts * (getattr(cfg, "moe_intermediate_size", None) or cfg.intermediate_size)
    return ModelShape(
        num_layers=cfg.num_hidden_layers,
        hidden_size=cfg.hidden_size,
        intermediate_size=(getattr(cfg, "moe_intermediate_size", None) if experts else None)
        or _mlp_width(cfg),
        num_heads=heads,
        kv_heads=config_kv_heads(cfg),
        head_dim=head_dim,
        vocab_size=cfg.vocab_size,
        num_embeddings=cfg.vocab_size,
        tied_embeddings=bool(getattr(cfg, "tie_word_embeddings", False)),
        qk_norm=family.startswith(("qwen3", "gemma3", "afmoe", "olmo2", "olmo3", "hunyuan")),
        rotated_qk_norms=family.startswith(ROTATED_QK_NORMS),
        layer_rope=family.startswith(LAYER_ROPE),
        head_gate=bool(getattr(cfg, "use_attention_gate", False)),
        rope_tables=_rope_tables(cfg),
        qkv_bias=bool(getattr(cfg, "attention_bias", family in ("qwen2", "qwen2_moe"))),
        family=family,
        num_experts=experts,
        experts_per_token=_first_field(cfg, EXPERTS_PER_TOKEN) if experts else 0,
        shared_width=shared if experts else 0,
        moe_layers=_moe_layers(cfg) if experts else None,
        dense_width=(getattr(cfg, "intermediate_size_mlp", None) or _mlp_width(cfg)) if experts else 0,
        layer_norms=4 if family in SANDWICH_NORMS else 1 if family in PARALLEL_BLOCKS else 2,
        float32_norms=family.startswith(FLOAT32_NORM_TYPES),
        centered_norms=family in PARALLEL_BLOCKS,
        gated_attention=family in GATED_ATTENTION,
        clamped_experts=bool(experts)
        and (getattr(cfg, "swiglu_limit", None) is not None or family == "gpt_oss"),
        dense_experts=bool(experts) and family.startswith("llama4"),
        logit_softcap=getattr(cfg, "final_logit_softcapping", None) is not None,
        attention_softcap=getattr(cfg, "attn_logit_softcapping", None) is not None,
        eager_experts=getattr(cfg, "_experts_implementation", None) == "eager",
        expert_biases=bool(experts) and family.startswith(EXPERT_BIASES),
        uncast_experts=bool(experts)
        and not family.startswith("llama4")  # (Llama 4's: torch.bmm, cast)
        and getattr(cfg, "_experts_implementation", None) in (None, "grouped_mm"),
        windows=_config_windows(cfg),
        layer_head_dims=layer_head_dims(cfg),
        layer_kv_heads=layer_kv_heads(cfg),
        layer_kv_sources=layer_kv_sources(cfg),
        mlp_layers=None if (blocks := _mlp_blocks(cfg)) is None else len(blocks),
        per_layer_inputs=getattr(cfg, "hidden_size_per_layer_input", None) or 0,
        scaled_embeddings=family in SCALED_EMBEDDINGS,
        layer_carry=(getattr(cfg, "router_hidden_size", None) or 0) * (family in SCALED_EMBEDDINGS),
        scaled_residuals=2 * (family in SCALED_EMBEDDINGS),
        l2_qk_norms=family in SCALED_EMBEDDINGS,
        complex_rope=family in COMPLEX_ROPE,
        float32_router=bool(experts) and family in FLOAT32_ROUTERS,
        **_latent_fields(cfg),
    )


def _latent_width(cfg: Any) -> int:
    """A multi-head latent attention config's latent width (``kv_lora_rank + qk_rope_head_dim``), else 0."""
    rank, rope = getattr(cfg, "kv_lora_rank", None), getattr(cfg, "qk_rope_head_dim", None)
    return rank + rope if isinstance(rank, int) and isinstance(rope, int) else 0


def _latent_fields(cfg: Any) -> dict[str, int]:
    """A multi-head latent attention config's :class:`ModelShape` fields (its latent's and heads' widths; none
    without latent attention)."""
    width = _latent_width(cfg)
    if not width:
        return {}
    fields = ("q_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")
    return {"latent_width": width, **{f: getattr(cfg, f, None) or 0 for f in fields}}


def _shape_of_attention_free(cfg: Any) -> ModelShape:
    """A config without attention (pure Mamba2, Mamba-1): no pages and no MLP, each layer a norm and a carried mixer
    (:func:`_attention_free_mixer`)."""
    mixer, layers = _attention_free_mixer(cfg), cfg.num_hidden_layers
    width, h = mixer.heads * mixer.head_dim, cfg.hidden_size
    if mixer.kind == "mamba":  # in (x, gate), x -> dt rank + B + C, dt rank -> dt, out
        rank = getattr(cfg, "time_step_rank", None) or -(-h // 16)
        rank = -(-h // 16) if rank == "auto" else rank
        linear = h * 2 * width + width * (rank + 2 * mixer.state) + rank * width + width * h
    else:  # in (gate, x B C, dt), out
        linear = h * (width + mixer.channels + mixer.heads) + width * h
    return ModelShape(
        num_layers=layers, hidden_size=cfg.hidden_size, intermediate_size=width, num_heads=1, kv_heads=1,
        head_dim=16, vocab_size=cfg.vocab_size, num_embeddings=cfg.vocab_size,
        tied_embeddings=bool(getattr(cfg, "tie_word_embeddings", False)), qk_norm=False, qkv_bias=False,
        family=getattr(cfg, "model_type", None) or "mamba2", kv_layers=0, mlp_layers=0, mixers=(mixer,) * layers,
        float32_residual=bool(getattr(cfg, "residual_in_fp32", False)), linear_weights=layers * linear,
        conv_state_elements=layers * mixer.channels * mixer.kernel, recurrent_state_elements=layers * width * mixer.state,
    )  # fmt: skip


def _attention_free_mixer(cfg: Any) -> Mixer:
    """Mamba-1's mixer (``intermediate_size`` channels of ``state_size`` each, ``conv_kernel``) or Mamba2's (its
    ``num_heads``, ``head_dim``, ``state_size``, ``n_groups``, ``conv_kernel``, ``chunk_size``)."""
    if getattr(cfg, "model_type", None) in MAMBA1_TYPES:
        width = cfg.intermediate_size
        return Mixer(
            "mamba", channels=width, kernel=cfg.conv_kernel, heads=width, head_dim=1, state=cfg.state_size
        )
    heads, head_dim, state = cfg.num_heads, cfg.head_dim, cfg.state_size
    channels = heads * head_dim + 2 * cfg.n_groups * state  # the convolution's: x, B and C
    return Mixer("mamba2", channels=channels, kernel=cfg.conv_kernel, heads=heads, head_dim=head_dim, state=state,
                 block=cfg.chunk_size, gated_norm=True)  # fmt: skip


def _first_field(cfg: Any, names: tuple[str, ...]) -> int:
    """The first of a config's fields ``names`` that is set (the name differs by family), else 0."""
    return next((getattr(cfg, k) for k in names if getattr(cfg, k, None)), 0)


def _moe_layers(cfg: Any) -> int | None:
    """How many of a config's layers route to experts where its fields make some dense (``None``: every one):
    Jamba's ``layers_num_experts``, Llama 4's ``moe_layers``, Kimi-Linear's ``mlp_layer_types``, Nemotron-H's
    ``layers_block_type``; Qwen-MoE's ``mlp_only_layers`` and ``decoder_sparse_step``; DeepSeek's and
    GLM's ``first_k_dense_replace``, AFMoE's and LFM2-MoE's ``num_dense_layers`` (the first layers dense); ERNIE's
    ``moe_layer_start_index`` / ``moe_layer_end_index`` / ``moe_layer_interval``."""
    n = cfg.num_hidden_layers
    per_layer = getattr(cfg, "layers_num_experts", None)
    if isinstance(per_layer, (list, tuple)):
        return sum(e > 1 for e in per_layer)
    listed = getattr(cfg, "moe_layers", None)  # Llama 4's (every interleave_moe_layer_step-th)
    if isinstance(listed, (list, tuple)):
        return len(listed)
    kinds = getattr(cfg, "mlp_layer_types", None)  # Kimi-Linear's "dense" / "sparse"
    if isinstance(kinds, (list, tuple)):
        return sum(k == "sparse" for k in kinds)
    if (blocks := _mlp_blocks(cfg)) is not None:  # Nemotron-H's "moe" blocks
        return blocks.count("moe")
    dense = set(getattr(cfg, "mlp_only_layers", None) or ())
    step = getattr(cfg, "decoder_sparse_step", None) or 1
    first = getattr(cfg, "first_k_dense_replace", None) or getattr(cfg, "num_dense_layers", None) or 0
    every = getattr(cfg, "moe_layer_interval", None) or 1
    start = getattr(cfg, "moe_layer_start_index", None) or 0
    end = getattr(cfg, "moe_layer_end_index", None)
    end = n - 1 if end is None or end < 0 else end

    def routes(i: int) -> bool:
        return (
            i not in dense
            and (i + 1) % step == 0
            and i >= first
            and (i + 1) % every == 0
            and start <= i <= end
        )

    count = sum(map(routes, range(n)))
    return None if count == n else count


def _mlp_blocks(cfg: Any) -> list[str] | None:
    """A config whose layers are each one block — a mixer, attention, an MLP or MoE (Nemotron-H's
    ``layers_block_type``) — its ``"mlp"`` and ``"moe"`` blocks; ``None`` for others."""
    blocks = getattr(cfg, "layers_block_type", None)
    if not isinstance(blocks, (list, tuple)):
        return None
    mlps = [b for b in blocks if b in ("mlp", "moe")]
    return mlps or None


def _mlp_width(cfg: Any) -> int:
    """A dense MLP's width: ``intermediate_size``, adjusted as LFM2 adjusts it (``block_auto_adjust_ff_dim``: two
    thirds, times ``block_ffn_dim_multiplier``, rounded up to ``block_multiple_of``); per-layer widths (Gemma 3n's
    list): the widest."""
    width = cfg.intermediate_size
    if isinstance(width, (list, tuple)):
        width = max(width)
    if not getattr(cfg, "block_auto_adjust_ff_dim", False):
        return width
    width = int(2 * width / 3)
    if getattr(cfg, "block_ffn_dim_multiplier", None) is not None:
        multiple = cfg.block_multiple_of
        width = -(-int(cfg.block_ffn_dim_multiplier * width) // multiple) * multiple
    return width


WINDOWED = ("sliding_attention", "full_attention", "chunked_attention")  # layer types of attention layers


def _config_windows(cfg: Any) -> tuple[int | None, ...] | None:
    """Each layer's sliding window as a Hugging Face config declares it: ``sliding_window`` on the layers its
    ``layer_types`` calls ``sliding_attention`` (on every layer without ``layer_types``: Mistral, Phi-3),
    ``attention_chunk_size`` on ``chunked_attention`` layers (Llama 4: they keep a window's pages); ``None``
    without a window, or with layer types other than these (a hybrid: its adapter says, :func:`_with_adapter`)."""
    window = getattr(cfg, "sliding_window", None)
    window = window if isinstance(window, int) and not isinstance(window, bool) else None
    types = getattr(cfg, "layer_types", None)
    if types is None:
        return None if window is None else (window,) * cfg.num_hidden_layers
    if any(t not in WINDOWED for t in types):
        return None
    spans = {"sliding_attention": window, "chunked_attention": getattr(cfg, "attention_chunk_size", None)}
    windows = tuple(spans.get(t) for t in types)
    return windows if any(w is not None for w in windows) else None


def _shape_of_chunk_model(model: torch.nn.Module) -> ModelShape:
    """A ChunkModel's shape read off its modules (``engine/model.py``'s ``ChunkModel`` says it to the model's
    author): the hidden size from the LM head; its MLPs are the ``nn.Linear`` modules that project a wider input
    back to the hidden size (their down projections: one per MLP, the widest input the MLP width; none found: one
    MLP per attention call slot, as wide as the widest ``nn.Linear``), except attention's output projections
    (:func:`_attention_output`), whose input gives the query heads (else ``hidden // head_dim``); its blocks as many
    as its attention call slots (``num_layers``) or MLPs, the more; its norms ``nn.RMSNorm`` or not; ``layer_windows`` and carried states as its adapter declares them
    (:func:`_with_adapter`)."""
    lm_head = model.lm_head()
    head = lm_head.weight
    hidden = head.shape[1]
    linears = [m for m in model.modules() if isinstance(m, torch.nn.Linear) and m.weight is not head]
    # a wider input projected back to the hidden size: an MLP's down projection, or attention's output projection
    # (heads x head_dim wider than the hidden size)
    wider = []  # (o, the other nn.Linear modules beside it)
    for parent in model.modules():
        children = [c for c in parent.children() if isinstance(c, torch.nn.Linear) and c.weight is not head]
        wider += [(o, [c for c in children if c is not o]) for o in children
                  if o.out_features == hidden < o.in_features]  # fmt: skip
    outputs = [o.in_features for o, siblings in wider if _attention_output(o, siblings, model)]
    downs = [o.in_features for o, siblings in wider if not _attention_output(o, siblings, model)]
    widest = max((max(m.in_features, m.out_features) for m in linears), default=4 * hidden)
    mlps = len(downs) or model.num_layers
    shape = ModelShape(
        num_layers=max(model.num_layers, mlps),
        hidden_size=hidden,
        intermediate_size=max(downs, default=widest),
        num_heads=max(outputs, default=hidden) // model.head_dim or 1,
        kv_heads=model.kv_heads,
        head_dim=model.head_dim,
        vocab_size=model.vocab_size,
        num_embeddings=model.num_embeddings,
        family=type(model).__name__,
        logit_softcap=lm_head.softcap is not None,
        kv_layers=model.num_layers,
        mlp_layers=mlps,
        linear_weights=sum(m.weight.numel() for m in linears),
        float32_norms=float32_norms(model.modules(), hidden),
    )
    return _with_adapter(shape, model)


def _attention_output(o: torch.nn.Linear, siblings: list[torch.nn.Linear], model: Any) -> bool:
    """Whether ``o`` (a wider input projected to the hidden size) is attention's output projection, not an MLP's
    down projection: its module also projects the hidden states to its input's width (the queries) and to the K/V
    width (``kv_heads x head_dim``: K and V apart, or together), or to both at once (a fused QKV projection) — an
    MLP's gate and up projections give its own width (or twice it, fused). (An MLP exactly twice as wide as K/V
    would read as attention.)"""
    if o.in_features % model.head_dim:
        return False
    kv = model.kv_heads * model.head_dim
    reads = [s.out_features for s in siblings if s.in_features == o.out_features]
    if o.in_features + 2 * kv in reads:  # fused QKV
        return True
    if o.in_features not in reads:
        return False
    rest = list(reads)
    rest.remove(o.in_features)  # the queries'
    return 2 * kv in rest or rest.count(kv) >= 2


def _with_adapter(shape: ModelShape, adapter: Any) -> ModelShape:
    """What a model's adapter (or a ChunkModel itself) declares: its layers' windows (``layer_windows``) and, when
    it carries states, its paged layers, carried state sizes (``carried_state_elements()``; without it the states
    are not counted, and the plan says so) and carried mixers (``carried_mixer_shapes()``, if it describes them:
    :class:`Mixer`)."""
    shape = dataclasses.replace(
        shape,
        windows=getattr(adapter, "layer_windows", shape.windows),
        layer_kv_heads=getattr(adapter, "layer_kv_heads", shape.layer_kv_heads),
        layer_head_dims=getattr(adapter, "layer_head_dims", shape.layer_head_dims),
        layer_kv_sources=getattr(adapter, "layer_kv_sources", shape.layer_kv_sources),
    )
    if not getattr(adapter, "carries_states", False):
        return shape
    elements = getattr(adapter, "carried_state_elements", None)
    conv, recurrent = elements() if callable(elements) else (0, 0)
    mixers = tuple(getattr(adapter, "carried_mixer_shapes", tuple)())
    return dataclasses.replace(shape, kv_layers=adapter.num_layers, conv_state_elements=conv,
                               recurrent_state_elements=recurrent, mixers=mixers,
                               unsized_states=not callable(elements))  # fmt: skip


def decoder_of(model: torch.nn.Module) -> torch.nn.Module:
    """The decoder stack of a Hugging Face causal LM (the module whose forward turns token ids into final hidden
    states, which the engine calls chunk by chunk): ``model.get_decoder()``, or the inner ``model`` where that is
    not a decoder stack — Mllama's and Llama 4's causal LMs return themselves, ModernBERT's decoder its output
    projection."""
    decoder = model.get_decoder()
    if decoder is model or not hasattr(decoder, "get_input_embeddings"):
        decoder = getattr(model, "model", decoder)
    return decoder


def _with_layers(shape: ModelShape, module: torch.nn.Module) -> ModelShape:
    """What a Hugging Face model's decoder layers (its decoder stack's ``layers``: ``decoder_of``, which looks past
    a ``get_decoder()`` that returns the model itself, as Llama 4's does) show beyond its config: the layers
    whose MLP holds ``experts`` and the dense MLPs' width (the widest projection back to the hidden size in a
    child named as :data:`MLP_NAMES` says), the hidden-wide norms a layer holds (its norm children), a
    ``gate_proj`` in its attention, its queries' and keys' norms (``q_norm``; Llama 4's ``qk_norm``, LFM2's
    ``q_layernorm``)."""
    decoder = decoder_of(module) if callable(getattr(module, "get_decoder", None)) else None
    layers = getattr(decoder, "layers", None)
    if not isinstance(layers, torch.nn.ModuleList) or not len(layers):
        return shape
    h = shape.hidden_size

    def routes(layer: torch.nn.Module) -> bool:
        return any(name.rsplit(".", 1)[-1] == "experts" for name, _ in layer.named_modules())

    def norms(layer: torch.nn.Module) -> int:
        return sum("norm" in type(c).__name__.lower() and getattr(c, "weight", None) is not None
                   and tuple(c.weight.shape) == (h,) for c in layer.children())  # fmt: skip

    dense = [layer for layer in layers if not routes(layer)]
    widths = [m.in_features for layer in dense for name, m in layer.named_modules()
              if isinstance(m, torch.nn.Linear) and m.out_features == h < m.in_features
              and any(part in MLP_NAMES for part in name.split("."))]  # fmt: skip
    attentions = [getattr(layer, "self_attn", None) for layer in layers]
    # the projections reading the normed input: q, k, v (fused: one) and the dense MLP's gate, up (fused: one)
    mlps = [getattr(layer, n, None) for layer in dense for n in MLP_NAMES]
    readers = [max((sum(isinstance(c, torch.nn.Linear) and c.in_features == h and name not in OUTPUT_PROJECTIONS
                        for name, c in m.named_children()) for m in modules if isinstance(m, torch.nn.Module)),
                   default=0) for modules in (attentions, mlps)]  # fmt: skip
    # an MoE layer's uncast experts read its normed input as it is: its router and shared experts' projections
    moes = [getattr(layer, n, None) for layer in layers if routes(layer) for n in MLP_NAMES]
    readers.append(max((_weights_reading(m, h) for m in moes if isinstance(m, torch.nn.Module)), default=0))
    qk_norms = [
        m for a in attentions for n in QK_NORMS if isinstance(m := getattr(a, n, None), torch.nn.Module)
    ]
    qk_layers = sum(
        any(isinstance(getattr(a, n, None), torch.nn.Module) for n in QK_NORMS) for a in attentions
    )
    changes: dict[str, Any] = dict(
        layer_norms=max(map(norms, layers)) or shape.layer_norms,
        float32_norms=(saves := float32_saves(layers.modules(), h)) >= 2,
        centered_norms=saves >= 3,
        native_norms=native_norms(layers.modules(), h),
        norm_readers=tuple(readers) if any(readers) else None,
        ungated_mlp=next(
            (u for m in mlps if isinstance(m, torch.nn.Module) and (u := ungated_mlp(m, h))), None
        ),
        gated_attention=any(isinstance(getattr(a, "gate_proj", None), torch.nn.Linear) for a in attentions),
        qk_norm=shape.qk_norm or bool(qk_norms),
        qk_norm_layers=qk_layers if 0 < qk_layers < sum(a is not None for a in attentions) else None,
        weightless_qk_norms=bool(qk_norms) and not any(any(True for _ in m.parameters()) for m in qk_norms),
        value_norm=any(isinstance(getattr(a, "v_norm", None), torch.nn.Module) for a in attentions),
        head_gate=shape.head_gate
        or any(isinstance(getattr(a, "g_proj", None), torch.nn.Linear) for a in attentions),
    )
    if shape.num_experts:
        # routed experts' biases: [experts, width] parameters of an "experts" module
        biases = any(name.rsplit(".", 1)[-1].endswith("bias") and p.dim() == 2 and "experts" in name.split(".")
                     for layer in layers for name, p in layer.named_parameters())  # fmt: skip
        changes.update(
            moe_layers=len(layers) - len(dense),
            dense_width=max(widths, default=shape.dense_width),
            expert_biases=biases,
        )
    return dataclasses.replace(shape, **changes)


def ungated_mlp(mlp: torch.nn.Module, hidden: int) -> tuple[int, int] | None:
    """``(width-wide tensors, bytes per element beside them)`` the activation of an MLP without a gate — one
    projection of the ``hidden``-wide input to the width its output projection reads, an activation module between —
    saves beside its output, as its forward shows on a float32 input (GELU: its input; ReLU²: the ReLU's output;
    Apertus's xIELU: four and a mask); ``None`` for a gated MLP or one whose activation is not a module."""
    linears = [(n, c) for n, c in mlp.named_children() if isinstance(c, torch.nn.Linear)]
    down = [c for n, c in linears if n in OUTPUT_PROJECTIONS]
    up = [c for n, c in linears if n not in OUTPUT_PROJECTIONS and c.in_features == hidden]
    act = [c for c in mlp.children() if not isinstance(c, torch.nn.Linear)]
    if len(down) != 1 or len(up) != 1 or up[0].out_features != down[0].in_features or len(act) != 1:
        return None
    params = {n: torch.ones(p.shape, requires_grad=True) for n, p in act[0].named_parameters()}
    params.update((n, torch.ones(b.shape, dtype=b.dtype)) for n, b in act[0].named_buffers())
    x = torch.randn(2, up[0].out_features, requires_grad=True)
    saved: list[torch.Tensor] = []
    hooks = torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t)
    try:
        with torch.enable_grad(), torch.autocast("cpu", enabled=False), hooks:
            out = torch.func.functional_call(act[0], params, (x,))
    except Exception:  # noqa: BLE001  (an activation that needs more than its input)
        return None
    rows = {t.untyped_storage().data_ptr(): t for t in saved if t.shape == x.shape}
    rows.pop(out.untyped_storage().data_ptr(), None)  # (the output projection's input: counted apart)
    wide = sum(t.is_floating_point() for t in rows.values())
    return wide, sum(t.element_size() for t in rows.values() if not t.is_floating_point())


def _weights_reading(block: torch.nn.Module, width: int) -> int:
    """Modules of an MoE block, its experts' aside, whose 2-D weight reads ``width``-wide inputs (a router's, its
    shared experts' and their gate's: each makes a cast copy of its input under autocast), output projections not."""
    return sum(isinstance(w := getattr(m, "weight", None), torch.Tensor) and w.dim() == 2 and w.shape[-1] == width
               and name.rsplit(".", 1)[-1] not in OUTPUT_PROJECTIONS and "experts" not in name.split(".")
               for name, m in block.named_modules() if name)  # fmt: skip


def _with_parameters(shape: ModelShape, module: torch.nn.Module) -> ModelShape:
    params = list(module.parameters())  # shared (tied) parameters appear once
    trainable = [p for p in params if p.requires_grad]
    if callable(getattr(module, "get_output_embeddings", None)):  # Hugging Face
        head, embedding = module.get_output_embeddings().weight, module.get_input_embeddings().weight
    else:  # a ChunkModel: its embedding is the parameter shaped [num_embeddings, hidden]
        head = module.lm_head().weight
        shaped = [p for p in params if p.shape == (shape.num_embeddings, shape.hidden_size)]
        embedding = next((p for p in shaped if p is not head), head)
    adapters = Counter((a.in_features, a.out_features, a.weight.element_size())
                       for m in module.modules() if hasattr(m, "lora_A") and hasattr(m, "base_layer")
                       for a in m.lora_A.values() if isinstance(a, torch.nn.Linear) and a.weight.requires_grad)  # fmt: skip
    decoder = module.get_decoder() if callable(getattr(module, "get_decoder", None)) else module
    frozen = bool(adapters) and not any(
        p.requires_grad for n, p in decoder.named_parameters() if "lora_" not in n
    )
    return dataclasses.replace(
        shape,
        adapters=tuple((*key, n) for key, n in adapters.items()),
        frozen_layers=frozen,
        head_trainable=head.requires_grad,
        head_grad_hooked=head.requires_grad and bool(gradient_hooks(head)),
        embedding_trainable=embedding.requires_grad,
        params=sum(p.numel() for p in params),
        trainable=sum(p.numel() for p in trainable),
        weight_bytes=sum(p.numel() * p.element_size() for p in params),
        grad_bytes=sum(p.numel() * p.element_size() for p in trainable),
        largest_param=max((p.numel() for p in trainable), default=0),
        half_trainable=sum(p.numel() for p in trainable if p.dtype in HALF_DTYPES),
        half_vectors=sum(p.numel() for p in trainable if p.dtype in HALF_DTYPES and p.dim() < 2),
    )


def float32_norms(modules: Any, width: int) -> bool:
    """Whether the norms among ``modules`` (``width``-wide weight, "norm" in the class name) keep their normed input in
    float32 under 16-bit activations, as their forward shows on a bfloat16 input: two float32 ``width``-wide tensors
    saved — the input and the normed input (torch's ``nn.RMSNorm``, Gemma's ``x * (1 + w)``) — not one (Llama's casts
    the normed input back first). A norm whose forward takes more than the hidden states (a gated norm) is not read."""
    return float32_saves(modules, width) >= 2


def float32_saves(modules: Any, width: int) -> int:
    """The most float32 ``width``-wide tensors a norm among ``modules`` saves per token on a bfloat16 input
    (:func:`float32_norms`; three: Cohere's LayerNorm, its centred input twice and the normed input)."""
    tried, most = set(), 0
    for norm in modules:
        weight = getattr(norm, "weight", None)
        if (
            type(norm) in tried
            or "norm" not in type(norm).__name__.lower()
            or not isinstance(weight, torch.Tensor)
        ):
            continue
        if tuple(weight.shape) == (width,):
            tried.add(type(norm))
            saved = _saved_by_norm(norm, width)
            rows = {
                t.untyped_storage().data_ptr() for t in saved if t.dtype == torch.float32 and t.dim() == 2
            }
            most = max(most, len(rows))
    return most


def native_norms(modules: Any, width: int) -> bool:
    """Whether the norms among ``modules`` are torch's fused LayerNorm (``F.layer_norm``: Nemotron's, StarCoder2's,
    StableLM's), as their forward shows on a bfloat16 input: its input saved as it is, no float32 copy of it."""
    norms = [m for m in modules if "norm" in type(m).__name__.lower() and isinstance(getattr(m, "weight", None),
             torch.Tensor) and tuple(m.weight.shape) == (width,)]  # fmt: skip
    if not norms:
        return False
    rows = [t for t in _saved_by_norm(norms[0], width) if t.dim() == 2]
    return bool(rows) and all(t.dtype == torch.bfloat16 for t in rows)


def _saved_by_norm(norm: torch.nn.Module, width: int) -> list[torch.Tensor]:
    """The ``width``-wide tensors ``norm`` saves for its backward on a bfloat16 input (real parameters in place of
    its own, which may be on the meta device); none if its forward fails."""
    params = {
        n: torch.ones(p.shape, dtype=torch.bfloat16, requires_grad=True) for n, p in norm.named_parameters()
    }
    buffers = {n: torch.zeros(b.shape, dtype=b.dtype) for n, b in norm.named_buffers()}
    x = torch.ones(2, width, dtype=torch.bfloat16, requires_grad=True)
    saved: list[torch.Tensor] = []
    hooks = torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t)
    try:
        with torch.enable_grad(), torch.autocast("cpu", enabled=False), hooks:
            torch.func.functional_call(norm, {**params, **buffers}, (x,))
    except Exception:  # noqa: BLE001  (a forward that needs more than the hidden states)
        return []
    return [t for t in saved if t.dim() and t.shape[-1] == width]
