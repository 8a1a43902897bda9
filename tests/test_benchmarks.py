"""The GPU benchmark scripts still run (tiny shapes on CPU), so the one-command GPU run does not rot."""

from __future__ import annotations

import contextlib
import importlib.machinery
import io
import json
import os
import re
import runpy
import subprocess
import sys
from pathlib import Path
from unittest import mock

import pytest
import torch

from benchmarks.loss_memory import OLD_COMMIT

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "run_gpu.sh"


# a fresh process runs the script as `__main__` after the suite's interpreter speed-ups
FRESH = "import runpy, sys; from tests.helpers.interpreter import speed_up_interpreter; speed_up_interpreter(); " \
        "sys.argv = sys.argv[1:]; runpy.run_path(sys.argv[0], run_name='__main__')"  # fmt: skip


def run(script: str, *args: str, fresh: bool = False) -> str:
    """``python script args``, its printed output. In this process unless ``fresh``: a new process would import
    torch, transformers and Lightning again (5-8 s a script on 2 cores); what a script may change for the process
    (environment variables, torch's default dtype, threads and grad mode) is restored after it."""
    if fresh:
        env = {**os.environ, "PYTHONPATH": str(ROOT)}
        done = subprocess.run([sys.executable, "-c", FRESH, script, *args], cwd=ROOT, env=env, capture_output=True,
                              text=True, timeout=300)  # fmt: skip
        assert done.returncode == 0, done.stderr[-3000:]
        return done.stdout
    dtype, threads, grad = torch.get_default_dtype(), torch.get_num_threads(), torch.is_grad_enabled()
    printed = io.StringIO()
    argv = mock.patch.object(sys, "argv", [script, *args])
    try:
        with mock.patch.dict(os.environ), argv, contextlib.redirect_stdout(printed):
            runpy.run_path(str(ROOT / script), run_name="__main__")
    except SystemExit as exit:
        assert exit.code in (0, None), printed.getvalue()[-3000:]
    finally:
        torch.set_default_dtype(dtype)
        torch.set_num_threads(threads)
        torch.set_grad_enabled(grad)
    return printed.getvalue()


def test_no_script_shadows_an_installed_module():
    """A script's folder comes first on ``sys.path`` when it runs, so a script named like an installed module is
    imported in its place (``benchmarks/kernels.py`` did that to the ``kernels`` package transformers >= 5.25
    imports: every benchmark script failed at ``import transformers``)."""
    folders = [ROOT / "benchmarks", ROOT / "examples"]
    scripts = {path.stem for folder in folders for path in folder.glob("*.py")} - {"__init__"}
    path = [entry for entry in sys.path if Path(entry or ".").resolve() not in folders]  # tests may add them
    found = {name for name in scripts if importlib.machinery.PathFinder.find_spec(name, path) is not None}
    assert not found | (scripts & set(sys.builtin_module_names))


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


def test_kernel_records_name_a_variant_that_did_not_load(monkeypatch):
    """A compiled variant whose binary does not load (shared memory, say) is recorded with the error, not as a
    variant that ran with unknown registers."""
    from types import SimpleNamespace

    from benchmarks import attention_kernels

    class Compiled:
        metadata = SimpleNamespace(num_warps=8, num_stages=3, shared=9)
        n_regs = None  # until loaded

        def __init__(self, fits: bool) -> None:
            self.fits = fits

        def _init_handles(self) -> None:
            if not self.fits:
                raise RuntimeError("out of resource: shared memory, Required: 102404, Hardware limit: 101376")
            self.n_regs, self.n_spills = 128, 0

    monkeypatch.setattr(attention_kernels, "_jit_function", lambda tuner: tuner)
    monkeypatch.setattr(attention_kernels, "_compiled", lambda jit: [Compiled(True), Compiled(False)])
    record = attention_kernels._kernel_record(SimpleNamespace(cache={}))
    loaded, failed = record["compiled"]
    assert loaded["n_regs"] == 128 and "load_error" not in loaded
    assert failed["n_regs"] is None and "Required: 102404" in failed["load_error"]


def test_kernel_benchmark_help():
    assert "FlexAttention" in run("benchmarks/attention_kernels.py", "--help", fresh=True)


@pytest.mark.slow
def test_kernel_benchmark_smoke(tmp_path):
    """Dense and sparse rows (default tiles, then tuned), the sparse accuracy check, ratios and kernel records."""
    out = tmp_path / "kernels.json"
    # a fresh process: the tuned kernels stay out of this one
    text = run("benchmarks/attention_kernels.py", "--smoke", "--methods", "paged,sparse", "--default-tiles",
               "--tune-configs", "2", "--out", str(out), fresh=True)  # fmt: skip
    data = json.loads(out.read_text())
    methods = {r["method"] for r in data["throughput"]}
    assert methods == {"oomb triton (paged)", "oomb triton (paged, sparse)",
                       "oomb triton (paged) at default tiles", "oomb triton (paged, sparse) at default tiles"}  # fmt: skip
    sparse = next(r for r in data["throughput"] if r["method"] == "oomb triton (paged, sparse)")
    assert sparse["attended_keys_per_query"] < next(r for r in data["throughput"])["attended_keys_per_query"]
    assert all(e["ok"] for e in data["accuracy"]["errors_vs_fp32"].values())
    assert "dk (sparse)" in data["accuracy"]["errors_vs_fp32"]
    assert data["sparse_over_dense"] and "kernels" in data and data["versions"]["torch"]
    assert "sparse / dense, per attended key" in text


@pytest.mark.slow
def test_tile_sweep_smoke(tmp_path):
    """Each kernel at its shipped tile (first) and one more, compared with the shipped tiles' results — the dK/dV
    kernel computing dQ too right after dK/dV, at its own shipped tile first — then the best combinations timed
    dense and sparse (with the fused dQ too); the table, the chart and the lines for SM90_DEFAULTS and
    SM90_FUSED_DQ_DEFAULT."""
    out = tmp_path / "sweep.json"
    text = run("benchmarks/tile_sweep.py", "--smoke", "--out", str(out), fresh=True)
    data = json.loads(out.read_text())
    swept = [r for r in data["rows"] if "kernel" in r]
    assert [r["kernel"] for r in swept] == [
        "forward",
        "forward",
        "dkdv",
        "dkdv",
        "dkdv+dq",
        "dkdv+dq",
        "dq",
        "dq",
    ]
    assert all(r["agrees"] and r["ms"] > 0 for r in swept)
    assert swept[0]["max_diff"] == 0.0  # the shipped tile against itself
    from csrc_triton.paged_attention import SM90_DEFAULTS, SM90_FUSED_DQ_DEFAULT

    assert tuple(swept[0]["tile"]) == SM90_DEFAULTS["forward"]
    assert {(r["tiles"], r["sparse"]) for r in data["rows"] if "tiles" in r} == {
        (t, s) for t in ("shipped", "best", "best, fused dQ") for s in (False, True)
    }
    fused = [r for r in swept if r["kernel"] == "dkdv+dq"]
    assert tuple(fused[0]["tile"]) == (*SM90_FUSED_DQ_DEFAULT, False)
    assert tuple(data["best_fused_dq"]) in [tuple(r["tile"]) for r in fused]
    assert out.with_suffix(".md").exists() and out.with_suffix(".png").exists()
    assert "SM90_DEFAULTS = {" in text and "SM90_FUSED_DQ_DEFAULT = (" in text


def test_profile_step_smoke(tmp_path):
    """A goals row's step profiled at tiny shapes: the wall times, the ops' own CPU time, the op table."""
    out = tmp_path / "profile.md"
    text = run("benchmarks/profile_step.py", "--row", "1m-sparse-host,128k-offload", "--tiny", "--device", "cpu",
               "--top", "8", "--plain", "--out", str(out))  # fmt: skip
    rows = json.loads(out.with_suffix(".json").read_text())["rows"]
    assert [(r["row"], r["context"]) for r in rows] == [("1m-sparse-host", 768), ("128k-offload", 256)]
    attention = {
        "PagedAttention",
        "aten::_scaled_dot_product_flash_attention_for_cpu",
    }  # (the op, its CPU kernel)
    for data in rows:
        assert data["step_s"] > 0 and len(data["by_self_cpu"]) == 8 and data["ops_cpu_s"] > 0
        assert not data["by_self_cuda"] and attention & {r["name"] for r in data["by_self_cpu"]}
    assert text.count("By self CPU time") == 2
    assert "not goals.py rows" in run_refused("benchmarks/profile_step.py", "--row", "nope", "--tiny")


def test_retimed_goals_of_the_recorded_run(tmp_path):
    """The recorded H200 run re-timed for the shipped tiles: faster steps, each a prediction from a measured row."""
    from benchmarks import retimed

    out = tmp_path / "retimed.json"
    assert retimed.main(["--gpu", "h200", "--out", str(out)]) == 0
    data = json.loads(out.read_text())
    assert 1.3 < data["attention_speedup"] < 1.8
    goals = {g["goal"]: g for g in data["goals"]}
    for name in ("32K step vs HF, layer checkpointing", "32K step vs HF, the strategies' defaults",
                 "dense 1M-token step"):  # fmt: skip
        assert goals[name]["predicted"] < goals[name]["measured"]
    offloaded = goals["dense throughput at 256K, every layer offloaded"]
    assert offloaded["predicted"] > offloaded["measured"]
    assert goals["dense throughput at 256K, the strategies' defaults"]["measured"] is None
    defaults = goals["dense 1M-token step, the strategies' defaults"]
    assert defaults["measured"] is None and defaults["predicted"] <= goals["dense 1M-token step"]["predicted"]
    for name in ("32K step vs HF", "dense 1M-token step"):  # the fused dQ backward: less attention time
        fused = goals[f"{name}, the strategies' defaults, fused dQ backward"]
        assert (
            fused["measured"] is None
            and fused["predicted"] < goals[f"{name}, the strategies' defaults"]["predicted"]
        )
    fused = goals["dense throughput at 256K, the strategies' defaults, fused dQ backward"]["predicted"]
    assert fused > goals["dense throughput at 256K, the strategies' defaults"]["predicted"]
    assert "every 'predicted' value is a prediction" in out.with_suffix(".md").read_text()


def run_refused(script: str, *args: str) -> str:
    """``python script args`` in this process, expected to exit 2: what it printed to stderr."""
    printed = io.StringIO()
    argv = mock.patch.object(sys, "argv", [script, *args])
    with argv, contextlib.redirect_stderr(printed), pytest.raises(SystemExit) as exit:
        runpy.run_path(str(ROOT / script), run_name="__main__")
    assert exit.value.code == 2
    return printed.getvalue()


@pytest.mark.slow
def test_goals_smoke(tmp_path):
    """Every part of the goal run at tiny shapes on the CPU: rows, their planner column, the summary table."""
    from benchmarks import goals

    common = ["--tiny", "--device", "cpu", "--out-dir", str(tmp_path)]
    assert goals.main(["--part", "compare", "--repeats", "1", *common]) == 0
    assert goals.main(["--part", "reduced", *common]) == 0
    assert goals.main(["--part", "summary", *common]) == 0
    check, *rows = json.loads((tmp_path / "goals-reduced.json").read_text())["rows"]
    assert check["role"] == "fidelity-32k" and 0 < check["oomb_error"] < 0.1 and 0 < check["hf_error"] < 0.1
    assert all("step_s" in r for r in rows), [r for r in rows if "step_s" not in r]
    assert all(r["planned_gib"] > 0 for r in rows)
    host = next(r for r in rows if r["role"] == "1m-sparse-host")
    assert host["hbm_layers"] == 1 and host["host_layers"] == 1 and host["attended_fraction"] < 1
    summary = (tmp_path / "summary.md").read_text()
    for goal in ("32K step time", "offload overhead at 128K", "sparse (chunk 4096 + 64 pages) at 256K",
                 "1M tokens in one step", "check: layer scaling of step time at 64K",
                 "check: sparse vs dense at 64K", "check: OOMB's gradient error vs HF's"):  # fmt: skip
        assert goal in summary, goal
    data = json.loads((tmp_path / "summary.json").read_text())
    assert {p["role"] for p in data["plans"]} == {"plan-1m", "plan-longest", "plan-1m-adamw"}
    assert data["command"] and "1M tokens in one training step with AdamW" in summary


def test_goals_budget_skips_rows_that_would_not_fit(tmp_path):
    from benchmarks import goals

    args = ["--part", "reduced", "--tiny", "--device", "cpu", "--out-dir", str(tmp_path), "--budget-s", "0"]
    assert goals.main(args) == 0
    rows = json.loads((tmp_path / "goals-reduced.json").read_text())["rows"]
    assert rows and all("skipped" in r and "step_s" not in r for r in rows)


def script_commands(tmp_path, parts: list[str], **env) -> list[list[str]]:
    """The ``python3`` command lines ``run_gpu.sh`` runs for ``parts`` (a stand-in ``python3`` records them)."""
    fake = tmp_path / "bin"
    fake.mkdir(exist_ok=True)
    calls = tmp_path / "calls"
    calls.unlink(missing_ok=True)
    (fake / "python3").write_text(f'#!/usr/bin/env bash\nprintf "%s\\n" "$@" "--end--" >> "{calls}"\n')
    (fake / "python3").chmod(0o755)
    env = {**os.environ, "PATH": f"{fake}{os.pathsep}{os.environ['PATH']}", **env}
    done = subprocess.run(["bash", str(SCRIPT), str(tmp_path / "out"), *parts], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=60)  # fmt: skip
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    assert (tmp_path / "out" / "run.log").exists()
    return [c.strip("\n").split("\n") for c in calls.read_text().split("--end--\n") if c.strip()]


@pytest.mark.parametrize("tiny", [False, True])
def test_run_gpu_script(tmp_path, tiny):
    """``bash -n`` passes, and every command the script runs (all parts) parses with its script's own parser; with
    ``OOMB_BENCH_TINY=1`` each one runs at tiny shapes on the CPU."""
    assert subprocess.run(["bash", "-n", str(SCRIPT)], capture_output=True).returncode == 0
    parts = [
        "checks",
        "kernels",
        "compare",
        "reduced",
        "summary",
        "tiles",
        "profile",
        "gather",
        "stress",
        "scaling",
        "windows",
        "latent",
    ]
    commands = script_commands(tmp_path, parts, **({"OOMB_BENCH_TINY": "1"} if tiny else {}))
    from benchmarks import (
        attention_kernels,
        goals,
        latent_pages,
        memory_scaling,
        offload_stress,
        profile_step,
        tile_sweep,
        window_tails,
    )

    parsers = {"benchmarks/goals.py": goals.parse_args, "benchmarks/attention_kernels.py": attention_kernels.parse_args,
               "benchmarks/memory_scaling.py": memory_scaling.parse_args,
               "benchmarks/offload_stress.py": offload_stress.parse_args,
               "benchmarks/tile_sweep.py": tile_sweep.parse_args,
               "benchmarks/profile_step.py": profile_step.parse_args,
               "benchmarks/window_tails.py": window_tails.parse_args,
               "benchmarks/latent_pages.py": latent_pages.parse_args}  # fmt: skip
    checked = []
    for argv in commands:
        if argv[0] in parsers:
            args = parsers[argv[0]](argv[1:])
            small = (
                args.smoke
                if argv[0] in ("benchmarks/attention_kernels.py", "benchmarks/tile_sweep.py")
                else args.tiny and args.device == "cpu"
            )
            assert small == tiny, argv
            checked.append(argv[0])
        else:
            assert argv[:2] == ["-m", "pytest"], argv
            assert all((ROOT / a.split("::")[0]).exists() for a in argv if a.startswith("tests/"))
    assert sorted(set(checked)) == sorted(parsers) and checked.count("benchmarks/goals.py") == 3
    if not tiny:  # the 8-minute default: checks kernels compare reduced summary, in that order
        default = script_commands(tmp_path, [])
        assert (
            default[0][-2:] == ["tests/engine/test_cuda_paths.py", "tests/kernels/test_page_copy.py"]
            and default[1][0] == "benchmarks/attention_kernels.py"
        )
        assert [c[2] for c in default if c[0] == "benchmarks/goals.py"] == ["compare", "reduced", "summary"]


def test_goal_table_arithmetic():
    """The goal table from made-up rows (no timings): the ratios, the per-layer scaling of time (checked at 64K), the
    offload overhead scaled per layer, the measured part of the memory slope (of one configuration's rows)."""
    import dataclasses

    from benchmarks import goals
    from lightning_oomb.engine import OOMBConfig

    scale = goals.TINY
    dense = dataclasses.asdict(OOMBConfig(64, 16, layer_checkpointing=True))
    off = dataclasses.asdict(OOMBConfig(64, 16, layer_checkpointing=True, offload=True, hbm_budget=0))

    def row(role, layers, length, step, peak, config=dense, method="oomb"):
        r = {"role": role, "method": method, "layers": layers, "context": scale.lengths[length], "repeats": 3,
             "step_s": step, "min_s": step, "warmup_s": step + 1, "peak_gib": peak}  # fmt: skip
        return r if config is None else {**r, "config": config}

    rows = [row("hf-32k", 3, "32k", 1.0, 10.0, None, "hf"), row("oomb-32k", 3, "32k", 1.1, 4.0),
            row("oomb-64k", 3, "64k", 2.0, 5.0), row("fit-64k", 2, "64k", 1.4, 3.0),
            row("fit-64k", 1, "64k", 0.8, 2.0), row("128k-dense", 1, "128k", 1.0, 2.5),
            row("warm-offload", 1, "32k", 0.3, 1.0, off), row("128k-offload", 1, "128k", 1.01, 1.001, off),
            row("256k-offload", 1, "256k", 2.0, 1.002, off),
            # other options, no point of the slope (its peak is lower: the gradient sums in host memory)
            row("256k-offload-host", 1, "256k", 2.1, 0.5, {**off, "grad_accumulation": "float32-host"})]  # fmt: skip
    table = {g["goal"]: g for g in goals.goal_table(scale, rows, {}, [], torch.device("cpu"))}
    assert table["32K step time vs HF + SDPA + checkpointing"]["value"] == pytest.approx(1.1)
    assert (
        table["32K peak vs HF's"]["value"] == pytest.approx(0.4) and table["32K peak vs HF's"]["met"] == "yes"
    )
    # fit: t(L) = 0.2 + 0.6 L at 192 tokens; 2 layers scaled to 3 = 2.0 s, the measured 3-layer step
    assert table["check: layer scaling of step time at 64K"]["value"] == pytest.approx(0.0, abs=1e-12)
    a = 0.2 / 192 * 256  # the per-token part at 128K's tiny length
    overhead = table["offload overhead at 128K"]["value"]
    assert overhead == pytest.approx(3 * 0.01 / (a + 3 * (1.0 - a)))
    slope = table["GPU memory growth with offload"]
    assert f"1 layers measured: {0.002 * 2**30 / 1e6 / (256 / 1e4):.2f}" in slope["measured"]
    assert "peaks at 128, 256, 384" in slope["how"]


@pytest.mark.slow
def test_loss_memory_smoke(tmp_path):
    """The fused loss's counted peak equals its formula and is below the unfused loss's, measured in one run (the
    unfused loss is read from git history: a copy without it, e.g. a shallow clone, measures the fused one only)."""
    out = tmp_path / "loss.json"
    history = subprocess.run(
        ["git", "cat-file", "-e", f"{OLD_COMMIT}^{{commit}}"], cwd=ROOT, capture_output=True
    )
    old = [] if history.returncode == 0 else ["--no-old"]
    run("benchmarks/loss_memory.py", "--vocab", "512", "--hidden", "32", "--tokens", "64", "--block", "16",
        "--repeats", "1", "--out", str(out), *old)  # fmt: skip
    rows = {(r["precision"], r["method"]): r for r in json.loads(out.read_text())["rows"]}
    for precision in ("32-true", "bf16-true", "bf16-mixed"):
        fused = rows[precision, "fused"]
        assert 0 <= fused["peak_bytes"] - fused["formula_bytes"] <= 8 * 16 * 32
        if not old:
            assert fused["peak_bytes"] < rows[precision, "unfused"]["peak_bytes"]
    assert out.with_suffix(".md").exists()


@pytest.mark.slow
def test_bf16_grad_fidelity_smoke(tmp_path):
    out = tmp_path / "fidelity.json"
    run("benchmarks/bf16_grad_fidelity.py", "--seq-len", "128", "--chunks", "1", "8", "--out", str(out))
    rows = json.loads(out.read_text())["rows"]
    assert {(r["precision"], r["accumulation"], r["kv_grad_dtype"], r["chunks"]) for r in rows} == {
        (p, a, g, c) for p, a, g in (("bf16-mixed", "float32", "float32"), ("bf16-true", "native", "float32"),
                                     ("bf16-true", "float32", "float32"), ("bf16-true", "float32-host", "float32"),
                                     ("bf16-true", "float32", "bfloat16")) for c in (1, 8)
    }  # fmt: skip
    assert all(0 < r["ratio"] < 2 for r in rows) and out.with_suffix(".md").exists()


@pytest.mark.slow
def test_cpu_step_smoke(tmp_path):
    """One tiny case of the CPU step benchmark, in process (timings are recorded, never checked)."""
    from benchmarks.cpu_step import main

    out = tmp_path / "cpu-step.json"
    main(["--cases", "256:128", "--repeats", "1", "--torch-up-to", "256", "--out", str(out),
          "--backends", "auto", "auto+reuse", "auto+sparse", "auto+packed", "torch"])  # fmt: skip
    rows = json.loads(out.read_text())["rows"]
    methods = [(r["method"], r["backend"]) for r in rows]
    backends = ("auto", "auto+reuse", "auto+sparse", "auto+packed", "torch")
    assert methods == [("hf", "sdpa")] + [("oomb", b) for b in backends]
    assert "| oomb | 256 | 128 | auto |" in out.with_suffix(".md").read_text()
    main(["--cases", "256:128", "--repeats", "1", "--window", "64", "--backends", "auto", "--out", str(out)])
    assert "sliding window of 64 keys" in out.with_suffix(".md").read_text()


@pytest.mark.slow
@pytest.mark.parametrize(("family", "tokens", "chunk"), [("qwen3_5", 256, 128), ("mamba", 128, 64)])
def test_hybrid_memory_smoke(tmp_path, family, tokens, chunk):
    """The hybrid benchmark's rows at a tiny length: OOMB keeps the states of its boundaries and adds less than HF
    without checkpointing (timings are recorded, never checked)."""
    from benchmarks.hybrid_memory import main

    out = tmp_path / "hybrid.json"
    main(["--family", family, "--contexts", str(tokens), "--chunk", str(chunk), "--out", str(out)])
    rows = {(r["method"], r["checkpointing"]): r for r in json.loads(out.read_text())["rows"]}
    assert set(rows) == {("hf", False), ("hf", True), ("oomb", True)}
    assert rows["oomb", True]["carried_state_bytes"] > 0
    assert rows["oomb", True]["peak_bytes"] < rows["hf", False]["peak_bytes"]
    assert f"| {tokens} |" in out.with_suffix(".md").read_text() and out.with_suffix(".png").exists()


def test_predictions_are_one_command(tmp_path):
    """The README's predictions come from benchmarks/predictions.py: its JSON and table hold every goal's row."""
    from benchmarks import predictions

    out = tmp_path / "predictions.json"
    assert predictions.main(["--out", str(out)]) == 0
    rows = json.loads(out.read_text())["predictions"]
    assert 0.5 < rows["scale"] < 1 and rows["1m_fits_no_optimizer"]["fits"]
    assert rows["256k_offloaded_peak_gb"]["native"] < rows["256k_offloaded_peak_gb"]["float32"]
    # the 32K peak against HF as measured (its gradients allocated) and as Lightning runs it (predicted)
    assert rows["hf_32k_peak_without_grads_gib"] < 77.0
    assert (
        out.with_suffix(".md").read_text().count("\n| ") == 12 + 5
    )  # goals: header + 11 rows; 80 GB: header + 4
    long = rows["80gb"]
    assert (
        all(r["fits"] for n, r in long.items() if n != "longest_tokens") and long["longest_tokens"] >= 1 << 20
    )


def test_model_coverage_smoke(tmp_path):
    """A family refused only for its default attention dropout is checked again with it 0 (GPT-2: exact then)."""
    out = tmp_path / "coverage.json"
    text = run("benchmarks/model_coverage.py", "--families", "gpt2", "qwen2", "--out", str(out))
    rows = {r["family"]: r["status"] for r in json.loads(out.read_text())["rows"]}
    assert rows == {"gpt2": "exact with attention dropout 0", "qwen2": "exact"}
    assert out.with_suffix(".md").exists() and "1 exact, 1 exact with attention dropout 0" in text


def test_staging_host_time_smoke(tmp_path):
    """The staging cache's host time per call, sparse and dense, next to the copy engine's time for its bytes."""
    from benchmarks import staging_host_time

    out = tmp_path / "staging.json"
    history = subprocess.run(
        ["git", "cat-file", "-e", f"{staging_host_time.OLD_COMMIT}^{{commit}}"], cwd=ROOT, capture_output=True
    )
    old = [] if history.returncode == 0 else ["--no-old"]
    run("benchmarks/staging_host_time.py", "--blocks", "8", "--selected", "40", "--reps", "1", "--out", str(out),
        *old)  # fmt: skip
    rows = {(r["case"], r["sweep"]): r for r in json.loads(out.read_text())["rows"]}
    assert rows["dense", "forward"]["copy_calls"] == 2 * 8  # K and V of each whole block
    sparse = rows["sparse", "forward"]
    assert (
        2 * 8 < sparse["copy_calls"] <= 2 * 40
    )  # scattered pages: more calls than whole blocks, fewer bytes
    assert rows["sparse", "backward"]["copy_calls"] > sparse["copy_calls"] and sparse["host_ms"] > 0
    assert (sparse["host_ms_old"] is None) == bool(old) and out.with_suffix(".png").exists()
    # gathered: one call per block and part where its pages make several runs, a copy per tensor where one
    assert sparse["gather_calls"] < sparse["copy_calls"] and rows["dense", "forward"]["gather_calls"] is None
    assert sparse["issue_us_loop"] > 0 and sparse["issue_us_foreach"] > 0  # the copies issued both ways


@pytest.mark.parametrize("lora", [False, True])
def test_fits_finds_the_longest_step_that_fits(lora):
    """benchmarks/fits.py's bisection: its step fits, a chunk more does not (overflowing what it names); a GPU
    smaller than the weights, gradients and states gets "—" with their bytes."""
    import transformers as tf

    from benchmarks import fits
    from lightning_oomb.engine.memory import HOST_RESERVE_BYTES

    config = tf.LlamaConfig(hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
                            num_key_value_heads=2, vocab_size=1024)  # fmt: skip
    model = fits.meta_model(config, lora)
    host = HOST_RESERVE_BYTES + (256 << 20)
    where = fits.Machine("cuda", 128 << 20, host)
    found = fits.longest(model, where)
    assert 0 < found["tokens"] < fits.LONGEST and fits.planned(model, found["tokens"], where).fits
    beyond = fits.planned(model, found["tokens"] + fits.CHUNK, where)
    assert not beyond.fits and (found["bound_by"] == "GPU") == (not beyond.device_fits)
    tiny = fits.longest(model, fits.Machine("cuda", 1 << 20, host))
    assert tiny["tokens"] == 0 and fits.cell(tiny).startswith("— (")
    assert fits.cell(found).endswith(f"({found['bound_by']})")


def _github_anchors(markdown: str) -> set[str]:
    """The anchors GitHub gives a Markdown file's headings (lower case, punctuation but ``-`` and ``_`` dropped,
    spaces to ``-``, repeats numbered), outside code blocks."""
    anchors, seen, code = set(), {}, False
    for line in markdown.splitlines():
        code ^= line.startswith("```")
        heading = None if code else re.match(r"#+\s+(.*)", line)
        if heading:
            words = heading.group(1).replace("`", "").strip().lower()
            slug = re.sub(r"[^\w\- ]", "", words).replace(" ", "-")
            anchors.add(f"{slug}-{seen[slug]}" if slug in seen else slug)
            seen[slug] = seen.get(slug, 0) + 1
    return anchors


def test_readme_and_docs_links_and_paths_resolve():
    """Every relative link in README.md and docs/*.md names an existing file (and heading, after ``#``), and every
    file path they quote in backticks (``benchmarks/...``, ``tests/...::test``, ``engine/...``) exists: a new user's
    first clicks and commands do not meet a renamed file."""
    missing = []
    for doc in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        text = doc.read_text()
        prose = re.sub(r"```.*?```", "", text, flags=re.S)
        for target in re.findall(r"\]\(([^)\s]+)\)", prose):
            if re.match(r"[a-z]+:", target):
                continue
            path, _, anchor = target.partition("#")
            file = doc.parent / path if path else doc
            if not file.exists() or (anchor and anchor not in _github_anchors(file.read_text())):
                missing.append(f"{doc.name}: ({target})")
        quoted_paths = r"(?<![\w./-])((?:benchmarks|tests|examples|lightning_oomb|csrc_triton|docs|engine)/[\w./-]*\w" \
                       r"\.(?:py|yaml|md|json|sh|png)(?:::\w+)?)"  # fmt: skip
        for quoted in re.findall(quoted_paths, " ".join(re.findall(r"`+([^`]+)`+", text))):
            path, _, test = quoted.partition("::")
            file = next((p for p in (ROOT / path, ROOT / "lightning_oomb" / path) if p.exists()), None)
            if file is None or (test and f"def {test}(" not in file.read_text()):
                missing.append(f"{doc.name}: `{quoted}`")
    assert not missing, missing


def test_latent_pages_smoke(tmp_path):
    """The latent-pages benchmark at a tiny width on the CPU: the same loss over expanded pages and latents, one KV
    head of 16 + 4 in the second row against 4 heads of 12 (timings are recorded, never checked)."""
    from benchmarks.latent_pages import main

    out = tmp_path / "latent-pages.json"
    main(["--tiny", "--device", "cpu", "--out", str(out)])
    expanded, latent = json.loads(out.read_text())["rows"]
    assert (expanded["method"], latent["method"]) == ("expanded", "latent")
    assert latent["loss"] == pytest.approx(expanded["loss"], rel=1e-5)
    heads = [(row["kv_heads"], row["head_dim"]) for row in (expanded, latent)]
    assert heads == [(4, 12), (1, 20)]
    assert "| latent |" in out.with_suffix(".md").read_text() and out.with_suffix(".png").exists()


def test_window_tails_smoke(tmp_path):
    """The window-tails benchmark at a tiny width on the CPU: the same loss with the tails on the device and in host
    memory, every window layer's tails hosted in the second row, their bytes out once and back but two groups
    (timings are recorded, never checked)."""
    from benchmarks.window_tails import main

    out = tmp_path / "window-tails.json"
    main(["--tiny", "--device", "cpu", "--out", str(out)])
    device, host = json.loads(out.read_text())["rows"]
    assert (device["method"], host["method"]) == ("device", "host") and device["loss"] == host["loss"]
    assert (device["hosted_tail_layers"], host["hosted_tail_layers"]) == (0, 5)
    assert host["d2h_gib"] == host["tail_host_gib"] and 0 < host["h2d_gib"] < host["d2h_gib"]
    assert "| host |" in out.with_suffix(".md").read_text() and out.with_suffix(".png").exists()
