"""``CausalLMModule``: a plain LightningModule around a Hugging Face causal LM, configurable from YAML.

Nothing in it knows about OOMB: ``training_step`` is the usual ``self.model(**batch, use_cache=False).loss``, so
the same module trains under ``strategy="oomb"`` or any other strategy.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from lightning.pytorch import LightningModule
from torchmetrics.aggregation import MeanMetric

from lightning_oomb.data import check_local_dir, hub_errors_named
from lightning_oomb.engine.errors import OOMBConfigError
from lightning_oomb.engine.loss import IGNORE_INDEX

# Qwen2.5-7B's shape (random init from this config is what the benchmarks measure; docs/design.md, "Goals").
QWEN2_5_7B: dict[str, Any] = {
    "model_type": "qwen2",
    "hidden_size": 3584,
    "intermediate_size": 18944,
    "num_hidden_layers": 28,
    "num_attention_heads": 28,
    "num_key_value_heads": 4,
    "head_dim": 128,
    "vocab_size": 152064,
    "tie_word_embeddings": False,
    "rope_theta": 1e6,
    "rms_norm_eps": 1e-6,
    "max_position_embeddings": 131072,
}


def build_config(spec: dict[str, Any]):
    """A transformers config from ``{"model_type": ..., **kwargs}`` (``AutoConfig.for_model``)."""
    from transformers import AutoConfig
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    kwargs = dict(spec)
    model_type = kwargs.pop("model_type", None)
    if model_type is None:
        raise OOMBConfigError(
            f"model config {spec} has no 'model_type' — transformers needs it to pick the architecture — add "
            "e.g. model_type: qwen2 (or llama, mistral, qwen3)."
        )
    if model_type not in CONFIG_MAPPING:  # (transformers' error lists every known one)
        raise OOMBConfigError(
            f"model_type {model_type!r} is not an architecture of this transformers — check its spelling (e.g. "
            "qwen2, llama, mistral, qwen3), or pass a local model directory holding its config.json."
        )
    return AutoConfig.for_model(model_type, **kwargs)


def qwen2_5_7b_config(**overrides: Any):
    """A ``Qwen2Config`` shaped like Qwen2.5-7B (hidden 3584, 28 layers, 28/4 heads, vocab 152064, untied)."""
    return build_config({**QWEN2_5_7B, **overrides})


GLM_4_7_FLASH = {  # zai-org/GLM-4.7-Flash's shape (its config.json's sizes; no weights)
    "model_type": "glm4_moe_lite",
    "vocab_size": 154880,
    "hidden_size": 2048,
    "intermediate_size": 10240,
    "moe_intermediate_size": 1536,
    "num_hidden_layers": 47,
    "num_attention_heads": 20,
    "num_key_value_heads": 20,
    "n_shared_experts": 1,
    "n_routed_experts": 64,
    "num_experts_per_tok": 4,
    "kv_lora_rank": 512,
    "q_lora_rank": 768,
    "qk_nope_head_dim": 192,
    "qk_rope_head_dim": 64,
    "v_head_dim": 256,
    "max_position_embeddings": 202752,
    "tie_word_embeddings": False,
}


def glm_4_7_flash_config(**overrides: Any):
    """A ``Glm4MoeLiteConfig`` shaped like GLM-4.7-Flash (47 layers of multi-head latent attention, 20 heads, a
    latent of 512 + 64; 64 routed experts, 4 a token, and one shared; vocab 154880)."""
    return build_config({**GLM_4_7_FLASH, **overrides})


class CausalLMModule(LightningModule):
    """Train a Hugging Face ``*ForCausalLM`` on batches ``{"input_ids", "labels"}`` (plus ``position_ids`` for
    packed documents; every key goes to the model call, with ``use_cache=False``: transformers builds the mask
    that keeps packed documents apart only without a KV cache, so the module trains alike under any strategy)
    with AdamW.

    The model is built in :meth:`configure_model` (so the Trainer's device and precision contexts apply, and
    constructing the module, e.g. when a CLI parses a config, loads nothing).

    Targets: ``labels`` (default: ``input_ids``), none where ``attention_mask`` is 0 (right padding), under any
    strategy. Logged: ``train_loss`` per step; per validation run ``val_loss``, the mean loss over all validation
    *target tokens* (each batch's loss weighted by its targets, ``labels[:, 1:] != -100``), and
    ``val_ppl = exp(val_loss)``; ``trainer.test`` the same as ``test_loss`` and ``test_ppl``. A batch without targets
    weighs nothing.

    Args:
        model_name_or_path: hub id or local directory for ``AutoModelForCausalLM.from_pretrained``.
        config: instead of a checkpoint, ``{"model_type": "qwen2", **config_kwargs}`` for a randomly
            initialised model (``AutoConfig.for_model``). Give exactly one of the two.
        learning_rate: peak AdamW learning rate.
        weight_decay: AdamW weight decay, applied to matrices and embeddings only (not norms and biases).
        betas: AdamW betas.
        warmup_steps: linear learning-rate warm-up from ``learning_rate / warmup_steps``.
        min_lr_ratio: cosine decay after the warm-up, down to ``min_lr_ratio * learning_rate`` at the last step
            the Trainer plans (1.0 keeps the rate constant).
        attn_implementation: the model's own attention outside OOMB (validation under other strategies,
            generation); OOMB replaces it while it trains.
        dtype: the weights' dtype (``"bfloat16"``, ``"float32"``; ``"auto"``: a checkpoint's own), with a checkpoint
            or a ``config``; ``None`` lets the Trainer's precision decide (``precision="bf16-true"`` builds the model
            in bfloat16).
        fused_optimizer: torch's fused AdamW (``fused=True``: one kernel per step and no state-sized temporary —
            the ``foreach`` one, torch's CUDA default, makes a ``sqrt`` copy of its largest parameter group, 14 GiB
            at the optimizer step of a bf16 7B model, often a long-context run's peak). ``None``: fused for
            parameters on a GPU unless Lightning's mixed-precision plugin clips gradients (it refuses fused
            optimizers there: ``*-mixed`` with ``gradient_clip_val``) or scales the loss (``16-mixed``: hooks
            before the step would see scaled gradients), as :func:`fused_adamw` decides.
        lora: LoRA fine-tuning: the fields of a ``peft.LoraConfig`` (e.g. ``{"r": 16, "lora_alpha": 32,
            "target_modules": "all-linear"}``; its ``task_type`` is ``CAUSAL_LM``), applied to the built model with
            ``peft.get_peft_model``: only the adapters train (AdamW over them alone), the base weights stay frozen.
            Checked at construction. ``None`` (default): every weight trains. Checkpoints hold the whole module (a
            resume needs nothing else); ``module.model.save_pretrained(dir)`` writes the adapters alone.
    """

    def __init__(
        self,
        model_name_or_path: str | None = None,
        config: dict[str, Any] | None = None,
        learning_rate: float = 3e-4,
        weight_decay: float = 0.0,
        betas: tuple[float, float] = (0.9, 0.95),
        warmup_steps: int = 0,
        min_lr_ratio: float = 0.1,
        attn_implementation: str = "sdpa",
        dtype: str | None = None,
        fused_optimizer: bool | None = None,
        lora: dict[str, Any] | None = None,
    ) -> None:
        super().__init__()
        if (model_name_or_path is None) == (config is None):
            raise OOMBConfigError(
                "CausalLMModule needs exactly one of model_name_or_path (load a checkpoint) and config (random "
                f"init), got {'both' if config is not None else 'neither'} — pass one of them."
            )
        if lora is not None:
            lora_config(lora)  # a wrong field or a missing peft is named now, before any data or weights load
        self.save_hyperparameters()
        self.model: torch.nn.Module | None = None
        # A NaN loss (a diverged model) must show, not be dropped with a warning (the default). Replacing NaN by NaN
        # keeps it; "disable" would too but drops the weights (torchmetrics issue #3434, open in 1.9).
        self.val_token_loss = MeanMetric(nan_strategy=math.nan)

    def prepare_data(self) -> None:
        """Refuse a local model path that does not exist before the data module tokenizes anything (Lightning
        builds the model after the data module's ``setup``); transformers would say 'Repo id must be in the form
        ...'. (Not in ``__init__``: ``oomb plan`` plans a config whose path is another machine's.)"""
        check_local_dir(
            self.hparams.model_name_or_path, "model_name_or_path", "the model's config.json and weights"
        )
        if self.hparams.get("lora") is not None and self.model is None:
            self._check_lora_targets()

    def _check_lora_targets(self) -> None:
        """Apply ``lora`` to the model built on the meta device (no weights, seconds for a 7B) and refuse it if peft
        does (``target_modules`` naming no layer of this model, ``layers_to_transform`` past its layers): else peft
        says so only in :meth:`configure_model`, after the data module's ``setup`` and the weights' load."""
        from transformers import AutoConfig

        hp = self.hparams
        if hp.config is not None:
            config = build_config(hp.config)
        else:
            with hub_errors_named(hp.model_name_or_path, "model"):
                config = AutoConfig.from_pretrained(hp.model_name_or_path)
        model = meta_causal_lm(config)
        try:
            with torch.random.fork_rng(
                devices=[]
            ):  # (peft's init: as the build's draws, not the seeded ones)
                with_lora(model, hp.lora)
        except ValueError as err:
            head = model.get_output_embeddings()  # (an adapter on the LM head: the OOMB strategies refuse it)
            linear = sorted(
                {
                    n.rsplit(".", 1)[-1]
                    for n, m in model.named_modules()
                    if type(m) is torch.nn.Linear and m is not head
                }
            )
            raise OOMBConfigError(
                f"lora={hp.lora!r} does not fit {type(model).__name__} ({err}) — peft would refuse it after the "
                f"data and the weights load — name this model's layers in target_modules (its linear layers: "
                f"{linear}; or all-linear)."
            ) from err

    def configure_model(self) -> None:
        if self.model is not None:
            return
        from transformers import AutoModelForCausalLM

        hp = self.hparams
        # None: the Trainer's precision decides (bf16-true sets torch's default dtype to bfloat16)
        dtype = torch.get_default_dtype() if hp.dtype is None else hp.dtype
        dtype = getattr(torch, dtype) if isinstance(dtype, str) and dtype != "auto" else dtype
        if hp.config is not None:  # "auto" reads a checkpoint's dtype: a random model has none, the default
            dtype = torch.get_default_dtype() if dtype == "auto" else dtype
            config = build_config(hp.config)
            self._check_vocabulary(config)
            model = AutoModelForCausalLM.from_config(
                config, attn_implementation=hp.attn_implementation, dtype=dtype
            )
            self.model = with_lora(model, hp.get("lora"))
            return
        from transformers import AutoConfig

        with hub_errors_named(hp.model_name_or_path, "model"):
            config = AutoConfig.from_pretrained(hp.model_name_or_path)
            self._check_vocabulary(config)
            # from_pretrained returns the model in eval mode, and Lightning leaves submodules' modes as they are:
            # fine-tuning would run without the model's dropout
            model = AutoModelForCausalLM.from_pretrained(
                hp.model_name_or_path, attn_implementation=hp.attn_implementation, dtype=dtype
            ).train()
        self.model = with_lora(model, hp.get("lora"))

    def _check_vocabulary(self, config) -> None:
        """Refuse, before the model is built, a data module whose token ids its embedding lacks (the tokenizer of
        another model): the engine would find them only at the first step, after the weights loaded."""
        data = self._trainer.datamodule if self._trainer is not None else None
        largest = getattr(data, "largest_token_id", None)
        rows = getattr(config.get_text_config(), "vocab_size", None)
        if largest is not None and rows is not None and largest >= rows:
            raise OOMBConfigError(
                f"the data's token ids reach {largest} but the model's vocabulary (config.vocab_size) is {rows} — "
                "the tokenizer is not the model's — use the model's own tokenizer (data.tokenizer), or for a model "
                f"built from a config set its vocab_size to at least {largest + 1}."
            )

    def training_step(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        loss = self.model(**with_targets(batch), use_cache=False).loss
        self.log("train_loss", loss, prog_bar=True)
        return loss

    def on_validation_epoch_start(self) -> None:
        # a 16-bit module (precision="bf16-true" converts every submodule) would sum the losses in 16 bits
        self.val_token_loss.set_dtype(torch.float32)

    def validation_step(self, batch: dict[str, torch.Tensor]) -> None:
        batch = with_targets(batch)
        loss = self.model(**batch, use_cache=False).loss  # the mean over this batch's targets
        targets = (batch["labels"][:, 1:] != IGNORE_INDEX).sum()
        # without targets HF's loss is NaN (0/0): weight 0 must not turn the mean into NaN
        self.val_token_loss.update(torch.where(targets > 0, loss.detach().float(), 0.0), weight=targets)

    def on_validation_epoch_end(self) -> None:
        self._log_held_out("val")

    # `trainer.test` / `oomb test`: the same metric on the test loader, as test_loss and test_ppl
    on_test_epoch_start = on_validation_epoch_start
    test_step = validation_step

    def on_test_epoch_end(self) -> None:
        self._log_held_out("test")

    def _log_held_out(self, split: str) -> None:
        loss = self.val_token_loss.compute()  # synchronised across processes
        self.val_token_loss.reset()
        # already the same on every process; sync_dist (a mean of equal values) only stops Lightning's warning
        self.log(f"{split}_loss", loss, prog_bar=split == "val", sync_dist=True)
        self.log(f"{split}_ppl", loss.exp(), sync_dist=True)

    def configure_optimizers(self):
        hp = self.hparams
        decay = [p for p in self.parameters() if p.requires_grad and p.dim() >= 2]
        no_decay = [p for p in self.parameters() if p.requires_grad and p.dim() < 2]
        groups = [
            {"params": decay, "weight_decay": hp.weight_decay},
            {"params": no_decay, "weight_decay": 0.0},
        ]
        trainer = self.trainer
        fused = fused_adamw(
            hp.fused_optimizer, self.device.type, trainer.precision, trainer.gradient_clip_val
        )
        optimizer = torch.optim.AdamW(groups, lr=hp.learning_rate, betas=tuple(hp.betas), fused=fused or None)
        total = []  # read at the first step past the warm-up (before it the factor does not depend on it): read
        # here, with max_epochs set, it would build the train loader before a resumed fit restores its position
        # (Lightning issue #20550), and the resumed epoch would start again from its first row

        def factor(step: int) -> float:
            if step <= hp.warmup_steps:
                return lr_factor(step, hp.warmup_steps, math.inf, hp.min_lr_ratio)
            if not total:
                total.append(self.trainer.estimated_stepping_batches)
            return lr_factor(step, hp.warmup_steps, total[0], hp.min_lr_ratio)

        schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, factor)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": schedule, "interval": "step"}}


def lora_config(fields: dict[str, Any]):
    """``peft.LoraConfig(task_type="CAUSAL_LM", **fields)``, or an error naming the cause and the fix."""
    try:
        import peft
    except ImportError as err:
        raise OOMBConfigError(
            "lora=... needs the peft package, which is not installed — pip install peft (or drop lora to train "
            "every weight)."
        ) from err
    if not isinstance(fields, dict):
        raise OOMBConfigError(
            f"lora={fields!r} is not a dict — pass peft.LoraConfig's fields, e.g. {{r: 16, lora_alpha: 32, "
            "target_modules: all-linear}."
        )
    try:
        return peft.LoraConfig(**{"task_type": "CAUSAL_LM", **fields})
    except (TypeError, ValueError) as err:
        raise OOMBConfigError(
            f"lora={fields!r} is not a valid peft.LoraConfig ({err}) — pass LoraConfig's fields, e.g. {{r: 16, "
            "lora_alpha: 32, target_modules: all-linear}."
        ) from err


def meta_causal_lm(config: Any, dtype: torch.dtype | None = None) -> torch.nn.Module:
    """The causal LM of a transformers ``config`` built on the ``meta`` device (nothing allocated) in ``dtype``; its
    random draws leave the global generator as it was (a seeded real build after it draws the same)."""
    from transformers import AutoModelForCausalLM

    with torch.random.fork_rng(devices=[]), torch.device("meta"):
        return AutoModelForCausalLM.from_config(config, dtype=dtype)


def with_lora(model: torch.nn.Module, fields: dict[str, Any] | None) -> torch.nn.Module:
    """``model`` with LoRA adapters of :func:`lora_config` ``(fields)`` (``peft.get_peft_model``: the base frozen);
    ``model`` itself for ``None``."""
    if fields is None:
        return model
    import peft

    return peft.get_peft_model(model, lora_config(fields))


def fused_adamw(
    choice: bool | None, device_type: str, precision: str, gradient_clip_val: float | None
) -> bool:
    """Whether :class:`CausalLMModule` trains with torch's fused AdamW: ``choice`` (its ``fused_optimizer``), or for
    ``None`` on a CUDA device unless the Lightning ``precision`` flag is ``*-mixed`` and gradients are clipped
    (Lightning's mixed-precision plugin refuses to clip for a fused optimizer) — refused there when asked for — or
    it is ``16-mixed`` (a fused optimizer unscales inside its step, so ``on_before_optimizer_step`` would see the
    gradients still scaled)."""
    clipping = bool(gradient_clip_val) and str(precision).endswith("-mixed")
    if choice and clipping:
        raise OOMBConfigError(
            f"fused_optimizer=True with precision={precision!r} and gradient_clip_val={gradient_clip_val}: "
            "Lightning's mixed-precision plugin cannot clip the gradients of a fused optimizer — set "
            "fused_optimizer to None (the foreach AdamW here), drop gradient clipping, or train with a *-true "
            "precision."
        )
    scaled = str(precision) in ("16-mixed", "16")
    return choice if choice is not None else device_type == "cuda" and not (clipping or scaled)


def with_targets(batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``batch`` with ``labels`` (default: ``input_ids``) ignoring right padding (``-100`` where ``attention_mask``
    is 0), as the OOMB strategy does: Hugging Face would train on the padded positions' labels."""
    labels = batch.get("labels", batch["input_ids"])
    mask = batch.get("attention_mask")
    if mask is not None:
        labels = labels.masked_fill(mask == 0, IGNORE_INDEX)
    return {**batch, "labels": labels}


def lr_factor(step: int, warmup_steps: int, total_steps: float, min_ratio: float) -> float:
    """Linear warm-up over ``warmup_steps``, then cosine from 1 to ``min_ratio`` at ``total_steps``."""
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    if not math.isfinite(total_steps) or total_steps <= warmup_steps:
        return 1.0
    progress = min(1.0, (step - warmup_steps) / (total_steps - warmup_steps))
    return min_ratio + (1.0 - min_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))
