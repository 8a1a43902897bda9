"""The ``oomb`` console script: ``LightningCLI`` with the OOMB strategy registered.

    oomb fit --config examples/configs/demo-cpu.yaml
    oomb fit --config examples/configs/qwen2.5-7b-128k.yaml --trainer.max_steps 10

``model`` and ``data`` are picked in the config by ``class_path`` (any LightningModule / LightningDataModule,
e.g. ``lightning_oomb.models.CausalLMModule`` and ``lightning_oomb.data.TextFileDataModule``); the strategy is
``trainer.strategy: oomb`` (its defaults) or ``{class_path: lightning_oomb.OOMBStrategy, init_args: {chunk_size:
4096, ...}}``; on the command line ``--trainer.strategy OOMBStrategy --trainer.strategy.chunk_size 4096``, or with a
registered name, ``--trainer.strategy oomb --trainer.strategy.chunk_size 4096``: jsonargparse takes options after a
class only, so the command line's registered name followed by options is replaced by its class and the registry's
options for it (``oomb_offload``: ``OOMBStrategy`` with ``offload`` true) before parsing (:func:`strategy_classes`); a
registered name from a config file given options on the command line cannot be, and its error ends with a hint
naming the class. One extra top-level option, ``num_threads`` (a positive count), sets ``torch.set_num_threads``
before anything is built (CPU runs).

``oomb plan --config x.yaml [--device-memory 141GB] [--host-memory 128GiB]`` prints the step's memory plan
(:func:`lightning_oomb.plan`) for the run that ``oomb fit --config x.yaml`` would start: the same parser reads the
same YAML (and the same ``--trainer...``/``--model...``/``--data...`` overrides) but nothing is loaded or
allocated. The model's shape comes from ``--model-config`` (a known hub id, a local model directory, a
``config.json``/YAML file or a JSON dict), else ``model.init_args.config``, else ``model_name_or_path``: the hub
ids of :data:`KNOWN_MODELS` are built from their shape (no download), a local directory is read, any other id is
fetched with ``AutoConfig`` where the hub can be reached. ``--seq-len``/``--batch-size`` override the datamodule's,
``--optimizer`` the optimizer (default: ``CausalLMModule``'s AdamW, ``adamw-fused`` where it takes torch's fused
one, else ``adamw``).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import math
import re
import sys
from pathlib import Path
from typing import Any

import torch
from lightning.pytorch import LightningDataModule, LightningModule
from lightning.pytorch.cli import LightningArgumentParser, LightningCLI

import lightning_oomb  # noqa: F401  (registers strategy="oomb")
from lightning_oomb.callbacks import OOMBSparseBudget

# imported so that their short names work in configs and on the command line (`--model CausalLMModule`) and that
# `oomb fit --help` lists them among the available subclasses
from lightning_oomb.data import NeedleRetrievalDataModule, TextFileDataModule  # noqa: F401
from lightning_oomb.engine import OOMBConfigError
from lightning_oomb.engine.planner import (
    MemoryPlan,
    gib,
    longest_fitting,
    plan,
    step_sizes_of,
)
from lightning_oomb.engine.step_setup import precision_dtypes
from lightning_oomb.models import (  # noqa: F401
    CausalLMModule,
    build_config,
    fused_adamw,
    glm_4_7_flash_config,
    meta_causal_lm,
    qwen2_5_7b_config,
    with_lora,
)
from lightning_oomb.strategy import most_micro_batches, widest_other_budgets

_STRATEGY = "--trainer.strategy"


def _registered(name: str) -> dict | None:
    """The Lightning strategy registry's entry of ``name`` (``{"strategy": class, "init_params": {...}}``), or
    ``None`` for a name it does not hold (a class name, an import path)."""
    from lightning.pytorch.strategies import StrategyRegistry

    return StrategyRegistry[name] if name in StrategyRegistry else None  # noqa: SIM401 (its get() builds one)


def _option_value(value: Any) -> str | None:
    """``value`` as jsonargparse reads a command-line value (YAML), or ``None`` when it has no such form."""
    if isinstance(value, str):
        return value
    try:
        return json.dumps(value)
    except (TypeError, ValueError):
        return None


def _class_form(name: str) -> list[str] | None:
    """The command-line form of registered strategy ``name``: its class's import path, then the registry's options
    for it (``["lightning_oomb.strategy.OOMBStrategy", "--trainer.strategy.offload=true"]``); ``None`` if ``name`` is
    not registered or an option has no command-line form."""
    entry = _registered(name)
    if entry is None:
        return None
    cls = entry["strategy"]
    options = [(key, _option_value(value)) for key, value in entry["init_params"].items()]
    if any(value is None for _, value in options):
        return None
    return [f"{cls.__module__}.{cls.__qualname__}", *(f"{_STRATEGY}.{key}={value}" for key, value in options)]


def strategy_classes(args: list[str]) -> list[str]:
    """``args`` with each registered strategy name (``--trainer.strategy oomb`` or ``--trainer.strategy=oomb``) that
    options follow (``--trainer.strategy.chunk_size 1024``) replaced by its class and the registry's options for it
    (:func:`_class_form`): jsonargparse resolves a class name or import path, not a registered name, so options after
    one failed with "Expected a dot import path string". Other arguments are kept as they are."""
    out: list[str] = []
    i = 0
    while i < len(args):
        arg = args[i]
        if arg == _STRATEGY and i + 1 < len(args):
            name, width = args[i + 1], 2
        elif arg.startswith(_STRATEGY + "="):
            name, width = arg[len(_STRATEGY) + 1 :], 1
        else:
            out.append(arg)
            i += 1
            continue
        later = args[i + width :]
        form = _class_form(name) if any(a.startswith(_STRATEGY + ".") for a in later) else None
        if form is None:
            out += args[i : i + width]
        else:
            out += [_STRATEGY, form[0], *form[1:]]
        i += width
    return out


def _named_strategy_hint(message: str) -> str:
    """A one-line hint for jsonargparse's error on a registered strategy name given options (one that
    :func:`strategy_classes` could not replace: the name came from a config file), or ``""``."""
    match = re.search(r"Expected a dot import path string: (\S+)", message)
    form = _class_form(match.group(1)) if match else None
    if form is None:
        return ""
    name, cls = match.group(1), form[0].rsplit(".", 1)[1]
    preset = "".join(f" {option.replace('=', ' ')}" for option in form[1:])
    return (
        f"\nhint: the registered strategy name {name!r} takes no options — name its class instead: {_STRATEGY} "
        f"{cls}{preset} {_STRATEGY}.chunk_size ... on the command line, or in the config file strategy: "
        f"{{class_path: {form[0]}, init_args: {{...}}}}"
    )


class OOMBArgumentParser(LightningArgumentParser):
    """``LightningArgumentParser`` that takes a registered strategy name with options on the command line
    (:func:`strategy_classes`) and ends the error of one it cannot take with a hint naming the class."""

    def parse_args(self, args=None, *rest, **kwargs):
        return super().parse_args(
            strategy_classes(list(sys.argv[1:] if args is None else args)), *rest, **kwargs
        )

    def error(self, message: str, ex: Exception | None = None):
        return super().error(message + _named_strategy_hint(message), ex)


class OOMBCLI(LightningCLI):
    """``LightningCLI`` in subclass mode for both the model and the data, plus ``num_threads``; its parser takes a
    registered strategy name with options (:class:`OOMBArgumentParser`)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("parser_class", OOMBArgumentParser)
        super().__init__(*args, **kwargs)

    def add_arguments_to_parser(self, parser: LightningArgumentParser) -> None:
        parser.add_argument(
            "--num_threads",
            type=int | None,
            default=None,
            help="torch CPU threads (default: torch's choice); 1 is fastest for tiny models on a busy machine.",
        )

    def before_instantiate_classes(self) -> None:
        threads = self._get(self.config, "num_threads")
        if threads is not None and threads < 1:
            raise OOMBConfigError(
                f"num_threads={threads}: torch needs at least one thread — pass a positive count."
            )
        if threads:
            torch.set_num_threads(threads)
        trainer = self._get(self.config, "trainer")  # (`oomb plan` builds without running: it may plan a GPU)
        gpu = str(getattr(trainer, "accelerator", "")) in ("gpu", "cuda")
        if self.subcommand is not None and gpu and not torch.cuda.is_available():
            raise OOMBConfigError(
                f"trainer.accelerator={trainer.accelerator} but torch sees no CUDA GPU on this machine (torch "
                f"{torch.__version__}) — run on a GPU machine with a CUDA build of torch, or pass "
                "--trainer.accelerator cpu (small models only)."
            )


def build_cli(args: list[str] | None = None, run: bool = True) -> OOMBCLI:
    """Parse ``args`` (default ``sys.argv[1:]``), build model, data and Trainer, and run the subcommand unless
    ``run=False`` (then ``args`` has no subcommand)."""
    return OOMBCLI(
        LightningModule,
        LightningDataModule,
        subclass_mode_model=True,
        subclass_mode_data=True,
        save_config_kwargs={"overwrite": True},  # the configs set trainer.default_root_dir to a run folder
        args=args,
        run=run,
    )


def main() -> None:
    """The ``oomb`` console script: ``oomb plan ...`` prints a memory plan, every other subcommand is LightningCLI's."""
    if sys.argv[1:2] in (["-h"], ["--help"]):
        print(
            "oomb plan --config <fit config> [--device-memory 141GB]: the step's memory plan, exit status 1 when "
            "it does not fit (oomb plan --help)\n"
        )
    try:
        if sys.argv[1:2] == ["plan"]:
            args, sys.argv = sys.argv[2:], sys.argv[:1]  # LightningCLI must not read sys.argv as well
            result = plan_command(args)
            if result is not None and not result.fits:
                sys.exit(1)  # scripts can test it: the step does not fit
            return
        build_cli()
    except OOMBConfigError as err:  # its message names the cause and the fix: no trace
        sys.exit(f"oomb: error: {err}")
    except ValueError as err:  # a class refused an option while jsonargparse built it: say why, not a trace
        reasons = refusals_in(err)
        if not reasons:
            raise
        sys.exit("oomb: error: " + " ".join(reasons))


def refusals_in(err: ValueError) -> list[str]:
    """The items of jsonargparse's "Does not validate against any of the Union subtypes" error that are a class's own
    refusal (its constructor's message), not a type mismatch — the list's own items only, not the nested lines
    explaining a mismatch (a callback's refusal came with "a class path (str)", ... appended)."""
    text = str(err)
    if "Union subtypes" not in text:
        return []
    items = [line for line in text.splitlines() if line.lstrip().startswith("- ")]
    if not items:
        return []
    depth = min(len(line) - len(line.lstrip()) for line in items)
    lines = [line.strip()[2:] for line in items if len(line) - len(line.lstrip()) == depth]
    return [line for line in lines if not line.startswith(("Expected a", "Not a valid", "Import path"))]


# ---------------------------------------------------------------------------------------------------- oomb plan
# hub ids whose shape is known without a download
KNOWN_MODELS = {"Qwen/Qwen2.5-7B": qwen2_5_7b_config, "zai-org/GLM-4.7-Flash": glm_4_7_flash_config}
_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12, "kib": 2**10, "mib": 2**20,
          "gib": 2**30, "tib": 2**40}  # fmt: skip


def parse_bytes(text: str, option: str | None = None) -> int:
    """``"141GB"`` (10^9), ``"128GiB"`` (2^30), ``"1.5e11"`` -> bytes; anything else (``"."``, ``"1.2.3GB"``, ``"lots"``)
    is refused with an :class:`OOMBConfigError` naming ``option`` (e.g. ``"--device-memory"``) and the accepted
    forms."""
    match = re.fullmatch(r"\s*([0-9.]+(?:e[+]?[0-9]+)?)\s*([a-z]*)\s*", str(text).lower())
    try:
        number = float(match.group(1)) if match and match.group(2) in _UNITS else None
    except ValueError:  # "." or "1.2.3": digits and dots that are no number
        number = None
    if number is None or not math.isfinite(number):
        where = f"{option}={text!r}" if option else repr(text)
        raise OOMBConfigError(
            f"{where} is not a memory size — the planner compares bytes — write a number of bytes with an optional "
            "unit: e.g. 141GB (10^9 bytes), 128GiB (2^30 bytes), 80e9 or 85899345920 (bytes); units B, KB, MB, "
            "GB, TB, KiB, MiB, GiB, TiB."
        )
    return int(number * _UNITS[match.group(2)])


class _PlanCLI(OOMBCLI):
    """The fit CLI's parser and classes, built on the CPU (nothing is loaded): records the accelerator asked for."""

    def before_instantiate_classes(self) -> None:
        super().before_instantiate_classes()
        trainer = self.config["trainer"]
        self.accelerator = str(trainer["accelerator"])
        self.per_node = _device_count(trainer["devices"])
        self.world = self.per_node * int(trainer.get("num_nodes") or 1)
        trainer["accelerator"], trainer["devices"], trainer["logger"] = "cpu", 1, False


def _device_count(devices: Any) -> int:
    """Devices per node of a ``trainer.devices`` value (``"auto"`` / ``-1``: this machine's GPUs, at least 1)."""
    if isinstance(devices, (list, tuple)):
        return len(devices)
    text = str(devices).strip().rstrip(",")
    if "," in text:
        return len([d for d in text.split(",") if d.strip()])
    if text.lstrip("-").isdigit() and int(text) > 0:
        return int(text)
    return max(torch.cuda.device_count(), 1)


def planned_model(
    config: Any, precision: str, param_dtype: torch.dtype | None = None, lora: dict | None = None
) -> Any:
    """What the planner reads for ``config``: the adapter of the model built on the meta device in the run's
    parameter dtype (nothing is allocated) — its exact parameters (a formula from the config's fields misses
    ungated MLPs, shared experts, ...), windows and, for a hybrid, its attention layers and carried states; with
    ``lora`` (``CausalLMModule``'s) its adapters, the base frozen; a model OOMB cannot train is refused with the
    reason, as the strategy would. The config itself if transformers cannot build the model."""
    from lightning_oomb.integrations.hf import HFChunkModel, find_causal_lm

    dtype = precision_dtypes(precision, param_dtype).param
    try:
        model = meta_causal_lm(config, dtype)
    except (ValueError, KeyError, TypeError, ImportError):  # not a causal LM transformers knows
        return config
    with torch.device(
        "meta"
    ):  # (peft makes float32 adapters: converted as the run's precision converts them)
        model = with_lora(model, lora).to(dtype)
    return HFChunkModel(find_causal_lm(model), verify_exactness=False)  # (its shape is read: no twin trained)


def model_config(model: LightningModule, override: str | None = None) -> Any:
    """The transformers config of the run's model (see the module docstring for the order)."""
    from transformers import AutoConfig

    hparams = getattr(model, "hparams", {})
    source = override or hparams.get("model_name_or_path")
    if override is None and hparams.get("config") is not None:
        return build_config(dict(hparams["config"]))
    if source is None:
        raise OOMBConfigError(
            f"{type(model).__name__} names no model_name_or_path or config — the planner needs the model's shape — "
            "pass --model-config (a hub id, a local model directory, a config.json or a JSON dict)."
        )
    if source in KNOWN_MODELS:
        return KNOWN_MODELS[source]()
    if source.lstrip().startswith("{"):  # before any path test: a long dict is no valid file name
        return build_config(json.loads(source))
    path = Path(source)
    if path.is_file():
        text = path.read_text()
        import yaml

        return build_config(json.loads(text) if path.suffix == ".json" else yaml.safe_load(text))
    try:
        return AutoConfig.from_pretrained(source)  # a local directory, or the hub where it can be reached
    except (OSError, ValueError) as err:
        raise OOMBConfigError(
            f"cannot read the config of {source!r} — it is not a local directory and cannot be downloaded here — "
            f"pass --model-config with a local model directory, a config.json, a JSON dict or one of "
            f"{sorted(KNOWN_MODELS)}."
        ) from err


LONGEST_PLANNED = 1 << 24  # tokens: the longest step `oomb plan --longest` looks for


def plan_command(args: list[str], print_table: bool = True) -> MemoryPlan | None:
    """``oomb plan``: parse the fit config of ``args`` and print (and return) the step's memory plan (``--help``:
    print the options, return ``None``)."""
    own = argparse.ArgumentParser(prog="oomb plan", add_help=False, allow_abbrev=False)  # --model is fit's
    own.add_argument("--device-memory", help="device memory, e.g. 141GB (default: this machine's)")
    own.add_argument("--host-memory", help="host memory, e.g. 128GiB (default: MemAvailable)")
    own.add_argument("--model-config", help="model shape: a hub id, a local directory, a config file or JSON")
    own.add_argument("--seq-len", type=int)
    own.add_argument("--batch-size", type=int)
    own.add_argument("--optimizer", help="none, sgd, sgd-momentum, adam, adamw, adamw-fused, ... (default: the "
                                          "module's AdamW)")  # fmt: skip
    own.add_argument("--longest", action="store_true",
                     help="plan the longest seq_len (whole chunks, up to 16M tokens) that fits with the config's "
                          "options instead of the data's")  # fmt: skip
    opts, rest = own.parse_known_args(args)
    if {"-h", "--help"} & set(rest):
        print(
            own.format_help()
            + "\nEvery other argument is `oomb fit`'s (--config, --trainer..., --model..., --data...)."
        )
        return None
    memory = {k: parse_bytes(v, "--" + k.replace("_", "-"))
              for k, v in (("device_memory", opts.device_memory), ("host_memory", opts.host_memory))
              if v is not None}  # fmt: skip
    loggers = [logging.getLogger(n) for n in ("lightning.pytorch", "lightning.fabric")]
    levels = [x.level for x in loggers]
    for x in loggers:
        x.setLevel(logging.WARNING)  # no "GPU available" or "Seed set" lines for a plan
    try:
        cli = _PlanCLI(LightningModule, LightningDataModule, subclass_mode_model=True, subclass_mode_data=True,
                       args=rest, run=False)  # fmt: skip
    finally:
        for x, level in zip(loggers, levels):
            x.setLevel(level)
    strategy = cli.trainer.strategy
    if not hasattr(strategy, "oomb_config"):
        raise OOMBConfigError(
            f"the config trains with {type(strategy).__name__} — oomb plan predicts the OOMB strategy's memory — "
            "set trainer.strategy: oomb (or lightning_oomb.OOMBStrategy)."
        )
    *warm_up, (data_seq_len, data_batch) = step_sizes_of(cli.datamodule)
    for name, value in (("--seq-len", opts.seq_len), ("--batch-size", opts.batch_size)):
        if value is not None and value < 1:
            raise OOMBConfigError(
                f"{name} {value} is not a positive integer — pass tokens per row / rows per step."
            )
    if opts.longest and opts.seq_len is not None:
        raise OOMBConfigError(
            "--longest and --seq-len ask for two step lengths — pass one of them (--longest finds the length)."
        )
    seq_len = data_seq_len if opts.seq_len is None else opts.seq_len
    batch = data_batch if opts.batch_size is None else opts.batch_size
    if seq_len is None and not opts.longest:
        raise OOMBConfigError(
            f"{type(cli.datamodule).__name__} declares no seq_len — the plan is per step length — pass --seq-len."
        )
    hparams = getattr(cli.model, "hparams", {})
    dtype = hparams.get("dtype")
    gpu = cli.accelerator in ("gpu", "cuda") or (
        cli.accelerator == "auto" and (torch.cuda.is_available() or "device_memory" in memory)
    )
    device = "cuda" if gpu else "cpu"
    param_dtype = getattr(torch, dtype) if dtype not in (None, "auto") else None
    optimizer = opts.optimizer or _module_optimizer(cli.model, device, cli.trainer)
    config = model_config(cli.model, opts.model_config)
    model = planned_model(config, cli.trainer.precision, param_dtype, hparams.get("lora"))

    if hasattr(strategy, "check_groups"):  # (a mesh the fit would refuse at launch)
        strategy.check_groups(cli.world)

    def plan_step(seq_len: int, batch: int, config) -> MemoryPlan:
        return plan(
            model,
            seq_len,
            batch,
            config,
            cli.trainer.precision,
            optimizer,
            device,
            **memory,
            param_dtype=param_dtype,
            context_parallel=strategy.context_size_on(cli.world)
            if hasattr(strategy, "context_size_on")
            else 1,
            accumulate_grad_batches=most_micro_batches(cli.trainer),
            processes_per_node=cli.per_node,
        )

    if opts.longest:  # (no data seq_len needed)
        chunk = strategy.oomb_config.chunk_size
        seq_len = longest_fitting(
            lambda n: plan_step(n, batch, strategy.oomb_config).fits, chunk, LONGEST_PLANNED
        )
        seq_len = seq_len or chunk  # none fits: the plan of one chunk says why
    result = plan_step(seq_len, batch, strategy.oomb_config)
    if opts.longest and print_table:
        print(
            f"longest step that fits: {batch} x {seq_len:,} tokens"
            if result.fits
            else "not even one chunk fits:"
        )
    # the data's warm-up steps, under the main steps' decisions
    elif opts.seq_len is None and opts.batch_size is None:
        warm = (plan_step(n, b, result.config) for n, b in warm_up)
        result = next((p for p in warm if not p.fits), result)
    # an OOMBSparseBudget schedule's dense and widest sparse steps, under the same decisions (as the fit checks)
    if result.fits:
        own = strategy.oomb_config.page_budget
        schedules = [c for c in cli.trainer.callbacks if isinstance(c, OOMBSparseBudget)]
        budgets = schedules[0].budgets(own, cli.trainer.max_steps) if schedules else None
        for budget in widest_other_budgets(budgets, own):
            other = plan_step(seq_len, batch, dataclasses.replace(result.config, page_budget=budget))
            if not other.fits:
                if print_table:
                    print(f"the OOMBSparseBudget schedule's steps at page_budget={budget}:")
                result = other
                break
    if print_table:
        print_plan(result)
    return result


def _module_optimizer(module: LightningModule, device: str, trainer) -> str:
    """The optimizer a fit of ``module`` would make, as a planner name: ``CausalLMModule``'s AdamW, fused where it
    would be (:func:`~lightning_oomb.models.fused_adamw`); AdamW for any other module (the usual choice)."""
    if not isinstance(module, CausalLMModule):
        return "adamw"
    choice = module.hparams.get("fused_optimizer")
    fused = fused_adamw(choice, device, trainer.precision, trainer.gradient_clip_val)
    return "adamw-fused" if fused else "adamw"


def print_plan(result: MemoryPlan) -> None:
    """The plan as a table (rich when installed, plain text otherwise)."""
    try:
        from rich.console import Console
        from rich.table import Table
    except ImportError:
        print(result.format())
        return
    console = Console(width=max(110, Console().width))
    console.print(f"oomb plan: {result.header()}")
    table = Table()
    table.add_column("term")
    table.add_column("device", justify="right")
    table.add_column("host", justify="right")
    for label, dev, host in result.rows():
        table.add_row(label, gib(dev), gib(host))
    table.add_row(f"peak ({result.peak_phase})", gib(result.peak_device), gib(result.host_tier), style="bold")
    console.print(table)
    console.print("moments (persistent + transients): " + ", ".join(
        f"{name} {gib(result.persistent + extra)}" for name, extra in result.phases.items()))  # fmt: skip
    console.print(result.summary())
    for option in result.options:
        console.print(f"  would fit: {option.text} (peak {gib(option.peak_device)})")
    if not result.fits and not result.options:
        console.print(f"  {result.fix()}")
    for note in result.notes:
        console.print(f"  note: {note}")


if __name__ == "__main__":  # python -m lightning_oomb.cli ... (as the oomb script)
    main()
