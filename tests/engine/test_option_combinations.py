"""Options together (float64): each case draws a family, a batch layout and a value of every engine option, and
OOMB must equal full-sequence training of the same batch — with a small page budget, full-sequence training with
each layer's stored selection as a mask; hybrids (states carried across chunks) likewise against their own call.
The features' own tests each vary one option; this catches two that disagree.

The draw is seeded (the same cases every run; ``OOMB_COMBINATIONS=N`` draws ``N`` more, e.g. for a long local
sweep: 1,000 more agreed when this test was written, 146 s, and 200 more of the hybrids, 79 s); every value of every option is in the fixed draw, and
9 of its 12 sparse cases select fewer pages than the past holds. The models' norms compute in float64
(:func:`~tests.helpers.models.float64_norms`): Llama's own normalises in float32, which let one case in about 600
differ by a float32 ulp (3e-8) — in the model, not in the chunking."""

from __future__ import annotations

import os
import random
import zlib
from dataclasses import dataclass, field

import pytest
import torch
import torch.nn.functional as F

from lightning_oomb.engine import OOMBConfig, OOMBEngine
from lightning_oomb.integrations.hf import HFChunkModel
from tests.helpers.attention import selection_mask
from tests.helpers.models import (
    HYBRIDS,
    _reference_forward,
    assert_hybrid_exact,
    build_causal_lm,
    build_family,
    build_hybrid,
    float64_hybrid,
    float64_norms,
    grads_of,
    hybrid_full_sequence,
    max_relative_error,
)

TOL = 1e-10
SEED, CASES = 20261204, 24
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


def draw(seed: int, n: int, families=FAMILIES, layouts=LAYOUTS, options=OPTIONS) -> list[Case]:
    """``n`` cases: each option's values repeated evenly over them (every value drawn once ``n`` reaches its count),
    shuffled per option by ``seed``, so the cases pair the values at random."""
    rng = random.Random(seed)

    def column(values) -> list:
        spread = (list(values) * (n // len(values) + 1))[:n]
        rng.shuffle(spread)
        return spread

    columns = [column(families), column(layouts), column(GEOMETRY)]
    drawn = {name: column(values) for name, values in options.items()}
    return [Case(*(c[i] for c in columns), {name: v[i] for name, v in drawn.items()}) for i in range(n)]


FIXED = draw(SEED, CASES)
MORE = draw(SEED + 1, int(os.environ.get("OOMB_COMBINATIONS", "0")))
# hybrids: states carried across chunks (packing is refused for them; their attention layers' sparse selections are
# covered by the features' own tests)
HYBRID_OPTIONS = {**OPTIONS, "page_budget": (None, 10_000)}
HYBRID_LAYOUTS = ("one document", "right-padded")
HYBRID_FAMILIES = [f for f in HYBRIDS if f != "nemotron_h"]  # its norms compute in float32
HYBRID = draw(SEED, 10, HYBRID_FAMILIES, HYBRID_LAYOUTS, HYBRID_OPTIONS)
HYBRID_MORE = draw(SEED + 1, len(MORE), HYBRID_FAMILIES, HYBRID_LAYOUTS, HYBRID_OPTIONS)


def batch_of(layout: str, vocab: int, gen: torch.Generator) -> dict[str, torch.Tensor]:
    """Two rows of ``layout``, labels ignoring ~10 % of the targets; documents cross chunk and page boundaries."""
    docs = {  # each row's document lengths; padding fills a row to the longest
        "one document": [[51], [51]],
        "packed": [[13, 29, 9], [21, 30]],
        "right-padded": [[51], [37]],
        "packed and padded": [[13, 29], [21, 5, 9]],
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


def full_sequence_training(model, batch, selections=None, page: int = 0) -> torch.Tensor:
    """The loss of the model's own full-sequence call on the batch (textbook attention): each token sees its
    document's earlier tokens — of a sparse step (``selections`` by layer and chunk start), only those on the pages
    the step selected for its query block, and its own chunk's —; a document's first token and padding are no
    target."""
    ids, labels = batch["input_ids"], batch["labels"].clone()
    positions = batch.get("position_ids", torch.arange(ids.shape[1]).expand_as(ids))
    starts = torch.ones_like(ids, dtype=torch.bool)
    starts[:, 1:] = positions[:, 1:] != positions[:, :-1] + 1
    document = starts.cumsum(1)
    visible = torch.ones(ids.shape[1], ids.shape[1], dtype=torch.bool).tril() & (
        document[:, :, None] == document[:, None]
    )
    labels[starts] = -100
    if "attention_mask" in batch:
        labels[batch["attention_mask"] == 0] = -100
    masks = dict.fromkeys(range(model.config.num_hidden_layers), visible)
    for (layer, start), selection in (selections or {}).items():
        if selection.pages is not None:
            masks[layer] = masks[layer].clone()
            end = min(start + selection.pages.shape[1] * page, ids.shape[1])
            masks[layer][:, start:end] &= selection_mask(
                selection.pages, start, end - start, ids.shape[1], page
            )
    logits = _reference_forward(model, ids, masks, position_ids=positions).logits[:, :-1]
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels[:, 1:].reshape(-1), ignore_index=-100)


def build(family: str):
    """The family's tiny float64 model (its norms in float64: :func:`~tests.helpers.models.float64_norms`) and
    its vocabulary size."""
    model = build_causal_lm(family) if family in ("qwen2", "mistral", "qwen3") else build_family(family)
    float64_norms(model)
    return model, model.config.vocab_size


def oomb_step(model, case: Case, batch: dict):
    """One OOMB step of ``case``'s options: its loss, the gradients and the sparse selections it made."""
    options = dict(case.options)
    if options.pop("offload"):  # every layer's pages stream through 3 device buffers
        options.update(offload=True, hbm_budget=0, staging_buffers=3)
    chunked = HFChunkModel(model, layer_checkpointing=options["layer_checkpointing"])
    loss = OOMBEngine(chunked, OOMBConfig(*case.geometry, **options)).loss(**batch)
    selections = loss.grad_fn.step.sparse.selections if options["page_budget"] else {}
    loss.backward()
    got = grads_of(model)
    model.zero_grad()
    return loss.detach(), got, selections


def seeded(case: Case) -> torch.Generator:
    return torch.Generator().manual_seed(zlib.crc32(str(case).encode()))


@pytest.mark.parametrize("case", FIXED + MORE, ids=str)
def test_options_together_equal_full_sequence_training(case):
    model, vocab = build(case.family)
    batch = batch_of(case.layout, vocab, seeded(case))
    loss, got, selections = oomb_step(model, case, batch)
    want_loss = full_sequence_training(model, batch, selections, case.geometry[1])
    want_loss.backward()
    assert abs(loss.item() - want_loss.item()) <= TOL * abs(want_loss.item())
    assert max_relative_error(got, grads_of(model)) <= TOL


@pytest.mark.parametrize("case", HYBRID + HYBRID_MORE, ids=str)
def test_options_together_with_carried_states(case):
    """The model's own full-sequence call (:func:`~tests.helpers.models.hybrid_full_sequence`)."""
    with float64_hybrid(build_hybrid(case.family)) as model:
        vocab = model.get_output_embeddings().weight.shape[0]
        batch = batch_of(case.layout, vocab, seeded(case))
        loss, got, _ = oomb_step(model, case, batch)
        labels = batch["labels"].clone()
        if "attention_mask" in batch:
            labels[batch["attention_mask"] == 0] = -100
        want_loss, want = hybrid_full_sequence(model, batch["input_ids"], labels)
    assert_hybrid_exact(loss, got, want_loss, want)
