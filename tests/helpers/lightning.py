"""Lightning fixtures: a tiny LightningModule around a tiny HF model, its data and a quiet CPU Trainer."""

from __future__ import annotations

import lightning as L
import torch
from lightning.pytorch.callbacks import Callback
from torch.utils.data import DataLoader

from lightning_oomb import OOMBStrategy
from tests.helpers.models import build_causal_lm


class TinyLM(L.LightningModule):
    def __init__(self, lr: float = 0.5):
        super().__init__()
        self.model = build_causal_lm("qwen2", dtype=torch.float32)
        self.lr = lr

    def training_step(self, batch):
        loss = self.model(**batch).loss
        self.log("train_loss", loss)
        return loss

    def validation_step(self, batch):
        self.log("val_loss", self.model(**batch).loss)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=self.lr, momentum=0.9)  # state that resume must restore


def batches(n=6, seq=40, seed=1) -> DataLoader:
    gen = torch.Generator().manual_seed(seed)
    rows = []
    for _ in range(n):
        ids = torch.randint(0, 97, (seq,), generator=gen)
        rows.append({"input_ids": ids, "labels": ids, "attention_mask": torch.ones_like(ids)})
    return DataLoader(rows, batch_size=2)


def oomb(**options) -> OOMBStrategy:
    """The OOMB strategy at the tiny models' scale: 16-token chunks of 8-token pages."""
    return OOMBStrategy(chunk_size=16, page_size=8, **options)


def make_trainer(strategy, steps: int = 3, **kwargs) -> L.Trainer:
    """A CPU Trainer that writes nothing and prints nothing unless asked (32-true unless a plugin is given)."""
    for key, value in (("enable_checkpointing", False), ("logger", False), ("enable_progress_bar", False),
                       ("enable_model_summary", False)):  # fmt: skip
        kwargs.setdefault(key, value)
    if "plugins" not in kwargs:
        kwargs.setdefault("precision", "32-true")
    kwargs.setdefault("devices", 1)
    return L.Trainer(strategy=strategy, accelerator="cpu", max_steps=steps, **kwargs)


def fit(strategy, module=None, data=None, steps: int = 3, **kwargs):
    """Fit ``module`` (default :class:`TinyLM`) on ``data`` (default :func:`batches`); returns it and the Trainer."""
    module = module or TinyLM()
    trainer = make_trainer(strategy, steps, **kwargs)
    trainer.fit(module, data if data is not None else batches())
    return module, trainer


class _CallModel(L.LightningModule):
    def __init__(self, model, loss_of):
        super().__init__()
        self.model, self.loss_of = model, loss_of

    def training_step(self, batch):
        return self.loss_of(self.model, batch)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.0)


class _StepGrads(Callback):
    """The step's loss and the gradients the optimizer sees."""

    def on_train_batch_end(self, trainer, module, outputs, *_):
        self.loss = outputs["loss"].detach().clone()

    def on_before_optimizer_step(self, trainer, module, optimizer):
        self.grads = {
            n: p.grad.detach().clone() for n, p in module.model.named_parameters() if p.grad is not None
        }


def hf_loss(model, batch):
    return model(input_ids=batch, labels=batch).loss


def oomb_step_through_trainer(model, ids, config, loss_of=hf_loss, strategy_cls=None, **strategy_options):
    """One ``Trainer(strategy="oomb", precision="64-true")`` step of ``model`` on the rows of ``ids`` with the
    engine options ``config``: the logged loss and the parameter gradients (``loss_of(model, batch)`` is the
    user's training_step; ``strategy_cls``: an ``OOMBStrategy`` subclass to run)."""
    capture = _StepGrads()
    strategy = (strategy_cls or OOMBStrategy)(**{**vars(config), **strategy_options})
    fit(strategy, _CallModel(model, loss_of), DataLoader(list(ids), batch_size=len(ids)), steps=1,
        precision="64-true", callbacks=[capture])  # fmt: skip
    return capture.loss, capture.grads
