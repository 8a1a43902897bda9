"""Offload of K/V and gradient pages to the host tier: exactness, placement, schedule, errors, recovery (CPU).

On CPU the host tier and its staging buffers run the same schedule with synchronous copies, so everything but
stream overlap is checked here. Host layers are attended block by block and merged by log-sum-exp, so offload
changes the loss and gradients only by float rounding (fp64 here).
"""

from __future__ import annotations

import random
import weakref
from collections import Counter

import pytest
import torch

from lightning_oomb.engine import OOMBConfig, OOMBConfigError, OOMBEngine
from lightning_oomb.engine import kv_pool as kv_pool_module
from lightning_oomb.engine.kv_pool import KVPool, plan_tiers
from lightning_oomb.engine.offload import staging as staging_module
from lightning_oomb.engine.offload.offloader import _groups, group_size
from lightning_oomb.engine.offload.schedule import Need
from lightning_oomb.engine.offload.staging import StagingCache
from lightning_oomb.engine.offload.transport import SyncTransport
from lightning_oomb.engine.pages import Arena, PoolShape, add_tokens, gather_tokens
from lightning_oomb.integrations.hf import HFChunkModel
from tests.helpers.models import build_causal_lm, full_sequence_loss, grads_of, max_relative_error
from tests.helpers.streams import RecordingTransport

CPU = torch.device("cpu")
SEQ, CHUNK, PAGE = 50, 16, 8


def pool_shape(layers: int, batch: int, seq: int, heads: int, dim: int, dtype=torch.float64, grads="float32"):
    return PoolShape(layers, batch, seq, heads, dim, PAGE, CHUNK, grads, dtype)


def tiny_shape(layers: int, seq: int = SEQ) -> PoolShape:
    """The pool shape of the tiny float64 model at batch 2 (float64 gradient pages: never narrower than K/V)."""
    return pool_shape(layers, 2, seq, 1, 8)


def offload_pool(**options) -> KVPool:
    return KVPool(OOMBConfig(CHUNK, PAGE, offload=True, **options))


def budget_for(shape: PoolShape, hbm_layers: int, buffers: int) -> int:
    """The ``hbm_budget`` that keeps exactly ``hbm_layers`` layers on the device."""
    return hbm_layers * shape.layer_bytes + buffers * shape.block_bytes


def run_step(model, ids, checkpointing, **offload):
    model.zero_grad()
    engine = OOMBEngine(
        HFChunkModel(model, layer_checkpointing=checkpointing),
        OOMBConfig(CHUNK, PAGE, layer_checkpointing=checkpointing, **offload),
    )
    loss = engine.loss(ids)
    loss.backward()
    return loss.detach(), grads_of(model), engine


# (layers, HBM layers, staging_buffers): everything on the host through the fewest buffers; one HBM layer + 3
# host layers; everything on the host with prefetch both ways; prefix blocks attended two per kernel call
PLACEMENTS = [(2, 0, 2), (4, 1, 3), (4, 0, 4), (2, 0, 5)]


@pytest.mark.parametrize(("layers", "hbm_layers", "buffers"), PLACEMENTS)
@pytest.mark.parametrize("checkpointing", [False, True])
def test_offload_equals_no_offload_and_full_sequence(layers, hbm_layers, buffers, checkpointing):
    model = build_causal_lm("qwen2", num_hidden_layers=layers)
    ids = torch.randint(0, 97, (2, SEQ), generator=torch.Generator().manual_seed(layers))
    want_loss = full_sequence_loss(model, ids)
    want_loss.backward()
    want = grads_of(model)
    model.train()

    loss, grads, _ = run_step(model, ids, checkpointing)
    budget = budget_for(tiny_shape(layers), hbm_layers, buffers)
    off_loss, off_grads, engine = run_step(
        model, ids, checkpointing, offload=True, hbm_budget=budget, staging_buffers=buffers
    )

    stats = engine.stats.extra
    assert stats["host_layers"] == layers - hbm_layers
    assert stats["h2d_bytes"] + stats["d2h_bytes"] > 0 and stats["copy_wait_s"] == 0.0
    assert abs(off_loss.item() - loss.item()) <= 1e-13 * loss.item()
    assert max_relative_error(off_grads, grads) <= 1e-12
    assert abs(off_loss.item() - want_loss.item()) <= 1e-10 * want_loss.item()
    assert max_relative_error(off_grads, want) <= 1e-10


def test_kept_attention_results_wait_in_host_memory_under_offload(monkeypatch):
    """With per-layer checkpointing under offload every layer's kept attention result goes to host memory in the
    chunk's recompute and comes back for the layer's checkpoint recompute (exact, as the test above checks), in the
    bytes the planner counts for it; without checkpointing nothing is parked (the results are saved anyway)."""
    from lightning_oomb.engine import activation_bytes, attention, step_setup
    from lightning_oomb.engine.model_shape import model_shape

    parked = []
    park = attention.Kept.park

    def spy(self):
        out = park(self)
        parked.append(out.out.host.untyped_storage().nbytes() + out.lse.host.untyped_storage().nbytes())
        assert out.out.host.device.type == "cpu" and out.out.host.data_ptr() != self.out.data_ptr()
        return out

    monkeypatch.setattr(attention.Kept, "park", spy)
    model = build_causal_lm("qwen2", num_hidden_layers=2)
    ids = torch.randint(0, 97, (2, 48), generator=torch.Generator().manual_seed(3))
    run_step(model, ids, False, offload=True)
    assert parked == []
    _, _, engine = run_step(model, ids, True, offload=True)
    assert len(parked) == 2 * 3  # layers x chunks
    shape = model_shape(engine.model)
    dtypes = step_setup.precision_dtypes("64-true")
    device, host = activation_bytes.parked_kept_bytes(shape, dtypes, 2 * CHUNK, pinned=False)
    assert host == sum(parked[:2]) and device == parked[0]


def test_checkpointed_layer_inputs_wait_in_host_memory_under_offload(monkeypatch):
    """Under offload with layer checkpointing (on CUDA; here forced on the CPU, at every size) the chunk recompute's
    saved activations are parked — each layer's input (torch's checkpoint saves it through the hooks around it) and
    the final norm's, each once — and come back, the one parked before each coming back ahead: the step equals
    full-sequence training (float64), and the planner counts the parked bytes."""
    from lightning_oomb.engine import activation_bytes, parking, step_setup
    from lightning_oomb.engine.model_shape import model_shape

    monkeypatch.setattr(parking, "DEVICE_TYPES", ("cuda", "cpu"))
    monkeypatch.setattr(parking, "MIN_BYTES", 1)
    made, prefetched = [], []
    hooks, prefetch = parking.ParkedSaves.__init__, parking.ParkedTensor.prefetch

    def spy_init(self, *args, **kwargs):
        hooks(self, *args, **kwargs)
        made.append(self)

    def spy_prefetch(self):
        prefetched.append(self.index)
        prefetch(self)

    monkeypatch.setattr(parking.ParkedSaves, "__init__", spy_init)
    monkeypatch.setattr(parking.ParkedTensor, "prefetch", spy_prefetch)
    layers = 3
    model = build_causal_lm("qwen2", num_hidden_layers=layers)
    ids = torch.randint(0, 97, (2, SEQ), generator=torch.Generator().manual_seed(5))
    want_loss = full_sequence_loss(model, ids)
    want_loss.backward()
    want = grads_of(model)
    model.train()
    loss, grads, engine = run_step(model, ids, True, offload=True)
    assert abs(loss.item() - want_loss.item()) <= 1e-10 * want_loss.item()
    assert max_relative_error(grads, want) <= 1e-10
    chunks = -(-SEQ // CHUNK)
    assert len(made) == chunks and prefetched
    hidden = model.config.hidden_size
    # per chunk: the layers' inputs [2, L, H]; the final norm's input and normed input [2, L, H] (float64: its
    # float32 cast is the input itself) and its 1/rms [2, L, 1]
    last = made[0].state  # the last chunk's (recomputed first): SEQ - 3 * CHUNK tokens
    tokens = 2 * (SEQ - (chunks - 1) * CHUNK)
    assert [p.host.shape for p in last.parked] == [(2, tokens // 2, hidden)] * (layers + 1) + [
        (2, tokens // 2, 1),
        (2, tokens // 2, hidden),
    ]
    shape, dtypes = model_shape(engine.model), step_setup.precision_dtypes("64-true")
    assert (
        activation_bytes.parked_saves_bytes(shape, dtypes, tokens, pinned=False, min_bytes=1)[1]
        == last.nbytes
    )
    # the step reports what it parked: every chunk's saves and kept attention results
    rows = [2 * (min(SEQ, start + CHUNK) - start) for start in range(0, SEQ, CHUNK)]
    kept = sum(activation_bytes.parked_kept_bytes(shape, dtypes, n, pinned=False)[1] for n in rows)
    assert engine.stats.extra["parked_bytes"] == sum(m.state.nbytes for m in made) + kept > 0


def test_a_centred_layernorms_parked_saves_are_planned(monkeypatch):
    """Cohere's final LayerNorm saves its centred float32 input twice (and 1/std and the normed input): the plan of
    the parked saves counts each tensor (it counted one input: 15 % under what a chunk parked), all but the norm
    weight's float32 copy (hidden-wide, per chunk)."""
    from lightning_oomb.engine import activation_bytes, parking, step_setup
    from lightning_oomb.engine.model_shape import model_shape
    from tests.helpers.models import build_family

    monkeypatch.setattr(parking, "DEVICE_TYPES", ("cuda", "cpu"))
    monkeypatch.setattr(parking, "MIN_BYTES", 1)
    made, hooks = [], parking.ParkedSaves.__init__

    def spy_init(self, *args, **kwargs):
        hooks(self, *args, **kwargs)
        made.append(self)

    monkeypatch.setattr(parking.ParkedSaves, "__init__", spy_init)
    model = build_family("cohere")
    ids = torch.randint(0, 60, (2, SEQ), generator=torch.Generator().manual_seed(5))
    _, _, engine = run_step(model, ids, True, offload=True)
    tokens = 2 * (SEQ - (-(-SEQ // CHUNK) - 1) * CHUNK)  # the last chunk's, parked first
    shape, dtypes = model_shape(engine.model), step_setup.precision_dtypes("64-true")
    planned = activation_bytes.parked_saves_bytes(shape, dtypes, tokens, pinned=False, min_bytes=1)[1]
    assert made[0].state.nbytes - planned == 4 * model.config.hidden_size


def test_parked_tensors_are_freed_with_their_graph(monkeypatch):
    """Each chunk's parked host copies go when its graph does, without waiting for Python's garbage collector (the
    hooks must not hold the context manager that holds them)."""
    import gc

    from lightning_oomb.engine import parking

    monkeypatch.setattr(parking, "DEVICE_TYPES", ("cuda", "cpu"))
    monkeypatch.setattr(parking, "MIN_BYTES", 1)
    states = []
    init = parking.Parking.__init__

    def spy(self, *args):
        init(self, *args)
        states.append(weakref.ref(self))

    monkeypatch.setattr(parking.Parking, "__init__", spy)
    model = build_causal_lm("qwen2", num_hidden_layers=2)
    ids = torch.randint(0, 97, (2, SEQ), generator=torch.Generator().manual_seed(6))
    gc.disable()
    try:
        run_step(model, ids, True, offload=True)
        alive = [ref for ref in states if ref() is not None]
    finally:
        gc.enable()
    assert len(states) == -(-SEQ // CHUNK) and not alive


# ------------------------------------------------------------------------------------------------- placement
def test_plan_tiers_fills_the_budget_with_whole_layers():
    lb, bb = 100, 10
    assert plan_tiers(8, lb, None, 2, bb).host_layers == ()  # offload off / no limit
    assert plan_tiers(8, lb, 800, 2, bb).host_layers == ()  # everything fits
    plan = plan_tiers(8, lb, 420, 2, bb)  # 4 HBM layers + 2 staging buffers = 420 bytes
    assert len(plan.hbm_layers) == 4 and plan.staging_buffers == 2
    assert plan.host_layers == (1, 3, 5, 7)  # spread over depth, not the last four
    assert len(plan_tiers(8, lb, 419, 2, bb).hbm_layers) == 3
    floor = plan_tiers(8, lb, 0, 3, bb)  # below the staging floor: all host
    assert floor.hbm_layers == () and floor.host_layers == tuple(range(8)) and floor.staging_buffers == 3


@pytest.mark.parametrize("hbm_layers", [0, 3, 5, 8])
def test_pool_device_bytes_stay_within_the_budget(hbm_layers):
    shape = pool_shape(8, 2, 40, 1, 4)
    budget = budget_for(shape, hbm_layers, 2)
    pool = offload_pool(hbm_budget=budget, staging_buffers=2)
    pool.reserve(shape, CPU)
    stats = pool.stats()
    assert pool.device_bytes <= budget
    assert stats["hbm_layers"] == hbm_layers and stats["host_layers"] == 8 - hbm_layers
    assert stats["hbm_pool_bytes"] == hbm_layers * shape.layer_bytes
    assert stats["host_pool_bytes"] == stats["host_layers"] * shape.layer_bytes
    assert stats["staging_bytes"] == (2 * shape.block_bytes if stats["host_layers"] else 0)


def test_offload_device_bytes_do_not_grow_with_the_sequence():
    """The goal of offload: with every layer on the host, device memory is the staging buffers, fixed by the
    chunk size; the host tier grows with the sequence."""
    device, host = [], []
    for seq in (64, 640, 6400):
        pool = offload_pool(hbm_budget=0, staging_buffers=4)
        pool.reserve(pool_shape(4, 1, seq, 2, 16, torch.bfloat16), CPU)
        device.append(pool.device_bytes)
        host.append(pool.host_bytes)
    assert device[0] == device[1] == device[2] == 4 * 2 * CHUNK * 2 * 16 * (2 + 4)
    assert host[0] < host[1] < host[2]


# -------------------------------------------------------------------------------------------------- schedule
# 4 layers, batch 2, 40 tokens: 5 pages per row, chunks (= blocks) of 2 + 2 + 1 pages
POOL_SHAPE = pool_shape(4, 2, 40, 1, 4)


def scrambled(start: int) -> list[int]:
    """A backward order of the layers that changes every chunk, so most predictions are wrong."""
    return [(i * 3 + start) % 4 for i in range(4)]


def drive(pool: KVPool, twice: bool = False, order=None, shape: PoolShape = POOL_SHAPE):
    """Replay the attention op's pool calls for one step (see ``PagedAttention``) with synthetic K/V and
    gradient adds; return everything the op would have read: each call's keys (K, V) in position order and each
    chunk's gradients. ``twice``: each layer streamed again right before its backward (a model that recomputes
    its layers without the engine's kept attention results: the schedule does not predict it)."""
    gen = torch.Generator().manual_seed(0)
    layers, starts = range(shape.num_layers), range(0, shape.seq_len, CHUNK)
    kv_of = {}
    seen = []

    def tokens(arena, kv, lo, hi):
        first, end = lo // PAGE, -(-hi // PAGE)
        return gather_tokens(arena, kv.page_table[:, first:end])[:, :, : hi - first * PAGE]

    def attend(layer, start, n, grads=False):
        pool.write(layer, start, *kv_of[layer, start])
        got = {}
        add = [torch.randn(2, 1, n, 4, generator=gen, dtype=torch.float64) for _ in "kv"] if grads else None
        ranges = []
        for kv in pool.parts(layer, n, grads):
            lo, hi = kv.keys
            ranges.append((lo, hi))
            got[lo] = [tokens(a, kv, lo, hi) for a in (kv.k, kv.v)]
            if grads:  # what the kernel does: add into the pages of the part's keys
                first, end = lo // PAGE, -(-hi // PAGE)
                for arena, g in zip((kv.dk, kv.dv), add, strict=True):
                    pad = torch.nn.functional.pad(g[:, :, lo:hi], (0, 0, 0, (end - first) * PAGE - (hi - lo)))
                    add_tokens(arena, kv.page_table[:, first:end], pad)
        ranges.sort()  # every key exactly once, in parts of whole blocks
        assert (
            ranges[0][0] == 0 and ranges[-1][1] == n and all(a[1] == b[0] for a, b in zip(ranges, ranges[1:]))
        )
        assert all(lo % CHUNK == 0 for lo, _ in ranges)
        seen.extend(torch.cat([got[lo][i] for lo in sorted(got)], dim=2) for i in (0, 1))

    pool.begin_sweep("forward")
    for start in starts:
        lq = min(CHUNK, shape.seq_len - start)
        for layer in layers:
            kv_of[layer, start] = [torch.randn(2, 1, lq, 4, generator=gen, dtype=torch.float64) for _ in "kv"]
            if not pool.holds(shape):
                pool.reserve(shape, CPU)
            attend(layer, start, start + lq)
    pool.end_sweep()

    pool.begin_sweep("backward")
    for start in reversed(starts):
        n = min(start + CHUNK, shape.seq_len)
        for layer in layers:  # recompute
            attend(layer, start, n)
        for layer in order(start) if order else reversed(layers):
            if twice:  # the layer's forward is recomputed right before its backward
                attend(layer, start, n)
            attend(layer, start, n, grads=True)
            seen.extend(pool.read_grad(layer, start, n - start))
    pool.end_sweep()
    return seen


def same(got, want) -> bool:
    return len(got) == len(want) and all(torch.equal(a, b) for a, b in zip(got, want, strict=True))


def transfers(pool, **match):
    return [t for t in pool.transfers if all(getattr(t, k) == v for k, v in match.items())]


@pytest.mark.parametrize("twice", [False, True])
@pytest.mark.parametrize("buffers", [2, 3, 4, 5, 9])
def test_schedule_reads_exactly_what_the_device_tier_reads(twice, buffers):
    want = drive(KVPool(), twice)
    pool = offload_pool(hbm_budget=0, staging_buffers=buffers)
    assert same(drive(pool, twice), want)
    stats = pool.stats()
    if buffers == 2:  # the chunk's block + one buffer for the prefix: blocks beyond the first come on demand
        assert stats["demand_copies"] > 0
    elif not twice:  # the walk (climbing forward; recompute up, backward down) predicted every use
        assert stats["demand_copies"] == 0 and stats["prefetch_copies"] > 0


@pytest.mark.parametrize("buffers", [5, 8])
def test_prefix_blocks_are_attended_in_groups_of_consecutive_blocks(buffers):
    """7 blocks: with 5 (8) buffers one kernel call attends up to 2 (3) prefix blocks; the keys read and the
    gradients are those of the device tier, each group's gradient pages go back once per stream."""
    shape = pool_shape(2, 2, 7 * CHUNK - 3, 1, 4)
    pool = offload_pool(hbm_budget=0, staging_buffers=buffers)
    assert same(drive(pool, shape=shape), drive(KVPool(), shape=shape))
    group = (buffers - 1) // 2
    calls = []
    pool.begin_sweep("forward")
    pool.reserve(shape, CPU)
    for start in range(0, shape.seq_len, CHUNK):
        k = torch.zeros(2, 1, min(CHUNK, shape.seq_len - start), 4, dtype=torch.float64)
        pool.write(0, start, k, k)
        calls.append([kv.keys for kv in pool.parts(0, start + k.shape[2])])
    pool.end_sweep()
    last = calls[-1]  # the chunk's own block, then the prefix in groups
    assert last[0] == (6 * CHUNK, shape.seq_len)
    assert last[1:] == [(lo * CHUNK, min(lo + group, 6) * CHUNK) for lo in range(0, 6, group)]


def test_a_gap_in_a_sparse_streams_blocks_ends_a_group():
    """A group's key range holds only its own blocks: selected blocks 0, 1, 2, 4, 5 in groups of up to 2."""
    needs = [Need(0, 6, False, False)] + [Need(0, j, True, False, frozenset({0})) for j in (0, 1, 2, 4, 5)]
    groups = [[n.block for n in g] for g in _groups(needs, True, 2)]
    assert groups == [[6], [0, 1], [2], [4, 5]]
    assert [[n.block for n in g] for g in _groups(needs[1:], False, 4)] == [[0, 1, 2], [4, 5]]
    assert group_size(4) == 1 and group_size(9) == 4


@pytest.mark.parametrize("depth", [0, 1])
def test_prefetch_depth_limits_how_far_ahead_blocks_are_staged(depth):
    want = drive(KVPool())
    pool = offload_pool(hbm_budget=0, staging_buffers=4, prefetch_depth=depth)
    assert same(drive(pool), want)
    stats = pool.stats()
    if depth == 0:  # a debugging aid: every copy on demand, nothing overlaps
        assert stats["prefetch_copies"] == 0 and stats["demand_copies"] > 0
    else:  # the walk is predicted one block use ahead: enough to issue every copy before it is needed
        assert stats["prefetch_copies"] > 0 and stats["demand_copies"] == 0


def test_schedule_stays_correct_when_predictions_are_wrong():
    """Layers' backward in a scrambled order each chunk: prefetch guesses wrong, demand copies fix it."""
    want = drive(KVPool(), order=scrambled)
    pool = offload_pool(hbm_budget=0, staging_buffers=3)
    assert same(drive(pool, order=scrambled), want)
    assert pool.stats()["demand_copies"] > 0


def test_write_back_schedule_and_dirty_tracking():
    budget = budget_for(POOL_SHAPE, 1, 4)
    pool = offload_pool(hbm_budget=budget, staging_buffers=4)
    drive(pool)
    host = pool.plan.host_layers
    assert len(host) == 3
    blocks = [(0, 2), (2, 4), (4, 5)]  # pages of each chunk's block
    # forward sweep: each chunk's new K/V pages go out once, right after they are written; nothing else does
    written = [(t.layer, t.first, t.end) for t in transfers(pool, sweep="forward", direction="d2h")]
    assert sorted(written) == sorted((layer, a, b) for layer in host for a, b in blocks)
    assert all(t.what == "kv" for t in transfers(pool, sweep="forward", direction="d2h"))
    # backward sweep: K/V pages are never dirty, so never written back, and the chunk's own K/V never come in
    assert transfers(pool, sweep="backward", direction="d2h", what="kv") == []
    kv_in = {(t.first, t.end) for t in transfers(pool, sweep="backward", direction="h2d", what="kv")}
    assert kv_in == set(blocks[:2])  # the prefix blocks of chunks 1 and 2; chunk 0 has none
    # gradients: chunk s writes back each prefix block once after adding into it (its own go to autograd)
    grads_out = sorted((t.layer, t.first) for t in transfers(pool, sweep="backward", direction="d2h"))
    assert grads_out == sorted((layer, blocks[j][0]) for layer in host for s in (1, 2) for j in range(s))
    # gradients come in only where the host holds some: written back by a later chunk (zero-filled otherwise,
    # and not at all when the buffer still holds the written-back copy)
    grads_in = Counter(
        (t.layer, t.first) for t in transfers(pool, sweep="backward", direction="h2d", what="grad")
    )
    could = Counter((layer, blocks[j][0]) for layer in host for s in (0, 1) for j in range(s + 1))
    assert grads_in and grads_in <= could
    # every copy in, in both sweeps, was a prefetch issued before the access that needed it
    assert {t.cause for t in transfers(pool, direction="h2d")} == {"prefetch"}
    assert pool.stats()["copy_runs"] == 2 * len(pool.transfers)  # K and V (dK and dV) of each run of pages


# -------------------------------------------------------------------------------- stream ordering, simulated
def check_ordering(broken=None, buffers=3, hbm_layers=0, twice=False, order=None):
    sim = RecordingTransport(ignore_waits_on=broken)
    budget = budget_for(POOL_SHAPE, hbm_layers, buffers)
    pool = KVPool(OOMBConfig(CHUNK, PAGE, offload=True, hbm_budget=budget, staging_buffers=buffers),
                  transport=lambda device: sim)  # fmt: skip
    got = drive(pool, twice, order)
    assert same(got, drive(KVPool(), twice, order))
    assert {op[0] for op in sim.ops} == {"compute", "h2d", "d2h"}
    return sim.hazards()


@pytest.mark.parametrize("twice", [False, True])
@pytest.mark.parametrize(
    ("buffers", "hbm_layers", "order"),
    [(2, 0, None), (3, 0, None), (4, 1, None), (3, 0, scrambled), (5, 0, None), (5, 0, scrambled)],
)
def test_every_cross_stream_hazard_is_ordered_by_events(buffers, hbm_layers, order, twice):
    """The CUDA schedule's events, checked on CPU: no two conflicting operations on different streams (kernel
    reads/adds, K/V writes, gradient gathers, copies in and out, zero-fills) are left unordered."""
    assert check_ordering(None, buffers, hbm_layers, twice, order) == []


@pytest.mark.parametrize("broken", ["compute", "h2d", "d2h"])
def test_the_ordering_check_catches_a_stream_that_ignores_its_waits(broken):
    assert check_ordering(broken) != []


# ------------------------------------------------------------------------------------------ errors, recovery
@pytest.mark.parametrize(
    "options",
    [
        {"offload": "yes"},
        {"hbm_budget": -1},
        {"hbm_budget": "8GiB"},
        {"hbm_budget": 2.5},
        {"staging_buffers": 0},
        {"staging_buffers": 1},
        {"staging_buffers": "many"},
    ],
)
def test_bad_offload_options_are_rejected(options):
    with pytest.raises(OOMBConfigError, match="must be|byte count"):
        OOMBConfig(**options)


def test_auto_staging_groups_small_blocks_only():
    """``staging_buffers="auto"``: 9 buffers (4 blocks a kernel call) where they take at most 256 MiB — Qwen2.5-7B's
    24 MiB blocks at chunk 4096 —, else 4; a number is taken as it is; the pool stages through what it says."""
    mib = 2**20
    auto = OOMBConfig()
    assert auto.staging_buffers == "auto"
    assert auto.staging_count(24 * mib) == 9 and auto.staging_count(29 * mib) == 4
    assert OOMBConfig(staging_buffers=5).staging_count(1 << 40) == 5
    pool = offload_pool(hbm_budget=0)
    pool.reserve(POOL_SHAPE, CPU)
    assert pool.plan.staging_buffers == 9 and pool.stats()["staging_bytes"] == 9 * POOL_SHAPE.block_bytes


def test_host_memory_is_checked_before_allocating(monkeypatch):
    assert kv_pool_module.host_memory_available() > 0  # Linux: MemAvailable is readable
    # 24 GiB of host pages (one block = the whole row: chunk_size 0)
    shape = PoolShape(4, 1, 1 << 20, 4, 128, 128, dtype=torch.bfloat16)
    monkeypatch.setattr(kv_pool_module, "host_memory_available", lambda: 8 << 30)
    pool = KVPool(OOMBConfig(offload=True, hbm_budget=0))
    with pytest.raises(
        OOMBConfigError, match=r"needs 24\.00 GiB.*6\.00 GiB is available.*bfloat16.*16\.00 GiB"
    ):
        pool.reserve(shape, CPU)
    assert pool.allocated_bytes == 0


def test_the_device_tier_is_checked_before_allocating_too(monkeypatch):
    """Without offload the pages live on the model's device: on CPU they count against host memory, on CUDA
    against free GPU memory (mocked here); either way nothing is allocated and the fix is named."""
    shape = PoolShape(4, 1, 1 << 20, 4, 128, 128, dtype=torch.bfloat16)  # 24 GiB of pages
    monkeypatch.setattr(kv_pool_module, "host_memory_available", lambda: 8 << 30)
    pool = KVPool()
    with pytest.raises(
        OOMBConfigError, match=r"needs 24\.00 GiB of host memory \(the model runs on the CPU\).*6\.00 GiB"
    ):
        pool.reserve(shape, CPU)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (10 << 30, 80 << 30))
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device=None: 2 << 30)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device=None: 0)
    monkeypatch.setattr(torch.cuda, "get_per_process_memory_fraction", lambda device=None: 1.0)
    with pytest.raises(
        OOMBConfigError, match=r"needs 24\.00 GiB of GPU memory.*12\.00 GiB is free.*offload=True"
    ):
        pool.reserve(shape, torch.device("cuda", 0))
    # a process limited to a share of the device (set_per_process_memory_fraction) can use only that share
    monkeypatch.setattr(torch.cuda, "get_per_process_memory_fraction", lambda device=None: 0.1)
    with pytest.raises(OOMBConfigError, match=r"needs 24\.00 GiB of GPU memory.*8\.00 GiB is free"):
        pool.reserve(shape, torch.device("cuda", 0))
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
    assert abs(again.item() - loss.item()) <= 1e-13 * loss.item()
    assert max_relative_error(grads_of(model), grads) <= 1e-12


def test_stats_report_both_sweeps():
    model = build_causal_lm("qwen2")
    ids = torch.randint(0, 97, (1, SEQ), generator=torch.Generator().manual_seed(2))
    engine = OOMBEngine(HFChunkModel(model), OOMBConfig(CHUNK, PAGE, offload=True, hbm_budget=0))
    loss = engine.loss(ids)
    after_forward = dict(engine.stats.extra)
    loss.backward()
    after_backward = engine.stats.extra
    assert after_forward["host_layers"] == 2 and after_forward["host_pool_bytes"] > 0
    assert after_forward["staging_bytes"] == engine.pool.plan.staging_buffers * engine.pool.shape.block_bytes
    assert after_backward["d2h_bytes"] > after_forward["d2h_bytes"]  # gradient write-backs
    assert engine.stats.pool_bytes == engine.pool.allocated_bytes


def test_sliding_window_streams_only_the_blocks_it_sees():
    """Mistral with a window (11 keys) shorter than a chunk (16): exact with offload, and each chunk copies in
    only the one prefix block its window reaches, never the blocks before it."""
    model = build_causal_lm("mistral", num_hidden_layers=2)
    ids = torch.randint(0, 97, (2, SEQ), generator=torch.Generator().manual_seed(3))
    want_loss = full_sequence_loss(model, ids)
    want_loss.backward()
    want = grads_of(model)
    model.train()
    loss, grads, engine = run_step(model, ids, False, offload=True, hbm_budget=0, staging_buffers=2)
    assert abs(loss.item() - want_loss.item()) <= 1e-10 * want_loss.item()
    assert max_relative_error(grads, want) <= 1e-10
    kv_in = Counter(
        (t.sweep, t.layer) for t in engine.pool.transfers if t.direction == "h2d" and t.what == "kv"
    )
    # chunks 1, 2, 3 each need one prefix block per layer in each sweep's attention (2 in the backward sweep:
    # recompute and backward); full attention would need 1 + 2 + 3
    assert all(n <= 3 for (sweep, _), n in kv_in.items() if sweep == "forward")
    assert all(n <= 6 for (sweep, _), n in kv_in.items() if sweep == "backward")


def test_a_training_step_keeps_the_same_device_pool_at_any_length():
    """Through the engine: 4x the tokens, 4x the host pool, the same device bytes (the staging buffers)."""
    model = build_causal_lm("qwen2")
    device_bytes, host_bytes = [], []
    for seq in (48, 192):
        ids = torch.randint(0, 97, (1, seq), generator=torch.Generator().manual_seed(seq))
        _, _, engine = run_step(model, ids, False, offload=True, hbm_budget=0)
        stats = engine.stats.extra
        assert stats["hbm_pool_bytes"] == 0
        device_bytes.append(engine.pool.device_bytes)
        host_bytes.append(stats["host_pool_bytes"])
    assert (
        device_bytes[0] == device_bytes[1] == engine.pool.plan.staging_buffers * engine.pool.shape.block_bytes
    )
    assert host_bytes[1] == 4 * host_bytes[0]


def test_evaluation_with_offload_equals_without():
    model = build_causal_lm("mistral")  # sliding window: blocks outside it are skipped in the eval sweep too
    ids = torch.randint(0, 97, (2, SEQ), generator=torch.Generator().manual_seed(4))
    want = full_sequence_loss(model, ids).item()
    plain = OOMBEngine(HFChunkModel(model), OOMBConfig(CHUNK, PAGE)).evaluate(ids).item()
    engine = OOMBEngine(
        HFChunkModel(model), OOMBConfig(CHUNK, PAGE, offload=True, hbm_budget=0, staging_buffers=3)
    )
    with torch.inference_mode():  # as in Lightning's evaluation loop
        offloaded = engine.evaluate(ids).item()
    assert engine.stats.extra["host_layers"] == 2 and engine.stats.extra["h2d_bytes"] > 0
    assert abs(offloaded - plain) <= 1e-13 * plain and abs(offloaded - want) <= 1e-10 * want


# ------------------------------------------------------------------------------------------------ staging cache
BLOCK_SHAPE = PoolShape(1, 2, 120, 1, 2, 4, 32, "float32", torch.float64)  # blocks of 8 pages; the last of 6


def staging_cache(buffers: int = 2) -> StagingCache:
    """A staging cache of one host layer (4 blocks of :data:`BLOCK_SHAPE`)."""
    host = Arena(BLOCK_SHAPE.layer_slots, BLOCK_SHAPE, CPU)
    staging = Arena(buffers * BLOCK_SHAPE.block_slots, BLOCK_SHAPE, CPU)
    return StagingCache(BLOCK_SHAPE, [0], host, staging, buffers, SyncTransport(CPU))


def walked_runs(pages: set[int], size: int) -> list[tuple[int, int]]:
    """Runs of consecutive pages by a walk over every offset of the block (the plain reference)."""
    runs, start = [], None
    for p in range(size + 1):
        if p in pages and start is None:
            start = p
        elif p not in pages and start is not None:
            runs.append((start, p))
            start = None
    return runs


def test_runs_of_consecutive_pages_match_a_walk_over_the_block():
    cache, rng = staging_cache(), random.Random(0)
    for block, size in ((0, 8), (3, 6)):
        buf = cache.stage(Need(0, block, False, False), "demand", set())
        assert buf.size == size and cache._runs(buf, None) == [(0, size)]
        every = set(range(size))
        edges = [set(), {0}, {size - 1}, every, every - {0}, every - {size - 1}, every - {1}, {0, size - 1}]
        for pages in edges + [set(rng.sample(range(size), rng.randint(1, size))) for _ in range(200)]:
            assert cache._runs(buf, frozenset(pages)) == walked_runs(pages, size), pages


def test_a_buffers_run_views_are_made_once_and_view_its_pages():
    cache = staging_cache()
    buf = cache.stage(Need(0, 0, False, False), "demand", set())  # 8 pages: 36 runs
    staging, start, batch = cache._staging, buf.index * BLOCK_SHAPE.block_slots, BLOCK_SHAPE.batch

    def check(pages: frozenset[int]) -> list:
        views = cache._views(buf, "kv", pages)
        runs = walked_runs(pages, buf.size)
        want = [t[start + a * batch : start + b * batch] for t in (staging.k, staging.v) for a, b in runs]
        assert sorted((v.data_ptr(), v.shape) for v in views) == sorted((w.data_ptr(), w.shape) for w in want)
        return views

    pages = frozenset({0, 2, 3, 5})
    assert all(a is b for a, b in zip(check(pages), check(pages), strict=True))  # kept, not made again
    for a in range(buf.size):  # every run of the block: more than are kept, and still the right views
        for b in range(a + 1, buf.size + 1):
            check(frozenset(range(a, b)))
    assert len(cache._staged[buf.index, "kv"]) == 4 * BLOCK_SHAPE.block_pages


def test_the_trace_keeps_the_last_transfers(monkeypatch):
    def traced() -> list:
        cache = staging_cache()
        for block in range(4):  # scattered pages: several transfers per copy
            cache.stage(Need(0, block, True, False, frozenset({0, 2, 5})), "demand", set())
        return cache.trace

    full = traced()
    monkeypatch.setattr(staging_module, "TRACE_LIMIT", 5)
    assert len(full) == 12 and traced() == full[-5:]
