"""The OOMB training step as one ``torch.autograd.Function``.

``forward`` is the **forward sweep**: chunk by chunk, with no graph, each chunk's K/V go into the pool and its
loss is summed (the step's loss, exact). ``backward`` is the **backward sweep**: chunks in reverse, each recomputed
with grad (same RNG and autocast state as in the forward sweep) and back-propagated at once with the incoming
``grad_output`` (so AMP loss scale and ``1 / accumulate_grad_batches`` arrive for free). Parameter ``.grad``
accumulates as in ordinary training; nothing of size O(N) is ever in autograd.

Chunk loss ``s`` = summed token CE over the chunk / number of target tokens in the whole batch (labels shifted
over the full sequence first), so the sum over chunks is the exact full-sequence mean. A batch without any
target token gives loss 0 and zero gradients (documented choice; Hugging Face would return NaN).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Protocol

import torch

from lightning_oomb.engine.attention import ChunkContext, PoolLayout, resolve_backend
from lightning_oomb.engine.errors import OOMBConfigError
from lightning_oomb.engine.kv_pool import GRAD_DTYPES, KVPool
from lightning_oomb.engine.loss import IGNORE_INDEX, linear_cross_entropy, shift_labels


@dataclass
class OOMBConfig:
    """Engine options (the strategy forwards its arguments of the same names).

    Args:
        chunk_size: tokens per chunk ``C``; activations scale with it, not with the sequence length.
        page_size: tokens per KV page ``P`` (the kernel tile); ``chunk_size`` must be a multiple of it.
        kv_grad_dtype: ``"float32"`` (default) or ``"bfloat16"`` gradient pages (half the memory, more rounding).
        layer_checkpointing: also checkpoint each decoder layer inside a chunk's recompute (less activation
            memory per chunk, one more forward per layer).
        attention_backend: ``"auto"`` (Triton on CUDA, torch elsewhere), ``"torch"`` or ``"triton"``.
        loss_block: tokens per block of LM-head logits in the cross-entropy.
        offload: keep the K/V and gradient pages of layers beyond ``hbm_budget`` in pinned host memory, streamed
            through device staging buffers on side CUDA streams (synchronous copies on CPU); results are identical.
        hbm_budget: device bytes for pages (HBM-tier layers + staging buffers) when ``offload`` is on: an int, or
            ``"auto"`` = free device memory minus a quarter of the device (on CPU: no limit, nothing moves). Whole
            layers are placed; a budget below the staging buffers puts every layer on the host.
        staging_buffers: device buffers of one block each — one chunk's K, V, dK, dV pages of one layer,
            ``2 * batch * chunk_size * kv_heads * head_dim * (kv itemsize + grad itemsize)`` bytes (24 MiB for
            Qwen2.5-7B at 4096) — through which host layers stream block by block. At least 2 (the chunk's own
            block and one prefix block); 3 overlaps copies in with compute, 4 also overlaps write-backs.
        prefetch_depth: how many predicted block uses ahead are staged early; ``None`` (default): as many as free
            buffers allow, ``0``: copies only on demand (a debugging aid: no overlap).
    """

    chunk_size: int = 4096
    page_size: int = 128
    kv_grad_dtype: str = "float32"
    layer_checkpointing: bool = False
    attention_backend: str = "auto"
    loss_block: int = 1024
    offload: bool = False
    hbm_budget: int | str = "auto"
    staging_buffers: int = 4
    prefetch_depth: int | None = None

    def __post_init__(self) -> None:
        for name in ("chunk_size", "page_size", "loss_block"):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise OOMBConfigError(f"{name}={value!r} must be a positive integer.")
        if self.chunk_size % self.page_size:
            raise OOMBConfigError(
                f"chunk_size={self.chunk_size} is not a multiple of page_size={self.page_size} — chunks must start "
                f"on page boundaries — use e.g. chunk_size={max(1, self.chunk_size // self.page_size) * self.page_size}."
            )
        if self.kv_grad_dtype not in GRAD_DTYPES:
            raise OOMBConfigError(
                f"kv_grad_dtype={self.kv_grad_dtype!r} is not supported — use one of {sorted(GRAD_DTYPES)}."
            )
        resolve_backend(self.attention_backend, torch.device("cpu"))  # validates the name
        if not isinstance(self.offload, bool):
            raise OOMBConfigError(f"offload={self.offload!r} must be True or False.")
        budget = self.hbm_budget
        if budget != "auto" and (isinstance(budget, bool) or not isinstance(budget, int) or budget < 0):
            raise OOMBConfigError(
                f"hbm_budget={budget!r} is not a byte count — it caps the device memory of KV and gradient pages "
                "when offload is on — pass a non-negative int of bytes (e.g. 40 * 2**30) or 'auto'."
            )
        buffers = self.staging_buffers
        if isinstance(buffers, bool) or not isinstance(buffers, int) or buffers < 2:
            raise OOMBConfigError(
                f"staging_buffers={buffers!r} must be an integer >= 2 — host-tier layers stream through these "
                "device buffers: one holds the chunk's own block, the others the blocks before it — use 4."
            )
        depth = self.prefetch_depth
        if depth is not None and (isinstance(depth, bool) or not isinstance(depth, int) or depth < 0):
            raise OOMBConfigError(
                f"prefetch_depth={depth!r} must be None (as deep as the buffers allow) or an integer >= 0 — it "
                "counts the block uses staged ahead of time."
            )


class ChunkModel(Protocol):
    """What the engine needs from a model (see ``lightning_oomb.integrations.hf.HFChunkModel``)."""

    num_layers: int
    kv_heads: int
    head_dim: int

    def hidden_states(
        self, input_ids: torch.Tensor, position_ids: torch.Tensor, chunk: ChunkContext
    ) -> torch.Tensor: ...  # final (normed) hidden states [B, L, H]

    def lm_head(self) -> tuple[torch.Tensor, torch.Tensor | None]: ...  # weight [V, H], bias [V] | None

    # attention runs through the engine inside the block
    def oomb_attention(self) -> contextlib.AbstractContextManager: ...


@dataclass
class StepStats:
    """What the last step did (read by callbacks and the demo)."""

    tokens: int = 0
    chunks: int = 0
    pool_bytes: int = 0
    kv_bytes: int = 0
    grad_bytes: int = 0
    extra: dict = field(default_factory=dict)


class _RNGState:
    """CPU (+ CUDA device) RNG state at a chunk's start, so its recompute draws the same dropout masks."""

    def __init__(self, device: torch.device):
        self.device = device
        self.cpu = torch.get_rng_state()
        self.cuda = torch.cuda.get_rng_state(device) if device.type == "cuda" else None

    def restore(self) -> None:
        torch.set_rng_state(self.cpu)
        if self.cuda is not None:
            torch.cuda.set_rng_state(self.cuda, self.device)


class _AutocastState:
    """Autocast and default dtype at the forward sweep, re-entered for the recompute (autocast is off in
    backward, see notes/lightning-integration.md §4)."""

    def __init__(self, device: torch.device):
        self.default_dtype = torch.get_default_dtype()
        self.modes = [
            (t, torch.is_autocast_enabled(t), torch.get_autocast_dtype(t))
            for t in dict.fromkeys((device.type, "cpu"))
        ]

    @contextlib.contextmanager
    def __call__(self):
        previous = torch.get_default_dtype()
        torch.set_default_dtype(self.default_dtype)
        try:
            with contextlib.ExitStack() as stack:
                for device_type, enabled, dtype in self.modes:
                    stack.enter_context(torch.autocast(device_type, dtype=dtype, enabled=enabled))
                yield
        finally:
            torch.set_default_dtype(previous)


@dataclass
class _Step:
    """One step's inputs, split in chunks."""

    input_ids: torch.Tensor
    targets: torch.Tensor
    denominator: int
    layout: PoolLayout
    backend: str
    bounds: list[tuple[int, int]]


class OOMBEngine:
    """Chunk-recurrent exact training of a :class:`ChunkModel`; plain torch, usable without Lightning.

    ``engine.loss(input_ids, labels)`` returns the full-sequence mean token loss as a differentiable scalar;
    calling ``.backward()`` on it (or on anything computed from it) runs the backward sweep.
    """

    def __init__(self, model: ChunkModel, config: OOMBConfig | None = None):
        self.model = model
        self.config = config or OOMBConfig()
        cfg = self.config
        self.pool = KVPool(
            cfg.offload, cfg.hbm_budget, cfg.staging_buffers, cfg.layer_checkpointing, cfg.prefetch_depth
        )
        self.stats = StepStats()

    # ------------------------------------------------------------------------------------------ public API
    def loss(self, input_ids: torch.Tensor, labels: torch.Tensor | None = None) -> torch.Tensor:
        """Differentiable mean next-token loss of ``input_ids [B, N]`` (``labels`` default to ``input_ids``).

        One step at a time: the pool holds this step's pages until its backward sweep, so call ``backward`` on
        the result before the next ``loss``.
        """
        step = self._plan(input_ids, labels)
        weight = self.model.lm_head()[0]
        anchor = weight.new_zeros((), dtype=torch.float32).requires_grad_(True)
        return _ChunkRecurrentStep.apply(anchor, self, step)

    def evaluate(self, input_ids: torch.Tensor, labels: torch.Tensor | None = None) -> torch.Tensor:
        """Mean next-token loss by the forward sweep alone (no gradient state kept).

        Works under ``torch.inference_mode`` (Lightning's evaluation loop): the pool is kept out of inference
        mode so that the next training step can keep writing into it.
        """
        step = self._plan(input_ids, labels)
        with torch.inference_mode(False), torch.no_grad():  # leaving inference mode re-enables grad
            loss, _ = self.forward_sweep(step, sweep="eval")
        return loss

    def release(self) -> None:
        """Free the pool, pinned host memory included (after an exception or at teardown); the next step
        reallocates it."""
        self.pool.release()

    @contextlib.contextmanager
    def _sweep(self, kind: str):
        """Bracket a sweep for the pool; an exception frees the pool, so the next step starts clean."""
        self.pool.begin_sweep(kind)
        try:
            yield
        except BaseException:
            self.release()
            raise
        self.pool.end_sweep()

    # -------------------------------------------------------------------------------------------- internals
    def _plan(self, input_ids: torch.Tensor, labels: torch.Tensor | None) -> _Step:
        if input_ids.dim() != 2 or input_ids.dtype not in (torch.int32, torch.int64):
            raise OOMBConfigError(
                f"input_ids must be an integer tensor [batch, tokens], got {tuple(input_ids.shape)} "
                f"{input_ids.dtype} — pass token ids, batched."
            )
        if labels is None:
            labels = input_ids
        elif labels.shape != input_ids.shape:
            raise OOMBConfigError(
                f"labels {tuple(labels.shape)} and input_ids {tuple(input_ids.shape)} differ in shape — "
                "give one label per input token (use -100 to ignore a position)."
            )
        targets = shift_labels(labels)
        batch, seq_len = input_ids.shape
        cfg = self.config
        layout = PoolLayout(
            self.model.num_layers,
            batch,
            seq_len,
            self.model.kv_heads,
            self.model.head_dim,
            cfg.page_size,
            cfg.kv_grad_dtype,
            cfg.chunk_size,
        )
        bounds = [(a, min(a + cfg.chunk_size, seq_len)) for a in range(0, seq_len, cfg.chunk_size)]
        denominator = int((targets != IGNORE_INDEX).sum())
        backend = resolve_backend(cfg.attention_backend, input_ids.device)
        return _Step(input_ids, targets, denominator, layout, backend, bounds)

    def _chunk_loss(self, step: _Step, start: int, end: int, sweep: str) -> torch.Tensor:
        chunk = ChunkContext(self.pool, step.layout, start, sweep, step.backend)
        ids = step.input_ids[:, start:end]
        positions = torch.arange(start, end, device=ids.device)[None]
        hidden = self.model.hidden_states(ids, positions, chunk)
        weight, bias = self.model.lm_head()
        total = linear_cross_entropy(hidden, weight, bias, step.targets[:, start:end], self.config.loss_block)
        return total / max(step.denominator, 1)

    def forward_sweep(self, step: _Step, sweep: str = "forward") -> tuple[torch.Tensor, list[_RNGState]]:
        """Run every chunk without a graph; return the summed loss and each chunk's RNG state."""
        device = step.input_ids.device
        rng, losses = [], []
        with self._sweep(sweep), self.model.oomb_attention():
            for start, end in step.bounds:
                rng.append(_RNGState(device))
                losses.append(self._chunk_loss(step, start, end, sweep))
        self._record(step)
        return torch.stack(losses).sum(), rng

    def backward_sweep(
        self, step: _Step, rng: list[_RNGState], autocast: _AutocastState, grad_output
    ) -> None:
        """Recompute chunks in reverse with grad and back-propagate each at once."""
        device = step.input_ids.device
        devices = [device] if device.type == "cuda" else []
        with torch.random.fork_rng(devices=devices, device_type=device.type), self._sweep("backward"):
            for (start, end), state in zip(reversed(step.bounds), reversed(rng), strict=True):
                state.restore()
                with self.model.oomb_attention():
                    with torch.enable_grad(), autocast():
                        loss = self._chunk_loss(step, start, end, "backward")
                    torch.autograd.backward(loss, grad_output)
        self.stats.extra.update(self.pool.stats())

    def _record(self, step: _Step) -> None:
        shape = self.pool.shape
        self.stats = StepStats(
            tokens=step.input_ids.numel(),
            chunks=len(step.bounds),
            pool_bytes=self.pool.allocated_bytes,
            kv_bytes=shape.kv_bytes if shape else 0,
            grad_bytes=shape.grad_bytes if shape else 0,
            extra=self.pool.stats(),
        )


class _ChunkRecurrentStep(torch.autograd.Function):
    """forward = forward sweep, backward = backward sweep (see the module docstring)."""

    @staticmethod
    def forward(ctx, anchor, engine: OOMBEngine, step: _Step):
        ctx.engine, ctx.step = engine, step
        ctx.autocast = _AutocastState(step.input_ids.device)
        loss, ctx.rng = engine.forward_sweep(step)
        return loss

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_output):
        ctx.engine.backward_sweep(ctx.step, ctx.rng, ctx.autocast, grad_output)
        ctx.step = ctx.rng = None
        return None, None, None
