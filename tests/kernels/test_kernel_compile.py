"""The shipped default tiles compiled offline (Triton's bundled ptxas, no GPU): for sm_90 no spills (the dK/dV
kernel computing dQ too at its own tile) but a register of the sparse forward's, no MMA rows
computed twice, no load left synchronous in a dense walk's loops, within sm_90's shared
memory (``benchmarks/kernel_compile.py
--quick`` in a subprocess: the suite's process interprets the kernels); for GPUs without wgmma (sm_89, sm_120: 99 KB
per block; sm_80) the shipped tiles are those of the recorded compiles, within their shared memory. And a GPU whose
shared memory a tile does not fit falls back to a smaller one."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _ptxas() -> bool:
    try:
        from triton.backends.nvidia.compiler import get_ptxas

        return Path(get_ptxas(90).path).exists()
    except Exception:
        return False


# spill bytes the sm_90 defaults may have (plain and with a page selection, Triton 3.9): none (dK/dV's 32 x 64 tile
# on 4 warps spilled 0.45-0.5 KB while its walk looped over the query heads outside its three key-range loops), but
# the sparse forward, at 255 registers, one register from its start to its end (SASS: the store in the prologue, the
# load in the epilogue; none on Triton 3.6); the bound catches a change that spills more
SPILL_BOUNDS = {"_fwd_kernel": 8, "_bwd_dq_kernel": 0, "_bwd_dkdv_kernel": 0}
# loads left synchronous in the kernels' loops (kernel_compile.loop_sync_loads): none in a dense walk (the page
# table's entry is copied ahead with the K/V tiles); with a page selection one, in the loops that need the listed
# page's position (the forward's and dQ's masked listed walk, dK/dV's walk over the listing blocks that need a mask),
# two in the dK/dV kernel computing dQ too (its tile's one masked loop at two stages leaves a second one)
LOOP_SYNC_LOADS = {(False, False): 0, (True, False): 1, (False, True): 0, (True, True): 2}


@pytest.mark.slow
@pytest.mark.skipif(not _ptxas(), reason="Triton's NVIDIA backend (ptxas) is not installed")
def test_default_tiles_compile_for_sm90_within_their_spill_bounds(tmp_path):
    from csrc_triton.paged_attention import SM90_FUSED_DQ_DEFAULT

    out = tmp_path / "compile.json"
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
    subprocess.run([sys.executable, str(ROOT / "benchmarks" / "kernel_compile.py"), "--quick", "--out", str(out)],
                   check=True, env=env, cwd=ROOT, capture_output=True, timeout=600)  # fmt: skip
    variants = json.loads(out.read_text())["variants"]
    assert {v["kernel"] for v in variants} == {"_fwd_kernel", "_bwd_dkdv_kernel", "_bwd_dq_kernel"}
    fused = [
        (v["BLOCK_M"], v["BLOCK_N"], v["num_warps"], v["num_stages"]) for v in variants if v.get("FUSED_DQ")
    ]
    assert fused == [SM90_FUSED_DQ_DEFAULT] * 2  # dK/dV with dQ at its own tile, dense and sparse
    for v in variants:
        assert max(v["spill_store_bytes"], v["spill_load_bytes"]) <= SPILL_BOUNDS[v["kernel"]], v
        assert v["mma_rows"] <= v["tile_rows"], v
        assert v["loop_sync_loads"] <= LOOP_SYNC_LOADS[v["SPARSE"], bool(v.get("FUSED_DQ"))], v
        assert v["shared_bytes"] <= 227 * 1024 == v["shared_limit"], v  # per block on H100 / H200


KERNEL_NAMES = {"_fwd_kernel": "forward", "_bwd_dkdv_kernel": "dkdv", "_bwd_dq_kernel": "dq"}


@pytest.mark.parametrize("arch", [89, 120, 80])
def test_the_mma_sync_tiles_are_those_compiled_within_shared_memory(arch):
    """The tiles GPUs without wgmma get are those the recorded offline compile (``benchmarks/kernel_compile.py --arch
    89|120|80 --head-dim 128 256 512``, Triton 3.9) fitted into their shared memory (99 KB per block on sm_89 and
    sm_120, where the sm_90 dQ tile needs 100 KB; 163 KB on sm_80) at every flag, with spills of at most 72 / 280 /
    128 bytes (dK/dV none; its experimental ``FUSED_DQ`` variant up to 0.3 KB): a changed table needs that compile
    again."""
    from csrc_triton.paged_attention import MMA_SYNC_DEFAULTS

    variants = json.loads((ROOT / "benchmarks" / "results" / f"kernel-compile-sm{arch}.json").read_text())[
        "variants"
    ]
    compiled = {(KERNEL_NAMES[v["kernel"]], v["HEAD_DIM"], v["BLOCK_M"], v["BLOCK_N"], v["num_warps"], v["num_stages"])
                for v in variants}  # fmt: skip
    shipped = {
        (kernel, width, *tile) for width, tiles in MMA_SYNC_DEFAULTS.items() for kernel, tile in tiles.items()
    }
    assert compiled == shipped
    assert all(v["shared_bytes"] <= v["shared_limit"] == SHARED_LIMITS[arch] for v in variants)
    spills = {v["kernel"]: 0 for v in variants}
    for v in variants:
        if not v.get("FUSED_DQ"):
            spills[v["kernel"]] = max(spills[v["kernel"]], v["spill_store_bytes"], v["spill_load_bytes"])
    assert spills["_bwd_dkdv_kernel"] == 0 and max(spills.values()) <= {89: 72, 120: 280, 80: 128}[arch], (
        spills
    )
    assert len(variants) == 144  # 3 widths x 3 kernels x their flags (dK/dV with and without FUSED_DQ)


SHARED_LIMITS = {
    89: 99 * 1024,
    120: 99 * 1024,
    80: 163 * 1024,
}  # per block: RTX 40, L4, L40S (sm_86); RTX 50; A100


def test_gpus_without_wgmma_get_their_own_tiles():
    """Hopper and data-centre Blackwell take the sm_90 tiles; A100, RTX 30/40/50, A10, L4, L40S the mma.sync ones
    (benchmarks/results/kernel-compile-sm89.md), by width as the sm_90 ones."""
    from csrc_triton.paged_attention import MMA_SYNC_DEFAULTS, SM90_DEFAULTS, shipped_tile

    for kernel in SM90_DEFAULTS:
        assert shipped_tile(kernel, 128, 90) == shipped_tile(kernel, 128, 100) == SM90_DEFAULTS[kernel]
        for arch in (80, 86, 89, 120):
            assert shipped_tile(kernel, 64, arch) == MMA_SYNC_DEFAULTS[128][kernel]
            assert shipped_tile(kernel, 192, arch) == MMA_SYNC_DEFAULTS[256][kernel]
            assert shipped_tile(kernel, 512, arch) == MMA_SYNC_DEFAULTS[512][kernel]
    assert shipped_tile("dq", 128, 89) != SM90_DEFAULTS["dq"]


def test_only_the_measured_dkdv_tile_splits_its_loop(monkeypatch):
    """dK/dV's shipped sm_90 tile at head_dim 128 runs the fully visible query blocks in a loop of their own (the
    H200 measured it faster); the wide-head and mma.sync tiles keep the one masked loop they were compiled with."""
    from csrc_triton import paged_attention as kernels

    # the GPU's space (the suite's is interpreted)
    monkeypatch.setattr(kernels, "_interpreting", lambda: False)
    prune = kernels._bwd_dkdv_kernel.early_config_prune
    tuner = SimpleNamespace(configs=kernels._configs("dkdv", [(32, 128)], (2,)), early_config_prune=prune)
    for arch, width, split in ((90, 128, True), (90, 256, False), (89, 128, False), (80, 512, False)):
        key = {"ARCH": arch, "HEAD_DIM": width, "PAGE": 128, "SPARSE": False}
        config = kernels.default_config(tuner, key)
        assert config.kwargs["SPLIT"] is split, (arch, width)
        m, _, _, stages = kernels.shipped_tile("dkdv", width, arch)
        assert (config.kwargs["BLOCK_M"], config.num_stages) == (m, stages)
        variants = {c.kwargs["SPLIT"] for c in kernels.tuning_space(tuner, key)[:2]}
        assert variants == {True, False}  # tuning tries both loops at the default tile


def test_the_dkdv_kernel_computing_dq_too_has_its_own_sm90_tile(monkeypatch):
    """With ``FUSED_DQ`` (part of the dK/dV kernel's tuning key) the sm_90 head-dim-128 default is
    :data:`SM90_FUSED_DQ_DEFAULT` with one masked loop (the dK/dV tile spills with dQ's accumulator); other widths
    and GPUs keep their dK/dV tile; a launch remembers the two defaults apart."""
    from csrc_triton import paged_attention as kernels

    monkeypatch.setattr(kernels, "_interpreting", lambda: False)
    prune = kernels._bwd_dkdv_kernel.early_config_prune
    tuner = SimpleNamespace(configs=kernels._configs("dkdv", [(32, 128)], (2,)), early_config_prune=prune)
    key = {"ARCH": 90, "HEAD_DIM": 128, "PAGE": 128, "SPARSE": False}
    fused = kernels.default_config(tuner, {**key, "FUSED_DQ": True})
    tile = (fused.kwargs["BLOCK_M"], fused.kwargs["BLOCK_N"], fused.num_warps, fused.num_stages)
    assert tile == kernels.SM90_FUSED_DQ_DEFAULT and fused.kwargs["SPLIT"] is False
    plain = kernels.default_config(tuner, {**key, "FUSED_DQ": False})
    assert plain.kwargs["BLOCK_N"] == kernels.SM90_DEFAULTS["dkdv"][1] != tile[1]
    for arch, width in ((90, 256), (90, 512), (89, 128), (80, 128)):
        own = kernels.shipped_tile("dkdv", width, arch, fused_dq=True)
        assert own == kernels.shipped_tile("dkdv", width, arch)
    assert "FUSED_DQ" in kernels._bwd_dkdv_kernel.keys

    ran = []
    tuner.cache, tuner.fn = {}, SimpleNamespace(run=lambda *a, grid, warmup, **kw: ran.append(kw["BLOCK_N"]))
    monkeypatch.setattr(kernels, "_device_arch", lambda: 90)
    for flag in (True, False, True):
        kernels._launch(tuner, (1,), HEAD_DIM=128, PAGE=128, SPARSE=False, FUSED_DQ=flag)
    assert ran == [tile[1], plain.kwargs["BLOCK_N"], tile[1]]


def test_a_tile_the_gpu_cannot_load_falls_back_to_a_smaller_one(monkeypatch):
    """Where Triton refuses to load the shipped tile (its shared memory above the GPU's), the launch takes the first
    of ``smaller_configs`` that loads — fewer stages first — and keeps it for the key; if none loads, the first
    refusal is raised."""
    import triton
    from triton.runtime.errors import OutOfResources

    from csrc_triton import paged_attention as kernels

    monkeypatch.setattr(kernels, "_interpreting", lambda: False)
    monkeypatch.setattr(kernels, "_device_arch", lambda: 89)
    tried = []

    def run(*args, grid, warmup, **kwargs):
        tried.append((kwargs["BLOCK_M"], kwargs["BLOCK_N"], kwargs["num_warps"], kwargs["num_stages"]))
        if kwargs["num_stages"] > limit:
            raise OutOfResources(120_000, 101_376, "shared memory")

    prune = kernels._pruner("BLOCK_M", 1, kernel="forward")
    tuner = SimpleNamespace(cache={}, configs=[triton.Config({"BLOCK_M": 128, "BLOCK_N": 64}, num_warps=8,
                            num_stages=3)], early_config_prune=prune, fn=SimpleNamespace(run=run))  # fmt: skip
    call = {"HEAD_DIM": 128, "PAGE": 128, "SPARSE": False}
    limit = 2
    for _ in range(2):
        kernels._launch(tuner, (1,), **call)
    assert tried == [
        (128, 32, 8, 3),
        (128, 32, 8, 2),
        (128, 32, 8, 2),
    ]  # sm_89's tile, 3 stages refused, then kept
    assert [c.num_stages for c in kernels.smaller_configs(tuner.cache[("default", 89, 128, 128, False, False)],
                                                           "BLOCK_M", 128, False)] == [2, 1] * 4  # fmt: skip
    tuner.cache.clear()
    limit = 0
    with pytest.raises(OutOfResources, match="shared memory"):
        kernels._launch(tuner, (1,), **call)


def test_wide_heads_get_their_own_default_tiles():
    """Head dims above 128 spill (or overflow shared memory) at the 128 tiles: each width gets the tiles compiled
    clean for it (benchmarks/results/kernel-compile-sm90-wide.md), a width between two the wider one's."""
    from csrc_triton.paged_attention import SM90_DEFAULTS, SM90_WIDE_DEFAULTS, shipped_tile

    for kernel in SM90_DEFAULTS:
        assert shipped_tile(kernel, 96) == shipped_tile(kernel, 128) == SM90_DEFAULTS[kernel]
        assert shipped_tile(kernel, 192) == shipped_tile(kernel, 256) == SM90_WIDE_DEFAULTS[256][kernel]
        assert shipped_tile(kernel, 512) == shipped_tile(kernel, 1024) == SM90_WIDE_DEFAULTS[512][kernel]
    assert all(tiles["forward"][0] < SM90_DEFAULTS["forward"][0] for tiles in SM90_WIDE_DEFAULTS.values())
