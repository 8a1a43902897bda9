"""Which transformers causal-LM families OOMB trains exactly: every family of ``AutoModelForCausalLM``, at a tiny
width, through the adapter's checks (CPU, a few minutes).

For each family the default config is shrunk the way the adapter's self-check shrinks a model (same layers and
layer types, tiny widths) and the model is handed to ``HFChunkModel(model, verify_exactness=True)``:

- ``exact``: accepted, and its float64 twin trains identically in three chunks and whole, and whole equals the
  model's own training (``lightning_oomb.integrations.hf.support``);
- ``accepted (unchecked)``: accepted by the static rules, but the twin could not train itself (its shrunk config
  is not valid) — the self-check could not run;
- ``exact with attention dropout 0``: refused only for its default attention dropout, and exact with it set to 0
  (the fix the refusal names);
- ``refused``: with the adapter's reason (static rules or the self-check's measurement);
- ``not built``: the tiny config does not build (a multimodal wrapper, a missing optional package, ...).

Writes JSON (``--out``) and a Markdown table next to it, and prints the counts last.

    PYTHONPATH=$PWD python benchmarks/model_coverage.py --out benchmarks/results/model-coverage-cpu.json
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time
import warnings
from collections import Counter
from pathlib import Path


class _Timeout(BaseException):  # not an Exception: the adapter's own error handling must not swallow it
    pass


def _alarm(*_):
    raise _Timeout


def _completed(d: dict) -> None:
    """Fill what some families' default configs leave unset (``None``) the way their published checkpoints set it;
    their models do not build otherwise."""
    heads = d.get("num_attention_heads")
    if d.get("head_dim", 0) is None and isinstance(heads, int):
        d["head_dim"] = d["hidden_size"] // heads
    if d.get("num_key_value_heads", 0) is None:
        d["num_key_value_heads"] = heads
    for field, value in (("n_routed_experts", 4), ("num_experts_per_tok", 2), ("n_shared_experts", 1)):
        if d.get(field, 0) is None:
            d[field] = value
    if (
        d.get("layer_types", 0) is None and "num_dense_layers" in d
    ):  # LFM2-MoE: convolutions, every 4th attention
        d["layer_types"] = ["full_attention" if i % 4 == 3 else "conv" for i in range(d["num_hidden_layers"])]


DROPOUTS = ("attention_dropout", "attention_probs_dropout_prob", "attn_pdrop")


def classify(name: str, seconds: int) -> dict:
    """The family's row; one refused only for its default attention dropout is checked again with it 0 (the fix
    the refusal names): ``exact with attention dropout 0`` if it then passes, else refused with what it meets
    next."""
    row = _classify(name, seconds)
    reasons = row.get("why", "").split(". Train this model")[0].split("; ")
    if row["status"] == "refused" and all(r.split("=")[0] in DROPOUTS for r in reasons):
        again = _classify(name, seconds, no_dropout=True)
        if again["status"] == "exact":
            row.update(
                status="exact with attention dropout 0", seconds=row.get("seconds", 0) + again["seconds"]
            )
        else:  # what the user meets next, after the fix
            row["why"] = f"{'; '.join(reasons)}; with it 0: {again.get('why', again['status'])}"
    return row


def _no_dropout(d: dict) -> None:
    """Attention dropout 0 in a config dict and its sub-configs (a multimodal wrapper's text config)."""
    d.update((field, 0.0) for field in DROPOUTS if d.get(field))
    for sub in d.values():
        if isinstance(sub, dict):
            _no_dropout(sub)


def _classify(name: str, seconds: int, no_dropout: bool = False) -> dict:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from lightning_oomb.engine import OOMBConfigError
    from lightning_oomb.integrations.hf import HFChunkModel, support
    from lightning_oomb.integrations.hf.adapter import verify_exactness_of

    row = {"family": name}
    start = time.perf_counter()
    signal.alarm(seconds)
    try:
        config = AutoConfig.for_model(name)
        d = config.to_dict()
        _completed(d)
        support._tiny(d)
        if no_dropout:
            _no_dropout(d)
        tiny = type(config).from_dict(d)
        with torch.device("meta"):  # the static rules and its size first, allocating nothing
            meta = AutoModelForCausalLM.from_config(tiny)
            size = sum(p.numel() for p in meta.parameters())
        row["class"] = type(meta).__name__
        HFChunkModel(meta, verify_exactness=False)
        if size > 50_000_000:  # a config whose width the shrinking does not reach stays big
            row.update(status="not built", why=f"{size / 1e6:.0f}M parameters after shrinking")
            return row
        model = AutoModelForCausalLM.from_config(tiny)
        row["class"] = type(model).__name__
    except _Timeout:
        row.update(status="not built", why="timeout")
        return row
    except OOMBConfigError as err:
        row.update(status="refused", why=_reason(err))
        return row
    except Exception as err:
        row.update(status="not built", why=f"{type(err).__name__}: {str(err).splitlines()[0][:160]}")
        return row
    finally:
        signal.alarm(0)
    signal.alarm(seconds)
    try:
        HFChunkModel(model, verify_exactness=False)  # the static rules
        row["status"] = "exact" if verify_exactness_of(model) else "accepted (unchecked)"
    except _Timeout:
        row.update(status="not built", why="timeout")
    except OOMBConfigError as err:
        row.update(status="refused", why=_reason(err))
    except Exception as err:
        row.update(status="not built", why=f"{type(err).__name__}: {str(err).splitlines()[0][:160]}")
    finally:
        signal.alarm(0)
    row["seconds"] = round(time.perf_counter() - start, 2)
    return row


def _reason(err: Exception) -> str:
    return str(err).split(" exactly: ", 1)[-1].split(" — train it")[0][:240]


def table(rows: list[dict]) -> str:
    lines = ["| family | class | status | reason |", "|---|---|---|---|"]
    order = {
        "exact": 0,
        "exact with attention dropout 0": 1,
        "accepted (unchecked)": 2,
        "refused": 3,
        "not built": 4,
    }
    for r in sorted(rows, key=lambda r: (order[r["status"]], r["family"])):
        why = r.get("why", "").replace("|", "/")
        lines.append(f"| {r['family']} | {r.get('class', '')} | {r['status']} | {why} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--families", nargs="*", help="model types (default: every causal-LM family)")
    parser.add_argument("--seconds", type=int, default=90, help="time limit per family")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/model-coverage-cpu.json"))
    args = parser.parse_args(argv)
    os.environ.setdefault("TRITON_INTERPRET", "1")
    warnings.filterwarnings("ignore")
    import torch
    import transformers
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    transformers.logging.set_verbosity_error()
    torch.set_num_threads(1)
    signal.signal(signal.SIGALRM, _alarm)
    rows = []
    args.out.parent.mkdir(parents=True, exist_ok=True)
    for name in args.families or sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES):
        rows.append(classify(name, args.seconds))
        print(json.dumps(rows[-1]), flush=True)
        report = {
            "command": "benchmarks/model_coverage.py " + " ".join(sys.argv[1:]),
            "transformers": transformers.__version__,
            "torch": torch.__version__,
            "rows": rows,
        }
        args.out.write_text(json.dumps(report, indent=1))
    args.out.with_suffix(".md").write_text(table(rows) + "\n")
    counts = Counter(r["status"] for r in rows)
    print(f"{len(rows)} families (transformers {transformers.__version__}): " + ", ".join(
        f"{counts[s]} {s}" for s in ("exact", "exact with attention dropout 0", "accepted (unchecked)", "refused",
                                     "not built")))  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
