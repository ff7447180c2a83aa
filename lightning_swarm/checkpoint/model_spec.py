"""What rebuilds a checkpoint's model: its class path and init args, stored in meta.json under ``model``.

    {"class_path": "recipes.dalle.module.DALLEModule", "init_args": {"config": {...}, "image_codec": "palette", ...}}

The init args are the LightningModule's saved hyper-parameters (``self.save_hyperparameters(...)``), so a module
stores what it needs to be rebuilt, codec settings included; values JSON can't hold are left out (with a
warning) and take their defaults when the model is rebuilt. Rebuilding goes through jsonargparse, as LightningCLI
builds the model from a YAML config, and only accepts LightningModule subclasses.
"""

from __future__ import annotations

import json
import logging
from typing import Any, Dict, Optional

import torch

logger = logging.getLogger(__name__)


def model_spec(module: torch.nn.Module) -> Dict[str, Any]:
    """``{"class_path": ..., "init_args": {...}}`` of ``module`` (init args: its JSON-serializable hparams)."""
    init_args: Dict[str, Any] = {}
    for key, value in dict(getattr(module, "hparams", None) or {}).items():
        try:
            json.dumps(value)
        except (TypeError, ValueError):
            logger.warning(f"Checkpoint meta: init arg {key!r} of {type(module).__name__} is not JSON data; "
                           f"it takes its default when the model is rebuilt")
            continue
        init_args[key] = value
    return {"class_path": f"{type(module).__module__}.{type(module).__qualname__}", "init_args": init_args}


def build_model(spec: Optional[Dict[str, Any]], source: str = "the checkpoint") -> torch.nn.Module:
    """Instantiate the LightningModule that ``spec`` (meta.json's ``model``) describes.

    Args:
        spec: ``{"class_path": "package.module.Class", "init_args": {...}}``.
        source: where the spec comes from, for error messages (e.g. the checkpoint URL).
    """
    import jsonargparse
    import lightning.pytorch as pl

    if not isinstance(spec, dict) or not isinstance(spec.get("class_path"), str):
        raise ValueError(
            f"{source} does not say which model it holds (meta.json has no model.class_path): it was written "
            f"before checkpoints recorded their model; load it into a model you build yourself with "
            f"lightning_swarm.checkpoint.checkpoint_io.load_checkpoint(url, module)"
        )
    init_args = spec.get("init_args") or {}
    if not isinstance(init_args, dict):
        raise ValueError(f"{source}: model.init_args must be a mapping, got {type(init_args).__name__}")
    parser = jsonargparse.ArgumentParser(exit_on_error=False)
    parser.add_subclass_arguments(pl.LightningModule, "model", fail_untyped=False)
    try:
        parsed = parser.parse_object({"model": {"class_path": spec["class_path"], "init_args": init_args}})
    except Exception as e:
        raise ValueError(f"{source}: cannot rebuild model {spec['class_path']!r} from its init args: {e}") from None
    return parser.instantiate_classes(parsed)["model"]
