"""The LR schedule of the recipes: linear warm-up to the peak, then a linear or cosine decay (or a constant LR).

One definition for every recipe (the DALL-E and CLIP modules both build their scheduler here). Under
HivemindStrategy a step is a global (swarm) step: hivemind steps the scheduler once per global epoch
(:mod:`lightning_swarm.scheduler`), so ``warmup_steps`` and ``decay_steps`` count global steps.

The multiplier of the peak LR at step ``s`` (0-based, the number of steps already taken)::

    s < warmup_steps:                  (s + 1) / warmup_steps           the peak is reached after warmup_steps steps
    no decay (decay_steps None):       1
    p = min(1, (s - warmup_steps) / decay_steps)
    linear:                            min_lr_ratio + (1 - min_lr_ratio) * (1 - p)
    cosine:                            min_lr_ratio + (1 - min_lr_ratio) * (1 + cos(pi * p)) / 2

The seed run (Training Transformers Together) used linear over 31,250 global steps with 10% warm-up:
``warmup_steps=3125, decay_steps=28125, decay="linear", min_lr_ratio=0``.
"""

from __future__ import annotations

import math
from typing import Optional

import torch
from torch.optim.lr_scheduler import LambdaLR

DECAY_SHAPES = ("cosine", "linear")


def check_schedule(warmup_steps: int, decay_steps: Optional[int], decay: str, min_lr_ratio: float) -> None:
    """Raise a ValueError naming the bad argument (see :func:`lr_multiplier` for their meaning)."""
    if isinstance(warmup_steps, bool) or not isinstance(warmup_steps, int) or warmup_steps < 0:
        raise ValueError(f"warmup_steps must be an integer >= 0, got {warmup_steps!r}")
    if decay_steps is not None and (isinstance(decay_steps, bool) or not isinstance(decay_steps, int)
                                    or decay_steps <= 0):
        raise ValueError(f"decay_steps must be a positive integer (or None for a constant LR), got {decay_steps!r}")
    if decay not in DECAY_SHAPES:
        raise ValueError(f"decay must be one of {DECAY_SHAPES}, got {decay!r}")
    if not 0.0 <= min_lr_ratio <= 1.0:
        raise ValueError(f"min_lr_ratio must lie in [0, 1], got {min_lr_ratio}")


def lr_multiplier(step: int, warmup_steps: int, decay_steps: Optional[int], decay: str = "cosine",
                  min_lr_ratio: float = 0.1) -> float:
    """The fraction of the peak LR used at ``step`` (the number of optimizer steps already taken).

    Args:
        step: optimizer (global) steps taken so far, from 0.
        warmup_steps: steps of linear warm-up from ``1 / warmup_steps`` to the peak (0: start at the peak).
        decay_steps: steps of decay after the warm-up; None keeps the peak LR after the warm-up.
        decay: ``"linear"`` or ``"cosine"``: the shape of the decay.
        min_lr_ratio: the LR at the end of the decay (and after it), as a fraction of the peak.
    """
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    if decay_steps is None:
        return 1.0
    progress = min(1.0, (step - warmup_steps) / decay_steps)
    remaining = 1.0 - progress if decay == "linear" else 0.5 * (1.0 + math.cos(math.pi * progress))
    return min_lr_ratio + (1.0 - min_lr_ratio) * remaining


def warmup_decay_scheduler(optimizer: torch.optim.Optimizer, warmup_steps: int, decay_steps: Optional[int],
                           decay: str = "cosine", min_lr_ratio: float = 0.1) -> LambdaLR:
    """A LambdaLR on ``optimizer`` following :func:`lr_multiplier` (arguments as there), validated first.

    The multiplier is a plain function, so checkpoints store only the step count: a resumed run follows the
    schedule of its current config.
    """
    check_schedule(warmup_steps, decay_steps, decay, min_lr_ratio)

    def multiplier(step: int) -> float:
        return lr_multiplier(step, warmup_steps, decay_steps, decay, min_lr_ratio)

    return LambdaLR(optimizer, multiplier)
