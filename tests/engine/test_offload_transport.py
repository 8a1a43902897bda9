"""Copy transports: the delaying transport runs copies late (on CPU: at random later moments, never after a wait
for them), and a training step with it equals one with synchronous copies bitwise — unless a wait is dropped."""

from __future__ import annotations

import functools

import pytest
import torch

from csrc_triton.page_copy import copy_rows
from lightning_oomb.engine import OOMBConfig, OOMBEngine
from lightning_oomb.engine.offload import SyncTransport, delaying_transport
from lightning_oomb.engine.offload.transport import _DeferredCopies
from lightning_oomb.integrations.hf import HFChunkModel
from tests.helpers.models import build_causal_lm, grads_of

CPU = torch.device("cpu")


def test_sync_transport_copies_at_once():
    transport = SyncTransport(CPU)
    src, dst = torch.arange(4.0), torch.zeros(4)
    assert transport.copy("h2d", [(dst, src)], [None]) is None
    assert torch.equal(dst, src)
    transport.zero([dst], [])
    assert not dst.any() and transport.finish() == 0.0


def test_deferred_copies_run_late_but_before_any_wait_for_them():
    transport = delaying_transport(CPU, seed=0, chance=0.0)  # never on its own: only when waited for
    a, b, c = torch.ones(3), torch.zeros(3), torch.zeros(3)
    into_b = transport.copy("h2d", [(b, a)], [])
    into_c = transport.copy("d2h", [(c, b)], [into_b])  # waits for the copy into b
    a.fill_(5.0)  # the compute stream runs ahead: the first copy has not read ``a`` yet
    assert not b.any() and not c.any()
    transport.acquire([into_c])  # forces d2h up to into_c, and first what it waits for
    assert torch.equal(b, torch.full((3,), 5.0)) and torch.equal(c, b)
    zeroed = transport.zero([c], [])
    assert c.any()
    transport.acquire([zeroed])
    assert not c.any()


def test_deferred_copies_progress_on_their_own_in_stream_order():
    transport = delaying_transport(CPU, seed=1, chance=1.0)
    dsts = [torch.zeros(1) for _ in range(20)]
    for i, dst in enumerate(dsts):
        transport.copy("h2d", [(dst, torch.tensor([i + 1.0]))], [])
    done = [bool(d.item()) for d in dsts]
    assert any(done) and done == sorted(done, reverse=True)  # a prefix of the stream ran, in order
    transport.synchronize()
    assert all(d.item() == i + 1 for i, d in enumerate(dsts))


class _DropsWaits(_DeferredCopies):
    """A broken transport: the compute stream never waits for copies (a negative control)."""

    def acquire(self, events, reads=(), writes=()) -> None:
        self._wander()


def offloaded_step(model, ids, transport, checkpointing: bool, page_budget=None):
    model.zero_grad()
    config = OOMBConfig(16, 8, layer_checkpointing=checkpointing, offload=True, hbm_budget=0, staging_buffers=3,
                        page_budget=page_budget)  # fmt: skip
    engine = OOMBEngine(HFChunkModel(model, layer_checkpointing=checkpointing), config, transport)
    loss = engine.loss(ids)
    loss.backward()
    return loss.detach(), grads_of(model), engine.stats.extra


@pytest.mark.parametrize(("checkpointing", "page_budget"), [(False, None), (True, None), (False, 1)])
@pytest.mark.parametrize(("seed", "chance"), [(0, 0.0), (1, 0.3), (2, 0.9)])
def test_a_step_with_delayed_copies_equals_synchronous_copies_bitwise(
    seed, chance, checkpointing, page_budget
):
    """Also a sparse step, whose copies move single pages."""
    model = build_causal_lm("qwen2", num_hidden_layers=3)
    ids = torch.randint(0, 97, (2, 50), generator=torch.Generator().manual_seed(seed))
    want_loss, want, want_stats = offloaded_step(model, ids, SyncTransport, checkpointing, page_budget)
    transport = functools.partial(delaying_transport, seed=seed, chance=chance)
    loss, got, stats = offloaded_step(model, ids, transport, checkpointing, page_budget)
    assert torch.equal(loss, want_loss)
    assert all(torch.equal(got[n], want[n]) for n in want)
    assert stats == want_stats  # the same schedule: only when the copies run differs


def test_the_delays_expose_a_transport_that_drops_its_waits():
    model = build_causal_lm("qwen2", num_hidden_layers=3)
    ids = torch.randint(0, 97, (2, 50), generator=torch.Generator().manual_seed(0))
    want_loss, want, _ = offloaded_step(model, ids, SyncTransport, False)
    loss, got, _ = offloaded_step(model, ids, lambda device: _DropsWaits(device, seed=0, chance=0.0), False)
    assert not torch.equal(loss, want_loss) or any(not torch.equal(got[n], want[n]) for n in want)


def sparse_step(model, ids, transport, buffers: int = 3):
    """A sparse offloaded step whose blocks (8 pages) stage scattered selected pages."""
    model.zero_grad()
    config = OOMBConfig(32, 4, page_budget=2, offload=True, hbm_budget=0, staging_buffers=buffers)
    engine = OOMBEngine(HFChunkModel(model), config, transport)
    loss = engine.loss(ids)
    loss.backward()
    return loss.detach(), grads_of(model), engine.stats.extra


class _KernelGathers(SyncTransport):
    """Gathers by the page-copy kernel itself (the Triton interpreter on CPU), as ``CudaTransport`` runs them."""

    def gather(self, stream, pairs, rows, after) -> None:
        copy_rows(pairs, rows)


@pytest.mark.parametrize("how", ["sync", "delayed", "kernel"])
def test_gathered_page_copies_equal_a_copy_per_run_bitwise(how):
    """A transport that ``gathers`` (``OOMB_OFFLOAD_GATHER``'s path: one call per block and part for scattered
    pages) gives the step the same bytes, schedule and results as a copy per run, in far fewer copy calls — also
    when its gathers run late, and through the page-copy kernel."""
    model = build_causal_lm("qwen2", num_hidden_layers=2)
    ids = torch.randint(0, 97, (2, 130), generator=torch.Generator().manual_seed(3))
    want_loss, want, want_stats = sparse_step(model, ids, SyncTransport)
    gathering = {
        "sync": functools.partial(SyncTransport, gathers=True),
        "delayed": functools.partial(delaying_transport, seed=4, chance=0.3, gathers=True),
        "kernel": functools.partial(_KernelGathers, gathers=True),
    }[how]
    loss, got, stats = sparse_step(model, ids, gathering)
    assert torch.equal(loss, want_loss)
    assert all(torch.equal(got[n], want[n]) for n in want)
    calls = stats.pop("copy_runs"), want_stats.pop("copy_runs")
    assert stats == want_stats and calls[0] < calls[1]
