"""One training step on CPU: OOMB (one chunk and several) next to Hugging Face + SDPA, in the same run.

A randomly initialised 4-layer Llama (hidden 256, 8 query / 2 KV heads of 32, float32) takes forward + backward of
one sequence per case; every method runs once to warm up, then ``--repeats`` timed steps (the median is reported):

- ``hf``: transformers with SDPA attention (no checkpointing);
- ``oomb``: the OOMB engine at ``chunk_size``, per ``--backends`` value of ``attention_backend`` (``auto``: the fused
  CPU path; ``auto+reuse``: the same with ``reuse_attention=True``, the backward sweep taking the forward sweep's
  attention results; ``auto+sparse``: sparse attention, ``page_budget=SPARSE_BUDGET`` pages of 128 before each
  chunk; ``auto+packed``: the sequence packed from documents of ``PACKED_DOCUMENT`` tokens (``position_ids`` that
  restart; HF's row stays the unpacked step); ``torch``: the plain reference, the oracle, measured only up to
  ``--torch-up-to`` tokens: it is slow).

Writes the rows ``{"method", "context", "chunk", "backend", "step_s", "vs_hf"}`` as JSON (``--out``) and a Markdown
table next to it, and prints the table last.

    PYTHONPATH=$PWD python benchmarks/cpu_step.py --out benchmarks/results/cpu-step.json
    PYTHONPATH=$PWD python benchmarks/cpu_step.py --threads 1 --out benchmarks/results/cpu-step-1thread.json
    PYTHONPATH=$PWD python benchmarks/cpu_step.py --cases 8192:1024 --backends auto auto+sparse auto+packed \
        --out benchmarks/results/cpu-step-terms.json
    PYTHONPATH=$PWD python benchmarks/cpu_step.py --window 512 --cases 8192:1024 --backends auto \
        --out benchmarks/results/cpu-step-window.json
    PYTHONPATH=$PWD python benchmarks/cpu_step.py --window 256 --cases 8192:1024 --backends auto+packed \
        --out benchmarks/results/cpu-step-window-packed.json
    PYTHONPATH=$PWD python benchmarks/cpu_step.py --cases 256:256 --repeats 1 --out /tmp/cpu-step.json  # smoke
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

import torch

from benchmarks.common import timed, write_json
from lightning_oomb.engine import OOMBConfig, OOMBEngine
from lightning_oomb.integrations.hf import HFChunkModel

LLAMA = dict(hidden_size=256, intermediate_size=688, num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=2,
             head_dim=32, vocab_size=1024, max_position_embeddings=16384)  # fmt: skip
CASES = ("2048:2048", "8192:8192", "8192:1024")  # context:chunk
SPARSE_BUDGET = 8  # auto+sparse: pages before each chunk (of 128 tokens)
PACKED_DOCUMENT = 512  # auto+packed: tokens per document


def build_llama(window: int | None = None) -> torch.nn.Module:
    """The benchmark's Llama; with ``window`` its Mistral twin (the same shapes, a sliding window of that many
    keys in every layer, HF's SDPA masked to it)."""
    from transformers import LlamaConfig, LlamaForCausalLM, MistralConfig, MistralForCausalLM

    torch.manual_seed(0)
    if window is not None:
        config = MistralConfig(**LLAMA, sliding_window=window, attn_implementation="sdpa")
        return MistralForCausalLM(config).train()
    return LlamaForCausalLM(LlamaConfig(**LLAMA, attn_implementation="sdpa")).train()


def median_step(step, repeats: int) -> float:
    """Seconds of ``step``: one warm-up run, then the median of ``repeats`` timed runs."""
    step()
    return statistics.median(timed(step, torch.device("cpu"))[0] for _ in range(repeats))


def hf_step(model, ids):
    def step():
        model.zero_grad(set_to_none=False)
        model(input_ids=ids, labels=ids).loss.backward()

    return step


def oomb_step(model, ids, chunk: int, backend: str):
    """``backend``: an ``attention_backend``, ``+reuse`` appended for ``reuse_attention=True``, ``+sparse`` for
    ``page_budget=SPARSE_BUDGET``, ``+packed`` for documents of ``PACKED_DOCUMENT`` tokens."""
    name, _, extra = backend.partition("+")
    config = OOMBConfig(chunk_size=chunk, attention_backend=name, reuse_attention=extra == "reuse",
                        page_budget=SPARSE_BUDGET if extra == "sparse" else None)  # fmt: skip
    engine = OOMBEngine(HFChunkModel(model), config)
    packed = {"position_ids": torch.arange(ids.shape[1])[None] % PACKED_DOCUMENT} if extra == "packed" else {}

    def step():
        model.zero_grad(set_to_none=False)
        engine.loss(ids, **packed).backward()

    return step


def run(
    cases: list[tuple[int, int]],
    backends: list[str],
    repeats: int,
    torch_up_to: int,
    window: int | None = None,
) -> list[dict]:
    model, rows, hf = build_llama(window), [], {}
    for context, chunk in cases:
        ids = torch.randint(
            0, LLAMA["vocab_size"], (1, context), generator=torch.Generator().manual_seed(context)
        )
        if context not in hf:
            hf[context] = median_step(hf_step(model, ids), repeats)
            rows.append({"method": "hf", "context": context, "chunk": None, "backend": "sdpa",
                         "step_s": hf[context], "vs_hf": 1.0})  # fmt: skip
            print(json.dumps(rows[-1]), flush=True)
        for backend in backends:
            if backend == "torch" and context > torch_up_to:
                continue
            seconds = median_step(oomb_step(model, ids, chunk, backend), repeats)
            rows.append({"method": "oomb", "context": context, "chunk": chunk, "backend": backend,
                         "step_s": seconds, "vs_hf": seconds / hf[context]})  # fmt: skip
            print(json.dumps(rows[-1]), flush=True)
    return rows


def table(rows: list[dict]) -> str:
    lines = ["| method | context | chunk | attention | step s | vs HF |", "|---|---|---|---|---|---|"]
    for r in rows:
        chunk = "" if r["chunk"] is None else r["chunk"]
        lines.append(f"| {r['method']} | {r['context']} | {chunk} | {r['backend']} | {r['step_s']:.3f} | "
                     f"{r['vs_hf']:.2f}x |")  # fmt: skip
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--cases", nargs="+", default=list(CASES), help="context:chunk pairs")
    parser.add_argument("--backends", nargs="+", default=["auto", "auto+reuse", "torch"],
                        help="attention_backend values (+reuse, +sparse, +packed: see above)")  # fmt: skip
    parser.add_argument("--torch-up-to", type=int, default=2048, help="longest context the reference runs at")
    parser.add_argument("--threads", type=int, help="torch's intra-op threads (default: torch's choice)")
    parser.add_argument("--repeats", type=int, default=3, help="timed steps per case after one warm-up step")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/cpu-step.json"))
    parser.add_argument("--note", default="", help="a line for the table (e.g. what else loaded the machine)")
    parser.add_argument(
        "--window", type=int, help="the model's Mistral twin with a sliding window of this many keys"
    )
    args = parser.parse_args(argv)
    cases = [tuple(int(x) for x in case.split(":")) for case in args.cases]
    if args.threads:
        torch.set_num_threads(args.threads)
    rows = run(cases, args.backends, args.repeats, args.torch_up_to, args.window)
    meta = {"threads": torch.get_num_threads(), "torch": torch.__version__, "model": LLAMA, "note": args.note,
            "window": args.window}  # fmt: skip
    write_json(args.out, {"meta": meta, "rows": rows})
    print(write_table(args.out.with_suffix(".md"), meta, rows))


def write_table(path: Path, meta: dict, rows: list[dict]) -> str:
    """The Markdown table of ``rows`` under a line saying how they were measured; returns the table."""
    text = table(rows)
    note = f" {meta['note']}" if meta.get("note") else ""
    if meta.get("window"):
        note = f" The model's Mistral twin, a sliding window of {meta['window']} keys in every layer.{note}"
    path.write_text(
        f"One step (forward + backward), float32, {meta['threads']} CPU threads, torch {meta['torch']}; "
        f"`{Path(__file__).name}`.{note}\n\n{text}"
    )
    return text


if __name__ == "__main__":
    main()
