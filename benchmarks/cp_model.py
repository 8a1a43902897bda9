"""Context parallelism's model: predicted per-GPU tokens/s and memory for 1, 2, 4 and 8 GPUs at 256K and 1M tokens.

**1. Counted.** Two gloo processes run one OOMB step of a small bf16 Qwen2 through the context-parallel engine at
two sequence lengths, with and without layer checkpointing, and read the bytes each rank contributed to each
collective (:attr:`ContextGroup.sent`). :func:`sent_per_chunk` is the formula the prediction uses; the script
exits 1 unless it equals every count exactly, and the counts per layer and chunk do not depend on the length.

**2. Predicted** (no GPU rates are measured yet, so the compute rates are stated assumptions, in the JSON):
per GPU and step, the dense and attention FLOPs of one OOMB step (:func:`lightning_oomb.engine.step_time.step_flops`,
the planner's model) divided by the group size ``R``; plus the collectives on the wire (ring algorithms: an all-gather sends ``R - 1`` parts, a reduce-scatter
``(R - 1) / R`` of its buffer, an all-reduce twice that), not overlapped with compute (they are synchronous as
built), with a fixed latency per collective; plus the once-per-step gradient all-reduce. Memory per GPU is
:func:`lightning_oomb.plan` with ``context_parallel=R`` (weights, gradients and AdamW states are replicated on
every GPU: context parallelism divides the pages, not the model).

Writes JSON (``--out``), a PNG (speed-up vs GPUs) and a Markdown table next to it.

    PYTHONPATH=$PWD python benchmarks/cp_model.py --out benchmarks/results/cp-model.json
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import torch

from benchmarks.common import GIB, build_qwen2, write_json
from lightning_oomb import plan
from lightning_oomb.engine import OOMBConfig, OOMBEngine
from lightning_oomb.engine.context import ContextGroup
from lightning_oomb.engine.model_shape import model_shape
from lightning_oomb.engine.planner import Machine
from lightning_oomb.engine.step_time import StepRates, context_seconds, context_sent, step_flops
from lightning_oomb.integrations.hf import HFChunkModel
from tests.helpers.distributed import run_ranks

QWEN25_7B = dict(hidden_size=3584, intermediate_size=18944, num_hidden_layers=28, num_attention_heads=28,
                 num_key_value_heads=4, vocab_size=152064, max_position_embeddings=1 << 20, rope_theta=1e6,
                 tie_word_embeddings=False)  # fmt: skip
SMALL = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
             head_dim=16, vocab_size=101, max_position_embeddings=4096)  # fmt: skip
LINKS = {"nvlink": 450e9, "pcie": 55e9}  # bytes/s one way per GPU (H100/H200 NVLink 4; PCIe 5 x16)
ASSUMED = {  # H200, bf16: stated, not measured (benchmarks/results holds no GPU step yet)
    "dense_flops": 600e12,  # GEMMs at ~60 % of the 989 TFLOP/s peak
    "attention_flops": 250e12,  # ~0.6x compiled FlexAttention's ~404 TFLOP/s (issue 13's estimate as built)
    "latency_s": {"nvlink": 20e-6, "pcie": 40e-6},  # per collective call
}
GPUS = (1, 2, 4, 8)
ATTENTION_FORWARDS = 2  # per layer, chunk and step, with or without layer checkpointing (attention.Kept)
LENGTHS = (262144, 1048576)


# ---------------------------------------------------------------------------------------------- the formula
def sent_per_chunk(shape, batch: int, rows: list[int], q_bytes: int, acc_bytes: int, forwards: int) -> dict:
    """The planner's bytes one rank contributes per layer and chunk (:func:`context_sent`)."""
    return context_sent(shape.num_heads, shape.head_dim, batch, rows, q_bytes, acc_bytes, forwards)


def link_rates(link: str) -> StepRates:
    """The assumed compute rates with ``link``'s bandwidth and latency."""
    return StepRates(ASSUMED["dense_flops"], ASSUMED["attention_flops"], 25e9, link_bytes=LINKS[link],
                     link_latency_s=ASSUMED["latency_s"][link])  # fmt: skip


# ------------------------------------------------------------------------------------------------ the count
def _count(rank, world, seq, checkpointing):
    torch.manual_seed(0)
    model = build_qwen2(torch.device("cpu"), torch.bfloat16, SMALL)
    ids = torch.randint(0, SMALL["vocab_size"], (1, seq), generator=torch.Generator().manual_seed(seq))
    engine = OOMBEngine(HFChunkModel(model, layer_checkpointing=checkpointing), OOMBConfig(64, 16),
                        context=ContextGroup.of())  # fmt: skip
    engine.loss(ids).backward()
    return dict(engine.context.sent)


def count(world: int = 2, lengths=(256, 512), checkpointing_modes=(False, True)) -> list[dict]:
    """The counted bytes next to :func:`sent_per_chunk` for real 2-rank CPU steps (see the module docstring)."""
    shape = model_shape(SMALL | {"model_type": "qwen2"})
    rows = []
    for checkpointing in checkpointing_modes:
        for seq in lengths:
            with tempfile.TemporaryDirectory() as tmp:
                counted = run_ranks(_count, world, Path(tmp), seq, checkpointing, timeout_s=300)
            chunks, layers = seq // 64, SMALL["num_hidden_layers"]
            per = sent_per_chunk(shape, 1, [64 // world] * world, 2, 4, ATTENTION_FORWARDS)
            for rank, sent in enumerate(counted):
                rows.append({"seq_len": seq, "layer_checkpointing": checkpointing, "rank": rank,
                             "counted_per_layer_chunk": {k: v / (chunks * layers) for k, v in sent.items()},
                             "formula_per_layer_chunk": per,
                             "equal": all(sent.get(k, 0) == v * chunks * layers for k, v in per.items())})  # fmt: skip
    return rows


# ------------------------------------------------------------------------------------------- the prediction
def predict(seq: int, gpus: int, link: str, chunk: int = 4096, checkpointing: bool = True) -> dict:
    """One step of Qwen2.5-7B (bf16-true, AdamW) on ``seq`` tokens shared by ``gpus`` GPUs over ``link``."""
    shape = model_shape(QWEN25_7B | {"model_type": "qwen2"})
    forwards = ATTENTION_FORWARDS
    config = OOMBConfig(chunk, 128, kv_grad_dtype="bfloat16", layer_checkpointing=checkpointing)
    dense, attention = step_flops(shape, seq, config)
    compute = (dense / ASSUMED["dense_flops"] + attention / ASSUMED["attention_flops"]) / gpus
    sent = sent_per_chunk(shape, 1, [chunk // gpus] * gpus, 2, 4, forwards)
    rates, grads = link_rates(link), shape.parameter_count() * 2
    comm = context_seconds(shape, seq, config, 1, gpus, rates, 2, 4, 0) if gpus > 1 else 0.0
    grad_sync = 2 * (gpus - 1) / gpus * grads / LINKS[link]
    step = compute + comm + grad_sync
    machine = Machine("cuda", 141 * 10**9, 128 * GIB)
    on_gpu = plan(QWEN25_7B | {"model_type": "qwen2"}, seq, 1, config, "bf16-true", "adamw", machine,
                  suggest=False, context_parallel=gpus)  # fmt: skip
    offload = OOMBConfig(chunk, 128, kv_grad_dtype="bfloat16", layer_checkpointing=checkpointing,
                         offload=True, hbm_budget=0)  # fmt: skip
    hosted = plan(QWEN25_7B | {"model_type": "qwen2"}, seq, 1, offload, "bf16-true", "adamw", machine,
                  suggest=False, context_parallel=gpus)  # fmt: skip
    return {
        "seq_len": seq, "gpus": gpus, "link": link, "chunk_size": chunk, "attention_forwards": forwards,
        "compute_s": compute, "communication_s": comm, "gradient_all_reduce_s": grad_sync, "step_s": step,
        "tokens_per_s": seq / step, "tokens_per_s_per_gpu": seq / step / gpus,
        "sent_per_layer_chunk_bytes": sum(sent.values()) if gpus > 1 else 0,
        "peak_gib_pool_on_gpu": on_gpu.peak_device / GIB, "pool_gib": on_gpu.device["kv_hbm"] / GIB,
        "peak_gib_offloaded": hosted.peak_device / GIB, "host_gib_offloaded": hosted.host_tier / GIB,
    }  # fmt: skip


def table(rows: list[dict]) -> str:
    out = ["| tokens | GPUs | link | step (s) | tok/s | tok/s per GPU | speed-up | comm share | peak GiB (pool on GPU) "
           "| peak GiB / host GiB (offloaded) |", "|---|---|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for r in rows:
        one = next(
            x for x in rows if x["seq_len"] == r["seq_len"] and x["gpus"] == 1 and x["link"] == r["link"]
        )
        out.append(
            f"| {r['seq_len'] // 1024}K | {r['gpus']} | {r['link']} | {r['step_s']:.1f} | {r['tokens_per_s']:,.0f} "
            f"| {r['tokens_per_s_per_gpu']:,.0f} | {one['step_s'] / r['step_s']:.2f}x "
            f"| {(r['communication_s'] + r['gradient_all_reduce_s']) / r['step_s']:.1%} "
            f"| {r['peak_gib_pool_on_gpu']:.1f} | {r['peak_gib_offloaded']:.1f} / {r['host_gib_offloaded']:.1f} |"
        )
    return "\n".join(out)


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for seq in LENGTHS:
        for link, style in (("nvlink", "-"), ("pcie", "--")):
            mine = [r for r in rows if r["seq_len"] == seq and r["link"] == link]
            ax.plot([r["gpus"] for r in mine], [mine[0]["step_s"] / r["step_s"] for r in mine], style, marker="o",
                    label=f"{seq // 1024}K, {link}")  # fmt: skip
    ax.plot(GPUS, GPUS, ":", color="grey", label="linear")
    ax.set(xlabel="GPUs in the context group", ylabel="speed-up (predicted)", xticks=GPUS,
           title="oomb_cp, Qwen2.5-7B, chunk 4096 (predicted)")  # fmt: skip
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/cp-model.json"))
    args = parser.parse_args(argv)
    counted = count()
    rows = [predict(seq, gpus, link) for seq in LENGTHS for link in LINKS for gpus in GPUS]
    agree = all(r["equal"] for r in counted)
    write_json(args.out, {"assumptions": ASSUMED, "links_bytes_per_s": LINKS, "counted": counted,
                          "formula_equals_count": agree, "predicted": rows})  # fmt: skip
    md = table(rows)
    args.out.with_suffix(".md").write_text(
        f"`PYTHONPATH=$PWD python benchmarks/cp_model.py --out {args.out}`\n\nPredicted, not measured (compute "
        f"rates assumed: {args.out.name}). The traffic formula equals the bytes counted in a 2-rank CPU run: {agree}.\n\n"
        f"{md}\n"
    )
    plot(rows, args.out.with_suffix(".png"))
    print(md)
    print("formula equals the counted bytes:", agree)
    return 0 if agree else 1


if __name__ == "__main__":
    sys.exit(main())
