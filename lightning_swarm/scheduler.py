"""Learning-rate schedules that advance once per global (swarm) epoch.

Lightning builds the user's scheduler on the user's optimizer and would step it every local step. Under the
swarm, hivemind re-creates the optimizer (``offload_optimizer`` keeps it on a CPU copy of the parameters) and
steps the scheduler itself whenever the swarm finishes a global epoch, also catching up after a state download
or a resume (it steps until ``scheduler._step_count == local_epoch + 1``). So we

1. re-bind a copy of the user's scheduler onto hivemind's optimizer (:func:`rebind_scheduler`), and
2. show Lightning a :class:`GlobalEpochScheduler` whose ``step()`` does nothing but whose ``state_dict`` and
   ``load_state_dict`` are the real scheduler's, so checkpoints still save and restore the schedule.
"""

from __future__ import annotations

import copy
from typing import Any, Dict, List

import torch
from torch.optim.lr_scheduler import LRScheduler, ReduceLROnPlateau

from lightning_swarm.torch_ext import child_schedulers, mark_step_tracking, set_child_schedulers


def rebind_scheduler(scheduler: LRScheduler, optimizer: torch.optim.Optimizer) -> LRScheduler:
    """A shallow copy of ``scheduler`` (same schedule, same progress) that drives ``optimizer`` instead.

    The new optimizer must have been built from the old optimizer's param groups, so the group-level keys some
    schedulers keep (``initial_lr``, OneCycleLR's ``max_lr``...) are already there.
    """
    if isinstance(scheduler, ReduceLROnPlateau):
        raise ValueError(
            "ReduceLROnPlateau can't be used with HivemindStrategy: it steps on a monitored metric, not once per "
            "global epoch. Use an epoch-based schedule (e.g. LambdaLR, CosineAnnealingLR, OneCycleLR)."
        )
    if not isinstance(scheduler, LRScheduler):
        raise ValueError(f"Unsupported LR scheduler {type(scheduler).__name__}: expected a torch LRScheduler")
    rebound = copy.copy(scheduler)
    rebound.optimizer = optimizer
    children = child_schedulers(scheduler)
    if children is not None:
        set_child_schedulers(rebound, [rebind_scheduler(child, optimizer) for child in children])
    mark_step_tracking(optimizer)
    return rebound


class GlobalEpochScheduler:
    """What Lightning sees in place of the user's scheduler: Lightning's per-step/per-epoch ``step()`` calls are
    ignored (hivemind steps the real scheduler once per global epoch); state goes to and from the real one."""

    def __init__(self, scheduler: LRScheduler, optimizer: Any):
        self.scheduler = scheduler
        self.optimizer = optimizer  # the hivemind.Optimizer, so LearningRateMonitor reads the live learning rates

    def step(self, *args: Any, **kwargs: Any) -> None:
        pass

    def state_dict(self) -> Dict[str, Any]:
        return self.scheduler.state_dict()

    def load_state_dict(self, state_dict: Dict[str, Any]) -> None:
        self.scheduler.load_state_dict(state_dict)

    def get_last_lr(self) -> List[float]:
        return self.scheduler.get_last_lr()

    def __getattr__(self, name: str) -> Any:
        # only called for attributes not found above (e.g. base_lrs, last_epoch)
        return getattr(self.__dict__["scheduler"], name)
