"""A training step's FLOPs and, at measured rates, its time (the memory planner's ``step_time_s``).

**FLOPs** (:func:`step_flops`). Matmuls: 2 FLOPs per weight and token per forward, a backward = 2 forwards; a
decoder layer's weights are its attention projections and the MLP a token passes through (its active experts under
MoE; a hybrid's other mixers counted as attention projections; a ChunkModel's MLP-only blocks have no attention
projections, its blocks without an MLP none of the MLP's: ``ModelShape.mixing_layers``, ``ModelShape.mlps``). OOMB runs each decoder layer in the forward sweep,
the chunk's recompute, the layer's checkpoint recompute (``layer_checkpointing``; it stops after the last tensor
the backward needs, so without ``mlp_tile`` the MLP's down projection is not recomputed) and the backward, a tiled
MLP (``mlp_tile``) once more, and the LM head in the forward sweep, the recompute and the backward (matmul FLOPs of
a CPU step counted with ``torch.utils.flop_counter`` equal these: ``tests/engine/test_step_time.py``). The reference — full-sequence training with per-layer checkpointing, as
Hugging Face runs it — runs a layer in 2 forwards + a backward (1 + a backward without checkpointing) and the head in
1 + a backward (its checkpoint's recompute skips the down projection too). Attention: 4 x head_dim FLOPs per visible query-key pair and query head per forward, a backward =
2.5 forwards (FlashAttention's count); OOMB attends twice forward (the forward sweep and the chunk's recompute, whose
result the checkpoint's recompute reuses) and once backward, a chunk whose forward result is kept
(``reuse_attention``) once forward; the reference as often as it runs the layer forward. Visible pairs: causal; a
query of a sliding-window layer sees at most ``window`` keys; in a sparse step (``page_budget``) at most
``page_budget`` pages before its chunk.

**Time** (:func:`step_time`): the compute time at the rates — matmul FLOPs / ``dense_flops`` + attention FLOPs /
``attention_flops`` — or the host-device copies' time (bytes / ``copy_bytes``: offload's pages, parked saves, kept
attention results) where that is longer: side streams overlap copies with compute. The flushes of
``grad_accumulation="float32-host"`` stop the compute while they run (:func:`host_sum_bytes`): their copies, and
without a page-locked mirror their host adds too (bytes of host memory read and written / ``host_bytes``), whichever
is longer — the staging slabs overlap the two; with the mirror a worker thread adds while the device computes on.
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass
from typing import Protocol

from lightning_oomb.engine.config import OOMBConfig
from lightning_oomb.engine.grads import host_flushes


class ModelShape(Protocol):
    """What the FLOP model reads of a model (:class:`lightning_oomb.engine.model_shape.ModelShape` has it)."""

    num_layers: int
    paged_layers: int
    mixing_layers: int
    mlps: int
    hidden_size: int
    num_heads: int
    head_dim: int
    vocab_size: int
    mean_mlp_width: float
    attention_params: int
    windows: tuple[int | None, ...] | None


ATTENTION_BACKWARD = 2.5  # an attention backward in forwards (FlashAttention's FLOP count)


@dataclass(frozen=True)
class StepRates:
    """Measured rates of one device kind: ``dense_flops`` (matmuls) and ``attention_flops`` per second inside a
    training step, ``copy_bytes`` per second between host and device (each way), ``host_bytes`` per second of host
    memory traffic in ``float32-host``'s adds (a nominal 20 GB/s where not measured); under context parallelism
    ``link_bytes`` per second between GPUs and ``link_latency_s`` per collective (nominal NVLink figures where not
    measured)."""

    dense_flops: float
    attention_flops: float
    copy_bytes: float
    host_bytes: float = 2e10
    # context parallelism: bytes/s one way per GPU (NVLink 4 nominal) and each collective's fixed cost
    link_bytes: float = 4.5e11
    link_latency_s: float = 2e-5


def step_flops(
    shape: ModelShape,
    seq_len: int,
    config: OOMBConfig,
    batch: int = 1,
    reference: bool = False,
    layers: int | None = None,
    attention_width: int | None = None,
) -> tuple[float, float]:
    """``(matmul, attention)`` FLOPs of one OOMB training step (the module docstring) on ``batch x seq_len``
    tokens, or of the reference's (``reference=True``: full-sequence training, checkpointed per layer as
    ``config.layer_checkpointing`` says); ``layers``: decoder layers counted (default: the model's);
    ``attention_width``: the head width the attention computes at (default ``shape.head_dim``; the Triton
    kernels': their tiles', ``attention.kernel_head_dim``; latent pages': the latent's)."""
    layers = shape.num_layers if layers is None else layers
    h = shape.hidden_size
    down = h * shape.mean_mlp_width  # the MLP's down projection: a third of its weights
    checkpointing = config.layer_checkpointing is True
    tiled = (
        not reference and config.mlp_tile is not None and config.mlp_tile < min(config.chunk_size, seq_len)
    )
    passes = (3 if reference else 4) + checkpointing
    mlp = 3 * down * passes + 3 * down * tiled
    mlp -= down * (checkpointing and not tiled)  # the checkpoint's recompute stops before it
    # the counted layers' token mixers and MLPs (a ChunkModel's MLP-only blocks have no attention projections)
    mixing, mlps = (round(layers * n / shape.num_layers) for n in (shape.mixing_layers, shape.mlps))
    head_passes = 3 if reference else 4
    layer_flops = mixing * shape.attention_params * passes + mlps * mlp
    dense = 2 * batch * seq_len * (layer_flops + shape.vocab_size * h * head_passes)

    windows = list(shape.windows or [None] * shape.paged_layers)
    windows = windows[
        : round(layers * len(windows) / shape.num_layers)
    ]  # the counted layers' attention layers
    chunks = math.ceil(seq_len / config.chunk_size)
    past_cap = math.inf if config.page_budget is None else config.page_budget * config.page_size
    attention = 0.0
    for window, count in Counter(windows).items():  # layers of one window see the same pairs
        if reference:  # dense, every pair in each forward
            forward = _pairs(seq_len, seq_len, window, math.inf)[0]
            again = forward if checkpointing else 0.0
        else:  # again: the recompute's pairs (a kept chunk's forward result is reused)
            kept = config.reused_chunks(chunks)
            forward, again = _pairs(seq_len, config.chunk_size, window, past_cap, first_again=chunks - kept)
        attention += count * (forward * (1 + ATTENTION_BACKWARD) + again)
    width = shape.head_dim if attention_width is None else attention_width
    return dense, 4 * width * shape.num_heads * batch * attention


def _pairs(seq_len: int, chunk: int, window: int | None, past_cap: float, first_again: int = 0):
    """``(pairs, pairs of chunks < first_again)``: the query-key pairs of a layer the queries see, chunk by chunk
    (``past_cap``: keys before its chunk a query may see: a sparse step's budget), in closed form per chunk."""
    total = again = 0
    for index, start in enumerate(range(0, seq_len, chunk)):
        pairs = _chunk_pairs(min(chunk, seq_len - start), window, min(start, past_cap))
        total += pairs
        again += pairs if index < first_again else 0
    return float(total), float(again)


def _chunk_pairs(queries: int, window: int | None, past: float) -> int:
    """Pairs of a chunk's ``queries``: query ``j`` sees ``min(j + 1, window)`` keys of its chunk and
    ``min(max(window - 1 - j, 0), past)`` before it (``past``: the earlier keys it may see)."""
    past = int(past)
    if window is None or window >= queries + past:  # no key out of the window: causal within, all of the past
        return queries * (queries + 1) // 2 + queries * past
    own = min(queries, window)
    own = own * (own + 1) // 2 + (queries - own) * window
    reaching = min(queries, max(window - 1, 0))  # queries whose window reaches before the chunk
    capped = min(max(window - past, 0), reaching)  # ... of which see all ``past`` keys
    rest = reaching - capped  # the others see window - 1 - j keys, j = capped .. reaching - 1
    return own + capped * past + rest * (window - 1) - (capped + reaching - 1) * rest // 2


def copy_bytes(
    seq_len: int,
    config: OOMBConfig,
    host_layers: int,
    kv_bytes: float,
    grad_bytes: float,
    parked: float = 0.0,
    reused: float = 0.0,
    tails: float = 0.0,
) -> float:
    """Bytes a step moves between host and device: each of ``host_layers`` (offload) writes its K/V to the host
    once and, per chunk, streams the earlier chunks' pages in (a sparse step: the selected ones, at most
    ``page_budget`` pages per query block) — K/V in the forward sweep, the recompute (not for a kept chunk) and the
    backward, gradient pages in and out in the backward (``kv_bytes``, ``grad_bytes``: per token, K and V); and
    what each chunk's recompute parks in host memory, out and back (``parked`` bytes per chunk:
    :mod:`~lightning_oomb.engine.parking`); ``reuse_attention``'s kept results, out in the forward sweep and back in
    the backward (``reused``: their bytes in all), and so the window layers' tails in host memory (``tails``: their
    bytes, ``PoolShape.tail_host_bytes``)."""
    chunk = config.chunk_size
    chunks = math.ceil(seq_len / chunk)
    first_kept = chunks - config.reused_chunks(chunks)
    streamed = recomputed = 0.0
    for index, start in enumerate(range(0, seq_len, chunk)):
        tokens = start if config.page_budget is None else min(start, config.page_budget * chunk)
        streamed += tokens
        recomputed += tokens if index < first_kept else 0
    per_layer = seq_len * kv_bytes + (2 * streamed + recomputed) * kv_bytes + 2 * streamed * grad_bytes
    return host_layers * per_layer + 2 * chunks * parked + 2 * reused + 2 * tails


def host_sum_bytes(
    chunks: int, accumulating: bool, matrix_elements: int, mirrored: bool = False
) -> tuple[float, float]:
    """``(bytes copied between device and host, bytes of host memory read and written)`` that the compute waits for
    in ``float32-host``'s flushes of a sweep of ``chunks`` chunks (:func:`~lightning_oomb.engine.grads.host_flushes`)
    summing ``matrix_elements`` 16-bit elements (:class:`~lightning_oomb.engine.grads.HostGradSums`): per flush but
    the last each element's 2 bytes copied out and — without the mirror (``mirrored``), whose adds run beside the
    compute — read and added into a float32 sum (4 read, 4 written); at the end each float32 sum copied in (4)."""
    flushes = host_flushes(chunks, accumulating)
    if not flushes:
        return 0.0, 0.0
    earlier = flushes - 1
    return matrix_elements * (2 * earlier + 4), 0.0 if mirrored else matrix_elements * 10 * earlier


ATTENTION_COLLECTIVES = (3, 4)  # per layer and chunk: 3 per attention forward, 4 for its backward


def context_sent(
    num_heads: int, head_dim: int, batch: int, rows: list[int], q_bytes: int, acc_bytes: int, forwards: int
) -> dict[str, float]:
    """Bytes one rank contributes per layer and chunk to each collective of context parallelism (the engine's
    ``ContextGroup.sent`` counts them: ``benchmarks/cp_model.py`` checks the two equal): ``rows``, the chunk's
    tokens on each rank; ``q_bytes``, the activations' itemsize; ``acc_bytes``, the attention's accumulators';
    ``forwards``, attention forwards of the chunk (each all-gathers the queries, all-reduces the row maxima and
    reduce-scatters the accumulators with their normalisers); its backward all-gathers Q, dO and (LSE, delta) and
    reduce-scatters dQ."""
    size, rowwise = len(rows), batch * num_heads * max(rows)  # one value per (padded) own query row
    return {
        "all_gather": forwards * rowwise * head_dim * q_bytes
        + rowwise * (2 * head_dim * q_bytes + 2 * acc_bytes),
        "all_reduce_max": forwards * batch * num_heads * sum(rows) * acc_bytes,
        "reduce_scatter": forwards * size * rowwise * (head_dim + 1) * acc_bytes
        + size * rowwise * head_dim * acc_bytes,
    }


def collective_seconds(sent: dict[str, float], size: int, forwards: int, rates: StepRates) -> float:
    """Seconds on the link for one rank's ``sent`` under ring collectives (an all-gather sends ``size - 1`` parts, a
    reduce-scatter ``(size - 1) / size`` of its buffer, an all-reduce twice that), with each call's latency."""
    if size == 1:
        return 0.0
    wire = (size - 1) * sent["all_gather"] + 2 * (size - 1) / size * sent["all_reduce_max"]
    wire += (size - 1) / size * sent["reduce_scatter"]
    calls = ATTENTION_COLLECTIVES[0] * forwards + ATTENTION_COLLECTIVES[1]
    return wire / rates.link_bytes + calls * rates.link_latency_s


def context_seconds(
    shape: ModelShape,
    seq_len: int,
    config: OOMBConfig,
    batch: int,
    devices: int,
    rates: StepRates,
    q_bytes: int,
    acc_bytes: int,
    grad_bytes: float,
) -> float:
    """A rank's seconds in context parallelism's collectives per step, not overlapped with compute (they are
    synchronous as built): per attention layer and chunk those of :func:`context_sent` (two attention forwards, one
    for a chunk whose forward result is kept: ``reuse_attention``), and the gradients' all-reduce of ``grad_bytes``
    (once per optimizer step: a micro-batch's share under gradient accumulation)."""
    chunks = math.ceil(seq_len / config.chunk_size)
    kept = config.reused_chunks(chunks)
    rows = [math.ceil(min(config.chunk_size, seq_len) / devices)] * devices
    per_chunk = {
        forwards: collective_seconds(
            context_sent(shape.num_heads, shape.head_dim, batch, rows, q_bytes, acc_bytes, forwards),
            devices,
            forwards,
            rates,
        )
        for forwards in (1, 2)
    }
    layers = shape.paged_layers * ((chunks - kept) * per_chunk[2] + kept * per_chunk[1])
    return layers + 2 * (devices - 1) / devices * grad_bytes / rates.link_bytes


def step_time(
    dense: float, attention: float, copies: float, rates: StepRates, summed: tuple[float, float] = (0.0, 0.0)
) -> float:
    """Seconds of a step of ``dense`` matmul and ``attention`` FLOPs moving ``copies`` bytes, with ``summed``
    (:func:`host_sum_bytes`) of ``float32-host``'s flushes (the module docstring)."""
    compute = max(dense / rates.dense_flops + attention / rates.attention_flops, copies / rates.copy_bytes)
    return compute + max(summed[0] / rates.copy_bytes, summed[1] / rates.host_bytes)
