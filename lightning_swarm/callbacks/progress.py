"""Show the swarm's progress in Lightning's progress bar and loggers.

HivemindStrategy adds this callback by itself (``log_progress=True``); add it yourself to change ``every_n_steps``.
Logged values: ``swarm/epoch`` (global epoch), ``swarm/peers`` (peers training in the run),
``swarm/samples_per_sec`` (the whole swarm) and ``swarm/local_samples_per_sec`` (this peer).
"""

from __future__ import annotations

from typing import Any, Optional, Protocol, runtime_checkable

import lightning.pytorch as pl
from lightning.pytorch.callbacks import Callback


@runtime_checkable
class SwarmStatus(Protocol):
    """What this callback reads from the Trainer's strategy (HivemindStrategy has it; this module does not import
    the strategy, which imports this module)."""

    optimizer: Optional[Any]  # None until training is set up
    global_epoch: int
    num_peers: int
    local_samples_per_second: float
    stats: Any  # with ``swarm_samples_per_second``


class SwarmProgress(Callback):
    """Log the swarm's global epoch, number of peers and throughput every ``every_n_steps`` local steps."""

    def __init__(self, every_n_steps: int = 1):
        if every_n_steps < 1:
            raise ValueError(f"every_n_steps must be >= 1, got {every_n_steps}")
        self.every_n_steps = every_n_steps

    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        strategy = trainer.strategy
        if not isinstance(strategy, SwarmStatus) or strategy.optimizer is None:
            return
        if batch_idx % self.every_n_steps != 0:
            return
        pl_module.log_dict(
            {
                "swarm/epoch": float(strategy.global_epoch),
                "swarm/peers": float(strategy.num_peers),
                "swarm/samples_per_sec": float(strategy.stats.swarm_samples_per_second),
                "swarm/local_samples_per_sec": float(strategy.local_samples_per_second),
            },
            prog_bar=True,
            on_step=True,
            on_epoch=False,
            batch_size=1,
        )
