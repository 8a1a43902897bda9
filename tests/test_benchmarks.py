"""The GPU benchmark scripts still run (tiny shapes on CPU), so the one-command GPU run does not rot."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def run(*args: str) -> str:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run(
        [sys.executable, *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


@pytest.mark.slow
def test_memory_scaling_smoke(tmp_path):
    out = tmp_path / "ms.json"
    text = run(
        "benchmarks/memory_scaling.py", "--tiny", "--device", "cpu", "--contexts", "256", "--offload-contexts",
        "256", "--chunk-size", "128", "--out", str(out),
    )  # fmt: skip
    rows = json.loads(out.read_text())
    assert {r["method"] for r in rows} == {"hf", "oomb", "oomb-offload"}
    assert out.with_suffix(".png").exists() and "vs oomb" in text


@pytest.mark.slow
def test_offload_stress_smoke(tmp_path):
    out = tmp_path / "stress.json"
    run("benchmarks/offload_stress.py", "--device", "cpu", "--tiny", "--steps", "1", "--out", str(out))
    report = json.loads(out.read_text())
    assert report["worst_rel_grad_err_delayed_vs_calm"]["host_all_2buf"] == 0.0
    assert max(report["worst_rel_grad_err_vs_no_offload"].values()) <= 1e-10  # float64: merges round only


def test_kernel_benchmark_help():
    assert "FlexAttention" in run("benchmarks/kernels.py", "--help")


@pytest.mark.slow
def test_loss_memory_smoke(tmp_path):
    """The fused loss's counted peak equals its formula and is below the unfused loss's, measured in one run."""
    out = tmp_path / "loss.json"
    run("benchmarks/loss_memory.py", "--vocab", "512", "--hidden", "32", "--tokens", "64", "--block", "16",
        "--repeats", "1", "--out", str(out))  # fmt: skip
    rows = {(r["precision"], r["method"]): r for r in json.loads(out.read_text())["rows"]}
    for precision in ("32-true", "bf16-true", "bf16-mixed"):
        fused, unfused = rows[precision, "fused"], rows[precision, "unfused"]
        assert fused["peak_bytes"] < unfused["peak_bytes"]
        assert 0 <= fused["peak_bytes"] - fused["formula_bytes"] <= 8 * 16 * 32
    assert out.with_suffix(".md").exists()
