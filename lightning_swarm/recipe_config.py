"""Read a recipe's LightningCLI YAML for tools (the monitor, the memory calculator): one reader for all of them.

A tool gets the sections it needs as plain init args, and builds the model exactly as LightningCLI does
(jsonargparse: nested ``class_path`` entries, dataclasses, type checks), so it has the trainers' parameter shapes.
Nothing else in the YAML is instantiated: no Trainer, no DataModule, no DHT.

    config = read_recipe_config("configs/dalle_tiny.yaml")
    config.strategy["run_id"], config.data_init_args["batch_size"]
    with torch.device("meta"):            # count parameters without allocating them
        model = config.build_model()
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, Optional, Tuple, Union

import yaml

# how a config without class_path for its model names the class (monitor and memory calculator flag)
MODEL_CLASS_FLAG = "--model-class"


def import_class(class_path: str) -> type:
    """``package.module.Name`` (or ``package.module:Name``) -> the object, with a clear error."""
    module_name, _, name = class_path.replace(":", ".").rpartition(".")
    if not module_name:
        raise ValueError(f"Expected a dotted path like 'package.module.ClassName', got {class_path!r}")
    try:
        return getattr(importlib.import_module(module_name), name)
    except (ImportError, AttributeError) as e:
        raise ValueError(f"cannot import {class_path!r}: {e}") from e


def load_yaml(path: Union[str, Path]) -> Dict[str, Any]:
    """The YAML mapping at ``path`` (a LightningCLI config)."""
    config = yaml.safe_load(Path(path).read_text()) or {}
    if not isinstance(config, dict):
        raise ValueError(f"{path}: expected a LightningCLI config (a mapping with 'model', 'trainer', ...)")
    return config


def _class_and_init_args(entry: Any, section: str, given_class: Optional[str] = None) -> Tuple[Optional[str], dict]:
    """(class path or None, init args) of a LightningCLI section: ``{class_path, init_args}``, a bare class path
    string, or the init args alone (recipes whose CLI fixes the class)."""
    if entry is None:
        return given_class, {}
    if isinstance(entry, str):
        return entry, {}
    if not isinstance(entry, dict):
        raise ValueError(f"the config's {section!r} section must be a mapping, got {entry!r}")
    if "class_path" in entry:
        return (given_class or entry["class_path"]), dict(entry.get("init_args") or {})
    return given_class, dict(entry)


def instantiate_model_config(model_config: Union[str, Dict[str, Any]], model_class: Optional[str] = None) -> Any:
    """Instantiate a LightningCLI ``model`` entry as LightningCLI does (jsonargparse).

    Call it under ``torch.device("meta")`` to allocate nothing.

    Args:
        model_config: the YAML's ``model`` entry (``{class_path, init_args}``, a class path, or bare init args).
        model_class: the class, as ``package.module.Class``, when the entry has no ``class_path``.
    """
    from jsonargparse import ArgumentParser

    class_path, init_args = _class_and_init_args(model_config, "model", model_class)
    if class_path is None:
        raise ValueError(
            f"the config's 'model' section has no class_path: pass {MODEL_CLASS_FLAG} package.module.ClassName "
            "(the LightningModule the recipe's CLI uses)"
        )
    parser = ArgumentParser(exit_on_error=False)
    parser.add_class_arguments(import_class(class_path), "model", fail_untyped=False)
    parsed = parser.parse_object({"model": init_args})
    return parser.instantiate_classes(parsed)["model"]


def build_model(config: Dict[str, Any], model_class: Optional[str] = None) -> Any:
    """The model of a parsed config (see :func:`instantiate_model_config`)."""
    if config.get("model") is None:
        raise ValueError("The config has no 'model' section: it is needed to build the model")
    return instantiate_model_config(config["model"], model_class)


def strategy_entry(config: Dict[str, Any]) -> Tuple[Optional[str], Dict[str, Any]]:
    """(class path or None, init args) of ``trainer.strategy``; ``(None, {})`` if the config names no strategy or
    only its name (such as ``"auto"``)."""
    strategy = (config.get("trainer") or {}).get("strategy")
    if strategy is None or isinstance(strategy, str):
        return None, {}
    return _class_and_init_args(strategy, "trainer.strategy")


def strategy_init_args(config: Dict[str, Any]) -> Dict[str, Any]:
    """The init args under ``trainer.strategy`` (empty if the config names no strategy or only its name)."""
    return strategy_entry(config)[1]


@dataclass
class RecipeConfig:
    """The sections of a recipe's LightningCLI YAML that tools use.

    Args:
        path: where it was read from.
        raw: the whole parsed YAML.
        model_class: the model's class path (from the YAML, or the ``model_class`` given to the reader).
        model_init_args: the model's init args as written.
        strategy: init args of ``trainer.strategy`` (the swarm settings of a HivemindStrategy).
        data_class: the data module's class path, or None.
        data_init_args: the data module's init args as written.
    """

    path: str
    raw: Dict[str, Any]
    model_class: Optional[str]
    model_init_args: Dict[str, Any]
    strategy: Dict[str, Any] = field(default_factory=dict)
    data_class: Optional[str] = None
    data_init_args: Dict[str, Any] = field(default_factory=dict)

    def build_model(self) -> Any:
        """Instantiate the model as LightningCLI would (under ``torch.device("meta")`` to allocate nothing)."""
        return instantiate_model_config({"class_path": self.model_class, "init_args": self.model_init_args}
                                        if self.model_class else self.model_init_args)


def read_recipe_config(path: Union[str, Path], model_class: Optional[str] = None) -> RecipeConfig:
    """Read a recipe's LightningCLI YAML.

    Args:
        path: the YAML file (e.g. ``configs/dalle_tiny.yaml``).
        model_class: the model class (``package.module.Class``) for configs whose ``model`` has no class_path.
    """
    if not Path(path).is_file():
        raise ValueError(f"config file {path} does not exist")
    config = load_yaml(path)
    if config.get("model") is None:
        raise ValueError(f"{path} has no 'model' section; expected LightningCLI YAML with model: {{class_path: ...}}")
    model_cls, model_args = _class_and_init_args(config["model"], "model", model_class)
    data_cls, data_args = _class_and_init_args(config.get("data"), "data")
    return RecipeConfig(str(path), config, model_cls, model_args, strategy_init_args(config), data_cls, data_args)
