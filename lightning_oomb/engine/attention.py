"""The attention op: a chunk's queries against all stored pages of its layer, as an autograd Function.

``paged_attention(q, k, v, chunk, layer, scale, window, softcap, sinks, block) -> out`` with ``q [B, Hq, Lq, D]``
and the chunk's own post-RoPE ``k, v [B, Hkv, Lq, D]``; ``softcap`` caps the scores (``c * tanh(s / c)``), ``sinks [Hq]``
(a parameter; it gets its gradient) adds one logit per query head to every row's softmax. In the forward sweep ``k, v`` are first written into the pool, so the kernels
see one uniform paged sequence ``[0, chunk.start + Lq)`` with lower-right causal alignment. Backward computes dQ,
**adds** dK/dV of every page read into the pool's gradient pages (the chunk's own pages included), and returns
the chunk's accumulated gradient pages as the gradient of ``k, v`` — they already hold every later chunk's
contribution because the backward sweep runs chunks in reverse.

Sparse steps (``page_budget``): each layer call's page selection (:mod:`lightning_oomb.engine.sparse`) is made
once in the forward sweep, from the pool's page summaries, and handed to the kernels as ``page_select`` in the
forward, the recompute and the backward alike.

Dispatch is choosing a module with the contract's two functions (``csrc_triton.contract``): the Triton kernels
(``csrc_triton.paged_attention``) for CUDA tensors, torch's fused CPU attention
(:mod:`lightning_oomb.engine.cpu_attention`, the reference for the calls it does not cover) for CPU tensors, the
plain-torch reference (:mod:`lightning_oomb.engine.reference`, the oracle) elsewhere; ``OOMBConfig.attention_backend``
or the environment variable ``OOMB_ATTENTION_BACKEND`` (``auto`` | ``torch`` | ``cpu`` | ``triton``) forces one.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field
from types import ModuleType
from typing import Literal

import torch
import torch.nn.functional as F

from lightning_oomb.engine import context, cpu_attention, reference
from lightning_oomb.engine.config import check_backend_name
from lightning_oomb.engine.errors import OOMBConfigError
from lightning_oomb.engine.kv_pool import KVPool
from lightning_oomb.engine.lse import add_sinks, finish_state, init_state, sink_grad
from lightning_oomb.engine.pages import PagedKV, PoolShape
from lightning_oomb.engine.parking import ParkedTensor
from lightning_oomb.engine.results import ForwardResults
from lightning_oomb.engine.sparse import Probe, Selection, SparseStep, select_pages
from lightning_oomb.engine.states import ChunkStates

Backend = Literal["torch", "cpu", "triton"]
_DEVICE_OF = {
    "cpu": ("cpu", "torch's fused CPU attention takes CPU tensors"),
    "triton": ("cuda", "the Triton kernels need CUDA"),
}


@dataclass
class ChunkContext:
    """Travels with one model call (an extra keyword of the call): where the chunk sits and where K/V go.

    ``shape``: the step's pool shape without the K/V dtype (the first chunk written decides it). ``step_loss``: the
    step's extra loss term, if the model has one (:class:`lightning_oomb.engine.model.StepLoss`). ``doc_start``:
    packed documents, each of the chunk's tokens' document start ``[B, L]``; ``key_floor``: no query of the chunk
    sees a key before it (its earliest document start). ``sparse``: the step's selections (a sparse step).
    ``context``: context parallelism — this rank runs its slice of the chunk, whose queries are attended across the
    group (:mod:`lightning_oomb.engine.context`); ``start`` stays the chunk's absolute start. ``kept``: the backward
    sweep's attention results of the chunk's recompute per layer, until the layer's backward (:class:`Kept`);
    ``park_kept``: they wait in host memory (offload with per-layer checkpointing).
    ``states``: a model with recurrent / convolution layers — the states they carry into and out of the chunk
    (:mod:`lightning_oomb.engine.states`). ``tokens``: right padding — which of the call's tokens ``[B, L]`` are real
    (``None``: all; e.g. a router's balancing loss counts only those). ``results``: ``reuse_attention`` — the
    forward sweep keeps this chunk's (``index``-th of ``chunks``) results there, the backward sweep's recompute
    takes them (:mod:`lightning_oomb.engine.results`). ``written``: the layers whose K/V this forward or eval pass
    over the chunk has stored (a second call with one of them is refused); ``shared``: the K/V those of them that
    other layers read (``PoolShape.layer_sources``) were called with, which those layers' calls must pass.
    """

    pool: KVPool
    shape: PoolShape
    start: int
    sweep: Literal["forward", "backward", "eval"]
    backend: Backend
    step_loss: object | None = None
    doc_start: torch.Tensor | None = None
    key_floor: int = 0
    sparse: SparseStep | None = None
    context: context.ContextChunk | None = None
    kept: dict[int, Kept] | None = None
    park_kept: bool = False
    states: ChunkStates | None = None
    tokens: torch.Tensor | None = None
    results: ForwardResults | None = None
    index: int = 0
    chunks: int = 0
    written: set[int] = field(default_factory=set, repr=False)
    shared: dict[int, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict, repr=False)


@dataclass(frozen=True)
class Kept:
    """One layer's attention result in a chunk's recompute. With per-layer checkpointing the layer's forward runs
    twice in the backward sweep (the chunk's recompute, then the checkpoint's right before the layer's backward);
    the second call takes this instead of attending again (same queries, same pages: the same result), so a step
    attends twice forward, as full-sequence training with checkpointing does, and streams no page twice. Held until
    the layer's backward: ``O(chunk)`` per layer under checkpointing, nothing extra without it (the same tensors
    are saved for the backward). Parked (``offload``), ``out`` and ``lse`` are
    :class:`~lightning_oomb.engine.parking.ParkedTensor` s."""

    out: torch.Tensor | ParkedTensor
    lse: torch.Tensor | ParkedTensor
    select: torch.Tensor | None

    @property
    def parked(self) -> bool:
        return isinstance(self.out, ParkedTensor)

    def park(self) -> Kept:
        """This result in host memory (``offload``: ``O(chunk)`` per layer off the device until the layer's
        backward; the small page selection stays), copied on the parking stream."""
        return Kept(ParkedTensor.out_of(self.out), ParkedTensor.out_of(self.lse), self.select)

    def prefetch(self) -> None:
        """A parked result starts back to its device ahead of :meth:`restore` (CUDA)."""
        if self.parked:
            self.out.prefetch()
            self.lse.prefetch()

    def restore(self) -> Kept:
        """The result on its device."""
        return Kept(self.out.take(), self.lse.take(), self.select) if self.parked else self


def _take_kept(chunk: ChunkContext, layer: int) -> Kept | None:
    """The layer's result kept for its checkpoint recompute, on its device (``None``: none kept, the chunk's
    recompute itself); the result of the next layer down, which the backward needs next, starts back meanwhile."""
    kept = chunk.kept.pop(layer, None) if chunk.kept is not None else None
    if kept is None:
        return None
    below = max((other for other in chunk.kept if other < layer), default=None)
    if below is not None:
        chunk.kept[below].prefetch()
    return kept.restore()


def resolve_backend(name: str, device: torch.device) -> Backend:
    """``auto`` -> Triton on CUDA, the fused CPU path on CPU, the torch reference elsewhere;
    ``OOMB_ATTENTION_BACKEND`` overrides ``auto``. ``cpu`` or ``triton`` on a device they cannot run on is refused
    (the Triton interpreter, for tests, runs the kernels on CPU tensors)."""
    source = f"attention_backend={name!r}"
    if name == "auto" and "OOMB_ATTENTION_BACKEND" in os.environ:
        name = os.environ["OOMB_ATTENTION_BACKEND"]
        source = f"the environment variable OOMB_ATTENTION_BACKEND={name!r} (over attention_backend='auto')"
    check_backend_name(name)
    if name == "auto":
        return {"cuda": "triton", "cpu": "cpu"}.get(device.type, "torch")
    interpreted = name == "triton" and os.environ.get("TRITON_INTERPRET") == "1"
    if name in _DEVICE_OF and device.type != _DEVICE_OF[name][0] and not interpreted:
        fix = (
            "unset OOMB_ATTENTION_BACKEND"
            if source.startswith("the environment")
            else "use attention_backend='auto'"
        )
        raise OOMBConfigError(
            f"{source} cannot run on a {device.type} device — {_DEVICE_OF[name][1]} — {fix} (or 'torch')."
        )
    return name


def check_kernel_shapes(backend: Backend, page_size: int) -> None:
    """Refuse, before any work, a page size the chosen backend cannot take."""
    if backend == "triton" and (page_size < 16 or page_size & (page_size - 1)):
        raise OOMBConfigError(
            f"page_size={page_size} cannot be used with the Triton attention kernels — their tiles need a power of "
            "two >= 16 — use page_size=128 (or another power of two >= 16)."
        )


def stored_head_dim(backend: Backend, head_dim: int) -> int:
    """The pages' head dim for a model's ``head_dim``: the head dim itself on every backend — the Triton kernels
    tile it at the next power of two (``csrc_triton.paged_attention.tile_width``) but read and write only its
    columns (Phi-3's 96, DeepSeek's multi-head latent attention's 192 and latent pages' 576 were stored at 128, 256
    and 1024), and the op's q, output and saved tensors are as wide."""
    return head_dim


def kernel_head_dim(backend: Backend, head_dim: int) -> int:
    """The head width the backend's attention computes at: the Triton kernels' tiles
    (``csrc_triton.paged_attention.tile_width``: the next power of two), else ``head_dim``."""
    if backend != "triton":
        return head_dim
    from csrc_triton.paged_attention import tile_width

    return tile_width(head_dim)


def kernels(backend: Backend) -> ModuleType:
    """The module implementing the backend's ``paged_attention_forward`` / ``paged_attention_backward``."""
    if backend == "triton":
        from csrc_triton import paged_attention

        return paged_attention
    return cpu_attention if backend == "cpu" else reference


def _first_key(chunk: ChunkContext, window: int | None) -> int:
    """The first key any query of the chunk sees (its window's and its documents' starts)."""
    return max(chunk.key_floor, 0 if window is None else chunk.start - window + 1)


def _whole(kv: PagedKV, num_keys: int) -> bool:
    return kv.keys is None or kv.keys == (0, num_keys)


def attend(
    backend: Backend, q, parts, q_start: int, scale: float, window, softcap=None, sinks=None, docs=None,
    select=None, probe: Probe | None = None,
):  # fmt: skip
    """``(out, lse)`` of ``q`` over the key parts of :meth:`KVPool.parts`: one call for a part holding every key,
    else each part folded into one running softmax state (the log-sum-exp merge), and the sinks folded in last.
    ``docs``: the queries' document starts (packed rows); ``select``: their page selection (sparse)."""
    ops, num_keys, state = kernels(backend), q_start + q.shape[2], None
    terms = {"softcap": softcap, "doc_start": docs, "page_select": select}
    dense = None
    for kv in parts:
        if state is None and sinks is None and probe is None and _whole(kv, num_keys):
            return ops.paged_attention_forward(q, kv.k, kv.v, kv.page_table, q_start, scale, window, **terms)
        if state is None:
            state = init_state(q)
        ops.paged_attention_forward(
            q, kv.k, kv.v, kv.page_table, q_start, scale, window, key_range=kv.keys, state=state, **terms
        )
        if probe is not None:
            dense = _probe_part(ops, q, kv, q_start, probe, scale, window, softcap, docs, dense)
    if probe is not None:
        probe.sparse_lse = (state[1] + torch.log(state[2]))[..., probe.lo : probe.hi]
        probe.dense_lse = dense[1] + torch.log(dense[2])
    if sinks is not None:
        add_sinks(state, sinks)
    return finish_state(state, q.dtype)


def _probe_part(ops, q, kv: PagedKV, q_start: int, probe: Probe, scale, window, softcap, docs, state):
    """Fold the part's keys that the probe rows can see into their dense state (made at the first part)."""
    rows = q[:, :, probe.lo : probe.hi]
    start, end = q_start + probe.lo, q_start + probe.hi
    lo, hi = kv.keys or (0, q_start + q.shape[2])
    if state is None:
        state = init_state(rows)
    if lo < end:
        docs = None if docs is None else docs[:, probe.lo : probe.hi].contiguous()
        ops.paged_attention_forward(
            rows.contiguous(), kv.k, kv.v, kv.page_table, start, scale, window, key_range=(lo, min(hi, end)),
            state=state, softcap=softcap, doc_start=docs,
        )  # fmt: skip
    return state


def attend_backward(
    backend: Backend, q, out, lse, dout, parts, q_start: int, scale: float, window, softcap=None, delta=None,
    docs=None, select=None,
):  # fmt: skip
    """``dq``, adding dK/dV into every part's gradient pages; dQ is summed over the parts. ``delta``: a precomputed
    ``rowsum(dout * out)`` (else computed once, by the backend: the Triton pre-pass kernel)."""
    ops, num_keys, dq = kernels(backend), q_start + q.shape[2], None
    terms = {"softcap": softcap, "doc_start": docs, "page_select": select}
    for kv in parts:
        pages = (kv.k, kv.v, kv.dk, kv.dv, kv.page_table)
        if dq is None and _whole(kv, num_keys):
            return ops.paged_attention_backward(
                q, out, lse, dout, *pages, q_start, scale, window, delta=delta, **terms
            )
        if dq is None:
            delta = ops.attention_delta(out, dout) if delta is None else delta
            dq = torch.zeros(q.shape, dtype=delta.dtype, device=q.device)
        ops.paged_attention_backward(
            q, out, lse, dout, *pages, q_start, scale, window, key_range=kv.keys, delta=delta, dq=dq, **terms
        )
    return dq.to(q.dtype)


class PagedAttention(torch.autograd.Function):
    """Thin Function around the kernels: saves ``q, out, lse`` (and the chunk's ``k, v`` for a host-tier layer,
    restaged on the device for the backward); no math of its own."""

    @staticmethod
    def forward(ctx, q, k, v, chunk: ChunkContext, layer: int, scale: float, window, softcap, sinks):
        pool = chunk.pool
        if chunk.sweep != "backward":  # the backward sweep's recompute writes nothing new
            _claim(chunk, layer, k)
        kept = _take_kept(chunk, layer)
        if chunk.context is not None:
            return _forward_across_group(ctx, q, k, v, chunk, layer, scale, window, softcap, sinks, kept)
        reused = _reused(chunk, layer) if kept is None else None
        if kept is not None:  # the layer's checkpoint recompute
            out, lse, select = kept.out, kept.lse, kept.select
        elif reused is not None:
            out, lse, select = reused
        else:
            pool.write(layer, chunk.start, k, v, window)
            out, lse, select = _attend_call(q, chunk, layer, scale, window, softcap, sinks)
            _keep(chunk, layer, out, lse, select)
        ctx.save_for_backward(q, out, lse, sinks, select, *((k, v) if pool.restages(layer) else ()))
        ctx.args = (chunk, layer, scale, window, softcap, k.dtype)
        return out.detach()  # a fresh alias: a kept result is returned by two calls

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, dout):
        chunk = ctx.args[0]
        if chunk.context is not None:
            return _backward_across_group(ctx, dout)
        q, out, lse, sinks, select, *kv = ctx.saved_tensors
        chunk, layer, scale, window, softcap, kv_dtype = ctx.args
        chunk.kept.pop(layer, None)  # a layer not checkpointed: its result was kept for nothing
        pool = chunk.pool
        if kv:
            pool.write(layer, chunk.start, *kv, window)
        first_key = _first_key(chunk, window)
        # the kernels add into each part's dk, dv
        parts = pool.parts(layer, chunk.start + q.shape[2], True, first_key, _selected_blocks(chunk, layer))
        dout = dout.contiguous()
        with torch.autocast(q.device.type, enabled=False):
            delta = kernels(chunk.backend).attention_delta(out, dout) if sinks is not None else None
            dq = attend_backward(
                chunk.backend,
                q,
                out,
                lse,
                dout,
                parts,
                chunk.start,
                scale,
                window,
                softcap,
                delta,
                chunk.doc_start,
                select,
            )
            dsinks = sink_grad(sinks, lse, delta) if sinks is not None and ctx.needs_input_grad[8] else None
        dk, dv = _kv_grads(pool.read_grad(layer, chunk.start, q.shape[2]), kv_dtype, pool.shape)
        return dq, dk, dv, None, None, None, None, None, dsinks


def _kv_grads(grads, dtype: torch.dtype, shape: PoolShape) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """The chunk's ``dk, dv`` in the K/V dtype, or ``(None, None)`` for a layer that reads another's pages: its
    adds went into them, and that layer's call returns them (both calls have the same ``k, v``); where values are
    keys (``PoolShape.values_are_keys``: the call's ``v`` is its ``k``) ``(dk + dv, None)``, the pages' one sum."""
    if grads is None:
        return None, None
    dk, dv = (g.to(dtype) for g in grads)
    return (dk, None) if shape.values_are_keys else (dk, dv)


def _claim(chunk: ChunkContext, layer: int, k: torch.Tensor) -> None:
    """Record that this forward or eval pass over the chunk stores ``layer``'s K/V; the sweep's first call sizes the
    pool for its K/V dtype. A layer stored before in this pass, or K/V of another dtype, is refused: either would
    overwrite pages that earlier calls' gradients are read from. (The backward sweep repeats the pass: it claims
    nothing, as it writes nothing new.)"""
    if layer in chunk.written:
        raise OOMBConfigError(
            f"paged_attention was called twice with layer={layer} in one chunk — each call stores the chunk's K/V "
            "in its layer's pages, so the second call overwrites the first's and the gradients come out wrong — "
            f"each paged_attention call needs its own layer index in 0..num_layers-1; num_layers counts attention "
            f"calls (the model declares {chunk.shape.num_layers}: two calls in one layer take two indices)."
        )
    pool, shape = chunk.pool, chunk.shape.for_dtype(k.dtype)
    if chunk.index == 0 and not chunk.written:  # the sweep's first call: a new step, maybe a new dtype
        if not pool.holds(shape):
            pool.reserve(shape, k.device)
    elif not pool.holds(shape):
        raise OOMBConfigError(
            f"layer {layer} passes {k.dtype} keys and values but this step's first attention call passed "
            f"{pool.shape.dtype} — every layer's pages live in one pool of one dtype — cast q, k and v to one dtype "
            "before paged_attention in every layer (and its output back, if the layer needs another)."
        )
    chunk.written.add(layer)


def _check_call(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, chunk: ChunkContext, layer: int) -> None:
    """Refuse a call whose layer index or tensor shapes do not fit the chunk and the model's declared shape (shape
    reads only: it runs on every call)."""
    shape = chunk.shape
    if not 0 <= layer < shape.num_layers:
        raise OOMBConfigError(
            f"paged_attention was called with layer={layer} but the model declares num_layers={shape.num_layers} — "
            "the pool holds pages for layers 0..num_layers-1 only — each paged_attention call needs its own layer "
            "index in 0..num_layers-1; num_layers counts attention calls."
        )
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        raise OOMBConfigError(
            f"layer {layer} calls paged_attention with {_shapes(q, k, v)} — it takes q [batch, heads, tokens, "
            "head_dim] and k, v [batch, kv_heads, tokens, head_dim] — view the projections per head and transpose "
            "[B, L, H, D] to [B, H, L, D] with .transpose(1, 2)."
        )
    if not q.dtype == k.dtype == v.dtype or not q.device == k.device == v.device:
        raise OOMBConfigError(
            f"layer {layer} calls paged_attention with q {q.dtype} on {q.device}, k {k.dtype} on {k.device}, v "
            f"{v.dtype} on {v.device} — the op (like torch's scaled_dot_product_attention) takes q, k and v of one "
            "dtype on one device — cast them to one dtype (and move them to one device) before the call."
        )
    if k.shape != v.shape:
        raise OOMBConfigError(
            f"layer {layer} calls paged_attention with {_shapes(q, k, v)}: keys and values of different shapes — "
            "one page pool holds both, in one shape — values with another head dim than the keys (or other head "
            "counts) are not supported: train this model with another strategy."
        )
    rows = (
        max(chunk.context.own, 1)
        if chunk.context is not None
        else min(shape.chunk_size, shape.seq_len - chunk.start)
    )
    want = (shape.batch, rows, shape.call_head_dim_of(layer))
    if (q.shape[0], q.shape[2], q.shape[3]) != want or (k.shape[0], k.shape[2], k.shape[3]) != want:
        raise OOMBConfigError(
            f"layer {layer} calls paged_attention with {_shapes(q, k, v)} but the chunk has batch {shape.batch} "
            f"and {rows} tokens, and the model declares head_dim={want[2]} — every call attends the whole chunk "
            "with the declared head dim — pass the chunk's q, k, v as [batch, heads, tokens, head_dim] (or correct "
            "the model's head_dim)."
        )
    if q.shape[1] % k.shape[1]:
        raise OOMBConfigError(
            f"layer {layer} calls paged_attention with {q.shape[1]} query heads and {k.shape[1]} KV heads — each KV "
            "head serves a group of query heads — use a multiple of the KV heads for the query heads."
        )


def _check_shared(k: torch.Tensor, v: torch.Tensor, chunk: ChunkContext, layer: int) -> None:
    """A layer that reads another's pages (``PoolShape.layer_sources``) must pass the K/V that layer was called with
    in this chunk (Gemma 4's KV-sharing layers pass the very tensors): its pages hold those, and its call returns
    their gradients for both. A source's K/V are recorded for its readers."""
    shape = chunk.shape
    if not 0 <= layer < shape.num_layers:
        return  # (refused by _check_call)
    source = shape.source_of(layer)
    if source == layer:
        if layer in shape.layer_sources:
            chunk.shared[layer] = (k, v)
        return
    passed = chunk.shared.get(source)
    if passed is None:
        why = f"before layer {source} was called in the chunk"
    elif not all(a is b or (a.shape == b.shape and torch.equal(a, b)) for a, b in zip(passed, (k, v))):
        why = f"other than layer {source}'s"
    else:
        return
    raise OOMBConfigError(
        f"layer {layer} is declared to read layer {source}'s pages (layer_kv_sources: it stores no K/V of its own) "
        f"but its call passes keys and values {why} — the pages hold that layer's, so the step would attend the "
        "wrong keys — declare only layers that pass the very K/V of an earlier layer in the same chunk (or drop "
        "layer_kv_sources: every layer then keeps its own pages)."
    )


def _autocast(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Under autocast, ``q, k, v`` in its dtype, as autocast casts ``scaled_dot_product_attention``'s (16- and
    32-bit floats; float64 kept): a model's norms may leave ``q, k`` in float32 beside a bfloat16 ``v``."""
    device = q.device.type
    if not torch.is_autocast_enabled(device):
        return q, k, v
    dtype = torch.get_autocast_dtype(device)
    return tuple(x.to(dtype) if x.dtype in _AUTOCAST_CASTS else x for x in (q, k, v))


_AUTOCAST_CASTS = (torch.float32, torch.float16, torch.bfloat16)


def _shapes(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> str:
    return f"q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}"


def _attend_call(q, chunk: ChunkContext, layer: int, scale, window, softcap, sinks):
    """``(out, lse, page selection)`` of one call on one device (the chunk's own K/V already written)."""
    pool = chunk.pool
    with torch.autocast(q.device.type, enabled=False):
        selection = _selection(chunk, layer, q, window)
        select = None if selection is None else selection.pages
        probe = (
            None
            if selection is None
            else chunk.sparse.probe_rows(
                selection, chunk.shape.page_size, q.shape[2], chunk.sweep, pool.streams(layer)
            )
        )
        blocks = _selected_blocks(chunk, layer, selection)
        parts = pool.parts(
            layer, chunk.start + q.shape[2], first_key=_first_key(chunk, window), blocks=blocks
        )
        out, lse = attend(chunk.backend, q, parts, chunk.start, scale, window, softcap, sinks, chunk.doc_start,
                          select, probe)  # fmt: skip
        if probe is not None:
            real = None if chunk.tokens is None else chunk.tokens[:, probe.lo : probe.hi]
            chunk.sparse.add_recall(probe.sparse_lse, probe.dense_lse, real)
    return out, lse, select


def _keep(chunk: ChunkContext, layer: int, out, lse, select) -> None:
    """Keep a layer's new result: in the backward sweep's chunk recompute for the layer's checkpoint recompute; in
    the forward sweep of a chunk whose results the backward sweep takes (``reuse_attention``), in host memory."""
    if chunk.kept is not None:
        kept = Kept(out, lse, select)
        chunk.kept[layer] = kept.park() if chunk.park_kept else kept
    if chunk.results is not None:
        chunk.results.put(chunk.index, layer, out, lse, select, chunk.chunks)


def _reused(chunk: ChunkContext, layer: int):
    """``(out, lse, page selection)`` the forward sweep kept for this backward-sweep recompute (``reuse_attention``;
    also kept for the layer's checkpoint recompute: parked already), or ``None``."""
    if chunk.results is None or chunk.sweep != "backward":
        return None
    out, lse, select, host = chunk.results.take(chunk.index, layer)
    if chunk.kept is not None and chunk.park_kept:
        # its host copy, valid after the fetch the current stream waited for: it can come back ahead too
        ready = torch.cuda.current_stream(out.device).record_event() if out.is_cuda else None
        chunk.kept[layer] = Kept(*(ParkedTensor(t, out.device, ready) for t in host), select)
    elif chunk.kept is not None:
        chunk.kept[layer] = Kept(out, lse, select)
    return out, lse, select


def _forward_across_group(ctx, q, k, v, chunk: ChunkContext, layer, scale, window, softcap, sinks, kept):
    """The forward of a context-parallel call: this rank's slice (``own`` rows; a stand-in rank has none and
    returns zeros for its one token). A ``kept`` result skips the group's attention (every rank has one)."""
    cp, pool = chunk.context, chunk.pool
    own = cp.own
    rows = q[:, :, :own]
    reused = _reused(chunk, layer) if kept is None else None
    if kept is not None:
        out, lse, select = kept.out, kept.lse, kept.select
    elif reused is not None:  # every rank of the group takes its own: no rank attends
        out, lse, select = reused
    else:
        if own:
            pool.write(layer, cp.local_start, k, v, window)
        out, lse, select = _attend_across_group(
            chunk, layer, rows, k[:, :, :own], scale, window, softcap, sinks
        )
        _keep(chunk, layer, out, lse, select)
    ctx.save_for_backward(rows, out, lse, sinks, select, *((k, v) if own and pool.restages(layer) else ()))
    ctx.args = (chunk, layer, scale, window, softcap, k.dtype)
    return _rows_like(out, q).detach()


def _attend_across_group(chunk: ChunkContext, layer, rows, k, scale, window, softcap, sinks):
    with torch.autocast(rows.device.type, enabled=False):
        return context.attend_forward(kernels(chunk.backend), chunk.context, chunk.pool, layer, rows, k, chunk.start,
                                      scale, window, softcap, sinks, chunk.doc_start, chunk.sparse,
                                      chunk.sweep, chunk.backend, _first_key(chunk, window))  # fmt: skip


def _backward_across_group(ctx, dout):
    rows, out, lse, sinks, select, *kv = ctx.saved_tensors
    chunk, layer, scale, window, softcap, kv_dtype = ctx.args
    chunk.kept.pop(layer, None)
    cp, pool = chunk.context, chunk.pool
    own = cp.own
    if kv:
        pool.write(layer, cp.local_start, *kv, window)
    grads_out = dout[:, :, :own].contiguous()
    with torch.autocast(dout.device.type, enabled=False):
        delta = kernels(chunk.backend).attention_delta(out, grads_out)
        dq = context.attend_backward(kernels(chunk.backend), cp, pool, layer, rows, lse, grads_out, delta,
                                     chunk.start, scale, window, softcap, chunk.doc_start, select,
                                     _first_key(chunk, window))  # fmt: skip
        dsinks = sink_grad(sinks, lse, delta) if sinks is not None and ctx.needs_input_grad[8] else None
    if own:
        dk, dv = _kv_grads(pool.read_grad(layer, cp.local_start, own), kv_dtype, pool.shape)
    else:  # the stand-in's token: no keys stored, no gradient
        shape = pool.shape
        dk = dv = dout.new_zeros(
            (dout.shape[0], shape.heads_of(layer), dout.shape[2], shape.head_dim_of(layer)), dtype=kv_dtype
        )
    return _rows_like(dq.to(rows.dtype), dout), dk, dv, None, None, None, None, None, dsinks


def _rows_like(x: torch.Tensor, like: torch.Tensor, rows: int | None = None) -> torch.Tensor:
    """``x [B, H, n, D]`` padded with zero rows to ``rows`` (default: ``like``'s)."""
    rows = like.shape[2] if rows is None else rows
    return torch.nn.functional.pad(x, (0, 0, 0, rows - x.shape[2])) if x.shape[2] < rows else x


def _selection(chunk: ChunkContext, layer: int, q: torch.Tensor, window) -> Selection | None:
    """The call's page selection in a sparse step: made now (forward, eval) or the forward sweep's (backward)."""
    sparse = chunk.sparse
    if sparse is None:
        return None
    page = chunk.shape.page_size

    def make() -> Selection:
        with torch.no_grad():
            summaries = chunk.pool.summaries(layer, chunk.start // page)
            return select_pages(q, summaries, chunk.start, page, sparse.budget, window, chunk.doc_start,
                                chunk.backend, chunk.tokens)  # fmt: skip

    return sparse.select(layer, chunk.start, chunk.sweep, make)


def _selected_blocks(chunk: ChunkContext, layer: int, selection: Selection | None = None) -> dict | None:
    """A sparse call's offload blocks holding a selected page, with those pages (the stored selection unless
    given; ``None``: all) — only for a streamed (host-tier) layer: finding them reads the selection on the host."""
    if chunk.sparse is None or not chunk.pool.streams(layer):
        return None
    selection = selection or chunk.sparse.selections.get((layer, chunk.start))
    return None if selection is None else selection.blocks(chunk.shape.block_pages)


def _in_blocks(chunk: ChunkContext, block: int, device: torch.device) -> ChunkContext:
    """The chunk as a chunked-attention call sees it (one context per call, sharing the chunk's state): its
    documents cut every ``block`` tokens from their starts, as documents of their own."""
    if block < 1:
        raise OOMBConfigError(
            f"paged_attention was called with block={block} — a chunked-attention span is a positive number of "
            "tokens — pass the layer's span (transformers' attention_chunk_size), or block=None for causal attention."
        )
    if chunk.context is not None:  # the whole chunk's tokens, every rank's slice
        rows = sum(chunk.context.lengths)
    else:
        rows = min(chunk.shape.chunk_size, chunk.shape.seq_len - chunk.start)
    index = torch.arange(chunk.start, chunk.start + rows, device=device, dtype=torch.int32)
    docs = chunk.doc_start
    if docs is None:
        starts = (index // block * block).expand(chunk.shape.batch, rows).contiguous()
        return dataclasses.replace(
            chunk, doc_start=starts, key_floor=max(chunk.key_floor, chunk.start // block * block)
        )
    starts = docs + (index.to(docs.dtype) - docs) // block * block
    return dataclasses.replace(chunk, doc_start=starts.contiguous())


@torch.compiler.disable
def paged_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    chunk: ChunkContext,
    layer: int,
    scale: float | None,
    window: int | None = None,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
    block: int | None = None,
) -> torch.Tensor:
    """Attention of a chunk's ``q [B, Hq, Lq, D]`` over its layer's pages plus its own ``k, v``; ``[B, Hq, Lq, D]``.

    ``scale``: the scores' factor (``None``: ``1 / sqrt(D)``, as torch's ``scaled_dot_product_attention``);
    ``window``: a sliding window of keys (query ``i`` sees ``W`` keys up to itself); ``softcap``: scores
    ``c * tanh(s / c)``; ``sinks [Hq]``: one extra logit per query head in every row's softmax; ``block``: chunked
    attention (Llama 4's local layers) — query ``i`` sees only the keys of its own span of ``block`` positions
    (``[block * (i // block), i]``; in packed rows ``i`` counts from its document's start: each document as if
    trained apart), a window of ``block`` whose earlier keys are masked (the layer keeps only ``block`` keys'
    pages, as a window layer). ``layer``: the
    call's own index in ``0..num_layers-1`` (a layer attending twice takes two). ``q``, ``k`` and ``v`` have one
    dtype and device (under autocast: cast to its dtype, as it casts torch's ``scaled_dot_product_attention``'s),
    and every call's the dtype of the step's first call (the pool's). A call that does not fit the
    chunk, the model's declared shape or these rules raises :class:`OOMBConfigError`. The op runs outside
    ``torch.compile`` graphs (``torch.compiler.disable``): compiled decoder layers break around it, into graphs that
    every chunk and step reuses (its per-chunk state would make Dynamo recompile at each call otherwise)."""
    if chunk.shape.layer_sources is not None and chunk.sweep != "backward":
        _check_shared(k, v, chunk, layer)
    keys_as_values = chunk.shape.values_are_keys
    if keys_as_values and v is not k:  # (the op returns the pages' one gradient sum for k alone)
        raise OOMBConfigError(
            f"layer {layer} calls paged_attention with values that are not its keys, but the model declares "
            "values_are_keys (one page holds both: latent attention over its latents) — pass v=k, or declare "
            "values_are_keys=False."
        )
    q, k, v = _autocast(q, k, v)
    v = k if keys_as_values else v
    _check_call(q, k, v, chunk, layer)
    if block is not None:
        chunk, window = _in_blocks(chunk, block, q.device), block if window is None else min(window, block)
    width = q.shape[-1]
    scale = width**-0.5 if scale is None else scale
    if pad := chunk.shape.head_dim_of(layer) - width:  # pages wider than the heads (:func:`stored_head_dim`)
        q, k, v = (F.pad(x, (0, pad)) for x in (q, k, v))
        v = k if keys_as_values else v
        return PagedAttention.apply(q, k, v, chunk, layer, scale, window, softcap, sinks)[..., :width]
    return PagedAttention.apply(q, k, v, chunk, layer, scale, window, softcap, sinks)
