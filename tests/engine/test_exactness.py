"""Dense OOMB equals full-sequence training in float64: loss and every parameter gradient."""

from __future__ import annotations

import inspect
import zlib

import pytest
import torch

from lightning_oomb.engine import OOMBConfig, OOMBEngine
from lightning_oomb.integrations.hf import HFChunkModel
from tests.helpers.models import FAMILIES, build_causal_lm, full_sequence_loss, grads_of, max_relative_error

TOL = 1e-10
SEQ = 53  # not divisible by the chunk (8 or 16) nor the page (8)


def oomb_loss_and_grads(model, ids, labels, chunk_size, checkpointing):
    engine = OOMBEngine(HFChunkModel(model, layer_checkpointing=checkpointing), OOMBConfig(chunk_size, 8))
    model.zero_grad()
    loss = engine.loss(ids, labels)
    loss.backward()
    return loss.detach(), grads_of(model), engine


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize(("chunk_size", "num_chunks"), [(64, 1), (32, 2), (8, 7)])
@pytest.mark.parametrize("batch", [1, 2])
@pytest.mark.parametrize("checkpointing", [False, True])
def test_dense_oomb_equals_full_sequence(family, chunk_size, num_chunks, batch, checkpointing):
    model = build_causal_lm(family)
    # a seed stable across runs (``hash`` of a str is salted per process): Hugging Face's RMSNorms compute in
    # float32 even in a float64 model, so now and then (once in thousands of random inputs here) a last-bit
    # difference between the two computations rounds to another float32 and a gradient differs by ~1e-8 — the
    # oracle's model, not the engine (with the norms in float64 the same input gives 2e-15)
    gen = torch.Generator().manual_seed(zlib.crc32(f"{family}-{chunk_size}-{batch}".encode()))
    ids = torch.randint(0, 97, (batch, SEQ), generator=gen)
    labels = ids.clone()
    labels[:, [3, 31, 32]] = -100  # ignored targets, one at a chunk boundary

    want_loss = full_sequence_loss(model, ids, labels)
    want_loss.backward()
    want = grads_of(model)
    model.train()

    loss, got, engine = oomb_loss_and_grads(model, ids, labels, chunk_size, checkpointing)
    assert engine.stats.chunks == num_chunks
    assert abs(loss.item() - want_loss.item()) <= TOL * abs(want_loss.item())
    assert max_relative_error(got, want) <= TOL


def test_negative_control_detects_missing_past():
    """The comparison is sensitive: dropping the past pages (chunk = independent sequence) fails it."""
    model = build_causal_lm("qwen2")
    ids = torch.randint(0, 97, (1, 32), generator=torch.Generator().manual_seed(0))
    want = full_sequence_loss(model, ids)
    halves = [full_sequence_loss(model, ids[:, :16]), full_sequence_loss(model, ids[:, 16:])]
    assert abs(sum(halves).item() / 2 - want.item()) > 1e-3


def test_second_step_reuses_pool_and_stays_exact():
    model = build_causal_lm("llama")
    gen = torch.Generator().manual_seed(3)
    engine = OOMBEngine(HFChunkModel(model), OOMBConfig(16, 8))
    for seq in (40, 24):  # a shorter second step fits in the same arenas
        ids = torch.randint(0, 97, (2, seq), generator=gen)
        model.zero_grad()
        want_loss = full_sequence_loss(model, ids)
        want_loss.backward()
        want = grads_of(model)
        model.zero_grad()
        loss = engine.loss(ids)
        loss.backward()
        assert abs(loss.item() - want_loss.item()) <= TOL * want_loss.item()
        assert max_relative_error(grads_of(model), want) <= TOL
    assert engine.pool.allocated_bytes == 4 * 2 * 2 * 5 * 8 * 8 * 8  # K,V,dK,dV x layers x rows x 5 pages


def test_dropout_is_replayed_in_the_recompute():
    """The recompute draws the same dropout masks as the forward sweep (RNG state saved per chunk).

    Oracle: the same chunks run with grad through an HF ``DynamicCache`` (graph kept), drawing the masks in
    the same order from the same seed.
    """
    from transformers import DynamicCache

    model = build_causal_lm("qwen2")
    model.model.embed_tokens.register_forward_hook(lambda m, i, o: torch.nn.functional.dropout(o, 0.3, True))
    ids = torch.randint(0, 97, (1, 24), generator=torch.Generator().manual_seed(0))
    torch.manual_seed(11)
    cache, want_loss = DynamicCache(), 0.0
    # transformers 5.25 renamed the argument
    name = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
    for start in range(0, 24, 8):
        chunk = ids[:, start : start + 8]
        positions = torch.arange(start, start + 8)[None]
        out = model(input_ids=chunk, position_ids=positions, use_cache=True, **{name: cache})
        logits = out.logits[0, : min(8, 23 - start)]
        want_loss = (
            want_loss
            + torch.nn.functional.cross_entropy(
                logits, ids[0, start + 1 : start + 1 + len(logits)], reduction="sum"
            )
            / 23
        )
    want_loss.backward()
    want = grads_of(model)

    model.zero_grad()
    torch.manual_seed(11)
    loss, got, _ = oomb_loss_and_grads(model, ids, None, 8, False)
    assert abs(loss.item() - want_loss.item()) <= TOL * want_loss.item()
    assert max_relative_error(got, want) <= TOL


@pytest.mark.parametrize("checkpointing", [False, True])
def test_a_tied_lm_head_gets_both_gradients(checkpointing):
    """Tied embeddings: the LM head is the input embedding, whose gradient sums the lookup's and the loss's."""
    model = build_causal_lm("qwen2", tie_word_embeddings=True)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    ids = torch.randint(0, 97, (2, SEQ), generator=torch.Generator().manual_seed(5))
    want_loss = full_sequence_loss(model, ids)
    want_loss.backward()
    want = grads_of(model)
    loss, got, _ = oomb_loss_and_grads(model, ids, None, 16, checkpointing)
    assert abs(loss.item() - want_loss.item()) <= TOL * want_loss.item()
    assert max_relative_error(got, want) <= TOL


def test_a_second_step_before_the_first_ones_backward_is_refused():
    """The pool holds one step's pages until its backward: a second ``loss`` or ``evaluate`` while a loss still
    waits for it would overwrite them (that loss's gradients were 2x off before) and is refused; once it is
    back-propagated — or dropped — the next step runs, and gradient accumulation over steps is exact."""
    from lightning_oomb.engine import OOMBConfigError

    model = build_causal_lm("qwen2")
    gen = torch.Generator().manual_seed(5)
    a, b = (torch.randint(0, 97, (1, 40), generator=gen) for _ in range(2))
    (full_sequence_loss(model, a) + full_sequence_loss(model, b)).backward()
    want = grads_of(model)
    model.zero_grad()
    engine = OOMBEngine(HFChunkModel(model), OOMBConfig(16, 8))
    first = engine.loss(a)
    for call in (engine.loss, engine.evaluate):
        with pytest.raises(OOMBConfigError, match="waits for its backward"):
            call(b)
    first.backward()
    engine.loss(b).backward()
    assert max_relative_error(grads_of(model), want) <= 1e-10
    twice = engine.loss(a)
    twice.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="back-propagated a second time"):
        twice.backward()
    model.zero_grad()
    dropped = engine.loss(a)
    del dropped  # never back-propagated: nothing waits
    with torch.no_grad():  # no graph, nothing to wait for
        engine.loss(a), engine.loss(b)
    assert engine.evaluate(a) > 0


@pytest.mark.parametrize("change", ["weights", "ids", "mode"])
def test_weights_or_ids_changed_before_the_backward_are_refused(change):
    """The backward sweep recomputes from the current weights and ids: changed in place since the loss (an
    optimizer step before backward), it would silently give another function's gradients — refused, as autograd
    refuses a modified saved tensor."""
    model = build_causal_lm("qwen2")
    ids = torch.randint(0, 97, (1, 40), generator=torch.Generator().manual_seed(6))
    engine = OOMBEngine(HFChunkModel(model), OOMBConfig(16, 8))
    loss = engine.loss(ids)
    with torch.no_grad():
        if change == "weights":
            next(model.parameters()).mul_(1.01)
        elif change == "ids":
            ids[0, 3] = (ids[0, 3] + 1) % 97
        else:
            model.eval()
    match = "to eval mode" if change == "mode" else "modified in place"
    with pytest.raises(RuntimeError, match=f"{match}.*between engine.loss and its backward"):
        loss.backward()
    engine.loss(ids).backward()  # the next step runs
