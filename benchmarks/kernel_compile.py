"""Offline compile of the paged-attention kernels for a GPU architecture (default sm_90): registers, spills, shared
memory and MMA layout per kernel and config.

No GPU needed: each kernel is compiled from its source for ``GPUTarget("cuda", arch, 32)`` (``triton.compile`` on an
``ASTSource``) and the PTX is assembled with Triton's bundled ``ptxas -v`` (``--gpu-name=sm_90a``, ``sm_120a``, ``sm_89``...),
whose report gives registers per thread and spill bytes; the compiled kernel's shared memory is checked against the
architecture's limit per block (:data:`SHARED_LIMITS`: Triton refuses to load a kernel above it). ``--arch 89``
(RTX 40, L4, L40S; sm_86 has the same limit), ``120`` (RTX 50) or ``80`` (A100) compiles the tiles those GPUs get
(``MMA_SYNC_DEFAULTS``). The launch-time specialisation is mimicked: pointers and the strides
that are not 1 divisible by 16, unit strides constant 1, the tuning key's constexprs as a real launch sets them
(bf16 inputs, float32 gradient pages, ``HEAD_DIM=128``, ``PAGE=128``).

Per variant the record also has ``loop_sync_loads`` (:func:`loop_sync_loads`), the MMA layouts of the TTGIR (version, ``warpsPerCTA``, ``instrShape``) and
``mma_rows`` (rows one MMA layout covers: ``16 * warpsPerCTA[0]``) beside ``tile_rows`` (the MMA's M: the query
tile in the forward and dQ kernels, the key tile in dK/dV): ``mma_rows > tile_rows`` means the warps beyond
``tile_rows / 16`` compute copies of the same rows (duplicated MMA work).

Flags: ``SPARSE`` (a page selection), ``CARRY`` (a carried state: offload's key parts), ``ACCUMULATE`` (dQ added
into an accumulator), ``ROWS`` (packed documents), ``SOFTCAP``; and the config's own: ``SPLIT`` (dK/dV: the fully
visible query blocks in an unmasked loop of their own). ``--all`` compiles every config the pruner keeps
(the tuning space), not only the defaults (plain variants only); ``--quick`` only the defaults per tuning key
(dK/dV's with and without ``FUSED_DQ``, which has a default of its own; ``tests/kernels/test_kernel_compile.py``).
Writes ``benchmarks/results/kernel-compile-sm<arch>.json`` and ``.md`` and prints the table.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FP32_POINTERS = {"LSE", "L", "DELTA", "DK", "DV"}
INT_POINTERS = {"TABLE", "FIRST", "SEL", "SEEING", "VISITS", "INV_PTR", "INV_IDX", "WORK"}
FLOATS = {"scale", "qk_scale", "cap"}
UNIT_STRIDES = {"stride_qd", "stride_kd"}
# (kernel, MMA M dim, specialisations to compile besides the tuning key's)
KERNELS = {
    "_fwd_kernel": ("BLOCK_M", [{"CARRY": False}, {"CARRY": True}]),
    "_bwd_dkdv_kernel": ("BLOCK_N", [{"FUSED_DQ": False}, {"FUSED_DQ": True}]),
    "_bwd_dq_kernel": ("BLOCK_M", [{"ACCUMULATE": False}, {"ACCUMULATE": True}]),
}
TERMS = [(False, False), (True, False), (False, True), (True, True)]  # (ROWS, SOFTCAP)
SHARED_LIMITS = {80: 166912, 86: 101376, 89: 101376, 90: 232448, 120: 101376}  # bytes per block (opt-in)
BASE = {"HEAD_DIM": 128, "PAGE": 128, "PRECISION": "tf32", "SOFTCAP": False, "ROWS": False, "COUNT": False,
        "K_P2": 64, "R_P2": 32, "FUSED_DQ": False}  # fmt: skip


def parse_args(argv=None):
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--all", action="store_true", help="every config the pruner keeps, not only the defaults"
    )
    parser.add_argument(
        "--quick", action="store_true", help="the defaults per tuning key only, no extra flags"
    )
    parser.add_argument("--head-dim", type=int, nargs="+", default=[128])
    parser.add_argument("--page", type=int, default=128)
    parser.add_argument(
        "--arch", type=int, default=90, choices=sorted(SHARED_LIMITS), help="compute capability"
    )
    parser.add_argument("--out", type=Path, help="default: benchmarks/results/kernel-compile-sm<arch>.json")
    args = parser.parse_args(argv)
    args.out = args.out or ROOT / "benchmarks" / "results" / f"kernel-compile-sm{args.arch}.json"
    return args


def signature(jit, constexprs: dict, flags: dict) -> tuple[dict, dict, dict]:
    """``(signature, constexprs, attrs)`` of an ``ASTSource`` for a bf16 launch with fp32 gradient pages."""
    sig, consts, attrs = {}, dict(constexprs), {}
    for i, (name, param) in enumerate(zip(jit.arg_names, jit.params)):
        if param.is_constexpr or name in UNIT_STRIDES:
            sig[name] = "constexpr"
            consts.setdefault(name, 1)
            continue
        fp32_out = (name == "OUT" and flags.get("CARRY")) or (
            name == "DQ" and (flags.get("ACCUMULATE") or flags.get("FUSED_DQ"))
        )
        if name.isupper():
            kind = "i32" if name in INT_POINTERS else "fp32" if name in FP32_POINTERS or fp32_out else "bf16"
            sig[name] = f"*{kind}"
            attrs[(i,)] = [["tt.divisibility", 16]]
        elif name in FLOATS:
            sig[name] = "fp32"
        else:
            sig[name] = "i32"
            if name.startswith("stride_"):
                attrs[(i,)] = [["tt.divisibility", 16]]
    return sig, consts, attrs


def gpu_name(arch: int) -> str:
    return f"sm_{arch}a" if arch >= 90 else f"sm_{arch}"  # (Triton's PTX targets sm_90a / sm_120a)


def ptxas_report(ptx: str, ptxas: str, arch: int = 90) -> dict:
    """Registers and spill bytes from ``ptxas -v`` for ``arch``."""
    with tempfile.TemporaryDirectory() as tmp:
        src = Path(tmp) / "k.ptx"
        src.write_text(ptx)
        log = subprocess.run([ptxas, "-v", f"--gpu-name={gpu_name(arch)}", str(src), "-o", str(src.with_suffix(".o"))],
                             capture_output=True, text=True, check=True).stderr  # fmt: skip
    regs = re.search(r"Used (\d+) registers", log)
    stores = re.search(r"(\d+) bytes spill stores", log)
    loads = re.search(r"(\d+) bytes spill loads", log)
    return {
        "n_regs": int(regs.group(1)) if regs else None,
        "spill_store_bytes": int(stores.group(1)) if stores else None,
        "spill_load_bytes": int(loads.group(1)) if loads else None,
    }


def mma_layouts(ttgir: str) -> list[dict]:
    """The distinct NVIDIA MMA layouts of a TTGIR module."""
    found = []
    for m in re.finditer(r"nvidia_mma<\{([^}]*)\}>", ttgir):
        body = m.group(1)
        version = re.search(r"versionMajor = (\d+)", body)
        warps = re.search(r"warpsPerCTA = \[([\d, ]+)\]", body)
        shape = re.search(r"instrShape = \[([\d, ]+)\]", body)
        item = {
            "version": int(version.group(1)) if version else None,
            "warpsPerCTA": [int(x) for x in warps.group(1).split(",")] if warps else None,
            "instrShape": [int(x) for x in shape.group(1).split(",")] if shape else None,
        }
        if item not in found:
            found.append(item)
    return found


def loop_sync_loads(ttgir: str) -> int:
    """Loads inside the TTGIR's loops that stayed synchronous (``tt.load``: the pipeliner made the others
    asynchronous copies into shared memory) — a load whose address depends on another load of the same iteration
    stalls the loop on memory latency."""
    loops, depth, count = [], 0, 0
    for line in ttgir.splitlines():
        count += bool(loops) and re.search(r"\btt\.load\b", line) is not None
        if "scf.for" in line and line.rstrip().endswith("{"):
            loops.append(depth)
        depth += line.count("{") - line.count("}")
        while loops and depth <= loops[-1]:
            loops.pop()
    return count


def compile_one(
    kernels, name: str, config, flags: dict, head_dim: int, page: int, ptxas: str, arch: int = 90
) -> dict:
    import triton
    from triton.backends.compiler import GPUTarget

    tuner = getattr(kernels, name)
    jit = tuner.fn
    rows_name, _ = KERNELS[name]
    constexprs = {**BASE, "HEAD_DIM": head_dim, "PAGE": page, **flags, **config.kwargs}
    constexprs = {k: v for k, v in constexprs.items() if k in jit.arg_names}
    sig, consts, attrs = signature(jit, constexprs, flags)
    src = triton.compiler.ASTSource(jit, sig, consts, attrs)
    started = time.perf_counter()
    compiled = triton.compile(
        src,
        target=GPUTarget("cuda", arch, 32),
        options={"num_warps": config.num_warps, "num_stages": config.num_stages},
    )
    layouts = mma_layouts(compiled.asm["ttgir"])
    covered = max((16 * lay["warpsPerCTA"][0] for lay in layouts if lay["warpsPerCTA"]), default=None)
    return {
        "kernel": name,
        **{k: v for k, v in flags.items()},
        "HEAD_DIM": head_dim,
        "PAGE": page,
        **config.kwargs,
        "num_warps": config.num_warps,
        "num_stages": config.num_stages,
        **ptxas_report(compiled.asm["ptx"], ptxas, arch),
        "shared_bytes": compiled.metadata.shared,
        "shared_limit": SHARED_LIMITS[arch],
        "mma": layouts,
        "tile_rows": config.kwargs[rows_name],
        "mma_rows": covered,
        "loop_sync_loads": loop_sync_loads(compiled.asm["ttgir"]),
        "compile_s": round(time.perf_counter() - started, 1),
    }


def variants(kernels, name: str, head_dim: int, page: int, every: bool, quick: bool = False, arch: int = 90):
    """``(config, flags)`` to compile: the shipped default for ``arch`` (or the pruned space) per tuning key, plain
    and with the score terms that are not part of the key (documents: ``ROWS``; ``SOFTCAP``)."""
    tuner = getattr(kernels, name)
    _, extra = KERNELS[name]
    flag_sets = extra
    if quick:  # each tuning key's default: dK/dV's FUSED_DQ is part of its key
        flag_sets = [f for f in extra if "FUSED_DQ" in f] or extra[:1]
    elif every:
        flag_sets = extra[:1]
    for sparse in (False, True):
        for flags in flag_sets:
            key = {"HEAD_DIM": head_dim, "PAGE": page, "SPARSE": sparse, "ARCH": arch, **flags}
            configs = kernels.tuning_space(tuner, key) if every else [kernels.default_config(tuner, key)]
            for config in configs:
                for rows, softcap in TERMS[:1] if every or quick else TERMS:
                    yield config, {"SPARSE": sparse, **flags, "ROWS": rows, "SOFTCAP": softcap}


def table(records: list[dict]) -> str:
    head = "| kernel | flags | tile (M, N) | warps | stages | regs | spill bytes (st/ld) | shared bytes | MMA rows / tile rows |"
    lines = [head, "|" + "---|" * 9]
    for r in records:
        flags = (
            ", ".join(
                k
                for k in ("SPARSE", "CARRY", "ACCUMULATE", "ROWS", "SOFTCAP", "SPLIT", "FUSED_DQ")
                if r.get(k)
            )
            or "-"
        )
        lines.append(
            f"| {r['kernel']} (d={r['HEAD_DIM']}) | {flags} | ({r['BLOCK_M']}, {r['BLOCK_N']}) | {r['num_warps']} | "
            f"{r['num_stages']} | {r['n_regs']} | {r['spill_store_bytes']}/{r['spill_load_bytes']} | "
            f"{r['shared_bytes']:,} | {r['mma_rows']} / {r['tile_rows']} |"
        )
    return "\n".join(lines)


def main(argv=None) -> int:
    args = parse_args(argv)
    sys.path.insert(0, str(ROOT))
    if os.environ.get("TRITON_INTERPRET") == "1":
        print("kernel_compile.py compiles for a GPU: unset TRITON_INTERPRET.", file=sys.stderr)
        return 2
    from triton.backends.nvidia.compiler import get_ptxas

    from benchmarks.common import command, versions, write_json
    from csrc_triton import paged_attention as kernels

    ptxas = get_ptxas(args.arch).path
    records = []
    for head_dim in args.head_dim:
        for name in KERNELS:
            for config, flags in variants(
                kernels, name, head_dim, args.page, args.all, args.quick, args.arch
            ):
                record = compile_one(kernels, name, config, flags, head_dim, args.page, ptxas, args.arch)
                print(json.dumps(record), flush=True)
                records.append(record)
    result = {"command": command(), "versions": versions(), "target": f"{gpu_name(args.arch)} (offline, ptxas -v)",
              "variants": records}  # fmt: skip
    write_json(args.out, result)
    md = table(records)
    args.out.with_suffix(".md").write_text(
        f"# Offline {gpu_name(args.arch)} compile of the paged-attention kernels\n\n`{result['command']}`\n\n"
        f"Triton {result['versions'].get('triton')}; bf16 inputs, float32 gradient pages, page {args.page}. Registers "
        "per thread and spill bytes from `ptxas -v`; shared bytes: the compiled kernel's (this architecture's limit "
        f"per block: {SHARED_LIMITS[args.arch]:,}); MMA rows: the rows one MMA layout covers (16 per warp along "
        "M), above the tile's rows the extra warps compute the same rows again.\n\n"
        f"{md}\n"
    )
    print(md)
    spilled = [r for r in records if r["spill_store_bytes"] or r["spill_load_bytes"]]
    duplicated = [r for r in records if r["mma_rows"] and r["mma_rows"] > r["tile_rows"]]
    too_big = [r for r in records if r["shared_bytes"] > r["shared_limit"]]
    print(f"\n{len(records)} variants: {len(spilled)} spill, {len(duplicated)} duplicate MMA rows, "
          f"{len(too_big)} above the shared memory limit")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
