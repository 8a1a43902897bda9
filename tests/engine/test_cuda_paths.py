"""The CUDA-only code of the host-memory features — side streams, events, page-locked buffers — on a GPU: skipped
without CUDA (the CPU suite runs the same logic synchronously); `benchmarks/run_gpu.sh` runs it (part `checks`).
Each check compares with the same step without the feature, on the same GPU."""

from __future__ import annotations

import functools
import random

import pytest
import torch

from lightning_oomb.engine import OOMBConfig, OOMBEngine, parking
from lightning_oomb.engine.offload import delaying_transport
from lightning_oomb.integrations.hf import HFChunkModel
from tests.helpers.models import build_causal_lm, grads_of, max_relative_error

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA only")
SEQ = 300  # 10 chunks of 32 tokens, the last ragged


def step(dtype, transport=None, mirror=None, page=16, family="qwen2", **options):
    """Loss and gradients of one OOMB step of a tiny Qwen2 (or ``family``) on the GPU (torch reference attention:
    deterministic; ``mirror``: float32-host's staging, see ``HostGradSums``; chunks of 32 tokens in pages of
    ``page``)."""
    model = build_causal_lm(family, dtype=dtype, tie_word_embeddings=False).cuda()
    ids = torch.randint(0, 97, (2, SEQ), generator=torch.Generator().manual_seed(0)).cuda()
    extra = {} if transport is None else {"transport": transport}
    engine = OOMBEngine(HFChunkModel(model, layer_checkpointing=options.get("layer_checkpointing", False)),
                        OOMBConfig(32, page, attention_backend="torch", **options), **extra)  # fmt: skip
    if options.get("grad_accumulation") == "float32-host":
        engine.host_grads.every, engine.host_grads.slab = 1, 1000  # a flush per chunk, many slabs per matrix
        engine.host_grads.mirror = mirror
    loss = engine.loss(ids)
    loss.backward()
    torch.cuda.synchronize()
    return loss.item(), grads_of(model), engine


@pytest.mark.parametrize("extra", [{}, {"offload": True, "hbm_budget": 0, "layer_checkpointing": True}])
def test_reused_results_come_back_through_the_side_stream(extra):
    """Results copied out on the side stream in the forward sweep and back in the backward's recompute: the
    step's loss and gradients are those of the step that attends again."""
    want_loss, want, _ = step(torch.float32, **extra)
    loss, got, engine = step(torch.float32, reuse_attention=True, **extra)
    assert engine.results.nbytes > 0
    assert abs(loss - want_loss) <= 1e-6 * abs(want_loss)
    assert max_relative_error(got, want) <= 1e-5


@pytest.mark.parametrize("mirror", [False, True])
def test_host_sums_through_the_staging_slabs_or_the_mirror(mirror):
    """A flush per chunk: the host's float32 sums equal the device's float32 sums (the same bf16 chunk gradients
    added in the same order) after the copies out — through the page-locked slabs, or into the page-locked mirror
    that the worker thread adds while the GPU computes on — and the merge on the GPU at the end."""
    _, want, _ = step(torch.bfloat16, grad_accumulation="float32")
    _, got, engine = step(torch.bfloat16, mirror=mirror, grad_accumulation="float32-host")
    assert engine.host_grads.flushes == 10
    sums = engine.host_grads
    assert bool(sums._mirror) == mirror and sums._unpin is not None  # page-locked with cudaHostRegister
    assert max_relative_error(got, want) <= 1e-3  # bf16 ulp is 4e-3: equal up to the chunks' own rounding


@pytest.mark.parametrize(("seed", "checkpointing", "buffers"), [(0, False, 3), (1, True, 3), (2, True, 9)])
def test_offloaded_pages_with_delayed_copies_equal_pages_on_the_device(
    monkeypatch, seed, checkpointing, buffers
):
    """Every layer's pages in page-locked host memory, streamed on the side streams through 3 staging buffers (one
    block a kernel call) or 9 (4 blocks a call, what "auto" takes for small blocks), each copy and each compute wait delayed by up to 200K
    GPU cycles (a missing event wait shows as wrong numbers); with layer checkpointing the recompute's attention
    results and saved activations (every size) are parked in host memory on their side stream too, each copy
    delayed likewise: the step equals the one whose pages stay on the device."""
    monkeypatch.setattr(parking, "MIN_BYTES", 1)
    copy_aside, gen = parking.copy_aside, random.Random(seed)

    def late_copies(device, pairs):  # each parking copy starts up to 200K GPU cycles late
        with torch.cuda.stream(parking._parking_stream(device)):
            torch.cuda._sleep(gen.randrange(200_000))
        return copy_aside(device, pairs)

    monkeypatch.setattr(parking, "copy_aside", late_copies)
    ckpt = {"layer_checkpointing": checkpointing}
    want_loss, want, _ = step(torch.float32, **ckpt)
    transport = functools.partial(delaying_transport, seed=seed)
    loss, got, engine = step(
        torch.float32, transport, offload=True, hbm_budget=0, staging_buffers=buffers, **ckpt
    )
    assert engine.pool.stats()["host_layers"] > 0
    assert abs(loss - want_loss) <= 1e-6 * abs(want_loss)
    assert max_relative_error(got, want) <= 1e-5


@pytest.mark.parametrize("delayed", [False, True], ids=["plain", "delayed"])
def test_gathered_sparse_copies_equal_a_copy_per_run(monkeypatch, delayed):
    """``OOMB_OFFLOAD_GATHER=1``: a sparse step's scattered pages move by the page-copy kernel to and from the host
    tier mapped into the GPU (each gather delayed by up to 200K cycles with ``delayed``): the same loss and
    gradients, bit for bit, as the copy per run of pages, in fewer copy calls."""
    options = {
        "offload": True,
        "hbm_budget": 0,
        "page_budget": 2,
        "staging_buffers": 3,
        "page": 4,
    }  # 8 a block
    runs = step(torch.float32, **options)
    monkeypatch.setenv("OOMB_OFFLOAD_GATHER", "1")
    transport = functools.partial(delaying_transport, seed=5) if delayed else None
    gathered = step(torch.float32, transport, **options)
    assert gathered[2].pool._host.mapped
    assert gathered[0] == runs[0] and all(torch.equal(gathered[1][n], runs[1][n]) for n in runs[1])
    assert gathered[2].stats.extra["copy_runs"] < runs[2].stats.extra["copy_runs"]


@pytest.mark.parametrize("seed", [0, 1])
def test_window_tails_in_host_memory_with_delayed_copies_equal_tails_on_the_device(seed):
    """Mistral's window layers with their tails in page-locked host memory (a ring of two tail groups on the
    device), each copy and each compute wait delayed by up to 200K GPU cycles: the step equals the one whose tails
    stay on the device."""
    want_loss, want, _ = step(torch.float32, family="mistral")
    transport = functools.partial(delaying_transport, seed=seed)
    loss, got, engine = step(
        torch.float32, transport, family="mistral", offload=True, hbm_budget=0, staging_buffers=3
    )
    assert engine.pool.shape.hosted_tails and engine.pool.stats()["h2d_bytes"] > 0
    assert abs(loss - want_loss) <= 1e-6 * abs(want_loss)
    assert max_relative_error(got, want) <= 1e-5


def test_latent_pages_on_the_triton_kernels_equal_the_torch_backend():
    """``mla_pages="latent"`` on the GPU's Triton kernels (one KV head of 20 attended by 4 query heads) gives the
    torch backend's step on the same GPU, also with every page offloaded (GLM-4.7-Flash's 576-wide latent: the
    ``latent`` part of ``run_gpu.sh``)."""
    from tests.integrations.test_latent_pages import _ids, _model

    model = _model(dtype=torch.float32).cuda()
    ids = _ids(tokens=160).cuda()
    results = {}
    for backend in ("torch", "triton"):
        for extra in ({}, {"offload": True, "hbm_budget": 0, "staging_buffers": 3}):
            model.zero_grad()
            config = OOMBConfig(32, 16, attention_backend=backend, mla_pages="latent", **extra)
            loss = OOMBEngine(HFChunkModel(model), config).loss(ids)
            loss.backward()
            torch.cuda.synchronize()
            results[backend, bool(extra)] = loss.item(), grads_of(model)
    want_loss, want = results["torch", False]
    for key, (loss, got) in results.items():
        assert abs(loss - want_loss) <= 1e-4 * abs(want_loss), key
        assert max_relative_error(got, want) <= 1e-3, key
