"""A newcomer trains with the swarm after one state download, however short the swarm's global steps are.

hivemind.Optimizer downloads the swarm's state when the peer's epoch is behind the swarm's
(``Optimizer._should_load_state_from_peers``), and after the download it takes the swarm's epoch only if the state
it got is at most one epoch behind. In a swarm whose global step is shorter than the download, the state is several
epochs old when it arrives: the peer downloads again, and again, and never trains (issue 25: the tiny recipe over a
50 Mbit/s link, a 145 MB state in 25 s while the swarm stepped every ~3 s).

Here (:class:`CatchUpAfterDownload`, :class:`StaleStateMerge`), once a download brought a state at most
``max_stale_epochs`` epochs behind the swarm's (fetched afresh after the download), the peer adopts the swarm's
epoch (and LR schedule) and trains from its next local step: its gradients, computed on parameters that many
epochs old, enter the swarm's next gradient rounds (bounded staleness, weighted by its samples as anyone's), and its
next state averaging round brings its parameters and optimizer statistics to its group's. It enters that round with
weight 0, so it takes its groupmates' state without pulling them back towards its older one. Until such a round
succeeded:

- it offers no state to other newcomers (its epoch would vouch for parameters it does not hold yet);
- while the swarm moves on, it follows (adopts the new epoch again) as long as the swarm is at most
  ``max_stale_epochs`` past the downloaded state's epoch; beyond, it downloads again, as hivemind would;
- if it is alone in the swarm, there is nothing to merge with: its state is the swarm's.

A peer that arrives at the swarm's epoch when it is ending (after a download or a catch-up, the swarm's samples for
it are complete: its peers' rounds are under way; after a download, also when its end is due within 1.5
``matchmaking_time``: its peers' rounds are pre-scheduled) sits that epoch out: no global step, no pre-scheduled round, its
samples accumulate, and when the swarm enters the next epoch it follows and ends that one with its peers. Stepping
at once, its round (matched per epoch, :mod:`~lightning_swarm.hivemind_ext.epoch_rounds`) found its groupmates gone;
it fell an epoch behind, caught up at the end of the next epoch, and so on (in CI a peer lost 10 epochs that way).
With hivemind's one key for gradient rounds (synchronous ones), its round joined the swarm's next one instead, so
its epoch stayed one behind the swarm's and its state rounds (matched per epoch) never met the swarm's: its stale
state was never merged (tests/lightning_swarm/test_newcomer.py). For the same reason a peer that catches up moves
its state rounds still looking for a group to the epoch it caught up to (``RoundEpochSender.move_round``).

``max_stale_epochs=0`` is hivemind's behaviour. The state rounds are ``average_state_every`` global steps apart
(default 1): the stale parameters live that long.
"""

from __future__ import annotations

import logging
import time
from typing import Any, Dict, Optional, Tuple

from hivemind.averaging.control import StepControl
from hivemind.optim.state_averager import TrainingStateAverager
from hivemind.utils import get_dht_time

log = logging.getLogger(__name__)

# Epochs a downloaded state may be behind the swarm's and still be trained on (issue 25: the tiny recipe's newcomer
# found the swarm 8 epochs ahead after its download over a 50 Mbit/s link). Its gradients enter at most the steps
# before its first state round (one, with average_state_every=1), as one peer's share of each.
DEFAULT_MAX_STALE_EPOCHS = 16


def check_max_stale_epochs(max_stale_epochs: int) -> int:
    """Return ``max_stale_epochs`` (an integer >= 0), or raise a ValueError naming it."""
    if isinstance(max_stale_epochs, bool) or not isinstance(max_stale_epochs, int) or max_stale_epochs < 0:
        raise ValueError(f"max_stale_epochs must be an integer >= 0 (0: download again whenever the swarm is more "
                         f"than one epoch ahead, as hivemind does), got {max_stale_epochs!r}")
    return max_stale_epochs


class StaleStateMerge:
    """Mixin for a hivemind TrainingStateAverager (put it before that class in the bases): a state that is older
    than the swarm's is merged into the group's at the next state round, with weight 0 (see the module docstring).

    ``stale_since`` is the epoch of the state this peer holds while it trains at a later epoch (None: its state is
    the swarm's). :meth:`hold_stale_state` starts that, a successful state round ends it.
    """

    weight_zero_merges = True  # RobustAveraging fails a weight-0 round that got part of the group's state

    def __init__(self, *args, **kwargs):
        self.stale_since: Optional[int] = None
        self.downloaded_epoch: Optional[int] = None  # the epoch of the state the last load_state_from_peers loaded
        self._merge_round: Optional[StepControl] = None  # the zero-weight state round under way
        self._shared_before_stale = False
        self.global_steps = 0  # calls that moved to the next epoch (the optimizer's global steps)
        super().__init__(*args, **kwargs)

    def load_state_from_peers(self, **kwargs):
        epoch_before, self.downloaded_epoch = self.local_epoch, None
        result = super().load_state_from_peers(**kwargs)
        if self.local_epoch != epoch_before:  # hivemind sets the donor's epoch once it loaded its state
            self.downloaded_epoch = self.local_epoch
        return result

    def hold_stale_state(self, state_epoch: int) -> None:
        """This peer now trains at a later epoch than ``state_epoch``, the epoch of its parameters: offer no state
        until a state round merged them into the group's."""
        if self.stale_since is None:
            self._shared_before_stale = self.allow_state_sharing
            if self._shared_before_stale:
                self.allow_state_sharing = False
        self.stale_since = state_epoch

    def end_stale_state(self, why: str) -> None:
        if self.stale_since is None:
            return
        log.warning(f"[lightning_swarm] state of epoch {self.stale_since} {why}: training on the swarm's state at "
                    f"epoch {self.local_epoch}")
        self.stale_since, self._merge_round = None, None
        if self._shared_before_stale:
            self.allow_state_sharing = True

    def step(self, *args, averaging_round: bool = False, averaging_control: Optional[StepControl] = None,
             averaging_opts: Optional[Dict[str, Any]] = None, **kwargs):
        # a merge round that finished is applied by this call (hivemind applies finished background rounds first)
        merge = self._merge_round
        if merge is not None and merge.done():
            self._merge_round = None
            if _merged(merge):
                self.end_stale_state("merged into its group's by a state averaging round")
            else:  # (a round that got part of the group's state fails too: RobustAveraging._check_merge_complete)
                log.info(f"[lightning_swarm] the state round that was to merge this peer's state of epoch "
                         f"{self.stale_since} failed: the next one merges it")
        self.global_steps += bool(kwargs.get("increment_epoch"))
        if averaging_round and self.stale_since is not None and self._merge_round is None:
            gather = self.local_epoch + int(bool(kwargs.get("increment_epoch")))  # as hivemind's round gathers
            averaging_control = self._zero_weight_round(averaging_control, averaging_opts or {}, gather)
            self._merge_round = averaging_control
        return super().step(*args, averaging_round=averaging_round, averaging_control=averaging_control,
                            averaging_opts=averaging_opts, **kwargs)

    def _zero_weight_round(self, control: Optional[StepControl], opts: Dict[str, Any], gather: int) -> StepControl:
        """The state round this peer enters with weight 0: the pre-scheduled one, or one started as hivemind's
        TrainingStateAverager would start it in its background step."""
        if control is not None and not (control.triggered or control.done()):
            control.weight = 0.0
            return control
        # the averager's round, as TrainingStateAverager's background step starts it (its super().step)
        return super(TrainingStateAverager, self).step(gather=gather, require_trigger=True, wait=False, weight=0.0,
                                                       **{key: value for key, value in opts.items() if key != "weight"})


def _merged(round_: StepControl) -> bool:
    """Whether a finished state round averaged with at least one other peer."""
    if round_.cancelled() or round_.exception() is not None:
        return False
    gathered = round_.result()
    return gathered is not None and len(gathered) > 1


class CatchUpAfterDownload:
    """Mixin for hivemind.Optimizer (put it before that class in the bases): after a state download, a state at
    most ``max_stale_epochs`` epochs behind the swarm's is trained on at the swarm's epoch (module docstring).

    Args:
        max_stale_epochs: how many epochs the downloaded state may be behind the swarm's (default
            :data:`DEFAULT_MAX_STALE_EPOCHS`); 0: download again whenever the swarm is more than one epoch ahead,
            as hivemind does. Needs a state averager with :class:`StaleStateMerge`.
        *args, **kwargs: as hivemind.Optimizer.
    """

    def __init__(self, *args, max_stale_epochs: int = DEFAULT_MAX_STALE_EPOCHS, **kwargs):
        self.max_stale_epochs = check_max_stale_epochs(max_stale_epochs)
        self.state_downloads = 0  # downloads that loaded a state (the tests and benchmarks count them)
        self.sat_out = 0  # epochs this peer arrived at as they ended and sat out (the tests count them)
        self._sit_out: Optional[Tuple[int, float]] = None  # (the epoch sat out, until when at most: monotonic s)
        super().__init__(*args, **kwargs)

    def load_state_from_peers(self, **kwargs) -> None:
        super().load_state_from_peers(**kwargs)
        loaded = self.state_averager.downloaded_epoch
        if loaded is None:
            return
        self.state_downloads += 1
        if self.max_stale_epochs:
            # the tracker's epoch is as old as the download (hivemind pauses its updates meanwhile): fetch it now
            self.tracker.fetch_global_progress()
            self._catch_up(loaded, after_download=True)

    def step(self, *args, **kwargs):
        averager = self.state_averager
        steps_before = averager.global_steps
        result = super().step(*args, **kwargs)
        # a global step alone has no state round to merge in (hivemind averages state only with num_peers > 1);
        # the epoch's peer count is known by then (this peer's own record included), unlike right after a download
        if averager.stale_since is not None and averager.global_steps > steps_before and self._no_other_peer():
            averager.end_stale_state("is the swarm's: this peer made a global step alone")
        return result

    def _no_other_peer(self) -> bool:
        return self.tracker.global_progress.num_peers <= 1

    def _update_global_epoch(self, grad_scaler) -> None:
        if not self._sitting_out():
            super()._update_global_epoch(grad_scaler)

    def _maybe_schedule_gradient_averaging(self) -> None:
        if not self._sitting_out():  # a round of the epoch sat out would look for groupmates who have gone
            super()._maybe_schedule_gradient_averaging()

    def _maybe_schedule_state_averaging(self) -> None:
        if not self._sitting_out():
            super()._maybe_schedule_state_averaging()

    def _sitting_out(self) -> bool:
        """Whether this peer sits out its current epoch (see the module docstring); ends with the epoch, or after
        averaging_timeout + matchmaking_time (the swarm's rounds of the epoch have ended or failed by then)."""
        if self._sit_out is None:
            return False
        epoch, until = self._sit_out
        if self.local_epoch != epoch or time.monotonic() >= until:
            self._sit_out = None
            return False
        return True

    def _sit_out_if_ending(self, after_download: bool = False) -> None:
        """Sit out the current epoch if the swarm's samples for it are complete (its peers' rounds are under way),
        or, right after a download, if its end is due within 1.5 ``matchmaking_time`` (its peers have pre-scheduled
        their rounds of the epoch: in an 8-peer test the newcomer's gradient round came too late for their group and
        searched alone until ``averaging_timeout``, while its pre-scheduled state round held their group for 14 s).
        Not when merely close to its end on a catch-up: a swarm whose epochs are shorter than ``matchmaking_time``
        (a lone peer stepping every second) then had the newcomer sit out every epoch (test_newcomer.py)."""
        progress = self.tracker.global_progress
        ending = progress.samples_accumulated >= self.tracker.target_batch_size
        if after_download and not ending:
            ending = progress.eta_next_epoch - get_dht_time() <= 1.5 * self.matchmaking_time
        others = progress.num_peers - int(getattr(self.tracker, "_counted_itself", True))
        if self.auxiliary or others < 1 or not ending:  # (a newcomer without samples has no record yet)
            return
        if self.tracker.global_epoch != self.local_epoch:
            return
        for name in ("scheduled_grads", "scheduled_state"):  # rounds pre-scheduled for an epoch this peer left
            control = getattr(self, name, None)
            if control is not None and not control.triggered and not control.done():
                control.cancel()
            setattr(self, name, None)
        self._sit_out = (self.local_epoch, time.monotonic() + (self.averaging_timeout or 0) + self.matchmaking_time)
        self.sat_out += 1
        log.warning(f"[lightning_swarm] the swarm is ending epoch {self.local_epoch} (its rounds are under way): "
                    "this peer sits it out and ends the next one with its peers (its samples count there)")

    def _should_load_state_from_peers(self) -> bool:
        should = super()._should_load_state_from_peers()
        stale_since = self.state_averager.stale_since
        if (self._sit_out is not None and self.max_stale_epochs and not self.auxiliary
                and self.tracker.global_epoch > self.local_epoch):
            # the swarm ended the epoch this peer sat out: follow it into the next one (the parameters are that
            # epoch's, merged into the group's at the next state round)
            self._sit_out = None
            return not self._catch_up(self.local_epoch if stale_since is None else stale_since)
        if stale_since is None or self.auxiliary or not self.max_stale_epochs:
            # a peer that fell behind downloads, as in hivemind: a moderator's revert is announced a few epochs ahead
            # of the swarm (lightning_swarm.monitor), and every trainer must load it, not follow its epoch
            return should
        if self.tracker.global_epoch > self.local_epoch:
            # follow the swarm at once, even one epoch behind: hivemind would let this peer end its epoch in the
            # swarm's next gradient round, and then stay one epoch behind its groupmates
            return not self._catch_up(stale_since)
        return should

    def _move_state_rounds(self, epoch: int) -> None:
        """State rounds still looking for a group under an epoch this peer has just caught up past look among the
        swarm's rounds of ``epoch`` instead: a triggered one (its global step into an earlier epoch started it) with
        the rounds its peers triggered as they entered ``epoch``, a pre-scheduled one with those of ``epoch + 1``,
        which its next global step triggers. Left under their own epoch, they found nobody (the swarm's rounds of
        that epoch had ended) and the newcomer's stale state stayed unmerged (test_newcomer.py in CI)."""
        averager = self.state_averager
        move = getattr(averager, "move_round", None)
        if move is None:
            return
        rounds = {id(control): control for control in (getattr(averager, "_merge_round", None),
                                                        getattr(self, "scheduled_state", None)) if control is not None}
        for control in rounds.values():
            move(control, epoch if control.triggered else epoch + 1)

    def _catch_up(self, state_epoch: int, after_download: bool = False) -> bool:
        """Train at the swarm's epoch on the state of ``state_epoch`` if it is at most max_stale_epochs behind;
        returns whether this peer is at the swarm's epoch now (``after_download``: see :meth:`_sit_out_if_ending`)."""
        swarm_epoch = self.tracker.global_epoch
        if swarm_epoch <= self.local_epoch:
            self._sit_out_if_ending(after_download)
            return True
        behind = swarm_epoch - state_epoch
        if behind > self.max_stale_epochs:
            log.warning(f"[lightning_swarm] the swarm is at epoch {swarm_epoch}, {behind} epochs past this peer's "
                        f"state (epoch {state_epoch}), more than max_stale_epochs={self.max_stale_epochs}: "
                        "downloading the state again")
            self.state_averager.end_stale_state("is too old")
            return False
        with self.tracker.pause_updates():
            self.state_averager.local_epoch = swarm_epoch
            self.state_averager._update_scheduler()  # the LR of the swarm's epoch
            self.state_averager.hold_stale_state(state_epoch)
            self.tracker.report_local_progress(self.local_epoch, self.tracker.local_progress.samples_accumulated)
        self._move_state_rounds(swarm_epoch)
        log.warning(f"[lightning_swarm] training at the swarm's epoch {swarm_epoch} on a state of epoch "
                    f"{state_epoch} ({behind} behind, at most max_stale_epochs={self.max_stale_epochs}): its "
                    "gradients count from now on, its next state averaging round brings it to its group's")
        self._sit_out_if_ending(after_download)
        return True
