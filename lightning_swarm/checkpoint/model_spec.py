"""What rebuilds a checkpoint's model: its class path and init args, stored in meta.json under ``model``.

    {"class_path": "recipes.dalle.module.DALLEModule", "init_args": {"config": {...}, "image_codec": "palette", ...}}

The init args are the LightningModule's saved hyper-parameters (``self.save_hyperparameters(...)``), so a module
stores what it needs to be rebuilt, codec settings included; values JSON can't hold are left out (with a
warning) and take their defaults when the model is rebuilt.

meta.json comes from whoever handed over the checkpoint, so rebuilding trusts none of it:

- the class path is checked as a string first: public dotted names inside a package the user allows (the
  project's ``recipes`` by default; others only by name, ``allowed_model_packages`` / ``--allow-model-package``);
  only then is its module imported, and the class must be a LightningModule defined in an allowed package;
- init args are plain JSON data: a nested class spec (a mapping with ``class_path``) anywhere in them is refused,
  and nothing in them is imported or instantiated. The only conversion is the one the class's own type hints ask
  for: a mapping becomes the dataclass a parameter is annotated with, a list the tuple (no jsonargparse: it imports
  what strings name and instantiates ``class_path`` specs under untyped arguments).
"""

from __future__ import annotations

import dataclasses
import importlib
import inspect
import json
import logging
import math
import re
import types
import typing
from typing import Any, Dict, Iterable, Optional, Sequence, Tuple

import torch

logger = logging.getLogger(__name__)

# the packages whose LightningModules a checkpoint may name without the user saying so
DEFAULT_ALLOWED_MODEL_PACKAGES: Tuple[str, ...] = ("recipes",)
# public dotted names only: no dunder modules (``__main__`` runs a CLI on import), no private ones
PUBLIC_DOTTED_NAME = re.compile(r"[A-Za-z][A-Za-z0-9_]*(\.[A-Za-z][A-Za-z0-9_]*)*")
MAX_CLASS_PATH_CHARS = 256


class ModelNotAllowedError(ValueError):
    """meta.json names a model class outside the packages the user allows (nothing was imported)."""


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


def allowed_packages(extra: Optional[Iterable[str]] = None) -> Tuple[str, ...]:
    """The default allowed packages plus ``extra`` (each checked to be a dotted module name)."""
    packages = list(DEFAULT_ALLOWED_MODEL_PACKAGES)
    for name in [extra] if isinstance(extra, str) else extra or ():  # one name given as a string is one package
        if not isinstance(name, str) or not PUBLIC_DOTTED_NAME.fullmatch(name):
            raise ValueError(f"allowed_model_packages: {name!r} is not a package name like 'my_models' or 'org.models'")
        packages.append(name)
    return tuple(dict.fromkeys(packages))


def _in_packages(dotted: str, packages: Sequence[str]) -> bool:
    return any(dotted == package or dotted.startswith(package + ".") for package in packages)


def check_class_path(class_path: Any, packages: Sequence[str], source: str = "the checkpoint") -> Tuple[str, str]:
    """(module name, class name) of ``class_path`` if, as a string, it names a public class inside ``packages``;
    raises :class:`ModelNotAllowedError` (naming the class and the opt-in) otherwise. Imports nothing."""
    text = class_path if isinstance(class_path, str) else repr(class_path)
    shown = text[:MAX_CLASS_PATH_CHARS] + ("..." if len(text) > MAX_CLASS_PATH_CHARS else "")
    if (not isinstance(class_path, str) or len(class_path) > MAX_CLASS_PATH_CHARS
            or not PUBLIC_DOTTED_NAME.fullmatch(class_path) or "." not in class_path):
        raise ModelNotAllowedError(f"{source}: meta.json's model.class_path {shown!r} is not a dotted class name "
                                   f"like 'recipes.dalle.module.DALLEModule'; refusing to load it")
    module_name, _, class_name = class_path.rpartition(".")
    if not _in_packages(module_name, packages):
        top = module_name.split(".")[0]
        raise ModelNotAllowedError(
            f"{source}: meta.json names model class {class_path!r}, outside the packages allowed to provide models "
            f"{list(packages)}; nothing was imported. If you trust that code, allow its package by name: "
            f"allowed_model_packages=[{top!r}] (inference: --allow-model-package {top})"
        )
    return module_name, class_name


def import_model_class(class_path: Any, packages: Sequence[str], source: str = "the checkpoint") -> type:
    """The LightningModule class ``class_path`` names, imported only after :func:`check_class_path` passed."""
    import lightning.pytorch as pl

    module_name, class_name = check_class_path(class_path, packages, source)
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise ValueError(f"{source}: cannot import {module_name!r} for model class {class_path!r}: {e}") from None
    cls = getattr(module, class_name, None)
    if not (isinstance(cls, type) and issubclass(cls, pl.LightningModule)):
        raise ModelNotAllowedError(f"{source}: {class_path!r} is not a LightningModule class; refusing to build it")
    if not _in_packages(cls.__module__, packages):  # a LightningModule another package's code defines, re-exported
        raise ModelNotAllowedError(f"{source}: {class_path!r} is {cls.__module__}.{cls.__qualname__}, defined "
                                   f"outside the allowed packages {list(packages)}; refusing to build it")
    return cls


def refuse_class_specs(value: Any, where: str, source: str) -> None:
    """Raise if ``value`` (JSON data from meta.json) holds a mapping with ``class_path`` anywhere."""
    stack = [(value, where)]
    while stack:
        item, path = stack.pop()
        if isinstance(item, dict):
            if "class_path" in item:
                raise ModelNotAllowedError(
                    f"{source}: {path} holds a class spec (class_path {str(item['class_path'])[:80]!r}); checkpoints "
                    f"rebuild models from plain data only and never instantiate classes named in their init args"
                )
            stack.extend((v, f"{path}.{k}") for k, v in item.items())
        elif isinstance(item, list):
            stack.extend((v, f"{path}[{i}]") for i, v in enumerate(item))
        elif not (item is None or isinstance(item, (bool, int, float, str))):
            raise ValueError(f"{source}: {path} is a {type(item).__name__}, not JSON data")


def _from_plain(value: Any, hint: Any, where: str) -> Any:
    """``value`` (plain JSON data) shaped as the type hint asks: mappings into dataclasses, lists into tuples.
    Anything else is passed through unchanged (the class's own ``__init__`` checks it)."""
    if hint is None or hint is Any or hint is inspect.Parameter.empty or isinstance(hint, (str, typing.ForwardRef)):
        return value
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin is typing.Union or origin is types.UnionType:
        if value is None:
            return None
        options = [a for a in args if a is not type(None)]
        if isinstance(value, dict):
            dataclasses_ = [a for a in options if isinstance(a, type) and dataclasses.is_dataclass(a)]
            if len(dataclasses_) == 1:
                return _from_plain(value, dataclasses_[0], where)
        if isinstance(value, list):
            tuples = [a for a in options if a is tuple or typing.get_origin(a) is tuple]
            if len(tuples) == 1:
                return _from_plain(value, tuples[0], where)
        return value
    if isinstance(hint, type) and dataclasses.is_dataclass(hint) and isinstance(value, dict):
        fields = {f.name: f for f in dataclasses.fields(hint) if f.init}
        unknown = sorted(set(value) - set(fields))
        if unknown:
            raise ValueError(f"{where}: {hint.__name__} has no field(s) {unknown}")
        try:
            hints = typing.get_type_hints(hint)
        except Exception:  # an annotation that does not resolve: pass its value as plain data
            hints = {}
        return hint(**{k: _from_plain(v, hints.get(k), f"{where}.{k}") for k, v in value.items()})
    if (hint is tuple or origin is tuple) and isinstance(value, list):
        if len(args) == 2 and args[1] is Ellipsis:
            return tuple(_from_plain(v, args[0], f"{where}[{i}]") for i, v in enumerate(value))
        if args and len(args) == len(value):
            return tuple(_from_plain(v, a, f"{where}[{i}]") for i, (v, a) in enumerate(zip(value, args)))
        return tuple(value)
    if origin is list and isinstance(value, list) and args:
        return [_from_plain(v, args[0], f"{where}[{i}]") for i, v in enumerate(value)]
    if origin is dict and isinstance(value, dict) and len(args) == 2:
        return {k: _from_plain(v, args[1], f"{where}.{k}") for k, v in value.items()}
    return value


def init_kwargs(cls: type, init_args: Dict[str, Any], source: str) -> Dict[str, Any]:
    """Keyword arguments of ``cls(...)`` from meta.json's plain-data ``init_args`` (checked, see module docstring)."""
    refuse_class_specs(init_args, "model.init_args", source)
    parameters = inspect.signature(cls.__init__).parameters
    takes_any = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters.values())
    named = {name for name, p in parameters.items()
             if name != "self" and p.kind in (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)}
    unknown = sorted(set(init_args) - named)
    if unknown and not takes_any:
        raise ValueError(f"{source}: model.init_args {unknown} are not arguments of {cls.__name__}")
    try:
        hints = typing.get_type_hints(cls.__init__)
    except Exception:  # an annotation that does not resolve: that argument is passed as plain data
        hints = {}
    return {name: _from_plain(value, hints.get(name), f"model.init_args.{name}") for name, value in init_args.items()}


def build_model(spec: Optional[Dict[str, Any]], source: str = "the checkpoint",
                allowed_model_packages: Optional[Iterable[str]] = None,
                base_class: Optional[type] = None) -> torch.nn.Module:
    """Instantiate the LightningModule that ``spec`` (meta.json's ``model``) describes.

    Args:
        spec: ``{"class_path": "package.module.Class", "init_args": {...}}``.
        source: where the spec comes from, for error messages (e.g. the checkpoint URL).
        allowed_model_packages: packages besides the project's ``recipes`` whose LightningModules may be built
            (their code runs: name only packages you trust).
        base_class: if given, the class must be a subclass of it (checked before anything is instantiated).
    """
    if not isinstance(spec, dict) or not isinstance(spec.get("class_path"), str):
        raise ValueError(
            f"{source} does not say which model it holds (meta.json has no model.class_path): it was written "
            f"before checkpoints recorded their model; load it into a model you build yourself with "
            f"lightning_swarm.checkpoint.checkpoint_io.load_checkpoint(url, module)"
        )
    init_args = spec.get("init_args") or {}
    if not isinstance(init_args, dict):
        raise ValueError(f"{source}: model.init_args must be a mapping, got {type(init_args).__name__}")
    cls = import_model_class(spec["class_path"], allowed_packages(allowed_model_packages), source)
    if base_class is not None and not issubclass(cls, base_class):
        raise ValueError(f"{source} holds a {cls.__name__}, not a {base_class.__module__}.{base_class.__qualname__}")
    kwargs = init_kwargs(cls, init_args, source)
    try:
        return cls(**kwargs)
    except Exception as e:  # whatever the class's own checks raise about hostile init args (sizes torch refuses...)
        raise ValueError(f"{source}: cannot rebuild model {spec['class_path']!r} from its init args: "
                         f"{type(e).__name__}: {str(e)[:300]}") from None


def check_against_weights(probe: torch.nn.Module, model_file: str, source: str) -> None:
    """Refuse init args that build a model other than the one the weights file holds, before it is built for real.

    ``probe`` is the model built on the meta device (no memory). Every tensor of its state dict that the file holds
    must have the file's shape, and its parameters and persistent buffers together may not hold more values than
    the file (tied weights are stored once, so they count once). Reads only the file's header.
    """
    from safetensors import safe_open

    with safe_open(model_file, framework="pt") as f:
        shapes = {name: tuple(f.get_slice(name).get_shape()) for name in f.keys()}
    for name, tensor in probe.state_dict(keep_vars=True).items():
        if name in shapes and tuple(tensor.shape) != shapes[name]:
            raise ValueError(f"{source}: model.init_args build {name} of shape {tuple(tensor.shape)}, the weights file "
                             f"holds {shapes[name]}; refusing to build it")
    non_persistent = {f"{prefix}.{name}" if prefix else name for prefix, module in probe.named_modules()
                      for name in getattr(module, "_non_persistent_buffers_set", ())}
    wanted = sum(p.numel() for p in probe.parameters()) + sum(
        b.numel() for name, b in probe.named_buffers() if name not in non_persistent)
    held = sum(math.prod(shape) for shape in shapes.values())
    if wanted > held:
        raise ValueError(f"{source}: model.init_args build a model of {wanted} values, the weights file holds {held}; "
                         f"refusing to build it")
