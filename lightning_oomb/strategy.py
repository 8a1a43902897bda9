"""``OOMBStrategy`` ("oomb"): exact chunk-recurrent training of a Hugging Face causal LM on one device.

The user's LightningModule stays unchanged: inside its ``training_step``, ``self.model(**batch)`` is answered by
the engine, whose loss is an autograd Function (forward sweep now, backward sweep when the loop calls
``backward``). The loop's order (training_step → zero_grad → backward → clip → step), AMP scaling, gradient
accumulation and clipping are untouched (notes/lightning-integration.md §2-3).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from lightning.pytorch import LightningModule
from lightning.pytorch.accelerators import Accelerator
from lightning.pytorch.plugins.io import CheckpointIO
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.strategies import SingleDeviceStrategy
from lightning.pytorch.utilities import rank_zero_warn
from lightning.pytorch.utilities.types import STEP_OUTPUT
from transformers.modeling_outputs import CausalLMOutputWithPast

from lightning_oomb.engine import OOMBConfig, OOMBConfigError, OOMBEngine
from lightning_oomb.integrations.hf import HFChunkModel
from lightning_oomb.precision import OOMBPrecision


def find_causal_lm(module: LightningModule, target_module: str | None) -> torch.nn.Module:
    """The HF causal LM the engine drives: ``target_module`` (attribute path) or the unique one found."""
    from transformers import PreTrainedModel

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


class _OOMBStrategyMixin:
    """What every OOMB strategy shares: precision wrapping, the engine and the model-call interception."""

    engine: OOMBEngine | None = None

    @property
    def precision_plugin(self) -> Precision:
        return self._precision_plugin if self._precision_plugin is not None else OOMBPrecision()

    @precision_plugin.setter
    def precision_plugin(self, plugin: Precision | None) -> None:
        self._precision_plugin = OOMBPrecision.wrap(plugin)

    def _build_engine(self, module: LightningModule) -> None:
        if not module.automatic_optimization:
            raise OOMBConfigError(
                "manual optimization is not supported by the OOMB strategy — the backward sweep runs inside the "
                "loop's own backward — set self.automatic_optimization = True."
            )
        if type(module).backward is not LightningModule.backward:
            rank_zero_warn(
                f"{type(module).__name__} overrides `backward`; OOMB runs the backward sweep from `loss.backward()` "
                "and anything else your override does is applied to the step's loss only."
            )
        model = find_causal_lm(module, self._target_module)
        adapter = HFChunkModel(model, layer_checkpointing=self.oomb_config.layer_checkpointing)
        self._causal_lm = model
        self.engine = OOMBEngine(adapter, self.oomb_config)

    @contextlib.contextmanager
    def _engine_answers_model_calls(self, mode: str) -> Iterator[list]:
        """Answer ``causal_lm(...)`` with the engine while the block runs; yields the list of calls made."""
        calls: list = []
        engine, model = self.engine, self._causal_lm

        def forward(input_ids=None, attention_mask=None, labels=None, **kwargs):
            _check_batch(input_ids, attention_mask, kwargs)
            if calls and mode == "train":
                raise OOMBConfigError(
                    "training_step called the OOMB-managed model twice — one step holds one KV pool — call "
                    "`self.model(**batch)` once per training_step."
                )
            calls.append(mode)
            loss = engine.loss(input_ids, labels) if mode == "train" else engine.evaluate(input_ids, labels)
            return CausalLMOutputWithPast(loss=loss, logits=_NoLogits())

        model.forward = forward
        try:
            yield calls
        finally:
            del model.forward

    def training_step(self, *args: Any, **kwargs: Any) -> STEP_OUTPUT:
        with self._engine_answers_model_calls("train") as calls:
            output = super().training_step(*args, **kwargs)
        if not calls:
            raise OOMBConfigError(
                "training_step did not call the OOMB-managed model — the strategy only trains through it — "
                "return `self.model(**batch).loss` (or a loss computed from it)."
            )
        return output

    def validation_step(self, *args: Any, **kwargs: Any) -> STEP_OUTPUT:
        with self._engine_answers_model_calls("eval"):
            return super().validation_step(*args, **kwargs)

    def test_step(self, *args: Any, **kwargs: Any) -> STEP_OUTPUT:
        with self._engine_answers_model_calls("eval"):
            return super().test_step(*args, **kwargs)

    def on_exception(self, exception: BaseException) -> None:
        if self.engine is not None:
            self.engine.release()
        super().on_exception(exception)

    def teardown(self) -> None:
        if self.engine is not None:
            self.engine.release()
        super().teardown()


class _LogitsUnavailable(OOMBConfigError, AttributeError):
    """Raised on any use of :class:`_NoLogits` (an ``AttributeError`` too, so ``hasattr`` probes stay quiet)."""


class _NoLogits:
    """Stands in for the logits of a model call the engine answers: ``[B, N, vocab]`` logits of a long sequence
    (80 GB at 128K tokens for Qwen2.5-7B in fp32) are exactly what OOMB never materialises. Any use raises."""

    def _refuse(self, *args: Any, **kwargs: Any):
        raise _LogitsUnavailable(
            "the OOMB strategy answers the model call with the loss only — the logits of the whole sequence are "
            "never materialised (they would not fit) — compute metrics from `output.loss`, or call the model "
            "outside training_step/validation_step/test_step (e.g. in predict_step) on a short input."
        )

    __getattr__ = __getitem__ = __iter__ = __len__ = __bool__ = __array__ = _refuse

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        cls._refuse(None)


def _check_batch(input_ids, attention_mask, extra: dict) -> None:
    unexpected = sorted(
        k for k, v in extra.items() if v is not None and k not in ("use_cache", "return_dict")
    )
    if input_ids is None or unexpected:
        raise OOMBConfigError(
            f"the OOMB-managed model got {unexpected or 'no input_ids'} — the engine computes positions, masks and "
            "the loss itself from token ids — call it as `model(input_ids=..., labels=..., attention_mask=...)`."
        )
    if attention_mask is not None and not bool(attention_mask.bool().all()):
        raise OOMBConfigError(
            "attention_mask contains padding — OOMB trains on equal-length rows (sequence packing is not yet "
            "supported) — pack or crop your samples to one length and drop the mask (or pass all ones)."
        )


class OOMBStrategy(_OOMBStrategyMixin, SingleDeviceStrategy):
    """Train a Hugging Face causal LM on very long sequences on one device, exactly, by OOMB.

    Args:
        chunk_size: tokens processed together; activation memory scales with it, not with the sequence.
        page_size: tokens per KV page (kernel tile); ``chunk_size`` must be a multiple of it.
        kv_grad_dtype: ``"float32"`` (default) or ``"bfloat16"`` KV-gradient pages.
        layer_checkpointing: checkpoint each decoder layer inside a chunk's recompute.
        attention_backend: ``"auto"`` (Triton on CUDA, torch elsewhere), ``"torch"`` or ``"triton"``.
        offload: keep KV pages beyond ``hbm_budget`` in pinned host memory.
        hbm_budget: device bytes for KV pages when offloading (``"auto"``: free memory minus a headroom).
        staging_buffers: device buffers that host-tier layers stream through when offloading, each one
            chunk's pages of one layer (fixed size: device memory stays flat in the context length); at least 2,
            4 (default) overlaps copies both ways with compute.
        prefetch_depth: block uses staged ahead of time when offloading (``None``: as many as the buffers
            allow; ``0``: copies on demand only).
        target_module: attribute path of the HF model in the LightningModule (default: the unique one).
        device: explicit device; by default the Trainer's accelerator decides (``accelerator="auto"`` works).
    """

    strategy_name = "oomb"

    def __init__(
        self,
        chunk_size: int = 4096,
        page_size: int = 128,
        kv_grad_dtype: str = "float32",
        layer_checkpointing: bool = False,
        attention_backend: str = "auto",
        offload: bool = False,
        hbm_budget: int | str = "auto",
        staging_buffers: int = 4,
        prefetch_depth: int | None = None,
        target_module: str | None = None,
        device: str | torch.device | None = None,
        accelerator: Accelerator | None = None,
        checkpoint_io: CheckpointIO | None = None,
        precision_plugin: Precision | None = None,
    ) -> None:
        self.oomb_config = OOMBConfig(
            chunk_size=chunk_size,
            page_size=page_size,
            kv_grad_dtype=kv_grad_dtype,
            layer_checkpointing=layer_checkpointing,
            attention_backend=attention_backend,
            offload=offload,
            hbm_budget=hbm_budget,
            staging_buffers=staging_buffers,
            prefetch_depth=prefetch_depth,
        )
        self._target_module = target_module
        self._explicit_device = None if device is None else torch.device(device)
        self._parallel_devices: list[torch.device] | None = None
        super().__init__(
            device=self._explicit_device or "cpu",
            accelerator=accelerator,
            checkpoint_io=checkpoint_io,
            precision_plugin=precision_plugin,
        )

    # The connector fills ``parallel_devices`` with what the accelerator chose; a plain SingleDeviceStrategy
    # would keep device="cpu" and fail on GPU machines (pytorch-lightning#18902).
    @property
    def parallel_devices(self) -> list[torch.device] | None:
        return self._parallel_devices

    @parallel_devices.setter
    def parallel_devices(self, devices: list[torch.device] | None) -> None:
        self._parallel_devices = devices

    @property
    def root_device(self) -> torch.device:
        if self._explicit_device is not None or not self._parallel_devices:
            return self._root_device
        return self._parallel_devices[0]

    def setup_environment(self) -> None:
        if self._parallel_devices and len(self._parallel_devices) > 1:
            raise OOMBConfigError(
                f"strategy='oomb' runs on one device but the Trainer asked for {len(self._parallel_devices)} — "
                "context parallelism across devices is not available yet — use devices=1."
            )
        super().setup_environment()

    def setup(self, trainer) -> None:
        self._build_engine(trainer.lightning_module)
        super().setup(trainer)

    @classmethod
    def register_strategies(cls, strategy_registry) -> None:
        if cls.strategy_name not in strategy_registry:
            strategy_registry.register(cls.strategy_name, cls, description="OOMB chunk-recurrent training")
