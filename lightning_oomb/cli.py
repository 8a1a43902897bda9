"""The ``oomb`` console script: ``LightningCLI`` with the OOMB strategy registered.

    oomb fit --config examples/configs/demo-cpu.yaml
    oomb fit --config examples/configs/qwen2.5-7b-128k.yaml --trainer.max_steps 10

``model`` and ``data`` are picked in the config by ``class_path`` (any LightningModule / LightningDataModule,
e.g. ``lightning_oomb.models.CausalLMModule`` and ``lightning_oomb.data.TextFileDataModule``); the strategy is
``trainer.strategy: oomb`` or ``{class_path: lightning_oomb.OOMBStrategy, init_args: {chunk_size: 4096, ...}}``.
One extra top-level option, ``num_threads``, sets ``torch.set_num_threads`` before anything is built (CPU runs).
"""

from __future__ import annotations

import torch
from lightning.pytorch import LightningDataModule, LightningModule
from lightning.pytorch.cli import LightningArgumentParser, LightningCLI

import lightning_oomb  # noqa: F401  (registers strategy="oomb")

# imported so that their short names work in configs and on the command line (`--model CausalLMModule`) and that
# `oomb fit --help` lists them among the available subclasses
from lightning_oomb.data import NeedleRetrievalDataModule, TextFileDataModule  # noqa: F401
from lightning_oomb.models import CausalLMModule  # noqa: F401


class OOMBCLI(LightningCLI):
    """``LightningCLI`` in subclass mode for both the model and the data, plus ``num_threads``."""

    def add_arguments_to_parser(self, parser: LightningArgumentParser) -> None:
        parser.add_argument(
            "--num_threads",
            type=int | None,
            default=None,
            help="torch CPU threads (default: torch's choice); 1 is fastest for tiny models on a busy machine.",
        )

    def before_instantiate_classes(self) -> None:
        threads = self._get(self.config, "num_threads")
        if threads:
            torch.set_num_threads(threads)


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
    """The ``oomb`` console script."""
    build_cli()
