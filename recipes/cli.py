"""LightningCLI entry shared by the recipes: configs name their model and data classes (`class_path`)."""

from __future__ import annotations

from typing import Any, Literal, Optional, Union

import torch
from lightning.fabric.connector import _PRECISION_INPUT
from lightning.pytorch import Trainer
from lightning.pytorch.cli import LightningCLI

from lightning_swarm.precision import resolve_precision


class RecipeTrainer(Trainer):
    """Lightning's Trainer (same arguments) whose ``precision`` also takes ``"auto"`` (the default).

    Args:
        precision: ``"auto"`` (bf16-mixed where the hardware runs bf16 natively, 16-mixed on GPUs without bf16,
            32-true otherwise; see :mod:`lightning_swarm.precision`) or any precision Lightning's Trainer takes.
    """

    def __init__(self, *args: Any, precision: Optional[Union[Literal["auto"], _PRECISION_INPUT]] = "auto",
                 **kwargs: Any):
        super().__init__(*args, precision=resolve_precision(precision, kwargs.get("accelerator", "auto")), **kwargs)


def main(args: list[str] | None = None, run: bool = True) -> LightningCLI:
    """Run LightningCLI (fit / validate / test / predict) on a YAML config with `model` and `data` classes.

    Args:
        args: command-line arguments (None: sys.argv).
        run: run the subcommand; False only parses and instantiates (Trainer, model, data: tests look at them).
            Tools that only read a config use :func:`lightning_swarm.recipe_config.read_recipe_config`.
    """
    torch.set_float32_matmul_precision("high")
    return LightningCLI(
        subclass_mode_model=True,
        subclass_mode_data=True,
        trainer_class=RecipeTrainer,
        save_config_kwargs={"overwrite": True},
        args=args,
        run=run,
    )
