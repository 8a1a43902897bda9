"""Host time of offload's staging per attention call against the copies it issues, on the CPU.

A host-tier layer's call stages its prefix blocks through the staging cache (``engine/offload/staging.py``): per
block the runs of consecutive pages to copy, a view of each run on both sides (the staging buffers' views kept
across calls) and a copy call per view. A dense call copies whole blocks (one run each); a sparse call only its
selected pages, which for the 1M-token sparse step of ``benchmarks/goals.py`` (Qwen2.5-7B's shape: pages of 128
tokens, 32 pages a block, 8,192 pages; 32 query blocks per chunk each selecting 64 pages) are up to 2,048 scattered
pages — thousands of runs. If the host needs longer to
issue them than the copy engine needs to move their bytes, the step is bound by the host (the 1M sparse step ran
1.6x its planned time on the H200).

Measured here, per call: the cache's bookkeeping with copies that do nothing (``--reps`` passes, median; the old
cache's passes alternate with the new's) — what the host spends before the copies' own calls (``copy_`` then
costs each a few microseconds more under CUDA) —, for the forward (K/V in) and the backward (K/V and gradient
pages in, gradient pages back out), sparse (random selection of ``--selected`` pages) and dense, next to the time
the copy engine needs for the same bytes at the H200's measured 55 GB/s each way (the reference, computed from the
bytes at Qwen2.5-7B's page size) — and the same bookkeeping of the staging cache as of ``OLD_COMMIT`` (every view
made anew per call, a ``Transfer`` per run), read from git; for the sparse calls also both caches with a gathering
transport (``OOMB_OFFLOAD_GATHER=1``'s path: a block's scattered pages in one call per part). Each cache lives
across its passes, as across a step's calls (what it keeps with it; the median leaves out the first pass). The
arenas here are tiny (views cost the same at any page size). Writes JSON (``--out``), a PNG and a Markdown table
next to it; ~40 s.

    PYTHONPATH=$PWD python benchmarks/staging_host_time.py --reps 21
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from pathlib import Path

import torch

from benchmarks.common import command, old_module, versions, write_json
from lightning_oomb.engine.offload.schedule import Need
from lightning_oomb.engine.offload.staging import StagingCache
from lightning_oomb.engine.offload.transport import SyncTransport, copy_pairs
from lightning_oomb.engine.pages import Arena, PoolShape

ROOT = Path(__file__).resolve().parents[1]
OLD_COMMIT = "4026a3e"  # the staging cache before its buffers' run views were kept (made per call by a split)
COPY_BYTES_PER_S = 55.4e9  # the H200's measured pinned copy rate, each way (planner.MEASURED_STEP_RATES)
QWEN_PAGE_BYTES = {
    "kv": 128 * 4 * 128 * 2,
    "grad": 128 * 4 * 128 * 4,
}  # one K (dK) page: bf16 K/V, fp32 grads


class CountingTransport(SyncTransport):
    """Copies, gathers and zero-fills that do nothing but count (the host-side cost of the cache alone)."""

    def __init__(self, gathers: bool = False) -> None:
        super().__init__(torch.device("cpu"), gathers)
        self.copies = 0

    def copy(self, stream, pairs, after):
        self.copies += len(pairs)

    def gather(self, stream, pairs, rows, after):
        self.copies += 1

    def zero(self, tensors, after):
        self.copies += len(tensors)


class RecordingTransport(CountingTransport):
    """Copies kept (their views), not made: the pairs a call issues, for :func:`issue_pass`."""

    def __init__(self) -> None:
        super().__init__()
        self.pairs: list = []

    def copy(self, stream, pairs, after):
        self.pairs += pairs


def issue_pass(shape: PoolShape, selection, backward: bool):
    """A function issuing the copies of one call (staged by :func:`call_pass`) for real on CPU tensors, by a Python
    loop of ``copy_`` (how the transports issued them) or one :func:`copy_pairs` call (how they do), returning its
    seconds per copy: what issuing costs the host beyond the cache's bookkeeping."""
    transport = RecordingTransport()
    call_pass(StagingCache, shape, selection, backward, transport=transport)()
    pairs = transport.pairs

    def run(loop: bool) -> float:
        start = time.perf_counter()
        if loop:
            for dst, src in pairs:
                dst.copy_(src)
        else:
            copy_pairs(pairs)
        return (time.perf_counter() - start) / len(pairs)

    return run


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--blocks", type=int, default=256, help="prefix blocks of the call (1M tokens / 4096)"
    )
    parser.add_argument("--block-pages", type=int, default=32, help="pages per block (chunk 4096 / page 128)")
    parser.add_argument(
        "--selected", type=int, default=2048, help="selected pages of a sparse call (32 x 64)"
    )
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument(
        "--no-old", action="store_true", help="skip the old cache (a copy without git history)"
    )
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks/results/staging-host-time-cpu.json")
    return parser.parse_args(argv)


def call_pass(
    cache_class,
    shape: PoolShape,
    selection: dict[int, frozenset[int]] | None,
    backward: bool,
    gathers: bool = False,
    transport: CountingTransport | None = None,
):
    """A function running the cache's work for one call's prefix (fresh buffers each time), returning its seconds
    and copy calls (``gathers``: scattered pages by one gather call per block and part; ``transport``: one of the
    caller's, e.g. a :class:`RecordingTransport`)."""
    host = Arena(shape.layer_slots, shape, torch.device("cpu"))
    staging = Arena(9 * shape.block_slots, shape, torch.device("cpu"))
    transport = transport or CountingTransport(gathers)
    cache = cache_class(shape, [0], host, staging, 9, transport)
    blocks = range(shape.num_blocks) if selection is None else sorted(selection)
    needs = [Need(0, b, True, backward, None if selection is None else selection[b]) for b in blocks]

    def run() -> tuple[float, int]:
        cache.begin_sweep("backward" if backward else "forward")
        transport.copies = 0
        start = time.perf_counter()
        for need in needs:
            cache.tick()
            buf = cache.stage(need, "demand", set())
            if backward:
                cache.added_grads(buf)
                cache.write_back(buf)
        return time.perf_counter() - start, transport.copies

    return run


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(1)
    page, chunk = 4, 4 * args.block_pages
    shape = PoolShape(1, 1, chunk * args.blocks, 1, 4, page, chunk, "float32", torch.bfloat16)
    rng = random.Random(0)
    chosen: dict[int, set[int]] = {}
    for p in rng.sample(range(args.blocks * args.block_pages), args.selected):
        chosen.setdefault(p // args.block_pages, set()).add(p % args.block_pages)
    sparse = {b: frozenset(pages) for b, pages in chosen.items()}
    old = (
        None
        if args.no_old
        else old_module(OLD_COMMIT, "lightning_oomb/engine/offload/staging.py").StagingCache
    )
    rows = []
    for case, selection in (("sparse", sparse), ("dense", None)):
        pages = args.blocks * args.block_pages if selection is None else args.selected
        for sweep, backward in (("forward", False), ("backward", True)):
            # bytes of the call at Qwen2.5-7B's page size: K/V in; backward also dK/dV in and out
            moved = 2 * pages * QWEN_PAGE_BYTES["kv"] + (
                4 * pages * QWEN_PAGE_BYTES["grad"] if backward else 0
            )
            # the copy engine's time: each direction runs on its own engine, the longer one bounds
            one_way = 2 * pages * (QWEN_PAGE_BYTES["kv"] + (QWEN_PAGE_BYTES["grad"] if backward else 0))
            # the two caches alternate pass by pass, so that a slower spell of the machine hits both alike
            runs = {"new": call_pass(StagingCache, shape, selection, backward)}
            if old is not None:
                runs["old"] = call_pass(old, shape, selection, backward)
            if selection is not None:
                runs["gather"] = call_pass(StagingCache, shape, selection, backward, gathers=True)
                if old is not None:
                    runs["gather_old"] = call_pass(old, shape, selection, backward, gathers=True)
            times, calls = {name: [] for name in runs}, {}
            for _ in range(args.reps):
                for name, run in runs.items():
                    seconds, calls[name] = run()
                    times[name].append(seconds)
            ms = {name: statistics.median(t) * 1e3 for name, t in times.items()}
            issue, issued = issue_pass(shape, selection, backward), {True: [], False: []}
            for _ in range(args.reps):
                for loop in (True, False):
                    issued[loop].append(issue(loop))
            rows.append({"case": case, "sweep": sweep, "pages": pages, "copy_calls": calls["new"],
                         "host_ms": ms["new"], "host_ms_old": ms.get("old"), "bytes": moved,
                         "copy_engine_ms": one_way / COPY_BYTES_PER_S * 1e3,
                         "host_us_per_copy": ms["new"] / calls["new"] * 1e3,
                         "gather_calls": calls.get("gather"), "host_ms_gather": ms.get("gather"),
                         "host_ms_gather_old": ms.get("gather_old"),
                         "issue_us_loop": statistics.median(issued[True]) * 1e6,
                         "issue_us_foreach": statistics.median(issued[False]) * 1e6})  # fmt: skip
            print(rows[-1], flush=True)
    result = {"command": command(), "versions": versions(), "old_commit": OLD_COMMIT, "blocks": args.blocks,
              "block_pages": args.block_pages, "selected": args.selected, "rows": rows}  # fmt: skip
    write_json(args.out, result)
    lines = ["# Offload staging: host time per attention call vs the copy engine's", "", f"`{result['command']}`", "",
             f"One host-tier layer's call over {args.blocks} prefix blocks of {args.block_pages} pages (1M tokens "
             f"at Qwen2.5-7B's shape); sparse: {args.selected} random pages. Host: the staging cache's bookkeeping "
             "with copies that do nothing (one CPU thread; under CUDA each copy call costs a few us more); copy "
             "engine: the call's bytes at 55 GB/s each way (the longer direction). Old: the cache as of "
             f"`{OLD_COMMIT}`. Gathered (`OOMB_OFFLOAD_GATHER=1`): scattered pages by one page-copy kernel per "
             "block and part — the host builds the rows here; under CUDA each gather also pins and sends them and "
             "launches the kernel (tens of us), and the bytes cross PCIe on the SMs. Issue: the call's copies made "
             "for real on CPU tensors, per copy, by a Python loop of `copy_` (before) and one `torch._foreach_copy_` "
             "(the transports' `copy_pairs`) — the host's share of issuing them, beside the driver's under CUDA.", "",
             "| call | copy calls | host ms | host ms (old) | copy engine ms | host us / copy "
             "| gathered: calls | gathered: host ms | (old) | issue us / copy: loop | foreach |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]  # fmt: skip

    def cell(value: float | None) -> str:
        return "—" if value is None else f"{value:.1f}"

    for r in rows:
        calls = "—" if r["gather_calls"] is None else f"{r['gather_calls']:,}"
        lines.append(f"| {r['case']} {r['sweep']} | {r['copy_calls']:,} | {cell(r['host_ms'])}"
                     f" | {cell(r['host_ms_old'])} | {r['copy_engine_ms']:.1f} | {r['host_us_per_copy']:.1f} | {calls}"
                     f" | {cell(r['host_ms_gather'])} | {cell(r['host_ms_gather_old'])}"
                     f" | {r['issue_us_loop']:.2f} | {r['issue_us_foreach']:.2f} |")  # fmt: skip
    args.out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    plot(rows, args.out.with_suffix(".png"))
    print("\n".join(lines))
    return 0


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = [f"{r['case']}\n{r['sweep']}" for r in rows]
    x = range(len(rows))
    fig, ax = plt.subplots(figsize=(7, 4))
    for offset, key, name in ((-0.32, "host_ms_old", "host (old)"), (-0.16, "host_ms", "host"),
                              (0.0, "host_ms_gather_old", "host, gathered (old)"),
                              (0.16, "host_ms_gather", "host, gathered"),
                              (0.32, "copy_engine_ms", "copy engine (55 GB/s)")):  # fmt: skip
        ax.bar([i + offset for i in x], [r[key] or 0.0 for r in rows], width=0.16, label=name)
    ax.set_xticks(list(x), labels)
    ax.set_ylabel("ms per attention call")
    ax.set_title("Offload staging at 1M tokens: host time vs copy time")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


if __name__ == "__main__":
    sys.exit(main())
