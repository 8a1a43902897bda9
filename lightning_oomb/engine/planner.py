"""Memory planner: a training step's peak memory, predicted before anything is allocated.

:func:`plan` takes a model (a transformers config, an ``nn.Module``, a :class:`~lightning_oomb.engine.model.
ChunkModel` or a :class:`ModelShape`), ``batch x seq_len``, an :class:`~lightning_oomb.engine.config.OOMBConfig`,
a Lightning precision flag, an optimizer and a :class:`Machine`, and returns a :class:`MemoryPlan`: every term of
the device's peak and of the pinned host tier, in bytes, whether the step fits, and — when it does not — the
options that would make it fit (each tried in the planner). The activation terms' functions are
:mod:`~lightning_oomb.engine.activation_bytes`'s (``saved_bytes``, ``loss_backward_bytes``, ... below), a precision's
dtypes and an optimizer's states :mod:`~lightning_oomb.engine.step_setup`'s.

**Terms** (``T = batch x min(chunk_size, seq_len)`` tokens per chunk; ``r`` / ``c``: itemsize of the activations
(the parameters' dtype) and of the compute dtype, which differ only under autocast):

- *weights*, *gradients* (trainable parameters, their dtype), *optimizer states* (parameter-sized tensors per
  trainable parameter, in the trainable parameters' dtype as torch keeps them: AdamW 2, SGD with momentum 1, SGD 0).
- *KV pool*: :func:`~lightning_oomb.engine.kv_pool.place_layers` and :func:`~lightning_oomb.engine.pages.arena_bytes`
  of the engine's own :class:`~lightning_oomb.engine.pages.PoolShape` (sliding-window layers keeping only their
  tails, as the model's windows say) — exactly what ``KVPool.reserve`` allocates
  (HBM tier and staging buffers on the device, the host tier pinned). K/V are in the compute dtype (the autocast
  dtype under ``*-mixed``: the op casts ``q, k, v`` to it) at the head dim the pages store
  (:func:`~lightning_oomb.engine.attention.stored_head_dim`: the model's, on every backend). A sparse step
  (``page_budget``) adds the page summaries (``PoolShape.summary_bytes``, on the device).
- *activations*: what autograd saves during one chunk's recompute (:func:`saved_bytes`; calibrated on
  :class:`~lightning_oomb.engine.memory.SavedTensorMeter`); per decoder layer and token of a Llama-style layer (HF's
  RMSNorm computes in float32): each norm ``4H + 4 + rH`` (its float32 input, 1/rms, the normed input; ``4H`` for
  torch's ``nn.RMSNorm`` and Gemma's, which keep it in float32: ``ModelShape.float32_norms``) plus the projections'
  input (``rH``; under autocast one cast copy per projection reading it — a fused ``qkv_proj`` or ``gate_up_proj``
  one — ``cH`` each: ``ModelShape.norm_readers``), attention ``2cQ`` (the op's query and output, in the compute
  dtype; on a GPU at the pages' padded head dim, not counted) ``+ 4 Hq`` (float32 LSE) ``+ rQ`` (o_proj input; ``cQ``
  under autocast), the MLP ``4cI`` (gate, SiLU, up, product) — ``Q = Hq x head_dim`` (the op's at the pages'
  head dim, the others at the layer's own: Gemma 4's sliding layers' narrower heads); an MoE layer per routed expert
  ``I`` of its width, its gathered input, output and weighted output (:func:`routed_bytes`) and the router's scores,
  its dense layers (DeepSeek's first, Jamba's every other) their own MLP; norms of the attention's and the MLP's
  outputs (Gemma 2/3) and a sigmoid gate on the attention output (AFMoE) counted as they save; a layer whose pages
  the backward rewrites (host tier, a window layer keeping only its tails) its chunk's K and V (``2c Hkv D``). A
  latent attention layer (DeepSeek's MLA) saves its own norms of its queries' low-rank projection and of its latent
  (each ``4w + 4 + 2cw`` on its width ``w``, with the next projection's input: :func:`_latent_norms_bytes`), o_proj's
  input at ``Hq x v_head_dim`` and RoPE's tables at ``qk_rope_head_dim``; over latent pages (``mla_pages="latent"``)
  the absorption's queries and its weights broadcast per row and head (:func:`latent_absorption_bytes`). Under
  autocast every decoder weight is saved once more as a ``c`` copy (a hybrid's mixers' projections as read off their
  modules: ``Mixer.linear_weights``) — but transformers' grouped_mm experts', which autocast casts on no device: they
  compute in the weights' dtype (``ModelShape.uncast_experts``). With ``layer_checkpointing`` a layer saves only its
  input (``rH``; ``4H`` past the first layer with a float32 residual stream — Mamba's ``residual_in_fp32`` — whose
  final norm and loss are in float32 too; under offload on a GPU parked in host memory but two layers':
  :func:`parked_saves_bytes`). Plus the final norm (``4H + 4 + rH``; the cross-entropy saves nothing) and the step's
  token ids (8 B x batch x N). LoRA (peft): frozen layers save no normed inputs and their projections' inputs only
  where adapters in the activations' dtype read them; each adapter its rank-wide input and, wider than the
  activations (float32 adapters of a 16-bit model), its own copy of its input (:func:`adapter_bytes`). A hybrid's
  layers without attention save their norm and carried mixer (:func:`mixer_bytes`: transformers' torch rules, their
  float32 tensors per block).
- *loss transients* (:func:`loss_backward_bytes`, from ``engine/loss.py``, whose recompute makes the gradients in
  its forward): its hidden states and ``dh`` (``2rH`` per token), the targets (8 B/token), under autocast the
  weight's compute-dtype copy (``cVH``), and one block's logits (``b = min(loss_block, T)``): float32 logits plus
  their compute-dtype cast, ``(4 + c) b V`` (``4bV`` in float32, ``8bV`` in float64; a soft cap's derivative makes
  it at least ``8bV``), plus a ``c min(b, H) V`` slab of the weight gradient's product when that is added into a
  wider tensor (float32 weights under autocast, float32 gradient sums); a Mamba2 hybrid's outgoing states, views of
  their scans' whole results (:func:`scan_views`). The LM-head gradient itself is added in
  place into ``.grad`` or its float32 sum (counted there), not made anew per chunk — unless a user's gradient hook
  on the head's weight (the tied embedding's) must see it: then a new ``[V, H]`` one in the weight's dtype
  (``pVH``) per chunk, handed to autograd (what the hook itself makes, e.g. a new gradient it returns, is not
  counted).
- *layer transients* (:func:`layer_backward_bytes`): while the last decoder layer back-propagates — with
  checkpointing its recompute's saved tensors again, less its attention result (the kept one) — the gradients in
  flight (``2cI + 4rH`` per token in the MLP: the down projection's saved input is freed before the product's
  backward makes two I-wide gradients from a third; in transformers' eager expert loop its experts' weight gradients,
  ``7 p E I H`` whatever the tokens, beside ``2rH`` per token; ``2rQ + 4Q + 4 r Hkv D + 2rH`` in attention) and, on
  the torch reference attention backend, four float32 score blocks of ``[batch x Hq x Lq, min(KEY_BLOCK, keys)]`` (a
  partial last chunk: the larger of its rows over every key and the last whole chunk's over the keys up to its end:
  :func:`score_area`); on the fused CPU path (``cpu``, the CPU default) the copies its kernels take, one piece at a
  time: K/V and their gradients per query head (``4 x 4Q`` per token), or the keys before the chunk (K, V and their
  gradients: ``4 x 4 Hkv D`` per key, ``min(PAST_BLOCK, keys - Lq)`` keys). A hybrid's largest carried mixer: its
  recompute (with checkpointing) and its rule's gradients in flight (:func:`mixer_bytes`).
- *kept attention* (with ``layer_checkpointing``): the chunk recompute's attention output and LSE of every layer
  (``rQ + 4 Hq`` per token and layer; ``8 Hq`` in float64), held for the layer's checkpoint recompute
  (:class:`~lightning_oomb.engine.attention.Kept`) through the chunk's backward; with ``offload=True`` parked in
  page-locked host memory (counted in the host tier: :func:`parked_kept_bytes`), one layer's on the device.
- *float32 gradient sums* (``grad_accumulation="float32"``, and ``"auto"`` beyond one window of chunks until
  :func:`decide_auto` decides it, as :meth:`~lightning_oomb.engine.config.OOMBConfig.grad_summing` says):
  during the backward sweep every trainable 16-bit parameter's gradient is a 4-byte sum instead of its 2-byte
  ``.grad`` (:mod:`~lightning_oomb.engine.grads`): 2 bytes per such parameter, in every moment of the sweep, not at
  the optimizer step. ``"float32-host"``: 2 bytes per 1-D parameter element on the device; once a sweep has more
  than one window of chunks (or under gradient accumulation), 4 host bytes per element of the other parameters
  (their sums in host memory) and their staging (:class:`~lightning_oomb.engine.grads.HostGradSums`): on a GPU
  whose host memory has room after every other term a page-locked mirror of their 16-bit gradients (2 bytes per
  element), else two slabs; at the end of the sweep a slab of the sums on the device (not counted: at most 128 MiB,
  when the sweep's activations are freed).
- *reused attention results* (``reuse_attention``): the forward sweep's output and log-sum-exp of every attention
  layer for the kept chunks, one whole-chunk slot each, in page-locked host memory (:func:`reused_attention_bytes`);
  on the device they take the place of the recompute's own results (no new term).
- *carried states* (hybrids, and ChunkModels that declare ``carried_state_elements()``:
  :mod:`~lightning_oomb.engine.states`): each row's recurrent / convolution states at
  every chunk boundary; with ``offload=True`` they wait in a page-locked host buffer instead (counted in the host
  tier, each boundary rounded up to 8 bytes) and the device holds two boundaries' worth (a chunk's incoming leaves
  and the gradients it hands on). While a chunk is back-propagated three boundaries' worth more are in flight
  (copies of its incoming states, its outgoing ones and their gradients).
- *optimizer step*: torch's ``foreach`` Adam/AdamW (its default on CUDA) makes one state-sized ``sqrt`` copy of
  the largest parameter group (the for-loop one of the largest parameter; fused: none).

The peak is the persistent part (weights, gradients, optimizer states, the pool's device arenas and summaries) plus
the largest of the moments (loss backward, the last layer's MLP, attention and carried mixer's backward, the
embedding's dense gradient, the optimizer step). Gradients count as allocated throughout (they are from the second
chunk on, and whenever gradients accumulate). The plan is of allocated bytes (``torch.cuda.max_memory_allocated``):
the caching allocator's fragmentation and the CUDA context come on top. Calibrated on CPU runs of tiny Llama / Qwen2 /
Qwen3 / Mistral models (saved tensors exact, a step's allocation peak within a few percent); other families and
non-Hugging-Face ChunkModels use the same layer formula and say so in :attr:`MemoryPlan.notes` — one attention per
paged-attention call slot, one MLP per down projection their modules show, autocast's copies of their ``nn.Linear``
weights (:func:`~lightning_oomb.engine.model_shape.model_shape`; ``engine/model.py``'s ``ChunkModel`` tells their
authors). Hybrids' carried mixers (Qwen3-Next, Bamba, Falcon-H1, LFM2) and float32 LoRA adapters of a bfloat16 model:
a CPU step's peak within -4 % .. +10 % (``tests/engine/test_planner_hybrids.py``, ``tests/engine/test_planner.py``); a
ChunkModel with MLP-only blocks or a carried short convolution: 0 % .. +5 % (``tests/engine/test_planner_custom.py``).

**Options.** When the step does not fit, :func:`plan` plans the changes that could make it fit and lists those that
do (:attr:`MemoryPlan.options`): ``kv_grad_dtype="bfloat16"``, ``grad_accumulation="float32-host"`` (on a GPU) or
``"native"`` (16-bit parameters), fewer ``reuse_attention`` chunks,
``layer_checkpointing=True``, ``mlp_tile`` (dense MLPs: 1024 tokens, or the longest of 512, 256, 128 that fits,
shorter than a chunk's rows), the largest smaller ``loss_block`` of 512, 256, 128, 64 that fits, the largest smaller
``chunk_size`` that fits (any multiple of ``page_size``; beside another change, the largest that fits with it),
``offload=True`` with ``hbm_budget="auto"`` or the largest explicit budget (whole layers), pairs of
these when no single one suffices, a fused optimizer, 16-bit weights instead of autocast, the longest ``seq_len``
that fits (its ``"auto"`` options decided for it, as a run of it decides them), and the fewest devices once context
parallelism exists; when none does, :meth:`MemoryPlan.fix` says why: the weights, gradients and optimizer states
alone, or the largest other terms at the peak and what shrinks each. A tiled MLP (``mlp_tile``) saves only its
input and holds one tile's intermediates in its backward (:func:`layer_backward_bytes`).

**Step time.** :attr:`MemoryPlan.step_time_s` is the step's time at the machine's measured rates
(:class:`~lightning_oomb.engine.step_time.StepRates`: matmul and attention FLOP/s, host-device bytes/s, host adds;
for a GPU :meth:`Machine.local` finds them in :data:`MEASURED_STEP_RATES` by its name) from the step's FLOPs and
copies (:mod:`~lightning_oomb.engine.step_time`); ``None`` without rates (no GPU has been measured yet, so the table
is empty: pass ``Machine(..., rates=StepRates(...))``). Under context parallelism a rank computes and copies
``1 / devices`` of the step and then waits on the collectives (:func:`~lightning_oomb.engine.step_time.
context_seconds`, at the rates' link bandwidth and latency: nominal NVLink figures until measured).
"""

from __future__ import annotations

import dataclasses
import math
import numbers
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from lightning_oomb.engine import parking
from lightning_oomb.engine.activation_bytes import (
    kept_attention_bytes,
    layer_backward_bytes,
    loss_backward_bytes,
    parked_bytes,
    parked_kept_bytes,
    parked_saves_bytes,
    saved_bytes,
    scan_views,
)
from lightning_oomb.engine.attention import kernel_head_dim, stored_head_dim
from lightning_oomb.engine.config import OOMBConfig
from lightning_oomb.engine.context import check_context
from lightning_oomb.engine.errors import OOMBConfigError
from lightning_oomb.engine.grads import HALF_DTYPES, one_window, staging_elements
from lightning_oomb.engine.kv_pool import device_memory_available, hbm_budget, place_layers
from lightning_oomb.engine.memory import HOST_RESERVE_BYTES, host_memory_available
from lightning_oomb.engine.model_shape import CALIBRATED, ModelShape, model_shape
from lightning_oomb.engine.offload import host_tail_bytes
from lightning_oomb.engine.pages import GRAD_DTYPES, PAGE_SCORES, PoolShape, arena_bytes
from lightning_oomb.engine.results import result_slot_bytes
from lightning_oomb.engine.states import BOUNDARY_ALIGN
from lightning_oomb.engine.step_setup import Dtypes, OptimizerSpec, optimizer_spec, precision_dtypes
from lightning_oomb.engine.step_time import (
    StepRates,
    context_seconds,
    copy_bytes,
    host_sum_bytes,
    step_flops,
    step_time,
)

# step rates per device name (torch.cuda.get_device_name()), as benchmarks/run_gpu.sh measures them (its summary's
# "step_rates"). The H200 (benchmarks/results/goals-summary-h200.md, 2026-12-04): matmuls 5.15e14 FLOP/s fitted on
# 8 steps (28, 4 and 2 layers, 32K-128K), copies 55 GB/s (a pinned 1 GiB copy), float32-host adds 21 GB/s; its
# attention's 2.56e14 FLOP/s were fitted at the kernels' earlier tiles, so the entry has that times 1.55, the
# forward + backward speed-up measured at the shipped ones (benchmarks/results/tile-sweep-h200.md) — until
# run_gpu.sh fits it again
MEASURED_STEP_RATES: Mapping[str, StepRates] = {"NVIDIA H200": StepRates(5.15e14, 3.96e14, 5.54e10, 2.11e10)}
# rates the "auto" decisions compare choices' step times at where a device has none measured (an H100/H200-class
# GPU's bf16 matmuls and attention, PCIe 5 copies; two CPU cores)
NOMINAL_STEP_RATES: Mapping[str, StepRates] = {
    "cuda": StepRates(5e14, 3e14, 2.5e10, 2e10),
    "cpu": StepRates(2e10, 5e9, 5e9, 5e9),
}

PLANNED_HEADROOM = (
    0.05  # a planned hbm_budget="auto" leaves this share of the device (allocator, CUDA context)
)


@dataclass(frozen=True)
class Machine:
    """Where the step runs: ``device_type`` ``"cuda"`` or ``"cpu"``; ``device_bytes``: device memory the run may
    use (on a CPU, host memory: the device *is* host memory); ``host_bytes``: host memory for the pinned tier;
    ``device_total``: the device's size, which ``hbm_budget="auto"`` leaves a quarter of (default
    ``device_bytes``); ``rates``: its measured step rates (``None``: unknown, no step time predicted)."""

    device_type: str
    device_bytes: int
    host_bytes: int
    device_total: int | None = None
    rates: StepRates | None = None

    @property
    def total(self) -> int:
        return self.device_total if self.device_total is not None else self.device_bytes

    def shared_by(self, processes: int) -> Machine:
        """One process's share when ``processes`` processes train on this machine (e.g. a node's ranks under
        ``oomb_cp``): host memory — and a CPU's device memory, which is host memory — divided among them."""
        if processes <= 1:
            return self
        host = self.host_bytes // processes
        device = host if self.device_type == "cpu" else self.device_bytes
        return dataclasses.replace(self, device_bytes=device, host_bytes=host)

    @classmethod
    def local(cls, device: str | torch.device | None = None, resident_bytes: int = 0) -> Machine:
        """This machine now: on CUDA, free device memory plus what this process's allocator holds (within its
        ``torch.cuda.set_per_process_memory_fraction`` share: a way to plan for less of the GPU); on a CPU,
        ``MemAvailable`` plus ``resident_bytes`` (e.g. the weights already loaded, which the plan counts); where
        ``MemAvailable`` cannot be read, host memory counts as unlimited."""
        device = torch.device(
            device if device is not None else ("cuda" if torch.cuda.is_available() else "cpu")
        )
        available = (
            host_memory_available()
        )  # None where unreadable: unlimited, as the pool's own check takes it
        host = (
            sys.maxsize if available is None else available + (resident_bytes if device.type == "cpu" else 0)
        )
        if device.type != "cuda":
            return cls(device.type, host, host)
        available, total = device_memory_available(device)
        rates = MEASURED_STEP_RATES.get(torch.cuda.get_device_name(device))
        return cls("cuda", available + torch.cuda.memory_allocated(device), host, total, rates)


def step_size_of(data: Any) -> tuple[int | None, int]:
    """``(seq_len, batch_size)`` a data module declares, as attributes or saved hyperparameters (``None``: no
    ``seq_len``; batch 1 when it declares none)."""
    hparams = getattr(data, "hparams", None) or {}
    seq_len, batch = (getattr(data, k, None) or hparams.get(k) for k in ("seq_len", "batch_size"))
    valid = [isinstance(x, int) and not isinstance(x, bool) and x > 0 for x in (seq_len, batch)]
    return (seq_len if valid[0] else None), (batch if valid[1] else 1)


def step_sizes_of(data: Any) -> list[tuple[int | None, int]]:
    """Every ``(seq_len, batch_size)`` a data module's training steps take: its ``step_sizes`` (e.g. a warm-up
    phase of shorter sequences in larger batches, which can take more memory than the main phase), else
    :func:`step_size_of`'s one. The memory plan is made for each; the largest decides."""
    sizes = getattr(data, "step_sizes", None)
    return list(sizes) if sizes else [step_size_of(data)]


def _pool_shape(
    shape: ModelShape,
    config: OOMBConfig,
    machine: Machine,
    batch: int,
    tokens: int,
    chunk: int,
    kv,
    score=None,
) -> PoolShape:
    """The pool of ``tokens`` per row in chunks of ``chunk``, as the engine shapes it: each paged layer at its own
    KV heads and head dim as the pages store it (:func:`~lightning_oomb.engine.attention.stored_head_dim`)."""
    backend = _backend(config, machine)
    latent = config.mla_pages == "latent" and bool(shape.latent_width)  # one page: keys and values
    shape = shape.attending(config.mla_pages)
    dims = shape.own_head_dims
    return PoolShape.for_layers(
        batch, tokens, shape.own_kv_heads, tuple(stored_head_dim(backend, d) for d in dims),
        dims, config.page_size, shape.windows, chunk_size=chunk, kv_grad_dtype=config.kv_grad_dtype, dtype=kv,
        page_score=score, layer_sources=shape.own_kv_sources, values_are_keys=latent,
    )  # fmt: skip


# ------------------------------------------------------------------------------------------------------ plan
@dataclass(frozen=True)
class Option:
    """A change that makes the step fit: ``changes`` (``OOMBConfig`` fields, or ``seq_len`` / ``devices``),
    ``text`` (how to say it) and the plan with it."""

    changes: dict
    text: str
    peak_device: int
    host_tier: int


@dataclass
class MemoryPlan:
    """A step's predicted memory (bytes). ``device``: every term of the device's peak (``peak_device`` = persistent
    terms + the largest moment, ``peak_phase``); ``host_tier``: the host memory the step holds, ``host_parts``
    its terms — the pool's pinned tier, parked attention results and states, float32-host's gradient sums, kept
    forward attention results (on a CPU machine it lives in the same memory as the device terms); ``fits``, and
    ``options`` that fit when it does not; ``notes``: what is approximate; ``step_time_s``: the step's time at the
    machine's measured rates (``None`` without them; the module docstring)."""

    seq_len: int
    batch: int
    config: OOMBConfig
    precision: str
    optimizer: str
    machine: Machine
    model: ModelShape
    pool: PoolShape
    hbm_layers: int
    host_layers: int
    device: dict[str, int]
    phases: dict[str, int]
    host_tier: int
    saved: dict[str, int]
    fits: bool = True
    options: list[Option] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    step_time_s: float | None = None
    host_parts: dict[str, int] = field(default_factory=dict)  # host_tier's terms (HOST_LABELS)
    grad_mirror: bool = False  # float32-host's flushes through a page-locked mirror (else two slabs)

    @property
    def persistent(self) -> int:
        """Device bytes held through the whole step: weights, gradients, optimizer states, the pool's arenas."""
        return sum(self.device[k] for k in PERSISTENT)

    @property
    def peak_device(self) -> int:
        return self.persistent + max(self.phases.values())

    @property
    def peak_phase(self) -> str:
        return max(self.phases, key=self.phases.get)

    @property
    def device_capacity(self) -> int:
        """Device bytes the step may use (on a CPU: host memory less what the pinned tier and the OS keep)."""
        if self.machine.device_type == "cpu":
            return max(self.machine.device_bytes - HOST_RESERVE_BYTES - self.host_tier, 0)
        return self.machine.device_bytes

    @property
    def host_capacity(self) -> int:
        """Host bytes the pinned tier may use (host memory less what the OS keeps)."""
        return max(self.machine.host_bytes - HOST_RESERVE_BYTES, 0)

    @property
    def device_fits(self) -> bool:
        return self.peak_device <= self.device_capacity

    @property
    def host_fits(self) -> bool:
        return self.machine.device_type == "cpu" or self.host_tier <= self.host_capacity

    def rows(self) -> list[tuple[str, int | None, int | None]]:
        """``(term, device bytes, host bytes)`` in the order a table shows them."""
        out = [(LABELS[k], v, None) for k, v in self.device.items()]
        parked = [(HOST_LABELS[k], None, v) for k, v in self.host_parts.items() if k != "pool" and v]
        pool = self.host_parts.get("pool", self.host_tier)
        return [*out, ("pinned host tier", None, pool), *parked]

    def summary(self) -> str:
        """One line: the peak, its moment, the capacity, fits or not."""
        where = "host memory" if self.machine.device_type == "cpu" else "device memory"
        verdict = "fits" if self.fits else "does NOT fit"
        host = (
            ""
            if self.machine.device_type == "cpu"
            else f"; host {gib(self.host_tier)} of {gib(self.host_capacity)}"
        )
        time = "" if self.step_time_s is None else f"; step {self.step_time_s:,.1f} s at the measured rates"
        return (
            f"{self.batch} x {self.seq_len} tokens, {self.precision}, {self.optimizer}: peak {gib(self.peak_device)} "
            f"of {gib(self.device_capacity)} {where} (at {self.peak_phase}){host}{time} — {verdict}"
        )

    def refusal(self) -> str:
        """Why the step does not fit and what would (the text of the strategy's refusal; empty if it fits)."""
        if self.fits:
            return ""
        terms = ", ".join(f"{LABELS[k]} {gib(v)}" for k, v in self.device.items() if v)
        tokens = f"{self.batch} x {self.seq_len} tokens"
        if not self.device_fits:
            where = (
                "host memory (the model runs on the CPU)"
                if self.machine.device_type == "cpu"
                else "GPU memory"
            )
            what = (
                f"the training step ({tokens}) needs {gib(self.peak_device)} of {where} at its peak "
                f"({self.peak_phase}; {terms}) but only {gib(self.device_capacity)} is available"
                + (f" ({gib(HOST_RESERVE_BYTES)} of host memory left to the system)" if self.machine.device_type
                   == "cpu" else "")
            )  # fmt: skip
        else:
            parts = ", ".join(f"{HOST_LABELS[k]} {gib(v)}" for k, v in self.host_parts.items() if v)
            what = (
                f"the step ({tokens}) needs {gib(self.host_tier)} of host memory ({parts}) but only "
                f"{gib(self.host_capacity)} is available"
            )
        return f"{what} — it would run out of memory — {self.fix()}."

    def fix(self) -> str:
        """What would make a step that does not fit fit: the options found (``use ...``), else why none does."""
        if self.options:
            return "use " + ", or ".join(o.text for o in self.options)
        if not self.device_fits:
            static = sum(self.device[k] for k in ("weights", "gradients", "optimizer_states"))
            if static > self.device_capacity:
                return (
                    f"no OOMB option makes it fit: weights, gradients and optimizer states alone need {gib(static)} "
                    "— train fewer parameters (e.g. LoRA adapters), use an optimizer with less state, or a larger "
                    "device"
                )
            # the largest other terms at the peak, each with what shrinks it
            keys = (*PERSISTENT[3:], *PHASE_TERMS.get(self.peak_phase, ()))
            terms = {k: self.device[k] for k in keys if self.device.get(k)}
            largest = sorted(terms, key=terms.get, reverse=True)[:3]
            named = "; ".join(f"{LABELS[k]} {gib(terms[k])} ({self._shrinker(k)})" for k in largest)
            return (
                f"no OOMB option makes it fit: the weights, gradients and optimizer states ({gib(static)}) leave "
                f"{gib(self.device_capacity - static)}, and the step needs {gib(self.peak_device - static)} more at "
                f"its peak ({self.peak_phase}), the most in {named} — shorten the step (seq_len, batch), train fewer "
                "parameters, or use a larger device"
            )
        return (
            "no OOMB option makes it fit in host memory — shorten the step (seq_len, batch), free host memory, or "
            "use a machine with more"
        )

    def _shrinker(self, key: str) -> str:
        """What shrinks the device term ``key`` (the text of a refusal that no option makes fit)."""
        gpu = self.machine.device_type == "cuda"
        chunk = "a smaller chunk_size"
        return {
            "kv_hbm": "offload=True" if gpu else "a shorter seq_len",
            "staging": "fewer staging_buffers",
            "page_summaries": "a larger page_size",
            "carried_states": "offload=True" if gpu else "a shorter seq_len",
            "grad_sums": "grad_accumulation='native'" + (" or 'float32-host'" if gpu else ""),
            "states_in_flight": "a smaller batch",
            "activations": chunk
            if self.config.layer_checkpointing is True
            else f"layer_checkpointing=True, {chunk}",
            "kept_attention": f"offload=True, {chunk}" if gpu else chunk,
            "loss_transients": f"a smaller loss_block, {chunk}",
            "layer_transients": f"mlp_tile, {chunk}",
            "optimizer_transients": "a fused optimizer",
        }.get(key, chunk)

    def header(self) -> str:
        """What is planned: the model, the step, the precision and optimizer, and the options as decided."""
        cfg = self.config
        latent = ", mla_pages latent (one head of latents)" if self.pool.values_are_keys else ""
        tails = f"; {self.hosted_tails_note()}" if self.pool.hosted_tails else ""
        return (
            f"{self.model.family}, {self.batch} x {self.seq_len} tokens, {self.precision}, {self.optimizer}, "
            f"chunk_size {cfg.chunk_size}, layer_checkpointing {cfg.layer_checkpointing}, kv_grad_dtype "
            f"{cfg.kv_grad_dtype}, grad_accumulation {cfg.grad_accumulation}{latent}, offload {cfg.offload} "
            f"({self.hbm_layers} HBM / {self.host_layers} host layers{tails})"
        )

    def hosted_tails_note(self) -> str:
        """``"the tails of N window layers in host memory"`` where the plan keeps window layers' tails there
        (``PoolShape.hosted_tails``: they count among the HBM layers, a ring of two tail groups staying on the
        device), else ``""``."""
        hosted = len(self.pool.hosted_tails)
        layers = "window layer" if hosted == 1 else "window layers"
        return f"the tails of {hosted} {layers} in host memory" if hosted else ""

    def format(self) -> str:
        """A plain-text table of every term (after :meth:`header`), the verdict and the options."""
        lines = [self.header(), f"{'term':<34}{'device':>14}{'host':>14}"]
        for label, dev, host in self.rows():
            lines.append(f"{label:<34}{gib(dev):>14}{gib(host):>14}")
        lines += [f"{'peak (' + self.peak_phase + ')':<34}{gib(self.peak_device):>14}{gib(self.host_tier):>14}",
                  self.summary()]  # fmt: skip
        lines.append(
            "moments: " + ", ".join(f"{k} {gib(self.persistent + v)}" for k, v in self.phases.items())
        )
        lines += [f"  would fit: {o.text}" for o in self.options]
        if not self.fits and not self.options:
            lines.append(f"  {self.fix()}")
        lines += [f"  note: {n}" for n in self.notes]
        return "\n".join(lines)


PERSISTENT = (
    "weights",
    "gradients",
    "optimizer_states",
    "kv_hbm",
    "staging",
    "page_summaries",
    "carried_states",
)
LABELS = {
    "weights": "weights",
    "gradients": "gradients",
    "optimizer_states": "optimizer states",
    "kv_hbm": "KV pool, HBM tier",
    "staging": "KV pool, staging buffers",
    "page_summaries": "page summaries (sparse)",
    "grad_sums": "float32 gradient sums (backward)",
    "carried_states": "recurrent / convolution states at chunk boundaries",
    "activations": "activations (one chunk)",
    "kept_attention": "attention results kept (checkpointing)",
    "loss_transients": "loss backward transients",
    "layer_transients": "layer backward transients",
    "optimizer_transients": "optimizer step transients",
    "states_in_flight": "carried states in flight",
}


# the device terms of each moment beside the persistent ones (MemoryPlan.fix names the largest)
_BACKWARD = ("grad_sums", "states_in_flight", "activations", "kept_attention")
PHASE_TERMS = {
    "loss backward": (*_BACKWARD, "loss_transients"),
    **{f"{part} backward": (*_BACKWARD, "layer_transients") for part in ("MLP", "attention", "mixer")},
    "embedding backward": ("grad_sums", "states_in_flight"),
    "optimizer step": ("optimizer_transients",),
}


HOST_LABELS = {
    "pool": "pinned host tier",
    "kept_attention": "attention results kept (checkpointing), pinned",
    "parked_saves": "layer inputs kept (checkpointing), pinned",
    "carried_states": "recurrent / convolution states at chunk boundaries, pinned",
    "grad_sums": "float32 gradient sums, pinned",
    "grad_staging": "float32 gradient sums' mirror or slabs, pinned",
    "reused_attention": "forward attention results (reuse_attention), pinned",
    "window_tails": "window layers' tails (K/V), pinned",
}


def gib(n: int | None) -> str:
    """Bytes in the largest binary unit up to GiB, e.g. ``"21.00 GiB"``, ``"64.0 MiB"`` (``""`` for ``None``: no
    such term)."""
    if n is None:
        return ""
    for unit, size, digits in (("GiB", 2**30, 2), ("MiB", 2**20, 1), ("KiB", 2**10, 1)):
        if abs(n) >= size:
            return f"{n / size:.{digits}f} {unit}"
    return f"{n} B"


def plan(
    model: Any,
    seq_len: int,
    batch: int = 1,
    config: OOMBConfig | None = None,
    precision: str | int = "32-true",
    optimizer: Any = "adamw",
    machine: Machine | str | None = None,
    *,
    device_memory: int | None = None,
    host_memory: int | None = None,
    param_dtype: torch.dtype | None = None,
    suggest: bool = True,
    context_parallel: int = 1,
    accumulate_grad_batches: int = 1,
    processes_per_node: int = 1,
) -> MemoryPlan:
    """Predict one training step's memory without allocating anything (see the module docstring).

    Args:
        model: a transformers config (or a dict of its fields), the model (``nn.Module``, counted exactly), a
            ChunkModel, or a :class:`ModelShape`.
        seq_len, batch: tokens per row and rows per step.
        config: the engine options (default ``OOMBConfig()``).
        precision: a Lightning precision flag (``"32-true"``, ``"bf16-true"``, ``"bf16-mixed"``, ``"16-mixed"``,
            ``"64-true"``, ...).
        optimizer: ``None``/``"none"``, ``"sgd"``, ``"sgd-momentum"``, ``"adamw"``, ..., an
            :class:`OptimizerSpec` or a ``torch.optim.Optimizer``.
        machine: where it runs: a :class:`Machine`, or ``"cuda"`` / ``"cpu"`` / ``None`` (this machine's device,
            :meth:`Machine.local`) with ``device_memory`` / ``host_memory`` (bytes) overriding what it reports (on
            a CPU both are its one memory: the smaller of those given).
        param_dtype: the weights' dtype when the flag does not convert them (a module's own is read from it).
        suggest: when it does not fit, try the options that could (``MemoryPlan.options``).
        Its ``"auto"`` options are decided here as the strategies decide them (:func:`decide_auto`): the plan's
        ``config`` holds the decisions.
        context_parallel: ranks sharing each sequence (``strategy="oomb_cp"``): each keeps ``1 / context_parallel``
            of the pages (a chunk's activations are still counted whole: an upper bound).
        accumulate_grad_batches: micro-batches per optimizer step (the Trainer's): with more than one,
            ``grad_accumulation="float32-host"`` keeps its host sums even for a step of one window of chunks.
        processes_per_node: training processes sharing the machine's host memory (a node's ranks: the plan is
            one process's, with its share, :meth:`Machine.shared_by`).
    """
    config = config or OOMBConfig()
    for name, value in (("seq_len", seq_len), ("batch", batch)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise OOMBConfigError(
                f"{name}={value!r} is not a positive integer — a step has rows of tokens — pass seq_len (tokens "
                "per row) and batch (rows per step) as positive ints."
            )
    if isinstance(context_parallel, bool) or not isinstance(context_parallel, int) or context_parallel < 1:
        raise OOMBConfigError(
            f"context_parallel={context_parallel!r} is not a positive integer — pass the ranks sharing each sequence "
            "(1: no context parallelism)."
        )
    if context_parallel > 1:
        check_context(config, context_parallel, seq_len)  # as the strategy refuses it at setup
    machine = _machine(machine, device_memory, host_memory).shared_by(processes_per_node)
    module = model if isinstance(model, torch.nn.Module) else getattr(model, "model", None)
    if param_dtype is None and isinstance(module, torch.nn.Module):
        param_dtype = _dominant_dtype(module)
    shape = model_shape(model)
    dtypes = precision_dtypes(precision, param_dtype)
    if param_dtype not in (None, dtypes.param):  # a module the flag converts: its bytes as they will be
        shape = _converted(shape)
    spec = optimizer_spec(optimizer)
    inputs = _Inputs(shape, dtypes, spec, machine, str(precision), accumulate_grad_batches)
    asked, config = config, decide_auto(inputs, config, batch, seq_len, context_parallel)
    result = _plan(inputs, config, batch, seq_len, context_parallel)
    if suggest and not result.fits:
        result.options = _options(inputs, config, batch, seq_len, asked)
    return result


def decide_auto(inputs, config: OOMBConfig, batch: int, seq_len: int, devices: int = 1) -> OOMBConfig:
    """The ``"auto"`` options decided as the strategies decide them at setup: the faster choice where it fits with
    ``PLANNED_HEADROOM`` of a GPU to spare (:func:`_roomy`), else the leaner one:

    - ``kv_grad_dtype``: ``"float32"`` when the step (its other options decided for it) fits, else ``"bfloat16"``
      (16-bit K/V only) — exact sums are given up last;
    - ``offload``: off when the step (its other options decided for it: e.g. layer checkpointing on) fits with its
      pages on the GPU, else on (with ``hbm_budget="auto"``: the layers that fit stay on the GPU); off on a CPU; on
      with an explicit ``hbm_budget``;
    - ``layer_checkpointing``: off when the step (its other options decided for it: e.g. ``"float32-host"`` sums
      rather than one more pass through every layer) fits, unless the step on (its options decided for it) fits too
      and is predicted faster (:func:`_faster`: ``"float32-host"``'s flushes can outweigh the extra pass), else on;
    - ``grad_accumulation``: ``"float32-host"`` for one window of chunks without gradient accumulation (then
      free), else ``"float32"`` when the step fits with it, else ``"float32-host"`` on a GPU when that fits;
    - ``hbm_budget`` (under offload on a CUDA device): the device bytes the rest of the step leaves (every term of
      its plan with no HBM-tier layer, less ``PLANNED_HEADROOM`` of the device) — unlike the engine's own
      ``"auto"``, which sees only what is allocated at the first step (not yet the optimizer states);
    - ``reuse_attention``: the most last chunks whose kept results still let the step fit and take at most half
      the memory the step leaves them (the rest stays free for the data loader, checkpoint saving, other
      processes), unless keeping none is predicted faster (:func:`_faster`: the results' copies, out and back,
      share the host link with offload's; ``False``: none).
    - ``mla_pages`` (a latent attention model): ``"expanded"`` when the step (its other options decided for it)
      fits, else ``"latent"`` (every head attends over one head of latents: the most attention FLOPs, so decided
      last); ``"expanded"`` for other models.
    """
    if config.mla_pages == "auto":
        expanded = decide_auto(
            inputs, dataclasses.replace(config, mla_pages="expanded"), batch, seq_len, devices
        )
        if not inputs.shape.latent_width or _roomy(_plan(inputs, expanded, batch, seq_len, devices)):
            return expanded
        return decide_auto(inputs, dataclasses.replace(config, mla_pages="latent"), batch, seq_len, devices)
    if config.kv_grad_dtype == "auto":
        wide = decide_auto(
            inputs, dataclasses.replace(config, kv_grad_dtype="float32"), batch, seq_len, devices
        )
        if inputs.dtypes.kv.itemsize >= 4 or _roomy(_plan(inputs, wide, batch, seq_len, devices)):
            return wide
        return decide_auto(
            inputs, dataclasses.replace(config, kv_grad_dtype="bfloat16"), batch, seq_len, devices
        )
    if config.offload == "auto" and config.hbm_budget != "auto":  # an explicit budget asks for offload
        return decide_auto(inputs, dataclasses.replace(config, offload=True), batch, seq_len, devices)
    if config.offload == "auto":  # pages on the device, with the other options decided for it, if that fits
        on_device = decide_auto(inputs, dataclasses.replace(config, offload=False), batch, seq_len, devices)
        if inputs.machine.device_type != "cuda" or _roomy(_plan(inputs, on_device, batch, seq_len, devices)):
            return on_device
        return decide_auto(inputs, dataclasses.replace(config, offload=True), batch, seq_len, devices)
    if config.layer_checkpointing == "auto":
        # off, with the other options decided for it, if it fits and on is not predicted faster
        off, on = (
            decide_auto(inputs, dataclasses.replace(config, layer_checkpointing=c), batch, seq_len, devices)
            for c in (False, True)
        )
        fits = _roomy(_plan(inputs, off, batch, seq_len, devices))
        return off if fits and not _faster(inputs, on, off, batch, seq_len, devices) else on
    if config.grad_accumulation == "auto" and any(_half_elements(inputs)):  # else nothing to sum: left "auto"
        config = dataclasses.replace(
            config, grad_accumulation=_summing(inputs, config, batch, seq_len, devices)
        )
    config = _budgeted(inputs, config, batch, seq_len, devices)
    if config.reuse_attention == "auto":
        # bisect the kept chunks (more of them, more memory), within half of what the step leaves them
        base = _plan(inputs, dataclasses.replace(config, reuse_attention=False), batch, seq_len, devices)
        share = _spare_for_results(base) // 2

        def room(kept: int) -> bool:
            p = _plan(inputs, dataclasses.replace(config, reuse_attention=kept), batch, seq_len, devices)
            return _roomy(p) and p.host_parts["reused_attention"] <= share

        most = longest_fitting(room, 1, math.ceil(seq_len / config.chunk_size))
        none = dataclasses.replace(config, reuse_attention=False)
        kept = dataclasses.replace(config, reuse_attention=most)
        # a copy-bound step (offload's pages streaming) may lose more to the results' copies than it saves
        config = none if not most or _faster(inputs, none, kept, batch, seq_len, devices) else kept
    return config


def _faster(inputs, a: OOMBConfig, b: OOMBConfig, batch: int, seq_len: int, devices: int) -> bool:
    """Whether step ``a`` fits with room to spare and is predicted faster than ``b`` (the step-time model at the
    machine's measured rates, else at ``NOMINAL_STEP_RATES``)."""
    machine = inputs.machine
    rates = machine.rates or NOMINAL_STEP_RATES.get(machine.device_type, NOMINAL_STEP_RATES["cpu"])
    timed = dataclasses.replace(inputs, machine=dataclasses.replace(machine, rates=rates))
    first, second = (_plan(timed, c, batch, seq_len, devices) for c in (a, b))
    times = (first.step_time_s, second.step_time_s)
    return _roomy(first) and None not in times and times[0] < times[1]


def _spare_for_results(result: MemoryPlan) -> int:
    """The memory a step without kept attention results leaves where they would be kept: host memory (on a CPU,
    the one memory the device terms share)."""
    if result.machine.device_type == "cpu":
        return max(result.device_capacity - result.peak_device, 0)
    return max(result.host_capacity - result.host_tier, 0)


def _summing(inputs, config: OOMBConfig, batch: int, seq_len: int, devices: int) -> str:
    """``grad_accumulation="auto"``: ``"float32-host"`` where it needs no host memory (one window of chunks, no
    gradient accumulation), else ``"float32"`` if the step fits with it with room to spare (:func:`_roomy`), else
    on a GPU ``"float32-host"`` if the step fits with that, else ``"float32"`` (the plan then refuses, naming the
    options)."""
    if one_window(math.ceil(seq_len / config.chunk_size), inputs.accumulating):
        return "float32-host"
    if inputs.machine.device_type == "cuda":  # float32 sums on the GPU with room to spare, else on the host
        for way, enough in (("float32", _roomy), ("float32-host", lambda result: result.fits)):
            tried = _budgeted(
                inputs, dataclasses.replace(config, grad_accumulation=way), batch, seq_len, devices
            )
            if enough(_plan(inputs, tried, batch, seq_len, devices)):
                return way
    return "float32"


def _roomy(result: MemoryPlan) -> bool:
    """Whether a plan fits with room to spare, as an ``"auto"`` choice must (it trades memory for speed): on a GPU
    ``PLANNED_HEADROOM`` of the device stays free (the allocator's slack, the CUDA context), as a planned
    ``hbm_budget`` leaves it."""
    spare = PLANNED_HEADROOM * result.machine.device_bytes if result.machine.device_type == "cuda" else 0
    return result.fits and result.peak_device <= result.device_capacity - spare


def _budgeted(inputs, config: OOMBConfig, batch: int, seq_len: int, devices: int) -> OOMBConfig:
    machine = inputs.machine
    if not (config.offloads and config.hbm_budget == "auto" and machine.device_type == "cuda"):
        return config
    rest = _plan(inputs, dataclasses.replace(config, hbm_budget=0), batch, seq_len, devices)
    # the budget holds the staging buffers and the device-only layers' pages too
    others = rest.peak_device - rest.device["staging"] - rest.device["kv_hbm"]
    spare = machine.device_bytes - others - int(PLANNED_HEADROOM * machine.device_bytes)
    return dataclasses.replace(config, hbm_budget=max(0, spare))


@dataclass(frozen=True)
class _Inputs:
    shape: ModelShape
    dtypes: Dtypes
    optimizer: OptimizerSpec
    machine: Machine
    precision: str
    micro_batches: int = 1  # per optimizer step (the Trainer's accumulate_grad_batches)

    @property
    def accumulating(self) -> bool:
        return self.micro_batches > 1


def _machine(machine: Machine | str | None, device_memory: int | None, host_memory: int | None) -> Machine:
    if isinstance(machine, Machine):
        return machine
    for name, value in (("device_memory", device_memory), ("host_memory", host_memory)):
        if value is not None and (
            isinstance(value, bool) or not isinstance(value, numbers.Real) or value < 1
        ):
            raise OOMBConfigError(
                f"{name}={value!r} is not a positive number of bytes — pass one (e.g. 80 * 2**30), or None to read "
                "this machine's."
            )
    kind = machine or ("cuda" if device_memory is not None or torch.cuda.is_available() else "cpu")
    if kind not in ("cuda", "cpu"):
        raise OOMBConfigError(f"machine={machine!r} is not a device type — use 'cuda', 'cpu' or a Machine.")
    if device_memory is None and kind == "cuda" and not torch.cuda.is_available():
        raise OOMBConfigError(
            "planning for a CUDA device on a machine without one — its memory cannot be read here — pass "
            "device_memory (bytes, e.g. 141 * 10**9 for an H200; oomb plan: --device-memory 141GB)."
        )
    # what is not given is read here (host memory alone needs no device: a CUDA plan can be made on a CPU machine)
    local = (
        None
        if device_memory is not None and host_memory is not None
        else Machine.local(kind if device_memory is None else "cpu")
    )
    host = int(host_memory) if host_memory is not None else local.host_bytes
    if kind == "cpu":  # the device is host memory: the smaller of the two where both are given
        size = min((int(m) for m in (device_memory, host_memory) if m is not None), default=host)
        return Machine("cpu", size, size)
    size = int(device_memory) if device_memory is not None else local.device_bytes
    return Machine("cuda", size, host, size if device_memory is not None else local.total)


def _converted(shape: ModelShape) -> ModelShape:
    """``shape`` without the bytes read off a module's parameters: counted in the dtype a precision flag converts
    every parameter to."""
    return dataclasses.replace(
        shape, weight_bytes=None, grad_bytes=None, half_trainable=None, half_vectors=None
    )


def _dominant_dtype(module: torch.nn.Module) -> torch.dtype | None:
    counts: dict[torch.dtype, int] = {}
    for p in module.parameters():
        if p.is_floating_point():
            counts[p.dtype] = counts.get(p.dtype, 0) + p.numel()
    return max(counts, key=counts.get) if counts else None


def _plan(inputs: _Inputs, config: OOMBConfig, batch: int, seq_len: int, devices: int = 1) -> MemoryPlan:
    shape, dtypes, spec, machine = inputs.shape, inputs.dtypes, inputs.optimizer, inputs.machine
    p = dtypes.param.itemsize
    params = shape.parameter_count()
    trainable = shape.trainable if shape.trainable is not None else params
    weights = shape.weight_bytes if shape.weight_bytes is not None else params * p
    grads = shape.grad_bytes if shape.grad_bytes is not None else trainable * p
    updated = spec.params if spec.params is not None else trainable
    # states in the trainable parameters' dtype(s), as torch keeps them (float32 LoRA adapters of a 16-bit model)
    state_size = spec.state_dtype.itemsize if spec.state_dtype is not None else grads / max(trainable, 1)
    if spec.state_bytes is not None and spec.state_dtype is None:
        states = spec.state_bytes
    else:
        states = math.ceil(spec.states * updated * state_size)
    step = 0
    if spec.sqrt_copy and not spec.fused:
        foreach = spec.foreach if spec.foreach is not None else machine.device_type == "cuda"
        largest = shape.largest_param or max(shape.num_embeddings, shape.vocab_size) * shape.hidden_size
        group = spec.largest_group if spec.largest_group is not None else updated
        step = math.ceil((group if foreach else largest) * state_size)

    # the pool, exactly as KVPool.reserve sizes it (for one of `devices`: context parallelism splits the pages and
    # each chunk, and replicates every page's summary on each rank: context.SharedSummaries)
    owned = math.ceil(seq_len / devices)
    sparse = config.page_score if config.page_budget is not None else None
    pool = _pool_shape(shape, config, machine, batch, owned, config.chunk_size // devices, dtypes.kv,
                       sparse if devices == 1 else None)  # fmt: skip
    summaries = _summary_bytes(dataclasses.replace(pool, seq_len=seq_len, page_score=sparse), devices)
    pool, tiers, slots = place_layers(
        pool, _budget(config, machine, weights), config.staging_count(pool.block_bytes), config.host_tails
    )
    hbm = arena_bytes(slots["hbm"], pool)
    staging = arena_bytes(slots["staging"], pool) if tiers.host_layers else 0
    host = {
        "pool": arena_bytes(slots["host"], pool),
        "window_tails": host_tail_bytes(pool),
    }  # pinned host terms

    backend = _backend(config, machine, shape)
    ckpt = config.layer_checkpointing
    restaging = set(tiers.host_layers) | set(pool.recycling)  # KVPool.restages: the op saves their K and V
    restaged = pool.parts * sum(math.prod(pool.geometry(layer)) for layer in restaging)
    saved = saved_bytes(
        shape, dtypes, batch, seq_len, config.chunk_size, ckpt, restaged, config.mlp_tile, backend,
        config.mla_pages,
    )  # fmt: skip
    tokens = batch * min(config.chunk_size, seq_len)
    parks = ckpt and config.offloads and machine.device_type in parking.DEVICE_TYPES
    if parks:  # the layers' inputs parked
        saved["layers"], host["parked_saves"] = parked_saves_bytes(shape, dtypes, tokens, pinned=True)
    activations = sum(saved.values())
    # the LM head's gradient is added into its float32 sum, or into its .grad — or, when a gradient hook must see
    # it, made anew for autograd (engine/recurrence.py)
    summing = config.grad_summing(math.ceil(seq_len / config.chunk_size), inputs.accumulating)
    summed = summing == "float32" and dtypes.param in HALF_DTYPES
    accumulator = None if shape.head_grad_hooked else torch.float32 if summed else dtypes.param
    stream = shape.stream_dtype(
        dtypes.activation
    )  # float32 hidden states: the loss in float32 (engine/loss.py)
    losses = dtypes if stream == dtypes.activation else Dtypes(dtypes.param, stream, stream)
    loss = loss_backward_bytes(shape, losses, tokens, config.loss_block, shape.head_trainable, accumulator)
    streamed = bool(tiers.host_layers) and tiers.host_layers[-1] == pool.num_layers - 1
    boundaries = max(math.ceil(seq_len / config.chunk_size) - 1, 0)
    carried = shape.carried_state_bytes(dtypes.compute) * batch * boundaries
    # in the host buffer; the device holds a chunk's leaves and their gradients
    if config.offloads and carried:
        per_boundary = shape.carried_state_bytes(dtypes.compute) * batch
        host["carried_states"] = math.ceil(per_boundary / BOUNDARY_ALIGN) * BOUNDARY_ALIGN * boundaries
        carried = per_boundary * min(boundaries, 2)
    lq = min(config.chunk_size, seq_len)  # the keys a layer's chunk sees: a window's, a page budget's
    # states in flight while a chunk is recomputed and back-propagated: its incoming states' copies, its outgoing
    # states and their gradients (three boundaries' worth)
    handed = 3 * shape.carried_state_bytes(dtypes.compute) * batch
    own = handed if ckpt else 0
    # the widest reach of any layer: a full-attention layer below a windowed last one sees every key
    windows = shape.windows or (None,)
    window = None if None in windows else max(windows)
    reach = min(seq_len, math.inf if window is None else window - 1 + lq,
                math.inf if config.page_budget is None else config.page_budget * config.page_size + lq)  # fmt: skip
    mlp_bwd, attn_bwd, mixer_bwd = layer_backward_bytes(
        shape.attending(config.mla_pages),
        dtypes,
        batch,
        seq_len,
        config.chunk_size,
        ckpt,
        backend,
        streamed,
        config.mlp_tile,
        int(reach),
        pool.num_layers - 1 in restaging,
        config.mla_pages,
    )
    below_head = activations - saved["head"]
    embed = shape.num_embeddings * shape.hidden_size * dtypes.activation.itemsize * shape.embedding_trainable
    # the op's results (kept, parked, reused) are as wide as the pages (stored_head_dim)
    wide = dataclasses.replace(shape, head_dim=pool.widest_head_dim)
    kept = kept_attention_bytes(wide, dtypes, tokens) if ckpt else 0
    if ckpt and config.offloads:  # parked in host memory until each layer's checkpoint recompute
        kept, host["kept_attention"] = parked_kept_bytes(wide, dtypes, tokens, machine.device_type == "cuda")
    sums, host["grad_sums"] = _grad_sums(inputs, config, math.ceil(seq_len / config.chunk_size))
    host["reused_attention"] = reused_attention_bytes(wide, dtypes, config, batch, seq_len, devices)
    host["grad_staging"], mirrored = _grad_staging(inputs, host)
    phases = {
        # (the outgoing Mamba2 states' whole scan results in the loss's moment, of exact terms; the mixers' backward
        # transients were fitted to CPU steps that held them: mixer_bytes)
        "loss backward": sums + handed + scan_views(shape, dtypes, batch, lq) + activations + kept + loss,
        "MLP backward": sums + own + below_head + kept + mlp_bwd,
        "attention backward": sums + own + below_head + kept + attn_bwd,
        "embedding backward": sums + own + saved["other"] + embed,
        "optimizer step": step,
    }
    if shape.mixers:
        phases["mixer backward"] = sums + handed + below_head + kept + mixer_bwd
    device = {
        "weights": weights,
        "gradients": grads,
        "optimizer_states": states,
        "kv_hbm": hbm,
        "staging": staging,
        "page_summaries": summaries,
        "grad_sums": sums,
        "carried_states": carried,
        "activations": activations,
        "kept_attention": kept,
        "loss_transients": loss,
        "layer_transients": max(mlp_bwd, attn_bwd, mixer_bwd),
        "optimizer_transients": step,
    }
    if handed:
        device["states_in_flight"] = handed
    result = MemoryPlan(
        seq_len, batch, config, inputs.precision, spec.name, machine, shape, pool, len(tiers.hbm_layers),
        len(tiers.host_layers), device, phases, sum(host.values()), saved, host_parts=host, grad_mirror=mirrored,
    )  # fmt: skip
    result.fits = result.device_fits and result.host_fits
    result.notes = _notes(inputs, config)
    if machine.rates is not None:
        width = kernel_head_dim(backend, shape.attending(config.mla_pages).head_dim)
        dense, attention = step_flops(shape, seq_len, config, batch, attention_width=width)
        kv, grad = (pool.page_bytes(part) / config.page_size for part in ("kv", "grad"))
        parked = parked_bytes(shape, dtypes, tokens) if parks else 0
        copies = copy_bytes(
            seq_len, config, len(tiers.host_layers), kv, grad, parked, host["reused_attention"],
            pool.tail_host_bytes,
        )  # fmt: skip
        chunks = math.ceil(seq_len / config.chunk_size)
        summed = (
            host_sum_bytes(chunks, inputs.accumulating, _half_elements(inputs)[1], mirrored)
            if config.grad_summing(chunks, inputs.accumulating) == "float32-host"
            else (0.0, 0.0)
        )
        # under context parallelism a rank computes and copies 1/devices of the step, then waits on collectives
        result.step_time_s = step_time(
            dense / devices, attention / devices, copies / devices, machine.rates, summed
        )
        if devices > 1:  # the attention's accumulators are float32 (float64 under 64-true)
            itemsize = dtypes.activation.itemsize
            result.step_time_s += context_seconds(
                shape,
                seq_len,
                config,
                batch,
                devices,
                machine.rates,
                itemsize,
                max(4, itemsize),
                device["gradients"] / inputs.micro_batches,  # one all-reduce per optimizer step
            )
    return result


def reused_attention_bytes(
    shape: ModelShape, dtypes: Dtypes, config: OOMBConfig, batch: int, seq_len: int, devices: int = 1
) -> int:
    """Host bytes of ``reuse_attention``'s buffer on one device: one slot of a whole chunk (of a rank's slice of one
    under context parallelism: its pages split across ``devices``), output and log-sum-exp, per kept chunk and
    attention layer (:class:`~lightning_oomb.engine.results.ForwardResults`)."""
    kept = config.reused_chunks(math.ceil(seq_len / config.chunk_size))
    lse = torch.float64 if dtypes.activation == torch.float64 else torch.float32
    pages = math.ceil(min(config.chunk_size, seq_len) / config.page_size)
    tokens = (
        min(config.chunk_size, seq_len) if devices == 1 else math.ceil(pages / devices) * config.page_size
    )
    slot = result_slot_bytes(batch, shape.num_heads, tokens, shape.head_dim, dtypes.kv, lse)
    return kept * shape.paged_layers * slot


def _grad_sums(inputs: _Inputs, config: OOMBConfig, chunks: int) -> tuple[int, int]:
    """(device, host) bytes of the backward sweep's float32 gradient sums of trainable 16-bit parameters (see the
    module docstring): ``"float32"`` 2 device bytes per element; ``"float32-host"`` 2 per vector element on the
    device, and — once a sweep has more than one window of chunks, or under gradient accumulation — 4 host bytes
    per matrix element (:mod:`~lightning_oomb.engine.grads`; their staging: :func:`_grad_staging`); ``"native"``
    none."""
    vectors, matrices = _half_elements(inputs)
    mode = config.grad_summing(chunks, inputs.accumulating)
    if mode == "float32":
        return 2 * (vectors + matrices), 0
    if mode != "float32-host":
        return 0, 0
    flushed = not one_window(chunks, inputs.accumulating)
    return 2 * vectors, 4 * matrices if flushed else 0


def _grad_staging(inputs: _Inputs, host: dict[str, int]) -> tuple[int, bool]:
    """Host bytes of ``float32-host``'s staging and whether it is the mirror, as
    :class:`~lightning_oomb.engine.grads.HostGradSums` chooses: on a GPU whose host memory has room beside the step's
    other ``host`` terms, a page-locked copy of the matrices' 16-bit gradients (their flushes' adds then run beside
    the compute); else two slabs."""
    if not host["grad_sums"]:
        return 0, False
    machine, shape = inputs.machine, inputs.shape
    mirror = 2 * _half_elements(inputs)[1]
    if (
        machine.device_type == "cuda"
        and sum(host.values()) + mirror <= machine.host_bytes - HOST_RESERVE_BYTES
    ):
        return mirror, True
    largest = shape.largest_param or max(shape.num_embeddings, shape.vocab_size) * shape.hidden_size
    return 2 * 2 * staging_elements(largest), False


def _half_elements(inputs: _Inputs) -> tuple[int, int]:
    """Trainable 16-bit elements in (1-D parameters, the others)."""
    shape = inputs.shape
    if shape.half_trainable is not None:
        vectors = shape.half_vectors if shape.half_vectors is not None else shape.vector_params()
        return min(vectors, shape.half_trainable), max(shape.half_trainable - vectors, 0)
    if inputs.dtypes.param not in HALF_DTYPES:
        return 0, 0
    trainable = shape.trainable if shape.trainable is not None else shape.parameter_count()
    vectors = min(shape.vector_params(), trainable)
    return vectors, trainable - vectors


def _budget(config: OOMBConfig, machine: Machine, weights: int) -> int | None:
    """The ``hbm_budget`` the pool will compute at the first step, when only the weights are on the device."""
    return hbm_budget(config, machine.device_type, lambda: (machine.device_bytes - weights, machine.total))


def _summary_bytes(pool: PoolShape, devices: int) -> int:
    """Bytes of a sparse step's page summaries, every page's: on one device the pool's one tensor at the widest
    layer's KV heads and head dim (``PoolShape.summary_bytes``); under context parallelism each layer's own, at its
    pages' geometry (:class:`~lightning_oomb.engine.context.SharedSummaries`)."""
    if devices == 1 or pool.page_score is None:
        return pool.summary_bytes
    per_page = pool.batch * pool.pages_per_row * PAGE_SCORES[pool.page_score] * pool.dtype.itemsize
    return per_page * sum(math.prod(pool.geometry(layer)) for layer in range(pool.num_layers))


def _backend(config: OOMBConfig, machine: Machine, shape: ModelShape | None = None) -> str:
    """The attention backend whose transients the plan counts: on a CPU the fused path's, unless the step's calls
    take the plain reference (``engine/cpu_attention.py``'s ``fast_path``: an attention softcap): then ``torch``'s,
    the reference's score blocks."""
    if config.attention_backend != "auto":
        backend = config.attention_backend
    else:
        backend = {"cuda": "triton", "cpu": "cpu"}.get(machine.device_type, "torch")
    referenced = shape is not None and shape.attention_softcap
    return "torch" if backend == "cpu" and referenced else backend


def _notes(inputs: _Inputs, config: OOMBConfig) -> list[str]:
    notes = []
    shape, dtypes = inputs.shape, inputs.dtypes
    if not shape.calibrated:
        notes.append(
            f"activations of {shape.family} estimated with the layer formula (checked on CPU steps of "
            f"{', '.join(CALIBRATED)}): treat them as approximate"
        )
    if shape.unsized_states:
        notes.append(
            f"{shape.family} carries states but has no carried_state_elements(): its states are not counted"
        )
    if shape.mixers:
        notes.append(
            "carried mixers counted as transformers' torch implementation computes them (the fla / mamba_ssm "
            "kernels hold less)"
        )
    if config.kv_grad_dtype == "bfloat16" and dtypes.kv.itemsize > GRAD_DTYPES["bfloat16"].itemsize:
        notes.append(f"kv_grad_dtype='bfloat16' has no effect with {dtypes.kv} K/V (never narrower)")
    return notes


# ------------------------------------------------------------------------------------------------------ options
def _options(
    inputs: _Inputs, config: OOMBConfig, batch: int, seq_len: int, asked: OOMBConfig
) -> list[Option]:
    """The changes that make the step fit, each planned (see the module docstring), the fastest of each kind
    first; a shorter ``seq_len`` with the ``"auto"`` options of ``asked`` decided for it, as a run of that length
    decides them."""
    fitting: list[Option] = []

    def attempt(changes: dict, cfg: OOMBConfig, n: int = seq_len, devices: int = 1, text: str | None = None):
        result = _plan(inputs, cfg, batch, n, devices)
        if result.fits:
            fitting.append(Option(changes, text or _say(changes), result.peak_device, result.host_tier))
        return result.fits

    singles = []
    for group in _candidates(inputs, config, batch, seq_len):
        fit = next(
            (c for c in group if _plan(inputs, dataclasses.replace(config, **c), batch, seq_len).fits), None
        )
        singles.append(fit or group[-1])  # the most a pair can gain from this group
        if fit:
            attempt(fit, dataclasses.replace(config, **fit))
    if not fitting:
        for i, a in enumerate(singles):
            for b in singles[i + 1 :]:
                both = {**a, **b}
                if not a.keys() & b.keys():
                    if both.get("chunk_size", config.chunk_size) < config.chunk_size:
                        # the largest smaller chunk that fits with the other change
                        other = dataclasses.replace(
                            config, **{k: v for k, v in both.items() if k != "chunk_size"}
                        )
                        both["chunk_size"] = (
                            _largest_chunk(inputs, other, batch, seq_len) or both["chunk_size"]
                        )
                    attempt(both, dataclasses.replace(config, **both))
    # outside the strategy's options: a fused optimizer step (no state-sized temporary), 16-bit weights and states
    spec, dtypes, other = inputs.optimizer, inputs.dtypes, []
    if spec.sqrt_copy and not spec.fused:
        name = "AdamW" if spec.name.startswith("adamw") else "Adam"
        fused = dataclasses.replace(inputs, optimizer=dataclasses.replace(spec, fused=True))
        other.append(
            (fused, {"optimizer": "fused"}, f"a fused optimizer (torch.optim.{name}(..., fused=True))")
        )
    if dtypes.mixed and dtypes.compute.itemsize == 2:
        flag = "bf16-true" if dtypes.compute == torch.bfloat16 else "16-true"
        half = dataclasses.replace(
            inputs,
            shape=_converted(inputs.shape),
            dtypes=precision_dtypes(flag),
            optimizer=dataclasses.replace(spec, state_bytes=None),
            precision=flag,
        )
        other.append(
            (half, {"precision": flag}, f"precision='{flag}' (16-bit weights, gradients and states)")
        )
    if len(other) == 2:  # both together
        both = dataclasses.replace(other[1][0], optimizer=other[0][0].optimizer)
        other.append((both, {**other[0][1], **other[1][1]}, f"{other[0][2]} and {other[1][2]}"))
    # each alone, else with the fewest of the strategy's options that make it fit (one, then two); both together
    # only if neither fits so
    withs = [{}, *singles, *({**a, **b} for i, a in enumerate(singles) for b in singles[i + 1 :]
                            if not a.keys() & b.keys())]  # fmt: skip
    found = False
    for index, (changed, changes, text) in enumerate(other):
        if index == 2 and found:
            break
        for extra in withs:  # the "auto" options decided as a run with these changes decides them
            tried = decide_auto(changed, dataclasses.replace(asked, **extra), batch, seq_len)
            result = _plan(changed, tried, batch, seq_len)
            if result.fits:
                said = f"{text} with {_say(extra)}" if extra else text
                fitting.append(Option({**changes, **extra}, said, result.peak_device, result.host_tier))
                found = True
                break

    def decided(n: int) -> OOMBConfig:
        return decide_auto(inputs, asked, batch, n)

    # the longest context (whole pages) that fits
    longest = longest_fitting(
        lambda n: _plan(inputs, decided(n), batch, n).fits, config.page_size, seq_len - 1
    )
    if longest:
        attempt(
            {"seq_len": longest}, decided(longest), longest, text=f"seq_len={longest} or fewer tokens per row"
        )
    for devices in (2, 4, 8, 16, 32, 64):
        text = f"{devices} devices with context parallelism (strategy='oomb_cp', context_parallel_size={devices})"
        if attempt({"devices": devices}, config, seq_len, devices, text):
            break
    return fitting


def longest_fitting(fits: Callable[[int], bool], step: int, upper: int) -> int:
    """The largest multiple of ``step`` at most ``upper`` for which ``fits`` holds (``fits`` monotone: what is
    larger fits less), by bisection; 0 if none does. E.g. the longest step a machine holds:
    ``longest_fitting(lambda n: plan(model, n, ...).fits, chunk_size, 1 << 24)``."""
    lo, hi = 0, upper // step
    while lo < hi:
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if fits(mid * step) else (lo, mid - 1)
    return lo * step


def _candidates(inputs: _Inputs, config: OOMBConfig, batch: int, seq_len: int) -> list[list[dict]]:
    """Groups of alternative changes, the preferred (fastest) first in each group."""
    groups = []
    if config.kv_grad_dtype == "float32" and inputs.dtypes.kv.itemsize < 4:
        groups.append([{"kv_grad_dtype": "bfloat16"}])
    chunks = math.ceil(seq_len / config.chunk_size)
    device_sums, host_sums = _grad_sums(inputs, config, chunks)
    if device_sums or host_sums:  # on a GPU float32-host keeps the flat error for host memory
        summing = config.grad_summing(chunks, inputs.accumulating)
        ways = ["float32-host"] * (inputs.machine.device_type == "cuda" and summing == "float32")
        groups.append([{"grad_accumulation": way} for way in (*ways, "native")])
    kept = config.reused_chunks(math.ceil(seq_len / config.chunk_size))
    if kept:  # fewer kept results (host memory), the most expensive chunks' first
        fewer = [kept // 2**i for i in range(1, kept.bit_length())]
        groups.append([*({"reuse_attention": k} for k in fewer), {"reuse_attention": False}])
    if not config.layer_checkpointing:
        groups.append([{"layer_checkpointing": True}])
    # tiles shorter than a chunk's rows, the longest (fastest) first; below 128 tokens a tile's matmuls grow thin
    tiles = [{"mlp_tile": t} for t in (1024, 512, 256, 128) if t < min(config.chunk_size, seq_len)]
    if config.mlp_tile is None and not inputs.shape.num_experts and tiles:
        groups.append(tiles)
    # smaller blocks of the loss's logits, the largest (fastest) first
    blocks = [
        {"loss_block": b}
        for b in (512, 256, 128, 64)
        if b < min(config.loss_block, batch * config.chunk_size)
    ]
    if blocks:
        groups.append(blocks)
    # the largest smaller chunk that fits, else a page's (the most a pair can gain from it)
    if min(config.chunk_size, seq_len) > config.page_size:
        largest = _largest_chunk(inputs, config, batch, seq_len)
        groups.append(
            [{"chunk_size": c} for c in dict.fromkeys((largest or config.page_size, config.page_size))]
        )
    pool = _pool_shape(
        inputs.shape, config, inputs.machine, batch, seq_len, config.chunk_size, inputs.dtypes.kv
    )
    # a larger chunk where window layers keep their tails (Gemma 2 / 3 / 4): fewer chunk starts keep fewer tails
    larger = [{"chunk_size": c} for c in (2 * config.chunk_size, 4 * config.chunk_size) if c < seq_len]
    if pool.recycling and larger:
        groups.append(larger)
    if inputs.machine.device_type == "cuda":
        offload = (
            []
            if config.offloads and config.hbm_budget == "auto"
            else [{"offload": True, "hbm_budget": "auto"}]
        )
        # the device-only layers (window layers keeping their tails — in host memory but a ring of two, once the
        # budget is short — others' KV heads) stay; then k full layers (the rest in the host tier)
        hosting = dataclasses.replace(pool, host_tails=True)
        full = pool.num_layers - len(pool.device_only)
        staging = config.staging_count(pool.block_bytes) * pool.block_bytes

        def budgets(fixed: int, extra: dict | None = None) -> list[dict]:
            return [{"offload": True, **(extra or {}), "hbm_budget": fixed + staging + k * pool.layer_bytes}
                    for k in range(full - 1, -1, -1)]  # fmt: skip

        kept = sum(map(pool.bytes_of, pool.device_only))
        if hosting.hosted_tails and config.host_tails is not False:
            hosted = sum(map(hosting.bytes_of, hosting.device_only))
            groups.append(
                [
                    *offload,
                    {"offload": True, "hbm_budget": hosted + full * pool.layer_bytes},
                    *budgets(hosted),
                ]
            )
            # where host memory is short: the tails stay on the device, full layers go to the host instead
            groups.append(budgets(kept, {"host_tails": False}))
        else:
            groups.append(offload + budgets(kept))
    # latent attention over one head of latents: fewer page bytes, more attention FLOPs
    if inputs.shape.latent_width and config.mla_pages == "expanded":
        groups.append([{"mla_pages": "latent"}])
    return groups


def _largest_chunk(inputs: _Inputs, config: OOMBConfig, batch: int, seq_len: int) -> int | None:
    """The largest ``chunk_size`` below the chunk's rows (``min(chunk_size, seq_len)``), a multiple of ``page_size``,
    with which the step fits (by bisection: a shorter chunk holds fewer activations); ``None`` if none does."""

    def fits(chunk: int) -> bool:
        return _plan(inputs, dataclasses.replace(config, chunk_size=chunk), batch, seq_len).fits

    return longest_fitting(fits, config.page_size, min(config.chunk_size, seq_len) - 1) or None


def _say(changes: dict) -> str:
    parts = []
    for key, value in changes.items():
        if key == "hbm_budget" and isinstance(value, int):
            parts.append(f"hbm_budget={value} ({gib(value)})")
        else:
            parts.append(f"{key}={value!r}")
    return ", ".join(parts)
