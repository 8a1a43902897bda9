"""Gradient fidelity of 16-bit OOMB training against float64, by number of chunks (CPU, 8 minutes on 2 busy cores).

One step of a tiny random Qwen2 (2 layers, the tests' shape) on one 4096-token sequence, all from the same
bf16-rounded weights: the float64 gradient is the truth; plain full-sequence training in ``bf16-true`` and in
``bf16-mixed`` (autocast) are the references; OOMB runs ``bf16-mixed``, and ``bf16-true`` with
``grad_accumulation="native"`` (autograd adds each chunk's gradient into the bf16 ``.grad``), ``"float32"``
(float32 sums, written back once per sweep; what the default ``"auto"`` picks when they fit) and ``"float32-host"`` (matrices: bf16 sums over windows of 16
chunks, added in float32 in host memory; vectors: float32 sums), and ``"float32"`` with bf16 gradient pages
(``kv_grad_dtype="bfloat16"``: every later chunk's dK/dV added into a bf16 page), at 1, 16, 64, 256 and 1024
chunks. Reported per run: the
relative L2 error of all parameters' gradients together and its ratio to plain training of the same precision,
the same ratio for the final norm's weight alone (whose gradient every token adds to: per-chunk rounding shows
there first) and the worst parameter's. One thread, so rounding is reproducible. (``bf16-mixed`` keeps float32
parameters: ``grad_accumulation`` does not apply to it.)

``--host-windows W ...`` runs, instead, ``"float32-host"`` with windows of each ``W`` chunks (the chunks a matrix's
bf16 ``.grad`` sums between flushes; the engine's is ``HOST_FLUSH_CHUNKS``, 16): the error a longer window would
cost.

Writes JSON (``--out``) and a Markdown table next to it.

    PYTHONPATH=$PWD python benchmarks/bf16_grad_fidelity.py --out benchmarks/results/bf16-grad-fidelity-cpu.json
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from benchmarks.common import build_qwen2, write_json
from lightning_oomb.engine import OOMBConfig, OOMBEngine
from lightning_oomb.integrations.hf import HFChunkModel

MODEL = dict(hidden_size=56, intermediate_size=64, num_hidden_layers=2, num_attention_heads=7,
             num_key_value_heads=1, head_dim=8, vocab_size=97, initializer_range=0.2)  # fmt: skip
NORM = "model.norm.weight"
# (precision, grad_accumulation, kv_grad_dtype)
RUNS = (
    ("bf16-mixed", "float32", "float32"),
    ("bf16-true", "native", "float32"),
    ("bf16-true", "float32", "float32"),
    ("bf16-true", "float32-host", "float32"),
    ("bf16-true", "float32", "bfloat16"),
)


def plain_loss(model, ids: torch.Tensor) -> torch.Tensor:
    """Full-sequence training's mean next-token loss (logits in the model's dtype, as HF computes them)."""
    logits = model(input_ids=ids).logits[:, :-1]
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), ids[:, 1:].reshape(-1))


def gradients(model, precision: str, step) -> dict[str, torch.Tensor]:
    """The float64 gradients of one ``step(model)`` under ``precision`` (autocast for ``*-mixed``)."""
    model.zero_grad(set_to_none=True)
    autocast = (
        torch.autocast("cpu", torch.bfloat16) if precision == "bf16-mixed" else contextlib.nullcontext()
    )
    with autocast:
        loss = step(model)
    loss.backward()
    return {n: p.grad.double() for n, p in model.named_parameters()}


def errors(got: dict, truth: dict) -> tuple[float, dict[str, float]]:
    """(relative L2 error of all gradients together, each parameter's relative error)."""
    squares = sum((got[n] - t).square().sum() for n, t in truth.items())
    total = (squares / sum(t.square().sum() for t in truth.values())).sqrt().item()
    return total, {n: ((got[n] - t).norm() / t.norm()).item() for n, t in truth.items()}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--seq-len", type=int, default=4096)
    parser.add_argument("--chunks", type=int, nargs="+", default=[1, 16, 64, 256, 1024])
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--host-windows", type=int, nargs="*", default=[])
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/bf16-grad-fidelity-cpu.json"))
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    torch.manual_seed(args.seed)
    cpu = torch.device("cpu")
    base = build_qwen2(cpu, torch.bfloat16, MODEL)
    models = {dtype: copy.deepcopy(base).to(dtype) for dtype in (torch.float64, torch.float32)}
    models[torch.bfloat16] = base
    gen = torch.Generator().manual_seed(args.seed)
    ids = torch.randint(0, MODEL["vocab_size"], (1, args.seq_len), generator=gen)

    truth = gradients(models[torch.float64], "64-true", lambda m: plain_loss(m, ids))
    plain = {}
    for precision, dtype in (("bf16-true", torch.bfloat16), ("bf16-mixed", torch.float32)):
        plain[precision] = errors(gradients(models[dtype], precision, lambda m: plain_loss(m, ids)), truth)
    rows = []
    runs = [(p, a, g, None) for p, a, g in RUNS]
    if args.host_windows:
        runs = [("bf16-true", "float32-host", "float32", w) for w in args.host_windows]
    for precision, accumulation, grad_pages, window in runs:
        model = models[torch.bfloat16 if precision == "bf16-true" else torch.float32]
        for chunks in args.chunks:
            chunk = args.seq_len // chunks
            config = OOMBConfig(
                chunk, min(chunk, 16), grad_accumulation=accumulation, kv_grad_dtype=grad_pages
            )
            engine = OOMBEngine(HFChunkModel(model), config)
            label = accumulation if window is None else f"{accumulation}, windows of {window}"
            if window is not None:
                engine.host_grads.every = window
            start = time.perf_counter()
            total, each = errors(gradients(model, precision, lambda m, e=engine: e.loss(ids)), truth)
            ref_total, ref_each = plain[precision]
            worst = max(each, key=lambda n: each[n] / ref_each[n])
            rows.append({
                "precision": precision, "accumulation": label, "kv_grad_dtype": grad_pages, "chunks": chunks,
                "chunk_size": chunk,
                "error": total, "plain_error": ref_total, "ratio": total / ref_total,
                "norm_ratio": each[NORM] / ref_each[NORM],
                "worst_parameter": worst, "worst_ratio": each[worst] / ref_each[worst],
                "seconds": round(time.perf_counter() - start, 2),
            })  # fmt: skip
            r = rows[-1]
            print(f"{precision} {label:>7} {grad_pages:>8} pages {chunks:>5} chunks: error {total:.4f} = {r['ratio']:.2f}x plain, "
                  f"final norm {r['norm_ratio']:.2f}x, worst {worst} {r['worst_ratio']:.2f}x ({r['seconds']} s)",
                  flush=True)  # fmt: skip
            command = "benchmarks/bf16_grad_fidelity.py " + " ".join(sys.argv[1:] if argv is None else argv)
            write_json(args.out, {"command": command, "seq_len": args.seq_len, "model": MODEL,
                                  "torch": torch.__version__, "rows": rows})  # fmt: skip
    args.out.with_suffix(".md").write_text(
        f"`PYTHONPATH=$PWD python {command}`\n\n{table(rows, args.seq_len)}\n"
    )
    print(table(rows, args.seq_len))
    return 0


def table(rows: list[dict], seq_len: int) -> str:
    lines = [
        f"Gradient error against float64, one {seq_len}-token step of a tiny Qwen2; x plain = over full-sequence "
        "training in the same precision ("
        + ", ".join(f"{p}: {e:.4f}" for p, e in {r["precision"]: r["plain_error"] for r in rows}.items())
        + ").",
        "",
        "| precision | grad_accumulation | gradient pages | chunks | error | x plain | final norm's x plain | worst parameter "
        "| its x plain |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(f"| {r['precision']} | {r['accumulation']} | {r.get('kv_grad_dtype', 'float32')} | {r['chunks']} | "
                     f"{r['error']:.4f} | "
                     f"{r['ratio']:.2f} | {r['norm_ratio']:.2f} | {r['worst_parameter']} | {r['worst_ratio']:.2f} |")  # fmt: skip
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
