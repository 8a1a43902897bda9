"""Steps of ``benchmarks/goals.py`` rows under ``torch.profiler``: where their time goes, on the GPU and on the CPU.

Each row is named by its role (``--row``, comma-separated; default ``1m-sparse-host``: the 1M-token sparse step
with one layer in host memory, which took 1.6x its planned time on the H200; ``128k-dense,128k-offload``: the same
step without and with offload, whose kernels' times side by side show where offload's overhead goes) and built as
``goals.py`` builds it — its layer count, context, options. Each step is warmed up first at 32K tokens (kernels
compiled, arenas grown), then one step is profiled (CPU and CUDA activities, no shapes or stacks, to keep the trace
small; ``--plain``: one more step timed without the profiler first, to see what profiling costs). Writes ``--out``
(``.md``: per row the wall times and the ops by self CUDA time and by self CPU time, ``--top`` each; ``.json``: the
same rows, and the ops' summed own CPU time and the GPU kernels' time; both rewritten after each row) and prints
the tables. A step whose CPU time is near its wall time while the GPU idles is bound by the host (launches,
Python, copies issued one by one), not by the kernels.

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
from benchmarks.goals import Scale, compare_rows, dtype, oomb_config, reduced_rows, scale_of

COLUMNS = ("count", "self_cpu_ms", "self_cuda_ms", "cpu_ms", "cuda_ms")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--row",
        default="1m-sparse-host",
        help="roles of goals.py's compare or reduced rows, comma-separated (profiled one after another)",
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


def profile_row(role: str, scale: Scale, args, device: torch.device) -> tuple[dict, list[str]]:
    """One goals row's step profiled: its result and its markdown section."""
    row = {r.role: r for r in compare_rows(1) + reduced_rows(scale)}[role]
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
    result = {"row": role, "layers": model.config.num_hidden_layers, "context": tokens,
              "config": None if config is None else str(config), "step_s": plain_s, "profiled_step_s": profiled_s,
              "ops_cpu_s": busy["self_cpu_ms"], "kernels_s": busy["self_cuda_ms"], "by_self_cuda": by_cuda,
              "by_self_cpu": by_cpu}  # fmt: skip
    model = None
    free_device_memory(device)
    lines = [f"## `{role}` ({result['layers']} layers, {tokens:,} tokens)", "", f"Step {profiled_s:.2f} s profiled"
             + ("" if plain_s is None else f", {plain_s:.2f} s without the profiler") + "; "
             f"ops' own CPU time {busy['self_cpu_ms']:.2f} s"
             + (f", GPU kernels {busy['self_cuda_ms']:.2f} s (the GPU idles the rest of the step)" if cuda else "")
             + ".", "", *(["### By self CUDA time", "", *table(by_cuda), ""] if cuda else []),
             "### By self CPU time", "", *table(by_cpu), ""]  # fmt: skip
    return result, lines


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    device = torch.device(args.device)
    scale = scale_of(args.tiny)
    known = {r.role for r in compare_rows(1) + reduced_rows(scale)}
    roles = args.row.split(",")
    unknown = [r for r in roles if r not in known]
    if unknown:
        print(f"--row {','.join(unknown)!r}: not goals.py rows; choose from {sorted(known)}", file=sys.stderr)
        return 2
    result = {"command": command(), "versions": versions(), "rows": []}
    lines = [f"# Profile of {', '.join(f'`{r}`' for r in roles)}", "", f"`{result['command']}`", "",
             f"On {result['versions'].get('gpu', device.type)}.", ""]  # fmt: skip
    for role in roles:
        row, section = profile_row(role, scale, args, device)
        result["rows"].append(row)
        lines += section
        write_json(args.out.with_suffix(".json"), result)  # rows so far, should a later one not finish
        args.out.with_suffix(".md").write_text("\n".join(lines))
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
