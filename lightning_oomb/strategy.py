"""``OOMBStrategy`` ("oomb"): exact chunk-recurrent training of a causal LM on one device.

The user's LightningModule stays unchanged: inside its ``training_step``, ``self.model(**batch)`` is answered by
the engine, whose loss is an autograd Function (forward sweep now, backward sweep when the loop calls
``backward``). The loop's order (training_step → zero_grad → backward → clip → step), AMP scaling, gradient
accumulation and clipping are untouched (docs/design.md, "Lightning"). The strategy talks to the model through
the engine's :class:`~lightning_oomb.engine.model.ManagedModel` protocol (:func:`lightning_oomb.integrations.
managed_model` finds it); it knows nothing of Hugging Face.
"""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
import textwrap
from collections.abc import Iterator
from typing import Any

import torch
from lightning.pytorch import LightningModule
from lightning.pytorch.accelerators import Accelerator
from lightning.pytorch.plugins.io import CheckpointIO
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.strategies import SingleDeviceStrategy
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn
from lightning.pytorch.utilities.types import STEP_OUTPUT
from typing_extensions import override

from lightning_oomb.engine import OOMBConfig, OOMBConfigError, OOMBEngine, OOMBOutOfMemoryError
from lightning_oomb.engine.config import STRATEGY_DEFAULTS
from lightning_oomb.engine.model import ManagedModel
from lightning_oomb.engine.planner import Machine, plan, step_sizes_of
from lightning_oomb.integrations import managed_model
from lightning_oomb.precision import checked_precision


def config_from_arguments(arguments: dict[str, Any]) -> OOMBConfig:
    """The :class:`OOMBConfig` of a strategy ``__init__``'s arguments (``locals()``): its fields, by name."""
    return OOMBConfig(**{name: arguments[name] for name in OOMBConfig.field_names()})


def strategy_doc(summary: str, more_args: str) -> str:
    """A strategy docstring: ``summary``, then the engine options documented once in :class:`OOMBConfig`, then
    ``more_args`` (entries indented by 8 spaces)."""
    more = textwrap.indent(inspect.cleandoc(more_args), " " * 8)
    return f"{summary}\n\n    Args:\n{OOMBConfig.args_doc()}{more}\n"


def most_micro_batches(trainer) -> int:
    """The most micro-batches an optimizer step of this fit accumulates (a ``GradientAccumulationScheduler``
    changes the Trainer's count by epoch)."""
    from lightning.pytorch.callbacks import GradientAccumulationScheduler

    scheduled = [
        max(c.scheduling.values()) for c in trainer.callbacks if isinstance(c, GradientAccumulationScheduler)
    ]
    return max([trainer.accumulate_grad_batches, *scheduled])


def widest_other_budgets(scheduled: frozenset[int | None] | None, own: int | None) -> list[int | None]:
    """The page budgets of a schedule (``scheduled``) whose steps may need more memory than the strategy's own
    budget ``own``: a dense step's (``None``, the most attention memory) and the largest sparse one (the page
    summaries, the most keys of a sparse call) — those that differ from ``own``."""
    if not scheduled:
        return []
    sparse = [b for b in scheduled if b is not None]
    widest = [None] if None in scheduled else []
    if sparse and (own is None or max(sparse) > own):
        widest.append(max(sparse))
    return [b for b in widest if b != own]


class _OOMBStrategyMixin:
    """What every OOMB strategy shares: the precision check, the engine and the model-call interception."""

    engine: OOMBEngine | None = None
    model_adapter: ManagedModel | None = None

    @property
    def precision_plugin(self) -> Precision:
        return self._precision_plugin if self._precision_plugin is not None else Precision()

    @precision_plugin.setter
    def precision_plugin(self, plugin: Precision | None) -> None:
        self._precision_plugin = checked_precision(plugin)

    # why this strategy refuses manual optimization (``None``: it runs it: ``self.manual_backward(loss)`` of the
    # model call's loss runs the backward sweep, as the automatic loop's backward does)
    _manual_optimization_refused: str | None = None

    def _build_engine(self, module: LightningModule) -> None:
        if not module.automatic_optimization and self._manual_optimization_refused:
            raise OOMBConfigError(
                f"manual optimization is not supported by this strategy — {self._manual_optimization_refused} — "
                "set self.automatic_optimization = True (or train with strategy='oomb')."
            )
        if type(module).backward is not LightningModule.backward:
            rank_zero_warn(
                f"{type(module).__name__} overrides `backward`; OOMB runs the backward sweep from `loss.backward()` "
                "and anything else your override does is applied to the step's loss only."
            )
        config = self.oomb_config
        self.model_adapter = managed_model(  # "auto": on until the memory plan decides (_check_memory_plan)
            module, self._target_module, config.layer_checkpointing is not False, self._verify_exactness
        )
        self.engine = OOMBEngine(self.model_adapter, config, context=self._context_group())
        self.engine.check_device(self.root_device)  # backend, head dim and page size, before any work

    # ---- memory plan at setup, or at the first batch (lightning_oomb.engine.planner) ----------------------------
    _plan_memory: bool = True
    # the (seq_len, batch) shapes planned for (None: no plan is made), on the machine read at setup
    _planned_sizes: list[tuple[int, int]] | None = None
    _machine: Machine | None = None
    # the page budgets an OOMBSparseBudget schedule will set (its setup says; None: no schedule, or not known)
    scheduled_budgets: frozenset[int | None] | None = None

    def _check_memory_plan(self, trainer) -> None:
        """Refuse, before the first step allocates anything of OOMB's, a fit whose step cannot fit the device.

        Runs at the end of ``setup``, after Lightning's own setup has converted the model to its precision, moved it
        and configured the optimizers, so the plan counts the real parameters (trainable ones, LoRA included), the
        real optimizer's states and the Trainer's precision. The sequence length is only known at the first step,
        so the plan uses the datamodule's ``seq_len`` and ``batch_size`` (attributes or hyperparameters; this
        project's datamodules have both; a warm-up of another shape, declared in ``step_sizes``, is planned under
        the main steps' decisions and must fit too). Without a ``seq_len`` (a plain ``DataLoader``) the first
        batch's shape (training, or the sanity check's validation) is planned for as a training step's, before the
        engine runs it (:meth:`_plan_batch`); a later batch of a shape no plan covers (longer rows or more of them)
        is planned again, its options decided anew for the largest shape seen. ``OOMBStrategy(plan_memory=False)``
        skips the check. The same plan decides ``layer_checkpointing="auto"``, ``kv_grad_dtype="auto"``,
        ``offload="auto"`` and, under offload on a GPU, ``hbm_budget="auto"`` with the optimizer states counted
        (:func:`~lightning_oomb.engine.planner.decide_auto`), ``reuse_attention="auto"`` and
        ``grad_accumulation="auto"`` (without a plan: each step decides, ``OOMBConfig``'s docstring;
        ``plan_memory=False`` plans only to decide other ``"auto"`` options, and then this one too). Under
        ``oomb_cp`` a node's ranks share its host memory; gradient accumulation counts its most micro-batches
        (``GradientAccumulationScheduler`` included).
        """
        config = self.oomb_config
        auto = any(getattr(config, name) == "auto" for name in STRATEGY_DEFAULTS) or (
            config.offloads and config.hbm_budget == "auto"
        )
        self._planned_sizes = None
        if not (self._plan_memory or auto) or trainer.state.fn != "fit":
            return
        params = sum(p.numel() * p.element_size() for p in trainer.lightning_module.parameters())
        self._machine = self._planning_machine(params)  # read once, before anything of OOMB's is allocated
        self._planned_sizes = []
        sizes = [(n, b) for n, b in step_sizes_of(trainer.datamodule) if n is not None]
        if sizes:
            self._plan_steps(trainer, sizes)

    def _plan_batch(self, input_ids: torch.Tensor) -> None:
        """Before the engine runs a batch (training or validation): plan its shape (:meth:`_plan_shape`)."""
        # (ids not [batch, tokens] are left to the engine, which refuses them naming why)
        if self._planned_sizes is not None and input_ids.dim() == 2:
            self._plan_shape((input_ids.shape[1], input_ids.shape[0]))

    def _plan_shape(self, shape: tuple[int, int]) -> None:
        """A ``(seq_len, batch)`` shape no plan covers (no row longer, no more rows): plan again with a training step
        of it, the options decided for the largest shape (most tokens) and the others checked under them, on every
        rank at once (``oomb_cp``: all refuse together)."""
        sizes = self._planned_sizes

        def covers(big: tuple[int, int], small: tuple[int, int]) -> bool:
            return small[0] <= big[0] and small[1] <= big[1]

        if any(covers(s, shape) for s in sizes):
            return
        kept = [s for s in sizes if not covers(shape, s)]
        main = max(kept[-1:] + [shape], key=lambda s: (s[0] * s[1], s[0]))  # the most tokens decide
        planned = [s for s in kept + [shape] if s != main] + [main]
        when = "planning a batch of a new shape" if sizes else "planning the first batch"
        self._agreeing(self._plan_steps, self.lightning_module.trainer, planned, when=when)

    def _agreeing(self, check, *args, when: str = "at setup") -> None:
        """Run ``check`` (one device: nothing to agree on; ``oomb_cp`` makes every rank refuse if one does, naming
        the rank and ``when``)."""
        check(*args)

    def _plan_steps(self, trainer, sizes: list[tuple[int, int]]) -> None:
        """Plan the steps of ``sizes`` (``(seq_len, batch)``; the last one decides the ``"auto"`` options, the
        others must fit under its decisions), reconfigure the engine and the model, refuse what cannot fit."""
        config = self.oomb_config
        optimizers = [o for o in self.optimizers if isinstance(o, torch.optim.Optimizer)]  # several: manual

        def plan_step(seq_len: int, batch: int, config: OOMBConfig):
            return plan(
                self.model_adapter,
                seq_len,
                batch,
                config,
                self.precision_plugin.precision,
                optimizers or None,
                self._machine,
                context_parallel=self.engine.context.size if self.engine.context is not None else 1,
                accumulate_grad_batches=most_micro_batches(trainer),
                processes_per_node=getattr(self, "num_processes", 1),  # they share the node's host memory
            )

        # the main steps (the last shape) decide the "auto" options; other shapes (a warm-up's) and the other page
        # budgets of an OOMBSparseBudget schedule must fit under them
        *others, main = sizes
        result = plan_step(*main, config)
        checks = [(o, result.config) for o in others] + [
            (main, dataclasses.replace(result.config, page_budget=budget))
            for budget in widest_other_budgets(self.scheduled_budgets, config.page_budget)
        ]
        result = next((p for p in (plan_step(*s, c) for s, c in checks) if not p.fits), result)
        decided = [
            f"{name}={getattr(result.config, name)!r}"
            for name in OOMBConfig.field_names()
            if getattr(config, name) == "auto" and getattr(result.config, name) != "auto"
        ]
        rank_zero_info(
            f"OOMB memory plan: {result.summary()}"
            + (f"; {result.hosted_tails_note()}" if result.pool.hosted_tails else "")
            + (f"; decided {', '.join(decided)}" if decided else "")
        )
        # the plan decided the "auto" options (again, for a new shape): for the engine and the model (the strategy's
        # page budget: a schedule sets the engine's per step)
        decisions = dataclasses.replace(result.config, page_budget=config.page_budget)
        if decisions != self.engine.config:
            self.engine.reconfigure(decisions)
            self.model_adapter.layer_checkpointing = decisions.layer_checkpointing
        # float32-host's mirror as planned, in this process's share of the host memory (a node's ranks would each
        # see the whole node's free memory when they first flush)
        self.engine.host_grads.mirror = result.grad_mirror
        # a refused shape is not recorded as planned: a smaller batch after it is planned anew
        if self._plan_memory and not result.fits:
            cuda = (
                "CUDA out of memory (predicted by OOMB's memory plan): "
                if result.machine.device_type == "cuda"
                else ""
            )
            scheduled = (
                f" at the OOMBSparseBudget schedule's page_budget={result.config.page_budget}"
                if result.config.page_budget != config.page_budget
                else ""
            )
            raise OOMBOutOfMemoryError(
                f"{cuda}{result.refusal()[:-1]}{scheduled} (OOMBStrategy(plan_memory=False) skips this check)."
            )
        self._planned_sizes = sizes

    def _planning_machine(self, resident_bytes: int) -> Machine:
        """The machine the memory plan is made for: this one now (:meth:`Machine.local`)."""
        return Machine.local(self.root_device, resident_bytes=resident_bytes)

    def _context_group(self):
        """The ranks sharing each sequence (context parallelism); ``None`` on one device."""
        return None

    @contextlib.contextmanager
    def _engine_answers_model_calls(self, mode: str) -> Iterator[list]:
        """Answer the managed model's calls with the engine while the block runs; yields the list of calls made."""
        calls: list = []
        engine = self.engine
        with_grad: list[bool] = []

        def respond(input_ids: torch.Tensor, labels: torch.Tensor | None, **layout) -> torch.Tensor:
            if calls and mode == "train":
                reference = not all([*with_grad, torch.is_grad_enabled()])
                raise OOMBConfigError(
                    "training_step called the OOMB-managed model twice"
                    + (
                        " (one call under torch.no_grad(): a reference loss, e.g. with peft's disable_adapter() for "
                        "a KL or DPO term, is a call of the model too)"
                        if reference
                        else ""
                    )
                    + " — one step holds one KV pool — call `self.model(**batch)` once per training_step"
                    + (
                        "; compute reference losses in a pass of their own (trainer.predict, the adapters "
                        "disabled) and bring them in the batch, or train with strategy='auto'."
                        if reference
                        else "."
                    )
                )
            calls.append(mode)
            with_grad.append(torch.is_grad_enabled())
            self._plan_batch(input_ids)  # a validation batch first (the sanity check) is planned too
            run = engine.loss if mode == "train" else engine.evaluate
            return run(input_ids, labels, **layout)

        with self.model_adapter.answer_calls(respond):
            yield calls

    @override
    def training_step(self, *args: Any, **kwargs: Any) -> STEP_OUTPUT:
        try:
            with self._engine_answers_model_calls("train") as calls:
                output = super().training_step(*args, **kwargs)
        except BaseException:
            # e.g. a use of the logits' stand-in, after the forward sweep, before any backward: the step's pages and
            # states are freed now, whoever keeps the traceback
            if self.engine is not None:
                self.engine.abandon()
            raise
        if not calls and output is not None:  # None: Lightning skips the batch
            raise OOMBConfigError(
                "training_step returned a loss without calling the OOMB-managed model — the strategy only trains "
                "through the causal LM's own call (a call of its base model, e.g. `self.model.model(...)`, or of "
                "another module runs the whole sequence at once, outside the engine) — return "
                "`self.model(**batch).loss` (or a loss computed from it; None skips the batch)."
            )
        return output

    @override
    def validation_step(self, *args: Any, **kwargs: Any) -> STEP_OUTPUT:
        with self._engine_answers_model_calls("eval"):
            return super().validation_step(*args, **kwargs)

    @override
    def test_step(self, *args: Any, **kwargs: Any) -> STEP_OUTPUT:
        with self._engine_answers_model_calls("eval"):
            return super().test_step(*args, **kwargs)

    @override
    def on_exception(self, exception: BaseException) -> None:
        if self.engine is not None:
            self.engine.release()
        super().on_exception(exception)

    @override
    def teardown(self) -> None:
        if self.engine is not None:
            self.engine.release()
        super().teardown()


class OOMBStrategy(_OOMBStrategyMixin, SingleDeviceStrategy):
    __doc__ = strategy_doc(
        """Train a causal LM (a Hugging Face ``*ForCausalLM``, LoRA via peft included) on very long sequences on one
    device, exactly, by OOMB. ``Trainer(strategy="oomb")``; ``"oomb_offload"`` is the same with ``offload=True``.""",
        """
        target_module: attribute path of the model in the LightningModule (default: the unique one).
        verify_exactness: at setup, train a float64 twin of the model's architecture (tiny width, CPU, one to a
            few seconds; deep hybrids up to ~12 s) in chunks against full-sequence training and refuse the model if they differ — the guard
            against architectures that chunking would silently change; ``False`` skips it.
        plan_memory: predict the step's peak memory (``lightning_oomb.plan``: at setup for the datamodule's
            ``seq_len`` and ``batch_size``, else at the first batch and any later one of a larger shape)
            and refuse, before the engine runs it, a step that cannot fit, naming the options that would; ``False``
            skips it.
        device: explicit device; by default the Trainer's accelerator decides (``accelerator="auto"`` works).
        accelerator, checkpoint_io, precision_plugin: as for Lightning's ``SingleDeviceStrategy`` (a stock
            precision plugin, kept as it is: :mod:`~lightning_oomb.precision`).
        """,
    )

    strategy_name = "oomb"

    def __init__(
        self,
        chunk_size: int = 4096,
        page_size: int = 128,
        kv_grad_dtype: str = "auto",
        layer_checkpointing: bool | str = "auto",
        attention_backend: str = "auto",
        loss_block: int = 1024,
        offload: bool | str = "auto",
        hbm_budget: int | str = "auto",
        staging_buffers: int | str = "auto",
        host_tails: bool | str = "auto",
        prefetch_depth: int | None = None,
        page_budget: int | None = None,
        page_score: str = "bound",
        grad_accumulation: str = "auto",
        mlp_tile: int | None = None,
        reuse_attention: bool | int | str = "auto",
        mla_pages: str = "auto",
        target_module: str | None = None,
        verify_exactness: bool = True,
        plan_memory: bool = True,
        device: str | torch.device | None = None,
        accelerator: Accelerator | None = None,
        checkpoint_io: CheckpointIO | None = None,
        precision_plugin: Precision | None = None,
    ) -> None:
        self.oomb_config = config_from_arguments(locals())
        self._target_module = target_module
        self._verify_exactness = verify_exactness
        self._plan_memory = plan_memory
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
    @override
    def root_device(self) -> torch.device:
        if self._explicit_device is not None or not self._parallel_devices:
            return self._root_device
        return self._parallel_devices[0]

    @override
    def setup_environment(self) -> None:
        if self._parallel_devices and len(self._parallel_devices) > 1:
            raise OOMBConfigError(
                f"strategy='oomb' runs on one device but the Trainer asked for {len(self._parallel_devices)} — "
                "use strategy='oomb_cp' (context parallelism: each sequence shared by the devices), or devices=1."
            )
        if self._parallel_devices and self._explicit_device is None:
            # kept for this Trainer's later runs (teardown below)
            self._root_device = self._parallel_devices[0]
        super().setup_environment()

    @override
    def teardown(self) -> None:
        """Also forget the Trainer's devices (the device stays this Trainer's root): a second Trainer given this
        instance chooses them anew (Lightning refused it: "CPU parallel_devices set through OOMBStrategy class, but
        accelerator set to <CPUAccelerator>"), as a stock ``SingleDeviceStrategy`` can be reused."""
        super().teardown()
        self._parallel_devices = None

    @override
    def setup(self, trainer) -> None:
        self._build_engine(trainer.lightning_module)
        super().setup(trainer)
        self._check_memory_plan(trainer)

    @classmethod
    @override
    def register_strategies(cls, strategy_registry) -> None:
        if cls.strategy_name not in strategy_registry:
            strategy_registry.register(cls.strategy_name, cls, description="OOMB chunk-recurrent training")
        if "oomb_offload" not in strategy_registry:
            strategy_registry.register(
                "oomb_offload",
                cls,
                description="OOMB with KV and gradient pages beyond hbm_budget in pinned host memory",
                offload=True,
            )
