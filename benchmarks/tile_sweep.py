"""Each paged-attention kernel's candidate tiles timed on this GPU, one kernel at a time: the data for the shipped
defaults (``csrc_triton.paged_attention.SM90_DEFAULTS``).

Shape: ``benchmarks/attention_kernels.py``'s (4096 queries after ``--keys`` keys, 28:4 heads of 128, page 128,
bf16). For each kernel (forward, dK/dV, dQ) and candidate ``(BLOCK_M, BLOCK_N, warps, stages[, variant])`` the
kernel runs at that tile while the other two keep their current pick; the forward is timed alone, a backward
kernel as forward+backward (the forward's time is the same in every row of that kernel). Before timing, each
candidate's out, dQ, dK and dV are compared with the shipped defaults' (``max_diff``: the largest absolute
difference, bf16 rounding apart they agree; ``agrees`` within ``TOLERANCE`` of the largest value). Kernels are swept
in order, each keeping the fastest agreeing tile found, so the last rows are the best combination; it is then timed
dense and with a page selection (``--page-budget`` pages per query block) at every ``--keys``, next to the shipped
defaults. Right after dK/dV, the dK/dV kernel computing dQ too (``OOMB_TRITON_FUSED_DQ=1``: no dQ kernel, dQ added
atomically; off by default until measured) at its candidate tiles — the kernel ``dkdv+dq`` — and, if one agrees, the
best combination with it (``best, fused dQ``) is timed too. Each candidate costs a compilation (1-3 s); a candidate starts only if
``--budget-s`` leaves time for it.

Writes JSON after every row (``--out``) and prints each row as a JSON line; at the end a table (``.md``) and a
chart (``.png``) next to it, and the winning tiles as the line to paste into ``SM90_DEFAULTS``. ``--smoke``: tiny
shapes, two candidates per kernel, on the CPU through the Triton interpreter (a check of the script).

    PYTHONPATH=$PWD python3 benchmarks/tile_sweep.py --out benchmarks/results/tile-sweep-h200.json
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time
from pathlib import Path
from unittest import mock

import torch

ROOT = Path(__file__).resolve().parents[1]
TOLERANCE = 0.02  # bf16 kernels at different tiles sum in different orders: within 2 % of the largest value
# (BLOCK_M, BLOCK_N, warps, stages, dK/dV's SPLIT) per kernel: tiles that fit sm_90's 227 KB of shared memory at
# head_dim 128 without duplicated MMA rows; the shipped default (shipped()) is swept first. Of the H200 sweep of
# 2026-12-04 (results/tile-sweep-h200.md) kept: the tiles within ~10 % of each kernel's best, those it did not
# reach, and the earlier forward default (128, 64, 8, 3) as a reference
FUSED = "dkdv+dq"  # the dK/dV kernel computing dQ too
CANDIDATES = {
    "forward": [(128, 128, 8, 3), (128, 128, 8, 2), (64, 64, 4, 3), (128, 64, 8, 3)],
    "dkdv": [(32, 64, 4, 3, True), (32, 64, 4, 3, False), (32, 128, 8, 3, True), (32, 64, 4, 2, True),
             (32, 64, 4, 4, True), (16, 64, 4, 3, True), (64, 64, 4, 2, True)],
    # swept right after dK/dV (so a short budget still measures it): its shipped tile (SM90_FUSED_DQ_DEFAULT)
    # first, then tiles that spill little or nothing with it (offline sm_90 compile) and the dK/dV default (spills
    # 8-924 bytes with it)
    FUSED: [(32, 128, 8, 2, False), (16, 128, 8, 3, True), (32, 128, 8, 3, False), (16, 128, 8, 2, False),
            (16, 64, 4, 3, True), (32, 64, 4, 3, True)],
    "dq": [(64, 64, 4, 3), (128, 128, 8, 3), (64, 64, 4, 4), (64, 64, 4, 2), (64, 32, 4, 3)],
}  # fmt: skip
TUNERS = {
    "forward": "_fwd_kernel",
    "dkdv": "_bwd_dkdv_kernel",
    "dq": "_bwd_dq_kernel",
    FUSED: "_bwd_dkdv_kernel",
}


def fused_dq_env(on: bool):
    """``OOMB_TRITON_FUSED_DQ`` set to ``on`` inside (read at each backward call), restored after."""
    return mock.patch.dict(os.environ, {"OOMB_TRITON_FUSED_DQ": "1" if on else "0"})


def shipped(kernels, kernel: str) -> tuple:
    """``kernel``'s shipped sm_90 tile at head_dim 128, with its default variant (dK/dV's ``SPLIT``; one masked loop
    for the dK/dV kernel computing dQ too, at a tile of its own)."""
    if kernel == FUSED:
        return (*kernels.shipped_tile("dkdv", 128, 90, fused_dq=True), False)
    variant = kernels.SM90_VARIANTS.get(kernel, ({},))[0]
    return (*kernels.SM90_DEFAULTS[kernel], *variant.values())


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--queries", type=int, default=4096)
    parser.add_argument(
        "--keys", type=int, nargs="+", default=[32768, 131072], help="the sweep runs at the first"
    )
    parser.add_argument("--heads", type=int, default=28)
    parser.add_argument("--kv-heads", type=int, default=4)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--page", type=int, default=128)
    parser.add_argument("--page-budget", type=int, default=64)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--iters", type=int, default=5)
    parser.add_argument(
        "--budget-s", type=float, default=None, help="candidates start only within this many s"
    )
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "tile-sweep.json")
    parser.add_argument("--smoke", action="store_true", help="tiny shapes, two candidates a kernel; CPU too")
    args = parser.parse_args(argv)
    if args.smoke:
        args.queries, args.keys, args.heads, args.kv_heads, args.page_budget = 32, [96], 4, 2, 2
        args.head_dim, args.page, args.warmup, args.iters = 16, 16, 1, 1
    return args


class Tiles:
    """The tile each kernel runs at: its autotuner's config list replaced by the one candidate (the pruner keeps a
    list's first config and fits it to the call), and its cached choice forgotten. The pruner's lookup of a shipped
    tile of its own (``shipped_tile``: the dK/dV kernel's with dQ) is off meanwhile, so the candidate runs."""

    def __init__(self, kernels):
        self.kernels, self.tuners = kernels, {k: getattr(kernels, name) for k, name in TUNERS.items()}
        self.shipped = {k: list(t.configs) for k, t in self.tuners.items()}
        self.shipped_tile = kernels.shipped_tile
        kernels.shipped_tile = lambda *args, **kwargs: None
        self.current: dict[str, tuple] = {}

    def set(self, kernel: str, tile: tuple) -> None:
        import triton

        m, n, warps, stages, *variant = tile
        extra = {"SPLIT": variant[0]} if variant else {}
        tuner = self.tuners[kernel]
        tuner.configs = [
            triton.Config({"BLOCK_M": m, "BLOCK_N": n, **extra}, num_warps=warps, num_stages=stages)
        ]
        tuner.cache.clear()
        self.current[kernel] = tile

    def restore(self) -> None:
        self.kernels.shipped_tile = self.shipped_tile
        for kernel, tuner in self.tuners.items():
            tuner.configs = self.shipped[kernel]
            tuner.cache.clear()


def outputs(kernels, p) -> dict[str, torch.Tensor]:
    from benchmarks.attention_kernels import oomb_grads

    return {name: x.float() for name, x in oomb_grads(kernels, p).items()}


def max_diff(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> tuple[float, bool]:
    """The largest absolute difference over out, dQ, dK, dV, and whether each is within ``TOLERANCE`` of its
    largest value."""
    diffs = {name: (got[name] - want[name]).abs().max().item() for name in want}
    agree = all(diffs[name] <= TOLERANCE * want[name].abs().max().item() for name in want)
    return max(diffs.values()), agree


def markdown(data: dict) -> str:
    """The sweep's rows as a table, then the shipped and best tiles timed together."""
    shape = data["shape"]
    lines = [f"# Paged-attention tiles on {data['versions'].get('gpu', 'this device')}", "",
             f"`{data['command']}`", "",
             f"Triton {data['versions'].get('triton')}, torch {data['versions'].get('torch')}; {shape['queries']} "
             f"queries after {shape['keys'][0]} keys, {shape['heads']}:{shape['kv_heads']} heads of "
             f"{shape['head_dim']}, page {shape['page']}. One kernel at a time at each tile, the others at their pick "
             "so far; forward rows time the forward, backward rows forward + backward (median ms). `max diff`: "
             "against the first tile's out, dQ, dK, dV.", "",
             "| kernel | tile (M, N, warps, stages[, SPLIT]) | ms | max diff | note |",
             "|---|---|---|---|---|"]  # fmt: skip
    for r in data["rows"]:
        if "kernel" in r:
            ms = f"{r['ms']:.2f}" if "ms" in r else ""
            diff = f"{r['max_diff']:.1e}" if "max_diff" in r else ""
            note = r.get("error") or r.get("skipped") or ("" if r.get("agrees", True) else "disagrees")
            lines.append(f"| {r['kernel']} | {tuple(r['tile'])} | {ms} | {diff} | {note} |")
    lines += ["", "| tiles | keys | sparse | fwd ms | fwd+bwd ms |", "|---|---|---|---|---|"]
    for r in data["rows"]:
        if "tiles" in r and "fwd_ms" in r:
            lines.append(
                f"| {r['tiles']} | {r['keys']} | {r['sparse']} | {r['fwd_ms']:.2f} | {r['fwd_bwd_ms']:.2f} |"
            )
    lines += ["", f"best: {data.get('best')}; shipped before: {data.get('shipped')}; the dK/dV kernel computing dQ "
              f"too, at its best: {data.get('best_fused_dq')}", ""]  # fmt: skip
    return "\n".join(lines)


def plot(data: dict, path: Path) -> None:
    """One bar per candidate tile, per kernel (ms; the fastest agreeing one dark)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    kernels = list(dict.fromkeys(r["kernel"] for r in data["rows"] if "kernel" in r))
    fig, axes = plt.subplots(1, len(kernels), figsize=(4 * len(kernels), 3.5), squeeze=False)
    for ax, kernel in zip(axes[0], kernels):
        rows = [r for r in data["rows"] if r.get("kernel") == kernel and "ms" in r]
        best = data.get("best", {}).get(kernel)
        ax.bar(range(len(rows)), [r["ms"] for r in rows],
               color=["tab:blue" if r["tile"] == best else "tab:gray" for r in rows])  # fmt: skip
        ax.set_xticks(range(len(rows)), [",".join(str(int(x)) for x in r["tile"]) for r in rows], rotation=60,
                      fontsize=7)  # fmt: skip
        ax.set_title(kernel)
        ax.set_ylabel("ms" if kernel == "forward" else "fwd+bwd ms")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def timings(kernels, p, args, device, select=None) -> dict:
    """``fwd_ms`` and ``fwd_bwd_ms`` of our kernels on problem ``p`` (with ``page_select`` ``select``)."""
    from benchmarks.attention_kernels import run_oomb, timed_ms

    def time_ms(backward: bool) -> float:
        return timed_ms(lambda: run_oomb(kernels, p, backward, select), args.warmup, args.iters, device)[0]

    return {"fwd_ms": time_ms(False), "fwd_bwd_ms": time_ms(True)}


def sweep(kernels, tiles: Tiles, candidates: dict, p, args, device, report, left) -> dict[str, tuple]:
    """Each kernel's candidates in turn (the others at their pick so far), each checked against the first tiles'
    results, then timed; returns the fastest agreeing tile per kernel (``left()``: seconds of the budget left)."""
    for kernel, found in candidates.items():
        if kernel != FUSED:
            tiles.set(kernel, found[0])
    want = outputs(kernels, p)  # the shipped defaults' results
    best: dict[str, tuple] = {}
    spent = 0.0  # the longest candidate so far: a candidate starts only if that much is left
    for kernel, found in candidates.items():
        agreeing = {}
        for tile in found:
            row = {"kernel": kernel, "tile": list(tile)}
            if left() < max(spent, 5.0):
                report.add({**row, "skipped": f"{left():.0f} s left of the budget"})
                continue
            t0 = time.monotonic()
            tiles.set(kernel, tile)
            try:
                with fused_dq_env(kernel == FUSED):
                    row["max_diff"], row["agrees"] = max_diff(outputs(kernels, p), want)
                    # what ran: a tile the GPU's shared memory does not hold falls back to a smaller one (_launch)
                    row["ran"] = sorted({str(c) for c in tiles.tuners[kernel].cache.values()})
                    measured = timings(kernels, p, args, device)
                row["ms"] = measured["fwd_ms" if kernel == "forward" else "fwd_bwd_ms"]
                if row["agrees"]:
                    agreeing[tile] = row["ms"]
            except Exception as e:  # a tile that does not compile or load on this GPU: recorded, never fatal
                row["error"] = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
            spent = max(spent, time.monotonic() - t0)
            report.add({**row, "seconds": time.monotonic() - t0})
        if kernel == FUSED:  # dK/dV back at its pick; the fused kernel's best only if one agreed
            tiles.set("dkdv", best["dkdv"])
            if agreeing:
                best[FUSED] = min(agreeing, key=agreeing.get)
            continue
        best[kernel] = min(agreeing, key=agreeing.get) if agreeing else found[0]
        tiles.set(kernel, best[kernel])
    return best


def main(argv: list[str] | None = None) -> int:
    started = time.monotonic()
    args = parse_args(argv)
    if torch.cuda.is_available():
        device, dtype = torch.device("cuda"), torch.bfloat16
    elif args.smoke:
        os.environ.setdefault("TRITON_INTERPRET", "1")  # before csrc_triton decorates its kernels
        device, dtype = torch.device("cpu"), torch.float16  # the interpreter's tl.dot mishandles bfloat16
    else:
        print(
            "benchmarks/tile_sweep.py needs a CUDA GPU (--smoke checks the script on CPU).", file=sys.stderr
        )
        return 2
    os.environ["OOMB_TRITON_AUTOTUNE"] = "0"
    sys.path.insert(0, str(ROOT))
    from benchmarks.attention_kernels import Problem
    from benchmarks.common import Report
    from csrc_triton import paged_attention as kernels

    def left() -> float:
        return math.inf if args.budget_s is None else args.budget_s - (time.monotonic() - started)

    shape = {k: getattr(args, k) for k in ("queries", "keys", "heads", "kv_heads", "head_dim", "page")}
    report = Report(args.out, shape=shape, tolerance=TOLERANCE)
    candidates = {}
    for kernel, listed in CANDIDATES.items():
        first = shipped(kernels, kernel)
        candidates[kernel] = [first, *(t for t in listed if t != first)][: 2 if args.smoke else None]
    tiles = Tiles(kernels)
    p = Problem(args, args.queries, args.keys[0], dtype, device)
    best = sweep(kernels, tiles, candidates, p, args, device, report, left)
    fused = best.pop(FUSED, None)
    report.data["best"] = {k: list(v) for k, v in best.items()}
    report.data["best_fused_dq"] = None if fused is None else list(fused)
    report.data["shipped"] = {k: list(v[0]) for k, v in candidates.items() if k != FUSED}
    combinations = [("shipped", report.data["shipped"]), ("best", report.data["best"])]
    if fused is not None:
        combinations.append(("best, fused dQ", {**report.data["best"], "dkdv": list(fused)}))
    for label, chosen in combinations:
        for kernel, tile in chosen.items():
            tiles.set(kernel, tuple(tile))
        for lk in args.keys:
            q = p if lk == args.keys[0] else Problem(args, args.queries, lk, dtype, device)
            for sparse in (False, True):
                row = {"tiles": label, "keys": lk, "sparse": sparse}
                if left() < 3.0:
                    report.add({**row, "skipped": "budget"})
                    continue
                with fused_dq_env(label == "best, fused dQ"):
                    select = q.select(args.page_budget) if sparse else None
                    report.add({**row, **timings(kernels, q, args, device, select)})
    tiles.restore()
    args.out.with_suffix(".md").write_text(markdown(report.data))
    plot(report.data, args.out.with_suffix(".png"))
    split = f"  # dkdv SPLIT={best['dkdv'][4]}" if len(best["dkdv"]) > 4 else ""
    print("SM90_DEFAULTS = {" + ", ".join(f'"{k}": {tuple(v[:4])}' for k, v in best.items()) + "}" + split)
    if fused is not None:
        print(f"SM90_FUSED_DQ_DEFAULT = {tuple(fused[:4])}  # SPLIT={fused[4]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
