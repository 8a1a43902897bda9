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


@pytest.fixture
def demo(monkeypatch):
    """The demo script as a module; what its main sets for the process (threads, log level) restored after."""
    import importlib.util
    import logging

    import torch

    spec = importlib.util.spec_from_file_location("demo", ROOT / "examples" / "train_long_context.py")
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "demo", module)  # its dataclasses look their module up
    spec.loader.exec_module(module)
    threads, log = torch.get_num_threads(), logging.getLogger("lightning.pytorch")
    level = log.level
    yield module
    torch.set_num_threads(threads)
    log.setLevel(level)


@pytest.mark.parametrize(
    ("args", "match"),
    [
        (["--steps", "0"], "--steps must be at least 1"),
        (["--lora-rank", "0"], "--lora-rank must be at least 1"),
        (["--tokenizer", "bytes"], "--tokenizer reads --text"),
        (["--val-rows", "2"], "--val-rows splits --text"),
        (["--seq-len", "256"], "--short-len 512 is longer than --seq-len 256"),
        (["--text", "a.txt", "--tokenizer", "bytes", "--val-rows", "-1"], "--val-rows must be at least 0"),
    ],
)
def test_flags_that_cannot_work_are_refused_before_anything_runs(demo, args, match, capsys):
    """``--steps 0`` ended in a ZeroDivisionError after training; ``--tokenizer`` without ``--text`` was ignored."""
    with pytest.raises(SystemExit):
        demo.parse_args(args)
    assert match in capsys.readouterr().err


def test_one_thread_by_default_unless_a_model_trains_on_a_gpu(demo, monkeypatch):
    """``--model`` on the CPU took torch's default (every core: slow on a busy machine), unlike the other modes."""
    text = ["--text", "a.txt", "--tokenizer", "bytes"]
    for args in ([], text, ["--model", "m"], ["--model", "m", *text]):
        assert demo.parse_args(args).threads == 1
    assert demo.parse_args(["--model", "m", "--threads", "3"]).threads == 3
    monkeypatch.setattr(demo.torch.cuda, "is_available", lambda: True)
    assert (
        demo.parse_args(["--model", "m", "--accelerator", "gpu"]).threads is None
    )  # host-side work uses them
    assert demo.parse_args(["--accelerator", "gpu"]).threads == 1  # the tiny model


def test_text_mode_holds_out_rows_and_reports_their_loss(demo, monkeypatch, recwarn):
    """``--text`` held nothing out: no held-out loss, an empty-val-loader warning and "Epoch 0/-2" in the progress
    bar (Lightning's max_epochs=-1). Now the last row is held out and validated once, after the last step."""
    trainers = []
    build = demo.build_trainer
    monkeypatch.setattr(
        demo, "build_trainer", lambda *a, **k: trainers.append(build(*a, **k)) or trainers[-1]
    )
    args = ["--text", str(ROOT / "examples" / "data" / "*.txt"), "--tokenizer", "bytes", "--seq-len", "512"]
    result = demo.main([*args, "--chunk-size", "256", "--steps", "14"])  # 10 training rows: 2 passes
    (trainer,) = trainers
    assert result["val_loss"] is not None and trainer.max_epochs == 2
    assert len(trainer.datamodule.val_set) == 1 and trainer.global_step == 14
    assert not [w for w in recwarn if "val" in str(w.message) or "zero" in str(w.message)]


def test_the_report_counts_the_full_length_steps_also_when_the_warm_up_is_as_long(demo):
    """``--seq-len`` equal to ``--short-len``: the warm-up's batches were counted as full-length steps."""
    result = demo.main(["--seq-len", "256", "--short-len", "256", "--chunk-size", "128", "--steps", "2",
                        "--short-steps", "3"])  # fmt: skip
    assert (result["warmup_steps"], result["full_length_steps"]) == (3, 2)


def test_lora_rank_trains_adapters_on_every_projection(demo):
    """``--lora-rank R``: the module gets rank-R adapters (alpha 2R) on every attention and MLP projection."""
    module = demo.build_model(demo.parse_args(["--lora-rank", "4"]), vocab_size=64)
    module.configure_model()
    trained = {n for n, p in module.named_parameters() if p.requires_grad}
    assert trained and all(".lora_" in n for n in trained) and module.hparams.lora["lora_alpha"] == 8
    assert {n.split(".")[-4] for n in trained} == {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                                                    "down_proj"}  # fmt: skip
