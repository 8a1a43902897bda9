"""The step FLOP and copy model (engine/step_time.py): matmul FLOPs equal what torch's FLOP counter counts in a CPU
step, visible pairs equal a brute-force mask, copies bound the offload traffic an engine counts, and the planner
predicts a step's time only at measured rates."""

from __future__ import annotations

import math

import pytest
import torch
from torch.utils._python_dispatch import _disable_current_modes
from torch.utils.flop_counter import FlopCounterMode, mm_flop

from lightning_oomb.engine import OOMBConfig, OOMBEngine, attention
from lightning_oomb.engine.memory import HOST_RESERVE_BYTES
from lightning_oomb.engine.model_shape import model_shape
from lightning_oomb.engine.planner import Machine, plan
from lightning_oomb.engine.step_time import StepRates, _pairs, context_seconds, copy_bytes, step_flops
from lightning_oomb.integrations.hf import HFChunkModel
from tests.helpers.models import build_causal_lm

SEQ = 96


def _uncounted(fn):
    def wrapped(*args, **kwargs):
        with _disable_current_modes():  # the attention's own FLOPs: counted by _pairs, not here
            return fn(*args, **kwargs)

    return wrapped


@pytest.mark.parametrize("tile", [None, 16])
@pytest.mark.parametrize("checkpointing", [False, True])
def test_matmul_flops_are_what_a_step_computes(monkeypatch, checkpointing, tile):
    """Every matmul of a step (layers, LM head and its in-place weight gradient) counted by torch's FLOP counter,
    attention aside: exactly the model's count — with checkpointing the recompute stops before the down projection,
    a tiled MLP runs once more."""
    monkeypatch.setattr(attention, "attend", _uncounted(attention.attend))
    monkeypatch.setattr(attention, "attend_backward", _uncounted(attention.attend_backward))
    model = build_causal_lm("qwen2", dtype=torch.float32)
    config = OOMBConfig(32, 8, layer_checkpointing=checkpointing, mlp_tile=tile, attention_backend="torch")
    engine = OOMBEngine(HFChunkModel(model, layer_checkpointing=checkpointing), config)
    ids = torch.randint(0, 97, (2, SEQ), generator=torch.Generator().manual_seed(0))
    in_place = {
        torch.ops.aten.addmm_: lambda _, a, b, **__: mm_flop(a, b)
    }  # the counter knows addmm, not addmm_
    with FlopCounterMode(display=False, custom_mapping=in_place) as counter:
        engine.loss(ids).backward()
    dense, _ = step_flops(model_shape(model), SEQ, config, batch=2)
    # RoPE's angles are no layer matmul (transformers 5.17 makes them by a batched outer product, aten.bmm; later
    # versions without a product the counter counts)
    rope = sum(
        sum(ops.values()) for name, ops in counter.get_flop_counts().items() if name.endswith("rotary_emb")
    )
    assert counter.get_total_flops() - rope == dense


@pytest.mark.parametrize(("seq_len", "chunk", "window", "cap"), [
    (96, 32, None, math.inf), (100, 32, 11, math.inf), (100, 32, None, 16), (96, 32, 40, 16), (30, 32, 5, math.inf),
])  # fmt: skip
def test_visible_pairs_are_the_mask_count(seq_len, chunk, window, cap):
    """Pairs a query sees: causal, within its window, at most ``cap`` keys before its chunk (a sparse budget's
    bound) — the count of a brute-force mask."""
    mask = visible(seq_len, chunk, window, cap)
    assert _pairs(seq_len, chunk, window, cap, first_again=1) == (
        float(mask.sum()),
        float(mask[:chunk].sum()),
    )


def test_visible_pairs_on_random_shapes():
    """The closed form per chunk against the mask on random lengths, chunks, windows and budgets."""
    draw = torch.Generator().manual_seed(7)

    def up_to(n: int) -> int:
        return int(torch.randint(1, n + 1, (), generator=draw))

    for _ in range(60):
        seq_len, chunk, again = up_to(200), up_to(64), up_to(5) - 1
        window = None if up_to(3) == 1 else up_to(90)
        cap = math.inf if up_to(3) == 1 else up_to(70) - 1
        mask = visible(seq_len, chunk, window, cap)
        assert _pairs(seq_len, chunk, window, cap, first_again=again) == (
            float(mask.sum()), float(mask[: again * chunk].sum())
        ), (seq_len, chunk, window, cap, again)  # fmt: skip


def visible(seq_len: int, chunk: int, window: int | None, cap: float) -> torch.Tensor:
    """The ``[query, key]`` mask of what a query sees: causal, within ``window``, at most ``cap`` keys before its
    chunk."""
    q, k = torch.arange(seq_len)[:, None], torch.arange(seq_len)[None]
    mask = k <= q
    if window is not None:
        mask &= k > q - window
    chunk_start = q // chunk * chunk
    past = mask & (k < chunk_start)
    rank = past.flip(-1).cumsum(-1).flip(-1)  # 1 for the last key before the chunk, 2 for the one before...
    return mask & (~past | (rank <= cap))


def test_flops_of_the_reference_and_of_sparse_and_reused_steps():
    """The reference (checkpointed full-sequence training) runs layers 2 forwards + backward, the head 1 + backward,
    and attends twice forward; OOMB's reused chunks attend once forward."""
    shape = model_shape(build_causal_lm("qwen2"))
    h, d, heads, layers = shape.hidden_size, shape.head_dim, shape.num_heads, shape.num_layers
    config = OOMBConfig(32, 8, layer_checkpointing=True)
    dense, attn = step_flops(shape, SEQ, config, reference=True)
    layer = shape.attention_params * 4 + 3 * h * shape.mlp_width * 4 - h * shape.mlp_width
    assert dense == 2 * SEQ * (layers * layer + shape.vocab_size * h * 3)
    pairs = SEQ * (SEQ + 1) / 2
    assert attn == 4 * d * heads * layers * pairs * 4.5
    _, oomb = step_flops(shape, SEQ, OOMBConfig(32, 8, reuse_attention=1))
    last = 32 * 33 / 2 + 32 * 64  # the last chunk's pairs: its forward result is reused
    assert oomb == 4 * d * heads * layers * (pairs * 4.5 - last)


@pytest.mark.parametrize("reuse", [False, True])
@pytest.mark.parametrize("budget", [None, 2])
def test_copies_bound_the_offload_traffic_counted(reuse, budget):
    """The bytes an offloaded step moves (every layer on the host): the engine's counted traffic is at most the
    model's and, dense, within 3 % of it (the staging cache keeps some blocks); sparse within 15 % (selections of
    a chunk's query blocks overlap)."""
    model = build_causal_lm("qwen2", dtype=torch.float32, num_hidden_layers=4)
    config = OOMBConfig(32, 8, offload=True, hbm_budget=0, staging_buffers=3, reuse_attention=reuse,
                        page_budget=budget)  # fmt: skip
    engine = OOMBEngine(HFChunkModel(model), config)
    engine.loss(torch.randint(0, 97, (2, 256), generator=torch.Generator().manual_seed(1))).backward()
    stats, shape = engine.pool.stats(), engine.pool.shape
    counted = stats["h2d_bytes"] + stats["d2h_bytes"]
    kv, grad = (shape.page_bytes(part) / shape.page_size for part in ("kv", "grad"))
    predicted = copy_bytes(256, config, stats["host_layers"], kv, grad)
    assert (0.97 if budget is None else 0.85) * predicted <= counted <= predicted


def test_the_plan_predicts_a_step_time_only_at_measured_rates():
    model = build_causal_lm("qwen2", dtype=torch.float32)
    config = OOMBConfig(32, 8)
    assert plan(model, SEQ, 2, config, "32-true", None, Machine("cpu", 1 << 40, 1 << 40)).step_time_s is None
    rates = StepRates(dense_flops=1e9, attention_flops=5e8, copy_bytes=1e9)
    planned = plan(model, SEQ, 2, config, "32-true", None, Machine("cpu", 1 << 40, 1 << 40, rates=rates))
    dense, attn = step_flops(model_shape(model), SEQ, config, batch=2)
    assert planned.step_time_s == pytest.approx(dense / 1e9 + attn / 5e8)
    assert "step" in planned.summary()


def test_host_gradient_sums_count_their_flushes_in_the_step_time():
    """``float32-host`` stops the compute for its flushes: 40 chunks in windows of 16 flush twice while chunks follow
    (each: 2 bytes per 16-bit matrix element copied out, and without the mirror 10 of host adds) and merge the sums
    on the device at the end (4 bytes copied in), so the planned time grows by the copies' time or the host adds',
    whichever is longer; with the page-locked mirror (a GPU with host memory to spare) the adds run beside the
    compute; 16 chunks flush nothing."""
    model = build_causal_lm("qwen2", dtype=torch.bfloat16)
    matrices = sum(p.numel() for p in model.parameters() if p.dim() >= 2)
    copies_bound = StepRates(1e30, 1e30, copy_bytes=1e6, host_bytes=1e9)
    adds_bound = StepRates(1e30, 1e30, copy_bytes=1e9, host_bytes=1e6)
    no_mirror = HOST_RESERVE_BYTES + 4 * matrices + 1  # room for the sums, not for their mirror
    for rates, host, chunks, want in ((copies_bound, 1 << 40, 40, matrices * (2 * 2 + 4) / 1e6),
                                      (adds_bound, no_mirror, 40, matrices * 10 * 2 / 1e6),
                                      (adds_bound, 1 << 40, 40, matrices * (2 * 2 + 4) / 1e9),
                                      (adds_bound, no_mirror, 16, 0.0)):  # fmt: skip
        plans = [
            plan(model, 8 * chunks, 1, OOMBConfig(8, 8, grad_accumulation=way), "bf16-true", None,
                 Machine("cuda", 1 << 40, host, rates=rates))
            for way in ("native", "float32-host")
        ]  # fmt: skip
        assert plans[1].step_time_s - plans[0].step_time_s == pytest.approx(want, abs=1e-9)
        mirror = plans[1].host_parts["grad_staging"] == 2 * matrices
        assert mirror == (host > no_mirror and chunks > 16)


def test_kept_attention_results_count_in_the_copies_and_a_copy_bound_step_keeps_none():
    """``reuse_attention``'s kept results go to host memory in the forward sweep and back in the backward: the
    planned copies are twice their bytes (no offload here: nothing else is copied); ``"auto"`` keeps every chunk's
    where the link is fast, none where those copies would take longer than the attention they save."""
    model = build_causal_lm("qwen2", dtype=torch.bfloat16, num_hidden_layers=2, head_dim=16)
    copies_only = Machine("cuda", 1 << 40, 1 << 40, rates=StepRates(1e30, 1e30, copy_bytes=1e6))
    kept = plan(model, SEQ, 2, OOMBConfig(32, 8, reuse_attention=True), "bf16-true", None, copies_only)
    assert kept.host_parts["reused_attention"] > 0
    assert kept.step_time_s == pytest.approx(2 * kept.host_parts["reused_attention"] / 1e6)
    decided = []
    for link in (1e15, 1e3):  # bytes/s
        machine = Machine("cuda", 1 << 40, 1 << 40, rates=StepRates(1e9, 5e8, copy_bytes=link))
        auto = OOMBConfig(32, 8, reuse_attention="auto", layer_checkpointing=False)
        decided.append(plan(model, SEQ, 2, auto, "bf16-true", None, machine).config.reuse_attention)
    assert decided == [SEQ // 32, False]


def test_parked_chunks_count_in_the_copies():
    """Offload with layer checkpointing on a GPU parks each chunk's kept attention results and layer inputs in host
    memory, out and back: the planned copies grow by twice those bytes per chunk (the bytes a CPU run parks when
    forced: tests/engine/test_offload.py), and a copy-bound step takes that much longer."""
    from lightning_oomb.engine.planner import parked_bytes, precision_dtypes

    model = build_causal_lm("qwen2", dtype=torch.bfloat16, num_hidden_layers=2, head_dim=16)  # pages unpadded
    config = OOMBConfig(32, 8, offload=True, hbm_budget=0, layer_checkpointing=True)
    rates = StepRates(dense_flops=1e30, attention_flops=1e30, copy_bytes=1e6)  # copies only
    times = {
        kind: plan(
            model, SEQ, 2, config, "bf16-true", None, Machine(kind, 1 << 40, 1 << 40, rates=rates)
        ).step_time_s
        for kind in ("cpu", "cuda")
    }
    parked = parked_bytes(model_shape(model), precision_dtypes("bf16-true"), 2 * 32)
    assert parked > 0
    assert times["cuda"] - times["cpu"] == pytest.approx(2 * (SEQ // 32) * parked / 1e6)


@pytest.mark.parametrize("layout", ["AMAM", "AAMM"])
def test_mlp_only_blocks_count_no_attention_projections(monkeypatch, layout):
    """A ChunkModel with MLP-only blocks (``tests/engine/test_planner_custom.py``'s): a step's matmul FLOPs, counted
    by torch's FLOP counter, are exactly the model's — attention projections only for the blocks that attend (they
    were counted for every block: 23 % more here)."""
    from tests.engine.test_planner_custom import BlocksLM

    monkeypatch.setattr(attention, "attend", _uncounted(attention.attend))
    monkeypatch.setattr(attention, "attend_backward", _uncounted(attention.attend_backward))
    model = BlocksLM(layout)
    config = OOMBConfig(32, 8, attention_backend="torch")
    engine = OOMBEngine(model, config)
    ids = torch.randint(0, 97, (2, SEQ), generator=torch.Generator().manual_seed(0))
    in_place = {torch.ops.aten.addmm_: lambda _, a, b, **__: mm_flop(a, b)}
    with FlopCounterMode(display=False, custom_mapping=in_place) as counter:
        engine.loss(ids).backward()
    shape = model_shape(model)
    assert (shape.mixing_layers, shape.mlps, shape.num_layers) == (2, 4, 4)
    assert counter.get_total_flops() == step_flops(shape, SEQ, config, batch=2)[0]


def test_a_context_parallel_plan_divides_the_compute_and_adds_the_collectives():
    """Under context parallelism a rank computes 1/devices of the step and then waits on the collectives — their
    bytes as the engine counts them (``benchmarks/cp_model.py`` checks the formula against a 2-rank run) at the
    link's rate, and the gradients' all-reduce: over a fast link 2 ranks take less than one, over a slow one more."""
    model = build_causal_lm("qwen2", dtype=torch.float32)
    config = OOMBConfig(32, 8)
    shape = model_shape(model)
    dense, attn = step_flops(shape, SEQ, config, batch=2)
    for link, faster in ((1e15, True), (1e3, False)):
        rates = StepRates(1e9, 5e8, 1e9, link_bytes=link, link_latency_s=0.0)
        machine = Machine("cpu", 1 << 40, 1 << 40, rates=rates)
        alone = plan(model, SEQ, 2, config, "32-true", None, machine)
        shared = plan(model, SEQ, 2, config, "32-true", None, machine, context_parallel=2)
        waits = context_seconds(shape, SEQ, config, 2, 2, rates, 4, 4, shared.device["gradients"])
        assert waits > 0 and shared.step_time_s == pytest.approx((dense / 1e9 + attn / 5e8) / 2 + waits)
        assert (shared.step_time_s < alone.step_time_s) is faster
        # 4 micro-batches an optimizer step: each carries a quarter of the one all-reduce (half the bytes each way)
        quarter = plan(
            model, SEQ, 2, config, "32-true", None, machine, context_parallel=2, accumulate_grad_batches=4
        )
        saved = shared.step_time_s - quarter.step_time_s
        assert saved == pytest.approx(3 / 4 * shared.device["gradients"] / link)


def test_the_window_tails_in_host_memory_count_out_and_back():
    """Window layers' tails in host memory (every layer a window layer, every tail group hosted): each group goes
    out once and comes back once — but the two the forward sweep leaves on the device: the model's count is an upper
    bound within one chunk's pair of groups of the engine's."""
    model = build_causal_lm("mistral", dtype=torch.float32, num_hidden_layers=2)
    config = OOMBConfig(32, 8, offload=True, hbm_budget=0, staging_buffers=3)
    engine = OOMBEngine(HFChunkModel(model), config)
    engine.loss(torch.randint(0, 97, (2, 256), generator=torch.Generator().manual_seed(1))).backward()
    stats, shape = engine.pool.stats(), engine.pool.shape
    assert shape.hosted_tails == (0, 1) and stats["host_layers"] == 0
    predicted = copy_bytes(256, config, 0, 0.0, 0.0, tails=shape.tail_host_bytes)
    counted = stats["h2d_bytes"] + stats["d2h_bytes"]
    groups = shape.num_blocks - 1  # 7, of which 2 stay
    assert counted == predicted * (2 * groups - 2) / (2 * groups)
