"""Window layers' tails wait in host memory when the device budget is short (``PoolShape.host_tails``): a ring of two
tail groups on the device, every group's K/V on the host, each crossing once each way — exact in float64, under
copies that run late, and counted by the planner byte for byte."""

from __future__ import annotations

import dataclasses
import functools

import pytest
import torch

from lightning_oomb.engine import OOMBConfig, OOMBConfigError, OOMBEngine
from lightning_oomb.engine.kv_pool import place_layers
from lightning_oomb.engine.offload import SyncTransport, delaying_transport
from lightning_oomb.engine.pages import PoolShape
from lightning_oomb.integrations.hf import HFChunkModel
from tests.engine.test_planner import assert_pool_planned
from tests.helpers.models import (
    build_family,
    exact_full_sequence_loss,
    float64_norms,
    grads_of,
    max_relative_error,
)

SEQ, CHUNK, PAGE = 200, 32, 4  # gemma3: window 7 -> a tail group of 2 pages per chunk, 6 groups (7 chunks)
OFFLOAD = {"offload": True, "staging_buffers": 3}


def gemma3():
    model = build_family("gemma3")  # 6 layers: 5 window layers, then a full one
    float64_norms(model)  # (its norms compute in float32: exact only so)
    return model


def ids_of(seed: int = 0, batch: int = 2) -> torch.Tensor:
    return torch.randint(0, 64, (batch, SEQ), generator=torch.Generator().manual_seed(seed))


def step(model, ids, transport=SyncTransport, checkpointing=False, **options):
    model.zero_grad()
    config = OOMBConfig(CHUNK, PAGE, layer_checkpointing=checkpointing, **options)
    engine = OOMBEngine(HFChunkModel(model, layer_checkpointing=checkpointing), config, transport)
    loss = engine.loss(ids)
    loss.backward()
    return loss.detach(), grads_of(model), engine


def tails_budget(model, ids, hosted: int = 5) -> int:
    """An ``hbm_budget`` that holds every full layer's pages and the tails of all but ``hosted`` window layers."""
    shape = step(model, ids)[2].pool.shape
    every = dataclasses.replace(shape, host_tails=True)
    return sum(map(every.bytes_of, range(shape.num_layers))) + (5 - hosted) * (
        shape.bytes_of(0) - every.bytes_of(0)
    )


@pytest.mark.parametrize("checkpointing", [False, True])
def test_hosted_tails_are_exact_and_cross_once_each_way(checkpointing):
    model, ids = gemma3(), ids_of()
    want_loss = exact_full_sequence_loss(model, ids)
    want_loss.backward()
    want = grads_of(model)
    budget = tails_budget(model, ids)
    loss, grads, engine = step(model, ids, checkpointing=checkpointing, hbm_budget=budget, **OFFLOAD)
    assert abs(loss.item() - want_loss.item()) <= 1e-10 * want_loss.item()
    assert max_relative_error(grads, want) <= 1e-10
    shape, stats = engine.pool.shape, engine.pool.stats()
    assert shape.hosted_tails == (0, 1, 2, 3, 4) and stats["host_layers"] == 0  # the full layer stays
    assert all(
        shape.layer_pages(layer) == 2 * 2 + 8 for layer in shape.hosted_tails
    )  # ring + a chunk's pages
    group = (
        2 * 2 * shape.tail_group(0) * PAGE * shape.kv_heads * shape.head_dim * 8
    )  # K and V, 2 rows, float64
    assert stats["d2h_bytes"] == shape.tail_host_bytes == 5 * 6 * group  # every group out once
    assert stats["h2d_bytes"] == 5 * 4 * group  # and back, but the two the forward sweep leaves on the device


def test_hosted_tails_beside_host_tier_layers_with_late_copies_equal_prompt_copies_bitwise():
    """Every full layer on the host too (``hbm_budget=0``), both sharing the copy streams; each copy runs at a
    random later moment (``chance`` 0: only when waited for): the same loss and gradients, bit for bit."""
    model, ids = gemma3(), ids_of(1)
    want_loss, want, engine = step(model, ids, checkpointing=True, hbm_budget=0, **OFFLOAD)
    assert engine.pool.stats()["host_layers"] == 1 and engine.pool.shape.hosted_tails
    for seed, chance in ((0, 0.0), (1, 0.3), (2, 0.3)):
        transport = functools.partial(delaying_transport, seed=seed, chance=chance)
        loss, got, _ = step(model, ids, transport, checkpointing=True, hbm_budget=0, **OFFLOAD)
        assert torch.equal(loss, want_loss)
        assert all(torch.equal(got[n], want[n]) for n in want)


def test_hosted_tails_with_reused_attention_and_two_steps_stay_exact():
    """``reuse_attention`` (the recompute reads no page, the backward restages them) and a second step in the same
    pool (rings rewritten, stale copies ignored)."""
    model, ids = gemma3(), ids_of(2)
    want_loss = exact_full_sequence_loss(model, ids)
    want_loss.backward()
    want = grads_of(model)
    config = OOMBConfig(CHUNK, PAGE, reuse_attention=True, hbm_budget=0, **OFFLOAD)
    engine = OOMBEngine(HFChunkModel(model), config)
    for _ in range(2):
        model.zero_grad()
        loss = engine.loss(ids)
        loss.backward()
        assert abs(loss.item() - want_loss.item()) <= 1e-10 * want_loss.item()
        assert max_relative_error(grads_of(model), want) <= 1e-10
    assert engine.pool.shape.hosted_tails


def test_an_eval_sweep_sends_no_tail():
    model, ids = gemma3(), ids_of()
    config = OOMBConfig(CHUNK, PAGE, hbm_budget=tails_budget(model, ids), **OFFLOAD)
    engine = OOMBEngine(HFChunkModel(model), config)
    with torch.inference_mode():
        engine.evaluate(ids)
    stats = engine.pool.stats()
    assert engine.pool.shape.hosted_tails and stats["d2h_bytes"] == stats["h2d_bytes"] == 0


def test_the_ring_holds_group_g_at_place_g_mod_2():
    shape = PoolShape(2, 1, 64, 1, 4, 4, 16, dtype=torch.float32, windows=(6, None), host_tails=True)
    assert shape.hosted_tails == (0,) and shape.tail_group(0) == 2  # 3 groups: pages (2, 3), (6, 7), (10, 11)
    table = shape.layer_table(0, torch.device("cpu"))[0].tolist()
    assert [table[p] for p in (2, 3, 6, 7, 10, 11)] == [0, 1, 2, 3, 0, 1]
    assert [table[p] for p in (0, 1, 4, 5, 12, 15)] == [
        4,
        5,
        4 + 4 % 4,
        5,
        4,
        7,
    ]  # the transient region after
    assert shape.hbm_slots_of(0) == 2 * 2 + 4 and shape.hbm_slots_of(1) == 16
    # two groups or fewer: the ring would hold them all — they stay on the device
    assert (
        PoolShape(2, 1, 48, 1, 4, 4, 16, dtype=torch.float32, windows=(6, None), host_tails=True).hosted_tails
        == ()
    )


def test_the_plan_counts_hosted_tails_byte_for_byte():
    model, ids = gemma3(), ids_of()
    config = OOMBConfig(CHUNK, PAGE, hbm_budget=tails_budget(model, ids), **OFFLOAD)
    engine = assert_pool_planned(model, config, ids)
    assert engine.pool.shape.hosted_tails


@pytest.mark.parametrize(("host_tails", "budget", "hosted"), [(False, 0, False), (True, 1 << 40, True)])
def test_host_tails_false_keeps_them_on_the_device_and_true_hosts_them_whatever_the_budget(
    host_tails, budget, hosted
):
    model, ids = gemma3(), ids_of(3)
    want_loss, want, _ = step(model, ids)
    loss, grads, engine = step(model, ids, hbm_budget=budget, host_tails=host_tails, **OFFLOAD)
    assert bool(engine.pool.shape.hosted_tails) == hosted
    assert abs(loss.item() - want_loss.item()) <= 1e-12 * want_loss.item()
    assert max_relative_error(grads, want) <= 1e-10


def test_a_host_tails_value_that_is_not_true_false_or_auto_is_refused():
    with pytest.raises(OOMBConfigError, match="host_tails='yes' must be True, False or 'auto'"):
        OOMBConfig(CHUNK, PAGE, host_tails="yes")


def test_as_few_layers_tails_as_the_budget_needs_go_to_host_memory():
    """A budget one byte short of every page: one window layer's tails go (the first of those saving the most), the
    others' stay on the device; exact, and only that layer's groups cross."""
    model, ids = gemma3(), ids_of(4)
    want_loss, want, engine = step(model, ids)
    shape = engine.pool.shape
    budget = sum(map(shape.bytes_of, range(shape.num_layers))) - 1
    loss, grads, engine = step(model, ids, hbm_budget=budget, **OFFLOAD)
    placed, stats = engine.pool.shape, engine.pool.stats()
    assert placed.hosted_tails == (0,) and stats["host_layers"] == 0
    assert stats["d2h_bytes"] == placed.tail_host_bytes
    assert abs(loss.item() - want_loss.item()) <= 1e-12 * want_loss.item()
    assert max_relative_error(grads, want) <= 1e-10
    # two layers' worth short: two layers' tails go
    _, _, engine = step(model, ids, hbm_budget=tails_budget(model, ids, hosted=2), **OFFLOAD)
    assert engine.pool.shape.hosted_tails == (0, 1)


def test_a_full_layer_in_the_host_tier_is_not_joined_by_tails_it_makes_room_for():
    """Fewest host-tier layers first, then fewest hosted tails: where hosting every tail cannot spare the full layer
    the host tier, the full layer goes and every tail stays on the device (before, the tails went to host memory
    too, for nothing); a byte less, and the window layer's tails go as well."""
    shape = PoolShape(
        2, 1, 64, 1, 4, 4, 16, dtype=torch.float32, windows=(6, None)
    )  # 3 tail groups of 2 pages
    every = dataclasses.replace(shape, host_tails=True)
    assert shape.bytes_of(1) > 3 * shape.block_bytes + shape.bytes_of(0) - every.bytes_of(0)
    budget = shape.bytes_of(0) + 3 * shape.block_bytes
    placed, plan, _ = place_layers(shape, budget, staging_buffers=3)
    assert plan.host_layers == (1,) and placed.hosted_tails == ()
    placed, plan, _ = place_layers(shape, budget - 1, staging_buffers=3)
    assert plan.host_layers == (1,) and placed.hosted_tails == (0,)
