"""``Trainer(strategy="oomb_cp")`` on 2 CPU processes (spawned, gloo): the same training as ``strategy="oomb"`` on
one process; clear errors before any work; a failing rank ends the others with an error naming it."""

from __future__ import annotations

import pytest
import torch

from lightning_oomb import OOMBConfigError, OOMBContextParallelStrategy
from tests.helpers.lightning import TinyLM, batches, make_trainer, oomb

pytestmark = pytest.mark.slow


def cp(**options) -> OOMBContextParallelStrategy:
    return OOMBContextParallelStrategy(chunk_size=16, page_size=8, start_method="spawn", collective_timeout=30,
                                       **options)  # fmt: skip


def fit(strategy, devices: int = 1, steps: int = 3, resume=None, **kwargs):
    torch.manual_seed(0)
    module = TinyLM().double()
    # the batches in their order on every rank (Lightning's distributed sampler would shuffle them, alike on each)
    trainer = make_trainer(strategy, steps, devices=devices, precision="64-true", accumulate_grad_batches=2,
                           gradient_clip_val=0.05, use_distributed_sampler=False, **kwargs)  # fmt: skip
    trainer.fit(module, batches(n=12), ckpt_path=resume)
    return module


def test_three_steps_with_accumulation_and_clipping_equal_one_process():
    want = fit(oomb())
    got = fit(cp(), devices=2)
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
    the same weights as saving and resuming on one process (model and optimizer states are whole on every rank)."""
    for name, strategy, devices in (("cp", cp(), 2), ("one", oomb(), 1)):
        fit(strategy, devices, 2, enable_checkpointing=True, default_root_dir=tmp_path / name)
    saved = [sorted((tmp_path / n).rglob("*.ckpt")) for n in ("cp", "one")]
    assert [len(s) for s in saved] == [1, 1]
    got, want = (fit(oomb(), 1, 3, resume=s[0]) for s in saved)
    for (name, a), b in zip(want.named_parameters(), got.parameters(), strict=True):
        assert torch.allclose(a, b, rtol=1e-10, atol=1e-12), name
