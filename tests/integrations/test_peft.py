"""LoRA (peft) adapters on an OOMB-trained model: exact gradients, and the strategy drives a ``PeftModel``."""

from __future__ import annotations

import lightning as L
import pytest
import torch

from lightning_oomb.engine import OOMBConfig, OOMBConfigError, OOMBEngine
from lightning_oomb.integrations.hf import HFChunkModel
from tests.helpers.lightning import fit, oomb
from tests.helpers.models import build_causal_lm, full_sequence_loss, grads_of, max_relative_error

peft = pytest.importorskip("peft")


def lora(model, dropout: float = 0.0):
    """Rank-4 LoRA on every attention and MLP projection; B starts random (not zero) so every adapter weight
    gets a gradient from the first step."""
    targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    config = peft.LoraConfig(
        r=4, lora_alpha=8, lora_dropout=dropout, target_modules=targets, init_lora_weights=False
    )
    return peft.get_peft_model(model, config)


@pytest.mark.parametrize("mlp_tile", [None, 5], ids=["whole-mlps", "mlp-tiles"])
@pytest.mark.parametrize("checkpointing", [False, True])
def test_lora_gradients_equal_full_sequence_training(checkpointing, mlp_tile):
    torch.manual_seed(0)
    model = lora(build_causal_lm("qwen2"))
    inner = model.get_base_model()
    ids = torch.randint(0, 97, (2, 50), generator=torch.Generator().manual_seed(1))
    want_loss = full_sequence_loss(inner, ids)
    want_loss.backward()
    want = grads_of(model)
    assert want and all("lora_" in name for name in want)  # only the adapters train
    model.zero_grad()

    engine = OOMBEngine(
        HFChunkModel(inner, layer_checkpointing=checkpointing), OOMBConfig(16, 8, mlp_tile=mlp_tile)
    )
    loss = engine.loss(ids)
    loss.backward()
    assert abs(loss.item() - want_loss.item()) <= 1e-10 * want_loss.item()
    assert max_relative_error(grads_of(model), want) <= 1e-10


class LoRALM(L.LightningModule):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.model = lora(build_causal_lm("qwen2", dtype=torch.float32))

    def training_step(self, batch):
        return self.model(input_ids=batch, labels=batch).loss

    def configure_optimizers(self):
        return torch.optim.SGD([p for p in self.parameters() if p.requires_grad], lr=0.5)


def test_the_strategy_trains_a_peft_model_like_the_default_strategy():
    data = torch.randint(0, 97, (4, 40), generator=torch.Generator().manual_seed(2))
    trained = {}
    for name, strategy in (("auto", "auto"), ("oomb", oomb())):
        module, _ = fit(strategy, LoRALM(), torch.utils.data.DataLoader(data, batch_size=2), steps=2)
        trained[name] = {n: p.detach().clone() for n, p in module.named_parameters() if p.requires_grad}
    assert trained["oomb"].keys() == trained["auto"].keys()
    assert max((trained["oomb"][n] - trained["auto"][n]).abs().max().item() for n in trained["auto"]) <= 1e-5


def test_lora_on_the_lm_head_is_refused_and_modules_to_save_trains_it_exactly():
    """OOMB's cross-entropy applies the head's weight itself: a LoRA adapter on ``lm_head`` would be skipped (no
    gradient, a wrong loss), so it is refused with the fix; ``modules_to_save=["lm_head"]`` (the head trained
    whole, as a copy) is exact."""
    model = peft.get_peft_model(
        build_causal_lm("qwen2"), peft.LoraConfig(r=4, target_modules=["q_proj", "lm_head"])
    )
    with pytest.raises(OOMBConfigError, match="not a plain linear layer.*leave it out of target_modules"):
        HFChunkModel(model.get_base_model())

    config = peft.LoraConfig(
        r=4, target_modules=["q_proj"], modules_to_save=["lm_head"], init_lora_weights=False
    )
    model = peft.get_peft_model(build_causal_lm("qwen2"), config)
    inner = model.get_base_model()
    ids = torch.randint(0, 97, (1, 40), generator=torch.Generator().manual_seed(1))
    full_sequence_loss(inner, ids).backward()
    want = grads_of(model)
    assert any("modules_to_save" in name for name in want)
    model.zero_grad()
    OOMBEngine(HFChunkModel(inner), OOMBConfig(16, 8)).loss(ids).backward()
    assert max_relative_error(grads_of(model), want) <= 1e-10


def test_trainable_tokens_on_a_tied_head_are_refused_naming_them():
    """peft's ``trainable_token_indices`` on a model with tied embeddings wraps the LM head as well; the refusal
    said "a LoRA adapter on lm_head: leave it out of target_modules", which the user never put there."""
    model = build_causal_lm("qwen2", tie_word_embeddings=True)
    config = peft.LoraConfig(r=4, target_modules=["q_proj"], trainable_token_indices=[3, 5])
    model = peft.get_peft_model(model, config)
    with pytest.raises(OOMBConfigError, match="trainable tokens.*LoRA adapter on the embedding"):
        HFChunkModel(model.get_base_model())


@pytest.mark.parametrize(
    "config",
    [
        lambda: peft.PromptTuningConfig(task_type="CAUSAL_LM", num_virtual_tokens=4),
        lambda: peft.PromptEncoderConfig(task_type="CAUSAL_LM", num_virtual_tokens=4, encoder_hidden_size=16),
        lambda: peft.PrefixTuningConfig(task_type="CAUSAL_LM", num_virtual_tokens=4),
    ],
    ids=["prompt-tuning", "p-tuning", "prefix-tuning"],
)
def test_prompt_learning_is_refused_at_setup_naming_it(config):
    """peft's prompt learning passes its virtual tokens as ``inputs_embeds`` or a ``past_key_values`` prefix, which
    the chunks cannot take: refused at setup, naming it and the adapters that do train (it was refused only in the
    first step, as a call without input_ids or a generate call the user never made)."""

    class PromptLM(LoRALM):
        def __init__(self):
            L.LightningModule.__init__(self)
            self.model = peft.get_peft_model(build_causal_lm("qwen2", dtype=torch.float32), config())
            self.steps = 0

        def training_step(self, batch):
            self.steps += 1
            return super().training_step(batch)

    module = PromptLM()
    data = torch.randint(0, 97, (2, 40), generator=torch.Generator().manual_seed(2))
    with pytest.raises(
        OOMBConfigError, match=r"is (PROMPT_TUNING|P_TUNING|PREFIX_TUNING) \(prompt learning\).*LoRA"
    ):
        fit(oomb(), module, torch.utils.data.DataLoader(data, batch_size=2), steps=1)
    assert module.steps == 0


@pytest.mark.parametrize(
    "config",
    [
        lambda t: peft.IA3Config(target_modules=t, feedforward_modules=["down_proj"], init_ia3_weights=False),
        lambda t: peft.LoHaConfig(r=4, target_modules=t, init_weights=False),
        lambda t: peft.LoKrConfig(r=4, target_modules=t, init_weights=False),
        lambda t: peft.VeraConfig(r=4, target_modules=["q_proj", "v_proj"], init_weights=False),
        lambda t: peft.OFTConfig(r=0, oft_block_size=8, target_modules=t, init_weights=False),
        lambda t: peft.LoraConfig(r=4, target_modules=t, use_dora=True, init_lora_weights=False),
    ],
    ids=["ia3", "loha", "lokr", "vera", "oft", "dora"],
)
def test_other_weight_adapters_train_exactly(config):
    """peft's adapters on the layers' weights besides LoRA train as exactly as LoRA (the README says so)."""
    model = peft.get_peft_model(build_causal_lm("qwen2"), config(["q_proj", "v_proj", "down_proj"]))
    inner = model.get_base_model()
    ids = torch.randint(0, 97, (2, 40), generator=torch.Generator().manual_seed(1))
    want_loss = full_sequence_loss(inner, ids)
    want_loss.backward()
    want = grads_of(model)
    model.zero_grad()
    loss = OOMBEngine(HFChunkModel(inner), OOMBConfig(16, 8)).loss(ids)
    loss.backward()
    assert abs(loss.item() - want_loss.item()) <= 1e-10 * want_loss.item()
    assert max_relative_error(grads_of(model), want) <= 1e-10


def test_a_loss_computed_with_the_adapters_disabled_is_refused_at_backward():
    """``with model.disable_adapter(): loss = model(...).loss`` then backward after the block: the backward sweep would
    recompute with the adapters on again and train them on a loss they took no part in (it did: every adapter moved;
    under ``strategy="auto"`` that loss has no gradient and its backward fails). Refused before the backward sweep."""

    class DisabledLM(LoRALM):
        def training_step(self, batch):
            with self.model.disable_adapter():
                return self.model(input_ids=batch, labels=batch).loss

    module = DisabledLM()
    before = {n: p.detach().clone() for n, p in module.named_parameters() if p.requires_grad}
    data = torch.randint(0, 97, (2, 40), generator=torch.Generator().manual_seed(2))
    with pytest.raises(RuntimeError, match=r"adapters were switched .*between engine.loss and its backward"):
        fit(oomb(), module, torch.utils.data.DataLoader(data, batch_size=2), steps=1)
    assert all(torch.equal(p, before[n]) for n, p in module.named_parameters() if p.requires_grad)


def test_a_reference_loss_with_the_adapters_disabled_is_refused_naming_it():
    """A KL / DPO-style reference loss (``torch.no_grad()`` and ``disable_adapter()``) beside the training call is a
    second call of the model: refused (one KV pool per step) with why and what to do instead (the message said only
    "called twice ... call it once")."""

    class ReferenceLM(LoRALM):
        def training_step(self, batch):
            with torch.no_grad(), self.model.disable_adapter():
                reference = self.model(input_ids=batch, labels=batch).loss
            return self.model(input_ids=batch, labels=batch).loss - reference

    data = torch.randint(0, 97, (2, 40), generator=torch.Generator().manual_seed(2))
    with pytest.raises(
        OOMBConfigError, match=r"twice \(one call under torch.no_grad\(\).*reference losses in a pass"
    ):
        fit(oomb(), ReferenceLM(), torch.utils.data.DataLoader(data, batch_size=2), steps=1)
