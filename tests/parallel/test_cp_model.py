"""``benchmarks/cp_model.py``: its traffic formula equals the bytes a real 2-rank step contributes (the prediction's
communication term rests on it), and its predictions are ordered as the model says."""

from __future__ import annotations

import pytest

from benchmarks.cp_model import LINKS, count, predict

pytestmark = pytest.mark.slow


def test_the_formula_equals_the_counted_bytes():
    rows = count(lengths=(128,), checkpointing_modes=(True,))
    assert len(rows) == 2 and all(r["equal"] for r in rows)
    assert all(r["counted_per_layer_chunk"]["reduce_scatter"] > 0 for r in rows)


def test_more_gpus_divide_the_pool_and_speed_the_step():
    for link in LINKS:
        rows = [predict(262144, gpus, link) for gpus in (1, 2, 4, 8)]
        assert [r["pool_gib"] for r in rows] == [rows[0]["pool_gib"] / g for g in (1, 2, 4, 8)]
        steps = [r["step_s"] for r in rows]
        assert steps == sorted(steps, reverse=True) and rows[0]["communication_s"] == 0
        assert all(r["step_s"] > rows[0]["step_s"] / r["gpus"] for r in rows[1:])  # communication costs
