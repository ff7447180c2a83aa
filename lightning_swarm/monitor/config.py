"""Read the trainers' LightningCLI YAML: build the LightningModule and find the swarm's settings.

The monitor uses the very config the trainers use, so it builds an identical model (same parameter shapes,
same optimizer) and joins the same run. The ``data`` section is ignored: the monitor trains nothing.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any, Dict, Optional, Tuple

import jsonargparse
import lightning.pytorch as pl
import yaml

if TYPE_CHECKING:
    from lightning_swarm.strategy import HivemindStrategy


def import_object(dotted: str) -> Any:
    """``package.module.Name`` (or ``package.module:Name``) -> the object."""
    module_name, _, name = dotted.replace(":", ".").rpartition(".")
    if not module_name:
        raise ValueError(f"Expected a dotted path like 'package.module.ClassName', got {dotted!r}")
    return getattr(importlib.import_module(module_name), name)


def load_yaml(path: str) -> Dict[str, Any]:
    with open(path) as f:
        config = yaml.safe_load(f) or {}
    if not isinstance(config, dict):
        raise ValueError(f"{path}: expected a LightningCLI config (a mapping with 'model', 'trainer', ...)")
    return config


def build_module(config: Dict[str, Any], model_class: Optional[str] = None) -> pl.LightningModule:
    """Instantiate the config's ``model`` section like LightningCLI does.

    Args:
        config: the parsed YAML.
        model_class: the LightningModule class when the YAML's ``model`` section has no ``class_path``
            (recipes whose CLI fixes the model class, e.g. ``recipes.dalle.module.DALLEModule``).
    """
    model_config = config.get("model")
    if model_config is None:
        raise ValueError("The config has no 'model' section: the monitor needs it to build the model")
    parser = jsonargparse.ArgumentParser(exit_on_error=False)
    if model_class is not None:
        parser.add_class_arguments(import_object(model_class), "model", fail_untyped=False)
        if isinstance(model_config, dict) and "class_path" in model_config:
            model_config = model_config.get("init_args", {})
    elif isinstance(model_config, dict) and "class_path" in model_config:
        parser.add_subclass_arguments(pl.LightningModule, "model", fail_untyped=False)
    else:
        raise ValueError(
            "The config's 'model' section has no class_path: pass --model_class package.module.ModuleClass "
            "(the LightningModule the recipe's CLI uses)"
        )
    parsed = parser.parse_object({"model": model_config})
    return parser.instantiate_classes(parsed)["model"]


def strategy_section(config: Dict[str, Any]) -> Dict[str, Any]:
    """``trainer.strategy`` as ``{"class_path": ..., "init_args": {...}}`` (empty init args if there is none)."""
    strategy = (config.get("trainer") or {}).get("strategy")
    if strategy is None or isinstance(strategy, str):  # no swarm strategy, or a bare name such as "auto"
        return {"class_path": "lightning_swarm.HivemindStrategy", "init_args": {}}
    if not isinstance(strategy, dict):
        raise ValueError(f"trainer.strategy must be a mapping with class_path/init_args, got {strategy!r}")
    if "class_path" not in strategy:
        return {"class_path": "lightning_swarm.HivemindStrategy", "init_args": dict(strategy)}
    return {"class_path": strategy["class_path"], "init_args": dict(strategy.get("init_args") or {})}


def build_strategy(config: Dict[str, Any], **overrides: Any) -> "HivemindStrategy":
    """The trainers' HivemindStrategy from ``config['trainer']['strategy']``, parsed and checked like LightningCLI
    does, with ``overrides`` (the monitor's own address, identity, ...) replacing its init args.

    The monitor builds its swarm optimizer through this strategy, so every strategy option means the same for it.
    """
    from lightning_swarm.strategy import HivemindStrategy

    section = strategy_section(config)
    section["init_args"].update({k: v for k, v in overrides.items() if v is not None})
    if not section["init_args"].get("run_id") or not section["init_args"].get("target_batch_size"):
        raise ValueError(
            "The monitor needs the run id and target batch size: put a HivemindStrategy with run_id and "
            "target_batch_size under trainer.strategy in the config, or pass --run_id/--target_batch_size"
        )
    parser = jsonargparse.ArgumentParser(exit_on_error=False)
    parser.add_subclass_arguments(HivemindStrategy, "strategy", fail_untyped=False)
    try:
        parsed = parser.parse_object({"strategy": section})
    except jsonargparse.ArgumentError as e:
        raise ValueError(f"trainer.strategy: {e}") from None
    return parser.instantiate_classes(parsed)["strategy"]


def load_monitor_config(
    path: str, model_class: Optional[str] = None, **strategy_overrides: Any
) -> Tuple[pl.LightningModule, "HivemindStrategy"]:
    """(the LightningModule, the trainers' HivemindStrategy with ``strategy_overrides``) from the YAML at ``path``."""
    config = load_yaml(path)
    return build_module(config, model_class), build_strategy(config, **strategy_overrides)
