"""The activation terms of the memory plan (:mod:`~lightning_oomb.engine.planner`): what autograd saves during one
chunk's recompute (:func:`saved_bytes`), what the loss's and a layer's backward allocate beside it
(:func:`loss_backward_bytes`, :func:`layer_backward_bytes`), what offload parks in host memory
(:func:`parked_bytes`) — per layer and token, for a :class:`~lightning_oomb.engine.model_shape.ModelShape` and
the step's :class:`~lightning_oomb.engine.step_setup.Dtypes`. The planner's module docstring gives the formulas."""

from __future__ import annotations

from collections import Counter

import torch

from lightning_oomb.engine import parking
from lightning_oomb.engine.attention import stored_head_dim
from lightning_oomb.engine.cpu_attention import PAST_BLOCK
from lightning_oomb.engine.model_shape import NORM_BYTES, Mixer, ModelShape
from lightning_oomb.engine.reference import KEY_BLOCK
from lightning_oomb.engine.step_setup import Dtypes

ID_BYTES = 8  # token ids and targets are int64


def saved_bytes(
    shape: ModelShape,
    dtypes: Dtypes,
    batch: int,
    seq_len: int,
    chunk_size: int,
    layer_checkpointing: bool,
    restaged_width: int = 0,
    mlp_tile: int | None = None,
    backend: str = "torch",
    mla_pages: str = "expanded",
) -> dict[str, int]:
    """Bytes autograd holds at the end of one full chunk's recompute, by part: ``layers`` (decoder layers),
    ``weight_copies`` (autocast's cast weights), ``head`` (final norm, the loss's hidden states, targets) and
    ``other`` (the step's token ids, RoPE cos/sin) — what :class:`~lightning_oomb.engine.memory.SavedTensorMeter`
    measures as its peak. ``restaged_width``: the elements per token of the K and V (one tensor where values are
    keys) of every layer whose op saves its chunk's K/V for the backward's rewrite, summed (host-tier layers and
    window layers keeping only their tails: ``KVPool.restages``). ``backend``: the attention backend, whose op saves
    its q and output as wide as the pages (``attention.stored_head_dim``);
    ``mla_pages="latent"``: a latent attention model's op saves them at its latent's width
    (``ModelShape.latent_width``), and the absorption its queries."""
    tokens = batch * min(chunk_size, seq_len)
    r, c = dtypes.activation.itemsize, dtypes.compute.itemsize
    if layer_checkpointing:  # a checkpointed layer saves its input only
        layers = _layer_inputs_bytes(shape, dtypes) * tokens
        copies = rope = 0
    else:
        tiled = mlp_tiled(shape, mlp_tile, min(chunk_size, seq_len))
        _, mlp, dense = _layer_bytes_per_token(shape, dtypes, streamed=False, tiled=tiled)
        # each paged layer's attention at its own head dim and KV heads (Gemma 4's sliding layers narrower than its
        # global ones, with more KV heads in its 31B and 26B-A4B; its E-series' last layers reuse earlier K/V)
        shares = [s is not None for s in shape.own_kv_sources or (None,) * shape.paged_layers]
        dims = Counter(zip(shape.own_head_dims, shape.own_kv_heads, shares))
        latent = shape.attending(mla_pages).head_dim if mla_pages == "latent" and shape.latent_width else 0
        attention = sum(
            n
            * _layer_bytes_per_token(
                shape, dtypes, False, tiled, d, kv, stored_head_dim(backend, latent or d), shared
            )[0]
            for (d, kv, shared), n in dims.items()
        )
        absorbed, absorbing = latent_absorption_bytes(shape, dtypes, batch) if latent else (0, 0)
        attention += shape.paged_layers * absorbed
        if shape.qk_norm and shape.qk_norm_layers is not None:  # (the layers without: Llama 4's NoPE layers)
            unnormed = max(shape.paged_layers - shape.qk_norm_layers, 0)
            attention -= unnormed * _qk_norm_bytes(
                shape, dtypes, min(shape.own_head_dims, default=shape.head_dim)
            )
        # a host-tier or tail-keeping window layer saves its chunk's K and V too
        restaged = dtypes.kv.itemsize * restaged_width
        # a hybrid's layers without attention: their input norm and carried mixer (mixer_bytes); a ChunkModel's
        # other layers without attention are its MLP-only blocks
        mixer_layers = min(shape.num_layers - shape.paged_layers, len(shape.mixers))
        mixed = mixer_layers * (_mixer_norm_bytes(shape, dtypes) + _output_norm_bytes(shape, dtypes)) * tokens
        mixed += sum(_mixer_saves(shape, dtypes, batch, min(chunk_size, seq_len)))
        mlps = shape.moe_mlps * mlp + (shape.mlps - shape.moe_mlps) * dense
        per_token = attention + mlps + restaged
        # a layer's scaled sums (ZAYA's): its output biased (under autocast float32: a float32 bias added) and the
        # float32 residual stream biased; each layer but the first scales the one before's router states
        out = NORM_BYTES if dtypes.mixed else r
        per_token += shape.num_layers * shape.scaled_residuals * (out + NORM_BYTES) * shape.hidden_size
        per_token += max(shape.num_layers - 1, 0) * c * shape.layer_carry
        # each layer's gate of its own input (Gemma 4's): the gate's input, its GELU's input and output, the
        # projection's input; under autocast the gate's cast input and both weights' copies
        gate = shape.per_layer_inputs
        per_token += (
            shape.num_layers * ((c if dtypes.mixed else r) * shape.hidden_size + 3 * c * gate) * bool(gate)
        )
        layers = (per_token + adapter_bytes(shape, dtypes)) * tokens + mixed + shape.paged_layers * absorbing
        linear = shape.linear_weights
        # the Llama-style layers' (a hybrid's: attention in its paged layers, its mixers' own projections)
        if linear is None:
            linear = shape.linear_params - shape.moe_mlps * shape.uncast_expert_params
            if shape.mixers and all(m.linear_weights for m in shape.mixers):
                unpaged = shape.num_layers - shape.paged_layers
                linear += sum(m.linear_weights for m in shape.mixers) - unpaged * shape.attention_params
        copies = (linear + 2 * shape.num_layers * shape.hidden_size * gate) * c if dtypes.mixed else 0
        # cos and sin, shared by the layers of a head dim or a table (layer_rope: each layer's float32 copies; latent
        # attention's as wide as its rotated columns, DeepSeek-V2's one complex64 table: 4 bytes a column)
        head_dims = set(shape.own_head_dims)
        widths = sum(head_dims) if len(head_dims) > 1 else shape.rope_tables * shape.head_dim
        widths = shape.rope_tables * shape.qk_rope_head_dim if shape.latent_width else widths
        tables = (1, NORM_BYTES) if shape.complex_rope else (2, r)
        rope = (
            tables[0]
            * min(chunk_size, seq_len)
            * widths
            * (NORM_BYTES * shape.paged_layers if shape.layer_rope else tables[1])
        )
    # the layers' own inputs (Gemma 4's): their sum, the float32 norm's input and output, 1/rms and one more per
    # layer; under autocast the projection's cast input and weight
    own = shape.per_layer_inputs * shape.num_layers
    own_inputs = (r + 2 * NORM_BYTES) * own + 2 * NORM_BYTES * shape.num_layers * bool(own)
    if dtypes.mixed and own:
        own_inputs += c * shape.hidden_size
        copies += c * shape.hidden_size * own
    # (and a scale's input before the first layer: ZAYA's)
    own_inputs += shape.scaled_embeddings * r * shape.hidden_size
    return {
        "layers": layers,
        "weight_copies": copies,
        "head": _head_bytes_per_token(shape, dtypes) * tokens,
        "other": ID_BYTES * batch * seq_len + rope + own_inputs * tokens,
    }


def latent_absorption_bytes(shape: ModelShape, dtypes: Dtypes, batch: int) -> tuple[int, int]:
    """(bytes per token, bytes per chunk) one latent attention layer's absorption saves under ``mla_pages="latent"``
    (:func:`~lightning_oomb.integrations.hf.latent.attend_latent`), in the compute dtype: the model's queries
    (``[Hq, nope + rope]`` a token, for ``absorb``'s gradient); the absorbed weights as the batched matmuls
    broadcast them, one copy per row and head (``absorb [nope + rope, rank]``, ``expand [rank + rope, v]``: for
    the queries' and the op output's gradients), and the identity ``kv_b_proj`` maps to give its weight
    (``[rank, rank]``). (The op's output, which ``expand`` reads, is the op's saved one.)"""
    c, heads, rank = dtypes.compute.itemsize, shape.num_heads, shape.kv_lora_rank
    qk = shape.qk_nope_head_dim + shape.qk_rope_head_dim
    weights = batch * heads * (qk * rank + shape.latent_width * shape.v_head_dim) + rank * rank
    return c * heads * qk, c * weights


def scan_views(shape: ModelShape, dtypes: Dtypes, batch: int, chunk_tokens: int) -> int:
    """Bytes a chunk's outgoing Mamba2 states hold beyond themselves while the chunk is back-propagated: each is a
    view of its scan's whole result, every block's states and one more (``heads x head_dim x state`` per row and
    block beyond the one counted, in float32 — under autocast the compute dtype: its einsum's; measured on CPU)."""
    f = dtypes.compute.itemsize if dtypes.mixed else 4
    return batch * sum(f * m.heads * m.head_dim * m.state * -(-chunk_tokens // m.block)
                       for m in shape.mixers if m.kind == "mamba2")  # fmt: skip


def kept_attention_bytes(shape: ModelShape, dtypes: Dtypes, tokens: int) -> int:
    """Bytes of every layer's kept attention output and LSE for a chunk of ``tokens`` (with layer checkpointing)."""
    r = dtypes.kv.itemsize
    lse = 8 if dtypes.activation == torch.float64 else 4
    return shape.paged_layers * (r * shape.num_heads * shape.head_dim + lse * shape.num_heads) * tokens


def parked_kept_bytes(shape: ModelShape, dtypes: Dtypes, tokens: int, pinned: bool) -> tuple[int, int]:
    """(device, host) bytes of the kept attention results under offload (:meth:`~lightning_oomb.engine.attention.
    Kept.park`): every layer's output and LSE in host memory, each rounded up to a power of two when ``pinned``
    (CUDA: the caching host allocator's blocks); on the device the layer's being restored and, on CUDA, the next
    one down's, brought back ahead (:meth:`~lightning_oomb.engine.attention.Kept.prefetch`)."""
    out = dtypes.kv.itemsize * shape.num_heads * shape.head_dim * tokens
    lse = (8 if dtypes.activation == torch.float64 else 4) * shape.num_heads * tokens
    host = sum(1 << (n - 1).bit_length() if pinned else n for n in (out, lse))
    return (2 if pinned else 1) * (out + lse), shape.paged_layers * host


def parked_saves_bytes(
    shape: ModelShape, dtypes: Dtypes, tokens: int, pinned: bool, min_bytes: int | None = None
) -> tuple[int, int]:
    """(device, host) bytes of a chunk recompute's saved activations under offload with layer checkpointing
    (:mod:`~lightning_oomb.engine.parking`): every decoder layer's input and the final norm's saved tensors of at
    least ``min_bytes`` (default :data:`~lightning_oomb.engine.parking.MIN_BYTES`) in host memory, each rounded up
    to a power of two when ``pinned`` (CUDA: the caching host allocator's blocks); on the device two layers' inputs
    at a time (the one taken and the one coming back ahead). The final norm's stay counted on the device too (the
    norm's backward takes them back while little else is held)."""
    least = parking.MIN_BYTES if min_bytes is None else min_bytes
    inputs = [n * tokens for n in _layer_input_tensors(shape, dtypes)]
    saved = [*inputs, *(n * tokens for n in shape.norm_tensors(shape.stream_dtype(dtypes.activation)))]
    host = sum(1 << (n - 1).bit_length() if pinned else n for n in saved if n >= least)
    return sum(sorted(inputs)[-2:]), host


def parked_bytes(shape: ModelShape, dtypes: Dtypes, tokens: int) -> int:
    """Bytes a chunk of ``tokens`` parks in host memory under offload with layer checkpointing on a GPU (the kept
    attention results and the saved layer inputs; each copied out and back once)."""
    return sum(f(shape, dtypes, tokens, pinned=False)[1] for f in (parked_kept_bytes, parked_saves_bytes))


def _layer_bytes_per_token(
    shape: ModelShape,
    dtypes: Dtypes,
    streamed: bool,
    tiled: bool = False,
    head_dim: int | None = None,
    kv_heads: int | None = None,
    op_head_dim: int | None = None,
    shares_kv: bool = False,
) -> tuple[int, int, int]:
    """Bytes per token one decoder layer saves: (input norm + attention, post-attention norm + MLP — an MoE
    layer's where the model has experts — and the same for a dense MLP); a ``tiled`` MLP (``mlp_tile``) saves only
    its input. Frozen layers (``frozen_layers``: LoRA) save no normed input for their
    norms' weights, and their projections' inputs only where LoRA adapters in the activations' dtype read them
    (wider adapters save their own copies: :func:`adapter_bytes`). Norms of the attention's and the MLP's outputs
    (``layer_norms`` 4: Gemma 2/3) and a sigmoid gate on the attention output count with attention; with one norm a
    layer (``layer_norms`` 1: Cohere's parallel block) the MLP reads the attention's (under autocast its own cast
    copies). ``head_dim``: the layer's own (``ModelShape.layer_head_dims``; default ``shape.head_dim``): its
    projections', norms' and the op's saved q and output widths; ``kv_heads``:
    its own (``ModelShape.layer_kv_heads``; default ``shape.kv_heads``); ``op_head_dim``: the width of the op's saved
    q and output (the pages', ``attention.stored_head_dim``; default ``head_dim``); ``shares_kv``: its call passes an
    earlier layer's K/V (``ModelShape.layer_kv_sources``): no key or value projection, norm or their saves."""
    r, c, f = dtypes.activation.itemsize, dtypes.compute.itemsize, NORM_BYTES
    h, heads, kv_heads = shape.hidden_size, shape.num_heads, kv_heads or shape.kv_heads
    d = shape.head_dim if head_dim is None else head_dim
    q, kv = heads * d, kv_heads * d
    lse = 8 if dtypes.activation == torch.float64 else 4
    # the projections' inputs are saved by the projections, else by adapters in the activations' dtype
    inputs = not shape.frozen_layers or any(a <= r for _, _, a, _ in shape.adapters)

    def norm(readers: int, own: bool = True) -> int:  # the norm's saved tensors, what the projections save
        saved = shape.norm_bytes(dtypes.activation) if own else 0
        return saved + (readers * c * h if dtypes.mixed else r * h * own) * inputs

    gated = shape.gated_attention
    readers = shape.norm_readers or (0, 0, 0)  # (0: q, k, v and a gate; gate and up; gate and up)
    # (latent attention's: its queries' and its latent's projections)
    attention_readers = (readers[0] or (2 if shape.latent_width else 3 + gated)) - 2 * shares_kv
    mlp_readers = readers[1] or 2
    # (an MoE layer's readers as read off its modules — router, shared experts — where its routed experts read no
    # cast copy of the whole normed input: grouped_mm's read it uncast, an expert loop's its gathered rows, Llama
    # 4's dense experts their scaled copies)
    moe_readers = readers[2] * (shape.uncast_experts or shape.expert_loop or shape.dense_experts) or 2
    routed = shape.intermediate_size * shape.routed_per_token
    op_q = heads * (op_head_dim or d)  # the op's saved q and output, as wide as the pages
    # (o_proj reads every head's value width: latent attention's v_head_dim)
    out = heads * (shape.v_head_dim or d)
    attn = norm(attention_readers) + 2 * c * op_q + lse * heads + (c if dtypes.mixed else r) * out * inputs
    attn += _latent_norms_bytes(shape, dtypes, inputs)
    # a gate's sigmoid, and the output it multiplies (a copy of the op's: reshaped)
    attn += 2 * c * q * gated
    # a gate per head (LFM3's): its sigmoid and the output it multiplies (a copy of the op's)
    attn += c * (q + heads) * shape.head_gate
    attn += _output_norm_bytes(shape, dtypes)
    attn += _qk_norm_bytes(shape, dtypes, d, kv_heads, keys=not shares_kv) * shape.qk_norm
    if (
        shape.value_norm and not shares_kv
    ):  # its float32 input and two per-head scalars (no weight: no normed input)
        attn += f * (kv + 2 * kv_heads)
    if streamed:
        attn += 2 * c * kv

    own = shape.layer_norms != 1  # (a parallel block's MLP reads the attention's norm)

    def mlp(width: int, experts: bool) -> int:
        if tiled:
            return shape.norm_bytes(dtypes.activation) + r * h
        if not experts and shape.ungated_mlp:  # what its activation saves and the output projection's input
            wide, extra = shape.ungated_mlp
            return norm(mlp_readers, own) + (wide * c + extra + inputs * c) * width
        if not experts:
            return norm(mlp_readers, own) + (3 + inputs) * c * width
        # its shared experts as a dense MLP, its routed ones (routed_bytes), the router's scores
        if shape.layer_carry:  # a router MLP (ZAYA's): one projection reads the normed input
            saved = norm(1, own) + (3 + inputs) * c * (width - routed)
            return saved + routed_bytes(shape, dtypes) + router_mlp_bytes(shape, dtypes)
        saved = norm(moe_readers, own) + (3 + inputs) * c * (width - routed)
        # (a float32 router's copy of its input, outside autocast where the activations are not float32)
        saved += f * h * (shape.float32_router and not dtypes.mixed and r != f)
        # (Llama 4's router: its top-k indices and the scores' float32 sigmoid)
        scores = ID_BYTES * shape.experts_per_token + f * shape.num_experts if shape.dense_experts else None
        return saved + routed_bytes(shape, dtypes) + (scores or 2 * f * shape.num_experts)

    dense = mlp(shape.dense_mlp_width, False)
    return attn, (mlp(shape.mlp_width, True) if shape.num_experts else dense), dense


def _latent_norms_bytes(shape: ModelShape, dtypes: Dtypes, inputs: bool) -> int:
    """Bytes per token a latent attention layer's own norms save (0 without latent attention): ``q_a_layernorm``
    on the queries' ``q_lora_rank``-wide projection (none without: ``q_proj``) and ``kv_a_layernorm`` on the
    latent — each its float32 input (the projection's whole output when it is float32: ``kv_a_proj_with_mqa``'s
    with the rotated key part, split off by a view), 1/rms and the normed input in the projection's (compute)
    dtype (none when frozen), and the next projection's input (``q_b_proj``'s, ``kv_b_proj``'s: the norm's output,
    under autocast its cast copy)."""
    c, f, whole = dtypes.compute.itemsize, NORM_BYTES, dtypes.compute == torch.float32
    normed = 0 if shape.frozen_layers else c

    def norm(width: int, output: int) -> int:
        return f * (output if whole else width) + f + (normed + c * inputs) * width

    if not shape.latent_width:
        return 0
    queries = norm(shape.q_lora_rank, shape.q_lora_rank) if shape.q_lora_rank else 0
    return queries + norm(shape.kv_lora_rank, shape.latent_width)


def router_mlp_bytes(shape: ModelShape, dtypes: Dtypes) -> int:
    """Bytes per token a router MLP of ``layer_carry`` width saves (ZAYA's, beside its projection's input): its norm
    (float32 input and output, 1/rms), the inputs of its two GELU projections, the GELUs' and the output
    projection's, the softmax over the experts and a skip class, the top-k indices and their skip mask."""
    c, f, width = dtypes.compute.itemsize, NORM_BYTES, shape.layer_carry
    k = shape.experts_per_token
    return 2 * f * width + f + 5 * c * width + c * (shape.num_experts + 1) + (ID_BYTES + 1) * k


def _qk_norm_bytes(
    shape: ModelShape, dtypes: Dtypes, head_dim: int, kv_heads: int | None = None, keys: bool = True
) -> int:
    """Bytes per token a layer's per-head norms of q and k (``keys``; else q's alone) save: float32 input, 1/rms and
    the normed input (in the compute dtype; ``float32_norms``: float32; ``rotated_qk_norms``: RoPE's float32 tables
    made it the activations' dtype under autocast; ``weightless_qk_norms``: none, no weight needs it)."""
    r, c, f = dtypes.activation.itemsize, dtypes.compute.itemsize, NORM_BYTES
    # ZAYA's: q and k, each head's norm and two scalars of it, the normed k the scale reads
    if shape.l2_qk_norms:
        q, kv = shape.num_heads, kv_heads or shape.kv_heads
        return c * ((q + 2 * kv) * head_dim + 3 * (q + kv))
    normed = (
        0 if shape.weightless_qk_norms else f if shape.float32_norms else r if shape.rotated_qk_norms else c
    )
    heads = shape.num_heads + (kv_heads or shape.kv_heads) * keys
    return (f + normed) * heads * head_dim + f * heads


def routed_bytes(shape: ModelShape, dtypes: Dtypes) -> int:
    """Bytes per token an MoE layer's routed experts save: per routed expert its I-wide gate, up and activation
    (a clamped GLU's — GPT-OSS's — gate and up, clamped gate, sigmoid, up + 1 and their product: six), the product
    the down projection reads (none for frozen layers), its gathered input, its output and the weighted output
    (grouped_mm's: none; Llama 4's ``dense_experts``: the input times the scores, its cast copy and the scores).
    In the compute dtype, but transformers' grouped_mm experts' (the weights' dtype: autocast
    casts them on no device), an expert loop's weighted output (the activations' dtype: under autocast the float32
    copy it adds into the layer's output) and, under autocast, biased experts' results (GPT-OSS's float32 biases
    added to the matmuls' outputs: the GLU's tensors and the output in float32; the projections read cast copies)."""
    r, c = dtypes.activation.itemsize, dtypes.compute.itemsize
    inputs = not shape.frozen_layers or any(a <= r for _, _, a, _ in shape.adapters)
    e = r if shape.uncast_experts else c  # what the projections read and compute in
    out = r if shape.expert_biases else e  # their results, a bias added
    routed = shape.intermediate_size * shape.routed_per_token
    wide = (3 + 3 * shape.clamped_experts) * out * routed + inputs * e * routed
    weighted = 0 if shape.uncast_experts else r if shape.expert_loop else e
    if shape.dense_experts:  # Llama 4's: each expert's copy of the input times its score (in the activations'
        # dtype) and its copy for the batched matmuls, the scores; the outputs are summed, not saved
        return wide + ((r + e) * shape.hidden_size + e) * shape.routed_per_token
    return wide + (e + out + weighted) * shape.hidden_size * shape.routed_per_token


def mixer_bytes(mixer: Mixer, dtypes: Dtypes, batch: int, length: int, hidden: int) -> tuple[int, int]:
    """(saved, backward transients) bytes of one carried mixer on a chunk of ``length`` tokens per row, as
    transformers' torch implementation computes it (the fla / mamba_ssm kernels hold less). Per token: its input
    projection's input and output (a short convolution's ``B``, ``C``, ``x``; Mamba2's whole projection), its
    convolution's input and output (with the kernel's earlier columns), its output gate (a gated RMSNorm: float32
    input, gate, product and the normed output) and output projection's input; per token of whole blocks the rule's
    float32 tensors: for a delta rule per value head ``12 Dk + 3 Dv`` (``8 Dk`` below float32 activations: measured)
    and five ``block``-wide rows (Kimi-Linear's, its decay per key channel: ``block x (3 Dk + 19)`` more, and as
    many in flight), for Mamba2's scan ``5 N + 4 P`` and three; per block its states (Mamba2: twice,
    and once more); for Mamba-1's scan ``3 N`` per channel (decays, inputs, states; with 16-bit activations the
    states cast back too). The transients (the gradients in flight beyond the saved tensors, fitted from above to
    CPU steps, ``tests/engine/test_planner_hybrids.py``): a delta rule's ``3 block + 3 Dk + Dv`` float32 per value
    head, Mamba2's ``5 N`` per head, 2 (plain gate: 6) float32 outputs and its states again, Mamba-1's ``4 N`` per
    channel, a short convolution's three gated inputs. Under autocast a Mamba2 mixer's and a gated delta-net's
    projections, convolution and scan / rule matmuls' operands are in the compute dtype (measured on CPU steps), a
    delta-net's projections each reading their own cast copy of its input (``Mixer.readers``); a short
    convolution computes all it saves in the compute dtype."""
    r, c, f = dtypes.activation.itemsize, dtypes.compute.itemsize, 4
    w, heads, d, n = mixer.channels, mixer.heads, mixer.head_dim, mixer.state
    out, padded = heads * d, -(-length // mixer.block) * mixer.block
    blocks = padded // mixer.block
    # the convolution's input after the previous chunk's last columns (a copy) and its output (the kernel's more)
    conv = r * w * (2 * length + 3 * mixer.kernel - 1)
    if (
        mixer.kind == "conv" and mixer.delayed
    ):  # ZAYA's attention projection (the attention formula counts its
        # projections' input, three readers): its two convolutions' inputs in the compute dtype — q and k after
        # the carried columns, then less the first's kernel (counted from above: as the whole ``kernel``) —, under
        # autocast the delayed values' projection's own cast copy, and that projection's row of zeros
        saved = c * w * (2 * length + 2 * mixer.kernel) + c * hidden * length * (c < r) + c * hidden
        return batch * saved, batch * 3 * r * w * length
    # under autocast a short convolution's cast input and all it computes in the compute dtype
    if mixer.kind == "conv":
        e = c
        saved = e * (hidden + 4 * w) * length + e * w * (2 * length + 3 * mixer.kernel - 1)
        return batch * saved, batch * 3 * e * w * length
    if mixer.kind == "mamba":  # Mamba-1's torch scan, token by token: per channel, state-wide float32 terms
        own = r * hidden + 8 * r * out + 6 * f * out + 2 * (r + f) * n
        rule = 3 * f * out * n  # per channel and state column: the decays, the inputs, the states
        cast = (f * out + r * out * n) if r != f else 0  # 16-bit: the gate in float32, the states cast back
        return batch * ((own + rule + cast) * length + conv), batch * f * 4 * out * n * length
    if mixer.kind in ("delta", "kda"):  # its projections' input, its gated norm, beta, g
        own = r * hidden + (12 + 3 * r) * out + 6 * f * heads
        keys = 12 if dtypes.activation == torch.float32 else 8
        rule = f * heads * (keys * n + 3 * d + 5 * mixer.block + 4)
        states = f * heads * n * d * blocks
        flight = f * heads * (3 * mixer.block + 3 * n + d) * padded
        # Kimi-Linear's decay per key channel: float32 [block, block, key dim] blocks per head (the decay mask
        # and the products it scales) and more [block, block] ones (fitted to CPU steps)
        if mixer.kind == "kda":
            rule += f * heads * mixer.block * (3 * n + 19)
            flight += f * heads * mixer.block * (3 * n + 19) * padded
        elif c < r:  # autocast (measured on CPU): each projection reads its own cast copy of the input; the
            # convolution, the gate, the output projection's input, one of the three per-head scalars and the
            # rule's matmul operands (per head and token 7 Dk, 2 Dv, 3 block-wide; two states a block) are in the
            # compute dtype, and a row's last state in float32
            own = (mixer.readers or 1) * c * hidden + (12 + 2 * r + 2 * c - f) * out + (5 * f + c) * heads
            rule = f * heads * (6 * n + 2 * d + 2 * mixer.block + 4)
            rule += c * heads * (7 * n + 2 * d + 3 * mixer.block)
            states = 2 * c * heads * n * d * blocks + f * heads * n * d
            conv = c * w * (2 * length + 3 * mixer.kernel - 1)
    else:  # Mamba2: its projection's input and output, the scan's input in float32 (a view of float32 ones), its
        # gated norm on float32 scan outputs (the gate cast too) or Falcon-H1's plain gate
        gate = (16 + f - r) * out if mixer.gated_norm else 8 * out
        own = r * hidden + r * (out + w + heads) + max(r * w, f * out) + gate + r * out
        rule = f * heads * (3 * mixer.block + 5 * n + 4 * d + 5)
        states = f * heads * d * n * (2 * blocks + 1)
        if (
            c < r
        ):  # autocast: projections, convolution and the scan's matmul operands in the compute dtype — per
            # head and token four block-wide, five state-wide and one head-wide, and the chunks' states (measured);
            # the projection not kept whole but the gate's float32 copy (unless scaled: Falcon-H1's, float32)
            kept = max(c * w, f * out) + f * out * mixer.gated_norm
            if mixer.scaled_projection:
                kept = r * (out + w + heads) + max(r * w, f * out)
            own = c * hidden + kept + gate + c * out
            rule -= (f - c) * heads * (4 * mixer.block + 5 * n + d)
            states -= (f - c) * heads * d * n * (blocks + 1)
            conv = c * w * (2 * length + 3 * mixer.kernel - 1)
        flight = f * (5 * heads * n + (2 if mixer.gated_norm else 6) * out) * length + states
    return batch * (own * length + conv + rule * padded + states), batch * flight


def adapter_bytes(shape: ModelShape, dtypes: Dtypes) -> int:
    """Bytes per token the model's LoRA adapters save beyond the layer formula: each its rank-wide input (the down
    projection's output) and, in a dtype wider than the activations (float32 adapters on a 16-bit model, outside
    Lightning's ``bf16-true``, which converts them), its own cast copy of its input (peft casts it)."""
    r = dtypes.activation.itemsize
    return sum(n * a * (rank + width * (a > r)) for width, rank, a, n in shape.adapters)


def _mixer_saves(shape: ModelShape, dtypes: Dtypes, batch: int, length: int) -> list[int]:
    """Each carried mixer's saved bytes on a chunk of ``length`` tokens per row."""
    return [mixer_bytes(m, dtypes, batch, length, shape.hidden_size)[0] for m in shape.mixers]


def _output_norm_bytes(shape: ModelShape, dtypes: Dtypes) -> int:
    """Bytes per token a layer's norms of its mixer's (attention's) and MLP's outputs save (Gemma 2/3, AFMoE, LFM3:
    ``layer_norms`` 4; no projection reads them): the normed input in its input's dtype — under autocast the
    compute dtype, the outputs' (``float32_norms``: float32)."""
    return max(shape.layer_norms - 2, 0) * shape.norm_bytes(
        dtypes.compute if dtypes.mixed else dtypes.activation
    )


def _mixer_norm_bytes(shape: ModelShape, dtypes: Dtypes) -> int:
    """Bytes per token a mixer layer's input norm saves (float32 input, 1/rms, normed input; the mixer saves the
    projections' input)."""
    return shape.norm_bytes(dtypes.activation)


def mlp_tiled(shape: ModelShape, mlp_tile: int | None, chunk_tokens: int) -> bool:
    """Whether ``mlp_tile`` tiles the MLPs of a chunk of ``chunk_tokens`` per row (dense MLPs, tiles shorter)."""
    return mlp_tile is not None and mlp_tile < chunk_tokens and not shape.num_experts


def _head_bytes_per_token(shape: ModelShape, dtypes: Dtypes) -> int:
    """The final norm's saved tensors (the cross-entropy saves none: its gradients are made in its forward); its
    normed input in the residual stream's dtype (float32 with ``float32_residual``)."""
    stream = shape.stream_dtype(dtypes.activation)
    return shape.norm_bytes(stream)


def _layer_inputs_bytes(shape: ModelShape, dtypes: Dtypes) -> int:
    """Bytes per token of every decoder layer's input (a checkpointed layer's saved tensors,
    :func:`_layer_input_tensors`)."""
    return sum(_layer_input_tensors(shape, dtypes))


def _layer_input_tensors(shape: ModelShape, dtypes: Dtypes) -> list[int]:
    """Bytes per token of each tensor a checkpointed layer saves as its input: every decoder layer's hidden states,
    the first in the activations' dtype, the others in the residual stream's (float32 with ``float32_residual``;
    every one with ``scaled_embeddings``), then what each but the first takes from the one before beside them
    (``layer_carry``, in the activations' dtype)."""
    if not shape.num_layers:
        return []
    r, w = dtypes.activation.itemsize, shape.stream_dtype(dtypes.activation).itemsize
    first, w = (4, 4) if shape.scaled_embeddings else (r, w)
    later = shape.num_layers - 1
    carries = [r * shape.layer_carry] * later if shape.layer_carry else []
    return [first * shape.hidden_size, *[w * shape.hidden_size] * later, *carries]


def loss_backward_bytes(
    shape: ModelShape,
    dtypes: Dtypes,
    tokens: int,
    loss_block: int,
    head_trainable: bool = True,
    accumulator: torch.dtype | None = None,
) -> int:
    """Peak bytes the chunked cross-entropy allocates with grad for a chunk of ``tokens`` (``engine/loss.py``): its
    hidden states, ``dh`` and targets, the weight's autocast copy, one block's logits, the block's hidden rows in the
    compute dtype (ignored rows zeroed) and the LM-head gradient — a
    new ``[V, H]`` one in the weight's dtype, or with ``accumulator`` (the dtype of the tensor it is added into in
    place, as the engine does) none; added into a wider tensor, in slabs (see the module docstring)."""
    v, h = shape.vocab_size, shape.hidden_size
    c, r, p = dtypes.compute.itemsize, dtypes.activation.itemsize, dtypes.param.itemsize
    acc = 8 if dtypes.compute == torch.float64 else 4
    block = min(loss_block, tokens)
    widened = dtypes.param != dtypes.compute  # autocast: the weight cast once for every block
    logits = (acc + (c if c != acc else 0)) * block * v  # float32 logits and their 16-bit original or cast
    moments = [logits, 2 * acc * block * v if shape.logit_softcap else 0]  # + a soft cap's derivative
    # + a compute-dtype slab of its product
    if head_trainable and (accumulator or dtypes.param) != dtypes.compute:
        moments.append(logits + c * min(block, h) * v)
    new_grad = v * h * p if head_trainable and accumulator is None else 0
    head = new_grad + (v * h * c if widened else 0)
    rows = c * block * h  # the block's hidden rows, ignored ones zeroed: alive through all its moments
    return (2 * r * h + ID_BYTES) * tokens + head + rows + max(moments)


def layer_backward_bytes(
    shape: ModelShape,
    dtypes: Dtypes,
    batch: int,
    seq_len: int,
    chunk_size: int,
    checkpointing: bool,
    backend: str,
    streamed: bool = False,
    mlp_tile: int | None = None,
    reach: int | None = None,
    restaged: bool = False,
    mla_pages: str = "expanded",
) -> tuple[int, int, int]:
    """Bytes beyond the saved activations while the last decoder layer back-propagates: (its MLP, its attention,
    a hybrid's largest carried mixer: :func:`mixer_bytes`; 0 without) — with ``checkpointing`` its recompute (what
    the part still holds: a mixer layer's, beside attention's in Falcon-H1's layers, or an attention layer's, the
    larger), without it less the MLP's saved tensors, already freed when attention (a mixer) back-propagates; plus
    the gradients in flight (an eager expert loop's its experts' weight gradients) and, on the torch attention
    backend, four float32 score blocks ``[batch x heads x Lq, keys]`` of ``min(KEY_BLOCK, keys)`` keys (a partial
    last chunk's: :func:`score_area`; keys: the sequence, or one chunk's block for a ``streamed`` host-tier layer; at most ``reach``: the keys a query block of the layer
    sees, under a sliding window or a page budget) and float32 copies of q and dO; on the fused CPU path
    its copies of K/V per query head and of their gradients, or — one piece at a time — four of
    ``min(PAST_BLOCK, keys - Lq)`` earlier keys (K, V and their gradients). A
    ``restaged`` layer (a ``streamed`` one, or a window layer keeping only its tails) saves its chunk's K and V;
    under ``mla_pages="latent"`` a recomputed latent attention layer holds its absorption's saved tensors too
    (:func:`latent_absorption_bytes`; ``shape``: the one its op sees, ``ModelShape.attending``)."""
    lq = min(chunk_size, seq_len)
    tokens = batch * lq
    r, c = dtypes.activation.itemsize, dtypes.compute.itemsize
    acc = 8 if dtypes.activation == torch.float64 else 4
    h, q, kv = shape.hidden_size, shape.num_heads * shape.head_dim, shape.kv_heads * shape.head_dim
    tiled = mlp_tiled(shape, mlp_tile, lq)
    attn, mlp, dense = _layer_bytes_per_token(shape, dtypes, streamed or restaged, tiled)
    mlp = max(mlp, dense)  # the last layer's, either kind
    mlp_params = shape.mlp_params - shape.uncast_expert_params
    attn_copies, mlp_copies = (shape.attention_params * c, mlp_params * c) if dtypes.mixed else (0, 0)
    # the recomputed layer holds its saved tensors (and autocast's weight copies) again, but not its attention
    # result: the kept one (counted apart: kept_attention_bytes)
    mixer_saved, mixer_flight = max((mixer_bytes(m, dtypes, batch, lq, h) for m in set(shape.mixers)), key=sum,
                                    default=(0, 0))  # fmt: skip
    if checkpointing:  # (a layer's share of the LoRA adapters counted with its attention)
        attn += adapter_bytes(shape, dtypes) // shape.num_layers
        latent = mla_pages == "latent" and shape.latent_width
        absorbed, absorbing = latent_absorption_bytes(shape, dtypes, batch) if latent else (0, 0)
        kept = (r * q + acc * shape.num_heads) * tokens
        held_attn = (attn + absorbed) * tokens + attn_copies + absorbing - kept
        beside = held_attn if len(shape.mixers) + shape.paged_layers > shape.num_layers else 0
        held_mixer = max(beside, _mixer_norm_bytes(shape, dtypes) * tokens) + mixer_saved
        held_mlp = max(held_attn, held_mixer) + mlp * tokens + mlp_copies
    else:
        held_mlp, held_attn = 0, -mlp * tokens - mlp_copies
        held_mixer = held_attn
    # the product's backward makes two I-wide gradients from a third (3cI) after the down projection's backward
    # freed its saved input (cI): 2cI beyond the saved tensors (a wide MLP's step peak within 2 % on CPU)
    width = max(shape.mlp_width, shape.dense_mlp_width)
    if (
        shape.num_experts and shape.uncast_experts and shape.mlp_width >= shape.dense_mlp_width
    ):  # in r: routed
        width += (r - c) * shape.intermediate_size * shape.routed_per_token // c
    mlp_flight = (2 * c * width + 4 * r * h) * tokens
    if shape.expert_loop:  # transformers' eager loop, one expert's rows at a time (measured on CPU):
        # each expert's slice of the [experts, ...] weights hands back a whole [experts, ...] gradient (select's
        # backward), which autograd adds out of place into the sum so far: the down projection's (E I H) and, at
        # each expert's gate/up projection, three of its (2 E I H: the sum so far, the new one, their sum) — 7 E I H
        # in the weights' dtype, whatever the chunk's tokens — from the second expert on, when the first one's
        # saved tensors are freed (a 1/E share of the routed experts'); beside the layer's output gradient and the
        # sum of the gathered rows' gradients (2rH) and its shared experts' gradients (as a dense MLP's); a dense
        # layer's MLP (2cI + 4rH) at another moment
        weights = 0 if shape.frozen_layers else 7 * dtypes.param.itemsize * shape.intermediate_size * h
        loop = (2 * c * shape.shared_width + 2 * r * h) * tokens + weights * shape.num_experts
        loop -= routed_bytes(shape, dtypes) * tokens // shape.num_experts
        dense_layers = shape.mlps > shape.moe_mlps
        mlp_flight = max(loop, (2 * c * shape.dense_mlp_width + 4 * r * h) * tokens * dense_layers)
    # wider LoRA adapters on the MLP's input hand back their copies' gradients (gate's, up's) in their dtype
    mlp_flight += 2 * max((a for _, _, a, _ in shape.adapters if a > r), default=0) * h * tokens
    # one tile's recompute (its saved tensors) and gradients, beside the chunk's dx and output gradient
    if tiled:
        mlp_flight = 7 * c * width * batch * mlp_tile + 2 * r * h * tokens
    attn_flight = (2 * r * q + acc * q + 4 * r * kv + 2 * r * h) * tokens
    keys = min(chunk_size if streamed else seq_len, reach or seq_len)
    copies = acc * q * tokens if r != acc else 0  # one [tokens, Q] tensor cast to the arithmetic's dtype
    if backend == "torch":  # q and dO cast; a soft cap's tanh and derivative: more blocks
        blocks = 4 + 2 * shape.attention_softcap
        area = lq * min(KEY_BLOCK, keys) if streamed else score_area(seq_len, lq, keys)
        attn_flight += blocks * batch * shape.num_heads * area * acc + 2 * copies
    elif backend == "cpu":  # q, dO and out cast, and one more such temporary (measured on CPU)
        # one piece at a time (engine/cpu_attention.py): the chunk's own keys (their K/V, per query head too, and
        # gradients), or the keys before it (a streamed layer's: a chunk's block) — K, V and their gradients, four
        # float32 copies of up to PAST_BLOCK keys, beside the piece's dq
        past = min(PAST_BLOCK, keys if streamed else max(keys - lq, 0))
        own = (4 * q + 2 * kv) * tokens
        attn_flight += acc * max(own, 4 * kv * batch * past + 2 * q * tokens) + 4 * copies
    # (a model without MLPs, pure Mamba2: no MLP moment)
    mlp_part = (held_mlp + mlp_flight) * bool(shape.mlps)
    return mlp_part, held_attn + attn_flight, (held_mixer + mixer_flight) * bool(shape.mixers)


def score_area(seq_len: int, lq: int, keys: int) -> int:
    """Rows x keys of the largest score block the reference attention's backward makes for one chunk: ``lq`` rows
    over ``min(KEY_BLOCK, keys)`` keys (``keys``: those the sequence's last ``lq`` rows see) — but where the last
    chunk is partial, the larger of its rows over every key and the last whole chunk's rows over the keys up to its
    end (a window's or a page budget's reach, ``keys - lq`` beyond a chunk's rows, moving with them)."""
    part = seq_len % lq
    if not part:
        return lq * min(KEY_BLOCK, keys)
    beyond = keys - lq if keys < seq_len else seq_len  # the keys before a chunk's rows that it sees
    last = part * min(KEY_BLOCK, seq_len, beyond + part)
    return max(last, lq * min(KEY_BLOCK, seq_len - part, beyond + lq))
