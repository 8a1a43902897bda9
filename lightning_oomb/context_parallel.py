"""``OOMBContextParallelStrategy`` ("oomb_cp"): OOMB across devices, every sequence shared by a context group.

The devices form a 2-D mesh ``("data", "context")``: the ``context_parallel_size`` ranks of a context group train
one sequence together — each runs its slice of every chunk and keeps its slices' K/V pages (KV memory, host memory
under offload and page traffic divided by the group size), attention exchanges only a chunk's queries and partial
outputs (:mod:`lightning_oomb.engine.context`) — and the data dimension replicates that over different batches (the
sampler shards batches over "data" only). There is no DDP wrapper (the backward sweep runs inside the loop's own
``backward``): after the backward of the last micro-batch of an optimizer step the gradients are summed over the
context group and averaged over the data replicas, once, before ``on_after_backward`` (as DDP's). torch.distributed
is the engine (NCCL on GPUs, gloo on CPU), launched the Lightning way (``devices=N`` starts the processes, torchrun
or SLURM set the ranks), so it runs across nodes unchanged. Checkpoints are saved by rank 0; every rank holds the
whole model and optimizer state, so a run resumes on any device count that divides as the new mesh needs.
"""

from __future__ import annotations

import atexit
import dataclasses
import datetime
from typing import Any

import torch
import torch.distributed as dist
from lightning.pytorch.accelerators import Accelerator
from lightning.pytorch.plugins.environments import ClusterEnvironment
from lightning.pytorch.plugins.io import CheckpointIO
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.strategies import DDPStrategy
from lightning.pytorch.utilities import rank_zero_warn
from typing_extensions import override

from lightning_oomb.engine import OOMBConfigError, OOMBOutOfMemoryError
from lightning_oomb.engine.context import ContextGroup, check_context
from lightning_oomb.engine.planner import Machine, step_sizes_of
from lightning_oomb.strategy import _OOMBStrategyMixin, config_from_arguments, strategy_doc


class OOMBContextParallelStrategy(_OOMBStrategyMixin, DDPStrategy):
    __doc__ = strategy_doc(
        """Train a causal LM on sequences too long for one device's memory or time, exactly, by OOMB across devices:
    each sequence is shared by a context group of ``context_parallel_size`` devices, which split every chunk and its
    KV pages between them. ``Trainer(strategy="oomb_cp", devices=N)``.""",
        """
        context_parallel_size: devices sharing each sequence (default: all); the others replicate it over different
            batches (data parallelism). ``chunk_size / page_size`` must be a multiple of it.
        target_module, verify_exactness, plan_memory: as for ``OOMBStrategy``.
        collective_timeout: seconds a rank waits in a collective before it gives up (a failed rank ends the others
            within this time, with an error naming it).
        accelerator, parallel_devices, cluster_environment, checkpoint_io, precision_plugin, process_group_backend,
            start_method: as for Lightning's ``DDPStrategy`` (``start_method="spawn"`` for notebooks and tests).
        """,
    )

    _manual_optimization_refused = (
        "the gradients are reduced over the group once per optimizer step, as the automatic loop accumulates them "
        "(a manual accumulation would sum a reduced gradient again)"
    )

    strategy_name = "oomb_cp"

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
        context_parallel_size: int | None = None,
        target_module: str | None = None,
        verify_exactness: bool = True,
        plan_memory: bool = True,
        collective_timeout: float = 600.0,
        accelerator: Accelerator | None = None,
        parallel_devices: list[torch.device] | None = None,
        cluster_environment: ClusterEnvironment | None = None,
        checkpoint_io: CheckpointIO | None = None,
        precision_plugin: Precision | None = None,
        process_group_backend: str | None = None,
        start_method: str = "popen",
    ) -> None:
        self.oomb_config = config_from_arguments(locals())
        size = context_parallel_size
        if size is not None and (isinstance(size, bool) or not isinstance(size, int) or size < 1):
            raise OOMBConfigError(
                f"context_parallel_size={size!r} must be a positive number of devices per sequence (or None: all)."
            )
        self._context_parallel_size = size
        self._target_module = target_module
        self._verify_exactness = verify_exactness
        self._plan_memory = plan_memory
        self._mesh = None
        super().__init__(
            accelerator=accelerator,
            parallel_devices=parallel_devices,
            cluster_environment=cluster_environment,
            checkpoint_io=checkpoint_io,
            precision_plugin=precision_plugin,
            process_group_backend=process_group_backend,
            timeout=datetime.timedelta(seconds=collective_timeout),
            start_method=start_method,
        )

    # ----------------------------------------------------------------------------------------------------- mesh
    @property
    def context_parallel_size(self) -> int:
        return self.context_size_on(self.world_size)

    def context_size_on(self, world: int) -> int:
        """Devices of a context group when the job has ``world`` devices (``oomb plan`` asks before launch)."""
        return self._context_parallel_size or world

    @property
    def data_parallel_size(self) -> int:
        return self.world_size // self.context_parallel_size

    @override
    def _configure_launcher(self) -> None:
        # Trainer(...) calls this once it knows the devices: refuse before processes start (with one device nothing
        # is launched, and the Trainer of `oomb plan` plans a bigger mesh on one CPU: setup_environment checks)
        if self.num_processes > 1:
            self._check_mesh()
        super()._configure_launcher()

    def check_groups(self, world: int) -> None:
        """Refuse a job of ``world`` devices whose context groups this strategy cannot form (``oomb plan`` asks
        before launch; setup checks the job's own)."""
        size = self.context_size_on(world)
        if world % size:
            raise OOMBConfigError(
                f"{world} devices do not divide into context groups of context_parallel_size={size} — each data "
                f"replica needs a whole group — use a device count that is a multiple of {size} (or change "
                "context_parallel_size)."
            )
        check_context(self.oomb_config, size)

    def _check_mesh(self) -> None:
        self.check_groups(self.world_size)
        backend = self._get_process_group_backend()
        device = self.root_device.type
        if (backend == "nccl") != (device == "cuda"):
            raise OOMBConfigError(
                f"process_group_backend={backend!r} cannot run the collectives of {device} tensors — use 'nccl' on "
                "GPUs and 'gloo' on CPUs (or leave it unset)."
            )

    @override
    def setup_environment(self) -> None:
        self._check_mesh()
        super().setup_environment()
        from torch.distributed.device_mesh import init_device_mesh

        size = self.context_parallel_size
        self._mesh = init_device_mesh(
            self.root_device.type, (self.world_size // size, size), mesh_dim_names=("data", "context")
        )
        atexit.unregister(_destroy_process_group)  # once, however many fits this process runs
        atexit.register(_destroy_process_group)

    @override
    def _planning_machine(self, resident_bytes: int) -> Machine:
        """The least memory any rank reads: every rank then plans alike and decides the ``"auto"`` options alike
        (``reuse_attention`` must agree: a rank that takes a chunk's kept results skips the recompute's
        collectives)."""
        return least_over_ranks(super()._planning_machine(resident_bytes), self.root_device)

    @override
    def _context_group(self) -> ContextGroup:
        return ContextGroup.of(self._mesh["context"].get_group())

    @property
    @override
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        return {"num_replicas": self.data_parallel_size, "rank": self._mesh.get_local_rank("data")}

    # ---------------------------------------------------------------------------------------------------- setup
    @override
    def setup(self, trainer) -> None:
        if self.world_size == 1:
            rank_zero_warn(
                "strategy='oomb_cp' on one device trains as strategy='oomb' does, with collectives of one process "
                "around it — use strategy='oomb' (or devices=N for a context group of N)."
            )
        if self.data_parallel_size == 1:
            # one context group: every rank takes the loaders' batches as they are, in their order, as `oomb`
            # does (Lightning's injected sampler would reshuffle them and cannot enter a custom batch sampler)
            trainer._accelerator_connector.use_distributed_sampler = False
        if self._start_method == "forkserver" and self.root_device.type == "cpu":
            _own_copy_of_the_weights(trainer.lightning_module)
        self._agreeing(self._build_engine, trainer.lightning_module)
        for seq_len, _ in step_sizes_of(trainer.datamodule):  # the datamodule's, where it declares them
            check_context(self.oomb_config, self.context_parallel_size, seq_len)
        super().setup(trainer)
        self._agreeing(self._check_memory_plan, trainer)

    @override
    def _agreeing(self, check, *args, when: str = "at setup") -> None:
        """Run ``check`` on every rank; if it refused (or failed) on any, every rank raises, naming the rank (no rank
        goes on into a collective the others never join): a refusal as ``OOMBConfigError``; a failure as itself on
        its rank, as ``RuntimeError`` on the others."""
        caught = None
        try:
            check(*args)
        except Exception as e:  # every rank must learn of it
            caught = e
        message = None if caught is None else (type(caught).__name__, str(caught))
        errors: list = [None] * self.world_size
        dist.all_gather_object(errors, message)
        failed = [(rank, e) for rank, e in enumerate(errors) if e is not None]
        if not failed:
            return
        if caught is not None and not isinstance(caught, OOMBConfigError):
            raise caught
        rank, (kind, text) = failed[0]
        refusals = {error.__name__: error for error in (OOMBConfigError, OOMBOutOfMemoryError)}
        if kind in refusals:
            raise refusals[kind](f"rank {rank}: {text}")
        raise RuntimeError(f"rank {rank} failed {when}: {kind}: {text}")

    @override
    def _plan_batch(self, input_ids: torch.Tensor) -> None:
        """Every rank plans the batch shapes of all ranks (one all-gather of two numbers a batch), so a shape no plan
        covers — a longer batch on one data replica — is planned, and refused, by every rank together: its replica
        alone refused it while the others waited in the gradients' all-reduce until ``collective_timeout``."""
        if self._planned_sizes is None:
            return
        mine = torch.tensor(
            input_ids.shape[::-1] if input_ids.dim() == 2 else (0, 0), device=self.root_device
        )
        shapes = [torch.empty_like(mine) for _ in range(self.world_size)]
        dist.all_gather(shapes, mine)
        for shape in sorted({tuple(s.tolist()) for s in shapes if s.all()}):
            self._plan_shape(shape)

    @override
    def teardown(self) -> None:
        """Also drop the (released) engine and the mesh, this strategy's references to the process groups: the
        Trainer lives in reference cycles until the interpreter's last collection, and a gloo group first freed
        there can abort a worker whose fit has finished (SIGABRT, "terminate called without an active exception");
        without them the destroy at exit frees the groups. The next ``fit`` sets both up anew."""
        super().teardown()
        self.engine, self._mesh = None, None

    @override
    def configure_ddp(self) -> None:
        """No DDP wrapper: the gradients are reduced once per optimizer step (:meth:`backward`)."""

    # ---------------------------------------------------------------------------------------------- gradients
    @override
    def backward(self, closure_loss: torch.Tensor, optimizer, *args: Any, **kwargs: Any) -> torch.Tensor:
        """Lightning's ``Strategy.backward`` with the gradients reduced between the backward and the precision
        plugin's ``post_backward`` (which calls ``on_after_backward``): the hook sees what it sees under DDP — at an
        optimizer step's last micro-batch the reduced gradients, before it the rank's own running sums."""
        module = self.lightning_module
        self.pre_backward(closure_loss)
        closure_loss = self.precision_plugin.pre_backward(closure_loss, module)
        self.precision_plugin.backward(closure_loss, module, optimizer, *args, **kwargs)
        if not module.trainer.fit_loop.epoch_loop._should_accumulate():
            self.reduce_gradients()
        closure_loss = self.precision_plugin.post_backward(closure_loss, module)
        self.post_backward(closure_loss)
        return closure_loss

    def reduce_gradients(self) -> None:
        """Sum every gradient over its context group and average over the data replicas (one all-reduce per dtype,
        over flattened buckets). A parameter no rank gave a gradient keeps ``grad=None``, as under DDP (so the
        optimizer leaves it alone: a zero gradient would still decay it and move it by its momentum); one that only
        some ranks did gets zeros on the others. A rank of another data replica that failed is named (it would
        end these collectives with a bare "connection closed")."""
        with self.engine.reporting():
            self._reduce_gradients()

    def _reduce_gradients(self) -> None:
        params = [p for p in self.lightning_module.parameters() if p.requires_grad]
        has = torch.tensor([p.grad is not None for p in params], dtype=torch.int32, device=self.root_device)
        dist.all_reduce(has, op=dist.ReduceOp.MAX)
        params = [p for p, some in zip(params, has.tolist(), strict=True) if some]
        for p in params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
        for p in params:
            by_dtype.setdefault(p.grad.dtype, []).append(p.grad)
        for grads in by_dtype.values():
            flat = torch.cat([g.reshape(-1) for g in grads])
            dist.all_reduce(flat)
            flat /= self.data_parallel_size
            offset = 0
            for g in grads:
                g.copy_(flat[offset : offset + g.numel()].view_as(g))
                offset += g.numel()

    @classmethod
    @override
    def register_strategies(cls, strategy_registry) -> None:
        if cls.strategy_name not in strategy_registry:
            strategy_registry.register(
                cls.strategy_name,
                cls,
                description="OOMB with every sequence shared by a context group of devices",
            )


def least_over_ranks(machine: Machine, device: torch.device) -> Machine:
    """``machine`` with the least device and host memory any rank of the default process group read (one
    all-reduce, on ``device``)."""
    sizes = [machine.device_bytes, machine.host_bytes, machine.total]
    least = torch.tensor(sizes, dtype=torch.int64, device=device)
    dist.all_reduce(least, op=dist.ReduceOp.MIN)
    device_bytes, host_bytes, total = least.tolist()
    return dataclasses.replace(machine, device_bytes=device_bytes, host_bytes=host_bytes, device_total=total)


def _destroy_process_group() -> None:
    """At exit, destroy the default group while the interpreter is still whole: a process (a spawned worker, say)
    exiting with a live gloo group can abort in interpreter finalization (SIGABRT, "terminate called without an
    active exception": its worker threads still hold tensors)."""
    if dist.is_initialized():
        dist.destroy_process_group()


@torch.no_grad()
def _own_copy_of_the_weights(module: torch.nn.Module) -> None:
    """Gives this rank its own CPU weights. Lightning hands the module to ``forkserver`` workers through shared memory
    and copies it out only under ``spawn``: every rank would step one shared copy (each update applied N times)."""
    for tensor in (*module.parameters(), *module.buffers()):
        tensor.data = tensor.data.clone()
