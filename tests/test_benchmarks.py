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
def test_cpu_step_smoke(tmp_path):
    """One tiny case of the CPU step benchmark, in process (timings are recorded, never checked)."""
    from benchmarks.cpu_step import main

    out = tmp_path / "cpu-step.json"
    main(["--cases", "128:128", "--repeats", "1", "--torch-up-to", "128", "--out", str(out)])
    rows = json.loads(out.read_text())["rows"]
    methods = [(r["method"], r["backend"]) for r in rows]
    assert methods == [("hf", "sdpa"), ("oomb", "auto"), ("oomb", "torch")]
    assert "| oomb | 128 | 128 | auto |" in out.with_suffix(".md").read_text()
