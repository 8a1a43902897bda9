"""``Trainer(strategy="oomb_cp")`` on 2 CPU processes (gloo, forked from a server: ``START_METHOD``): the same
training as ``strategy="oomb"`` on one process; clear errors before any work; a failing rank ends the others with
an error naming it."""

from __future__ import annotations

import atexit
import os
import weakref
from types import SimpleNamespace

import lightning as L
import pytest
import torch
import torch.distributed as dist
from lightning.pytorch.callbacks import Callback

from lightning_oomb import (
    OOMBConfig,
    OOMBConfigError,
    OOMBContextParallelStrategy,
    OOMBOutOfMemoryError,
    plan,
)
from lightning_oomb.context_parallel import least_over_ranks
from lightning_oomb.engine.planner import Machine
from lightning_oomb.models import qwen2_5_7b_config
from tests.helpers.distributed import START_METHOD, run_ranks
from tests.helpers.lightning import TinyLM, batches, make_trainer, oomb

pytestmark = pytest.mark.slow


def cp(**options) -> OOMBContextParallelStrategy:
    options = {"start_method": START_METHOD, **options}
    return OOMBContextParallelStrategy(chunk_size=16, page_size=8, collective_timeout=30, **options)


class Rows(L.LightningDataModule):
    """12 rows of 40 tokens, 2 a batch, declaring the step size the strategies plan for at setup."""

    seq_len, batch_size = 40, 2

    def train_dataloader(self):
        return batches(n=12)


def fit(strategy, devices: int = 1, steps: int = 3, resume=None, plain: bool = False, **kwargs):
    """Train ``steps`` steps on :class:`Rows` (``plain``: its loader alone, with no ``seq_len`` to plan for)."""
    torch.manual_seed(0)
    module = TinyLM().double()
    # the batches in their order on every rank (Lightning's distributed sampler would shuffle them, alike on each)
    trainer = make_trainer(strategy, steps, devices=devices, precision="64-true", accumulate_grad_batches=2,
                           gradient_clip_val=0.05, use_distributed_sampler=False, **kwargs)  # fmt: skip
    data = {"train_dataloaders": Rows().train_dataloader()} if plain else {"datamodule": Rows()}
    trainer.fit(module, ckpt_path=resume, **data)
    return module


class ReducedAfterBackward(Callback):
    """Fails a rank whose ``on_after_backward`` at an optimizer step's last micro-batch sees other gradients than
    the optimizer step gets (the reduced ones, as under DDP)."""

    def on_after_backward(self, trainer, module):
        self.seen = [None if p.grad is None else p.grad.clone() for p in module.parameters()]

    def on_before_optimizer_step(self, trainer, module, optimizer):
        for seen, p in zip(self.seen, module.parameters(), strict=True):
            assert (seen is None and p.grad is None) or torch.equal(seen, p.grad)


class GroupsFreedAtExit(Callback):
    """Ends a worker with exit code 3 if, at its exit, the destroyed process groups are still referenced: then they
    are first freed in the interpreter's finalization, where a gloo group can abort the worker (SIGABRT) after a
    finished fit. (Registered after the strategies' exit hooks, so it runs first and destroys the groups itself.)"""

    def on_fit_start(self, trainer, module):
        mesh = trainer.strategy._mesh
        groups = [
            weakref.ref(g) for g in (dist.group.WORLD, *(mesh[d].get_group() for d in ("data", "context")))
        ]

        def check():
            dist.destroy_process_group()
            if any(g() is not None for g in groups):
                os._exit(3)

        atexit.register(check)


@pytest.mark.parametrize("plain", [False, True])
def test_three_steps_with_accumulation_and_clipping_equal_one_process(plain):
    """The ranks plan (each with the group's least memory) at setup, or with a plain loader at the first batch, all
    at once, and keep their slices' attention results as ``reuse_attention="auto"`` decides; the weights equal one
    process's; ``on_after_backward`` sees the reduced gradients."""
    want = fit(oomb())
    got = fit(cp(reuse_attention="auto"), devices=2, plain=plain, callbacks=[ReducedAfterBackward()])
    for (name, a), b in zip(want.named_parameters(), got.parameters(), strict=True):
        assert torch.allclose(a, b, rtol=1e-10, atol=1e-12), name
    start = TinyLM().double()  # the steps moved the weights (clipping kept them small, not zero)
    assert any(not torch.equal(a, b) for a, b in zip(start.parameters(), got.parameters(), strict=True))


@pytest.mark.parametrize(("strategy", "devices", "message"), [
    (lambda: cp(context_parallel_size=2), 3, "3 devices do not divide into context groups of context_parallel_size=2"),
    (lambda: cp(process_group_backend="nccl"), 2, "process_group_backend='nccl' cannot run the collectives of cpu"),
    (lambda: OOMBContextParallelStrategy(chunk_size=8, page_size=8), 2, "equal slices of whole pages"),
])  # fmt: skip
def test_a_mesh_that_cannot_work_is_refused_by_the_trainer_before_any_process_starts(
    strategy, devices, message
):
    with pytest.raises(OOMBConfigError, match=message):
        make_trainer(strategy(), 1, devices=devices)


def test_one_device_and_a_bigger_context_group_is_refused_at_fit():
    with pytest.raises(
        OOMBConfigError, match="1 devices do not divide into context groups of context_parallel_size=2"
    ):
        fit(
            OOMBContextParallelStrategy(chunk_size=16, page_size=8, context_parallel_size=2),
            devices=1,
            steps=1,
        )


def test_options_are_checked_at_construction():
    with pytest.raises(OOMBConfigError, match="context_parallel_size=0"):
        OOMBContextParallelStrategy(context_parallel_size=0)


def test_a_checkpoint_saved_by_the_group_resumes_on_one_device(tmp_path):
    """Saved once (rank 0) by 2 ranks after 2 steps, resumed by ``strategy="oomb"`` on one process for a third:
    the same weights as saving and resuming on one process (model and optimizer states are whole on every rank).
    The workers hold no process group after the fit (:class:`GroupsFreedAtExit`; spawned: a forked worker ends
    without the interpreter's exit)."""
    fit(cp(start_method="spawn"), 2, 2, enable_checkpointing=True, default_root_dir=tmp_path / "cp",
        callbacks=[GroupsFreedAtExit()])  # fmt: skip
    fit(oomb(), 1, 2, enable_checkpointing=True, default_root_dir=tmp_path / "one")
    saved = [sorted((tmp_path / n).rglob("*.ckpt")) for n in ("cp", "one")]
    assert [len(s) for s in saved] == [1, 1]
    got, want = (fit(oomb(), 1, 3, resume=s[0]) for s in saved)
    for (name, a), b in zip(want.named_parameters(), got.parameters(), strict=True):
        assert torch.allclose(a, b, rtol=1e-10, atol=1e-12), name


def _reuse_decided(rank: int, world: int) -> tuple[int, int]:
    """``reuse_attention="auto"`` decided on this rank (rank 1 reads 8 GiB less host memory) from its own
    reading and from the group's least."""
    gib = 2**30
    machine = Machine("cuda", 140 * gib, (48 - 8 * rank) * gib, 141 * gib)
    config = OOMBConfig(layer_checkpointing=True, offload=True, reuse_attention="auto")
    kept = [
        plan(
            qwen2_5_7b_config(), 262144, 1, config, "bf16-true", None, m, suggest=False
        ).config.reuse_attention
        for m in (machine, least_over_ranks(machine, torch.device("cpu")))
    ]
    return tuple(kept)


def test_the_ranks_plan_alike_with_the_least_memory_any_of_them_reads(tmp_path):
    """A rank that keeps a chunk's attention results skips the recompute's collectives, so the ranks must decide
    ``reuse_attention="auto"`` alike: from their own readings they would not (the control), from the least they do."""
    (own0, least0), (own1, least1) = run_ranks(_reuse_decided, 2, tmp_path)
    assert own0 != own1
    assert least0 == least1 == own1


def _agree(rank: int, world: int) -> tuple[str, str] | None:
    """A setup check that fails on rank 1 only, with an error that is no refusal."""

    def check():
        if rank == 1:
            raise ValueError("no memory reading")

    try:
        OOMBContextParallelStrategy._agreeing(SimpleNamespace(world_size=world), check)
    except Exception as e:
        return type(e).__name__, str(e)
    return None


def test_a_setup_failure_on_one_rank_is_raised_on_every_rank(tmp_path):
    """No rank goes on into a collective the failed one never joins: the failed rank raises its error, the others
    an error naming it."""
    assert run_ranks(_agree, 2, tmp_path) == [
        ("RuntimeError", "rank 1 failed at setup: ValueError: no memory reading"),
        ("ValueError", "no memory reading"),
    ]


class _BatchPlanner:
    """The strategy's planning of a batch (its own methods) on a rank of the group, with a plan that refuses any
    step of more than 100 tokens a row."""

    _plan_batch = OOMBContextParallelStrategy._plan_batch
    _plan_shape = OOMBContextParallelStrategy._plan_shape
    _agreeing = OOMBContextParallelStrategy._agreeing

    def __init__(self, world: int) -> None:
        self.world_size, self.root_device = world, torch.device("cpu")
        self.lightning_module = SimpleNamespace(trainer=None)
        self._planned_sizes = [(40, 2)]  # planned at setup

    def _plan_steps(self, trainer, sizes: list[tuple[int, int]]) -> None:
        if max(n for n, _ in sizes) > 100:
            raise OOMBOutOfMemoryError(f"a step of {max(sizes)} does not fit")
        self._planned_sizes = sizes


def _plan_a_longer_batch_on_rank_1(rank: int, world: int):
    planner = _BatchPlanner(world)
    try:
        planner._plan_batch(torch.zeros(2, 200 if rank == 1 else 40, dtype=torch.long))
    except Exception as e:
        return type(e).__name__, str(e)
    return planner._planned_sizes


def test_a_batch_one_data_replica_cannot_fit_is_refused_by_every_rank_at_once(tmp_path):
    """Rank 1's batch (2 x 200 tokens) is longer than the setup's plan: every rank plans it and refuses together,
    with the refusal's own error (the first rank's) — rank 0 went on into the gradients' all-reduce and waited there until
    ``collective_timeout`` (600 s by default) before a ``RankFailure`` named rank 1."""
    assert (
        run_ranks(_plan_a_longer_batch_on_rank_1, 2, tmp_path)
        == [("OOMBOutOfMemoryError", "rank 0: a step of (200, 2) does not fit")] * 2
    )


def _reduce(rank: int, world: int):
    """``reduce_gradients`` on a module whose first layer has a gradient on rank 0 only and whose second none."""
    from lightning_oomb.context_parallel import OOMBContextParallelStrategy

    module = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Linear(2, 2))
    if rank == 0:
        module[0].weight.grad = torch.ones(2, 2)
    strategy = SimpleNamespace(lightning_module=module, root_device=torch.device("cpu"), data_parallel_size=1)
    OOMBContextParallelStrategy._reduce_gradients(strategy)  # (the reduction, outside the failure reporting)
    return {n: None if p.grad is None else p.grad.clone() for n, p in module.named_parameters()}


def test_a_parameter_no_rank_gave_a_gradient_keeps_none(tmp_path):
    """As under DDP: an unused layer keeps ``grad=None`` (AdamW leaves it alone; a zero gradient still moved it by
    weight decay); one that some ranks used gets the group's sum."""
    from tests.helpers.distributed import run_ranks

    for grads in run_ranks(_reduce, 2, tmp_path):
        assert torch.equal(grads["0.weight"], torch.ones(2, 2))
        assert grads["0.bias"] is None and grads["1.weight"] is None and grads["1.bias"] is None


def _text_fit(strategy, devices: int = 1):
    from pathlib import Path

    from lightning_oomb.data import TextFileDataModule
    from lightning_oomb.models import CausalLMModule

    files = str(Path(__file__).resolve().parents[2] / "examples" / "data" / "*.txt")
    data = TextFileDataModule(files, tokenizer="bytes", seq_len=64, batch_size=2, shuffle=True)
    shape = dict(model_type="qwen2", vocab_size=data.vocab_size, hidden_size=16, intermediate_size=32,
                 num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1)  # fmt: skip
    torch.manual_seed(0)
    module = CausalLMModule(config=shape, dtype="float64")
    module.configure_model()  # built here: the spawned ranks' weights come back into it
    make_trainer(strategy, 2, devices=devices, precision="64-true").fit(module, data)
    return module


def test_the_text_data_module_trains_a_context_group_as_one_process():
    """With Lightning's defaults (``use_distributed_sampler=True``): its resumable loader crashed Lightning's
    sampler injection; one context group takes the rows as one process does (in the loader's own order)."""
    want = _text_fit(oomb())
    got = _text_fit(cp(), devices=2)
    for (name, a), b in zip(want.named_parameters(), got.parameters(), strict=True):
        assert torch.allclose(a, b, rtol=1e-10, atol=1e-12), name


def test_one_device_trains_but_suggests_the_plain_strategy(monkeypatch):
    import torch.distributed as dist

    for var in ("MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "RANK", "LOCAL_RANK", "NODE_RANK"):
        monkeypatch.delenv(var, raising=False)  # what Lightning sets for this process goes with the test
    strategy = OOMBContextParallelStrategy(chunk_size=16, page_size=8)  # one process: this one
    try:
        with pytest.warns(UserWarning, match="on one device trains as strategy='oomb' does"):
            fit(strategy, devices=1, steps=1)
    finally:
        if dist.is_initialized():  # the group of one this process joined: later tests run without it
            dist.destroy_process_group()


class ShortRows(Rows):
    seq_len = 8  # one page of 8 in the first chunk: fewer than 2 ranks


def test_sequences_too_short_for_the_group_are_refused_at_setup():
    """Every rank needs a page of the first chunk: known from the datamodule's ``seq_len``, refused before the
    optimizer and the sanity validation (was: at the first step)."""
    from lightning_oomb.engine.context import check_context

    with pytest.raises(
        OOMBConfigError, match="8 tokens has 1 pages of 8 in its first chunk, fewer than the 2 ranks"
    ):
        check_context(OOMBConfig(16, 8), 2, 8)
    check_context(OOMBConfig(16, 8), 2, 9)
    trainer = make_trainer(cp(), 1, devices=2, precision="64-true")
    with pytest.raises(Exception, match="every rank needs a page of it"):
        trainer.fit(TinyLM().double(), datamodule=ShortRows())
