"""OOMBStrategy inside a real Trainer: parity with strategy="auto", hooks, logging, resume, errors."""

from __future__ import annotations

import warnings
from unittest import mock

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from lightning.pytorch.plugins.precision import DoublePrecision, HalfPrecision, MixedPrecision, Precision
from lightning.pytorch.strategies import StrategyRegistry
from lightning.pytorch.tuner import Tuner
from torch.utils.data import DataLoader

import lightning_oomb
from lightning_oomb import OOMBConfigError, OOMBContextParallelStrategy, OOMBOutOfMemoryError, OOMBStrategy
from lightning_oomb.engine.planner import Machine
from tests.helpers.lightning import TinyLM, batches, fit, make_trainer, oomb


class CountHooks(Callback):
    def __init__(self):
        self.calls = {"before": 0, "after": 0, "batches": 0}

    def on_train_batch_start(self, *_):
        self.calls["batches"] += 1

    def on_before_backward(self, *_):
        self.calls["before"] += 1

    def on_after_backward(self, *_):
        self.calls["after"] += 1


def max_param_diff(a, b):
    return max((p - q).abs().max().item() for p, q in zip(a.parameters(), b.parameters(), strict=True))


def test_import_registers_the_strategy():
    assert "oomb" in StrategyRegistry
    trainer = L.Trainer(strategy="oomb", accelerator="cpu", logger=False)
    assert isinstance(trainer.strategy, OOMBStrategy)
    lightning_oomb.OOMBStrategy.register_strategies(StrategyRegistry)  # idempotent


@pytest.mark.parametrize(
    ("flag", "stock", "dtype"),
    [
        ("32-true", Precision, torch.float32),
        ("64-true", DoublePrecision, torch.float64),
        ("bf16-mixed", MixedPrecision, torch.bfloat16),
        ("bf16-true", HalfPrecision, torch.bfloat16),
    ],
)
def test_every_stock_precision_is_kept_as_it_is(flag, stock, dtype):
    """What reads the plugin's type sees the stock one: ThroughputMonitor's compute dtype (a wrapper read as 32-true
    made its MFU 15x too high under bf16)."""
    from lightning.pytorch.callbacks.throughput_monitor import _plugin_to_compute_dtype

    trainer = L.Trainer(strategy=oomb(), precision=flag, accelerator="cpu", logger=False)
    plugin = trainer.strategy.precision_plugin
    assert type(plugin) is stock and _plugin_to_compute_dtype(plugin) == dtype


def test_a_plugin_of_another_strategy_is_refused():
    from lightning.pytorch.plugins.precision import FSDPPrecision

    with pytest.raises(OOMBConfigError, match="FSDPPrecision cannot be combined with the OOMB strategy"):
        OOMBStrategy(precision_plugin=FSDPPrecision("bf16-mixed"))


def test_scaler_state_resumes_from_a_checkpoint_of_the_former_wrapper():
    """Checkpoints written while the strategy wrapped its plugin filed the scaler under both class names: the stock
    plugin's key restores it."""
    stock = MixedPrecision("16-mixed", "cpu", scaler=torch.amp.GradScaler("cpu", init_scale=1024.0))
    checkpoint = {"OOMBPrecision": stock.state_dict(), "MixedPrecision": stock.state_dict()}
    trainer = L.Trainer(strategy=oomb(), accelerator="cpu", logger=False)
    trainer.strategy.precision_plugin = MixedPrecision("16-mixed", "cpu", scaler=torch.amp.GradScaler("cpu"))
    trainer._checkpoint_connector._loaded_checkpoint = checkpoint
    trainer._checkpoint_connector.restore_precision_plugin_state()
    assert trainer.strategy.precision_plugin.scaler.get_scale() == 1024.0


def test_accelerator_auto_resolves_to_the_gpu():
    """pytorch-lightning#18902: a registry-built SingleDeviceStrategy would stay on cpu."""
    with (
        mock.patch("lightning.fabric.accelerators.cuda.num_cuda_devices", return_value=1),
        mock.patch("lightning.pytorch.accelerators.cuda.num_cuda_devices", return_value=1),
    ):
        trainer = L.Trainer(strategy="oomb", accelerator="auto", devices=1, logger=False)
    assert trainer.strategy.root_device == torch.device("cuda", 0)


@pytest.mark.parametrize(
    ("precision", "tol"),
    [
        ("32-true", 1e-6),
        ("64-true", 1e-8),  # HF's own loss upcasts logits to fp32 only
        ("bf16-mixed", 2e-3),
        ("bf16-true", 4e-3),  # one bf16 ulp of the weights
        (MixedPrecision("16-mixed", "cpu"), 2e-3),
    ],
    ids=["32-true", "64-true", "bf16-mixed", "bf16-true", "16-mixed-scaler"],
)
def test_parity_with_auto_strategy(precision, tol):
    def kwargs():
        p = precision if isinstance(precision, str) else MixedPrecision("16-mixed", "cpu")
        key = "precision" if isinstance(p, str) else "plugins"
        return {key: p, "accumulate_grad_batches": 2, "gradient_clip_val": 0.05}

    hooks = CountHooks()
    want, t_auto = fit("auto", **kwargs())
    got, t_oomb = fit(oomb(), callbacks=[hooks], **kwargs())
    assert max_param_diff(got, want) <= tol
    assert max_param_diff(got, TinyLM()) > 1e-3  # training moved the weights (clipped steps)
    assert (
        hooks.calls["before"] == hooks.calls["after"] == hooks.calls["batches"] == 5
    )  # 3 steps, accumulate 2
    logged = [t.callback_metrics["train_loss"].item() for t in (t_oomb, t_auto)]
    assert logged[0] == pytest.approx(logged[1], rel=max(tol, 1e-6))  # HF logs an fp32 loss
    if not isinstance(precision, str):
        assert t_oomb.strategy.precision_plugin.scaler is not None


def test_validation_loss_matches_auto():
    def validate(strategy):
        trainer = L.Trainer(strategy=strategy, accelerator="cpu", logger=False, enable_progress_bar=False)
        return trainer.validate(TinyLM(), batches(2, seed=9), verbose=False)[0]["val_loss"]

    assert validate(oomb()) == pytest.approx(validate("auto"), rel=1e-6)


def test_resume_gives_the_uninterrupted_next_loss(tmp_path):
    class LossRecorder(Callback):
        def __init__(self):
            self.losses = []

        def on_train_batch_end(self, trainer, module, outputs, *_):
            self.losses.append(outputs["loss"].item())

    straight = LossRecorder()
    fit(
        oomb(), data=batches(2), steps=3, callbacks=[straight]
    )  # one batch per epoch: resume at an epoch boundary
    ckpt = ModelCheckpoint(dirpath=tmp_path, save_last=True)
    fit(
        oomb(),
        data=batches(2),
        steps=2,
        callbacks=[ckpt],
        enable_checkpointing=True,
        default_root_dir=tmp_path,
    )
    resumed = LossRecorder()
    trainer = make_trainer(oomb(), 3, callbacks=[resumed], default_root_dir=tmp_path)
    trainer.fit(TinyLM(), batches(2), ckpt_path=str(tmp_path / "last.ckpt"))
    assert resumed.losses == pytest.approx(straight.losses[2:], rel=1e-6)


class ManualLM(TinyLM):
    """Manual optimization: two optimizers (the attention's and the rest), toggled in turn; each step's loss
    backed up by ``manual_backward``, clipped, and stepped every second batch (a manual accumulation)."""

    def __init__(self):
        super().__init__()
        self.automatic_optimization = False

    def configure_optimizers(self):
        attention = [p for n, p in self.named_parameters() if "self_attn" in n]
        rest = [p for n, p in self.named_parameters() if "self_attn" not in n]
        return torch.optim.SGD(attention, lr=0.5, momentum=0.9), torch.optim.AdamW(rest, lr=1e-2)

    def training_step(self, batch, batch_idx):
        opt = self.optimizers()[(batch_idx // 2) % 2]
        self.toggle_optimizer(opt)
        loss = self.model(**batch).loss
        self.manual_backward(loss / 2)
        if batch_idx % 2:
            self.clip_gradients(opt, gradient_clip_val=0.05, gradient_clip_algorithm="norm")
            opt.step()
            opt.zero_grad()
        self.untoggle_optimizer(opt)
        self.log("train_loss", loss)


class NoModelCallLM(TinyLM):
    def training_step(self, batch):
        return self.model.lm_head.weight.sum()


class TwoCallsLM(TinyLM):
    def training_step(self, batch):
        return self.model(**batch).loss + self.model(**batch).loss


class LeftPaddedLM(TinyLM):
    def training_step(self, batch):
        batch["attention_mask"][:, :3] = 0  # right padding is supported; left padding is not
        return self.model(**batch).loss


class ExtraKeysLM(TinyLM):
    def training_step(self, batch):
        return self.model(**batch, token_type_ids=torch.zeros_like(batch["input_ids"])).loss


class LogitsLM(TinyLM):
    def training_step(self, batch):
        output = self.model(**batch)
        assert not hasattr(output.logits, "_fields")  # probes (Lightning's, HF's) see an ordinary object
        return output.loss + output.logits.float().mean()


class OwnCrossEntropyLM(TinyLM):
    def training_step(self, batch):
        out = self.model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"])
        logits = out.logits[:, :-1]
        return torch.nn.functional.cross_entropy(logits.flatten(0, 1), batch["labels"][:, 1:].flatten())


def test_a_loss_of_ones_own_from_the_logits_is_refused_before_the_backward_holding_nothing():
    """A cross-entropy of one's own from ``out.logits`` (a call without labels: a supported call, whose labels default
    to input_ids) is refused at the logits' first use, after the call's forward sweep and before any backward, naming
    the supported way; the step's pages and state are freed then, though the traceback still holds the loss (it kept
    the step, and the engine refused its next loss as one still waiting for its backward)."""
    module = OwnCrossEntropyLM()
    backward = CountHooks()
    trainer = make_trainer(oomb(), 1, callbacks=[backward])
    with pytest.raises(OOMBConfigError, match=r"cannot train under OOMB: return `output.loss`") as refused:
        trainer.fit(module, batches())
    assert backward.calls["before"] == 0
    engine = trainer.strategy.engine
    assert engine.pool.stats()["hbm_pool_bytes"] == 0
    assert engine._pending is None and refused.traceback is not None
    engine.loss(torch.randint(0, 97, (1, 16))).backward()  # the engine serves the next step
    given_up = engine.loss(torch.randint(0, 97, (1, 16)))
    engine.abandon()
    with pytest.raises(RuntimeError, match="step was abandoned"):
        given_up.backward()


@pytest.mark.parametrize(
    ("module", "match"),
    [
        (LogitsLM, "logits of the whole sequence are never materialised"),
        (NoModelCallLM, "returned a loss without calling the OOMB-managed model"),
        (TwoCallsLM, "twice"),
        (LeftPaddedLM, "not right padding"),
        (ExtraKeysLM, r"cannot take \['token_type_ids'\].*drop such keys from the batch"),
    ],
)
def test_bad_use_is_refused_with_the_fix(module, match):
    with pytest.raises(OOMBConfigError, match=match):
        fit(oomb(), module=module(), steps=1)


def test_a_strategy_instance_serves_a_second_trainer():
    """(The second Trainer raised "CPU parallel_devices set through OOMBStrategy class, but accelerator set"; with
    an explicit ``accelerator=`` Lightning refuses a used instance of its own strategies too.)"""
    strategy = oomb()
    for _ in range(2):
        trainer = L.Trainer(strategy=strategy, max_steps=1, logger=False, enable_checkpointing=False,
                            enable_progress_bar=False, enable_model_summary=False)  # fmt: skip
        module = TinyLM()
        trainer.fit(module, batches())
        trainer.validate(module, batches(2), verbose=False)  # the same Trainer again: its device kept
    assert strategy.root_device == torch.device("cpu")


class BaseModelBesideLM(TinyLM):
    def training_step(self, batch):
        loss = self.model(**batch).loss
        extra = self.model.model(input_ids=batch["input_ids"]).last_hidden_state.pow(2).mean()
        return loss + 1e-3 * extra


def test_a_base_model_call_beside_the_causal_lms_warns_before_it_runs():
    """(It ran the whole sequence unchunked without a word.)"""
    with pytest.warns(
        UserWarning, match=r"base model \(Qwen2Model\) was called directly inside a managed step"
    ):
        fit(oomb(), module=BaseModelBesideLM(), steps=1)
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*called directly inside a managed step")
        fit(oomb(), steps=1)


class BaseModelOnlyLM(TinyLM):
    def __init__(self):
        super().__init__()
        self.embedded = 0  # calls of the embedding: the base model's forward began

        def count(*_):
            self.embedded += 1

        self.model.model.embed_tokens.register_forward_pre_hook(count)

    def training_step(self, batch):
        hidden = self.model.model(batch["input_ids"]).last_hidden_state
        logits = self.model.lm_head(hidden[:, :-1]).float()
        return torch.nn.functional.cross_entropy(logits.flatten(0, 1), batch["labels"][:, 1:].flatten())


def test_a_step_that_trains_through_the_base_model_alone_is_refused_before_it_runs():
    """(It was warned about, then ran its whole sequence unchunked — an out-of-memory on a long one — and was refused
    only after, for returning a loss without calling the causal LM.)"""
    module = BaseModelOnlyLM()
    with pytest.raises(
        OOMBConfigError,
        match=r"base model \(Qwen2Model\) was called directly in a training step, before the causal LM .*"
        r"return `self.model\(\*\*batch\).loss`.*call the causal LM first",
    ):
        fit(oomb(), module=module, steps=1)
    assert module.embedded == 0


def test_manual_optimization_equals_auto_strategy():
    """(It was refused; ``manual_backward`` of the model call's loss runs the backward sweep.)"""
    want, _ = fit("auto", module=ManualLM(), steps=8, precision="64-true")
    got, _ = fit(oomb(), module=ManualLM(), steps=8, precision="64-true")
    assert (
        max_param_diff(got, want) <= 1e-8
    )  # as test_parity_with_auto_strategy: HF's loss upcasts to fp32 only
    assert max_param_diff(got, ManualLM().double()) > 1e-3  # both optimizers moved their weights


class SkipsOddBatchesLM(TinyLM):
    def training_step(self, batch, batch_idx):
        return None if batch_idx % 2 else self.model(**batch).loss


def test_a_step_that_returns_none_skips_the_batch_as_lightning_does():
    """Lightning's idiom for skipping a batch (before calling the model) works under OOMB too."""
    trained = {}
    for name, strategy in (("auto", "auto"), ("oomb", oomb())):
        module, trainer = fit(strategy, module=SkipsOddBatchesLM(), steps=2, max_epochs=1)
        trained[name] = ([p.detach().clone() for p in module.parameters()], trainer.global_step)
    assert trained["oomb"][1] == trained["auto"][1] == 2
    assert max((a - b).abs().max().item() for a, b in zip(*(trained[n][0] for n in trained))) <= 1e-5


def test_more_than_one_device_is_refused():
    trainer = L.Trainer(strategy=oomb(), accelerator="cpu", devices=2, logger=False, max_steps=1)
    with pytest.raises(OOMBConfigError, match="devices=1"):
        trainer.fit(TinyLM(), batches())


def test_bad_strategy_arguments_fail_at_construction():
    with pytest.raises(OOMBConfigError, match="multiple of page_size"):
        OOMBStrategy(chunk_size=100, page_size=64)


def test_sanity_validation_then_training():
    """Validation runs under inference mode; the pool it allocates must still serve training."""
    module = TinyLM()
    trainer = L.Trainer(
        strategy=oomb(),
        accelerator="cpu",
        max_steps=2,
        limit_val_batches=1,
        num_sanity_val_steps=1,
        val_check_interval=1,
        logger=False,
        enable_progress_bar=False,
        enable_checkpointing=False,
    )
    trainer.fit(module, batches(), batches(2, seed=9))
    assert "val_loss" in trainer.callback_metrics


def test_offload_through_the_strategy_matches_no_offload():
    plain, _ = fit(oomb())
    offloaded, trainer = fit(OOMBStrategy(chunk_size=16, page_size=8, offload=True, hbm_budget=0))
    assert trainer.strategy.engine.stats.extra["host_layers"] == 2
    # host layers are attended block by block (a log-sum-exp merge): equal up to float32 rounding
    assert max_param_diff(plain, offloaded) <= 1e-5


@pytest.mark.parametrize("strategy_cls", [OOMBStrategy, OOMBContextParallelStrategy])
def test_strategy_arguments_are_the_config_options(strategy_cls):
    """OOMBConfig defines every option once; each strategy's typed __init__ (the YAML schema) has each with the
    same annotation and default — but the options its memory plan decides, "auto" there — and its docstring carries
    each option's documentation."""
    import dataclasses
    import inspect

    from lightning_oomb.engine import OOMBConfig
    from lightning_oomb.engine.config import STRATEGY_DEFAULTS

    params = inspect.signature(strategy_cls.__init__).parameters
    for field in dataclasses.fields(OOMBConfig):
        assert field.name in params, field.name
        assert params[field.name].default == STRATEGY_DEFAULTS.get(field.name, field.default), field.name
        assert params[field.name].annotation == field.type, field.name
    assert OOMBConfig.args_doc() in strategy_cls.__doc__
    strategy = strategy_cls(loss_block=256, prefetch_depth=2)
    assert strategy.oomb_config == OOMBConfig(loss_block=256, prefetch_depth=2, **STRATEGY_DEFAULTS)


def test_triton_without_cuda_is_refused_at_setup(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)  # (the tests interpret the kernels on CPU)
    with pytest.raises(
        OOMBConfigError, match="attention_backend='triton' cannot run on a cpu device.*'auto'"
    ) as err:
        fit(oomb(attention_backend="triton"), steps=1)
    assert "setup" in "".join(str(f.name) for f in err.traceback)


def test_a_page_size_the_kernels_cannot_take_is_refused_at_setup():
    module = TinyLM()
    with pytest.raises(
        OOMBConfigError, match="page_size=24 cannot be used with the Triton attention kernels"
    ):
        fit(OOMBStrategy(chunk_size=48, page_size=24, attention_backend="triton"), module=module, steps=1)


def test_checkpointing_is_not_left_on_after_a_fit():
    module, trainer = fit(oomb(layer_checkpointing=True), steps=1)
    assert trainer.global_step == 1
    assert not any(getattr(m, "gradient_checkpointing", False) for m in module.model.modules())


class GeneratingLM(TinyLM):
    def validation_step(self, batch):
        self.model.generate(batch["input_ids"][:, :4], max_new_tokens=2, do_sample=False)


def test_generate_inside_validation_step_says_where_to_generate():
    trainer = make_trainer(oomb(), 1)
    with pytest.raises(OOMBConfigError, match="generate in predict_step"):
        trainer.validate(GeneratingLM(), batches(2))


def test_the_batch_size_finder_backs_off_from_a_batch_the_plan_refuses():
    """On a GPU a refused step raises ``OOMBOutOfMemoryError``, whose message Lightning reads as CUDA's out-of-memory
    error: ``Tuner.scale_batch_size`` keeps the last batch that fit (the refusal, a plain ``ValueError``, ended the
    search). The GPU: 2 MiB as the plan sees it (planned on this CPU)."""

    class SmallGPU(OOMBStrategy):
        def _planning_machine(self, resident_bytes):
            return Machine("cuda", 2 << 20, super()._planning_machine(resident_bytes).host_bytes)

    class Module(TinyLM):
        batch_size = 2
        validation_step = None

        def train_dataloader(self):
            return DataLoader(batches(32, seq=256).dataset, batch_size=self.batch_size)

    trainer = make_trainer(SmallGPU(chunk_size=16, page_size=8), steps=1)
    assert Tuner(trainer).scale_batch_size(Module(), mode="power", max_trials=5, steps_per_trial=1) == 8
    assert issubclass(OOMBOutOfMemoryError, OOMBConfigError) and issubclass(
        OOMBOutOfMemoryError, RuntimeError
    )
