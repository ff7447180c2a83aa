"""SwarmOptimizer: hivemind.Optimizer with the background work of a peer cut to what the swarm needs.

Each hivemind peer runs a DHT process and two averager processes next to training. Left as they are, they take a
good part of a CPU core even when the peer is alone, which costs training throughput wherever cores are scarce.
SwarmOptimizer changes these things and nothing else:
- progress is published through :class:`~lightning_swarm.hivemind_ext.tracker.ThrottledProgressTracker` (not a
  DHT store on every local step);
- both averagers search for groups through
  :class:`~lightning_swarm.hivemind_ext.matchmaking.ThrottledLeaderSearch` (not a DHT poll loop without pause);
- a peer alone in the run does not pre-schedule averaging rounds: there is no one to find, and hivemind would only
  search until it cancels the round at the end of the epoch;
- in a swarm, state averaging rounds are pre-scheduled like gradient rounds (hivemind 1.1.12 never does, see
  ``_maybe_schedule_state_averaging``), so their group is ready when the epoch ends;
- overlapping rounds (the overlap options ``delay_optimizer_step`` / ``delay_grad_averaging`` /
  ``delay_state_averaging``): while they are in force each gradient round is matched with rounds of its own epoch
  (:mod:`~lightning_swarm.hivemind_ext.epoch_rounds`; state rounds always are, synchronous gradient rounds use
  hivemind's one key), and a groupmate's part that arrives before its group is
  registered waits for it (:mod:`~lightning_swarm.hivemind_ext.round_groups`);
  they apply while the swarm has at most ``overlap_max_peers`` peers (default 8; None: any size), synchronous rounds
  beyond;
  docs/swarm-at-scale.md has the measurements;
- a round (matched per epoch) still looking for a group once the swarm went past its epoch is given up after a
  matchmaking window (:class:`~lightning_swarm.hivemind_ext.epoch_rounds.LateRounds`), and a peer that arrives at an
  epoch as it ends sits it out (:mod:`~lightning_swarm.hivemind_ext.catch_up`);
- a gradient round that failed leaves the peer its own gradient for its step (hivemind 1.1.12 stepped on the
  accumulators its ``GradientAverager.step`` had zeroed as the round began: the epoch's samples were lost);
- a peer whose synchronous gradient round met its groupmates' next round (synchronous rounds share one key) takes
  their epoch for its step, so that its state round meets theirs (each gradient round gathers its epoch);
- a newcomer's state download is verified, logged and retried, and skips the gradient buffers
  (:mod:`~lightning_swarm.hivemind_ext.state_download`); its retries end when ``stop_waiting()`` says so; a state at
  most ``max_stale_epochs`` behind the swarm's is trained on (:mod:`~lightning_swarm.hivemind_ext.catch_up`);
- ``client_mode`` left to None is the DHT's (hivemind 1.1.12 keeps None, and a client-mode peer then dies at its
  first global step setting a state sharing priority its averagers refuse);
- the process keeps its Ctrl+C: hivemind's averagers set SIGINT to "ignore" in the process that starts them (so that
  their children ignore it), which left a training peer, or a notebook's kernel, deaf to Ctrl+C and Jupyter's
  interrupt; the handler is put back once they started (their children still ignore it, and the trainer's
  shutdown stops them).
"""

from __future__ import annotations

import functools
import logging
import signal
import threading
import weakref
from typing import Callable, Optional

import hivemind
from hivemind.optim.progress_tracker import ProgressTracker
from hivemind.optim.state_averager import TrainingStateAverager

from lightning_swarm.hivemind_ext.auth_guards import AuthenticatedAveraging, EpochGuard
from lightning_swarm.hivemind_ext.catch_up import CatchUpAfterDownload, StaleStateMerge
from lightning_swarm.hivemind_ext.credentials import PeerCredentials
from lightning_swarm.hivemind_ext.epoch_rounds import LateRounds, RoundEpochs, RoundEpochSender
from lightning_swarm.hivemind_ext.finite_state import FiniteStateDownload
from lightning_swarm.hivemind_ext.gathered_checks import CheckedGatheredData
from lightning_swarm.hivemind_ext.grad_averager import SampleWeightedGradientAverager
from lightning_swarm.hivemind_ext.group_keys import MovingGroupKeys
from lightning_swarm.hivemind_ext.lifetime import DiesWithParent
from lightning_swarm.hivemind_ext.matchmaking import ThrottledLeaderSearch
from lightning_swarm.hivemind_ext.state_download import NoStateDownload, StateDownloadStopped, VerifiedStateDownload
from lightning_swarm.hivemind_ext.state_serving import GuardedStateServing
from lightning_swarm.hivemind_ext.state_snapshot import UpdateLabelledState
from lightning_swarm.hivemind_ext.robust_allreduce import RobustAveraging
from lightning_swarm.hivemind_ext.round_groups import PatientGroupRegistration
from lightning_swarm.hivemind_ext.weight_bounds import ProgressBoundedWeights
from lightning_swarm.hivemind_ext.tracker import ThrottledProgressTracker

log = logging.getLogger(__name__)

# the largest swarm in which the overlap options were measured not to lose to synchronous rounds (since a handler's last
# message is no longer lost at its close, stream_ends): 8 simulated peers, half in client mode, churn, 0.91 and 0.93 of
# ideal against 0.87 and 0.73 synchronous; at 16 with 15 s epochs overlapped rounds still fell apart (0.49 against 0.77:
# a state round's members start its all-reduce when their own gradient round ends, seconds apart, and the next epoch
# waits for it), with 30 s epochs they held (0.87 and 0.90 against 0.76) (docs/swarm-at-scale.md)
DEFAULT_OVERLAP_MAX_PEERS = 8
# a triggered state round still looking for a group after this many matchmaking windows is given up (LateRounds)
STATE_SEARCH_WINDOWS = 2
# the two measured delays before a state round (SwarmOptimizer._bound_state_round_delays) together at most this share
# of matchmaking_time: the round is then pre-scheduled at least the rest of matchmaking_time before the epoch's end
STATE_DELAY_SHARE = 0.5
OVERLAP_OPTIONS = ("delay_optimizer_step", "delay_grad_averaging", "delay_state_averaging")


def check_overlap_max_peers(overlap_max_peers: Optional[int]) -> Optional[int]:
    """Return ``overlap_max_peers`` (a positive number of peers, or None), or raise a ValueError naming it."""
    if overlap_max_peers is not None and (isinstance(overlap_max_peers, bool) or not isinstance(overlap_max_peers, int)
                                          or overlap_max_peers < 1):
        raise ValueError(f"overlap_max_peers must be a positive number of peers or None, got {overlap_max_peers!r}")
    return overlap_max_peers


def _weak_call(method, default):
    """A callable that calls the bound ``method`` while its object lives, and returns ``default`` after."""
    reference = weakref.WeakMethod(method)

    def call():
        alive = reference()
        return default if alive is None else alive()
    return call


class HivemindRpcNames:
    """Mixin for subclasses of hivemind averagers: serve and call RPCs under the hivemind class's name.

    hivemind names every RPC handler after the servicer's class (``"<prefix>::TrainingStateAverager.rpc_download_state"``),
    so a subclass under its own name could not talk to peers that run hivemind's own classes.
    """

    @classmethod
    def _get_handle_name(cls, namespace, method_name: str) -> str:
        hivemind_class = next(k for k in cls.__mro__ if k.__module__.startswith("hivemind."))
        return hivemind_class._get_handle_name(namespace, method_name)


class SwarmGradientAverager(DiesWithParent, HivemindRpcNames, RoundEpochs, AuthenticatedAveraging, CheckedGatheredData,
                            GuardedStateServing, PatientGroupRegistration, MovingGroupKeys, ThrottledLeaderSearch,
                            ProgressBoundedWeights, SampleWeightedGradientAverager, RoundEpochSender, NoStateDownload):
    """Gradient averager of a SwarmOptimizer: mean over samples, throttled leader search (``leader_poll_interval``),
    groupmates' parts wait for their group to be registered (:mod:`~lightning_swarm.hivemind_ext.round_groups`),
    screened all-reduce (``aggregation``, ``centered_clip_tau``, ``centered_clip_iters``,
    ``centered_clip_min_alignment``; each sender's weight at most the samples in its progress record, read from
    ``progress_key``: in an overlapped round, its samples of the round's epoch), no non-finite gradient sent, and a
    newcomer does not download the donor's gradient buffers (they are reset right after), its own are served to at
    most ``max_state_downloads`` requesters at once, one download each
    (:mod:`~lightning_swarm.hivemind_ext.state_serving`); in a run with an authority only authenticated peers share a
    group and download state (``swarm_auth``); a member's malformed gathered data does not fail the round
    (:mod:`~lightning_swarm.hivemind_ext.gathered_checks`); its process dies with the trainer
    (:mod:`~lightning_swarm.hivemind_ext.lifetime`)."""


class SwarmStateAverager(DiesWithParent, HivemindRpcNames, RoundEpochs, AuthenticatedAveraging, CheckedGatheredData,
                         GuardedStateServing, PatientGroupRegistration, MovingGroupKeys, ThrottledLeaderSearch,
                         StaleStateMerge, UpdateLabelledState, RobustAveraging, TrainingStateAverager, RoundEpochSender,
                         FiniteStateDownload, VerifiedStateDownload):
    """State averager of a SwarmOptimizer: hivemind's TrainingStateAverager with a throttled leader search,
    groupmates' parts that wait for their group to be registered (:mod:`~lightning_swarm.hivemind_ext.round_groups`),
    a screened all-reduce (every peer has weight 1 in state averaging: ``max_sender_weight=1``), a verified, retried
    state download (``state_download_attempts``) and no non-finite downloaded state, its own state served to at most
    ``max_state_downloads`` requesters at once, one download each, and a member's malformed gathered data does not fail
    the round; in a run with an authority, groups of authenticated peers only, state from plausible donors (or the one
    a moderator's revert names) and to token holders only; its process dies with the trainer
    (:mod:`~lightning_swarm.hivemind_ext.lifetime`); a downloaded state older than the swarm's is merged into the
    group's at the next state round (:mod:`~lightning_swarm.hivemind_ext.catch_up`); the state it serves is labelled
    with the epoch of the update it holds (:mod:`~lightning_swarm.hivemind_ext.state_snapshot`)."""

    def __init__(self, *args, **kwargs):
        kwargs.setdefault("max_sender_weight", 1.0)
        # parameters and optimizer state all go along their average: the alignment screen is for gradients
        kwargs.pop("centered_clip_min_alignment", None)
        super().__init__(*args, **kwargs)


class GuardedProgressTracker(EpochGuard, ThrottledProgressTracker):
    """ThrottledProgressTracker that, in a run with an authority, ignores epochs no other peer confirms."""


class SwarmOptimizer(CatchUpAfterDownload, hivemind.Optimizer):
    """hivemind.Optimizer (same arguments) with less background CPU, see the module docstring.

    ``tracker_opts`` may set ``min_report_interval`` (see ThrottledProgressTracker); ``averager_opts`` and the
    ``grad_averager_factory`` may set ``leader_poll_interval`` (see ThrottledLeaderSearch). The default gradient
    averager is :class:`SwarmGradientAverager`. ``robust_averaging_opts`` (``aggregation``, ``centered_clip_tau``,
    ``centered_clip_iters``) configure the state averager's all-reduce (see RobustAveraging); give the gradient
    averager's through ``grad_averager_factory``. ``swarm_auth`` (a :class:`~lightning_swarm.hivemind_ext.credentials.PeerCredentials`
    such as :class:`~lightning_swarm.auth.peer.SwarmAuth`, in a run with an authority) is handed to the tracker and both averagers (see
    :mod:`lightning_swarm.hivemind_ext.auth_guards`); the DHT must have been created with its authorizer.
    ``overlap_max_peers`` (default 8; None: no limit): if ``delay_optimizer_step`` or ``delay_grad_averaging`` is on,
    they (and ``delay_state_averaging``, if on) apply while the swarm has at most this many peers; in a larger
    swarm this peer averages synchronously, and says so in the log when it switches. ``client_mode`` left out (or
    None) is the DHT's, as hivemind documents but 1.1.12 does not do. ``max_stale_epochs``: a downloaded state that
    many epochs behind the swarm's, or fewer, is trained on at the swarm's epoch (see
    :mod:`~lightning_swarm.hivemind_ext.catch_up`).
    """

    def __init__(self, *args, grad_averager_factory=SwarmGradientAverager, robust_averaging_opts=None,
                 swarm_auth: Optional[PeerCredentials] = None,
                 overlap_max_peers: Optional[int] = DEFAULT_OVERLAP_MAX_PEERS, **kwargs):
        self.overlap_max_peers = check_overlap_max_peers(overlap_max_peers)
        if kwargs.get("client_mode") is None and kwargs.get("dht") is not None:
            # hivemind 1.1.12 keeps None here (its condition is inverted): a client-mode peer would then set a state
            # sharing priority at its first global step, which its averagers refuse with a ValueError
            kwargs["client_mode"] = kwargs["dht"].client_mode
        self.robust_averaging_opts = dict(robust_averaging_opts or {})  # read by _make_state_averager in super()
        self.swarm_auth = swarm_auth  # read by the factories below, which hivemind calls from its __init__
        if swarm_auth is not None and grad_averager_factory is not None:  # None: local updates, no such averager
            grad_averager_factory = functools.partial(grad_averager_factory, swarm_auth=swarm_auth)
        in_main_thread = threading.current_thread() is threading.main_thread()  # signal handlers live there only
        interrupt_handler = signal.getsignal(signal.SIGINT) if in_main_thread else None
        try:
            super().__init__(*args, grad_averager_factory=grad_averager_factory, **kwargs)
        finally:
            if interrupt_handler is not None and signal.getsignal(signal.SIGINT) is not interrupt_handler:
                signal.signal(signal.SIGINT, interrupt_handler)  # hivemind's averagers set SIG_IGN (module docstring)
        if isinstance(self.grad_averager, RoundEpochSender):  # its rounds are matched with rounds of their epoch
            self.grad_averager.round_epoch = self._next_epoch  # (state rounds always, gradient rounds when overlapped)
            self.grad_averager.epoch_keys = self._rounds_matched_per_epoch
        if isinstance(self.grad_averager, ProgressBoundedWeights) and hasattr(self.tracker, "epoch_counts"):
            # an overlapped round bounds its senders by their counts of its epoch, which the tracker has read
            self.grad_averager.round_counts = self.tracker.epoch_counts
        # a round of an epoch the swarm has finished finds nobody: give it up after a matchmaking window
        # (through a weak reference: the thread must not keep a dropped optimizer, and its averagers, alive)
        self.late_rounds = LateRounds(_weak_call(self._peek_global_epoch, default=-1), grace=self.matchmaking_time)
        weakref.finalize(self, self.late_rounds.stop)
        self.late_rounds.start()
        for averager in (self.grad_averager, self.state_averager):
            if isinstance(averager, RoundEpochSender):
                averager.on_round = self.late_rounds.watch
        if isinstance(self.state_averager, RoundEpochSender):  # a state round that finds nobody soon is given up
            self.state_averager.on_round = functools.partial(
                self.late_rounds.watch, search_limit=STATE_SEARCH_WINDOWS * self.matchmaking_time)
        self.requested_overlap = {name: getattr(self, name) for name in OVERLAP_OPTIONS}  # as configured
        self.download_abandoned: Optional[str] = None  # why a state download was abandoned (see stop_waiting)
        self.overlapping = True  # whether the requested overlap options are in force
        self.state_delays_bounded = False  # whether _bound_state_round_delays has scaled the delays down yet

    @property
    def stop_waiting(self) -> Optional[Callable[[], Optional[str]]]:
        """A callable giving why this peer should stop (its trainer got SIGTERM, reached max_time...) or None: a state
        download in progress is then abandoned, see :meth:`load_state_from_peers`."""
        return self.state_averager.stop_waiting

    @stop_waiting.setter
    def stop_waiting(self, check: Optional[Callable[[], Optional[str]]]) -> None:
        self.state_averager.stop_waiting = check

    def load_state_from_peers(self, **kwargs) -> None:
        """hivemind's (which retries forever), abandoned when ``stop_waiting()`` gives a reason: then nothing is
        loaded, ``download_abandoned`` holds the reason and the caller should stop training."""
        try:
            super().load_state_from_peers(**kwargs)
        except StateDownloadStopped as e:
            log.warning(f"[lightning_swarm] {e}")
            self.download_abandoned = str(e)

    def shutdown(self) -> None:
        late_rounds = self.__dict__.get("late_rounds")
        if late_rounds is not None:
            late_rounds.stop()
        super().shutdown()

    def step(self, *args, **kwargs):
        self._choose_overlap()
        return super().step(*args, **kwargs)

    def _choose_overlap(self) -> None:
        """Turn the requested overlap options off while the swarm has more than overlap_max_peers peers, on again
        when it shrinks (hivemind reads them at every step)."""
        requested = [name for name, value in self.requested_overlap.items() if value]
        delayed = self.requested_overlap["delay_optimizer_step"] or self.requested_overlap["delay_grad_averaging"]
        if self.overlap_max_peers is None or not delayed or self.auxiliary or not self.use_gradient_averaging:
            # delay_state_averaging alone (hivemind's default) is left as it is: it was not measured to misbehave;
            # with local updates, hivemind built the state averager for the configured delays
            return
        num_peers = max(1, self.tracker.global_progress.num_peers)  # 0 until the first progress fetch
        overlap = num_peers <= self.overlap_max_peers
        if overlap == self.overlapping:
            return
        if not overlap:  # the rounds under way in the background finish first; this step applies their results
            self.state_averager.step(wait_for_delayed_updates=True)
        for name in requested:
            setattr(self, name, overlap)
        self.overlapping = overlap
        if overlap:
            log.warning(f"[lightning_swarm] {num_peers} peer(s) in the swarm: {', '.join(requested)} on again "
                        f"(they apply while the swarm has at most overlap_max_peers={self.overlap_max_peers} peers)")
        else:
            log.warning(f"[lightning_swarm] {num_peers} peers in the swarm: averaging synchronously, "
                        f"{', '.join(requested)} off while the swarm has more than overlap_max_peers="
                        f"{self.overlap_max_peers} peers")

    def _make_progress_tracker(self, target_batch_size: int, **kwargs) -> ProgressTracker:
        return GuardedProgressTracker(
            swarm_auth=self.swarm_auth,
            dht=self.dht,
            prefix=self.run_id,
            target_batch_size=target_batch_size,
            client_mode=self.client_mode,
            status_loglevel=self.status_loglevel,
            start=True,
            **kwargs,
        )

    def _make_state_averager(self, **kwargs) -> TrainingStateAverager:
        # hivemind 1.1.12's arguments, with our class (hivemind hard-codes TrainingStateAverager here)
        return SwarmStateAverager(
            swarm_auth=self.swarm_auth,
            dht=self.dht,
            prefix=f"{self.run_id}_state_averager",
            min_matchmaking_time=self.matchmaking_time,
            allreduce_timeout=self.allreduce_timeout,
            shutdown_timeout=self.shutdown_timeout,
            offload_optimizer=self.offload_optimizer,
            custom_gradients=self.offload_optimizer,
            status_loglevel=self.status_loglevel,
            next_chunk_timeout=self.next_chunk_timeout,
            client_mode=self.client_mode,
            auxiliary=self.auxiliary,
            start=True,
            **self.robust_averaging_opts,
            **kwargs,
        )

    def _rounds_matched_per_epoch(self) -> bool:
        """Whether this peer's gradient rounds are matched per epoch now: while the overlap options that put several
        rounds under way are in force (``delay_grad_averaging`` / ``delay_optimizer_step``, as ``_choose_overlap``
        set them). Synchronous gradient rounds use hivemind's one key: a peer one epoch behind still finds its
        groupmates (in the swarm's next round, its gradients one step stale). State rounds are always matched per
        epoch: parameters of different epochs averaged together put a peer a step ahead of its epoch (an 8-peer
        test's newcomer, whose state round joined the swarm's next one)."""
        return bool(self.delay_grad_averaging or self.delay_optimizer_step)

    def _load_local_gradients_into_optimizer(self) -> None:
        averager = self.grad_averager
        if averager is not None and averager._new_averaged_grads:
            # a round was begun with this epoch's gradient and failed: hivemind's GradientAverager.step zeroed the
            # accumulators as it began the round, and reloading them (hivemind's fallback) applied a zero gradient:
            # the peer's whole epoch of samples was lost. The averager's buffers still hold its gradient (where the
            # round completed a part before failing, the group's result for it)
            hivemind.optim.optimizer.logger.log(
                self.status_loglevel, "Proceeding with local gradients (kept in the averager: its round failed)")
            self._load_averaged_gradients_into_optimizer_()
            return
        super()._load_local_gradients_into_optimizer()

    def _average_gradients_and_load_into_optimizer(self, maybe_step_control) -> None:
        super()._average_gradients_and_load_into_optimizer(maybe_step_control)
        if maybe_step_control is not None and not self._rounds_matched_per_epoch():
            self._follow_group_epoch(maybe_step_control)

    def _follow_group_epoch(self, control) -> None:
        """After a synchronous gradient round whose groupmates' rounds led one epoch further than this peer's (each
        member gathers its round's epoch, ``RoundEpochSender``), take their epoch for this global step: its LR, and
        the state round that follows (matched per epoch), which then meets theirs and merges the parameters.

        Synchronous gradient rounds share one key across epochs, so a peer whose round missed its group (or left it)
        finds the group of its peers' *next* round; ending its own epoch there, it stayed one epoch behind them for
        good, its state rounds never meeting theirs (test_byzantine_swarm.py's nan case: two honest peers one round
        out of step for the rest of the run, one 30% above the other's loss). At most one epoch per round: a member
        claiming more is not followed (a peer further behind downloads the state, as in hivemind)."""
        if not control.done() or control.cancelled() or control.exception() is not None:
            return
        gathered = control.result()
        if not isinstance(gathered, dict):
            return
        ours = self.local_epoch + 1  # the epoch this global step leads to, as this peer's round gathered it
        claims = [epoch for epoch in gathered.values()
                  if isinstance(epoch, int) and not isinstance(epoch, bool)]
        if ours + 1 not in claims:
            return
        averager = self.state_averager
        averager.local_epoch = ours  # the step below increments it to the group's
        averager._update_scheduler()  # the LR of the group's epoch
        if self.scheduled_state is not None and isinstance(averager, RoundEpochSender):
            averager.move_round(self.scheduled_state, ours + 1)
        log.warning(f"[lightning_swarm] this peer's gradient group ended epoch {ours}, one past this peer's: it "
                    f"follows (its next epoch is {ours + 1})")

    def _peek_global_epoch(self) -> int:
        peek = getattr(self.tracker, "peek_global_epoch", None)  # (a tracker of hivemind's own class has none)
        return peek() if peek is not None else self.tracker.global_epoch

    def _next_epoch(self) -> int:
        """The epoch this peer's next global step leads to (as hivemind's ``_update_global_epoch`` computes it)."""
        return max(self.local_epoch + 1, self.tracker.global_epoch)

    @property
    def _alone(self) -> bool:
        return self.tracker.global_progress.num_peers <= 1

    def _maybe_schedule_gradient_averaging(self) -> None:
        if not self._alone:  # if a peer joins later, the epoch's end starts the round at once instead
            super()._maybe_schedule_gradient_averaging()

    def _maybe_schedule_state_averaging(self) -> None:
        if self._alone:  # hivemind averages state only when num_peers > 1 anyway
            return
        self._bound_state_round_delays()
        if self.delay_before_state_averaging.num_updates == 0:
            # hivemind 1.1.12 pre-schedules state averaging only once it has measured the delay between an epoch's
            # end and its state averaging step, and measures that delay only after a pre-scheduled round: so it
            # never pre-schedules one. Every state round then searches for a group only after the epoch ended
            # (at least matchmaking_time), and a peer whose round ends late waits for it at its next epoch.
            # The delay is a few milliseconds (the gradient round is started in between); seed it with zero.
            self.delay_before_state_averaging.update(task_size=1, interval=0.0)
        super()._maybe_schedule_state_averaging()

    def _bound_state_round_delays(self) -> None:
        """Keep the delays hivemind adds to an epoch's end to pre-schedule a state round below
        ``STATE_DELAY_SHARE * matchmaking_time`` together (both scaled down alike when they are above).

        hivemind 1.1.12 pre-schedules a state round once the tracker's estimate of the epoch's end, plus
        ``delay_before_state_averaging`` (measured from the epoch's end to the state round's step: in synchronous
        mode the whole gradient round) plus the state averager's ``delay_before_averaging`` (that step's start to its
        all-reduce), is within ``matchmaking_time``. A state round is pre-scheduled before the epoch's end or not at
        all (the transition starts one at once when none was; after it the peer is blocked in the gradient round, or
        has handed the round to the background), and ``delay_before_state_averaging`` is measured only at epochs whose
        round was pre-scheduled. One gradient round that waited out a dead groupmate (30 s, against a usual 1 s)
        raised that average (alpha 0.1) above ``matchmaking_time`` and the peer never pre-scheduled again: its state
        rounds began at the transition, after its groupmates' groups had formed, and found nobody for the rest of the
        run (client-mode peers of an 8-peer swarm with churn, docs/notes/swarm-at-scale-measurements.md 2026-11-29,
        whose parameters then drifted from the swarm's). Starting matchmaking early costs a group only some waiting
        for its members' triggers, so the bound errs that way."""
        delays = (self.delay_before_state_averaging, self.state_averager.delay_before_averaging)
        total = sum(delay.ema_seconds_per_sample for delay in delays)
        limit = STATE_DELAY_SHARE * self.matchmaking_time
        if total <= limit:
            return
        for delay in delays:
            delay.ema_seconds_per_sample *= limit / total
        log.log(logging.DEBUG if self.state_delays_bounded else logging.INFO,
                f"a state round's measured delays ({total:.1f} s together) scaled down to {limit:.1f} s, so that the "
                f"next one is pre-scheduled before the epoch's end (once a gradient round is slow, e.g. it waited out a "
                f"peer that died)")
        self.state_delays_bounded = True
