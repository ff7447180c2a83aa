"""The one place where lightning_swarm touches private parts of torch and Lightning.

Everything here is a small wrapper around a name that torch or Lightning does not promise to keep. Each name is
listed in :data:`PRIVATE_NAMES` (checked by ``tests/lightning_swarm/test_torch_ext.py``, which also checks the
behaviour the wrappers rely on). After an upgrade, :func:`missing_private_names` says what moved, and
:func:`check_versions` warns once when torch or Lightning is outside the releases this was checked against.
(hivemind's private API has its own seam: :mod:`lightning_swarm.hivemind_ext`.)
"""

from __future__ import annotations

import functools
import importlib
import warnings
from dataclasses import dataclass
from importlib.metadata import PackageNotFoundError, version
from typing import Any, Dict, List, Optional, Tuple

import torch
from lightning.fabric.connector import _PRECISION_INPUT
from lightning.pytorch.core.optimizer import _configure_optimizers, _configure_schedulers_automatic_opt
from packaging.specifiers import SpecifierSet
from packaging.version import Version

# the releases whose private names below were checked (the names are older than the lower bounds)
SUPPORTED_RANGES: Dict[str, str] = {"torch": ">=2.4,<2.16", "lightning": ">=2.4,<2.7"}

# Lightning's type of the Trainer's ``precision`` argument, for a CLI that adds "auto" to it
PRECISION_INPUT = _PRECISION_INPUT


@dataclass(frozen=True)
class PrivateName:
    """One private torch or Lightning name that lightning_swarm uses.

    Args:
        path: importable dotted path, e.g. ``"torch.cpu._is_amx_tile_supported"``; for an attribute that torch sets
            on instances (not importable), the path of the code that sets it, with ``attribute`` naming it.
        why: what we use it for.
        attribute: for names set on instances: the attribute, checked by behaviour in the test, not by import.
    """

    path: str
    why: str
    attribute: Optional[str] = None


PRIVATE_NAMES: Tuple[PrivateName, ...] = (
    PrivateName("lightning.fabric.connector._PRECISION_INPUT", "the CLI's precision type, plus 'auto'"),
    PrivateName("lightning.pytorch.core.optimizer._configure_optimizers",
                "reads configure_optimizers() in every format Lightning accepts (the monitor)"),
    PrivateName("lightning.pytorch.core.optimizer._configure_schedulers_automatic_opt",
                "turns its schedulers into LRSchedulerConfigs (the monitor)"),
    PrivateName("torch.cpu._is_avx512_bf16_supported", "native bf16 on this CPU? (precision choice)"),
    PrivateName("torch.cpu._is_amx_tile_supported", "AMX on this CPU? (precision choice)"),
    PrivateName("torch.ops.mkldnn._is_mkldnn_bf16_supported", "oneDNN bf16 kernels? (precision choice)"),
    PrivateName("torch.optim.lr_scheduler.LRScheduler", "marks a re-created optimizer's step as tracked",
                attribute="_opt_called"),
    PrivateName("torch.optim.lr_scheduler.LRScheduler", "the marker on an optimizer.step torch has wrapped",
                attribute="_wrapped_by_lr_sched"),
    PrivateName("torch.optim.lr_scheduler.SequentialLR", "children of a composite scheduler, re-bound one by one",
                attribute="_schedulers"),
)


def _resolve(path: str) -> Any:
    module_path, _, name = path.rpartition(".")
    owner: Any = None
    while module_path:  # import the longest importable prefix, then walk attributes
        try:
            owner = importlib.import_module(module_path)
            break
        except ImportError:
            module_path, _, parent = module_path.rpartition(".")
            name = f"{parent}.{name}"
    if owner is None:
        raise AttributeError(path)
    for part in name.split("."):
        owner = getattr(owner, part)
    return owner


def missing_private_names() -> List[str]:
    """The importable :data:`PRIVATE_NAMES` the installed torch and Lightning no longer have."""
    missing = []
    for private in PRIVATE_NAMES:
        if private.attribute is None:
            try:
                _resolve(private.path)
            except AttributeError:
                missing.append(private.path)
    return missing


def check_versions(installed: Optional[Dict[str, str]] = None) -> List[str]:
    """Warn (once per call) for each of torch and Lightning outside :data:`SUPPORTED_RANGES`; return their names.

    Args:
        installed: versions to check, by package name; default: the installed ones.
    """
    outside = []
    for package, supported in SUPPORTED_RANGES.items():
        try:
            found = (installed or {}).get(package) or version(package)
        except PackageNotFoundError:
            continue
        if Version(Version(found).base_version) not in SpecifierSet(supported):  # "2.5.1+cpu" is 2.5.1
            outside.append(package)
            warnings.warn(
                f"lightning_swarm uses private parts of {package} checked for {package}{supported}, but {found} is "
                f"installed: if something fails, run tests/lightning_swarm/test_torch_ext.py, which names what moved.",
                RuntimeWarning, stacklevel=2)
    return outside


def cpu_probe(path: str) -> bool:
    """Call one of torch's private CPU feature probes (e.g. ``"torch.cpu._is_amx_tile_supported"``); False if this
    torch does not have it (then the feature is taken as absent)."""
    try:
        probe = _resolve(path)
    except AttributeError:
        return False
    return bool(probe()) if callable(probe) else False


def mark_step_tracking(optimizer: torch.optim.Optimizer) -> None:
    """Wrap ``optimizer.step`` the way torch's LRScheduler does, and mark it as stepped.

    torch warns when a scheduler steps on an optimizer whose step() it did not wrap, and hivemind re-creates the
    optimizer after the scheduler was built; hivemind also steps the scheduler only after an optimizer step.
    """
    if hasattr(optimizer.step, "_wrapped_by_lr_sched"):
        return
    original_step = optimizer.step

    @functools.wraps(original_step)
    def step_and_record(*args: Any, **kwargs: Any) -> Any:
        optimizer._opt_called = True
        return original_step(*args, **kwargs)

    step_and_record._wrapped_by_lr_sched = True
    optimizer.step = step_and_record
    optimizer._opt_called = True


def child_schedulers(scheduler: Any) -> Optional[list]:
    """The children of a composite scheduler (SequentialLR, ChainedScheduler), or None for a plain one."""
    return getattr(scheduler, "_schedulers", None)


def set_child_schedulers(scheduler: Any, children: list) -> None:
    """Replace a composite scheduler's children (see :func:`child_schedulers`)."""
    scheduler._schedulers = children


def configure_single_optimizer(module: torch.nn.Module):
    """(optimizer, scheduler or None) from ``module.configure_optimizers()``, in any format Lightning accepts."""
    optimizers, schedulers, _ = _configure_optimizers(module.configure_optimizers())
    if len(optimizers) != 1:
        raise ValueError(f"The swarm trains with exactly one optimizer; configure_optimizers gave {len(optimizers)}")
    configs = _configure_schedulers_automatic_opt(schedulers, None)
    if len(configs) > 1:
        raise ValueError(f"The swarm supports at most one LR scheduler; configure_optimizers gave {len(configs)}")
    return optimizers[0], (configs[0].scheduler if configs else None)


check_versions()
