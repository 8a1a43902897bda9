"""Labels across a packed document boundary (float64): an explicit target there — transformers'
``DataCollatorWithFlattening(separator_id=EOS)`` puts the separator at each document's first label, so the document
before learns to end — is trained as transformers trains it; a label that is the input id there (labels copied
from ``input_ids``) is the next document's first token, and documents stay apart."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from lightning_oomb.engine import OOMBConfig, OOMBEngine
from lightning_oomb.engine.batch import plan_layout
from lightning_oomb.integrations.hf import HFChunkModel
from tests.engine.test_packing import apart
from tests.helpers.distributed import run_ranks
from tests.helpers.lightning import oomb_step_through_trainer
from tests.helpers.models import build_causal_lm, grads_of, max_relative_error

EOS = 2
DOCS = (13, 29, 40, 9)  # 91 tokens: documents cross chunk (16) and page (8) boundaries


def documents(seed: int, lengths=DOCS) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 97, (n,), generator=gen).tolist() for n in lengths]  # no EOS inside a document


def flattened(docs, separator_id=EOS) -> dict[str, torch.Tensor]:
    from transformers import DataCollatorWithFlattening

    batch = DataCollatorWithFlattening(separator_id=separator_id)([{"input_ids": d} for d in docs])
    return {k: batch[k] for k in ("input_ids", "labels", "position_ids")}


def hf_summed_loss(model, batch) -> tuple[torch.Tensor, int]:
    """transformers' own full-sequence training of a flattened row (``use_cache=False``: its attention keeps the
    documents apart by ``position_ids``), in float64: its logits, its shifted labels, summed; and the target count."""
    out = model(**batch, use_cache=False)
    logits, targets = out.logits[:, :-1], batch["labels"][:, 1:]
    loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1), reduction="sum")
    count = int((targets != -100).sum())
    assert abs(out.loss.item() - loss.item() / count) <= 1e-6 * loss.item() / count  # (its own loss: float32)
    return loss, count


def documents_apart_with_eos(model, docs) -> torch.Tensor:
    """The truth the collator encodes: each document on its own, its last token predicting EOS (but the row's
    last document's: nothing follows it in the row)."""
    total, count = 0, 0
    for k, doc in enumerate(docs):
        ids = torch.tensor([doc])
        logits = model(input_ids=ids, use_cache=False).logits[0]
        targets = torch.tensor([*doc[1:], EOS if k < len(docs) - 1 else -100])
        total = total + F.cross_entropy(logits, targets, reduction="sum")
        count += int((targets != -100).sum())
    return total / count


def oomb(model, batch, offload=False):
    model.zero_grad()
    extra = {"offload": True, "hbm_budget": 0, "staging_buffers": 3} if offload else {}
    engine = OOMBEngine(HFChunkModel(model), OOMBConfig(16, 8, attention_backend="torch", **extra))
    loss = engine.loss(**batch)
    loss.backward()
    return loss.detach(), grads_of(model)


def reference(model, rows):
    """Mean of transformers' own full-sequence losses of flattened rows (their targets pooled), and gradients."""
    return apart(model, rows, hf_summed_loss)


@pytest.mark.parametrize("offload", [False, True])
def test_a_flattening_collators_separator_targets_train_as_transformers_trains_them(offload):
    model = build_causal_lm("qwen2")
    docs = documents(0)
    batch = flattened(docs)
    assert batch["labels"][0, [13, 42, 82]].tolist() == [EOS] * 3  # each later document's first label
    want_loss, want = reference(model, [batch])
    with torch.no_grad():  # transformers' training is the documents apart, each learning to end
        truth = documents_apart_with_eos(model, docs)
    assert abs(want_loss.item() - truth.item()) <= 1e-10 * truth.item()
    loss, grads = oomb(model, batch, offload)
    assert abs(loss.item() - want_loss.item()) <= 1e-10 * want_loss.item()
    assert max_relative_error(grads, want) <= 1e-10


def _context_step(rank, world):
    import torch.distributed as dist

    from lightning_oomb.engine.context import ContextGroup

    model = build_causal_lm("qwen2")
    engine = OOMBEngine(HFChunkModel(model), OOMBConfig(32, 8), context=ContextGroup.of())
    loss = engine.loss(**flattened(documents(5)))
    loss.backward()
    grads = grads_of(model)
    for g in grads.values():
        dist.all_reduce(g, group=engine.context.group)
    return {"loss": loss.detach(), "grads": grads}


@pytest.mark.slow
def test_separator_targets_under_context_parallelism(tmp_path):
    """2 ranks, each a half of every chunk: the separator targets reach the loss as on one process."""
    model = build_causal_lm("qwen2")
    want_loss, want = reference(model, [flattened(documents(5))])
    for r in run_ranks(_context_step, 2, tmp_path):
        assert abs(r["loss"].item() - want_loss.item()) <= 1e-10 * want_loss.item()
        assert max_relative_error(r["grads"], want) <= 1e-10


def test_separator_targets_in_a_right_padded_batch():
    """Two flattened rows of different lengths, the shorter right-padded (its padding labelled and positioned
    arbitrarily: the mask decides): each row's targets as transformers trains the row alone."""
    model = build_causal_lm("qwen2")
    first, second = flattened(documents(1, (13, 29, 40))), flattened(documents(2, (21, 30)))
    pad = first["input_ids"].shape[1] - second["input_ids"].shape[1]
    padded = {
        "input_ids": F.pad(second["input_ids"], (0, pad), value=EOS),
        "labels": F.pad(
            second["labels"], (0, pad), value=EOS
        ),  # a pad label that is not the input: still ignored
        "position_ids": F.pad(second["position_ids"], (0, pad), value=0),
    }
    batch = {k: torch.cat([first[k], padded[k]]) for k in first}
    batch["attention_mask"] = torch.ones_like(batch["input_ids"])
    batch["attention_mask"][1, second["input_ids"].shape[1] :] = 0
    want_loss, want = reference(model, [first, second])
    loss, grads = oomb(model, batch)
    assert abs(loss.item() - want_loss.item()) <= 1e-10 * want_loss.item()
    assert max_relative_error(grads, want) <= 1e-10


def test_separator_targets_through_the_trainer():
    """The user's ``self.model(**batch, use_cache=False)`` with the collator's labels and positions reaches the
    engine: the same loss and gradients as transformers' own training (``strategy='auto'``)."""
    model = build_causal_lm("qwen2")
    batch = flattened(documents(3))
    want_loss, want = reference(model, [batch])
    model.zero_grad()

    def flattened_call(model, ids):
        return model(
            input_ids=ids, labels=batch["labels"], position_ids=batch["position_ids"], use_cache=False
        ).loss

    loss, grads = oomb_step_through_trainer(
        model, batch["input_ids"], OOMBConfig(16, 8), loss_of=flattened_call
    )
    assert abs(loss.item() - want_loss.item()) <= 1e-10 * want_loss.item()
    assert max_relative_error(grads, want) <= 1e-10


def test_labels_copied_from_input_ids_keep_documents_apart():
    """``labels=input_ids.clone()`` on a packed row (the usual recipe, no separator): no document's last token is
    trained on the next document's first token — the documents trained apart."""
    model = build_causal_lm("qwen2")
    docs = documents(4)
    batch = flattened(docs)
    batch["labels"] = batch["input_ids"].clone()
    model.zero_grad()
    sums, counts = [], 0
    for doc in docs:
        ids = torch.tensor([doc])
        logits = model(input_ids=ids, use_cache=False).logits[0, :-1]
        sums.append(F.cross_entropy(logits, ids[0, 1:], reduction="sum"))
        counts += len(doc) - 1
    want_loss = sum(sums) / counts
    want_loss.backward()
    want = grads_of(model)
    loss, grads = oomb(model, batch)
    assert abs(loss.item() - want_loss.item()) <= 1e-10 * want_loss.item()
    assert max_relative_error(grads, want) <= 1e-10


def test_layout_keeps_explicit_targets_across_a_boundary_and_drops_copied_ones():
    positions = torch.tensor([[0, 1, 2, 0, 1, 0, 1, 2, 3]])
    ids = torch.tensor([[10, 11, 12, 13, 14, 15, 16, 17, 18]])
    copied = plan_layout(ids, ids.clone(), positions)
    assert copied.targets.tolist() == [[11, 12, -100, 14, -100, 16, 17, 18, -100]]
    assert plan_layout(ids, ids, positions).targets.tolist() == copied.targets.tolist()  # defaulted labels
    separated = ids.clone()
    separated[0, [0, 3, 5]] = EOS  # DataCollatorWithFlattening(separator_id=EOS)
    assert plan_layout(ids, separated, positions).targets.tolist() == [
        [11, 12, EOS, 14, EOS, 16, 17, 18, -100]
    ]
    ignored = ids.masked_fill(positions == 0, -100)  # its default separator_id=-100: nothing to train
    assert plan_layout(ids, ignored, positions).targets.tolist() == copied.targets.tolist()
    mixed = ids.clone()
    mixed[0, 5] = (
        EOS  # one explicit target: the labels are the caller's, every boundary's trained as given (as HF)
    )
    assert plan_layout(ids, mixed, positions).targets.tolist() == [[11, 12, 13, 14, EOS, 16, 17, 18, -100]]
    # a separator equal to the next document's first token (EOS also starting documents): kept, as any separator —
    # it was dropped as a copied label (a batch of only such boundaries cannot tell them from a copy: dropped)
    starts = ids.clone()
    starts[0, 3] = EOS
    separated = starts.clone()
    separated[0, 5] = EOS
    assert plan_layout(starts, separated, positions).targets.tolist() == [
        [11, 12, EOS, 14, EOS, 16, 17, 18, -100]
    ]
