"""``OOMBConfig``: every engine option, defined and validated once.

The strategies' typed ``__init__`` arguments (the YAML schema) mirror these fields with the same names, defaults and
documentation (a test keeps them equal); the pool and the offload streams read the config itself.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

from lightning_oomb.engine.errors import OOMBConfigError
from lightning_oomb.engine.grads import one_window
from lightning_oomb.engine.pages import GRAD_DTYPES
from lightning_oomb.engine.sparse import check_budget, check_page_score

BACKENDS = ("auto", "torch", "cpu", "triton")
GRAD_ACCUMULATIONS = ("auto", "float32", "float32-host", "native")
MLA_PAGES = ("expanded", "latent", "auto")
STAGING_AUTO_BYTES = 256 * 2**20  # staging_buffers="auto": 9 buffers (4 blocks a call) where they fit in this
# the strategies' defaults where they differ from the engine's: decided by their memory plan at setup
STRATEGY_DEFAULTS = {
    "kv_grad_dtype": "auto",
    "layer_checkpointing": "auto",
    "offload": "auto",
    "reuse_attention": "auto",
    "mla_pages": "auto",
}


@dataclass(frozen=True)
class OOMBConfig:
    """Options of the OOMB engine. The strategies, which plan each run's memory (at setup for a datamodule's
    ``seq_len``, else at the first batch), default ``kv_grad_dtype``, ``layer_checkpointing``,
    ``offload`` and ``reuse_attention`` to ``"auto"`` (the fastest choice that fits, decided by the plan and
    logged); the engine alone, with no plan, defaults them to fixed choices.

    Args:
        chunk_size: tokens processed together (``C``); activation memory scales with it, not with the sequence
            length. A multiple of ``page_size``.
        page_size: tokens per KV page (``P``, the kernel tile; the Triton kernels take powers of two >= 16).
        kv_grad_dtype: ``"float32"`` (the engine's default) or ``"bfloat16"`` gradient pages: half the memory,
            more rounding (measured 0.96-1.05x plain bf16 training's gradient error at 1-1024 chunks,
            ``benchmarks/bf16_grad_fidelity.py``); never narrower than the K/V dtype (with float32 K/V the pages stay
            float32). ``"auto"`` (the strategies' default): their memory plan at setup takes ``"float32"`` when the
            step fits with it, else ``"bfloat16"``; undecided (a bare engine): ``"float32"``.
        layer_checkpointing: also checkpoint each decoder layer inside a chunk's recompute: a chunk's activations
            shrink to each layer's input (plus its attention output, kept so the attention is not recomputed), at
            the price of one more pass through each layer's other parts. ``"auto"`` (the strategies' default): on
            when the memory plan (:func:`lightning_oomb.plan`) says the step would not fit without it, or that it
            would fit only with ``"float32-host"`` sums whose flushes its step-time model predicts slower than the
            extra pass, off otherwise (the strategies decide at setup from the datamodule's ``seq_len``; without
            one, at the first batch).
            ``True`` turns the model's checkpointing on (e.g. ``HFChunkModel.layer_checkpointing``) when the engine
            is made; ``False`` (the engine's default) leaves the model's own choice, as does an undecided
            ``"auto"`` in a bare engine.
        attention_backend: ``"auto"`` (Triton on CUDA, ``"cpu"`` on CPU, the torch reference elsewhere; the
            environment variable ``OOMB_ATTENTION_BACKEND`` overrides ``auto``), ``"torch"`` (the plain-torch
            reference, the oracle: any device, slow), ``"cpu"`` (CPU only: torch's fused CPU flash attention where
            a call allows it — no attention softcap, no tile counter — and the reference for the rest) or ``"triton"`` (CUDA only).
        loss_block: tokens per block of LM-head logits in the cross-entropy (the logits of at most this many
            tokens exist at once).
        offload: keep the K/V and gradient pages of layers beyond ``hbm_budget`` in pinned host memory, streamed
            through device staging buffers on side CUDA streams; results equal those without offload up to float
            rounding. On a CPU device with ``hbm_budget="auto"`` it changes nothing (pages are in host memory
            already; an explicit budget streams them anyway, which tests the schedule). ``"auto"`` (the
            strategies' default): their memory plan turns it on when the step (its other options decided for it)
            would not fit the GPU with its pages there, off otherwise and on a CPU device; on with an explicit
            ``hbm_budget``; undecided (a bare engine): off.
        hbm_budget: device bytes for pages (HBM-tier layers + staging buffers) when ``offload`` is on (an int with
            ``offload="auto"`` turns it on; with ``offload=False`` it does nothing, and says so): an int, or
            ``"auto"``: the strategies decide it at setup from the memory plan (the device bytes left by weights,
            gradients, optimizer states and one chunk's activations and transients, less 5 % of the device); the
            engine alone takes the free device memory at the first step minus a quarter of the device. Whole layers
            are placed; a budget below the staging buffers puts every layer on the host.
        staging_buffers: device buffers of one block each — one chunk's K, V, dK, dV pages of one layer,
            ``2 * batch * chunk_size * kv_heads * head_dim * (kv itemsize + grad itemsize)`` bytes (24 MiB for
            Qwen2.5-7B at chunk 4096) — through which host-tier layers stream; at least 2 (the chunk's own block
            and one prefix block); 3 overlaps copies in with compute, 4 also overlaps write-backs; one kernel call
            attends ``(staging_buffers - 1) // 2`` staged prefix blocks, so 9 pays a call's fixed costs once per 4
            blocks. ``"auto"`` (default, :meth:`staging_count`): 9 where they take at most 256 MiB (216 MiB for
            Qwen2.5-7B at chunk 4096), else 4 — large blocks make large calls already.
        host_tails: under ``offload``, whether sliding-window layers' *tails* (the pages of the last ``window - 1``
            keys before each chunk start, kept for the whole step) wait in pinned host memory, the device keeping two
            tail groups per layer: ``"auto"`` (default) where every layer's pages do not fit ``hbm_budget`` — before
            any full layer goes to the host, as they cross PCIe once each way (K/V only) where a host-tier layer's
            pages stream in every chunk; ``True``: whenever offload is on; ``False``: they stay on the device (full
            layers go to the host instead: less host memory per device byte freed, where host memory is short).
        prefetch_depth: predicted block uses staged ahead of time when offloading; ``None`` (default): as many as
            free buffers allow, ``0``: copies only on demand (a debugging aid: no overlap).
        page_budget: sparse attention: each block of ``page_size`` queries attends to its chunk's own pages and to
            the ``page_budget`` earlier pages whose key summaries score highest (a block with fewer earlier pages
            is dense); ``None`` (default): dense, exact. The selection is made in the forward sweep and reused by
            the backward (exact gradients of the sparse loss); ``OOMBSparseBudget`` changes it during training.
        page_score: how a query block scores earlier pages for ``page_budget``: ``"bound"`` (default; each page keeps
            its keys' elementwise max and min, and a query scores the upper bound of its dot product with any of
            them: a page holding one strongly matching key scores high) or ``"mean"`` (the mean key, the OOMB
            paper's rule; half the summary memory, but blind to single keys: see ``benchmarks/sparse_quality.py``).
        grad_accumulation: how the backward sweep sums the chunks' gradients of trainable 16-bit parameters
            (``bf16-true``, ``16-true``): ``"auto"`` (default): ``"float32-host"`` for a step of at most 16
            chunks without gradient accumulation (it then needs no host memory and copies nothing: the least
            memory; the matrices' ``.grad`` sums at most 16 chunks in 16 bits, the error measured as flat as
            ``"float32"``'s), else ``"float32"``, unless the strategies' memory plan at setup finds that the step
            fits a GPU only with ``"float32-host"`` — then that (both keep the error flat); where no plan decides
            (``plan_memory=False`` with no other ``"auto"`` option to decide, a bare engine) each
            step decides: ``"float32-host"`` for one of at most 16 chunks that starts without an earlier
            micro-batch's ``.grad``, else ``"float32"``. A ``.grad`` of zeros (``zero_grad(set_to_none=False)``)
            is dropped when the sweep starts: it holds no earlier sum. ``"float32"``: in a float32 sum per
            parameter, written into
            ``.grad`` once when the sweep ends (added to what ``.grad`` held, once), so the gradient's error stays
            that of ordinary 16-bit training whatever the number of chunks; during the sweep each such parameter's
            gradient takes 4 bytes instead of 2 (+14 GiB for a full fine-tune of Qwen2.5-7B, little under LoRA;
            the memory plan counts it). ``"native"``: autograd's own, each chunk's gradient added into the 16-bit
            ``.grad``, rounded once per chunk (one 4096-token step: 1.3x ordinary bf16 training's error at 256
            chunks, 3.7x at 1024, 32x on the final norm's weight; ``benchmarks/bf16_grad_fidelity.py``).
            ``"float32-host"``: the float32 sums of the matrices in host memory instead — their 16-bit ``.grad``
            sums up to 16 chunks (rounded per chunk over a window that does not grow with the sequence), then the
            window is copied to the host and added there (what ``.grad`` held from earlier micro-batches first);
            the 1-D parameters (norms, biases) keep float32 sums on the device. No device memory beyond
            ``"native"``'s (2 bytes per 1-D element), 4 host bytes per matrix element (28 GiB for Qwen2.5-7B) and,
            per 16 chunks, a device-to-host copy of the gradients and a host add; a step of at most 16 chunks
            without gradient accumulation is ``"native"`` for the matrices and needs no host memory.
            Parameters of 32 and 64 bits are summed by autograd either way.
        mlp_tile: run each decoder layer's MLP ``mlp_tile`` tokens at a time with grad, keeping only its input: its
            backward recomputes and back-propagates one tile at a time (:mod:`lightning_oomb.engine.tiles`), so the
            MLP's activations and backward transients shrink from a chunk's tokens to a tile's (Qwen2.5-7B, chunk
            4096, tiles of 1024: the last layer's MLP backward 1.3 → 0.6 GiB), at the price of one more MLP forward
            per step (~16 % more matmul FLOPs at 7B); exact (under ``grad_accumulation="native"`` each tile's
            parameter gradient is added into the 16-bit ``.grad``). ``None`` (default): whole chunks. Dense MLPs of
            Hugging Face models (a layer's ``mlp`` whose class name ends in ``MLP``; MoE blocks are left whole).
        reuse_attention: keep the forward sweep's attention results (each layer's output and log-sum-exp,
            ``(2 D + 4) Hq`` bytes per token and layer in 16-bit: 7.3 KB for Qwen2.5-7B, 204 KB per token) in host
            memory (page-locked under CUDA, copied on a side stream) so that the backward sweep's chunk recompute
            takes them instead of attending again: attention runs once forward and once backward per step (HF
            with checkpointing: twice forward). ``True``: every chunk; an int ``k``: the last ``k`` chunks of a
            step (those that attend to the most keys: the last fifth of the chunks carry over a third of the
            attention); ``"auto"`` (the strategies' default): their memory plan at setup keeps the most last chunks
            whose results fit in half the memory the rest of the step leaves (none while undecided: a bare
            engine); ``False`` (the engine's default): recompute. Exact (the same
            result); the memory plan counts the host bytes. Under ``oomb_cp`` each rank keeps its slices' results
            (no rank attends in the recompute).
        mla_pages: what the pages of multi-head latent attention layers hold (DeepSeek-V2/V3, GLM-4.7-Flash,
            Kimi-Linear, MiniCPM3, Youtu, LongCat-Flash...: attention modules with a ``kv_b_proj``): ``"expanded"``
            every head's keys and values, as the model makes them (GLM-4.7-Flash: 20 heads x (256 + 256) values
            per token and layer); ``"latent"``: the layer's latent, one head of ``kv_lora_rank + qk_rope_head_dim``
            values (576) serving as keys and values — one page tensor for both and one gradient page for both
            gradients (``PoolShape.values_are_keys``) — with ``kv_b_proj``'s key half absorbed into the queries and
            its value half applied to the output (the method DeepSeek's inference uses): 17.8x fewer page bytes
            per token for GLM-4.7-Flash, 14.2x for DeepSeek-V2-Lite, for more attention FLOPs (each head attends
            576 wide, tiled at 1,024 by the Triton kernels: 4x the expanded pages' 256-wide tiles). Exact (the same
            function, rounded otherwise); refused for a model without such layers and under LoRA dropout on
            ``kv_b_proj``. ``"auto"`` (the strategies' default): their memory plan keeps ``"expanded"`` where the
            step fits with it (its other options decided for it: offload, checkpointing, 16-bit gradient pages),
            else ``"latent"``; undecided (a bare engine, whose default is ``"expanded"``) and for models without
            latent attention: ``"expanded"``.
    """

    chunk_size: int = 4096
    page_size: int = 128
    kv_grad_dtype: str = "float32"
    layer_checkpointing: bool | str = False
    attention_backend: str = "auto"
    loss_block: int = 1024
    offload: bool | str = False
    hbm_budget: int | str = "auto"
    staging_buffers: int | str = "auto"
    host_tails: bool | str = "auto"
    prefetch_depth: int | None = None
    page_budget: int | None = None
    page_score: str = "bound"
    grad_accumulation: str = "auto"
    mlp_tile: int | None = None
    reuse_attention: bool | int | str = False
    mla_pages: str = "expanded"

    def __post_init__(self) -> None:
        for name in ("chunk_size", "page_size", "loss_block"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise OOMBConfigError(f"{name}={value!r} must be a positive integer.")
        if self.chunk_size % self.page_size:
            nearest = max(1, round(self.chunk_size / self.page_size)) * self.page_size
            raise OOMBConfigError(
                f"chunk_size={self.chunk_size} is not a multiple of page_size={self.page_size} — chunks must start "
                f"on page boundaries — use e.g. chunk_size={nearest}."
            )
        if self.kv_grad_dtype not in (*GRAD_DTYPES, "auto"):
            raise OOMBConfigError(
                f"kv_grad_dtype={self.kv_grad_dtype!r} is not supported — use one of {[*sorted(GRAD_DTYPES), 'auto']}."
            )
        check_backend_name(self.attention_backend)
        if not isinstance(self.offload, bool) and self.offload != "auto":
            raise OOMBConfigError(f"offload={self.offload!r} must be True, False or 'auto'.")
        if not isinstance(self.layer_checkpointing, bool) and self.layer_checkpointing != "auto":
            raise OOMBConfigError(
                f"layer_checkpointing={self.layer_checkpointing!r} must be True, False or 'auto'."
            )
        budget = self.hbm_budget
        if budget != "auto" and (isinstance(budget, bool) or not isinstance(budget, int) or budget < 0):
            raise OOMBConfigError(
                f"hbm_budget={budget!r} is not a byte count — it caps the device memory of KV and gradient pages "
                "when offload is on — pass a non-negative int of bytes (e.g. 40 * 2**30) or 'auto'."
            )
        buffers = self.staging_buffers
        if buffers != "auto" and (isinstance(buffers, bool) or not isinstance(buffers, int) or buffers < 2):
            raise OOMBConfigError(
                f"staging_buffers={buffers!r} must be an integer >= 2 or 'auto' — host-tier layers stream through "
                "these device buffers: one holds the chunk's own block, the others the blocks before it — use "
                "'auto' (the default)."
            )
        if not isinstance(self.host_tails, bool) and self.host_tails != "auto":
            raise OOMBConfigError(f"host_tails={self.host_tails!r} must be True, False or 'auto'.")
        depth = self.prefetch_depth
        if depth is not None and (isinstance(depth, bool) or not isinstance(depth, int) or depth < 0):
            raise OOMBConfigError(
                f"prefetch_depth={depth!r} must be None (as deep as the buffers allow) or an integer >= 0 — it "
                "counts the block uses staged ahead of time."
            )
        check_budget(self.page_budget)
        check_page_score(self.page_score)
        tile = self.mlp_tile
        if tile is not None and (isinstance(tile, bool) or not isinstance(tile, int) or tile <= 0):
            raise OOMBConfigError(
                f"mlp_tile={tile!r} must be None (whole chunks) or a positive number of tokens per MLP tile "
                "(e.g. 1024)."
            )
        reuse = self.reuse_attention
        if reuse != "auto" and (not isinstance(reuse, int) or (not isinstance(reuse, bool) and reuse < 0)):
            raise OOMBConfigError(
                f"reuse_attention={reuse!r} must be True (every chunk's forward attention result kept for the "
                "backward sweep), False (recomputed), a number of chunks (the last ones of each step) or 'auto' "
                "(as many as the memory plan finds room for)."
            )
        if self.mla_pages not in MLA_PAGES:
            raise OOMBConfigError(
                f"mla_pages={self.mla_pages!r} is unknown — it says what multi-head latent attention layers' pages "
                f"hold — use one of {MLA_PAGES}."
            )
        if self.grad_accumulation not in GRAD_ACCUMULATIONS:
            raise OOMBConfigError(
                f"grad_accumulation={self.grad_accumulation!r} is unknown — it says how the chunks' gradients of "
                f"16-bit parameters are summed — use one of {GRAD_ACCUMULATIONS}."
            )

    def grad_summing(self, chunks: int, accumulating: bool) -> str:
        """How a backward sweep of ``chunks`` chunks sums 16-bit chunk gradients (``accumulating``: ``.grad`` holds
        earlier micro-batches' sum). ``"auto"`` not yet decided: ``"float32-host"`` where it needs no host memory
        (one window of chunks, nothing accumulating: the matrices' ``.grad`` sums as autograd's own), else
        ``"float32"``."""
        if self.grad_accumulation != "auto":
            return self.grad_accumulation
        return "float32-host" if one_window(chunks, accumulating) else "float32"

    def reused_chunks(self, chunks: int) -> int:
        """How many of a step's ``chunks`` (its last ones) keep their forward attention results (``"auto"`` not
        yet decided: none)."""
        reuse = self.reuse_attention
        return chunks if reuse is True else 0 if reuse == "auto" else min(int(reuse), chunks)

    def staging_count(self, block_bytes: int) -> int:
        """The staging buffers for blocks of ``block_bytes``: ``staging_buffers``, or for ``"auto"`` 9 (4 blocks
        a kernel call) where they take at most :data:`STAGING_AUTO_BYTES`, else 4 (a block a call)."""
        if self.staging_buffers != "auto":
            return self.staging_buffers
        return 9 if 9 * block_bytes <= STAGING_AUTO_BYTES else 4

    @property
    def offloads(self) -> bool:
        """Whether pages beyond ``hbm_budget`` live in host memory: ``offload=True``, or ``"auto"`` with an explicit
        ``hbm_budget`` (a cap on the pages' device memory asks for it); an otherwise undecided ``"auto"``: no."""
        return self.offload is True or (self.offload == "auto" and self.hbm_budget != "auto")

    @classmethod
    def field_names(cls) -> tuple[str, ...]:
        return tuple(f.name for f in fields(cls))

    @classmethod
    def args_doc(cls) -> str:
        """The ``Args:`` entries of this docstring (indented by 8 spaces), for classes that take the same options."""
        doc = cls.__doc__
        return doc[doc.index("Args:\n") + len("Args:\n") :].rstrip() + "\n"


def check_backend_name(name: str) -> None:
    if name not in BACKENDS:
        raise OOMBConfigError(
            f"attention backend {name!r} is unknown — choose one of {BACKENDS} "
            "(OOMBConfig.attention_backend or OOMB_ATTENTION_BACKEND)."
        )
