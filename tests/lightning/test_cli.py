"""The ``oomb`` CLI: every example config parses and builds without loading a model, the demo config is the
demo script's run, and a tiny fit goes end to end through the CLI."""

from __future__ import annotations

import dataclasses
import re
import subprocess
import sys

import pytest
import torch
from lightning.pytorch import LightningDataModule

from lightning_oomb import OOMBContextParallelStrategy, OOMBStrategy
from lightning_oomb.callbacks import OOMBOffload
from lightning_oomb.cli import build_cli, main, plan_command
from lightning_oomb.engine import OOMBConfigError
from lightning_oomb.engine.memory import HOST_RESERVE_BYTES as HOST_RESERVE
from lightning_oomb.models import CausalLMModule
from tests.helpers.examples import EXAMPLES, load_example

CONFIGS = sorted((EXAMPLES / "configs").glob("*.yaml"))
DEMO_CONFIG = EXAMPLES / "configs" / "demo-cpu.yaml"


@pytest.fixture(autouse=True)
def isolate(monkeypatch):
    monkeypatch.setattr(sys, "argv", ["oomb"])  # LightningCLI warns when args and pytest's argv both exist
    threads = torch.get_num_threads()  # configs may set num_threads
    yield
    torch.set_num_threads(threads)


def load_demo_script():
    return load_example("train_long_context")


def test_there_are_example_configs():
    assert {p.name for p in CONFIGS} >= {
        "demo-cpu.yaml",
        "qwen2.5-7b-128k.yaml",
        "qwen2.5-7b-256k-offload.yaml",
    }


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_example_config_parses_and_builds(path):
    # GPU configs are built on the CPU here; from_pretrained only runs in configure_model (at fit)
    cli = build_cli(["--config", str(path), "--trainer.accelerator=cpu"], run=False)
    assert isinstance(
        cli.trainer.strategy, OOMBContextParallelStrategy if re.search(r"-cp\d", path.name) else OOMBStrategy
    )
    assert isinstance(cli.model, CausalLMModule) and cli.model.model is None
    assert isinstance(cli.datamodule, LightningDataModule)
    if "offload" in path.name:  # offload on in the strategy, its streams tuned by the callback
        assert cli.trainer.strategy.oomb_config.offload
        assert any(isinstance(c, OOMBOffload) for c in cli.trainer.callbacks)


def _init_args(hparams) -> dict:
    return {k: tuple(v) if isinstance(v, list) else v for k, v in hparams.items() if not k.startswith("_")}


def test_demo_config_is_the_demo_script_run():
    demo = load_demo_script()
    args = demo.parse_args([])
    cli = build_cli(["--config", str(DEMO_CONFIG)], run=False)
    data = demo.build_data(args)
    assert _init_args(cli.datamodule.hparams) == _init_args(data.hparams)
    assert _init_args(cli.model.hparams) == _init_args(demo.build_model(args, data.vocab_size).hparams)
    assert cli.trainer.max_steps == args.short_steps + args.steps
    assert cli.trainer.gradient_clip_val == demo.DEMO_CLIP
    assert cli.trainer.strategy.oomb_config.chunk_size == args.chunk_size
    assert torch.get_num_threads() == 1


def test_cli_fits_the_demo_config_at_tiny_size(tmp_path):
    cli = build_cli(
        [
            "fit",
            "--config",
            str(DEMO_CONFIG),
            "--data.init_args.seq_len=256",
            "--data.init_args.short_samples=0",
            "--data.init_args.train_samples=2",
            "--data.init_args.val_samples=1",
            "--trainer.max_steps=2",
            "--trainer.strategy.init_args.chunk_size=128",
            f"--trainer.default_root_dir={tmp_path}",
        ]
    )
    assert cli.trainer.global_step == 2
    assert {"train_loss", "val_loss"} <= set(cli.trainer.callback_metrics)
    assert cli.trainer.strategy.engine.stats.chunks == 2
    assert (tmp_path / "config.yaml").exists()


def test_help_lists_the_projects_classes_and_short_names_work(capsys):
    with pytest.raises(SystemExit):
        build_cli(["fit", "--help"])
    text = capsys.readouterr().out
    for name in ("CausalLMModule", "NeedleRetrievalDataModule", "TextFileDataModule", "OOMBStrategy"):
        assert name in text, name
    cli = build_cli(
        ["--model", "CausalLMModule", "--model.config", '{"model_type": "qwen2", "vocab_size": 25}',
         "--data", "NeedleRetrievalDataModule", "--trainer.strategy", "OOMBStrategy",
         "--trainer.strategy.loss_block", "64", "--trainer.accelerator", "cpu"],
        run=False,
    )  # fmt: skip
    assert isinstance(cli.model, CausalLMModule) and cli.trainer.strategy.oomb_config.loss_block == 64


def test_cli_fits_the_packed_text_config(tmp_path):
    """Local text and jsonl documents, packed (position_ids restart per document), trained by OOMB."""
    cli = build_cli(
        ["fit", "--config", str(EXAMPLES / "configs" / "textfiles-packed-cpu.yaml"), "--trainer.max_steps=2",
         f"--trainer.default_root_dir={tmp_path}"]
    )  # fmt: skip
    assert cli.trainer.global_step == 2 and cli.trainer.strategy.engine.stats.chunks == 4


# ---------------------------------------------------------------------------------------------------- oomb plan
H200_ARGS = ["--device-memory", "141GB", "--host-memory", "128GiB"]


@pytest.mark.parametrize(
    ("name", "hbm", "host"),
    [
        ("qwen2.5-7b-128k.yaml", "21.00 GiB", "0 B"),
        ("qwen2.5-7b-256k-offload.yaml", "0 B", "28.00 GiB"),
        ("qwen2.5-7b-1m-cp8.yaml", "14.00 GiB", "0 B"),  # 1/8 of the pages per GPU
    ],
)
def test_oomb_plan_prints_the_table_of_an_example_config(name, hbm, host, capsys):
    """The hub id Qwen/Qwen2.5-7B is planned from its known shape (no download); the YAML is fit's."""
    result = plan_command(["--config", str(EXAMPLES / "configs" / name), *H200_ARGS])
    text = capsys.readouterr().out
    assert result.fits and result.machine.device_type == "cuda" and result.precision == "bf16-true"
    assert result.optimizer == "adamw-fused"  # CausalLMModule's on a GPU (bf16-true clips a fused one)
    fit = build_cli(["--config", str(EXAMPLES / "configs" / name), "--trainer.accelerator=cpu"], run=False)
    asked = fit.trainer.strategy.oomb_config
    assert asked.grad_accumulation == asked.reuse_attention == "auto"  # the plan decides them:
    kept = result.config.reuse_attention  # the float32 sums fit an H200, as do most chunks' kept results
    want = {
        "grad_accumulation": "float32",
        "reuse_attention": kept,
        "mla_pages": "expanded",
    }  # (Qwen: no latents)
    if asked.layer_checkpointing == "auto":  # the 128K example leaves it to the plan: an H200 needs neither
        want.update(layer_checkpointing=False, kv_grad_dtype="float32")
    if asked.offload == "auto":  # the pages fit an H200 (at 1M: each GPU's eighth of them)
        want.update(offload=False)
    assert result.config == dataclasses.replace(asked, **want)
    assert kept > result.seq_len // asked.chunk_size // (8 if "cp8" in name else 1) // 2
    assert result.model.num_layers == 28
    # a node's ranks share its host memory: each plans with its share
    assert result.machine.host_bytes == 128 * 2**30 // (8 if "cp8" in name else 1)
    assert result.seq_len == {"128k": 131072, "1m-c": 1 << 20}.get(name[11:15], 262144)
    row = next(line for line in text.splitlines() if "KV pool, HBM tier" in line)
    assert hbm in row and host in next(line for line in text.splitlines() if "pinned host tier" in line)
    assert "optimizer states" in text and "fits" in text and "128.00 GiB" not in text


def test_a_refused_strategy_option_is_one_line_not_a_traceback(monkeypatch):
    """jsonargparse reports a strategy's refusal inside a Union-type error with every subtype it tried: the console
    script prints the refusal alone."""
    argv = ["oomb", "fit", "--config", str(DEMO_CONFIG), "--trainer.strategy.init_args.chunk_size", "100"]
    monkeypatch.setattr(sys, "argv", argv)
    with pytest.raises(
        SystemExit, match=r"^oomb: error: chunk_size=100 is not a multiple of page_size=128 .*128\.$"
    ):
        main()


def test_a_refused_callback_option_is_one_line_too(monkeypatch, tmp_path):
    """A callback's refusal sits in a list-or-callback Union error whose "not a valid subclass" item lists the
    accepted forms on nested lines: they were printed after the refusal ("... max(1, ...). a class path (str) a
    dict with class_path entry ...")."""
    config = tmp_path / "bad-schedule.yaml"
    config.write_text(
        "trainer:\n  callbacks:\n    - class_path: lightning_oomb.callbacks.OOMBSparseBudget\n"
        "      init_args:\n        schedule: {0: null, 1: 0}\n"
    )
    argv = ["oomb", "fit", "--config", str(DEMO_CONFIG), "--config", str(config)]
    monkeypatch.setattr(sys, "argv", argv)
    with pytest.raises(
        SystemExit, match=r"^oomb: error: OOMBSparseBudget's schedule maps step 1 to 0 .*1000: 64}\.$"
    ):
        main()


def test_oomb_console_script_plans_the_cpu_demo(monkeypatch, capsys):
    """``oomb plan`` through the console script: the demo's model config dict, on this machine's CPU."""
    monkeypatch.setattr(sys, "argv", ["oomb", "plan", "--config", str(DEMO_CONFIG), "--optimizer", "sgd"])
    main()
    text = capsys.readouterr().out
    assert "16384 tokens" in text and "host memory" in text and "fits" in text


def test_oomb_plan_of_a_step_that_cannot_fit_says_why_and_exits_1(monkeypatch, capsys):
    """No option fits Qwen2.5-7B's full fine-tune on 24 GB (its weights, gradients and AdamW states alone need more):
    the plan says so, not only "does NOT fit", and the console script's exit status is 1."""
    config = EXAMPLES / "configs" / "qwen2.5-7b-128k.yaml"
    argv = ["oomb", "plan", "--config", str(config), "--device-memory", "24GB", "--host-memory", "64GiB"]
    monkeypatch.setattr(sys, "argv", argv)
    with pytest.raises(SystemExit) as exit:
        main()
    text = capsys.readouterr().out
    assert exit.value.code == 1
    assert "does NOT fit" in text and "no OOMB option makes it fit" in text and "would fit" not in text


def test_oomb_plan_checks_the_data_warm_up_steps_too():
    """The demo's warm-up (here 16 sequences of 8192 per step) takes 13x the memory of its main 16384-token steps:
    planned under the main steps' decisions, it is the plan shown when it does not fit."""
    base = [
        "--config",
        str(DEMO_CONFIG),
        "--trainer.accelerator=auto",
        "--device-memory=0.3GiB",
        "--host-memory=8GiB",
    ]
    main_steps = plan_command(base, print_table=False)
    assert (main_steps.batch, main_steps.seq_len, main_steps.fits) == (1, 16384, True)
    warm = ["--data.init_args.short_seq_len", "8192", "--data.init_args.short_batch_size", "16"]
    warm_up = plan_command(base + warm, print_table=False)
    assert (warm_up.batch, warm_up.seq_len, warm_up.fits) == (16, 8192, False)
    assert warm_up.config == main_steps.config


def test_oomb_plan_reads_a_model_config_override(tmp_path, capsys):
    from lightning_oomb.models import qwen2_5_7b_config

    qwen2_5_7b_config(num_hidden_layers=2).save_pretrained(tmp_path)
    config = EXAMPLES / "configs" / "qwen2.5-7b-128k.yaml"
    override = plan_command(["--config", str(config), "--model-config", str(tmp_path), "--seq-len", "8192",
                             *H200_ARGS])  # fmt: skip
    assert override.model.num_layers == 2 and override.seq_len == 8192
    with pytest.raises(OOMBConfigError, match="cannot be downloaded here.*--model-config"):
        plan_command(["--config", str(config), "--model.init_args.model_name_or_path", "/no/such/model",
                      *H200_ARGS])  # fmt: skip
    with pytest.raises(OOMBConfigError, match="not a memory size"):
        plan_command(["--config", str(config), "--device-memory", "lots"])


def test_oomb_plan_refuses_what_fit_refuses():
    """Sizes of 0 (they were replaced by the data's), a context-parallel mesh the fit would refuse at launch (the
    plan said "fits"), an unknown model_type (transformers' traceback)."""
    config = ["--config", str(EXAMPLES / "configs" / "qwen2.5-7b-1m-cp8.yaml"), *H200_ARGS]
    for option in ("--seq-len", "--batch-size"):
        with pytest.raises(OOMBConfigError, match=f"{option} 0 is not a positive integer"):
            plan_command([*config, option, "0"], print_table=False)
    with pytest.raises(OOMBConfigError, match="6 devices do not divide into context groups"):
        plan_command(
            [*config, "--trainer.devices", "6", "--trainer.strategy.init_args.context_parallel_size", "4"]
        )
    with pytest.raises(OOMBConfigError, match="do not split into 3 equal slices"):
        plan_command(
            [*config, "--trainer.devices", "3", "--trainer.strategy.init_args.context_parallel_size", "3"]
        )
    with pytest.raises(OOMBConfigError, match="model_type 'nosuch' is not an architecture"):
        plan_command([*config, "--model-config", '{"model_type": "nosuch", "hidden_size": 64}'])


def test_python_dash_m_runs_the_console_script():
    """``python -m lightning_oomb`` is ``oomb`` (``-m lightning_oomb.cli`` too: it did nothing and exited 0)."""
    done = subprocess.run([sys.executable, "-m", "lightning_oomb", "plan", "--seq-len", "0", "--config",
                           str(DEMO_CONFIG)], capture_output=True, text=True, cwd=EXAMPLES.parent)  # fmt: skip
    assert done.returncode == 1 and "oomb: error: --seq-len 0" in done.stderr, done.stderr


def test_oomb_plan_counts_the_parameters_of_the_model_the_config_builds():
    """A config is planned from its model built on the meta device: StarCoder2's ungated MLP (2 matrices) and
    Qwen2-MoE's shared expert are counted as they are (a Llama formula said +39 % and -6 %); a JSON dict longer than
    a file name is read as JSON; ``accelerator: auto`` with only ``--host-memory`` on a machine without a GPU plans
    for this CPU."""
    import json

    import transformers as tf

    shapes = {
        "starcoder2": dict(hidden_size=256, intermediate_size=1024, num_hidden_layers=2, num_attention_heads=4,
                           num_key_value_heads=2, vocab_size=512),
        "qwen2_moe": dict(hidden_size=128, intermediate_size=256, moe_intermediate_size=64, num_hidden_layers=2,
                          num_attention_heads=4, num_key_value_heads=2, vocab_size=512, num_experts=4,
                          num_experts_per_tok=2, shared_expert_intermediate_size=256),
    }  # fmt: skip
    for family, fields in shapes.items():
        text = json.dumps(
            {"model_type": family, **fields, "max_position_embeddings": 4096, "padding": "x" * 300}
        )
        assert len(text) > 300
        result = plan_command(["--config", str(DEMO_CONFIG), "--model-config", text, "--trainer.precision", "32-true",
                               "--optimizer", "sgd"], print_table=False)  # fmt: skip
        with torch.device("meta"):
            model = tf.AutoModelForCausalLM.from_config(tf.AutoConfig.for_model(family, **fields))
        assert result.device["weights"] == 4 * sum(p.numel() for p in model.parameters())
    if not torch.cuda.is_available():
        cpu = plan_command(["--config", str(DEMO_CONFIG), "--trainer.accelerator", "auto", "--host-memory", "16GB"],
                           print_table=False)  # fmt: skip
        assert cpu.machine.device_type == "cpu"


def test_oomb_plan_of_a_hybrid_pages_only_attention_layers_and_counts_the_carried_states(tmp_path):
    """A Qwen3.5-style config (3 gated delta-net layers : 1 attention layer): planned from the model built on the
    meta device — pages for the 2 attention layers, the states at every chunk boundary, exact parameters."""
    from transformers import Qwen3_5TextConfig

    Qwen3_5TextConfig(num_hidden_layers=8, hidden_size=256, intermediate_size=512, num_attention_heads=4,
                      num_key_value_heads=2, head_dim=64, vocab_size=1000).save_pretrained(tmp_path)  # fmt: skip
    config = EXAMPLES / "configs" / "qwen2.5-7b-128k.yaml"
    result = plan_command(["--config", str(config), "--model-config", str(tmp_path), "--seq-len", "16384",
                           *H200_ARGS])  # fmt: skip
    assert result.model.num_layers == 8 and result.pool.num_layers == 2 == result.model.kv_layers
    boundaries = 16384 // result.config.chunk_size - 1
    assert (
        result.device["carried_states"] == boundaries * result.model.carried_state_bytes(torch.bfloat16) > 0
    )


def test_the_console_script_prints_an_oomb_refusal_in_one_line(monkeypatch):
    """An ``OOMBConfigError`` (here the planner's, for an unknown optimizer) names cause and fix: no traceback."""
    monkeypatch.setattr(sys, "argv", ["oomb", "plan", "--config", str(DEMO_CONFIG), "--optimizer", "adamww"])
    with pytest.raises(SystemExit, match=r"^oomb: error: optimizer='adamww' is unknown to the planner"):
        main()


def test_a_gpu_accelerator_without_a_gpu_is_refused_naming_the_fix(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    argv = ["oomb", "fit", "--config", str(DEMO_CONFIG), "--trainer.accelerator", "gpu"]
    monkeypatch.setattr(sys, "argv", argv)
    with pytest.raises(
        SystemExit, match=r"^oomb: error: trainer.accelerator=gpu .*--trainer.accelerator cpu"
    ):
        main()


def test_num_threads_below_one_is_refused(monkeypatch):
    """``--num_threads 0`` was silently ignored (torch's default thread count ran)."""
    monkeypatch.setattr(sys, "argv", ["oomb", "fit", "--config", str(DEMO_CONFIG), "--num_threads", "0"])
    with pytest.raises(SystemExit, match=r"^oomb: error: num_threads=0: .* pass a positive count"):
        main()


def test_oomb_plan_takes_fits_model_option_as_fit_does(capsys):
    """``--model`` is ``oomb fit``'s (the LightningModule), not an abbreviation of ``oomb plan``'s
    ``--model-config``; and ``--help`` of ``oomb`` names ``oomb plan``."""
    config = '{"model_type": "qwen2", "hidden_size": 32, "intermediate_size": 64, "num_attention_heads": 4, ' \
        '"num_key_value_heads": 2, "num_hidden_layers": 2, "vocab_size": 256}'  # fmt: skip
    result = plan_command(["--model", "CausalLMModule", "--model.config", config, "--data", "TextFileDataModule",
                           "--data.files", str(EXAMPLES / "data" / "*.txt"), "--data.tokenizer", "bytes",
                           "--data.seq_len", "512", "--trainer.strategy", "oomb"])  # fmt: skip
    assert result.model.num_layers == 2 and result.seq_len == 512


def test_a_registered_strategy_name_takes_options_on_the_command_line(tmp_path):
    """``--trainer.strategy oomb --trainer.strategy.chunk_size 128`` failed with jsonargparse's "Expected a dot import
    path string: oomb" and no hint (options follow a class, not a registered name): the name is replaced by its class
    and the registry's options for it (``oomb_offload``: offload on)."""
    cli = build_cli(
        ["fit", "--config", str(DEMO_CONFIG), "--data.init_args.seq_len=256", "--data.init_args.short_samples=0",
         "--data.init_args.train_samples=1", "--data.init_args.val_samples=1", "--trainer.max_steps=1",
         "--trainer.strategy", "oomb", "--trainer.strategy.chunk_size", "128",
         f"--trainer.default_root_dir={tmp_path}"]
    )  # fmt: skip
    assert type(cli.trainer.strategy) is OOMBStrategy and cli.trainer.global_step == 1
    assert (
        cli.trainer.strategy.oomb_config.chunk_size == 128 and cli.trainer.strategy.engine.stats.chunks == 2
    )
    offload = build_cli(["--config", str(DEMO_CONFIG), "--trainer.strategy=oomb_offload",
                         "--trainer.strategy.init_args.page_size=64"], run=False)  # fmt: skip
    config = offload.trainer.strategy.oomb_config
    assert config.offload is True and config.page_size == 64
    named = build_cli(["--config", str(DEMO_CONFIG), "--trainer.strategy", "oomb"], run=False)
    assert (
        named.config["trainer"]["strategy"] == "oomb"
    )  # without options the name stays, as Lightning takes it


def test_a_registered_strategy_name_from_a_config_file_given_options_gets_a_hint(
    tmp_path, monkeypatch, capsys
):
    """A config file's ``strategy: oomb`` cannot take command-line options (jsonargparse reads it as a class path):
    its error ends with a one-line hint naming the working form."""
    text = DEMO_CONFIG.read_text()
    start = text.index("  strategy:\n")
    end = text.index("  max_epochs:")
    config = tmp_path / "short-name.yaml"
    config.write_text(text[:start] + "  strategy: oomb_offload\n" + text[end:])
    argv = ["oomb", "fit", "--config", str(config), "--trainer.strategy.chunk_size", "1024"]
    monkeypatch.setattr(sys, "argv", argv)
    with pytest.raises(SystemExit) as exited:
        main()
    assert exited.value.code == 2
    hint = capsys.readouterr().err.strip().splitlines()[-1]
    assert hint.startswith("hint: the registered strategy name 'oomb_offload' takes no options")
    assert (
        "--trainer.strategy OOMBStrategy --trainer.strategy.offload true --trainer.strategy.chunk_size"
        in hint
    )


def test_oomb_plan_of_the_lora_example_counts_only_the_adapters_as_trained():
    """The 24 GB LoRA example: the plan builds the model with its adapters (meta device) and fits it — the frozen
    base has no gradients or optimizer states; the same run training every weight does not fit."""
    args = ["--config", str(EXAMPLES / "configs" / "qwen2.5-7b-lora-256k-24gb.yaml"), "--device-memory", "24GB",
            "--host-memory", "128GiB"]  # fmt: skip
    lora = plan_command(args, print_table=False)
    assert lora.fits and lora.seq_len == 262144
    assert (
        lora.device["gradients"] < 2**27 and lora.device["optimizer_states"] < 2**28
    )  # rank-16 adapters: 40M elements
    full = plan_command([*args, "--model.lora", "null"], print_table=False)
    assert not full.fits and full.device["optimizer_states"] > 28 * 2**30


def test_oomb_plan_longest_plans_the_longest_step_that_fits(capsys):
    """``--longest``: the longest whole-chunk step with the config's options (one chunk more does not fit); with
    ``--seq-len`` too it is refused naming both."""
    args = ["--config", str(EXAMPLES / "configs" / "qwen2.5-7b-lora-256k-24gb.yaml"), *H200_ARGS]
    longest = plan_command([*args, "--longest"])
    assert longest.fits and longest.seq_len % 4096 == 0 and longest.seq_len > 262144
    assert f"longest step that fits: 1 x {longest.seq_len:,} tokens" in capsys.readouterr().out
    beyond = plan_command([*args, "--seq-len", str(longest.seq_len + 4096)], print_table=False)
    assert not beyond.fits
    with pytest.raises(OOMBConfigError, match="--longest and --seq-len"):
        plan_command([*args, "--longest", "--seq-len", "4096"])


def test_oomb_plan_plans_a_sparse_schedules_dense_steps_too(tmp_path, capsys):
    """As the fit's check: with an OOMBSparseBudget schedule that starts dense, ``oomb plan`` plans its dense steps
    too (on the CPU's reference backend, which attends a chunk's rows to a block of keys at a time, they take more
    memory than the strategy's sparse budget) and shows the plan that does not fit."""
    import yaml

    def config_file(name: str, callbacks: list) -> str:
        config = yaml.safe_load(DEMO_CONFIG.read_text())
        config["trainer"]["strategy"]["init_args"].update(
            chunk_size=512, page_budget=1, attention_backend="torch"
        )
        config["trainer"]["callbacks"] = callbacks
        (tmp_path / name).write_text(yaml.safe_dump(config))
        return str(tmp_path / name)

    plain = ["--config", config_file("sparse.yaml", []), "--seq-len", "65536"]
    schedule = {
        "class_path": "lightning_oomb.callbacks.OOMBSparseBudget",
        "init_args": {"schedule": {0: None, 5: 2}},
    }
    scheduled = ["--config", config_file("scheduled.yaml", [schedule]), "--seq-len", "65536"]
    sparse = plan_command(plain, print_table=False)
    dense = plan_command([*plain, "--trainer.strategy.init_args.page_budget=null"], print_table=False)
    assert dense.peak_device > sparse.peak_device
    between = HOST_RESERVE + sparse.host_tier + (sparse.peak_device + dense.peak_device) // 2
    assert plan_command([*plain, f"--host-memory={between}B"], print_table=False).fits
    refused = plan_command([*scheduled, f"--host-memory={between}B"])
    assert not refused.fits and refused.config.page_budget is None
    assert "the OOMBSparseBudget schedule's steps at page_budget=None" in capsys.readouterr().out


def test_oomb_plan_of_the_glm_example_takes_latents_on_an_h200(capsys):
    """GLM-4.7-Flash's hub id is planned from its known shape; its 512K rows fit an H200 with 128 GiB of host memory
    only over latents, which the strategy's ``mla_pages: auto`` decides (and the header says)."""
    result = plan_command(
        ["--config", str(EXAMPLES / "configs" / "glm-4.7-flash-lora-512k.yaml"), *H200_ARGS]
    )
    assert result.fits and result.config.mla_pages == "latent" and result.pool.values_are_keys
    assert result.seq_len == 524288 and result.model.num_layers == 47
    assert "mla_pages latent" in capsys.readouterr().out


def test_the_plain_text_plan_names_the_decisions_as_the_rich_one_does():
    """Without ``rich`` the plan prints ``MemoryPlan.format()``: its first line is the header the rich table has —
    the options as decided, latent pages and hosted tails included (it had no header)."""
    result = plan_command(
        ["--config", str(EXAMPLES / "configs" / "glm-4.7-flash-lora-512k.yaml"), *H200_ARGS]
    )
    first = result.format().splitlines()[0]
    assert first == result.header() and "mla_pages latent" in first and "offload True" in first
