"""CausalLMModule: lazy model construction, from_pretrained from a local folder, the learning-rate schedule,
validation metrics weighted by target tokens."""

from __future__ import annotations

import math

import pytest
import torch
from torch.utils.data import DataLoader

from lightning_oomb import OOMBConfigError, OOMBStrategy
from lightning_oomb.models import (
    QWEN2_5_7B,
    CausalLMModule,
    build_config,
    fused_adamw,
    lr_factor,
    qwen2_5_7b_config,
)
from tests.helpers.lightning import make_trainer
from tests.helpers.models import build_causal_lm

TINY = {
    "model_type": "qwen2",
    "vocab_size": 32,
    "hidden_size": 16,
    "intermediate_size": 32,
    "num_hidden_layers": 1,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
}


def test_module_builds_lazily_from_a_config():
    module = CausalLMModule(config=TINY)
    assert module.model is None  # nothing built until the Trainer (or the user) calls configure_model
    module.configure_model()
    model = module.model
    module.configure_model()
    assert module.model is model and type(model).__name__ == "Qwen2ForCausalLM"
    assert model.config.hidden_size == 16 and model.config._attn_implementation == "sdpa"


def test_module_loads_a_local_checkpoint(tmp_path):
    source = CausalLMModule(config=TINY)
    source.configure_model()
    source.model.save_pretrained(tmp_path)
    module = CausalLMModule(model_name_or_path=str(tmp_path), dtype="float64")
    module.configure_model()
    assert module.model.dtype == torch.float64
    assert (
        module.model.training
    )  # from_pretrained returns it in eval mode: fine-tuning would drop its dropout
    for (name, a), b in zip(source.model.state_dict().items(), module.model.state_dict().values()):
        assert torch.equal(a.double(), b), name


@pytest.mark.parametrize("kwargs", [{}, {"model_name_or_path": "x", "config": TINY}])
def test_module_needs_exactly_one_model_source(kwargs):
    with pytest.raises(OOMBConfigError, match="exactly one of model_name_or_path"):
        CausalLMModule(**kwargs)


def test_config_needs_a_model_type():
    with pytest.raises(OOMBConfigError, match="model_type"):
        build_config({"hidden_size": 8})


def test_qwen2_5_7b_shape():
    config = qwen2_5_7b_config(num_hidden_layers=2)
    assert config.model_type == "qwen2" and config.num_hidden_layers == 2
    assert (config.hidden_size, config.num_attention_heads, config.num_key_value_heads) == (3584, 28, 4)
    assert (config.head_dim, config.intermediate_size, config.vocab_size) == (128, 18944, 152064)
    assert not config.tie_word_embeddings and config.rms_norm_eps == 1e-6
    assert config.rope_parameters["rope_theta"] == QWEN2_5_7B["rope_theta"] == 1e6


def test_lr_schedule_warms_up_then_decays_to_the_floor():
    factors = [lr_factor(s, warmup_steps=4, total_steps=20, min_ratio=0.1) for s in range(21)]
    assert factors[:4] == [0.25, 0.5, 0.75, 1.0]
    assert factors[4] == 1.0 and all(a >= b for a, b in zip(factors[4:], factors[5:]))
    assert factors[20] == pytest.approx(0.1)
    assert lr_factor(100, 0, math.inf, 0.1) == 1.0  # no planned end: constant after the warm-up


def test_weight_decay_skips_norms_and_biases():
    module = CausalLMModule(config=TINY, weight_decay=0.1)
    module.configure_model()
    trainer = {"estimated_stepping_batches": 10, "precision": "32-true", "gradient_clip_val": None}
    module.trainer = type("Trainer", (), trainer)()
    optimizer = module.configure_optimizers()["optimizer"]
    assert not optimizer.defaults["fused"]  # on a CPU: torch's default AdamW
    decay, no_decay = optimizer.param_groups
    assert decay["weight_decay"] == 0.1 and no_decay["weight_decay"] == 0.0
    assert all(p.dim() >= 2 for p in decay["params"]) and all(p.dim() < 2 for p in no_decay["params"])
    assert len(decay["params"]) + len(no_decay["params"]) == len(list(module.parameters()))


# fused: no state-sized sqrt temporary at the optimizer step; not where Lightning's mixed-precision plugin must clip
# (it refuses a fused optimizer) or scales the loss (a fused step unscales inside: hooks would see scaled gradients)
@pytest.mark.parametrize(("choice", "device", "precision", "clip", "fused"), [
    (None, "cuda", "bf16-true", 1.0, True),
    (None, "cuda", "bf16-mixed", None, True),
    (None, "cuda", "bf16-mixed", 1.0, False),
    (None, "cuda", "16-mixed", None, False),
    (None, "cpu", "32-true", None, False),
    (False, "cuda", "bf16-true", None, False),
    (True, "cpu", "32-true", 1.0, True),
])  # fmt: skip
def test_adamw_is_fused_on_a_gpu_unless_lightning_must_clip_it_under_mixed_precision(
    choice, device, precision, clip, fused
):
    assert fused_adamw(choice, device, precision, clip) is fused


def test_a_fused_adamw_that_lightning_cannot_clip_is_refused_and_one_it_can_trains():
    with pytest.raises(
        OOMBConfigError, match=r"fused_optimizer=True with precision='16-mixed' .* drop gradient"
    ):
        fused_adamw(True, "cuda", "16-mixed", 0.5)
    module = CausalLMModule(config=TINY, fused_optimizer=True)
    trainer = make_trainer(OOMBStrategy(chunk_size=16, page_size=8), 1, gradient_clip_val=0.5)
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, TINY["vocab_size"], (2, 40), generator=gen)
    trainer.fit(module, DataLoader([{"input_ids": row[None]} for row in ids], batch_size=None))
    assert trainer.optimizers[0].defaults["fused"] and trainer.global_step == 1


def _batch(gen: torch.Generator, rows: int, tokens: int, ignored: int = 0) -> dict[str, torch.Tensor]:
    """Random ids; the first ``ignored`` labels of every row are -100."""
    ids = torch.randint(0, 97, (rows, tokens), generator=gen)
    labels = ids.clone()
    labels[:, :ignored] = -100
    return {"input_ids": ids, "labels": labels}


@pytest.mark.parametrize("precision", ["32-true", "bf16-true"])  # bf16-true converts the metric's state too
def test_validation_metrics_weigh_batches_by_their_target_tokens(precision):
    gen = torch.Generator().manual_seed(0)
    # 5, 98, 5 and 0 target tokens (the last batch: HF's loss is NaN, it must weigh nothing)
    batches = [
        _batch(gen, 1, 6),
        _batch(gen, 2, 50),
        _batch(gen, 1, 30, ignored=25),
        _batch(gen, 1, 8, ignored=8),
    ]
    module = CausalLMModule(config=TINY)
    module.model = build_causal_lm("qwen2", dtype=torch.float32)  # configure_model keeps a model it is given
    trainer = make_trainer("auto", precision=precision)
    trainer.validate(module, DataLoader(batches, batch_size=None), verbose=False)

    with torch.no_grad():  # the per-batch losses validation_step saw: HF's mean over each batch's targets
        losses = torch.stack([module.model(**b).loss.double() for b in batches[:-1]])
    counts = torch.tensor(
        [int((b["labels"][:, 1:] != -100).sum()) for b in batches[:-1]], dtype=torch.float64
    )
    assert counts.tolist() == [5, 98, 5]
    weighted = float((losses * counts).sum() / counts.sum())
    logged = trainer.callback_metrics
    assert float(logged["val_loss"]) == pytest.approx(weighted, rel=1e-6)
    assert float(logged["val_ppl"]) == pytest.approx(math.exp(weighted), rel=1e-6)
    # the unweighted mean of the batch losses is a different number
    assert abs(math.exp(float(losses.mean())) - float(logged["val_ppl"])) > 1e-3


def test_packed_documents_train_alike_under_any_strategy():
    """Packed rows (positions restarting): HF keeps the documents apart only without a KV cache (its default
    use_cache=True lets them attend to each other), so the module calls it with use_cache=False and the default
    strategy's step loss is OOMB's (float64)."""
    import lightning as L

    import lightning_oomb

    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 32, (2, 40), generator=gen)
    positions = torch.cat([torch.arange(13), torch.arange(27)]).expand(2, -1)
    labels = ids.masked_fill(positions == 0, -100)
    batch = {"input_ids": ids, "labels": labels, "position_ids": positions}

    class Losses(L.Callback):
        def __init__(self):
            self.losses = []

        def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
            self.losses.append(float(outputs["loss"]))

    seen = {}
    for name, strategy in (
        ("auto", "auto"),
        ("oomb", lightning_oomb.OOMBStrategy(chunk_size=16, page_size=8)),
    ):
        torch.manual_seed(0)
        module, record = CausalLMModule(config=TINY), Losses()
        trainer = make_trainer(strategy, steps=2, precision="64-true", callbacks=[record])
        trainer.fit(module, DataLoader([batch, batch], batch_size=None))
        seen[name] = record.losses
    assert seen["auto"] == pytest.approx(seen["oomb"], rel=1e-6)  # HF: a float32 cross-entropy


def test_right_padding_has_no_targets_under_any_strategy():
    """A right-padded batch: its padded positions are no targets (OOMB's rule; HF would train on their labels), so
    ``val_loss`` is the mean over the real targets, the same under both strategies (it weighed padded ones)."""
    import lightning_oomb

    gen = torch.Generator().manual_seed(0)
    short = _batch(gen, 1, 64)
    short["attention_mask"] = torch.ones_like(short["input_ids"])
    short["attention_mask"][:, 8:] = 0
    full = _batch(gen, 1, 64)
    full["attention_mask"] = torch.ones_like(full["input_ids"])
    batches = [short, full]
    seen = {}
    for name, strategy in (
        ("auto", "auto"),
        ("oomb", lightning_oomb.OOMBStrategy(chunk_size=16, page_size=8)),
    ):
        module = CausalLMModule(config=TINY)
        module.model = build_causal_lm("qwen2", dtype=torch.float64)
        trainer = make_trainer(strategy, precision="64-true")
        trainer.validate(module, DataLoader(batches, batch_size=None), verbose=False)
        seen[name] = float(trainer.callback_metrics["val_loss"])
    model = build_causal_lm("qwen2", dtype=torch.float64)
    with torch.no_grad():  # by hand: the real tokens' summed losses over their count (7 + 63 targets)
        sums = [model(input_ids=b["input_ids"][:, :n], labels=b["input_ids"][:, :n]).loss * (n - 1)
                for b, n in ((short, 8), (full, 64))]  # fmt: skip
    want = float(sum(sums) / 70)
    assert seen["auto"] == pytest.approx(want, rel=1e-6) and seen["oomb"] == pytest.approx(want, rel=1e-6)


def test_dtype_applies_to_a_model_built_from_a_config_too():
    """``oomb plan`` counts the weights in ``dtype``: the model the module builds must be in it."""
    module = CausalLMModule(config=TINY, dtype="bfloat16")
    module.configure_model()
    assert {p.dtype for p in module.model.parameters()} == {torch.bfloat16}


def test_a_local_model_path_that_does_not_exist_is_refused_before_the_data_is_read(tmp_path):
    """Lightning builds the model after the data module's setup (which tokenizes): the module's ``prepare_data``,
    which runs first, names the path; transformers said 'Repo id must be in the form ...'."""
    with pytest.raises(OOMBConfigError, match="model_name_or_path='/no/such/model' is not a directory"):
        CausalLMModule(model_name_or_path="/no/such/model").prepare_data()
    with pytest.raises(OOMBConfigError, match="is not a directory"):
        CausalLMModule(model_name_or_path=str(tmp_path / "missing")).prepare_data()
    CausalLMModule(model_name_or_path="Qwen/Qwen2.5-7B").prepare_data()  # a hub id: loaded (or refused) later
    # the data modules' tokenizer likewise (it had no check)
    from lightning_oomb.data import load_tokenizer

    with pytest.raises(OOMBConfigError, match="tokenizer='./no_such_tok' is not a directory"):
        load_tokenizer("./no_such_tok")


def test_trainer_test_reports_the_held_out_loss_as_test_metrics():
    """``oomb test`` / ``trainer.test``: the text data module tests on its held-out rows, the module logs
    ``test_loss`` and ``test_ppl`` as validation logs ``val_loss`` (it had no ``test_step``)."""
    from lightning_oomb.data import TextFileDataModule

    words = ["the", "quick", "brown", "fox", "jumps", "over", "the", "lazy", "dog"]
    records = [{"text": " ".join(words[i % 5 :] * 4)} for i in range(12)]
    data = TextFileDataModule(records=records, tokenizer="bytes", seq_len=32, val_rows=2)
    module = CausalLMModule(config={**TINY, "vocab_size": data.vocab_size})
    trainer = make_trainer("oomb", 1)
    val = trainer.validate(module, data, verbose=False)[0]
    test = trainer.test(module, data, verbose=False)[0]
    assert test["test_loss"] == pytest.approx(val["val_loss"]) and test["test_ppl"] == pytest.approx(
        val["val_ppl"]
    )


def test_a_tokenizer_whose_ids_the_model_lacks_is_refused_before_the_model_is_built(tmp_path):
    """The bytes tokenizer's ids reach 258; a model of 100 embedding rows is refused in ``configure_model`` (before
    ``from_pretrained`` loads weights), not at the first step; added tokens the text never uses need no row."""
    from lightning_oomb.data import TextFileDataModule

    (tmp_path / "a.txt").write_text("the quick brown fox jumps over the lazy dog " * 8)
    data = TextFileDataModule(str(tmp_path / "a.txt"), tokenizer="bytes", seq_len=32, val_rows=1)
    data.setup("fit")
    largest = data.largest_token_id
    assert (
        largest == max(b + 3 for b in b"the quick brown fox jumps over the lazy dog ") < data.vocab_size - 1
    )
    source = CausalLMModule(config={**TINY, "vocab_size": largest})
    source.configure_model()
    source.model.save_pretrained(tmp_path / "model")
    for module in (CausalLMModule(config={**TINY, "vocab_size": largest}),
                   CausalLMModule(model_name_or_path=str(tmp_path / "model"))):  # fmt: skip
        trainer = make_trainer(OOMBStrategy(chunk_size=16, page_size=8), 1, limit_val_batches=0)
        with pytest.raises(
            OOMBConfigError, match=f"token ids reach {largest} but .* is {largest} — the tokenizer"
        ):
            trainer.fit(module, datamodule=data)
        assert module.model is None
    module = CausalLMModule(config={**TINY, "vocab_size": largest + 1})
    make_trainer(OOMBStrategy(chunk_size=16, page_size=8), 1, limit_val_batches=0).fit(
        module, datamodule=data
    )


def test_a_hub_id_that_cannot_be_fetched_is_named_with_the_fix(monkeypatch):
    """Without network (or with a wrong id) transformers raises a long ``OSError``; the module and the data module
    name the id and the fix in an ``OOMBConfigError`` (which ``oomb`` prints as one line)."""
    import transformers

    from lightning_oomb.data import load_tokenizer

    def unreachable(name, *args, **kwargs):
        raise OSError(
            f"We couldn't connect to 'https://huggingface.co' to load the files of {name}.\nCheck ..."
        )

    for auto in (transformers.AutoConfig, transformers.AutoTokenizer):
        monkeypatch.setattr(auto, "from_pretrained", unreachable)
    with pytest.raises(
        OOMBConfigError, match=r"model 'no-such-org/no-such-model' could not be loaded \(OSError"
    ):
        CausalLMModule(model_name_or_path="no-such-org/no-such-model").configure_model()
    with pytest.raises(
        OOMBConfigError, match="tokenizer 'no-such-org/no-such-model' could not be loaded.*HF_HUB"
    ):
        load_tokenizer("no-such-org/no-such-model")


def test_lora_trains_only_the_adapters_as_under_any_strategy():
    """``lora``: peft adapters on the built model; only they train (AdamW over them alone) and they step as under
    the default strategy (float64), the base weights untouched."""
    import lightning_oomb

    gen = torch.Generator().manual_seed(0)
    batches = [{"input_ids": torch.randint(0, 32, (2, 40), generator=gen)} for _ in range(2)]
    lora = {"r": 2, "lora_alpha": 4, "target_modules": ["q_proj", "v_proj", "down_proj"]}
    stepped = {}
    for name, strategy in (
        ("auto", "auto"),
        ("oomb", lightning_oomb.OOMBStrategy(chunk_size=16, page_size=8)),
    ):
        torch.manual_seed(0)
        module = CausalLMModule(config=TINY, lora=lora, learning_rate=1e-2)
        trainer = make_trainer(strategy, steps=2, precision="64-true")
        trainer.fit(module, DataLoader(batches, batch_size=None))
        trained = {n for n, p in module.named_parameters() if p.requires_grad}
        assert trained and all(".lora_" in n for n in trained)
        optimized = {id(p) for group in trainer.optimizers[0].param_groups for p in group["params"]}
        assert optimized == {id(p) for n, p in module.named_parameters() if n in trained}
        stepped[name] = {n: p.detach().clone() for n, p in module.named_parameters()}
    torch.manual_seed(0)
    fresh = CausalLMModule(config=TINY, lora=lora, dtype="float64")  # as 64-true builds it
    fresh.configure_model()
    for n, p in fresh.named_parameters():
        moved = not torch.equal(p, stepped["oomb"][n])
        assert moved == (".lora_B" in n or ".lora_A" in n), n  # (lora_B starts at 0: both move after 2 steps)
        torch.testing.assert_close(
            stepped["oomb"][n], stepped["auto"][n], rtol=1e-6, atol=1e-8
        )  # HF: float32 loss


@pytest.mark.parametrize(
    ("lora", "match"), [({"rank": 16}, "not a valid peft.LoraConfig"), (16, "not a dict")]
)
def test_a_wrong_lora_is_refused_at_construction(lora, match):
    with pytest.raises(OOMBConfigError, match=match):
        CausalLMModule(config=TINY, lora=lora)


def test_lora_targets_this_model_lacks_are_refused_before_the_data_and_the_weights_load():
    """A ``target_modules`` naming no layer of the model (a typo): peft refused it only when ``configure_model``
    applied it, after the data module's setup and the weights' load; now ``prepare_data`` applies it to the model
    built on the meta device and names the model's linear layers."""
    import lightning as L

    class Data(L.LightningDataModule):
        set_up = False

        def setup(self, stage):
            Data.set_up = True

        def train_dataloader(self):
            return DataLoader([{"input_ids": torch.zeros(2, 40, dtype=torch.long)}], batch_size=None)

    module = CausalLMModule(config=TINY, lora={"target_modules": ["qproj"]})
    with pytest.raises(OOMBConfigError, match=r"Target modules \{'qproj'\} not found.*'q_proj'.*'v_proj'"):
        make_trainer("auto", steps=1).fit(module, datamodule=Data())
    assert not Data.set_up and module.model is None
