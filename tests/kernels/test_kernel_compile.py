"""The shipped default tiles compiled offline for sm_90 (Triton's bundled ptxas, no GPU): no spills (on Triton 3.9
and on the GPU machine's 3.6), no MMA rows computed twice, within sm_90's shared memory. Runs ``benchmarks/kernel_compile.py --quick`` in a subprocess (the suite's process interprets the
kernels)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _ptxas() -> bool:
    try:
        from triton.backends.nvidia.compiler import get_ptxas

        return Path(get_ptxas(90).path).exists()
    except Exception:
        return False


@pytest.mark.slow
@pytest.mark.skipif(not _ptxas(), reason="Triton's NVIDIA backend (ptxas) is not installed")
def test_default_tiles_compile_for_sm90_without_spills(tmp_path):
    out = tmp_path / "compile.json"
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
    subprocess.run([sys.executable, str(ROOT / "benchmarks" / "kernel_compile.py"), "--quick", "--out", str(out)],
                   check=True, env=env, cwd=ROOT, capture_output=True, timeout=300)  # fmt: skip
    variants = json.loads(out.read_text())["variants"]
    assert {v["kernel"] for v in variants} == {"_fwd_kernel", "_bwd_dkdv_kernel", "_bwd_dq_kernel"}
    for v in variants:
        assert v["spill_store_bytes"] == 0 and v["spill_load_bytes"] == 0, v
        assert v["mma_rows"] <= v["tile_rows"], v
        assert v["shared_bytes"] <= SM90_SHARED_BYTES, v


SM90_SHARED_BYTES = 227 * 1024  # per block on H100 / H200


def test_wide_heads_get_their_own_default_tiles():
    """Head dims above 128 spill (or overflow shared memory) at the 128 tiles: each width gets the tiles compiled
    clean for it (benchmarks/results/kernel-compile-sm90-wide.md), a width between two the wider one's."""
    from csrc_triton.paged_attention import SM90_DEFAULTS, SM90_WIDE_DEFAULTS, shipped_tile

    for kernel in SM90_DEFAULTS:
        assert shipped_tile(kernel, 96) == shipped_tile(kernel, 128) == SM90_DEFAULTS[kernel]
        assert shipped_tile(kernel, 192) == shipped_tile(kernel, 256) == SM90_WIDE_DEFAULTS[256][kernel]
        assert shipped_tile(kernel, 512) == shipped_tile(kernel, 1024) == SM90_WIDE_DEFAULTS[512][kernel]
    assert all(tiles["forward"][0] < SM90_DEFAULTS["forward"][0] for tiles in SM90_WIDE_DEFAULTS.values())
