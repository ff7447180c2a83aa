"""Overlapping averaging rounds of many peers: each round is matched with rounds of its own epoch, and a triggered
round that has no group gives up instead of holding its peer (and the groups it would join) back.

With the overlap options (``delay_optimizer_step`` / ``delay_grad_averaging`` / ``delay_state_averaging``) an averager
has several rounds under way: the next epoch's round is pre-scheduled (it looks for a group) while the current one
is still searching, waiting for its trigger or running its all-reduce. hivemind 1.1.12 matches every round of an
averager under one group key and runs one search at a time, first come first served. When the current epoch's
round has to search again (its group fell apart, or it missed it), the next epoch's round searches first, under the
same key, and can take a seat in a group of the current epoch: that group then waits for a trigger that comes one
epoch later (``next_chunk_timeout`` lost by every member), and the round that missed its group searches alone until
its deadline (``averaging_timeout``) while its peer waits for it (docs/swarm-at-scale.md has the logs).

- :class:`RoundEpochs` (averager mixin, in the averager's process): a round looks for its group under a key that
  names its epoch (``<prefix>_e<epoch>.0b<group bits>``), so rounds of different epochs never share a group. It also
  bounds the search of a round that was triggered but has no group: at
  ``max(scheduled time, trigger + min_matchmaking_time) + min_matchmaking_time`` the round is cancelled (its peer
  goes on with its local gradients or parameters, as after any failed round) and logged; without the bound it
  searches until ``averaging_timeout`` and its peer's next trigger is that much late.
- :class:`RoundEpochSender` (averager base, in the trainer's process): tells the averager's process the epoch of the
  round each ``step`` starts: the ``gather`` of a state round (hivemind gathers the epoch there), or what
  ``round_epoch()`` says (the optimizer sets it for gradient rounds). It must come after hivemind's
  GradientAverager / TrainingStateAverager in the class's bases, whose ``schedule_step``/``_do`` call
  ``DecentralizedAverager.step`` through ``super()``.
- :class:`EpochGroupKeyManager`: the group key with the epoch of the round being matched (see ``group_keys``, which
  switches the key manager's class).

Every peer of a run must use the same keys: a peer of an older lightning_swarm (one key for all epochs) and a peer
with this module never share a group.
"""

from __future__ import annotations

import asyncio
from typing import Callable, Optional

from hivemind.averaging import DecentralizedAverager
from hivemind.averaging.control import AveragingStage, StepControl
from hivemind.utils import get_dht_time, get_logger
from hivemind.utils.mpfuture import MPFuture

from lightning_swarm.hivemind_ext.group_keys import MovingGroupKeyManager

# runs in hivemind's averager process: log under hivemind's logger, whose handler shows INFO beside hivemind's own
log = get_logger("hivemind.averaging.epoch_rounds")

# how often a triggered round's search is checked against its deadline
UNMATCHED_POLL_SECONDS = 0.1
# the line logged when a triggered round that found no group is given up (benchmarks count it)
UNMATCHED_ROUND_LINE = "found no group by its deadline after its trigger"


def epoch_group_prefix(prefix: str, epoch: Optional[int]) -> str:
    """The group key prefix of a round of ``epoch`` (``prefix`` itself when the epoch is unknown)."""
    return prefix if epoch is None else f"{prefix}_e{int(epoch)}"


class EpochGroupKeyManager(MovingGroupKeyManager):
    """MovingGroupKeyManager whose key names the epoch of the round being matched (the ``round_epoch`` that
    :class:`RoundEpochs` put on the matchmaking's ``step_control``); the group bits move as before."""

    @property
    def current_key(self) -> str:
        matchmaking = getattr(self, "matchmaking", None)
        step = getattr(matchmaking, "step_control", None)
        epoch = getattr(step, "round_epoch", None)
        return f"{epoch_group_prefix(self.prefix, epoch)}.0b{self.group_bits}"


class RoundEpochs:
    """Mixin for hivemind averager classes: rounds matched per epoch, triggered rounds without a group given up (see
    the module docstring). Put it before any mixin that overrides ``_step`` and awaits before calling hivemind's
    (``AuthenticatedAveraging``): the epoch sent before a step is read as the step begins.

    ``unmatched_round_grace`` (class attribute, in units of ``min_matchmaking_time``, default 1): how long a triggered
    round may search beyond ``max(scheduled time, trigger + min_matchmaking_time)``. ``enabled`` (class attribute,
    default True): False restores hivemind's behaviour (one key for all epochs, no bound), for benchmarks that
    compare the two; set it before the averager's process starts.
    """

    group_key_manager_class = EpochGroupKeyManager  # read by MovingGroupKeys
    unmatched_round_grace = 1.0
    enabled = True

    async def _set_round_epoch(self, epoch: Optional[int]) -> None:
        """(averager process) The epoch of the round whose ``_step`` comes next through the pipe."""
        self.__dict__["_next_round_epoch"] = epoch

    async def _step(self, *, step: StepControl, future_for_init: MPFuture):
        # read before any await: the trainer sends the epoch right before the step, and the next epoch only with
        # the next step
        step.round_epoch = self.__dict__.pop("_next_round_epoch", None)
        if not self.enabled:
            step.round_epoch = None
            return await super()._step(step=step, future_for_init=future_for_init)
        watchdog = asyncio.create_task(self._give_up_if_unmatched(step))
        try:
            return await super()._step(step=step, future_for_init=future_for_init)
        finally:
            watchdog.cancel()

    async def _give_up_if_unmatched(self, step: StepControl) -> None:
        """Cancel ``step`` if it was triggered and is still looking for a group past its deadline."""
        min_matchmaking_time = self.matchmaking_kwargs["min_matchmaking_time"]
        while step._trigger is None or not step.triggered:  # attached by hivemind's _step
            if step.done():
                return
            await asyncio.sleep(UNMATCHED_POLL_SECONDS)
        triggered_at = get_dht_time()
        deadline = (max(step.scheduled_time, triggered_at + min_matchmaking_time)
                    + self.unmatched_round_grace * min_matchmaking_time)
        while not step.done() and step.stage in (AveragingStage.IDLE, AveragingStage.LOOKING_FOR_GROUP):
            if get_dht_time() >= deadline:
                log.info(f"{self.prefix}: the round of epoch {step.round_epoch} {UNMATCHED_ROUND_LINE} "
                         f"({get_dht_time() - triggered_at:.1f} s after it): giving it up")
                # the step's own future only: its owner (the trainer's process) then cancels it as a user's cancel
                # does, which also wakes hivemind's _step here (StepControl.cancel from this side would set the
                # cancel future twice, and the owner's update would fail)
                MPFuture.cancel(step)
                return
            await asyncio.sleep(UNMATCHED_POLL_SECONDS)


class RoundEpochSender(DecentralizedAverager):
    """Base for hivemind averager classes (after GradientAverager / TrainingStateAverager in the bases): each round
    started by ``step`` (also through ``schedule_step``) is announced to the averager's process with its epoch.

    ``round_epoch`` (attribute, set in the trainer's process): a callable giving the epoch of the round about to be
    started, or None: then the ``gather`` of the step, if it is an epoch number (as hivemind's state rounds gather).
    """

    round_epoch: Optional[Callable[[], Optional[int]]] = None

    def step(self, gather=None, *args, **kwargs):
        epoch = self.round_epoch() if self.round_epoch is not None else None
        if epoch is None and isinstance(gather, int) and not isinstance(gather, bool):
            epoch = gather
        if self.is_alive() and hasattr(self, "_set_round_epoch"):  # RoundEpochs receives it
            self._outer_pipe.send(("_set_round_epoch", [], dict(epoch=epoch)))
        return super().step(gather, *args, **kwargs)
