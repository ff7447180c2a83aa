"""Overlapping averaging rounds of many peers: each round is matched with rounds of its own epoch.

With the overlap options (``delay_optimizer_step`` / ``delay_grad_averaging`` / ``delay_state_averaging``) an averager
has several rounds under way: the next epoch's round is pre-scheduled (it looks for a group) while the current one
is still searching, waiting for its trigger or running its all-reduce. hivemind 1.1.12 matches every round of an
averager under one group key and runs one search at a time, first come first served. When the current epoch's
round has to search again (its group fell apart, or it missed it), the next epoch's round searches first, under the
same key, and can take a seat in a group of the current epoch: that group then waits for a trigger that comes one
epoch later (``next_chunk_timeout`` lost by every member), and the round that missed its group searches alone until
its deadline (``averaging_timeout``) while its peer waits for it (docs/swarm-at-scale.md has the logs).

- :class:`RoundEpochs` (averager mixin, in the averager's process): a round looks for its group under a key that
  names its epoch (``<prefix>_e<epoch>.0b<group bits>``), so rounds of different epochs never share a group. A
  triggered round's search is not cut short: it fails at its own timeout (a reverted earlier version gave it up ~2
  matchmaking times after its trigger).
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

from typing import Callable, Optional

from hivemind.averaging import DecentralizedAverager
from hivemind.averaging.control import StepControl
from hivemind.utils import get_logger
from hivemind.utils.mpfuture import MPFuture

from lightning_swarm.hivemind_ext.group_keys import MovingGroupKeyManager

# runs in hivemind's averager process: log under hivemind's logger, whose handler shows INFO beside hivemind's own
log = get_logger("hivemind.averaging.epoch_rounds")



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
    """Mixin for hivemind averager classes: rounds matched per epoch (see the module docstring). Put it before any
    mixin that overrides ``_step`` and awaits before calling hivemind's (``AuthenticatedAveraging``): the epoch sent
    before a step is read as the step begins.

    ``enabled`` (class attribute, default True): False restores hivemind's behaviour (one key for all epochs), for
    benchmarks that compare the two; set it before the averager's process starts.
    """

    group_key_manager_class = EpochGroupKeyManager  # read by MovingGroupKeys
    enabled = True

    async def _set_round_epoch(self, epoch: Optional[int]) -> None:
        """(averager process) The epoch of the round whose ``_step`` comes next through the pipe.

        Args:
            epoch: the epoch of that round, or None (hivemind's one key).
        """
        self.__dict__["_next_round_epoch"] = epoch

    async def _step(self, *, step: StepControl, future_for_init: MPFuture):
        # read before any await: the trainer sends the epoch right before the step, and the next epoch only with
        # the next step
        step.round_epoch = self.__dict__.pop("_next_round_epoch", None) if self.enabled else None
        return await super()._step(step=step, future_for_init=future_for_init)


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
