"""LightningCLI entry shared by the recipes: configs name their model and data classes (`class_path`).

A few facts are stated twice in a recipe config, once for the model and once for the data (e.g. the DALL-E's
``text_seq_len``): :data:`MODEL_DATA_FACTS` lists them, and a config where the two disagree is refused when it is
parsed, before anything is built or downloaded. They are not derived with LightningCLI's ``link_arguments``, because
a linked value silently overrides one given explicitly (``--data.init_args.text_seq_len 24`` would be ignored).
"""

from __future__ import annotations

from typing import Any, Literal, Optional, Union

import torch
from lightning.pytorch import Trainer
from lightning.pytorch.cli import LightningCLI

from lightning_swarm.precision import resolve_precision
from lightning_swarm.torch_ext import PRECISION_INPUT


class RecipeTrainer(Trainer):
    """Lightning's Trainer (same arguments) whose ``precision`` also takes ``"auto"`` (the default).

    Args:
        precision: ``"auto"`` (bf16-mixed where the hardware runs bf16 natively, 16-mixed on GPUs without bf16,
            32-true otherwise; see :mod:`lightning_swarm.precision`) or any precision Lightning's Trainer takes.
    """

    def __init__(self, *args: Any, precision: Optional[Union[Literal["auto"], PRECISION_INPUT]] = "auto",
                 **kwargs: Any):
        super().__init__(*args, precision=resolve_precision(precision, kwargs.get("accelerator", "auto")), **kwargs)


# (model init_args path, data init_args path) of each fact a recipe config states for both; checked if both are set
MODEL_DATA_FACTS = (
    ("config.text_seq_len", "text_seq_len"),  # recipes.dalle
    ("config.image_grid_size", "image_grid_size"),
    ("model_cfg.text_cfg.context_length", "context_length"),  # recipes.clip
    ("model_cfg.vision_cfg.image_size", "image_size"),
)
_UNSET = object()


def _lookup(tree: Any, dotted: str) -> Any:
    for part in dotted.split("."):
        if tree is None:
            return _UNSET
        tree = tree.get(part, _UNSET) if isinstance(tree, dict) else getattr(tree, part, _UNSET)
        if tree is _UNSET:
            return _UNSET
    return tree


def check_model_matches_data(model: Any, data: Any) -> None:
    """Raise ValueError if ``model`` and ``data`` (parsed ``class_path``/``init_args`` sections of a recipe config)
    disagree on one of :data:`MODEL_DATA_FACTS`."""
    for model_path, data_path in MODEL_DATA_FACTS:
        model_value = _lookup(model, f"init_args.{model_path}")
        data_value = _lookup(data, f"init_args.{data_path}")
        if _UNSET not in (model_value, data_value) and model_value != data_value:
            raise ValueError(
                f"the config gives model.init_args.{model_path}={model_value} but data.init_args.{data_path}="
                f"{data_value}: they must be equal (the data is made for the model); set both to the same value")


class RecipeCLI(LightningCLI):
    """LightningCLI that refuses a config whose model and data disagree (module docstring) before building them."""

    def before_instantiate_classes(self) -> None:
        config = self.config[self.subcommand] if self.subcommand else self.config
        check_model_matches_data(config.get("model"), config.get("data"))


def main(args: list[str] | None = None, run: bool = True) -> LightningCLI:
    """Run LightningCLI (fit / validate / test / predict) on a YAML config with `model` and `data` classes.

    Args:
        args: command-line arguments (None: sys.argv).
        run: run the subcommand; False only parses and instantiates (Trainer, model, data: tests look at them).
            Tools that only read a config use :func:`lightning_swarm.recipe_config.read_recipe_config`.
    """
    torch.set_float32_matmul_precision("high")
    return RecipeCLI(
        subclass_mode_model=True,
        subclass_mode_data=True,
        trainer_class=RecipeTrainer,
        save_config_kwargs={"overwrite": True},
        args=args,
        run=run,
    )
