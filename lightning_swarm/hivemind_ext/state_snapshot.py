"""A donor labels the state it serves with the epoch of the update it holds (overlap's delayed optimizer step).

With ``delay_optimizer_step`` a peer enters epoch K and runs the update of epoch K - 1 in the background: until that
update's optimizer step has run (after the gradient round, seconds into the epoch), its parameters and optimizer
statistics are those of epoch K - 1. hivemind 1.1.12's ``TrainingStateAverager.get_current_state`` serves them as
epoch K all the same (its ``local_epoch``), without the optimizer's lock, so a download could also catch the step
half done. A newcomer that downloaded then trained as if current, one update behind its peers for good: its state
rounds, at full weight, pulled theirs back (bench_many_peers, 16 overlapped peers: a newcomer whose loss stayed that
of the epoch before its peers', docs/notes/swarm-at-scale-measurements.md, 2026-11-29 session 34).

:class:`UpdateLabelledState` serves the state under the optimizer's lock and labels it one epoch lower for every
optimizer step the donor has begun but not run: the newcomer then knows it is behind, and catches up as after any
older download (:mod:`~lightning_swarm.hivemind_ext.catch_up`: it trains at the swarm's epoch and its next state round
merges it with weight 0).

Private names used here are listed in :data:`lightning_swarm.hivemind_ext.private_api.PRIVATE_SYMBOLS`.
"""

from __future__ import annotations

import logging
from typing import Any

log = logging.getLogger(__name__)


class UpdateLabelledState:
    """Mixin for a hivemind TrainingStateAverager (put it before that class in the bases): ``get_current_state``
    under ``lock_optimizer``, its epoch lowered by the optimizer steps this peer has begun and not yet run (module
    docstring). Counts the steps begun in :meth:`step` and those run with a step post-hook on its optimizer."""

    def __init__(self, *args, **kwargs):
        self.optimizer_steps_begun = 0  # step(optimizer_step=True) calls (main thread)
        self.optimizer_steps_run = 0  # optimizer.step() calls that returned (background thread, or main)
        super().__init__(*args, **kwargs)
        self.optimizer.register_step_post_hook(self._count_optimizer_step)

    def _count_optimizer_step(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        self.optimizer_steps_run += 1

    def step(self, *args, optimizer_step: bool = False, **kwargs):
        if optimizer_step:
            if not self._update_pending():
                # a background update that failed before its optimizer step (its trigger raised) never runs it
                self.optimizer_steps_begun = self.optimizer_steps_run
            self.optimizer_steps_begun += 1
        return super().step(*args, optimizer_step=optimizer_step, **kwargs)

    def _update_pending(self) -> bool:
        try:
            return any(not update.done() for update in list(self.pending_updates))
        except RuntimeError:  # the set changed while copied (main thread): count it as pending
            return True

    def updates_behind(self) -> int:
        """Optimizer steps this peer has begun and not run: its state is that many epochs older than its epoch."""
        if not self._update_pending():
            return 0
        return max(0, self.optimizer_steps_begun - self.optimizer_steps_run)

    def get_current_state(self):
        with self.lock_optimizer:  # not halfway through a background optimizer step
            metadata, tensors, infos = super().get_current_state()
            behind = self.updates_behind()
        if behind and isinstance(metadata, dict) and isinstance(metadata.get("epoch"), int):
            log.debug(f"serving the state of epoch {metadata['epoch'] - behind} at epoch {metadata['epoch']}: its "
                      f"update is under way in the background")
            metadata = dict(metadata, epoch=metadata["epoch"] - behind)
        return metadata, tensors, infos
