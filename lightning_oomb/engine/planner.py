"""Memory planner: a training step's peak memory, predicted before anything is allocated.

:func:`plan` takes a model (a transformers config, an ``nn.Module``, a :class:`~lightning_oomb.engine.model.
ChunkModel` or a :class:`ModelShape`), ``batch x seq_len``, an :class:`~lightning_oomb.engine.config.OOMBConfig`,
a Lightning precision flag, an optimizer and a :class:`Machine`, and returns a :class:`MemoryPlan`: every term of
the device's peak and of the pinned host tier, in bytes, whether the step fits, and — when it does not — the
options that would make it fit (each tried in the planner).

**Terms** (``T = batch x min(chunk_size, seq_len)`` tokens per chunk; ``r`` / ``c``: itemsize of the activations
(the parameters' dtype) and of the compute dtype, which differ only under autocast):

- *weights*, *gradients* (trainable parameters, their dtype), *optimizer states* (parameter-sized tensors per
  trainable parameter, in the trainable parameters' dtype as torch keeps them: AdamW 2, SGD with momentum 1, SGD 0).
- *KV pool*: :func:`~lightning_oomb.engine.kv_pool.place_layers` and :func:`~lightning_oomb.engine.pages.arena_bytes`
  of the engine's own :class:`~lightning_oomb.engine.pages.PoolShape` (sliding-window layers keeping only their
  tails, as the model's windows say) — exactly what ``KVPool.reserve`` allocates
  (HBM tier and staging buffers on the device, the host tier pinned). K/V are in the compute dtype (the autocast
  dtype under ``*-mixed``: the op casts ``q, k, v`` to it) and, on a GPU, a head dim the Triton kernels cannot tile
  zero-padded to the next power of two (:func:`~lightning_oomb.engine.attention.stored_head_dim`). A sparse step
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
  the backward rewrites (host tier, a window layer keeping only its tails) its chunk's K and V (``2c Hkv D``). Under
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
from collections import Counter
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from lightning_oomb.engine import parking
from lightning_oomb.engine.attention import stored_head_dim
from lightning_oomb.engine.config import OOMBConfig
from lightning_oomb.engine.context import check_context
from lightning_oomb.engine.cpu_attention import PAST_BLOCK
from lightning_oomb.engine.errors import OOMBConfigError
from lightning_oomb.engine.grads import HALF_DTYPES, one_window, staging_elements
from lightning_oomb.engine.kv_pool import device_memory_available, hbm_budget, place_layers
from lightning_oomb.engine.memory import HOST_RESERVE_BYTES, host_memory_available
from lightning_oomb.engine.model_shape import CALIBRATED, NORM_BYTES, Mixer, ModelShape, model_shape
from lightning_oomb.engine.pages import GRAD_DTYPES, PoolShape, arena_bytes
from lightning_oomb.engine.reference import KEY_BLOCK
from lightning_oomb.engine.results import result_slot_bytes
from lightning_oomb.engine.states import BOUNDARY_ALIGN
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
ID_BYTES = 8  # token ids and targets are int64

# Lightning precision flags -> (parameter dtype, autocast dtype or None)
PRECISIONS: dict[str, tuple[torch.dtype, torch.dtype | None]] = {
    "32-true": (torch.float32, None),
    "64-true": (torch.float64, None),
    "bf16-true": (torch.bfloat16, None),
    "16-true": (torch.float16, None),
    "bf16-mixed": (torch.float32, torch.bfloat16),
    "16-mixed": (torch.float32, torch.float16),
}
_ALIASES = {"32": "32-true", "64": "64-true", "16": "16-mixed", "bf16": "bf16-mixed"}
# Lightning converts the model's weights to these flags' dtype
_CONVERTING = ("64-true", "bf16-true", "16-true")


# ------------------------------------------------------------------------------------------------------ inputs
@dataclass(frozen=True)
class Dtypes:
    """``param``: weights, gradients and optimizer states; ``activation``: the residual stream, K/V and what
    layers save (the parameters' dtype); ``compute``: what matmuls produce (the autocast dtype under ``*-mixed``)."""

    param: torch.dtype
    activation: torch.dtype
    compute: torch.dtype

    @property
    def mixed(self) -> bool:
        return self.compute != self.activation

    @property
    def kv(self) -> torch.dtype:
        """Attention's ``q, k, v``, output and K/V pages: the compute dtype (autocast casts them, as it casts
        ``scaled_dot_product_attention``'s)."""
        return self.compute


def precision_dtypes(precision: str | int, param_dtype: torch.dtype | None = None) -> Dtypes:
    """The dtypes a Lightning ``precision`` flag gives (``param_dtype``: the model's own, when it is known; the
    flags that convert the weights — ``*-true`` but ``32-true`` — take theirs, e.g. a float32 module planned for
    ``bf16-true``; the others keep it, e.g. a bf16 checkpoint under ``32-true``)."""
    flag = _ALIASES.get(str(precision), str(precision))
    if flag not in PRECISIONS:
        raise OOMBConfigError(
            f"precision={precision!r} is not a precision the OOMB strategy runs — the planner needs the dtypes of "
            f"weights and compute — use one of {sorted(PRECISIONS)}."
        )
    param, autocast = PRECISIONS[flag]
    param = param if flag in _CONVERTING or param_dtype is None else param_dtype
    return Dtypes(param, param, autocast or param)


@dataclass(frozen=True)
class OptimizerSpec:
    """``states``: parameter-sized state tensors per trainable parameter; ``state_dtype``: their dtype (``None``:
    the parameter's, as torch's ``zeros_like``/``clone`` keep them); ``sqrt_copy``: a step makes a state-sized
    ``sqrt`` temporary (Adam's), of the largest parameter group with ``foreach`` (``None``: torch's default, on
    for CUDA) or of the largest parameter in the for-loop implementation, none when ``fused``; ``params``,
    ``state_bytes``, ``largest_group``: what an optimizer instance updates (``None``: every trainable parameter)."""

    name: str
    states: int
    state_dtype: torch.dtype | None = None
    sqrt_copy: bool = False
    foreach: bool | None = None
    fused: bool = False
    params: int | None = None
    state_bytes: int | None = None
    largest_group: int | None = None


_OPTIMIZERS = {"none": 0, "sgd": 0, "sgd-momentum": 1, "adam": 2, "adamw": 2, "adagrad": 1, "rmsprop": 1,
               "adam-fused": 2, "adamw-fused": 2}  # fmt: skip


def optimizer_spec(optimizer: Any) -> OptimizerSpec:
    """The :class:`OptimizerSpec` of ``optimizer``: ``None`` / ``"none"``, ``"sgd"``, ``"sgd-momentum"``,
    ``"adamw"``, ``"adam"`` (torch's default implementation: ``foreach`` on CUDA), ``"adamw-fused"``,
    ``"adam-fused"`` (``fused=True``), ..., an :class:`OptimizerSpec`, or a ``torch.optim.Optimizer`` (its type,
    options and parameter groups are read; an unknown type is assumed to keep two states per parameter, like
    Adam), or a list of torch optimizers (manual optimization's: their states summed)."""
    if isinstance(optimizer, OptimizerSpec):
        return optimizer
    if isinstance(optimizer, (list, tuple)):
        specs = [optimizer_spec(o) for o in optimizer]
        if len(specs) == 1:
            return specs[0]
        if not all(isinstance(o, torch.optim.Optimizer) for o in optimizer) or not specs:
            raise OOMBConfigError(
                f"optimizer={optimizer!r}: a list is read as the torch optimizers one step uses (their parameters "
                "and states are summed) — pass the torch.optim.Optimizer instances, or one name or OptimizerSpec."
            )
        copies = [s for s in specs if s.sqrt_copy and not s.fused]
        return OptimizerSpec(
            " + ".join(s.name for s in specs),
            max(s.states for s in specs),
            sqrt_copy=bool(copies),
            params=sum(s.params for s in specs),
            state_bytes=sum(s.state_bytes for s in specs),
            largest_group=max((s.largest_group for s in copies), default=0),
        )
    if optimizer is None:
        return OptimizerSpec("none", 0)
    if isinstance(optimizer, str):
        name = optimizer.lower().replace("_", "-")
        if name not in _OPTIMIZERS:
            raise OOMBConfigError(
                f"optimizer={optimizer!r} is unknown to the planner — it counts each optimizer's state tensors — "
                f"use one of {sorted(_OPTIMIZERS)}, an OptimizerSpec, or the torch optimizer itself."
            )
        fused = name.endswith("-fused")
        return OptimizerSpec(name, _OPTIMIZERS[name], sqrt_copy=name in ("adam", "adamw"), fused=fused)
    if isinstance(optimizer, torch.optim.Optimizer):
        return _spec_of_optimizer(optimizer)
    raise OOMBConfigError(
        f"optimizer={optimizer!r} is not an optimizer — the planner counts its states — pass a name such as "
        "'adamw', an OptimizerSpec, or a torch.optim.Optimizer."
    )


def _spec_of_optimizer(optimizer: torch.optim.Optimizer) -> OptimizerSpec:
    kind = type(optimizer).__name__.lower()
    d = optimizer.defaults
    if kind == "sgd":
        states = int(bool(d.get("momentum", 0)))
    elif kind in ("adam", "adamw"):
        states = 2 + int(bool(d.get("amsgrad", False)))
    elif kind == "rmsprop":
        states = 1 + int(bool(d.get("momentum", 0))) + int(bool(d.get("centered", False)))
    else:
        states = _OPTIMIZERS.get(kind, 2)
    groups = [[p for p in g["params"] if p.requires_grad] for g in optimizer.param_groups]
    params = [p for g in groups for p in g]
    # named as given: the planner's names of its options (SGD with momentum, a fused or AMSGrad Adam)
    name = kind if kind in _OPTIMIZERS else f"{type(optimizer).__name__} (assumed Adam-like)"
    if kind == "sgd" and states:
        name = "sgd-momentum"
    elif kind in ("adam", "adamw"):
        name += "-fused" * bool(d.get("fused")) + " (amsgrad)" * bool(d.get("amsgrad", False))
    return OptimizerSpec(
        name,
        states,
        sqrt_copy=kind in ("adam", "adamw"),
        foreach=d.get("foreach"),
        fused=bool(d.get("fused")),
        params=sum(p.numel() for p in params),
        state_bytes=states * sum(p.numel() * p.element_size() for p in params),
        largest_group=max((sum(p.numel() for p in g) for g in groups), default=0),
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


# ------------------------------------------------------------------------------------------------------ terms
def saved_bytes(
    shape: ModelShape,
    dtypes: Dtypes,
    batch: int,
    seq_len: int,
    chunk_size: int,
    layer_checkpointing: bool,
    restaged_layers: int = 0,
    mlp_tile: int | None = None,
) -> dict[str, int]:
    """Bytes autograd holds at the end of one full chunk's recompute, by part: ``layers`` (decoder layers),
    ``weight_copies`` (autocast's cast weights), ``head`` (final norm, the loss's hidden states, targets) and
    ``other`` (the step's token ids, RoPE cos/sin) — what :class:`~lightning_oomb.engine.memory.SavedTensorMeter`
    measures as its peak. ``restaged_layers``: layers whose op saves its chunk's K and V for the backward's rewrite
    (host-tier layers and window layers keeping only their tails: ``KVPool.restages``)."""
    tokens = batch * min(chunk_size, seq_len)
    r, c = dtypes.activation.itemsize, dtypes.compute.itemsize
    if layer_checkpointing:  # a checkpointed layer saves its input only
        layers = _layer_inputs_bytes(shape, dtypes) * tokens
        copies = rope = 0
    else:
        tiled = mlp_tiled(shape, mlp_tile, min(chunk_size, seq_len))
        _, mlp, dense = _layer_bytes_per_token(shape, dtypes, streamed=False, tiled=tiled)
        # each paged layer's attention at its own head dim (Gemma 4's sliding layers narrower than its global ones)
        dims = Counter(shape.own_head_dims)
        attention = sum(
            n * _layer_bytes_per_token(shape, dtypes, False, tiled, d)[0] for d, n in dims.items()
        )
        if shape.qk_norm and shape.qk_norm_layers is not None:  # (the layers without: Llama 4's NoPE layers)
            unnormed = max(shape.paged_layers - shape.qk_norm_layers, 0)
            attention -= unnormed * _qk_norm_bytes(shape, dtypes, min(dims, default=shape.head_dim))
        # a host-tier or tail-keeping window layer saves its chunk's K and V too
        restaged = 2 * dtypes.kv.itemsize * shape.kv_heads * shape.head_dim
        # a hybrid's layers without attention: their input norm and carried mixer (mixer_bytes); a ChunkModel's
        # other layers without attention are its MLP-only blocks
        mixer_layers = min(shape.num_layers - shape.paged_layers, len(shape.mixers))
        mixed = mixer_layers * (_mixer_norm_bytes(shape, dtypes) + _output_norm_bytes(shape, dtypes)) * tokens
        mixed += sum(_mixer_saves(shape, dtypes, batch, min(chunk_size, seq_len)))
        mlps = shape.moe_mlps * mlp + (shape.mlps - shape.moe_mlps) * dense
        per_token = attention + mlps + restaged_layers * restaged
        # each layer's gate of its own input (Gemma 4's): the gate's input, its GELU's input and output, the
        # projection's input; under autocast the gate's cast input and both weights' copies
        gate = shape.per_layer_inputs
        per_token += (
            shape.num_layers * ((c if dtypes.mixed else r) * shape.hidden_size + 3 * c * gate) * bool(gate)
        )
        layers = (per_token + adapter_bytes(shape, dtypes)) * tokens + mixed
        linear = shape.linear_weights
        # the Llama-style layers' (a hybrid's: attention in its paged layers, its mixers' own projections)
        if linear is None:
            linear = shape.linear_params - shape.moe_mlps * shape.uncast_expert_params
            if shape.mixers and all(m.linear_weights for m in shape.mixers):
                unpaged = shape.num_layers - shape.paged_layers
                linear += sum(m.linear_weights for m in shape.mixers) - unpaged * shape.attention_params
        copies = (linear + 2 * shape.num_layers * shape.hidden_size * gate) * c if dtypes.mixed else 0
        # cos and sin, shared by the layers of a head dim or a table (layer_rope: each layer's float32 copies)
        widths = sum(dims) if len(dims) > 1 else shape.rope_tables * shape.head_dim
        rope = (
            2
            * min(chunk_size, seq_len)
            * widths
            * (NORM_BYTES * shape.paged_layers if shape.layer_rope else r)
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


def _page_head_dim(shape: ModelShape, config: OOMBConfig, machine: Machine) -> int:
    """The pages' head dim: on a GPU with the Triton kernels, ``shape.head_dim`` zero-padded to a power of two."""
    triton = machine.device_type == "cuda" and config.attention_backend in ("auto", "triton")
    return stored_head_dim("triton" if triton else "torch", shape.head_dim)


def _layer_bytes_per_token(
    shape: ModelShape, dtypes: Dtypes, streamed: bool, tiled: bool = False, head_dim: int | None = None
) -> tuple[int, int, int]:
    """Bytes per token one decoder layer saves: (input norm + attention, post-attention norm + MLP — an MoE
    layer's where the model has experts — and the same for a dense MLP); a ``tiled`` MLP (``mlp_tile``) saves only
    its input. Frozen layers (``frozen_layers``: LoRA) save no normed input for their
    norms' weights, and their projections' inputs only where LoRA adapters in the activations' dtype read them
    (wider adapters save their own copies: :func:`adapter_bytes`). Norms of the attention's and the MLP's outputs
    (``layer_norms`` 4: Gemma 2/3) and a sigmoid gate on the attention output count with attention; with one norm a
    layer (``layer_norms`` 1: Cohere's parallel block) the MLP reads the attention's (under autocast its own cast
    copies). ``head_dim``: the layer's own (``ModelShape.layer_head_dims``; default ``shape.head_dim``): its
    projections' and norms' widths, the op's saved q and output at ``shape.head_dim`` (the pages')."""
    r, c, f = dtypes.activation.itemsize, dtypes.compute.itemsize, NORM_BYTES
    h, heads, kv_heads = shape.hidden_size, shape.num_heads, shape.kv_heads
    d = shape.head_dim if head_dim is None else head_dim
    q, kv, paged_q = heads * d, kv_heads * d, heads * shape.head_dim
    lse = 8 if dtypes.activation == torch.float64 else 4
    # the projections' inputs are saved by the projections, else by adapters in the activations' dtype
    inputs = not shape.frozen_layers or any(a <= r for _, _, a, _ in shape.adapters)

    def norm(readers: int, own: bool = True) -> int:  # the norm's saved tensors, what the projections save
        saved = shape.norm_bytes(dtypes.activation) if own else 0
        return saved + (readers * c * h if dtypes.mixed else r * h * own) * inputs

    gated = shape.gated_attention
    readers = shape.norm_readers or (0, 0, 0)  # (0: q, k, v and a gate; gate and up; gate and up)
    attention_readers, mlp_readers = readers[0] or 3 + gated, readers[1] or 2
    # (an MoE layer's readers as read off its modules — router, shared experts — where its routed experts read no
    # cast copy of the whole normed input: grouped_mm's read it uncast, an expert loop's its gathered rows)
    moe_readers = readers[2] * (shape.uncast_experts or shape.expert_loop) or 2
    routed = shape.intermediate_size * shape.routed_per_token
    attn = norm(attention_readers) + 2 * c * paged_q + lse * heads + (c if dtypes.mixed else r) * q * inputs
    # a gate's sigmoid, and the output it multiplies (a copy of the op's: reshaped)
    attn += 2 * c * q * gated
    # a gate per head (LFM3's): its sigmoid and the output it multiplies (a copy of the op's)
    attn += c * (q + heads) * shape.head_gate
    attn += _output_norm_bytes(shape, dtypes)
    attn += _qk_norm_bytes(shape, dtypes, d) * shape.qk_norm
    if shape.value_norm:  # its float32 input and two per-head scalars (no weight: no normed input)
        attn += f * (kv + 2 * kv_heads)
    if streamed:
        attn += 2 * c * kv_heads * shape.head_dim

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
        saved = norm(moe_readers, own) + (3 + inputs) * c * (width - routed)
        return saved + routed_bytes(shape, dtypes) + 2 * f * shape.num_experts

    dense = mlp(shape.dense_mlp_width, False)
    return attn, (mlp(shape.mlp_width, True) if shape.num_experts else dense), dense


def _qk_norm_bytes(shape: ModelShape, dtypes: Dtypes, head_dim: int) -> int:
    """Bytes per token a layer's per-head norms of q and k save: float32 input, 1/rms and the normed input (in the
    compute dtype; ``float32_norms``: float32; ``rotated_qk_norms``: RoPE's float32 tables made it the activations'
    dtype under autocast; ``weightless_qk_norms``: none, no weight needs it)."""
    r, c, f = dtypes.activation.itemsize, dtypes.compute.itemsize, NORM_BYTES
    normed = (
        0 if shape.weightless_qk_norms else f if shape.float32_norms else r if shape.rotated_qk_norms else c
    )
    heads = shape.num_heads + shape.kv_heads
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
    # under autocast a short convolution's cast input and all it computes in the compute dtype (ZAYA's attention
    # projection, its values delayed, counted as one: in the activations' dtype)
    if mixer.kind == "conv":
        e = r if mixer.delayed else c
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
    ``restaged`` layer (a ``streamed`` one, or a window layer keeping only its tails) saves its chunk's K and V."""
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
        held_attn = (attn * tokens + attn_copies) - (r * q + acc * shape.num_heads) * tokens
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

    def format(self) -> str:
        """A plain-text table of every term, the verdict and the options."""
        lines = [f"{'term':<34}{'device':>14}{'host':>14}"]
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
    """
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
    others = rest.peak_device - rest.device["staging"]  # the budget holds the staging buffers too
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
    pool = PoolShape(shape.paged_layers, batch, owned, shape.kv_heads, _page_head_dim(shape, config, machine),
                     config.page_size, config.chunk_size // devices, config.kv_grad_dtype, dtypes.kv,
                     windows=shape.windows,
                     page_score=sparse if devices == 1 else None)  # fmt: skip
    summaries = dataclasses.replace(pool, seq_len=seq_len, page_score=sparse).summary_bytes
    tiers, slots = place_layers(
        pool, _budget(config, machine, weights), config.staging_count(pool.block_bytes)
    )
    hbm = arena_bytes(slots["hbm"], pool)
    staging = arena_bytes(slots["staging"], pool) if tiers.host_layers else 0
    host = {"pool": arena_bytes(slots["host"], pool)}  # the pinned host memory's terms

    backend = _backend(config, machine, shape)
    ckpt = config.layer_checkpointing
    restaging = set(tiers.host_layers) | set(pool.recycling)  # KVPool.restages: the op saves their K and V
    saved = saved_bytes(
        shape, dtypes, batch, seq_len, config.chunk_size, ckpt, len(restaging), config.mlp_tile
    )
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
        shape,
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
    )
    below_head = activations - saved["head"]
    embed = shape.num_embeddings * shape.hidden_size * dtypes.activation.itemsize * shape.embedding_trainable
    # the op's results (kept, parked, reused) are as wide as the pages (zero-padded heads: stored_head_dim)
    wide = dataclasses.replace(shape, head_dim=pool.head_dim)
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
        dense, attention = step_flops(shape, seq_len, config, batch)
        kv, grad = (pool.page_bytes(part) / config.page_size for part in ("kv", "grad"))
        parked = parked_bytes(shape, dtypes, tokens) if parks else 0
        copies = copy_bytes(
            seq_len, config, len(tiers.host_layers), kv, grad, parked, host["reused_attention"]
        )
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
                    if "chunk_size" in both:  # the largest chunk that fits with the other change
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
    if inputs.machine.device_type == "cuda":
        offload = (
            []
            if config.offloads and config.hbm_budget == "auto"
            else [{"offload": True, "hbm_budget": "auto"}]
        )
        shape = inputs.shape
        pool = PoolShape(shape.paged_layers, batch, seq_len, shape.kv_heads,
                         _page_head_dim(shape, config, inputs.machine), config.page_size, config.chunk_size,
                         config.kv_grad_dtype, inputs.dtypes.kv,
                         windows=shape.windows)  # fmt: skip
        # window layers keeping only their tails stay on the device; then k full layers, most first
        staging = config.staging_count(pool.block_bytes) * pool.block_bytes
        fixed = sum(map(pool.bytes_of, pool.recycling)) + staging
        offload += [{"offload": True, "hbm_budget": fixed + k * pool.layer_bytes}
                    for k in range(pool.num_layers - len(pool.recycling) - 1, -1, -1)]  # fmt: skip
        groups.append(offload)
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
