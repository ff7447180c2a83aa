"""The monitor's view of the trainers' LightningCLI YAML: the LightningModule and the trainers' strategy.

The YAML is read by :mod:`lightning_swarm.recipe_config`, the reader every tool shares.

The monitor uses the very config the trainers use, so it builds an identical model (same parameter shapes,
same optimizer) and joins the same run. The ``data`` section is ignored: the monitor trains nothing.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Dict, Optional, Tuple

import jsonargparse
import lightning.pytorch as pl

from lightning_swarm.recipe_config import build_model, load_yaml, strategy_entry

if TYPE_CHECKING:
    from lightning_swarm.strategy import HivemindStrategy


def strategy_section(config: Dict[str, Any]) -> Dict[str, Any]:
    """``trainer.strategy`` as ``{"class_path": ..., "init_args": {...}}`` (empty init args if there is none)."""
    class_path, init_args = strategy_entry(config)  # no class (none, a bare name, init args alone): HivemindStrategy
    return {"class_path": class_path or "lightning_swarm.HivemindStrategy", "init_args": init_args}


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
            "target_batch_size under trainer.strategy in the config, or pass --run-id/--target-batch-size"
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
    return build_model(config, model_class), build_strategy(config, **strategy_overrides)
