"""Engine option combinations for the float64 tests: seeded cases that each draw a family, a batch layout, a chunk
geometry and a value of every engine option (``tests/engine/test_option_combinations.py``, and under context
parallelism ``tests/parallel/test_context_combinations.py``)."""

from __future__ import annotations

import random
import zlib
from dataclasses import dataclass, field

import torch

from lightning_oomb.engine import OOMBConfig, OOMBEngine
from lightning_oomb.integrations.hf import HFChunkModel
from tests.helpers.models import build_causal_lm, build_family, float64_norms, grads_of

SEED = 20261204
FAMILIES = (
    "qwen2",
    "mistral",
    "qwen3",
    "gemma2",
    "gemma3",
    "gpt_oss",
    "phi3_longrope",
    "llama_dynamic",
    "granite",
)
LAYOUTS = ("one document", "packed", "right-padded", "packed and padded")
OPTIONS = {  # engine options and the values drawn
    "layer_checkpointing": (False, True, "auto"),
    "attention_backend": ("torch", "cpu"),
    "reuse_attention": (False, True, 1),
    "mlp_tile": (None, 8),
    "loss_block": (4, 1024),
    "offload": (False, True),
    "page_budget": (None, 10_000, 1, 3),  # None and more pages than any sequence has: dense
}
GEOMETRY = ((8, 4), (16, 8), (16, 16), (32, 8))  # (chunk_size, page_size)


@dataclass
class Case:
    family: str
    layout: str
    geometry: tuple[int, int]
    options: dict = field(default_factory=dict)

    def __str__(self) -> str:
        named = ",".join(f"{k}={v}" for k, v in self.options.items())
        return f"{self.family}-{self.layout.replace(' ', '_')}-{self.geometry[0]}/{self.geometry[1]}-{named}"


def draw(
    seed: int, n: int, families=FAMILIES, layouts=LAYOUTS, options=OPTIONS, geometries=GEOMETRY
) -> list[Case]:
    """``n`` cases: each option's values repeated evenly over them (every value drawn once ``n`` reaches its count),
    shuffled per option by ``seed``, so the cases pair the values at random."""
    rng = random.Random(seed)

    def column(values) -> list:
        spread = (list(values) * (n // len(values) + 1))[:n]
        rng.shuffle(spread)
        return spread

    columns = [column(families), column(layouts), column(geometries)]
    drawn = {name: column(values) for name, values in options.items()}
    return [Case(*(c[i] for c in columns), {name: v[i] for name, v in drawn.items()}) for i in range(n)]


def batch_of(layout: str, vocab: int, gen: torch.Generator) -> dict[str, torch.Tensor]:
    """Two rows of ``layout``, labels ignoring ~10 % of the targets; documents cross chunk and page boundaries."""
    docs = {  # each row's document lengths; padding fills a row to the longest
        "one document": [[51], [51]],
        "packed": [[13, 29, 9], [21, 30]],
        "right-padded": [[51], [37]],
        "packed and padded": [[13, 29], [21, 5, 9]],
        "a lone last token": [[49], [49]],  # 1 more than a multiple of every chunk of 8 and 16
    }[layout]
    lengths = [sum(row) for row in docs]
    n = max(lengths)
    ids = torch.randint(0, vocab, (2, n), generator=gen)
    labels = ids.masked_fill(torch.rand(2, n, generator=gen) < 0.1, -100)
    batch = {"input_ids": ids, "labels": labels}
    if "packed" in layout:
        batch["position_ids"] = torch.stack(
            [
                torch.cat([torch.arange(d) for d in row] + [torch.arange(row[-1], row[-1] + n - sum(row))])
                for row in docs
            ]
        )
    if "padded" in layout:
        batch["attention_mask"] = (torch.arange(n)[None] < torch.tensor(lengths)[:, None]).long()
    return batch


def build(family: str, dtype=torch.float64):
    """The family's tiny model (its norms in its dtype: :func:`~tests.helpers.models.float64_norms`) and its
    vocabulary size."""
    tiny = build_causal_lm if family in ("qwen2", "mistral", "qwen3") else build_family
    model = tiny(family, dtype=dtype)
    float64_norms(model)
    return model, model.config.vocab_size


def oomb_step(model, case: Case, batch: dict, context=None):
    """One OOMB step of ``case``'s options (across ``context``, a context group, if given): its loss, the gradients
    and the sparse selections it made."""
    options = dict(case.options)
    if options.pop("offload"):  # every layer's pages stream through 3 device buffers
        options.update(offload=True, hbm_budget=0, staging_buffers=3)
    chunked = HFChunkModel(model, layer_checkpointing=options["layer_checkpointing"])
    loss = OOMBEngine(chunked, OOMBConfig(*case.geometry, **options), context=context).loss(**batch)
    selections = loss.grad_fn.step.sparse.selections if options["page_budget"] else {}
    loss.backward()
    got = grads_of(model)
    model.zero_grad()
    return loss.detach(), got, selections


def seeded(case: Case) -> torch.Generator:
    return torch.Generator().manual_seed(zlib.crc32(str(case).encode()))
