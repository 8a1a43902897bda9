"""One step of a ``benchmarks/goals.py`` row under ``torch.profiler``: where its time goes, on the GPU and on the CPU.

The row is named by its role (``--row``, default ``1m-sparse-host``: the 1M-token sparse step with one layer in
host memory, which took 1.6x its planned time on the H200) and built as ``goals.py`` builds it — its layer count,
context, options. The step is warmed up first at 32K tokens (kernels compiled, arenas grown), then one step is
profiled (CPU and CUDA activities, no shapes or stacks, to keep the trace small; ``--plain``: one more step timed
without the profiler first, to see what profiling costs). Writes ``--out`` (``.md``: the wall times and the ops by
self CUDA time and by self CPU time, ``--top`` each; ``.json``: the same rows, and the ops' summed own CPU time and
the GPU kernels' time) and prints the tables. A step whose CPU time is near its wall time while the GPU idles is
bound by the host (launches, Python, copies issued one by one), not by the kernels.

    PYTHONPATH=$PWD python3 benchmarks/profile_step.py --row 1m-sparse-host --out benchmarks/results/profile.md
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

from benchmarks.common import (
    HF,
    build_qwen2,
    command,
    free_device_memory,
    make_step,
    reserve_pool,
    timed,
    versions,
    write_json,
)
from benchmarks.goals import FULL, TINY, Scale, _qwen7b, compare_rows, dtype, oomb_config, reduced_rows

COLUMNS = ("count", "self_cpu_ms", "self_cuda_ms", "cpu_ms", "cuda_ms")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--row", default="1m-sparse-host", help="a role of goals.py's compare or reduced rows"
    )
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/profile.md"))
    parser.add_argument("--top", type=int, default=25, help="ops listed per table")
    parser.add_argument("--plain", action="store_true", help="also time one step without the profiler")
    parser.add_argument("--device", default="cuda")
    parser.add_argument(
        "--tiny", action="store_true", help="tiny shapes (a check of the script, e.g. on CPU)"
    )
    return parser.parse_args(argv)


def ops(prof, top: int | None, key: str) -> list[dict]:
    """The profiler's ops, ``top`` of them (``None``: all) by ``key`` (a column of :data:`COLUMNS`)."""
    rows = []
    for e in prof.key_averages():
        cuda_self = getattr(e, "self_device_time_total", getattr(e, "self_cuda_time_total", 0.0))
        cuda = getattr(e, "device_time_total", getattr(e, "cuda_time_total", 0.0))
        cpu = e.self_cpu_time_total / 1e3
        rows.append({"name": e.key, "count": e.count, "self_cpu_ms": cpu, "self_cuda_ms": cuda_self / 1e3,
                     "cpu_ms": e.cpu_time_total / 1e3, "cuda_ms": cuda / 1e3})  # fmt: skip
    return sorted(rows, key=lambda r: -r[key])[:top]


def table(rows: list[dict]) -> list[str]:
    lines = ["| op | " + " | ".join(COLUMNS) + " |", "|---|" + "---|" * len(COLUMNS)]
    for r in rows:
        cells = [str(r["count"])] + [f"{r[c]:,.1f}" for c in COLUMNS[1:]]
        lines.append(f"| `{r['name'][:70]}` | " + " | ".join(cells) + " |")
    return lines


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    device = torch.device(args.device)
    scale = TINY if args.tiny else Scale(_qwen7b(), **FULL)
    rows = {r.role: r for r in compare_rows(1) + reduced_rows(scale)}
    if args.row not in rows:
        print(f"--row {args.row!r} is not a goals.py row; choose from {sorted(rows)}", file=sys.stderr)
        return 2
    row = rows[args.row]
    tokens = scale.lengths[row.length]
    model = build_qwen2(device, dtype(device), scale.config(row.layers))
    config = None if row.method == HF else oomb_config(row, scale, model, tokens)
    step, engine = make_step(model, row.method, config)
    if engine is not None:
        reserve_pool(engine, model, tokens, device)
    gen = torch.Generator(device).manual_seed(tokens)
    warm, ids = (torch.randint(0, model.config.vocab_size, (1, n), device=device, generator=gen)
                 for n in (min(tokens, scale.lengths["32k"]), tokens))  # fmt: skip
    timed(lambda: step(warm), device)
    plain_s = timed(lambda: step(ids), device)[0] if args.plain else None
    activities = [torch.profiler.ProfilerActivity.CPU]
    if device.type == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    with torch.profiler.profile(activities=activities, record_shapes=False, with_stack=False) as prof:
        profiled_s = timed(lambda: step(ids), device)[0]
    if engine is not None:
        engine.release()
    everything = ops(prof, None, "self_cpu_ms")
    busy = {c: sum(r[c] for r in everything) / 1e3 for c in ("self_cpu_ms", "self_cuda_ms")}  # seconds
    cuda = device.type == "cuda"
    by_cuda, by_cpu = ops(prof, args.top, "self_cuda_ms") if cuda else [], everything[: args.top]
    result = {"command": command(), "versions": versions(), "row": args.row, "layers": model.config.num_hidden_layers,
              "context": tokens, "config": None if config is None else str(config), "step_s": plain_s,
              "profiled_step_s": profiled_s, "ops_cpu_s": busy["self_cpu_ms"], "kernels_s": busy["self_cuda_ms"],
              "by_self_cuda": by_cuda, "by_self_cpu": by_cpu}  # fmt: skip
    model = None
    free_device_memory(device)
    write_json(args.out.with_suffix(".json"), result)
    lines = [f"# Profile of `{args.row}` ({result['layers']} layers, {tokens:,} tokens)", "",
             f"`{result['command']}`", "", f"Step {profiled_s:.2f} s profiled"
             + ("" if plain_s is None else f", {plain_s:.2f} s without the profiler") + "; "
             f"{result['versions'].get('gpu', device.type)}. Ops' own CPU time {busy['self_cpu_ms']:.2f} s"
             + (f", GPU kernels {busy['self_cuda_ms']:.2f} s (the GPU idles the rest of the step)" if cuda else "")
             + ".", "", *(["## By self CUDA time", "", *table(by_cuda), ""] if cuda else []),
             "## By self CPU time", "", *table(by_cpu), ""]  # fmt: skip
    args.out.with_suffix(".md").write_text("\n".join(lines))
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
