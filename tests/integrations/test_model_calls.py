"""The user's ``model(...)`` calls inside a managed step are read as the model's own ``forward`` reads them."""

from __future__ import annotations

import pytest
import torch
import transformers as tf

from lightning_oomb.engine import OOMBConfig, OOMBConfigError, OOMBEngine
from lightning_oomb.integrations.hf import HFChunkModel
from lightning_oomb.integrations.hf.calls import LogitsUnavailable, read_call
from tests.helpers.models import (
    build_causal_lm,
    build_family,
    full_sequence_loss,
    grads_of,
    max_relative_error,
)


def recorded_calls(model):
    """An adapter answering calls with a dummy loss; the list of what each call handed the engine."""
    adapter = HFChunkModel(model)
    seen = []

    def respond(ids, labels, position_ids=None, attention_mask=None):
        seen.append({"ids": ids, "labels": labels, "positions": position_ids, "mask": attention_mask})
        return ids.sum().double()

    return adapter.answer_calls(respond), seen


def test_positional_arguments_mean_what_they_mean_to_the_models_forward():
    """Llama takes (input_ids, attention_mask, position_ids, ...): positions given third are positions, not labels
    (they trained as targets before); GPT-2 takes (input_ids, cache, attention_mask, ...)."""
    model = build_causal_lm("llama")
    ids, mask, positions = torch.randint(0, 97, (1, 12)), torch.ones(1, 12), torch.arange(12)[None]
    answering, seen = recorded_calls(model)
    with answering:
        model(ids, mask, positions)
    assert seen[0]["labels"] is None and seen[0]["positions"] is positions and seen[0]["mask"] is mask
    gpt2 = tf.GPT2LMHeadModel(tf.GPT2Config(n_embd=16, n_layer=1, n_head=2, vocab_size=97))
    call = read_call(gpt2, (ids, None, mask), {"labels": ids}, balances_experts=False)
    assert call.attention_mask is mask and call.labels is ids and call.position_ids is None
    with pytest.raises(OOMBConfigError, match="too many positional arguments"):
        read_call(gpt2, (ids,) * 30, {}, balances_experts=False)


def test_return_dict_false_gives_hfs_tuple():
    model = build_causal_lm("qwen2")
    ids = torch.randint(0, 97, (1, 12))
    answering, seen = recorded_calls(model)
    with answering:
        loss, logits = model(ids, labels=ids, return_dict=False)
        assert loss == ids.sum()
        # HF answers (logits,) without labels: nothing in it could be used — refused at the call, before any sweep
        # (it ran the forward sweep, then refused the logits' first use)
        with pytest.raises(
            OOMBConfigError, match=r"return_dict=False .* and no labels .* read the loss as `out\[0\]`"
        ):
            model(ids, return_dict=False)
        assert len(seen) == 1
        with pytest.raises(LogitsUnavailable, match=r"compute metrics from `output.loss`"):
            model(ids).logits.float()
        logits = model(ids).logits
        for use in (lambda: logits / 0.7, lambda: 1.0 - logits, lambda: -logits, lambda: logits == 1.0):
            with pytest.raises(LogitsUnavailable):  # (a bare TypeError, or False for ==)
                use()
        model.config.return_dict = False
        assert isinstance(model(ids, labels=ids), tuple)
        with pytest.raises(OOMBConfigError, match=r"return_dict=False \(the call's or the config's\)"):
            model(ids)


def test_a_loss_of_ones_own_from_the_logits_is_refused_naming_the_supported_way():
    """A call without labels is a supported one (its labels default to input_ids), so a cross-entropy of one's own
    from its logits is refused at their first use, naming what trains: the call's loss, shaped by labels (-100) and
    num_items_in_batch."""
    model = build_causal_lm("qwen2")
    ids = torch.randint(0, 97, (2, 12))
    answering, _ = recorded_calls(model)
    with answering:
        out = model(input_ids=ids, attention_mask=torch.ones_like(ids))
        with pytest.raises(
            LogitsUnavailable,
            match=r"cross-entropy of your own\) cannot train under OOMB: return `output.loss`.*-100 marks positions "
            r"to ignore; num_items_in_batch sets the divisor.*strategy='auto'",
        ):
            torch.nn.functional.cross_entropy(out.logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten())


def test_a_model_training_its_router_loss_answers_as_hfs_moe_models():
    """With ``output_router_logits``, HF answers ``MoeCausalLMOutputWithPast`` (``aux_loss``, ``router_logits``) or
    ``(loss, aux_loss, logits, router_logits)``: reading them raised a bare AttributeError, and ``out[1]`` was the
    logits' stand-in; now they are stand-ins that say the balancing loss is in ``loss`` already."""
    model = build_family("qwen3_moe", output_router_logits=True)
    ids = torch.randint(0, 97, (1, 12))
    answering, _ = recorded_calls(model)
    with answering:
        out = model(ids, labels=ids)
        assert out.loss == ids.sum()
        with pytest.raises(LogitsUnavailable, match="load-balancing loss is already in the loss"):
            out.aux_loss * 0.01
        with pytest.raises(LogitsUnavailable, match="router logits of the whole sequence are never kept"):
            out.router_logits[0]
        loss, aux, _, _ = model(ids, labels=ids, return_dict=False)
        assert loss == ids.sum()
        with pytest.raises(LogitsUnavailable, match="load-balancing loss"):
            torch.add(aux, 1)


@pytest.mark.parametrize(
    "extra",
    [
        {"output_attentions": False, "output_hidden_states": False, "logits_to_keep": 0},
        {"use_cache": True, "return_dict": True, "output_router_logits": False},
        {"cache_position": torch.arange(12), "past_key_values": None},
    ],
    ids=["outputs-off", "defaults", "counting-cache-position"],
)
def test_arguments_that_change_nothing_in_the_loss_are_accepted(extra):
    model = build_causal_lm("qwen2")
    answering, seen = recorded_calls(model)
    with answering:
        model(input_ids=torch.randint(0, 97, (1, 12)), **extra)
    assert len(seen) == 1


@pytest.mark.parametrize(
    ("extra", "match"),
    [
        ({"output_attentions": True}, r"output_attentions \(the attention weights"),
        ({"logits_to_keep": 1}, r"logits_to_keep \(the logits are never materialised"),
        ({"output_router_logits": True}, r"config.output_router_logits"),
        ({"token_type_ids": torch.zeros(1, 12, dtype=torch.long)}, r"\['token_type_ids'\] .*drop such keys"),
        ({"cache_position": torch.arange(5, 17)}, "cached decoding"),
        ({"past_key_values": tf.DynamicCache()}, "past_key_values .*generate in predict_step"),
    ],
    ids=["attentions", "logits-to-keep", "router", "token-types", "decoding-position", "cache"],
)
def test_arguments_the_engine_cannot_honour_are_refused_with_their_reason(extra, match):
    model = build_causal_lm("qwen2")
    answering, seen = recorded_calls(model)
    with answering, pytest.raises(OOMBConfigError, match=match):
        model(input_ids=torch.randint(0, 97, (1, 12)), **extra)
    assert not seen


def test_inputs_embeds_without_ids_is_refused_with_the_reason():
    model = build_causal_lm("qwen2")
    answering, _ = recorded_calls(model)
    with answering, pytest.raises(OOMBConfigError, match="inputs_embeds cannot be split into chunks"):
        model(inputs_embeds=torch.zeros(1, 12, 56, dtype=torch.float64))


def test_the_flattening_collators_document_keys_are_checked_against_the_positions():
    """``DataCollatorWithFlattening(return_flash_attn_kwargs=True, return_seq_idx=True)``: its keys repeat what
    ``position_ids`` say; they are accepted when they agree and refused when they do not."""
    features = [{"input_ids": torch.randint(0, 97, (n,)).tolist()} for n in (5, 9, 3)]
    batch = tf.DataCollatorWithFlattening(return_flash_attn_kwargs=True, return_seq_idx=True)(features)
    model = build_causal_lm("qwen2")
    answering, seen = recorded_calls(model)
    with answering:
        model(**batch)
        assert torch.equal(seen[0]["positions"], batch["position_ids"])
        wrong = dict(batch, cu_seq_lens_q=torch.tensor([0, 6, 14, 17], dtype=torch.int32))
        with pytest.raises(OOMBConfigError, match="cu_seq_lens_q that disagree with position_ids"):
            model(**wrong)
        without = {k: v for k, v in batch.items() if k != "position_ids"}
        with pytest.raises(OOMBConfigError, match="without position_ids"):
            model(**without)


def test_the_vocabulary_is_read_at_each_step():
    """``resize_token_embeddings`` after the adapter is built (e.g. in ``on_fit_start``) is what the id check
    reads."""
    model = build_causal_lm("qwen2")
    adapter = HFChunkModel(model)
    model.resize_token_embeddings(130)
    assert adapter.vocab_size == adapter.num_embeddings == 130


def test_num_items_in_batch_divides_the_summed_loss_as_transformers_does():
    """``model(..., num_items_in_batch=n)``: the summed token losses over ``n`` (a tensor or a number), as HF's
    loss computes it for gradient accumulation weighted by tokens — loss and gradients in float64 (1e-10)."""
    model = build_causal_lm("qwen2")
    ids = torch.randint(0, 97, (2, 40), generator=torch.Generator().manual_seed(3))
    labels = ids.clone()
    labels[0, :7] = -100
    targets = int((labels[:, 1:] != -100).sum())
    want_loss = full_sequence_loss(model, ids, labels) * targets / 100
    want_loss.backward()
    want = grads_of(model)
    model.zero_grad()
    engine = OOMBEngine(HFChunkModel(model), OOMBConfig(16, 8))
    with engine.model.answer_calls(lambda ids, labels, **kw: engine.loss(ids, labels, **kw)):
        loss = model(input_ids=ids, labels=labels, num_items_in_batch=torch.tensor(100)).loss
    loss.backward()
    assert abs(loss.item() / want_loss.item() - 1) <= 1e-10
    assert max_relative_error(grads_of(model), want) <= 1e-10
    with pytest.raises(OOMBConfigError, match="num_items_in_batch=0 is not a positive count"):
        engine.evaluate(ids, labels, num_items_in_batch=0)  # targets to divide
    # a window without targets: transformers counts 0 (it then gets 0/0 = NaN); loss 0 as without the count (it
    # was refused, ending the fit)
    none = torch.full_like(labels, -100)
    assert engine.evaluate(ids, none, num_items_in_batch=torch.tensor(0)).item() == 0.0
