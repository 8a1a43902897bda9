"""Memory and time of the chunked LM-head cross-entropy with grad (the backward sweep's recompute), on the CPU.

Three losses, measured in the same run: the fused one (``engine/loss.py``: gradients made in the forward, in place),
the previous unfused one (``engine/loss.py`` of commit ``OLD_COMMIT``, read from git: value in the forward, logits
recomputed in backward, float32 weight-gradient accumulator) and a plain full-logits loss as Hugging Face computes
it (``F.linear``, ``.float()``, ``F.cross_entropy``). Per precision (``32-true``, ``bf16-true``, ``bf16-mixed``) at
a small shape: the allocation peak of forward + backward (live CPU storages, ``tests/helpers/memory.py``; the weight
not counted, the hidden states and targets counted) next to the planner's formula of each version
(``loss_backward_bytes``, new and old); the time of forward + backward and of the value alone (no grad: the forward
and eval sweeps), median of ``--repeats``; in 16-bit precisions the relative error of the hidden-state and weight
gradients against float64 on the same inputs. Then both formulas at Qwen2.5-7B's shape (152,064 x 3,584, chunks of
4,096 tokens, blocks of 1,024).

Writes JSON (``--out``), a PNG and a Markdown table next to it; about 50 s on one CPU thread.

    PYTHONPATH=$PWD python benchmarks/loss_memory.py --out benchmarks/results/loss-memory-cpu.json
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from benchmarks.common import old_module, write_json
from lightning_oomb.engine import activation_bytes, step_setup
from lightning_oomb.engine.loss import LMHead, linear_cross_entropy
from lightning_oomb.engine.model_shape import ModelShape
from lightning_oomb.models import qwen2_5_7b_config
from tests.helpers.memory import cross_entropy_peak

ROOT = Path(__file__).resolve().parents[1]
OLD_COMMIT = "e58d89f"  # the last commit with the unfused loss
MIB = 2**20
PRECISIONS = {  # weight dtype, autocast dtype
    "32-true": (torch.float32, None),
    "bf16-true": (torch.bfloat16, None),
    "bf16-mixed": (torch.float32, torch.bfloat16),
}


def plain(hidden, head, targets, block):
    """Hugging Face's causal-LM loss on materialised logits (``block`` unused)."""
    return F.cross_entropy(F.linear(hidden, head.weight).float(), targets, reduction="sum")


def formulas(old_planner, precision: str, vocab: int, hidden: int, tokens: int, block: int) -> dict[str, int]:
    """The planner's loss term, new and (with ``old_planner``) old; the old one plus the hidden states and targets,
    which it counted as saved activations (the unfused loss saved them)."""
    dtypes = step_setup.precision_dtypes(precision)
    shape = ModelShape(1, hidden, hidden, 1, 1, hidden, vocab, vocab)
    terms = {"fused": activation_bytes.loss_backward_bytes(shape, dtypes, tokens, block)}
    if old_planner is not None:
        old_shape = old_planner.ModelShape(1, hidden, hidden, 1, 1, hidden, vocab, vocab)
        old = old_planner.loss_backward_bytes(
            old_shape, old_planner.precision_dtypes(precision), tokens, block
        )
        terms["unfused"] = old + tokens * (dtypes.activation.itemsize * hidden + activation_bytes.ID_BYTES)
    return terms


def inputs(precision: str, vocab: int, hidden: int, tokens: int, dtype: torch.dtype | None = None):
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(vocab, hidden, generator=gen) / hidden**0.5
    h = torch.randn(tokens, hidden, generator=gen)
    t = torch.randint(0, vocab, (tokens,), generator=gen)
    dtype = dtype or PRECISIONS[precision][0]
    return w.to(dtype), h.to(dtype), t


def run(fn, w, h, t, block: int, grad: bool, autocast: torch.dtype | None = None):
    """One loss call (forward + backward with ``grad``); returns the hidden-state and weight gradients."""
    h, w = h.detach().requires_grad_(grad), w.detach().requires_grad_(grad)
    with torch.set_grad_enabled(grad), torch.autocast("cpu", dtype=autocast or torch.bfloat16,
                                                      enabled=autocast is not None):  # fmt: skip
        loss = fn(h, LMHead(w), t, block)
    if grad:
        loss.backward()
    return h.grad, w.grad


def seconds(fn, w, h, t, block, grad, autocast, repeats) -> float:
    run(fn, w, h, t, block, grad, autocast)  # warm-up
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        run(fn, w, h, t, block, grad, autocast)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def errors(fn, precision, vocab, hidden, tokens, block) -> dict[str, float]:
    """Relative (Frobenius) error of the hidden and weight gradients against float64 on the same rounded inputs."""
    w, h, t = inputs(precision, vocab, hidden, tokens)
    if precision.endswith("mixed"):  # the float64 reference sees what the bf16 matmuls see
        w, h = w.bfloat16().float(), h.bfloat16().float()
    got = run(fn, w, h, t, block, True, PRECISIONS[precision][1])
    want = run(plain, w.double(), h.double(), t, block, True)
    return {
        k: float((g.double() - r).norm() / r.norm()) for k, g, r in zip(("dh", "dw"), got, want, strict=True)
    }


def measure(args, methods) -> list[dict]:
    old_planner = old_module(OLD_COMMIT, "lightning_oomb/engine/planner.py") if "unfused" in methods else None
    rows = []
    for precision in ("32-true", "bf16-true", "bf16-mixed"):
        dtype, autocast = PRECISIONS[precision]
        w, h, t = inputs(precision, args.vocab, args.hidden, args.tokens)
        formula = formulas(old_planner, precision, args.vocab, args.hidden, args.tokens, args.block)
        for name, fn in methods.items():
            peak = cross_entropy_peak(
                args.vocab, args.hidden, args.tokens, args.block, dtype, autocast, loss_fn=fn
            )
            row = {
                "precision": precision,
                "method": name,
                "peak_bytes": peak,
                "formula_bytes": formula.get(name),
                "grad_s": seconds(fn, w, h, t, args.block, True, autocast, args.repeats),
                "value_s": seconds(fn, w, h, t, args.block, False, autocast, args.repeats),
                "errors": errors(fn, precision, args.vocab, args.hidden, args.tokens, args.block)
                if precision != "32-true"
                else None,
            }
            rows.append(row)
            print(f"{precision:>10} {name:>8}: peak {peak / MIB:7.1f} MiB, fwd+bwd {row['grad_s']:.3f} s, "
                  f"value {row['value_s']:.3f} s", flush=True)  # fmt: skip
    return rows


def at_7b(methods) -> list[dict]:
    if "unfused" not in methods:
        return []
    old_planner = old_module(OLD_COMMIT, "lightning_oomb/engine/planner.py")
    cfg = qwen2_5_7b_config()
    return [
        {"precision": p, **formulas(old_planner, p, cfg.vocab_size, cfg.hidden_size, 4096, 1024)}
        for p in ("32-true", "bf16-true", "bf16-mixed")
    ]


def plot(rows: list[dict], big: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    precisions = list(dict.fromkeys(r["precision"] for r in rows))
    methods = list(dict.fromkeys(r["method"] for r in rows))
    fig, axes = plt.subplots(1, 3 if big else 2, figsize=(14 if big else 10, 4))
    width = 0.8 / len(methods)
    for i, m in enumerate(methods):
        xs = [j + i * width for j in range(len(precisions))]
        by = {r["precision"]: r for r in rows if r["method"] == m}
        axes[0].bar(xs, [by[p]["peak_bytes"] / MIB for p in precisions], width, label=m)
        axes[1].bar(xs, [by[p]["grad_s"] for p in precisions], width, label=m)
    for ax, label in zip(
        axes[:2], ("peak MiB, forward + backward", "seconds, forward + backward"), strict=True
    ):
        ax.set_xticks([j + 0.4 - width / 2 for j in range(len(precisions))], precisions)
        ax.set_ylabel(label)
        ax.legend(fontsize=8)
    if big:
        for i, m in enumerate(("unfused", "fused")):
            axes[2].bar(
                [j + i * 0.4 for j in range(len(big))], [r[m] / 2**30 for r in big], 0.4, label=f"{m} formula"
            )
        axes[2].set_xticks([j + 0.2 for j in range(len(big))], [r["precision"] for r in big])
        axes[2].set_ylabel("GiB, planner's loss term")
        axes[2].set_title("Qwen2.5-7B shape, 4,096-token chunk", fontsize=9)
        axes[2].legend(fontsize=8)
    fig.suptitle("Chunked LM-head cross-entropy with grad (CPU)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def table(report: dict) -> str:
    a = report["shape"]
    vh, bv = a["vocab"] * a["hidden"], a["block"] * a["vocab"]
    lines = [
        f"`{report['command']}`",
        "",
        f"Vocabulary {a['vocab']:,} x hidden {a['hidden']}, {a['tokens']:,} tokens in blocks of {a['block']} "
        f"({report['threads']} CPU thread(s); times: median of {report['repeats']}). Peak: live CPU bytes of "
        "forward + backward with grad, weight not counted; formula: the planner's loss term of that version. "
        f"For scale: a float32 copy of the [V, H] weight is {4 * vh / MIB:.1f} MiB, one block's float32 logits "
        f"{4 * bv / MIB:.1f} MiB; errors: relative to float64 on the same inputs.",
        "",
        "| precision | loss | peak (MiB) | formula (MiB) | fwd+bwd (s) | value only (s) | dh error | dW error |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in report["rows"]:
        f = "—" if r["formula_bytes"] is None else f"{r['formula_bytes'] / MIB:.1f}"
        e = r["errors"] or {}
        dh, dw = (f"{e[k]:.2e}" if k in e else "—" for k in ("dh", "dw"))
        lines.append(f"| {r['precision']} | {r['method']} | {r['peak_bytes'] / MIB:.1f} | {f} | {r['grad_s']:.3f} "
                     f"| {r['value_s']:.3f} | {dh} | {dw} |")  # fmt: skip
    if report["qwen2_5_7b"]:
        lines += ["", "Qwen2.5-7B's shape (152,064 x 3,584), a 4,096-token chunk in blocks of 1,024: the planner's loss "
                  "term (GiB).", "", "| precision | unfused | fused |", "|---|---|---|"]  # fmt: skip
        lines += [f"| {r['precision']} | {r['unfused'] / 2**30:.2f} | {r['fused'] / 2**30:.2f} |"
                  for r in report["qwen2_5_7b"]]  # fmt: skip
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--vocab", type=int, default=16384)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--tokens", type=int, default=1024, help="tokens of the chunk")
    p.add_argument("--block", type=int, default=128, help="loss_block")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, default=1, help="CPU threads (1: steadiest on a shared machine)")
    p.add_argument(
        "--no-old", action="store_true", help=f"skip the unfused loss (needs git and {OLD_COMMIT})"
    )
    p.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "loss-memory-cpu.json")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    methods = {"fused": linear_cross_entropy, "plain": plain}
    if not args.no_old:
        methods = {
            "unfused": old_module(OLD_COMMIT, "lightning_oomb/engine/loss.py").linear_cross_entropy,
            **methods,
        }
    start = time.perf_counter()
    report = {
        "command": "PYTHONPATH=$PWD python benchmarks/loss_memory.py " + " ".join(argv or sys.argv[1:]),
        "old_commit": None if args.no_old else OLD_COMMIT,
        "torch": torch.__version__,
        "threads": args.threads,
        "repeats": args.repeats,
        "shape": {k: getattr(args, k) for k in ("vocab", "hidden", "tokens", "block")},
        "rows": measure(args, methods),
        "qwen2_5_7b": at_7b(methods),
    }
    report["wall_s"] = time.perf_counter() - start
    write_json(args.out, report)
    plot(report["rows"], report["qwen2_5_7b"], args.out.with_suffix(".png"))
    args.out.with_suffix(".md").write_text(table(report))
    print(table(report))
    return report


if __name__ == "__main__":
    main()
