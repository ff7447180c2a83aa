"""LightningCLI entry shared by the recipes: configs name their model and data classes (`class_path`)."""

from __future__ import annotations

import torch
from lightning.pytorch.cli import LightningCLI


def main(args: list[str] | None = None, run: bool = True) -> LightningCLI:
    """Run LightningCLI (fit / validate / test / predict) on a YAML config with `model` and `data` classes.

    Args:
        args: command-line arguments (None: sys.argv).
        run: run the subcommand; False only parses and instantiates (used by tools that need the model).
    """
    torch.set_float32_matmul_precision("high")
    return LightningCLI(
        subclass_mode_model=True,
        subclass_mode_data=True,
        save_config_kwargs={"overwrite": True},
        args=args,
        run=run,
    )
