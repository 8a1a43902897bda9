"""Packed documents and right padding (float64): a packed row trains exactly like its documents trained apart, a
right-padded batch exactly like its rows apart; other masks are refused before any work."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from lightning_oomb.engine import OOMBConfig, OOMBConfigError, OOMBEngine
from lightning_oomb.engine.batch import plan_layout
from lightning_oomb.integrations.hf import HFChunkModel
from tests.helpers.lightning import oomb_step_through_trainer
from tests.helpers.models import assert_triton_matches_torch, build_causal_lm, grads_of, max_relative_error

DOCS = (
    13,
    29,
    40,
    9,
)  # 91 tokens: not multiples of the page (8) or chunk (16); documents cross chunk boundaries


def summed_token_loss(model, ids):
    """Summed next-token cross-entropy of one sequence ``[1, n]`` (full-sequence training) and its target count."""
    hidden = model.get_decoder()(input_ids=ids).last_hidden_state
    logits = model.get_output_embeddings()(hidden)[:, :-1]
    return F.cross_entropy(
        logits.reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1), reduction="sum"
    ), ids.shape[1] - 1


def apart(model, pieces, summed=summed_token_loss):
    """Mean next-token loss over the targets of every piece, each trained as its own sequence (``summed``: its
    summed loss and target count), and its gradients."""
    model.zero_grad()
    sums, counts = zip(*(summed(model, p) for p in pieces), strict=True)
    loss = sum(sums) / sum(counts)
    loss.backward()
    return loss.detach(), grads_of(model)


def packed_row(gen, lengths=DOCS):
    docs = [torch.randint(0, 97, (1, n), generator=gen) for n in lengths]
    ids = torch.cat(docs, 1)
    positions = torch.cat([torch.arange(n) for n in lengths])[None]
    return docs, ids, positions


def oomb(model, ids, offload=False, backend="torch", **batch):
    model.zero_grad()
    extra = {"offload": True, "hbm_budget": 0, "staging_buffers": 3} if offload else {}
    engine = OOMBEngine(HFChunkModel(model), OOMBConfig(16, 8, attention_backend=backend, **extra))
    loss = engine.loss(ids, **batch)
    loss.backward()
    return loss.detach(), grads_of(model), engine


@pytest.mark.parametrize("offload", [False, True])
@pytest.mark.parametrize(
    "family", ["qwen2", "mistral"]
)  # mistral: a sliding window shorter than two documents
def test_a_packed_row_trains_like_its_documents_apart(family, offload):
    model = build_causal_lm(family)
    docs, ids, positions = packed_row(torch.Generator().manual_seed(0))
    want_loss, want = apart(model, docs)
    loss, grads, _ = oomb(model, ids, offload, position_ids=positions)
    assert abs(loss.item() - want_loss.item()) <= 1e-10 * want_loss.item()
    assert max_relative_error(grads, want) <= 1e-10


def test_offload_streams_only_the_blocks_the_documents_reach():
    """Chunk 5 (tokens 80..90) holds the ends of the documents starting at 42 and 82: it never needs the blocks of
    tokens before 32, so the packed row copies fewer key blocks in than the same tokens as one document."""
    model = build_causal_lm("qwen2")
    _, ids, positions = packed_row(torch.Generator().manual_seed(0))

    def blocks_in(**batch):
        engine = oomb(model, ids, offload=True, **batch)[2]
        return [(t.layer, t.first) for t in engine.pool.transfers if t.direction == "h2d" and t.what == "kv"]

    packed, whole = blocks_in(position_ids=positions), blocks_in()
    assert len(packed) < len(whole)


def test_packed_rows_of_a_batch_and_labels_that_ignore_tokens():
    """Two rows with different document layouts, user labels with ignored positions (HF's packing collator sets
    each document's first label to -100: the engine would ignore those targets anyway)."""
    model = build_causal_lm("qwen2")
    gen = torch.Generator().manual_seed(1)
    first, ids0, pos0 = packed_row(gen, (13, 29, 40, 9))
    second, ids1, pos1 = packed_row(gen, (50, 41))
    ids, positions = torch.cat([ids0, ids1]), torch.cat([pos0, pos1])
    labels = ids.clone()
    labels[positions == 0] = -100
    want_loss, want = apart(model, [*first, *second])
    loss, grads, _ = oomb(model, ids, labels=labels, position_ids=positions)
    assert abs(loss.item() - want_loss.item()) <= 1e-10 * want_loss.item()
    assert max_relative_error(grads, want) <= 1e-10


def test_a_right_padded_batch_trains_like_its_rows_apart():
    model = build_causal_lm("qwen2")
    gen = torch.Generator().manual_seed(2)
    rows = [torch.randint(0, 97, (1, n), generator=gen) for n in (50, 37)]
    ids = torch.cat([rows[0], F.pad(rows[1], (0, 13), value=5)])
    mask = torch.ones_like(ids)
    mask[1, 37:] = 0
    want_loss, want = apart(model, rows)
    loss, grads, _ = oomb(model, ids, attention_mask=mask)
    assert abs(loss.item() - want_loss.item()) <= 1e-10 * want_loss.item()
    assert max_relative_error(grads, want) <= 1e-10


def test_a_packed_batch_through_the_trainer():
    """The user's ``self.model(**batch)`` with HF packing's ``position_ids`` (and labels) reaches the engine."""
    model = build_causal_lm("qwen2")
    docs, ids, positions = packed_row(torch.Generator().manual_seed(3))
    want_loss, want = apart(model, docs)
    model.zero_grad()

    def packed_call(model, batch):
        return model(input_ids=batch, labels=batch, position_ids=positions).loss

    loss, grads = oomb_step_through_trainer(model, ids, OOMBConfig(16, 8), loss_of=packed_call)
    assert abs(loss.item() - want_loss.item()) <= 1e-10 * want_loss.item()
    assert max_relative_error(grads, want) <= 1e-10


@pytest.mark.slow
def test_packed_rows_with_the_triton_kernels():
    """The Triton backend (interpreted on CPU) gives the torch backend's loss and gradients on a packed row."""
    model = build_causal_lm("mistral", dtype=torch.float32, head_dim=16)
    _, ids, positions = packed_row(torch.Generator().manual_seed(4))
    assert_triton_matches_torch(model, ids, position_ids=positions)


@pytest.mark.parametrize(
    ("mask", "match"),
    [
        ([0, 0, 1, 1, 1, 1], "not right padding"),  # left padding
        ([1, 1, 0, 1, 1, 1], "not right padding"),  # a hole
    ],
)
def test_masks_other_than_right_padding_are_refused_before_any_work(mask, match):
    engine = OOMBEngine(HFChunkModel(build_causal_lm("qwen2")), OOMBConfig(16, 8))
    ids = torch.randint(0, 97, (1, 6))
    with pytest.raises(OOMBConfigError, match=match):
        engine.loss(ids, attention_mask=torch.tensor([mask]))
    assert engine.pool.allocated_bytes == 0


def test_layout_of_packed_positions():
    """Document starts from positions that restart (wherever a position does not exceed the previous one), and no
    target across a boundary; forward jumps (PoSE, a stride) continue the document (a stride of 2 read as one-token
    documents dropped every target: loss 0), a restart at every token warns that nothing is left to train."""
    positions = torch.tensor([[0, 1, 2, 0, 1, 0, 1, 2, 3]])
    ids = torch.arange(9)[None]
    layout = plan_layout(ids, ids, positions)
    assert layout.doc_start.tolist() == [[0, 0, 0, 3, 3, 5, 5, 5, 5]]
    assert layout.targets.tolist() == [[1, 2, -100, 4, -100, 6, 7, 8, -100]]
    assert (
        plan_layout(ids, ids, torch.arange(9)[None] + 4).doc_start is None
    )  # one document, offset positions
    for skipped in ([0, 1, 2, 3, 10, 11, 12, 13, 14], [0, 2, 4, 6, 8, 10, 12, 14, 16]):
        assert plan_layout(ids, ids, torch.tensor([skipped])).doc_start is None
    with pytest.warns(UserWarning, match="each document is one token"):
        assert (plan_layout(ids, ids, torch.zeros(1, 9, dtype=torch.long)).targets == -100).all()
    with pytest.raises(OOMBConfigError, match="position_ids"):
        plan_layout(ids, ids, torch.arange(8)[None])
