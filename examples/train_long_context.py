"""Train a causal LM on 16K-token sequences with ``Trainer(strategy="oomb")``: the CPU demo.

    python examples/train_long_context.py                    # under a minute on 2 idle CPU cores, no download

With no arguments a tiny, randomly initialised Qwen2 (1 layer, 121K parameters) learns a long-range retrieval
task (``lightning_oomb.data.NeedleRetrievalDataset``): the answer at the end of each 16,384-token sequence is only
written in its first half, at least 8K tokens back. OOMB trains on it exactly, chunk by chunk, with activation
memory set by the chunk (2,048 tokens), not by the sequence. Because full-length CPU steps are slow, the model
first learns the task on short 512-token sequences (a length curriculum: 100 steps of 16 sequences), then trains
8 steps on full-length sequences; the held-out loss at the end is measured on fresh 16K sequences and compared
with the best loss possible without the context (``ln 8``). The report also shows throughput, peak activation
memory and KV pool size.

Real use (the text's last row is held out for the held-out loss: ``--val-rows``):

    python examples/train_long_context.py --model Qwen/Qwen2.5-0.5B --text 'corpus/*.txt' \\
        --seq-len 32768 --chunk-size 4096 --steps 100 --precision bf16-true --accelerator gpu
"""

from __future__ import annotations

import argparse
import logging
import math
import time
import warnings
from dataclasses import dataclass, field

import lightning as L
import torch
from lightning.pytorch.callbacks import Callback

from lightning_oomb import OOMBStrategy
from lightning_oomb.data import NeedleRetrievalDataModule, TextFileDataModule
from lightning_oomb.engine.memory import SavedTensorMeter
from lightning_oomb.models import CausalLMModule

# The default run; examples/configs/demo-cpu.yaml is the same run for `oomb fit` (tests keep them equal).
DEMO_MODEL = {
    "model_type": "qwen2",
    "hidden_size": 128,
    "intermediate_size": 256,
    "num_hidden_layers": 1,
    "num_attention_heads": 1,
    "num_key_value_heads": 1,
    "head_dim": 32,
    "rope_theta": 1e6,
    "tie_word_embeddings": False,
}
DEMO_TASK = {"num_values": 8, "num_filler": 16, "needle_fraction": 1 / 64, "val_samples": 4, "seed": 0}
DEMO_OPTIM = {"learning_rate": 3e-3, "warmup_steps": 10, "min_lr_ratio": 0.1, "betas": (0.9, 0.95)}
DEMO_SHORT_BATCH = 16  # warm-up sequences per step: cheap at 512 tokens, and a much smoother gradient
DEMO_CLIP = 1.0


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", help="HF hub id or local path to fine-tune (default: a tiny random Qwen2)")
    p.add_argument(
        "--text", nargs="+", help="local text files or globs to train on (default: the retrieval task)"
    )
    p.add_argument("--tokenizer", help="tokenizer for --text (default: --model)")
    p.add_argument(
        "--val-rows",
        type=int,
        help="--text: the last rows held out for the held-out loss (default 1; 0: none)",
    )
    p.add_argument("--seq-len", type=int, default=16384, help="tokens per sequence (default 16384)")
    p.add_argument("--chunk-size", type=int, default=2048, help="OOMB chunk size (default 2048)")
    p.add_argument("--steps", type=int, default=8, help="optimizer steps at --seq-len (default 8)")
    p.add_argument(
        "--short-steps",
        type=int,
        default=100,
        help=f"retrieval task: warm-up steps of {DEMO_SHORT_BATCH} sequences (default 100)",
    )
    p.add_argument("--short-len", type=int, default=512, help="retrieval task: warm-up length (default 512)")
    p.add_argument(
        "--lr",
        type=float,
        default=DEMO_OPTIM["learning_rate"],
        help=f"peak learning rate (default {DEMO_OPTIM['learning_rate']})",
    )
    p.add_argument(
        "--lora-rank",
        type=int,
        help="train rank-R LoRA adapters on every attention and MLP projection (alpha 2R; needs peft) instead of "
        "every weight",
    )
    p.add_argument("--precision", default="32-true", help="Lightning precision, e.g. bf16-true, bf16-mixed")
    p.add_argument("--accelerator", default="cpu", help="cpu, gpu or auto (default cpu)")
    p.add_argument(
        "--threads",
        type=int,
        help="CPU threads (default: 1, fastest for the tiny demo model and robust on a busy machine; torch's "
        "default for --model on a GPU, where host-side work such as float32-host gradient sums uses them)",
    )
    args = p.parse_args(argv)
    if args.text and not (args.tokenizer or args.model):
        p.error("--text needs --tokenizer (or --model, whose tokenizer is then used)")
    if args.tokenizer and not args.text:
        p.error("--tokenizer reads --text: give the text files too (the retrieval task has its own tokens)")
    if args.val_rows is not None and not args.text:
        p.error("--val-rows splits --text: the retrieval task validates on fresh sequences of its own")
    if (args.val_rows or 0) < 0:
        p.error("--val-rows must be at least 0")
    if args.text and args.val_rows is None:
        args.val_rows = 1
    if args.threads is None and not (args.model and args.accelerator != "cpu" and torch.cuda.is_available()):
        args.threads = 1
    if not args.text and args.short_steps and args.short_len > args.seq_len:
        p.error(
            f"--short-len {args.short_len} is longer than --seq-len {args.seq_len}: the warm-up is the short part"
        )
    for name in ("steps", "seq_len", "chunk_size", "lora_rank"):
        if getattr(args, name) is not None and getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be at least 1")
    return args


def build_data(args: argparse.Namespace) -> NeedleRetrievalDataModule | TextFileDataModule:
    if args.text:
        return TextFileDataModule(
            args.text, args.tokenizer or args.model, seq_len=args.seq_len, val_rows=args.val_rows
        )
    return NeedleRetrievalDataModule(
        seq_len=args.seq_len,
        train_samples=args.steps,
        short_seq_len=args.short_len,
        short_samples=args.short_steps * DEMO_SHORT_BATCH,
        short_batch_size=DEMO_SHORT_BATCH,
        **DEMO_TASK,
    )


def build_model(args: argparse.Namespace, vocab_size: int) -> CausalLMModule:
    optim = {**DEMO_OPTIM, "learning_rate": args.lr}
    if args.lora_rank:
        optim["lora"] = {
            "r": args.lora_rank,
            "lora_alpha": 2 * args.lora_rank,
            "target_modules": "all-linear",
        }
    if args.model:
        return CausalLMModule(model_name_or_path=args.model, **optim)
    config = {**DEMO_MODEL, "vocab_size": vocab_size, "max_position_embeddings": max(args.seq_len, 32768)}
    return CausalLMModule(config=config, **optim)


def build_trainer(
    args: argparse.Namespace,
    callbacks: list[Callback],
    data: TextFileDataModule | None = None,
    **strategy_options,
) -> L.Trainer:
    """The demo's Trainer: ``strategy="oomb"`` at ``--chunk-size`` (plus ``strategy_options``), quiet. ``data``:
    the ``--text`` data, whose training rows set the passes ``--steps`` takes (the progress bar's epochs)."""
    schedule = {"max_epochs": 1, "max_steps": args.short_steps + args.steps}
    if args.text:
        data.setup("fit")
        rows = len(data.train_dataloader())
        schedule = {
            "max_epochs": math.ceil(args.steps / rows),
            "max_steps": args.steps,
            "limit_train_batches": min(rows, args.steps),
            "check_val_every_n_epoch": None,  # validate once, after the last step (it may end an epoch early)
            "val_check_interval": args.steps,
            "limit_val_batches": None if args.val_rows else 0,
        }
    return L.Trainer(
        strategy=OOMBStrategy(chunk_size=args.chunk_size, page_size=128, **strategy_options),
        accelerator=args.accelerator,
        devices=1,
        precision=args.precision,
        **schedule,
        callbacks=callbacks,
        logger=False,
        enable_checkpointing=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        gradient_clip_val=DEMO_CLIP,
    )


@dataclass
class StepRecord:
    seq_len: int
    tokens: int
    seconds: float
    loss: float
    peak_saved_bytes: int
    pool: dict = field(default_factory=dict)


class StepMeter(Callback):
    """Per training step: tokens, wall time, loss, peak autograd-saved bytes and the engine's pool stats."""

    def __init__(self) -> None:
        self.steps: list[StepRecord] = []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self._meter = SavedTensorMeter(exclude=pl_module.parameters()).__enter__()
        self._start = time.perf_counter()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        seconds = time.perf_counter() - self._start
        self._meter.__exit__(None, None, None)
        engine = getattr(trainer.strategy, "engine", None)
        stats = engine.stats if engine is not None else None
        pool = {k: getattr(stats, k) for k in ("pool_bytes", "kv_bytes", "grad_bytes")} if stats else {}
        loss = float(outputs["loss"]) if isinstance(outputs, dict) else float(outputs)
        ids = batch["input_ids"]
        self.steps.append(StepRecord(ids.shape[1], ids.numel(), seconds, loss, self._meter.peak, pool))


def full_sequence_saved_bytes(model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> int:
    """Peak bytes autograd holds in ordinary full-sequence training: the model's own forward, with grad."""
    with SavedTensorMeter(exclude=model.parameters()) as meter:
        loss = model(**batch).loss
    del loss  # frees the graph; no backward needed to know what it held
    return meter.peak


def _mib(n: float) -> str:
    return f"{n / 2**20:,.1f} MiB"


def print_report(rows: list[tuple[str, str]]) -> None:
    """Print the final table (with rich when it is installed)."""
    try:
        from rich.console import Console
        from rich.table import Table
    except ImportError:
        width = max(len(k) for k, _ in rows)
        print("\n".join(f"{k:<{width}}  {v}" for k, v in rows))
        return
    table = Table(title="lightning_oomb demo", show_header=False)
    table.add_column(style="bold")
    table.add_column()
    for key, value in rows:
        table.add_row(key, value)
    Console().print(table)


def report_rows(args: argparse.Namespace, result: dict) -> list[tuple[str, str]]:
    saved = _mib(result["peak_saved_bytes"])
    if "full_sequence_saved_bytes" in result:
        saved += f" (full-sequence training: {_mib(result['full_sequence_saved_bytes'])})"
    steps = f"{result['full_length_steps']} at {args.seq_len:,} tokens"
    if result["warmup_steps"]:
        steps = f"{result['warmup_steps']} x {DEMO_SHORT_BATCH} at {args.short_len} tokens, then {steps}"
    rows = [
        ("model", f"{args.model or 'tiny random Qwen2'}, {result['params']:,} parameters"),
        ("sequence / chunk", f"{args.seq_len:,} / {args.chunk_size:,} tokens"),
        ("steps", steps),
        ("throughput", f"{result['tokens_per_s']:,.0f} tokens/s"),
        ("peak saved activations", saved),
    ]
    if pool := result["pool"]:
        kv, grads = _mib(pool["kv_bytes"]), _mib(pool["grad_bytes"])
        rows.append(("KV pool", f"{_mib(pool['pool_bytes'])} (K/V {kv}, gradients {grads})"))
    rows.append(("train loss, last step", f"{result['train_loss']:.3g}"))
    if result["val_loss"] is not None:
        held_out = f"fresh {args.seq_len:,}-token sequences"
        if args.text:
            held_out = f"the text's last {args.val_rows} row(s), not trained on"
        rows.append(("held-out loss", f"{result['val_loss']:.3g} ({held_out})"))
    if (base := result["baseline_loss"]) is not None:
        rows.append(
            (
                "no-context baseline",
                f"{base:.3g} = ln {round(math.exp(base))} (the best loss without retrieval)",
            )
        )
    rows.append(("time", f"{result['wall_s']:.0f} s after imports"))
    return rows


def main(argv: list[str] | None = None) -> dict:
    """Run the demo, print the report and return its numbers."""
    args = parse_args(argv)
    start = time.perf_counter()
    logging.getLogger("lightning.pytorch").setLevel(logging.WARNING)
    warnings.filterwarnings("ignore", ".*does not have many workers.*")
    warnings.filterwarnings("ignore", ".*treespec.*")  # torch/Lightning version chatter
    L.seed_everything(0, verbose=False)
    if args.threads:
        torch.set_num_threads(args.threads)

    data = build_data(args)
    module = build_model(args, data.vocab_size)
    meter = StepMeter()
    trainer = build_trainer(args, [meter], data, reuse_attention=True)  # attend once forward per step
    trainer.fit(module, data)

    full = meter.steps[0 if args.text else args.short_steps :]  # the warm-up's steps may be as long
    val = trainer.callback_metrics.get("val_loss")
    result = {
        "params": sum(p.numel() for p in module.parameters()),
        "warmup_steps": len(meter.steps) - len(full),
        "full_length_steps": len(full),
        "tokens_per_s": sum(s.tokens for s in full) / sum(s.seconds for s in full),
        "peak_saved_bytes": max(s.peak_saved_bytes for s in full),
        "pool": full[-1].pool,
        "train_loss": full[-1].loss,
        "val_loss": None if val is None else float(val),
        "baseline_loss": None if args.text else data.baseline_loss,
    }
    if not args.model:  # cheap for the tiny model; a big one could run out of memory
        loader = data.train_dataloader() if args.text else data.val_dataloader()
        batch = {k: v[:1, : args.seq_len].to(module.device) for k, v in next(iter(loader)).items()}
        result["full_sequence_saved_bytes"] = full_sequence_saved_bytes(module.model, batch)
    result["wall_s"] = time.perf_counter() - start

    print_report(report_rows(args, result))
    return result


if __name__ == "__main__":
    main()
