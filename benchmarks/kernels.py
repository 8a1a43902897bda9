"""Paged attention kernels (csrc_triton) against torch SDPA and FlexAttention on OOMB's shape, on one GPU.

Measured in the same run:

1. Accuracy, the FlashAttention rule: the error (max |x - x_fp32|) of out, dQ, dK, dV against a float32 reference
   on the same inputs must be at most 2x the error of a plain-torch implementation in the low-precision dtype.
2. Throughput: forward and forward+backward of a chunk of queries at the end of long key sequences (default 4096
   queries against 32K and 128K keys, B=1, 28 query / 4 KV heads, head_dim 128, bf16, page 128) for our kernels,
   SDPA with ``causal_lower_right`` (K/V expanded by ``repeat_interleave``, and ``enable_gqa=True``) and compiled
   FlexAttention (``enable_gqa=True``, lower-right causal block mask). Median of ``--iters`` runs after warm-up
   (compilation and autotuning happen there), timed with CUDA events. Also our kernels over the keys in blocks
   of Lq keys merged by log-sum-exp, as offload runs them: the compute overhead of streaming.

FLOPs: forward = 4 * Hq * D * Lq * Lk (two matmuls over the full Lq x Lk rectangle, as if dense: the causal
triangle of the last Lq keys, 6 % of it at 32K keys and 1.6 % at 128K, is counted too); forward+backward = 3.5x
that. The same count for every method, so the ratios are ratios of times.

Writes JSON to ``--out`` (default ``benchmarks/results/kernels-<gpu>.json``) and a PNG next to it; prints the
table last. ``--smoke`` runs tiny shapes (on a machine without a GPU through the Triton interpreter, float16) to
check that the script works.
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--queries", type=int, default=4096, help="queries per chunk (Lq)")
    parser.add_argument(
        "--keys", type=int, nargs="+", default=[32768, 131072], help="total keys Lk (each a run)"
    )
    parser.add_argument("--heads", type=int, default=28, help="query heads")
    parser.add_argument("--kv-heads", type=int, default=4, help="KV heads")
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--page", type=int, default=128, help="tokens per KV page")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="bfloat16")
    parser.add_argument("--accuracy-shape", type=int, nargs=2, default=[2048, 16384], metavar=("LQ", "LK"))
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--iters", type=int, default=10)
    parser.add_argument("--out", type=Path, default=None, help="JSON path (PNG written next to it)")
    parser.add_argument("--smoke", action="store_true", help="tiny shapes and iterations; runs on CPU too")
    args = parser.parse_args(argv)
    if args.smoke:
        args.queries, args.keys, args.heads, args.kv_heads = 40, [160], 4, 2
        args.head_dim, args.page, args.accuracy_shape, args.warmup, args.iters = 16, 16, [40, 160], 1, 2
    return args


# ------------------------------------------------------------------------------------------------- problem
class Problem:
    """One chunk: ``q, dout [1, Hq, Lq, D]``; ``k, v [1, Hkv, Lk, D]`` and the same K/V in shuffled pages."""

    def __init__(self, args, lq: int, lk: int, dtype: torch.dtype, device: torch.device, seed: int = 0):
        gen = torch.Generator().manual_seed(seed)
        h, hkv, d, page = args.heads, args.kv_heads, args.head_dim, args.page

        def randn(*shape):
            return torch.randn(*shape, generator=gen).to(device, dtype)

        self.lq, self.lk, self.page, self.scale = lq, lk, page, d**-0.5
        self.q, self.dout = randn(1, h, lq, d), randn(1, h, lq, d)
        self.k, self.v = randn(1, hkv, lk, d), randn(1, hkv, lk, d)
        from tests.helpers.attention import to_pages  # (imports triton: after main() chose interpret mode)

        n_pages = math.ceil(lk / page)
        self.table = torch.randperm(n_pages, generator=gen).int().to(device)[None]
        self.k_arena, self.v_arena = (to_pages(x, self.table, page) for x in (self.k, self.v))
        self.dk_arena = torch.zeros(self.k_arena.shape, dtype=torch.float32, device=device)
        self.dv_arena = torch.zeros_like(self.dk_arena)

    def from_pages(self, arena: torch.Tensor) -> torch.Tensor:
        """The problem's tokens ``[1, Hkv, Lk, D]`` held in ``arena``."""
        from tests.helpers.attention import from_pages

        return from_pages(arena, self.table, self.lk)


def torch_grads(p: Problem, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    from tests.helpers.attention import dense_attention

    q, k, v = (x.detach().to(dtype).requires_grad_() for x in (p.q, p.k, p.v))
    out = dense_attention(q, k, v, p.lk - p.lq, p.scale)  # plain torch, materialised scores, in ``dtype``
    out.backward(p.dout.to(dtype))
    return {"out": out.detach(), "dq": q.grad, "dk": k.grad, "dv": v.grad}


def run_oomb(kernels, p: Problem, backward: bool = True) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Our forward (and backward, which adds into ``p``'s gradient pages); returns ``out`` and ``dq``."""
    q_start = p.lk - p.lq
    out, lse = kernels.paged_attention_forward(p.q, p.k_arena, p.v_arena, p.table, q_start, p.scale, None)
    if not backward:
        return out, None
    dq = kernels.paged_attention_backward(
        p.q, out, lse, p.dout, p.k_arena, p.v_arena, p.dk_arena, p.dv_arena, p.table, q_start, p.scale, None
    )
    return out, dq


def run_oomb_blocks(p: Problem, block: int, backward: bool = True) -> None:
    """The offload path: the keys in blocks of ``block`` tokens (one staged chunk each), merged by the engine's
    ``attend`` / ``attend_backward`` (carried softmax state, accumulated dQ) — its cost over one call is the
    compute overhead of streaming."""
    from lightning_oomb.engine.attention import attend, attend_backward
    from lightning_oomb.engine.pages import PagedKV

    q_start = p.lk - p.lq
    arenas = (p.k_arena, p.v_arena, p.dk_arena, p.dv_arena)
    parts = [PagedKV(*arenas, p.table, (lo, min(lo + block, p.lk))) for lo in range(0, p.lk, block)]
    out, lse = attend("triton", p.q, parts, q_start, p.scale, None)
    if backward:
        attend_backward("triton", p.q, out, lse, p.dout, parts, q_start, p.scale, None)


def oomb_grads(kernels, p: Problem) -> dict[str, torch.Tensor]:
    p.dk_arena.zero_()
    p.dv_arena.zero_()
    out, dq = run_oomb(kernels, p)
    return {"out": out, "dq": dq, "dk": p.from_pages(p.dk_arena), "dv": p.from_pages(p.dv_arena)}


def accuracy(kernels, args, dtype, device) -> dict:
    """FlashAttention rule for out, dQ, dK, dV at ``--accuracy-shape``."""
    p = Problem(args, *args.accuracy_shape, dtype, device, seed=1)
    want = torch_grads(p, torch.float32)
    plain = torch_grads(p, dtype)
    ours = oomb_grads(kernels, p)
    result = {}
    for name, ref in want.items():
        err_ours = (ours[name].float() - ref).abs().max().item()
        err_plain = (plain[name].float() - ref).abs().max().item()
        result[name] = {"oomb": err_ours, "plain_torch": err_plain, "ok": err_ours <= 2 * err_plain}
    return result


# ---------------------------------------------------------------------------------------------- throughput
def methods(kernels, p: Problem) -> dict[str, tuple[Callable, Callable]]:
    """name -> (forward, forward+backward) closures on the problem ``p``."""
    from torch.nn.attention.bias import causal_lower_right
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    q_start, lq, lk = p.lk - p.lq, p.lq, p.lk
    leaves = [x.detach().requires_grad_() for x in (p.q, p.k, p.v)]

    def autograd(attend: Callable) -> Callable:
        def run(backward: bool):
            for x in leaves:
                x.grad = None
            with torch.set_grad_enabled(backward):
                out = attend(*leaves)
            if backward:
                out.backward(p.dout)

        return run

    group = p.q.shape[1] // p.k.shape[1]
    mask = causal_lower_right(lq, lk)
    block_mask = create_block_mask(
        lambda b, h, qi, ki: ki <= qi + q_start, None, None, lq, lk, device=p.q.device.type
    )
    flex = torch.compile(flex_attention, dynamic=False)
    runs = {
        "oomb triton (paged)": functools.partial(run_oomb, kernels, p),
        "oomb triton (chunk-sized key blocks, merged)": functools.partial(
            run_oomb_blocks, p, math.ceil(lq / p.page) * p.page
        ),
        "sdpa lower-right (repeat_interleave)": autograd(
            lambda q, k, v: F.scaled_dot_product_attention(
                q, k.repeat_interleave(group, 1), v.repeat_interleave(group, 1), attn_mask=mask, scale=p.scale
            )
        ),
        "sdpa lower-right (enable_gqa)": autograd(
            lambda q, k, v: F.scaled_dot_product_attention(
                q, k, v, attn_mask=mask, scale=p.scale, enable_gqa=True
            )
        ),
        "flex compiled (enable_gqa)": autograd(
            lambda q, k, v: flex(q, k, v, block_mask=block_mask, scale=p.scale, enable_gqa=True)
        ),
    }
    return {name: (lambda r=run: r(False), lambda r=run: r(True)) for name, run in runs.items()}


def median_ms(fn: Callable, warmup: int, iters: int, device: torch.device) -> float:
    """Median wall time of ``fn`` in ms (CUDA events on GPU, ``perf_counter`` on CPU)."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            torch.cuda.synchronize()
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def throughput(kernels, args, dtype, device) -> list[dict]:
    rows = []
    for lk in args.keys:
        p = Problem(args, args.queries, lk, dtype, device)
        flops = 4 * args.heads * args.head_dim * args.queries * lk
        for name, (fwd, fwd_bwd) in methods(kernels, p).items():
            row = {"method": name, "keys": lk}
            try:
                row["fwd_ms"] = median_ms(fwd, args.warmup, args.iters, device)
                row["fwd_bwd_ms"] = median_ms(fwd_bwd, args.warmup, args.iters, device)
                row["fwd_tflops"] = flops / row["fwd_ms"] / 1e9
                row["fwd_bwd_tflops"] = 3.5 * flops / row["fwd_bwd_ms"] / 1e9
            except Exception as e:  # a reference this torch build cannot run is recorded, not fatal
                row["error"] = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
            rows.append(row)
        del p
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return rows


# ------------------------------------------------------------------------------------------------- report
def ratios(rows: list[dict]) -> dict[int, float | None]:
    """Per key length: our fwd+bwd TFLOP/s over the fastest reference's."""
    result = {}
    for lk in dict.fromkeys(r["keys"] for r in rows):
        ours = [r.get("fwd_bwd_tflops") for r in rows if r["keys"] == lk and r["method"].startswith("oomb")]
        refs = [
            r["fwd_bwd_tflops"]
            for r in rows
            if r["keys"] == lk and not r["method"].startswith("oomb") and "error" not in r
        ]
        result[lk] = ours[0] / max(refs) if ours and ours[0] and refs else None
    return result


def plot(rows: list[dict], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    keys = list(dict.fromkeys(r["keys"] for r in rows))
    names = list(dict.fromkeys(r["method"] for r in rows))
    width = 0.8 / len(names)
    fig, ax = plt.subplots(figsize=(8, 4.5))
    for i, name in enumerate(names):
        values = [
            next((r.get("fwd_bwd_tflops", 0.0) for r in rows if r["keys"] == k and r["method"] == name), 0.0)
            for k in keys
        ]
        ax.bar([j + i * width for j in range(len(keys))], values, width, label=name)
    ax.set_xticks([j + 0.4 - width / 2 for j in range(len(keys))], [f"{k / 1024:g}K keys" for k in keys])
    ax.set_ylabel("forward+backward TFLOP/s")
    ax.set_title(title)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if torch.cuda.is_available():
        device = torch.device("cuda")
        gpu = torch.cuda.get_device_name()
    elif args.smoke:
        os.environ.setdefault("TRITON_INTERPRET", "1")  # before csrc_triton decorates its kernels
        device, gpu = torch.device("cpu"), "cpu-interpreter"
        args.dtype = "float16"  # the interpreter's tl.dot mishandles bfloat16
    else:
        print(
            "benchmarks/kernels.py needs a CUDA GPU (use --smoke to check the script on CPU).",
            file=sys.stderr,
        )
        return 2
    sys.path.insert(0, str(ROOT))
    import triton

    from csrc_triton import paged_attention as kernels

    dtype = DTYPES[args.dtype]
    slug = gpu.lower().replace(" ", "-")
    out = args.out or ROOT / "benchmarks" / "results" / f"kernels-{slug}.json"
    out.parent.mkdir(parents=True, exist_ok=True)

    rows = throughput(kernels, args, dtype, device)  # first, so the kernels autotune on the benchmark shape
    acc = accuracy(kernels, args, dtype, device)
    shape = f"{args.queries} queries, {args.heads}:{args.kv_heads} heads, d={args.head_dim}, page {args.page}"
    result = {
        "gpu": gpu,
        "torch": torch.__version__,
        "triton": triton.__version__,
        "dtype": args.dtype,
        "shape": {k: getattr(args, k) for k in ("queries", "keys", "heads", "kv_heads", "head_dim", "page")},
        "flops": "fwd = 4*Hq*D*Lq*Lk (full rectangle); fwd+bwd = 3.5 * fwd",
        "accuracy": {"shape": args.accuracy_shape, "errors_vs_fp32": acc},
        "throughput": rows,
        "oomb_over_best_reference": ratios(rows),
    }
    out.write_text(json.dumps(result, indent=2))
    plot(rows, out.with_suffix(".png"), f"{gpu}, {args.dtype}: {shape}")

    print(
        f"accuracy ({args.accuracy_shape[0]} queries, {args.accuracy_shape[1]} keys), max abs error vs fp32:"
    )
    for name, e in acc.items():
        verdict = "ok" if e["ok"] else "FAIL (> 2x plain torch)"
        print(f"  {name:4s} oomb {e['oomb']:.3e}  plain {args.dtype} {e['plain_torch']:.3e}  {verdict}")
    print(f"\nwrote {out} and {out.with_suffix('.png').name}\n{gpu}, {args.dtype}, {shape}")
    print(f"{'keys':>7}  {'method':38s} {'fwd ms':>9} {'fwd+bwd ms':>11} {'TFLOP/s':>8}")
    for r in rows:
        if "error" in r:
            print(f"{r['keys']:>7}  {r['method']:38s} {r['error'][:60]}")
        else:
            print(
                f"{r['keys']:>7}  {r['method']:38s} {r['fwd_ms']:9.2f} {r['fwd_bwd_ms']:11.2f} {r['fwd_bwd_tflops']:8.1f}"
            )
    for lk, ratio in result["oomb_over_best_reference"].items():
        print(f"{lk:>7}  oomb / fastest reference (fwd+bwd): " + (f"{ratio:.2f}x" if ratio else "n/a"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
