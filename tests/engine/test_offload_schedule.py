"""The offload schedule on plain lists: it predicts the sweeps' order of layer streams and their block uses."""

from __future__ import annotations

import pytest

from lightning_oomb.engine.offload.schedule import Need, OffloadSchedule, Visit


def sweep_order(layers: int, chunks: int) -> dict[str, list[tuple[int, int, bool]]]:
    """The engine's order of layer streams ``(layer, chunk, grads)``: the forward sweep climbs the layers chunk
    after chunk; the backward sweep recomputes each chunk climbing, then back-propagates it descending (a
    checkpointed layer's recompute streams nothing: it reuses the climb's attention result)."""
    forward = [(layer, c, False) for c in range(chunks) for layer in range(layers)]
    backward = []
    for c in reversed(range(chunks)):
        backward += [(layer, c, False) for layer in range(layers)]
        for layer in reversed(range(layers)):
            backward += [(layer, c, True)]
    return {"forward": forward, "backward": backward}


@pytest.mark.parametrize(("layers", "chunks"), [(1, 1), (3, 4), (4, 2)])
def test_every_next_stream_is_predicted(layers, chunks):
    """Along the engine's real order, the predicted next stream is the one that comes, in both sweeps, and the
    prediction ends exactly where the sweep does."""
    schedule = OffloadSchedule(layers, chunks, host_layers=range(layers))
    for sweep, order in sweep_order(layers, chunks).items():
        schedule.begin_sweep(sweep)
        predicted = None
        for i, (layer, chunk, grads) in enumerate(order):
            at = schedule.visit(layer, chunk, grads)
            assert i == 0 or predicted == at, (sweep, at, predicted)
            predicted = schedule.next_visit(at)
        assert predicted is None or predicted.chunk >= chunks  # nothing predicted past the sweep's end


def test_forward_prediction_lists_host_blocks_with_kv_on_the_host():
    """Forward sweep, layers 0 and 2 on the host: from layer 0 of chunk 1, the uses ahead are layer 2's own block
    and the prefix blocks whose K/V were written, then chunk 2's streams; the HBM layer 1 predicts nothing."""
    schedule = OffloadSchedule(3, 3, host_layers=(0, 2))
    for layer, chunk in [(0, 0), (2, 0), (0, 1)]:
        schedule.wrote(layer, chunk)
    needs = schedule.stream(0, 1, grads=False)
    assert needs == [Need(0, 1, False, False), Need(0, 0, True, False)]
    schedule.using(needs, 0)
    ahead = list(schedule.upcoming())
    assert ahead[:4] == [
        Need(0, 0, True, False),  # the rest of this stream
        Need(2, 1, False, False),  # layer 2's own block of chunk 1, then its written prefix
        Need(2, 0, True, False),
        Need(0, 2, False, False),  # chunk 2 climbs again
    ]
    assert all(n.layer != 1 for n in ahead)


def test_backward_prediction_stages_gradient_pages():
    """Backward sweep, no checkpointing, 2 layers, from the top layer's recompute of chunk 1: next come the top
    layer's backward (with gradient pages) and then layer 0's."""
    schedule = OffloadSchedule(2, 2, host_layers=(0, 1))
    for chunk in (0, 1):
        for layer in (0, 1):
            schedule.wrote(layer, chunk)
    schedule.begin_sweep("backward")
    schedule.visit(0, 1)
    schedule.visit(1, 1)
    ahead = list(schedule.upcoming())
    assert ahead[:4] == [
        Need(1, 1, False, True),
        Need(1, 0, True, True),
        Need(0, 1, False, True),
        Need(0, 0, True, True),
    ]
    assert schedule.next_visit(Visit(0, 0, True)) is None  # the bottom layer of the first chunk ends it


def test_a_sliding_window_narrows_the_predicted_prefix():
    schedule = OffloadSchedule(1, 6, host_layers=(0,))
    for chunk in range(5):
        schedule.wrote(0, chunk)
    needs = schedule.stream(0, 4, grads=False, first=3)  # the window reaches back one block
    assert [n.block for n in needs] == [4, 3]
    schedule.using(needs, len(needs) - 1)
    assert list(schedule.upcoming()) == [Need(0, 5, False, False), Need(0, 4, True, False)]


def test_a_new_forward_sweep_forgets_what_was_written():
    schedule = OffloadSchedule(2, 2, host_layers=(0, 1))
    schedule.wrote(1, 1)
    schedule.begin_sweep("backward")
    assert schedule.written == [0, 2]  # K/V stay on the host for the backward sweep
    schedule.begin_sweep("forward")
    assert schedule.written == [0, 0] and schedule.at is None
