"""Offload of K/V and gradient pages to the host tier: exactness, placement, schedule, errors, recovery (CPU).

On CPU the host tier and its staging buffers run the same schedule with synchronous copies, so everything but
stream overlap is checked here: offload must not change a single bit of the loss or the gradients.
"""

from __future__ import annotations

import contextlib

import pytest
import torch
from conftest import build_causal_lm, full_sequence_loss, grads_of, max_relative_error

from lightning_oomb.engine import OOMBConfig, OOMBConfigError, OOMBEngine
from lightning_oomb.engine import kv_pool as kv_pool_module
from lightning_oomb.engine import offload as offload_module
from lightning_oomb.engine.kv_pool import KVPool, PoolShape, plan_tiers
from lightning_oomb.engine.offload import Offloader
from lightning_oomb.engine.reference import _add_to_pages
from lightning_oomb.integrations.hf import HFChunkModel

CPU = torch.device("cpu")
SEQ, CHUNK, PAGE = 50, 16, 8


def layer_bytes(layers: int) -> int:
    """``PoolShape.layer_bytes`` of the tiny float64 model at batch 2, SEQ tokens."""
    return PoolShape(layers, 2, SEQ, 1, 8, PAGE, torch.float64, torch.float64).layer_bytes


def run_step(model, ids, checkpointing, **offload):
    model.zero_grad()
    engine = OOMBEngine(
        HFChunkModel(model, layer_checkpointing=checkpointing), OOMBConfig(CHUNK, PAGE, **offload)
    )
    loss = engine.loss(ids)
    loss.backward()
    return loss.detach(), grads_of(model), engine


# (layers, hbm_budget in layers, staging_buffers): everything on the host with every layer staged at once;
# one HBM layer + 3 host layers through 2 buffers (eviction and prefetch); all host through 1 buffer (no prefetch)
PLACEMENTS = [(2, 0, 2), (4, 3, 2), (4, 0, 1)]


@pytest.mark.parametrize(("layers", "budget_layers", "buffers"), PLACEMENTS)
@pytest.mark.parametrize("checkpointing", [False, True])
def test_offload_is_bitwise_identical_and_exact(layers, budget_layers, buffers, checkpointing):
    model = build_causal_lm("qwen2", num_hidden_layers=layers)
    ids = torch.randint(0, 97, (2, SEQ), generator=torch.Generator().manual_seed(layers))
    want_loss = full_sequence_loss(model, ids)
    want_loss.backward()
    want = grads_of(model)
    model.train()

    loss, grads, _ = run_step(model, ids, checkpointing)
    budget = budget_layers * layer_bytes(layers)
    off_loss, off_grads, engine = run_step(
        model, ids, checkpointing, offload=True, hbm_budget=budget, staging_buffers=buffers
    )

    stats = engine.stats.extra
    assert stats["host_layers"] == layers - (1 if budget_layers else 0)
    assert stats["h2d_bytes"] + stats["d2h_bytes"] > 0 and stats["copy_wait_s"] == 0.0
    assert torch.equal(off_loss, loss)
    assert all(torch.equal(off_grads[n], grads[n]) for n in grads)
    assert abs(off_loss.item() - want_loss.item()) <= 1e-10 * want_loss.item()
    assert max_relative_error(off_grads, want) <= 1e-10


# ------------------------------------------------------------------------------------------------- placement
def test_plan_tiers_fills_the_budget_with_whole_layers():
    lb = 100
    assert plan_tiers(8, lb, None, 2).host_layers == ()  # offload off / no limit
    assert plan_tiers(8, lb, 800, 2).host_layers == ()  # everything fits
    plan = plan_tiers(8, lb, 600, 2)  # 4 HBM layers + 2 staging buffers = 600 bytes
    assert len(plan.hbm_layers) == 4 and plan.staging_buffers == 2
    assert plan.host_layers == (1, 3, 5, 7)  # spread over depth, not the last four
    assert len(plan_tiers(8, lb, 599, 2).hbm_layers) == 3
    floor = plan_tiers(8, lb, 0, 3)  # below the staging floor: all host
    assert floor.hbm_layers == () and floor.host_layers == tuple(range(8)) and floor.staging_buffers == 3
    assert plan_tiers(2, lb, 0, 3).staging_buffers == 2  # never more buffers than host layers


@pytest.mark.parametrize("budget_layers", [0, 3, 5, 8])
def test_pool_device_bytes_stay_within_the_budget(budget_layers):
    shape = PoolShape(8, 2, 40, 1, 4, PAGE, torch.float64, torch.float64)
    budget = budget_layers * shape.layer_bytes
    pool = KVPool(offload=True, hbm_budget=budget, staging_buffers=2)
    pool.reserve(shape, CPU)
    stats = pool.stats()
    staging = stats["staging_bytes"]
    assert pool.device_bytes <= max(budget, staging)
    assert stats["hbm_pool_bytes"] == stats["hbm_layers"] * shape.layer_bytes
    assert stats["host_pool_bytes"] == stats["host_layers"] * shape.layer_bytes
    assert staging == (2 * shape.layer_bytes if stats["host_layers"] else 0)
    assert stats["hbm_layers"] + stats["host_layers"] == 8


# -------------------------------------------------------------------------------------------------- schedule
# 4 layers, batch 2, 40 tokens: 5 pages per row, chunks of 2 + 2 + 1 pages
POOL_SHAPE = PoolShape(4, 2, 40, 1, 4, PAGE, torch.float64, torch.float64)


def scrambled(start: int) -> list[int]:
    """A backward order of the layers that changes every chunk, so most predictions are wrong."""
    return [(i * 3 + start) % 4 for i in range(4)]


def drive(pool: KVPool, checkpointing: bool = False, order=None, on_view=None):
    """Replay the attention op's pool calls for one step (see ``PagedAttention``) with synthetic K/V and
    gradient adds; return everything the op would have read: views (K, V) and each chunk's gradients.
    ``on_view(layer, kv, grads)`` runs where the kernel would."""
    gen = torch.Generator().manual_seed(0)
    shape, layers = POOL_SHAPE, range(POOL_SHAPE.num_layers)
    starts = list(range(0, shape.seq_len, CHUNK))
    seen = []

    def look(layer, n, grads=False):
        kv = pool.view(layer, n, grads)
        slots = kv.page_table.flatten().long()
        seen.extend((kv.k[slots], kv.v[slots]))  # the pages the kernel reads, in page-table order
        if on_view is not None:
            on_view(layer, kv, grads)
        return kv

    pool.begin_sweep("forward")
    for start in starts:
        lq = min(CHUNK, shape.seq_len - start)
        for layer in layers:
            k, v = (torch.randn(2, 1, lq, 4, generator=gen, dtype=torch.float64) for _ in "kv")
            if pool.shape != shape:
                pool.reserve(shape, CPU)
            pool.write(layer, start, k, v)
            look(layer, start + lq)
    pool.end_sweep()

    pool.begin_sweep("backward")
    for start in reversed(starts):
        n = min(start + CHUNK, shape.seq_len)
        for layer in layers:  # recompute
            look(layer, n)
        for layer in order(start) if order else reversed(layers):
            if checkpointing:  # the layer's forward is recomputed right before its backward
                look(layer, n)
            kv = look(layer, n, grads=True)
            pages = kv.page_table.shape[1]
            for arena in (kv.dk, kv.dv):  # what the kernel does: add into every page of the view
                _add_to_pages(
                    arena, kv.page_table, torch.randn(2, 1, pages * PAGE, 4, generator=gen, dtype=arena.dtype)
                )
            seen.extend(pool.read_grad(layer, start, n - start))
    pool.end_sweep()
    return seen


def transfers(pool, **match):
    return [t for t in pool.transfers if all(getattr(t, k) == v for k, v in match.items())]


@pytest.mark.parametrize("checkpointing", [False, True])
@pytest.mark.parametrize("buffers", [1, 2, 3])
def test_schedule_reads_exactly_what_the_device_tier_reads(checkpointing, buffers):
    want = drive(KVPool(), checkpointing)
    pool = KVPool(offload=True, hbm_budget=0, staging_buffers=buffers)
    got = drive(pool, checkpointing)
    assert len(got) == len(want) and all(torch.equal(a, b) for a, b in zip(got, want, strict=True))
    stats = pool.stats()
    if buffers == 1:  # nothing to prefetch into: every copy is on demand
        assert stats["prefetch_copies"] == 0 and stats["demand_copies"] > 0
    else:  # the walk (ascending forward; bouncing backward, checkpointed or not) predicted every access
        assert stats["demand_copies"] == 0 and stats["prefetch_copies"] > 0


def test_schedule_stays_correct_when_predictions_are_wrong():
    """Layers' backward in a scrambled order each chunk: prefetch guesses wrong, demand copies fix it."""
    want = drive(KVPool(), order=scrambled)
    pool = KVPool(offload=True, hbm_budget=0, staging_buffers=2)
    got = drive(pool, order=scrambled)
    assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))
    assert pool.stats()["demand_copies"] > 0


@pytest.mark.parametrize("checkpointing", [False, True])
def test_write_back_schedule_and_dirty_tracking(checkpointing):
    pool = KVPool(offload=True, hbm_budget=POOL_SHAPE.layer_bytes * 3, staging_buffers=2)  # 1 HBM + 3 host
    drive(pool, checkpointing)
    host = pool.plan.host_layers
    assert host == (1, 2, 3)
    chunk_pages = [(0, 2), (2, 4), (4, 5)]
    # forward sweep: each chunk's new K/V pages go out once, right after they are written; nothing else does
    written = [(t.layer, t.first, t.end) for t in transfers(pool, sweep="forward", direction="d2h")]
    assert sorted(written) == sorted((layer, a, b) for layer in host for a, b in chunk_pages)
    assert all(t.what == "kv" for t in transfers(pool, sweep="forward", direction="d2h"))
    # backward sweep: K/V pages are never dirty, so never written back
    assert transfers(pool, sweep="backward", direction="d2h", what="kv") == []
    # gradients: each chunk writes back its prefix once (its own pages go to autograd); the first chunk none
    grads_out = [(t.layer, t.first, t.end) for t in transfers(pool, sweep="backward", direction="d2h")]
    assert sorted(grads_out) == sorted((layer, 0, a) for layer in host for a, _ in chunk_pages if a)
    # gradients come in for later chunks, but not for the sweep's first (last) chunk: the host holds none yet,
    # so the device zero-fills them
    grads_in = {t.end for t in transfers(pool, sweep="backward", direction="h2d", what="grad")}
    assert grads_in == {2, 4}
    # every copy in, in both sweeps, was a prefetch issued before the access that needed it
    assert {t.cause for t in transfers(pool, direction="h2d")} == {"prefetch"}


# -------------------------------------------------------------------------------- stream ordering, simulated
class SimEvent:
    def __init__(self, clock: dict):
        self.clock = clock

    def synchronize(self):
        pass

    def elapsed_time(self, other) -> float:
        return 0.0


class SimStreams:
    """Stands in for the CUDA streams: copies still run at once, but every operation on the device is logged
    with a vector clock (how many operations of each stream it is ordered after, through program order and
    event waits), so every pair of conflicting operations on different streams can be checked for an order."""

    cuda, h2d, d2h = True, "h2d", "d2h"

    def __init__(self, ignore_waits_on: str | None = None):
        self.clocks = {stream: {} for stream in ("compute", "h2d", "d2h")}
        self.current, self.ops, self.ignore = "compute", [], ignore_waits_on

    def compute(self):
        return "compute"

    def record(self, stream, timing=False):
        return SimEvent(dict(self.clocks[stream]))

    def wait(self, stream, *events):
        if stream == self.ignore:  # negative control: a stream that ignores its waits
            return
        clock = self.clocks[stream]
        for event in filter(None, events):
            for other, n in event.clock.items():
                clock[other] = max(clock.get(other, 0), n)

    @contextlib.contextmanager
    def on(self, stream):
        previous, self.current = self.current, stream
        try:
            yield
        finally:
            self.current = previous

    def synchronize(self):
        pass

    def op(self, stream, reads=(), writes=()):
        clock = self.clocks[stream]
        clock[stream] = clock.get(stream, 0) + 1
        self.ops.append((stream, clock[stream], dict(clock), list(reads), list(writes)))

    def hazards(self) -> list:
        """Pairs (earlier, later) that touch the same memory, one writing, on different streams, unordered."""
        overlap = lambda x, y: x[:2] == y[:2] and x[2] < y[3] and y[2] < x[3]  # noqa: E731
        clash = lambda xs, ys: any(overlap(x, y) for x in xs for y in ys)  # noqa: E731
        found = []
        for i, (sa, na, _, ra, wa) in enumerate(self.ops):
            for sb, _, clock, rb, wb in self.ops[i + 1 :]:
                if sa != sb and clock.get(sa, 0) < na and (clash(wa, rb + wb) or clash(ra, wb)):
                    found.append((sa, sb))
        return found


def instrument(monkeypatch, sim: SimStreams):
    """Route the offloader through ``sim`` and log its copies plus the compute stream's uses of the buffers.
    Memory regions: ``(space, "kv"|"grad", first slot, end slot)`` in the staging or host arena."""
    slots, rows = POOL_SHAPE.layer_slots, POOL_SHAPE.batch
    original = {name: getattr(Offloader, name) for name in ("_move", "_zero_grads", "written", "consumed")}

    def region(space, what, base, first, end):  # pages [first, end) of the layer at slot base * layer_slots
        return space, what, base * slots + first * rows, base * slots + end * rows

    def logged_move(self, direction, buf, what, first, end, cause):
        stage = region("stage", what, buf.index, first, end)
        host = region("host", what, self._rank[buf.layer], first, end)
        src, dst = (host, stage) if direction == "h2d" else (stage, host)
        sim.op(sim.current, reads=[src], writes=[dst])
        original["_move"](self, direction, buf, what, first, end, cause)

    def logged_zero(self, buf, first, end):
        sim.op(sim.current, writes=[region("stage", "grad", buf.index, first, end)])
        original["_zero_grads"](self, buf, first, end)

    def logged_written(self, layer, first, end):  # the K/V write the compute stream just enqueued
        sim.op("compute", writes=[region("stage", "kv", self._holder[layer].index, first, end)])
        original["written"](self, layer, first, end)

    def logged_consumed(self, layer, keep):  # read_grad's gather of the chunk's gradient pages
        if (buf := self._holder.get(layer)) is not None:
            sim.op("compute", reads=[region("stage", "grad", buf.index, keep, buf.grad_pages)])
        original["consumed"](self, layer, keep)

    monkeypatch.setattr(offload_module, "_Streams", lambda device, staging: sim)
    for name, fn in zip(original, (logged_move, logged_zero, logged_written, logged_consumed), strict=True):
        monkeypatch.setattr(Offloader, name, fn)

    def kernel(layer, kv, grads):
        """The kernel reads every K/V page of a staged view; the backward adds into its gradient pages."""
        buf, pages = int(kv.page_table[0, 0]) // slots, kv.page_table.shape[1]
        grad = [region("stage", "grad", buf, 0, pages)] if grads else []
        sim.op("compute", reads=[region("stage", "kv", buf, 0, pages), *grad], writes=grad)

    return kernel


def check_ordering(monkeypatch, broken=None, buffers=2, budget_layers=0, checkpointing=False, order=None):
    sim = SimStreams(ignore_waits_on=broken)
    kernel = instrument(monkeypatch, sim)
    pool = KVPool(offload=True, hbm_budget=budget_layers * POOL_SHAPE.layer_bytes, staging_buffers=buffers)
    host = set(plan_tiers(4, POOL_SHAPE.layer_bytes, pool.hbm_budget, buffers).host_layers)
    got = drive(
        pool, checkpointing, order, on_view=lambda layer, *a: kernel(layer, *a) if layer in host else None
    )
    assert all(torch.equal(a, b) for a, b in zip(got, drive(KVPool(), checkpointing, order), strict=True))
    assert {op[0] for op in sim.ops} == {"compute", "h2d", "d2h"}
    return sim.hazards()


@pytest.mark.parametrize("checkpointing", [False, True])
@pytest.mark.parametrize(
    ("buffers", "budget_layers", "order"), [(1, 0, None), (2, 0, None), (2, 3, None), (3, 0, scrambled)]
)
def test_every_cross_stream_hazard_is_ordered_by_events(
    monkeypatch, buffers, budget_layers, order, checkpointing
):
    """The CUDA schedule's events, checked on CPU: no two conflicting operations on different streams (kernel
    reads/adds, K/V writes, gradient gathers, copies in and out, zero-fills) are left unordered."""
    assert check_ordering(monkeypatch, None, buffers, budget_layers, checkpointing, order) == []


@pytest.mark.parametrize("broken", ["compute", "h2d", "d2h"])
def test_the_ordering_check_catches_a_stream_that_ignores_its_waits(monkeypatch, broken):
    assert check_ordering(monkeypatch, broken) != []


# ------------------------------------------------------------------------------------------ errors, recovery
@pytest.mark.parametrize(
    "options",
    [
        {"offload": "yes"},
        {"hbm_budget": -1},
        {"hbm_budget": "8GiB"},
        {"hbm_budget": 2.5},
        {"staging_buffers": 0},
    ],
)
def test_bad_offload_options_are_rejected(options):
    with pytest.raises(OOMBConfigError, match="must be|byte count"):
        OOMBConfig(**options)


def test_host_memory_is_checked_before_allocating(monkeypatch):
    assert kv_pool_module.host_memory_available() > 0  # Linux: MemAvailable is readable
    shape = PoolShape(4, 1, 1 << 20, 4, 128, 128, torch.bfloat16, torch.float32)  # 24 GiB of host pages
    monkeypatch.setattr(kv_pool_module, "host_memory_available", lambda: 8 << 30)
    pool = KVPool(offload=True, hbm_budget=0)
    with pytest.raises(
        OOMBConfigError, match=r"needs 24\.00 GiB.*6\.00 GiB is available.*bfloat16.*16\.00 GiB"
    ):
        pool.reserve(shape, CPU)
    assert pool.allocated_bytes == 0


@pytest.mark.parametrize("sweep", ["forward", "backward"])
def test_an_exception_in_a_sweep_releases_the_pool_and_the_next_step_works(sweep):
    model = build_causal_lm("qwen2", num_hidden_layers=4)
    ids = torch.randint(0, 97, (2, SEQ), generator=torch.Generator().manual_seed(5))
    loss, grads, _ = run_step(model, ids, False)

    fail = {"armed": True}

    def boom(module, args, kwargs):
        hidden = args[0] if args else kwargs["hidden_states"]
        in_sweep = torch.is_grad_enabled() == (sweep == "backward")
        if fail["armed"] and in_sweep and hidden.shape[1] < CHUNK:  # the ragged last chunk, mid-sweep
            fail["armed"] = False
            raise RuntimeError("injected")

    handle = model.model.layers[2].register_forward_pre_hook(boom, with_kwargs=True)
    model.zero_grad()
    engine = OOMBEngine(HFChunkModel(model), OOMBConfig(CHUNK, PAGE, offload=True, hbm_budget=0))
    with pytest.raises(RuntimeError, match="injected"):
        engine.loss(ids).backward()
    handle.remove()
    assert not fail["armed"] and engine.pool.allocated_bytes == 0 and engine.pool.shape is None

    model.zero_grad()
    again = engine.loss(ids)
    again.backward()
    assert torch.equal(again.detach(), loss)
    assert all(torch.equal(g, grads[n]) for n, g in grads_of(model).items())


def test_stats_report_both_sweeps():
    model = build_causal_lm("qwen2")
    ids = torch.randint(0, 97, (1, SEQ), generator=torch.Generator().manual_seed(2))
    engine = OOMBEngine(HFChunkModel(model), OOMBConfig(CHUNK, PAGE, offload=True, hbm_budget=0))
    loss = engine.loss(ids)
    after_forward = dict(engine.stats.extra)
    loss.backward()
    after_backward = engine.stats.extra
    assert after_forward["host_layers"] == 2 and after_forward["host_pool_bytes"] > 0
    assert after_backward["d2h_bytes"] > after_forward["d2h_bytes"]  # gradient write-backs
    assert engine.stats.pool_bytes == engine.pool.allocated_bytes
