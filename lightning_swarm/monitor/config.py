"""Read the trainers' LightningCLI YAML: build the LightningModule and find the swarm's settings.

The monitor uses the very config the trainers use, so it builds an identical model (same parameter shapes,
same optimizer) and joins the same run. The ``data`` section is ignored: the monitor trains nothing.
"""

from __future__ import annotations

import importlib
from typing import Any, Dict, Optional, Tuple

import jsonargparse
import lightning.pytorch as pl
import yaml


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


# strategy arguments the monitor reuses (the rest are about training and don't concern it)
SWARM_KEYS = ("run_id", "target_batch_size", "initial_peers", "compression", "matchmaking_time",
              "averaging_timeout", "load_state_timeout", "averager_opts", "tracker_opts")


def strategy_settings(config: Dict[str, Any]) -> Dict[str, Any]:
    """The HivemindStrategy init args found under ``trainer.strategy`` (empty if the config has none)."""
    strategy = (config.get("trainer") or {}).get("strategy")
    if strategy is None or isinstance(strategy, str):
        return {}
    if not isinstance(strategy, dict):
        raise ValueError(f"trainer.strategy must be a mapping with class_path/init_args, got {strategy!r}")
    init_args = strategy.get("init_args", strategy if "class_path" not in strategy else {})
    return {key: init_args[key] for key in SWARM_KEYS if key in init_args}


def load_monitor_config(path: str, model_class: Optional[str] = None) -> Tuple[pl.LightningModule, Dict[str, Any]]:
    """(the LightningModule, the swarm settings) from the trainers' YAML at ``path``."""
    config = load_yaml(path)
    return build_module(config, model_class), strategy_settings(config)
