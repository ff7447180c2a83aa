"""Optimizer and scheduler states as JSON plus a flat dict of tensors (no pickle), for a checkpoint's
training_state.json + training_state.safetensors."""

from __future__ import annotations

import logging
import math
from typing import Any, Dict

import torch

logger = logging.getLogger(__name__)


def flatten_state(obj: Any, tensors: Dict[str, torch.Tensor], path: str = "") -> Any:
    """Turn a nested optimizer/scheduler state into JSON, moving every tensor into ``tensors``.

    Tensors become ``{"__tensor__": key}``, tuples ``{"__tuple__": [...]}`` and dicts whose keys are not all
    strings (optimizer states are keyed by int) ``{"__dict__": [[key, value], ...]}``. Values JSON can't hold
    (e.g. lambdas inside a LambdaLR state) are dropped with a warning: the scheduler rebuilds them in code.
    """
    if isinstance(obj, torch.Tensor):
        key = path or "tensor"
        tensors[key] = obj.detach().to("cpu").contiguous()
        return {"__tensor__": key}
    if isinstance(obj, dict):
        if all(isinstance(k, str) and not k.startswith("__") for k in obj):
            return {k: flatten_state(v, tensors, f"{path}.{k}") for k, v in obj.items()}
        items = []
        for k, v in obj.items():
            if not isinstance(k, (str, int, float, bool)) and k is not None:
                logger.warning(f"Checkpoint: dropping state entry {path}.{k!r}: key type {type(k).__name__}")
                continue
            items.append([k, flatten_state(v, tensors, f"{path}.{k}")])
        return {"__dict__": items}
    if isinstance(obj, tuple):
        return {"__tuple__": [flatten_state(v, tensors, f"{path}.{i}") for i, v in enumerate(obj)]}
    if isinstance(obj, list):
        return [flatten_state(v, tensors, f"{path}.{i}") for i, v in enumerate(obj)]
    if obj is None or isinstance(obj, (bool, int, str)):
        return obj
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else {"__float__": repr(obj)}  # keep inf/nan exactly, JSON-valid
    logger.warning(f"Checkpoint: dropping state entry {path}: {type(obj).__name__} is not tensor/JSON data")
    return None


def unflatten_state(obj: Any, tensors: Dict[str, torch.Tensor]) -> Any:
    """Inverse of :func:`flatten_state`."""
    if isinstance(obj, dict):
        if "__tensor__" in obj:
            return tensors[obj["__tensor__"]]
        if "__tuple__" in obj:
            return tuple(unflatten_state(v, tensors) for v in obj["__tuple__"])
        if "__dict__" in obj:
            return {k: unflatten_state(v, tensors) for k, v in obj["__dict__"]}
        if "__float__" in obj:
            return float(obj["__float__"])
        return {k: unflatten_state(v, tensors) for k, v in obj.items()}
    if isinstance(obj, list):
        return [unflatten_state(v, tensors) for v in obj]
    return obj
