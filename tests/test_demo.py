"""README command 1 runs end to end (tiny settings; the full demo is timed by hand, never in tests)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_demo_runs_and_prints_the_report():
    args = ["--seq-len", "1024", "--steps", "2", "--short-steps", "5", "--short-len", "256", "--chunk-size", "256"]  # fmt: skip
    done = subprocess.run(
        [sys.executable, "examples/train_long_context.py", *args],
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    for line in ("throughput", "peak saved activations", "KV pool", "held-out loss", "no-context baseline"):
        assert line in done.stdout


@pytest.mark.parametrize(
    ("args", "match"),
    [
        (["--steps", "0"], "--steps must be at least 1"),
        (["--tokenizer", "bytes"], "--tokenizer reads --text"),
    ],
)
def test_flags_that_cannot_work_are_refused_before_anything_runs(args, match, capsys, monkeypatch):
    """``--steps 0`` ended in a ZeroDivisionError after training; ``--tokenizer`` without ``--text`` was ignored."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("demo", ROOT / "examples" / "train_long_context.py")
    demo = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "demo", demo)  # its dataclasses look their module up
    spec.loader.exec_module(demo)
    with pytest.raises(SystemExit):
        demo.parse_args(args)
    assert match in capsys.readouterr().err
