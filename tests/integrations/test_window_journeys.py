"""Window models' user journeys from the outside, with the window layers' tails in host memory (``offload`` and a
short ``hbm_budget``: ``PoolShape.hosted_tails``): a Lightning fit of ``CausalLMModule`` on packed text (gradient
accumulation, validation inside the epoch, ``OOMBMonitor``, a checkpoint and its resume), ``oomb plan`` of a
Gemma-3-shaped config, and the tails ring's edge cases — each against full-sequence training (float64) or the same
step with the tails on the device."""

from __future__ import annotations

import random

import lightning as L
import pytest
import torch
import torch.nn.functional as F
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from torch.utils.data import DataLoader

from lightning_oomb import OOMBStrategy
from lightning_oomb.callbacks import OOMBMonitor
from lightning_oomb.cli import plan_command
from lightning_oomb.data import TextFileDataModule
from lightning_oomb.engine import OOMBConfig, OOMBEngine
from lightning_oomb.integrations.hf import HFChunkModel
from lightning_oomb.models import CausalLMModule
from tests.helpers.models import (
    TINY,
    _reference_forward,
    build_causal_lm,
    build_family,
    exact_full_sequence_loss,
    float64_norms,
    grads_of,
    max_relative_error,
)

CHUNK, PAGE = 32, 4  # gemma3's window 7: a tail group of 2 pages before every chunk start
# Gemma 3 of 3 layers: two window layers, then a full one
LAYERS = {"num_hidden_layers": 3, "layer_types": ["sliding_attention", "sliding_attention", "full_attention"]}
HOSTED = {"offload": True, "hbm_budget": 0, "staging_buffers": 3}  # tails and full layers in host memory


pytestmark = pytest.mark.usefixtures("one_thread")


def window_model(family: str = "gemma3", dtype=torch.float64, **overrides):
    if family == "gemma3":
        overrides = {**LAYERS, **overrides}
    model = (
        build_causal_lm("mistral", dtype) if family == "mistral" else build_family(family, dtype, **overrides)
    )
    float64_norms(model)  # (Gemma's norms compute in float32: exact only so)
    return model


def ids_of(seq: int, batch: int = 2, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, 64, (batch, seq), generator=torch.Generator().manual_seed(seed))


def oracle(model, ids):
    model.zero_grad()
    loss = exact_full_sequence_loss(model, ids)
    loss.backward()
    return loss.detach(), grads_of(model)


def step(model, ids, engine=None, checkpointing=False, batch=None, **options):
    """One OOMB step (a new engine unless ``engine``): ``(loss, gradients, engine)``."""
    model.zero_grad()
    if engine is None:
        config = OOMBConfig(CHUNK, PAGE, layer_checkpointing=checkpointing, **options)
        engine = OOMBEngine(HFChunkModel(model, layer_checkpointing=checkpointing), config)
    loss = engine.loss(ids, **(batch or {}))
    loss.backward()
    return loss.detach(), grads_of(model), engine


def assert_exact(got, want):
    (loss, grads), (want_loss, want_grads) = got[:2], want
    assert abs(loss.item() - want_loss.item()) <= 1e-10 * want_loss.item()
    assert max_relative_error(grads, want_grads) <= 1e-10


def tails_budget(engine) -> int:
    """An ``hbm_budget`` that holds every full layer's pages but not every window layer's tails."""
    shape = engine.pool.shape
    return sum(map(shape.bytes_of, range(shape.num_layers))) - 1


# ------------------------------------------------------------------------------------ the tails ring's edge cases
# (sequence length, rows, model overrides, engine options, whether tails go to the host): the ring applies only
# with more than two tail groups (chunks - 1 > 2)
CASES = {
    "1 chunk, partial": (31, 2, {}, {}, False),
    "1 chunk exactly": (32, 2, {}, {}, False),
    "2 chunks": (64, 2, {}, {}, False),
    "3 chunks: two groups, all on the device": (96, 2, {}, {}, False),
    "3 chunks and a token": (97, 2, {}, {}, True),
    "4 chunks exactly": (128, 2, {}, {}, True),
    "6 chunks and a token, 1 row": (193, 1, {}, {}, True),
    "4 chunks, 3 rows": (128, 3, {}, {}, True),
    "page 8 over window 7": (128, 2, {}, {"page": 8}, True),
    "window 10: page 4 does not divide its 9 keys": (128, 2, {"sliding_window": 10}, {}, True),
    "window 2: one key before a chunk": (128, 2, {"sliding_window": 2}, {}, True),
    "window = chunk: no tails kept": (128, 2, {"sliding_window": CHUNK}, {}, False),
    "window > chunk: no tails kept": (128, 2, {"sliding_window": CHUNK + 1}, {}, False),
    "layer checkpointing": (128, 2, {}, {"checkpointing": True}, True),
    "reuse_attention and checkpointing": (128, 2, {}, {"reuse_attention": True, "checkpointing": True}, True),
}


@pytest.mark.parametrize("case", list(CASES))
def test_hosted_tails_edge_cases_equal_full_sequence_training(case):
    seq, batch, overrides, options, hosted = CASES[case]
    model, ids = window_model(**overrides), ids_of(seq, batch, seed=seq)
    page = options.pop("page", PAGE)
    want = oracle(model, ids)
    config = OOMBConfig(CHUNK, page, layer_checkpointing=options.get("checkpointing", False),
                        reuse_attention=options.get("reuse_attention", False), **HOSTED)  # fmt: skip
    checkpointing = options.get("checkpointing", False)
    engine = OOMBEngine(HFChunkModel(model, layer_checkpointing=checkpointing), config)
    got = step(model, ids, engine)
    assert_exact(got, want)
    shape = engine.pool.shape
    assert shape.hosted_tails == ((0, 1) if hosted else ())
    assert engine.pool.stats()["hosted_tail_layers"] == len(shape.hosted_tails)


@pytest.mark.parametrize("family", ["gemma2", "gpt_oss", "mistral", "gemma4"])
def test_hosted_tails_of_other_window_families_are_exact(family):
    """Gemma 2 (softcaps) and GPT-OSS (sinks, MoE) alternate window and full layers, Mistral's are all window,
    Gemma 4's window layers have more and narrower KV heads than its full ones (their ring at their own geometry)."""
    if family == "gemma4":
        from tests.integrations.test_layer_kv_heads import _model

        model = _model()  # window 8; layers 2 and 5 full
    else:
        model = window_model(family)
    ids = ids_of(128, seed=1)
    want = oracle(model, ids)
    got = step(model, ids, **HOSTED)
    assert_exact(got, want)
    hosted = {"gemma2": (0,), "gpt_oss": (0,), "mistral": (0, 1), "gemma4": (0, 1, 3, 4)}[family]
    assert got[2].pool.shape.hosted_tails == hosted


def test_one_pool_through_steps_of_changing_length_and_rows_stays_exact():
    """Longer, shorter (down to no hosted tails), more rows and back, in the pool the first step reserved."""
    model, engine = window_model(), None
    for seq, batch in ((160, 2), (97, 2), (250, 1), (40, 3), (129, 3), (160, 2)):
        ids = ids_of(seq, batch, seed=seq + batch)
        want = oracle(model, ids)
        got = step(model, ids, engine, **HOSTED) if engine is None else step(model, ids, engine)
        engine = got[2]
        assert_exact(got, want)
        assert bool(engine.pool.shape.hosted_tails) == (seq > 3 * CHUNK)


def test_an_evaluation_between_steps_leaves_the_hosted_tails_exact():
    model, ids = window_model(), ids_of(160, seed=2)
    want = oracle(model, ids)
    engine = step(model, ids, **HOSTED)[2]
    with torch.inference_mode():
        shorter = engine.evaluate(ids[:, :120])
    assert (
        abs(shorter.item() - exact_full_sequence_loss(model, ids[:, :120]).item()) <= 1e-10 * shorter.item()
    )
    assert_exact(step(model, ids, engine), want)


def test_a_packed_row_with_hosted_tails_trains_like_its_documents_apart():
    model = window_model()
    gen = torch.Generator().manual_seed(3)
    docs = [torch.randint(0, 64, (1, n), generator=gen) for n in (50, 45, 3, 60)]  # across chunk boundaries
    ids, positions = torch.cat(docs, 1), torch.cat([torch.arange(d.shape[1]) for d in docs])[None]
    model.zero_grad()
    sums = []
    for doc in docs:
        logits = _reference_forward(model, doc).logits[0, :-1]
        sums.append(F.cross_entropy(logits, doc[0, 1:], reduction="sum"))
    want_loss = sum(sums) / sum(d.shape[1] - 1 for d in docs)
    want_loss.backward()
    want = want_loss.detach(), grads_of(model)
    got = step(model, ids, batch={"position_ids": positions}, **HOSTED)
    assert_exact(got, want)
    assert got[2].pool.shape.hosted_tails


@pytest.mark.parametrize("reuse", [False, True])
def test_sparse_steps_with_hosted_tails_equal_tails_on_the_device(reuse):
    model, ids = window_model(), ids_of(128, seed=5)
    options = {"page_budget": 3, "reuse_attention": reuse}
    on_device = step(model, ids, **options)
    hosted = step(model, ids, **options, **HOSTED)
    assert hosted[2].pool.shape.hosted_tails and not on_device[2].pool.shape.hosted_tails
    assert_exact(hosted, on_device[:2])


@pytest.mark.parametrize("kv_grad_dtype", ["bfloat16"])
def test_a_bf16_model_with_hosted_tails_equals_tails_on_the_device_bit_for_bit(kv_grad_dtype):
    """K/V cross to the host and back unchanged, gradients never do: the same bits as the tails on the device
    (every full layer stays on the device: its offloaded blocks would sum in another order)."""
    model, ids = build_family("gemma3", torch.bfloat16, **LAYERS), ids_of(128, seed=6)
    loss, grads, engine = step(model, ids, kv_grad_dtype=kv_grad_dtype)
    hosted = step(model, ids, kv_grad_dtype=kv_grad_dtype, offload=True, hbm_budget=tails_budget(engine))
    shape = hosted[2].pool.shape
    assert (
        shape.hosted_tails
        and hosted[2].pool.stats()["host_layers"] == 0
        and shape.grad_dtype == getattr(torch, kv_grad_dtype)
    )
    assert torch.equal(hosted[0], loss) and all(torch.equal(hosted[1][n], grads[n]) for n in grads)


# ------------------------------------------------------------------------------------------ a Lightning fit
# a 3-layer Gemma 3 (two window layers, then a full one) on byte-level text packed into rows of 4 chunks
GEMMA3 = {"model_type": "gemma3_text", **TINY, **LAYERS, "vocab_size": 260, "sliding_window": 7,
          "rope_parameters": {"sliding_attention": {"rope_type": "default", "rope_theta": 10.0},
                              "full_attention": {"rope_type": "default", "rope_theta": 1000.0}}}  # fmt: skip
_rng = random.Random(0)
TEXTS = [{"text": "".join(_rng.choice("abcdefgh ") for _ in range(_rng.randint(60, 200)))} for _ in range(14)]


class Float64Gemma(CausalLMModule):
    def configure_model(self) -> None:
        super().configure_model()
        float64_norms(self.model)


class Record(Callback):
    def __init__(self):
        self.losses, self.val, self.stats = [], [], []

    def on_train_batch_end(self, trainer, module, outputs, *_):
        self.losses.append(outputs["loss"].item())
        self.stats.append(trainer.strategy.engine.pool.stats())

    def on_validation_end(self, trainer, module):  # (after the module logged val_loss)
        if not trainer.sanity_checking:
            self.val.append(trainer.callback_metrics["val_loss"].item())


def fit(offload: bool, steps: int, root=None, resume=None, monitor: bool = False):
    """``steps`` optimizer steps of 2 micro-batches, validation every 2 batches: ``(Record, trainer, module)``."""
    L.seed_everything(0, verbose=False)
    module = Float64Gemma(config=GEMMA3, dtype="float64", learning_rate=1e-2, min_lr_ratio=1.0)
    record = Record()
    callbacks = [record, OOMBMonitor()] if monitor else [record]
    if root is not None:
        callbacks.append(ModelCheckpoint(dirpath=root, save_top_k=-1, every_n_train_steps=1))
    trainer = L.Trainer(
        strategy=OOMBStrategy(CHUNK, PAGE, **(HOSTED if offload else {"offload": False})),
        accelerator="cpu", devices=1, precision="64-true", max_steps=steps, accumulate_grad_batches=2,
        val_check_interval=2, limit_val_batches=1, num_sanity_val_steps=0, log_every_n_steps=1,
        logger=False, enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=root is not None,
        callbacks=callbacks,
    )  # fmt: skip
    data = TextFileDataModule(records=TEXTS, tokenizer="bytes", seq_len=4 * CHUNK, batch_size=2, val_rows=2)
    trainer.fit(module, datamodule=data, ckpt_path=resume)
    return record, trainer, module


def max_param_error(got, want) -> float:
    pairs = [(g, w) for g, w in zip(got.parameters(), want.parameters(), strict=True)]
    return max(((g - w).abs().max() / w.abs().max()).item() for g, w in pairs)


def test_a_fit_with_hosted_tails_equals_the_fit_without_offload_and_resumes_exactly(tmp_path, caplog):
    with caplog.at_level("INFO"):
        hosted, trainer, module = fit(True, 2, root=tmp_path, monitor=True)
    # the strategy's plan line says where the window layers' tails are
    (line,) = [r.getMessage() for r in caplog.records if r.getMessage().startswith("OOMB memory plan")]
    assert "; the tails of 2 window layers in host memory" in line
    on_device, _, reference = fit(False, 2)
    assert len(hosted.losses) == 4 and len(hosted.val) == 2  # 2 steps of 2 packed rows, 2 validations
    for got, want in ((hosted.losses, on_device.losses), (hosted.val, on_device.val)):
        assert got == pytest.approx(want, rel=1e-10, abs=0)
    assert max_param_error(module, reference) <= 1e-10
    stats = hosted.stats[-1]
    assert stats["hosted_tail_layers"] == 2 and stats["host_layers"] == 1 and stats["d2h_bytes"] > 0
    logged = trainer.callback_metrics
    assert logged["oomb/hosted_tail_layers"] == 2 and logged["oomb/d2h_bytes"] == stats["d2h_bytes"]
    assert on_device.stats[-1]["hosted_tail_layers"] == 0
    # the checkpoint of step 1, resumed to step 2: the same model (the data module resumes at the next row)
    resumed, _, again = fit(True, 2, resume=str(tmp_path / "epoch=0-step=1.ckpt"))
    assert resumed.losses == pytest.approx(hosted.losses[2:], rel=1e-10, abs=0)
    assert max_param_error(again, module) <= 1e-10


def test_a_lora_fit_validating_longer_rows_with_hosted_tails_equals_the_fit_without_offload():
    """LoRA adapters (``CausalLMModule(lora=...)``) on rows of 4 chunks, validated on rows of 7 (the sanity check
    first: planned for its shape), 2 steps: the same losses as the tails on the device."""
    results = []
    for options in (HOSTED, {"offload": False}):
        L.seed_everything(0, verbose=False)
        module = Float64Gemma(
            config=GEMMA3, dtype="float64", learning_rate=1e-2, lora={"r": 4, "target_modules": "all-linear"}
        )
        record = Record()
        trainer = L.Trainer(
            strategy=OOMBStrategy(CHUNK, PAGE, **options), accelerator="cpu", devices=1, precision="64-true",
            max_steps=2, val_check_interval=1, limit_val_batches=1, num_sanity_val_steps=1, logger=False,
            enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False, callbacks=[record],
        )  # fmt: skip
        train, val = (
            [{"input_ids": ids} for ids in ids_of(seq, 4, seed)] for seq, seed in ((128, 1), (200, 2))
        )
        trainer.fit(module, DataLoader(train, batch_size=2), DataLoader(val, batch_size=2))
        results.append((record, module))
    (hosted, module), (on_device, reference) = results
    assert max_param_error(module, reference) <= 1e-10  # the adapters after 2 steps
    assert [s["hosted_tail_layers"] for s in hosted.stats] == [2, 2] and len(hosted.val) == 2
    assert hosted.losses == pytest.approx(on_device.losses, rel=1e-10, abs=0)
    assert hosted.val == pytest.approx(on_device.val, rel=1e-10, abs=0)


# ---------------------------------------------------------------------------------------------------- oomb plan
GEMMA3_12B = {"model_type": "gemma3_text", "hidden_size": 3840, "intermediate_size": 15360, "num_hidden_layers": 12,
              "num_attention_heads": 16, "num_key_value_heads": 8, "head_dim": 256, "sliding_window": 1024,
              "vocab_size": 262208}  # fmt: skip


def plan_args(tmp_path, host: str, **strategy) -> list[str]:
    """``oomb plan`` arguments for a 12-layer Gemma-3-12B-shaped LoRA run at 256K tokens on an 80 GB GPU."""
    import yaml

    config = {
        "trainer": {"accelerator": "gpu", "devices": 1, "precision": "bf16-true",
                    "strategy": {"class_path": "lightning_oomb.OOMBStrategy",
                                 "init_args": {"chunk_size": 4096, "offload": True, **strategy}}},
        "model": {"class_path": "lightning_oomb.models.CausalLMModule",
                  "init_args": {"config": GEMMA3_12B, "lora": {"r": 16, "target_modules": "all-linear"}}},
        "data": {"class_path": "lightning_oomb.data.TextFileDataModule",
                 "init_args": {"records": [{"text": "a"}], "tokenizer": "bytes", "seq_len": 262144}},
    }  # fmt: skip
    path = tmp_path / "gemma3.yaml"
    path.write_text(yaml.safe_dump(config))
    return ["--config", str(path), "--device-memory", "80GB", "--host-memory", host]


def test_oomb_plan_names_the_window_tails_in_host_memory(tmp_path, capsys):
    result = plan_command(plan_args(tmp_path, "128GiB", hbm_budget=0))
    out = capsys.readouterr().out
    assert result.fits and result.pool.hosted_tails == tuple(i for i in range(12) if (i + 1) % 6)  # 10 of 12
    assert result.host_parts["window_tails"] > 0
    assert "window layers' tails (K/V), pinned" in out
    # the header says where the window layers' pages are, not only "12 HBM / 0 host layers"
    assert "the tails of 10 window layers in host memory" in " ".join(out.split())


def test_oomb_plan_of_too_little_host_memory_for_the_tails_suggests_keeping_them_on_the_gpu(tmp_path, capsys):
    """``hbm_budget=0`` with 12 GiB of host memory: the full layers' pages (8 GiB) and the tails' K/V (4.9 GiB) do
    not fit it; the GPU has room for them, so ``hbm_budget='auto'`` is among the options (planned: it fits)."""
    result = plan_command(plan_args(tmp_path, "12GiB", hbm_budget=0))
    out = " ".join(capsys.readouterr().out.split())
    assert not result.fits and result.device_fits and not result.host_fits
    assert result.pool.hosted_tails and "does NOT fit" in out and "window layers' tails (K/V), pinned" in out
    assert "would fit: offload=True, hbm_budget='auto'" in out
    auto = plan_command(plan_args(tmp_path, "12GiB", hbm_budget="auto"), print_table=False)
    assert auto.fits and not auto.pool.hosted_tails


def test_where_host_memory_is_short_keeping_the_tails_on_the_gpu_is_an_option(tmp_path, capsys):
    """``hbm_budget=0`` with 12 GiB of host memory on a 40 GB GPU: the tails in host memory do not fit it, but the
    tails on the GPU with the full layers on the host do (``host_tails=False``: 8.8 GiB of host memory, a 32 GiB
    peak), and the plan says so; that run plans as said."""
    args = plan_args(tmp_path, "12GiB", hbm_budget=0)
    args[args.index("80GB")] = "40GB"
    result = plan_command(args)
    out = " ".join(capsys.readouterr().out.split())
    assert not result.fits and result.pool.hosted_tails
    assert "would fit: offload=True, host_tails=False, hbm_budget=" in out
    off = plan_args(tmp_path, "12GiB", hbm_budget=0, host_tails=False)
    off[off.index("80GB")] = "40GB"
    kept = plan_command(off, print_table=False)
    assert kept.fits and not kept.pool.hosted_tails and kept.host_layers == 2
