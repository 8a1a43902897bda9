"""16-bit parameters' chunk gradients are summed in float32 and written into ``.grad`` once per backward sweep: the
gradient's error against float64 does not grow with the number of chunks (it does with autograd's native bf16
accumulation, the negative control), earlier ``.grad`` is added once, other parameters are left to autograd."""

from __future__ import annotations

import threading

import pytest
import torch

from lightning_oomb.engine import OOMBConfig, OOMBConfigError, OOMBEngine, grads
from lightning_oomb.engine.grads import Float32GradSums, HostGradSums, host_flushes
from lightning_oomb.integrations.hf import HFChunkModel
from tests.helpers.memory import LiveBytes
from tests.helpers.models import build_causal_lm, full_sequence_loss, grads_of

pytestmark = pytest.mark.usefixtures("one_thread")


def backward_n_times(sums, params, times: int) -> None:
    """``times`` backward passes, each adding a gradient of exactly 1 to every parameter."""
    with sums:
        for _ in range(times):
            sum(p.sum() for p in params).backward()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_earlier_grad_plus_the_chunks_is_rounded_once(dtype):
    """An earlier .grad of 256 plus 64 chunks' gradients of 1: bf16 rounds every +1 back to 256 (its ulp is 2
    there; float16's at 2048), the float32 sum gives 320, rounded once."""
    p = torch.nn.Parameter(torch.ones(3, dtype=dtype))
    big = 256.0 if dtype == torch.bfloat16 else 2048.0  # 1 is half an ulp there
    earlier = torch.full((3,), big, dtype=dtype)  # an earlier micro-batch
    p.grad = earlier.clone()
    backward_n_times(Float32GradSums([p]), [p], 64)
    assert p.grad.dtype == dtype and torch.equal(p.grad, earlier + 64)

    native = torch.nn.Parameter(torch.ones(3, dtype=dtype))
    native.grad = earlier.clone()
    backward_n_times(torch.enable_grad(), [native], 64)
    assert torch.equal(native.grad, earlier)  # the control: autograd's own sum stagnates


def test_other_parameters_are_left_to_autograd():
    """float32/float64 and frozen parameters get no sum; a 16-bit one without a gradient keeps its .grad; a
    parameter used twice (tied) gets both uses' gradient."""
    wide = torch.nn.Parameter(torch.ones(2, dtype=torch.float32))
    frozen = torch.nn.Parameter(torch.ones(2, dtype=torch.bfloat16), requires_grad=False)
    unused = torch.nn.Parameter(torch.ones(2, dtype=torch.bfloat16))
    unused.grad = torch.full((2,), 5.0, dtype=torch.bfloat16)
    tied = torch.nn.Parameter(torch.ones(2, dtype=torch.bfloat16))
    sums = Float32GradSums([wide, frozen, unused, tied, tied])
    assert sums.params == [unused, tied]
    with sums:
        for _ in range(3):
            (wide.sum() + (tied * 2).sum() + (tied * 3).sum()).backward()
            assert wide.grad is not None and tied.grad is None  # the sum holds tied's gradient meanwhile
    assert torch.equal(wide.grad, torch.full((2,), 3.0))
    assert torch.equal(tied.grad, torch.full_like(tied, 15.0))
    assert torch.equal(unused.grad, torch.full_like(unused, 5.0)) and frozen.grad is None


def gradient_errors(accumulation: str, chunk_size: int, seq_len: int = 1024) -> dict[str, float]:
    """Each parameter's relative gradient error of one bf16 OOMB step against float64 (the same bf16 weights)."""
    ids = torch.randint(0, 97, (1, seq_len), generator=torch.Generator().manual_seed(0))
    truth_model = build_causal_lm("qwen2", dtype=torch.bfloat16).double()
    full_sequence_loss(truth_model, ids).backward()
    model = build_causal_lm("qwen2", dtype=torch.bfloat16)
    config = OOMBConfig(chunk_size, min(chunk_size, 8), grad_accumulation=accumulation)
    OOMBEngine(HFChunkModel(model), config).loss(ids).backward()
    got = grads_of(model)
    return {n: ((got[n].double() - t).norm() / t.norm()).item() for n, t in grads_of(truth_model).items()}


@pytest.mark.parametrize(
    ("accumulation", "grows"), [("float32", False), ("float32-host", False), ("native", True)]
)
def test_bf16_gradient_error_does_not_grow_with_the_chunks(accumulation, grows):
    """1 vs 256 chunks of 1024 tokens. The final norm's weight, whose gradient every token adds to, shows the
    per-chunk rounding most: native bf16 accumulation (the control) makes its error ~3.5x, the float32 sums keep
    it; no parameter's error grows by more than a few percent with them."""
    one, many = gradient_errors(accumulation, 1024), gradient_errors(accumulation, 4)
    norm = many["model.norm.weight"] / one["model.norm.weight"]
    assert norm > 2 if grows else norm < 1.25, (one, many)
    if not grows:
        assert max(many[n] / one[n] for n in one) < 1.25, (one, many)


def step_grads(dtype, checkpointing: bool = False, accumulation: str = "float32") -> dict[str, torch.Tensor]:
    """The gradients of one 4-chunk OOMB step of a tiny Qwen2 in ``dtype``."""
    ids = torch.randint(0, 97, (1, 64), generator=torch.Generator().manual_seed(2))
    model = build_causal_lm("qwen2", dtype=dtype)
    engine = OOMBEngine(HFChunkModel(model, checkpointing), OOMBConfig(16, 8, grad_accumulation=accumulation))
    engine.loss(ids).backward()
    return grads_of(model)


@pytest.mark.parametrize(
    ("dtype", "one", "other"),
    [
        # checkpointed layers back-propagate inside their own recompute: the sums still get every gradient
        (torch.bfloat16, {"checkpointing": True}, {"checkpointing": False}),
        # nothing changes for 64-bit parameters
        (torch.float64, {"accumulation": "float32"}, {"accumulation": "native"}),
    ],
    ids=["bf16-checkpointing", "float64"],
)
def test_same_bits(dtype, one, other):
    want, got = step_grads(dtype, **one), step_grads(dtype, **other)
    assert all(torch.equal(want[n], got[n]) for n in want)


def test_unknown_accumulation_is_refused():
    with pytest.raises(
        OOMBConfigError, match="grad_accumulation='bf16'.*'float32', 'float32-host', 'native'"
    ):
        OOMBConfig(grad_accumulation="bf16")


# ------------------------------------------------------------------------------------------------ float32-host
def chunk_gradients(count: int, shape, seed: int) -> list[torch.Tensor]:
    """``count`` bf16 gradients of varied magnitude: their bf16 running sum rounds."""
    gen = torch.Generator().manual_seed(seed)
    return [
        (torch.randn(shape, generator=gen) * 4 ** torch.randn((), generator=gen)).bfloat16()
        for _ in range(count)
    ]


def host_sweep(sums: HostGradSums, params, grads: list[list[torch.Tensor]]) -> None:
    """One backward sweep of ``len(grads)`` chunks; chunk ``k`` hands ``params[i]`` the gradient ``grads[k][i]``."""
    with sums.sweep(params):
        for k, chunk in enumerate(grads):
            sum((p * g).sum() for p, g in zip(params, chunk)).backward()
            sums.chunk_done(more=k + 1 < len(grads))


def windowed(earlier, grads: list[torch.Tensor], every: int) -> torch.Tensor:
    """What float32-host computes for a matrix: the earlier ``.grad`` and bf16 running sums over windows of
    ``every`` chunks, added in float32, rounded once."""
    total = torch.zeros(grads[0].shape, dtype=torch.float32) if earlier is None else earlier.float()
    for start in range(0, len(grads), every):
        window = None
        for g in grads[start : start + every]:
            window = g.clone() if window is None else window + g
        total += window.float()
    return total.bfloat16()


@pytest.mark.parametrize("chunks", [10, 4])
@pytest.mark.parametrize("accumulating", [True, False])
def test_host_sums_round_once_per_window(chunks, accumulating):
    """Matrices: bf16 over windows of ``every`` chunks, float32 in host memory across them (slabs of 4 elements:
    the staging pipeline runs over several), an earlier micro-batch's ``.grad`` added there first; a sweep of one
    window without an earlier ``.grad`` is autograd's own; vectors: one float32 sum."""
    matrix = torch.nn.Parameter(torch.zeros(3, 5, dtype=torch.bfloat16))
    vector = torch.nn.Parameter(torch.zeros(7, dtype=torch.bfloat16))
    earlier = chunk_gradients(1, (3, 5), 9)[0] if accumulating else None
    matrix.grad = None if earlier is None else earlier.clone()
    grads = list(zip(chunk_gradients(chunks, (3, 5), 1), chunk_gradients(chunks, (7,), 2)))
    sums = HostGradSums(every=4, slab=4)
    host_sweep(sums, [matrix, vector], grads)
    # the earlier .grad first, windows flushed while chunks follow, then (if any was) the last window at the end
    flushed = int(accumulating) + (2 if chunks == 10 else 0)
    assert sums.flushes == flushed + bool(flushed) == host_flushes(chunks, accumulating, every=4)
    assert torch.equal(matrix.grad, windowed(earlier, [g for g, _ in grads], 4))
    assert torch.equal(vector.grad, sum(v.float() for _, v in grads).bfloat16())
    assert sums.host_bytes == (3 * 5 * 4 + 2 * 4 * 2 if sums.flushes else 0)


@pytest.mark.parametrize("accumulating", [True, False])
def test_host_sums_through_the_mirror_are_those_through_the_slabs(monkeypatch, accumulating):
    """The page-locked mirror (a GPU's choice when host memory has room; asked for here): the flushes' adds run on
    the worker thread into the same float32 sums — the same bits as through the slabs — and the mirror holds one
    16-bit copy of the matrices; an add that fails is raised at the next flush or when the sweep ends."""
    threads = set()
    add_staged = grads._add_staged

    def watched(event, jobs):
        threads.add(threading.current_thread().name)
        return add_staged(event, jobs)

    monkeypatch.setattr(grads, "_add_staged", watched)
    shapes = [(3, 5), (2, 2)]
    earlier = [g[0] for g in (chunk_gradients(1, s, 9 + i) for i, s in enumerate(shapes))]
    chunks = list(zip(*(chunk_gradients(10, s, i) for i, s in enumerate(shapes))))
    got = {}
    for mirror in (False, True):
        matrices = [torch.nn.Parameter(torch.zeros(s, dtype=torch.bfloat16)) for s in shapes]
        for m, g in zip(matrices, earlier):
            m.grad = g.clone() if accumulating else None
        sums = HostGradSums(every=4, slab=4, mirror=mirror)
        host_sweep(sums, matrices, chunks)
        got[mirror] = [m.grad for m in matrices]
        assert sums.host_bytes == (4 + 2 * mirror) * 19 + (not mirror) * 2 * 4 * 2
    assert all(torch.equal(a, b) for a, b in zip(got[False], got[True], strict=True))
    for i, g in enumerate(got[True]):
        assert torch.equal(g, windowed(earlier[i] if accumulating else None, [c[i] for c in chunks], 4))
    assert any(name.startswith("oomb-host-sums") for name in threads)

    def failing(event, jobs):
        raise RuntimeError("the host add failed")

    monkeypatch.setattr(grads, "_add_staged", failing)
    with pytest.raises(RuntimeError, match="the host add failed"):
        host_sweep(HostGradSums(every=4, slab=4, mirror=True), matrices, chunks)


def test_host_sums_keep_an_earlier_micro_batch_out_of_the_bf16_window():
    """An earlier ``.grad`` of 256 plus 4 chunks of 1 (one window, no flush of its own): bf16 would round every +1
    back to 256; the earlier sum waits in float32 in host memory, the window sums 4 exactly: 260, rounded once."""
    p = torch.nn.Parameter(torch.ones(2, 3, dtype=torch.bfloat16))
    p.grad = torch.full((2, 3), 256.0, dtype=torch.bfloat16)
    host_sweep(HostGradSums(every=16, slab=4), [p], [[torch.ones(2, 3, dtype=torch.bfloat16)]] * 4)
    assert torch.equal(p.grad, torch.full((2, 3), 260.0, dtype=torch.bfloat16))


def test_host_sums_start_fresh_each_step():
    """A second step reuses the host sums' memory, not their values; a matrix without gradients in it keeps none."""
    used, idle = (torch.nn.Parameter(torch.zeros(2, 3, dtype=torch.bfloat16)) for _ in range(2))
    sums = HostGradSums(every=2, slab=4)
    host_sweep(sums, [used, idle], [chunk_gradients(2, (2, 3), k) for k in range(5)])
    used.grad = idle.grad = None  # the optimizer step's zero_grad
    second = chunk_gradients(5, (2, 3), 7)
    host_sweep(sums, [used], [[g] for g in second])
    assert torch.equal(used.grad, windowed(None, second, 2)) and idle.grad is None
    assert set(sums._host) == {id(used)}  # the idle matrix's host sum was freed


def test_host_sums_follow_a_new_mirror_choice():
    """The strategies set ``mirror`` from each memory plan: a choice other than the layout's lays the host memory
    out anew (with a mirror or two slabs), and the sums are the same."""
    p = torch.nn.Parameter(torch.zeros(3, 5, dtype=torch.bfloat16))
    chunks = [[g] for g in chunk_gradients(5, (3, 5), 3)]
    sums = HostGradSums(every=2, slab=4, mirror=False)
    host_sweep(sums, [p], chunks)
    want = p.grad
    for mirror in (True, False):
        p.grad, sums.mirror = None, mirror
        host_sweep(sums, [p], chunks)
        assert bool(sums._mirror) == mirror and torch.equal(p.grad, want)
        assert sums.host_bytes == (6 * 15 if mirror else 4 * 15 + 2 * 4 * 2)


@pytest.mark.parametrize("accumulation", ["float32", "native"])
def test_host_sums_in_the_engine(accumulation):
    """8 chunks, flushed every 2: the vectors' gradients are those of the float32 sums bit for bit; a sweep of one
    window (4 chunks, the default 16 per window) gives the matrices autograd's own bits."""
    ids = torch.randint(0, 97, (1, 64), generator=torch.Generator().manual_seed(2))
    runs = {}
    for mode, chunk, every in ((accumulation, 8, 16), ("float32-host", 8, 2), ("float32-host", 16, 16)):
        model = build_causal_lm("qwen2", dtype=torch.bfloat16)
        engine = OOMBEngine(HFChunkModel(model), OOMBConfig(chunk, 8, grad_accumulation=mode))
        engine.host_grads.every = every
        engine.loss(ids).backward()
        runs[mode, chunk] = grads_of(model), dict(model.named_parameters())
    (want, params), (flushed, _), (one_window, _) = runs.values()
    if accumulation == "float32":
        vectors = [n for n, p in params.items() if p.dim() == 1]
        assert vectors and all(torch.equal(flushed[n], want[n]) for n in vectors)
    else:
        matrices = [n for n, p in params.items() if p.dim() == 2]
        four_chunks = step_grads(torch.bfloat16, accumulation="native")
        assert all(torch.equal(one_window[n], four_chunks[n]) for n in matrices)


@pytest.mark.parametrize("mirror", [False, True])
def test_host_sums_of_single_chunk_windows_equal_the_device_sums(mirror):
    """Flushed after every chunk, the host's float32 sum adds the same bf16 chunk gradients in the same order as
    Float32GradSums: the same bits for every parameter (the LM head's too: one loss block per chunk, whose bf16
    product both add in float32), through the slabs or the mirror. Slabs of 100 elements: the staging pipeline (and
    the final merge) runs over many."""
    ids = torch.randint(0, 97, (1, 64), generator=torch.Generator().manual_seed(3))
    runs = []
    for mode in ("float32", "float32-host"):
        model = build_causal_lm("qwen2", dtype=torch.bfloat16, tie_word_embeddings=False)
        engine = OOMBEngine(HFChunkModel(model), OOMBConfig(8, 8, grad_accumulation=mode))
        engine.host_grads.every, engine.host_grads.slab, engine.host_grads.mirror = 1, 100, mirror
        engine.loss(ids).backward()
        runs.append(grads_of(model))
    assert engine.host_grads.flushes == 8
    device, host = runs
    assert all(torch.equal(host[n], device[n]) for n in device)


def auto_step(
    accumulation: str, seq_len: int, earlier: str | None
) -> tuple[dict[str, torch.Tensor], OOMBEngine]:
    """A bf16 step of chunks of 16 tokens; every ``.grad`` holds ``earlier``: ``None``, ``"sum"`` (an earlier
    micro-batch's) or ``"zeros"`` (``zero_grad(set_to_none=False)``)."""
    ids = torch.randint(0, 97, (1, seq_len), generator=torch.Generator().manual_seed(4))
    model = build_causal_lm("qwen2", dtype=torch.bfloat16)
    gen = torch.Generator().manual_seed(5)
    for p in model.parameters():
        p.grad = None if earlier is None else torch.randn(p.shape, generator=gen).bfloat16()
        if earlier == "zeros":
            p.grad.zero_()
    engine = OOMBEngine(HFChunkModel(model), OOMBConfig(16, 8, grad_accumulation=accumulation))
    engine.loss(ids).backward()
    return grads_of(model), engine


@pytest.mark.parametrize(
    ("seq_len", "earlier", "like"),
    [
        (64, None, "float32-host"),
        (64, "zeros", "float32-host"),
        (64, "sum", "float32"),
        (272, None, "float32"),
    ],
)
def test_undecided_auto_sums_on_the_host_only_where_that_is_free(seq_len, earlier, like):
    """``auto`` with no memory plan to decide it: a step of one window of chunks (4) with no earlier sum in ``.grad``
    (none, or zeros) sums as float32-host (the matrices' ``.grad`` as autograd's own, no host memory); one with an
    earlier micro-batch's ``.grad`` or more chunks than a window (17) as float32 — bit for bit the named mode (the
    two differ here)."""
    (got, engine), (want, _) = auto_step("auto", seq_len, earlier), auto_step(like, seq_len, earlier)
    assert all(torch.equal(got[n], want[n]) for n in want)
    assert engine.host_grads.host_bytes == 0
    other = "float32" if like == "float32-host" else "float32-host"
    assert not all(torch.equal(got[n], g) for n, g in auto_step(other, seq_len, earlier)[0].items())


def test_zero_grads_do_not_flush_to_the_host():
    """``zero_grad(set_to_none=False)`` before a float32-host step of one window: nothing goes to the host (the zeros
    are dropped, not kept apart as an earlier micro-batch's sum), and the gradients are those of a step without."""
    (zeros, engine), (none, _) = auto_step("float32-host", 64, "zeros"), auto_step("float32-host", 64, None)
    assert engine.host_grads.flushes == 0 and engine.host_grads.host_bytes == 0
    assert all(torch.equal(zeros[n], none[n]) for n in none)


@pytest.mark.parametrize("accumulation", ["float32", "float32-host", "native"])
def test_a_zero_grad_the_step_adds_nothing_to_stays_zero(accumulation):
    """``zero_grad(set_to_none=False)``, then a step in which a trainable parameter gets no gradient: its ``.grad``
    stays the zeros autograd leaves (``None`` would make the optimizer skip it: no weight decay, no momentum)."""
    model = build_causal_lm("qwen2", dtype=torch.bfloat16)
    model.register_parameter("unused", torch.nn.Parameter(torch.ones(3, 4, dtype=torch.bfloat16)))
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    engine = OOMBEngine(HFChunkModel(model), OOMBConfig(16, 8, grad_accumulation=accumulation))
    engine.loss(torch.randint(0, 97, (1, 64), generator=torch.Generator().manual_seed(6))).backward()
    assert model.unused.grad is not None and not model.unused.grad.any()
    assert model.lm_head.weight.grad.any()


@pytest.mark.parametrize("mirror", [False, True])
def test_host_flush_pipeline_waits_for_each_copy(monkeypatch, mirror):
    """On CUDA the staging copies run asynchronously. Here every non-blocking copy is held back until an event
    recorded after it is waited for (the latest a GPU could run it): the sums stay exact, so each add and each
    reuse of a slab waits for the copy it needs, across matrices smaller and larger than a slab (4 elements); with
    the mirror the worker thread's adds wait for the copies into it."""
    queue, done = [], [0]
    copy = torch.Tensor.copy_

    def lagging(self, src, non_blocking=False):
        if not non_blocking:
            return copy(self, src)
        queue.append((self, src))
        return self

    def run_until(event):
        while event is not None and done[0] < event:
            dst, src = queue[done[0]]
            copy(dst, src)
            done[0] += 1

    monkeypatch.setattr(torch.Tensor, "copy_", lagging)
    monkeypatch.setattr(grads, "_record", lambda device: len(queue))
    monkeypatch.setattr(grads, "_wait", run_until)
    shapes = [(1, 3), (7, 1), (2, 2)]
    matrices = [torch.nn.Parameter(torch.zeros(s, dtype=torch.bfloat16)) for s in shapes]
    chunks = list(zip(*(chunk_gradients(5, s, seed) for seed, s in enumerate(shapes))))
    host_sweep(HostGradSums(every=1, slab=4, mirror=mirror), matrices, chunks)
    assert queue and done[0] == len(queue)
    for i, m in enumerate(matrices):
        assert torch.equal(m.grad, windowed(None, [c[i] for c in chunks], 1)), shapes[i]


def test_zero_grads_are_not_held_while_the_sweep_makes_the_new_ones():
    """``zero_grad(set_to_none=False)`` leaves zeros in every ``.grad``: the backward sweep drops them before it makes
    the new gradients (it held them to the end of the sweep: a bf16-true step held its gradients twice)."""
    ids = torch.randint(0, 97, (1, 64), generator=torch.Generator().manual_seed(7))
    peaks = {}
    for earlier in (None, "zeros"):
        model = build_causal_lm("qwen2", dtype=torch.bfloat16)
        engine = OOMBEngine(HFChunkModel(model), OOMBConfig(16, 8, grad_accumulation="native"))
        with LiveBytes(list(model.parameters())) as live:
            for p in model.parameters():
                p.grad = None if earlier is None else torch.zeros_like(p)
            engine.loss(ids).backward()
        peaks[earlier] = live.peak
    gradients = sum(p.numel() * p.element_size() for p in model.parameters())
    assert peaks["zeros"] - peaks[None] < gradients / 4, (peaks, gradients)
