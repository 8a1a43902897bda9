"""Context parallelism with the engine's options together (2 gloo processes, float64): in each case of
:mod:`tests.helpers.combinations` — a family, a batch layout (packed documents, right padding), a chunk geometry,
checkpointing, backend, ``reuse_attention``, ``mlp_tile``, ``loss_block``, offload, a page budget — the group's
loss and summed gradients equal one process's step with the same options, which
``tests/engine/test_option_combinations.py`` holds to full-sequence training.

Seeded, as there; ``OOMB_COMBINATIONS=N`` draws ``N`` more (300 random ones agreed when this test was written)."""

from __future__ import annotations

import os

import pytest
import torch.distributed as dist

from lightning_oomb.engine.context import ContextGroup
from tests.helpers.combinations import SEED, batch_of, build, draw, oomb_step, seeded
from tests.helpers.distributed import run_ranks
from tests.helpers.models import max_relative_error

pytestmark = pytest.mark.slow
TOL = 1e-10
GEOMETRY = (
    (8, 4),
    (16, 8),
    (32, 8),
    (16, 4),
)  # chunks of an even number of pages: a slice of whole pages per rank
CASES = draw(SEED + 2, 12, geometries=GEOMETRY)
MORE = draw(SEED + 3, int(os.environ.get("OOMB_COMBINATIONS", "0")), geometries=GEOMETRY)


def step(case, context=None):
    """``case``'s step (of this rank, across ``context``): its loss and gradients."""
    model, vocab = build(case.family)
    loss, grads, _ = oomb_step(model, case, batch_of(case.layout, vocab, seeded(case)), context)
    return loss, grads


def _group_step(rank, world, case):
    loss, grads = step(case, ContextGroup.of())
    for g in grads.values():  # each rank holds its tokens' share
        dist.all_reduce(g)
    return {"loss": loss, "grads": grads}


@pytest.mark.parametrize("case", CASES + MORE, ids=str)
def test_a_context_group_equals_one_process_with_the_same_options(tmp_path, case):
    want_loss, want = step(case)
    for result in run_ranks(_group_step, 2, tmp_path, case):
        assert abs(result["loss"].item() - want_loss.item()) <= TOL * abs(want_loss.item())
        assert max_relative_error(result["grads"], want) <= TOL
