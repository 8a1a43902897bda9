"""Sparse attention's quality on the demo's needle-retrieval task (CPU, about 4 minutes on 2 cores).

Trains the CPU demo (``examples/train_long_context.py``: a tiny random Qwen2 learns to retrieve an answer written
at least 8K tokens back in 16,384-token sequences) twice from the same start: dense, and with ``page_budget =
--train-budget`` during the full-length steps (``OOMBSparseBudget``; the 512-token warm-up is a single chunk,
dense either way). Both models are then evaluated on held-out 16K sequences at budgets 1, 2, 4, 8, 16 pages of
128 tokens with the default page score (``bound``), at 1, 4, 16 with the OOMB paper's ``mean``, and dense — the
answer's loss, the answer accuracy (argmax of the query position's logits over the whole
vocabulary) and the selection recall (the share of dense attention mass on the attended keys, one probed query
block per chunk) — on two held-out sets: the training distribution (the answer on 1/64 of the first half's
positions: on most pages) and a single needle (the answer on one of the 112 pages before the query's chunk).

Writes JSON (``--out``), a PNG and a Markdown table next to it.

    PYTHONPATH=$PWD python benchmarks/sparse_quality.py --out benchmarks/results/sparse-quality-cpu.json
"""

from __future__ import annotations

import argparse
import importlib.util
import logging
import math
import sys
import time
import warnings
from pathlib import Path

import lightning as L
import torch

from benchmarks.common import write_json
from lightning_oomb.callbacks import OOMBSparseBudget
from lightning_oomb.data import NeedleRetrievalDataset
from lightning_oomb.engine import OOMBConfig, OOMBEngine
from lightning_oomb.integrations.hf import HFChunkModel

ROOT = Path(__file__).resolve().parents[1]
BUDGETS = (1, 2, 4, 8, 16, None)
MEAN_BUDGETS = (1, 4, 16)
PAGE = 128


def load_demo():
    spec = importlib.util.spec_from_file_location(
        "train_long_context", ROOT / "examples" / "train_long_context.py"
    )
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def train(demo, train_budget: int | None) -> torch.nn.Module:
    """The demo's training run (same seed, data and schedule); sparse at ``train_budget`` after the warm-up."""
    args = demo.parse_args([])
    L.seed_everything(0, verbose=False)
    data = demo.build_data(args)
    module = demo.build_model(args, data.vocab_size)
    callbacks = [] if train_budget is None else [OOMBSparseBudget({args.short_steps: train_budget}, 0)]
    demo.build_trainer(args, callbacks).fit(module, data)
    return module.model.eval()


class _QueryHidden(HFChunkModel):
    """The adapter, keeping the hidden state at the query position (the second-to-last token of the last chunk)."""

    def hidden_states(self, input_ids, position_ids, chunk):
        hidden = super().hidden_states(input_ids, position_ids, chunk)
        self.query = hidden[:, -2]
        return hidden


def evaluate(model, samples, budget: int | None, chunk: int, score: str = "bound") -> dict:
    adapter = _QueryHidden(model)
    engine = OOMBEngine(adapter, OOMBConfig(chunk, PAGE, page_budget=budget, page_score=score))
    engine.probe_recall = budget is not None
    losses, correct, recalls, fractions = [], 0, [], []
    with torch.inference_mode():
        for sample in samples:
            ids, labels = sample["input_ids"][None], sample["labels"][None]
            losses.append(float(engine.evaluate(ids, labels)))
            prediction = int(model.get_output_embeddings()(adapter.query).argmax(-1))
            correct += prediction == int(labels[0, -1])
            if (stats := engine.stats.sparse) is not None:
                fractions.append(stats.attended_fraction)
                if stats.selection_recall is not None:
                    recalls.append(stats.selection_recall)
    return {
        "budget": budget,
        "score": score if budget is not None else None,
        "loss": sum(losses) / len(losses),
        "accuracy": correct / len(samples),
        "attended_fraction": sum(fractions) / len(fractions) if fractions else 1.0,
        "selection_recall": sum(recalls) / len(recalls) if recalls else None,
    }


def held_out(demo, count: int) -> dict[str, list]:
    task = {k: v for k, v in demo.DEMO_TASK.items() if k not in ("val_samples", "seed")}
    seed = demo.DEMO_TASK["seed"] + 1  # the demo's held-out stream
    sets = {
        "training distribution": NeedleRetrievalDataset(count, 16384, seed=seed, **task),
        "single needle": NeedleRetrievalDataset(count, 16384, seed=seed, **{**task, "needle_fraction": 0.0}),
    }
    return {name: [ds[i] for i in range(count)] for name, ds in sets.items()}


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for (trained, task, score), group in _groups(rows).items():
        xs = [r["budget"] or 2 * BUDGETS[-2] for r in group]
        style = ("-o" if score == "bound" else ":^") if trained == "dense" else "--s"
        label = f"{trained}-trained, {task}, {score} score"
        axes[0].plot(xs, [100 * r["accuracy"] for r in group], style, label=label)
        axes[1].plot(xs, [r["loss"] for r in group], style, label=label)
    for ax, name in zip(axes, ("answer accuracy (%)", "answer loss (nats)"), strict=True):
        ax.set_xscale("log", base=2)
        ax.set_xticks([b or 2 * BUDGETS[-2] for b in BUDGETS], [str(b or "dense") for b in BUDGETS])
        ax.set_xlabel("page budget (pages of 128 tokens per query block)")
        ax.set_ylabel(name)
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=7)
    fig.suptitle("Sparse attention on 16K-token needle retrieval (tiny Qwen2, CPU)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def _groups(rows: list[dict]) -> dict:
    """Rows by (trained, task, page score); the dense row joins every score's curve of its model and task."""
    groups: dict = {}
    for r in rows:
        if r["score"] is not None:
            groups.setdefault((r["trained"], r["task"], r["score"]), []).append(r)
    for r in rows:
        if r["score"] is None:
            for key, group in groups.items():
                if key[:2] == (r["trained"], r["task"]):
                    group.append(r)
    return groups


def table(rows: list[dict], count: int, train_budget: int) -> str:
    lines = [
        f"Held-out 16K-token sequences ({count} per set; one sample = {100 / count:.1f} accuracy points). "
        f"'sparse-trained': page_budget={train_budget} for the full-length steps.",
        "",
        "| trained | held-out set | page score | budget (pages) | share of pages attended | answer accuracy | answer loss "
        "| selection recall |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        recall = "—" if r["selection_recall"] is None else f"{r['selection_recall']:.3f}"
        lines.append(
            f"| {r['trained']} | {r['task']} | {r['score'] or '—'} | {r['budget'] or 'dense'} "
            f"| {100 * r['attended_fraction']:.1f} % "
            f"| {100 * r['accuracy']:.1f} % | {r['loss']:.4f} | {recall} |"
        )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--samples", type=int, default=16, help="held-out sequences per set (default 16)")
    p.add_argument("--train-budget", type=int, default=4, help="page budget of the sparse training run")
    p.add_argument(
        "--threads", type=int, default=1, help="CPU threads (the demo model is tiny: 1 is fastest)"
    )
    p.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "sparse-quality-cpu.json")
    args = p.parse_args(argv)
    start = time.perf_counter()
    logging.getLogger("lightning.pytorch").setLevel(logging.WARNING)
    warnings.filterwarnings("ignore", ".*does not have many workers.*|.*treespec.*|.*val_dataloader.*")
    torch.set_num_threads(args.threads)
    demo = load_demo()
    chunk = demo.parse_args([]).chunk_size
    sets = held_out(demo, args.samples)
    models = {"dense": train(demo, None), "sparse": train(demo, args.train_budget)}
    rows = []
    for trained, model in models.items():
        runs = [(b, "bound") for b in BUDGETS[:-1]] + [(b, "mean") for b in MEAN_BUDGETS] + [(None, "bound")]
        if trained == "sparse":
            runs = [(args.train_budget, "bound"), (None, "bound")]
        for task, samples in sets.items():
            for budget, score in runs:
                row = {"trained": trained, "task": task, **evaluate(model, samples, budget, chunk, score)}
                rows.append(row)
                print(f"{trained:>6}-trained {task:>21} {score:>5} budget {str(budget or 'dense'):>5}: accuracy "
                      f"{100 * row['accuracy']:5.1f} %, loss {row['loss']:.4f}", flush=True)  # fmt: skip
    report = {
        "command": "PYTHONPATH=$PWD python benchmarks/sparse_quality.py " + " ".join(argv or sys.argv[1:]),
        "samples_per_set": args.samples,
        "train_budget": args.train_budget,
        "page_size": PAGE,
        "chunk_size": chunk,
        "past_pages_at_query": 16384 // PAGE - chunk // PAGE,
        "baseline_loss": math.log(demo.DEMO_TASK["num_values"]),
        "rows": rows,
        "wall_s": time.perf_counter() - start,
    }
    write_json(args.out, report)
    plot(rows, args.out.with_suffix(".png"))
    args.out.with_suffix(".md").write_text(table(rows, args.samples, args.train_budget))
    print(table(rows, args.samples, args.train_budget))
    print(f"wall time {report['wall_s']:.0f} s")
    return report


if __name__ == "__main__":
    main()
