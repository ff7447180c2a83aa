"""Overlapping averaging rounds of many peers: each round is matched with rounds of its own epoch.

With the overlap options (``delay_optimizer_step`` / ``delay_grad_averaging`` / ``delay_state_averaging``) an averager
has several rounds under way: the next epoch's round is pre-scheduled (it looks for a group) while the current one
is still searching, waiting for its trigger or running its all-reduce. hivemind 1.1.12 matches every round of an
averager under one group key and runs one search at a time, first come first served. When the current epoch's
round has to search again (its group fell apart, or it missed it), the next epoch's round searches first, under the
same key, and can take a seat in a group of the current epoch: that group then waits for a trigger that comes one
epoch later (``next_chunk_timeout`` lost by every member), and the round that missed its group searches alone until
its deadline (``averaging_timeout``) while its peer waits for it (docs/notes/swarm-at-scale-measurements.md has
the logs).

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
- :class:`LateRounds` (in the trainer's process): a triggered round still looking for a group once the swarm has
  gone past its epoch gives up after a grace period instead of searching until ``averaging_timeout``. Nobody will
  join it (its groupmates have averaged and moved on), and a peer that waited the whole timeout came back several
  epochs behind, caught up to the swarm's epoch in the middle of that epoch's round, was late for it again, and so
  on: in CI a peer lost 10 epochs that way (tests/lightning_swarm/test_leaver.py). Given up, it applies its local
  gradients like after any failed round and catches up with the swarm. "Past its epoch" means a peer entered the
  epoch after the round's: peers enter the round's own epoch while that round may still look for its group
  (``delay_state_averaging``, hivemind's default, and ``delay_grad_averaging`` run it in the background).

The swarm optimizer matches state rounds per epoch always, and gradient rounds only while ``delay_grad_averaging``
/ ``delay_optimizer_step`` are in force (``SwarmOptimizer._rounds_matched_per_epoch``, through
``RoundEpochSender.epoch_keys``). Synchronous gradient rounds keep hivemind's one key: an averager has one round at
a time, and a peer one epoch behind still finds its groupmates in the swarm's next round (its gradients one step
stale); state rounds of different epochs must not meet (an 8-peer test's newcomer joined the swarm's next state
round and was a step ahead of its epoch). With gradient rounds matched per epoch too, a peer one epoch off the
swarm's found nobody in any round, and a newcomer that arrived as an epoch ended was late for every round after
(tests/lightning_swarm/test_leaver.py failed that way in CI, test_newcomer.py here; LateRounds and the catch-up's
sit-out shorten that, they do not remove it).

Every peer of a run must use the same keys: with the overlap options on, a peer of an older lightning_swarm (one key
for all epochs) and a peer with this module never share a group.
"""

from __future__ import annotations

import threading
import time
import weakref
from typing import Callable, List, Optional

from hivemind.averaging import DecentralizedAverager
from hivemind.averaging.control import AveragingStage, StepControl
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
        self.__dict__.setdefault("_live_rounds", weakref.WeakSet()).add(step)
        return await super()._step(step=step, future_for_init=future_for_init)

    async def _move_rounds(self, from_epoch: int, to_epoch: int) -> None:
        """(averager process) Rounds of ``from_epoch`` that have not found a group yet look for one among the rounds
        of ``to_epoch`` from now on (the group key is read at each poll and declaration, and checked on each join
        request: see EpochGroupKeyManager).

        Args:
            from_epoch: the epoch the rounds were started for.
            to_epoch: the epoch whose rounds they join.
        """
        for step in list(self.__dict__.get("_live_rounds", ())):
            if (getattr(step, "round_epoch", None) == from_epoch and not step.done()
                    and step.stage in (AveragingStage.IDLE, AveragingStage.LOOKING_FOR_GROUP)):
                step.round_epoch = int(to_epoch)
                log.info(f"{type(self).__name__} round of epoch {from_epoch} looks for a group of epoch {to_epoch} "
                         "(this peer caught up with the swarm)")


class RoundEpochSender(DecentralizedAverager):
    """Base for hivemind averager classes (after GradientAverager / TrainingStateAverager in the bases): each round
    started by ``step`` (also through ``schedule_step``) is announced to the averager's process with its epoch.

    ``round_epoch`` (attribute, set in the trainer's process): a callable giving the epoch of the round about to be
    started, or None: then the ``gather`` of the step, if it is an epoch number (as hivemind's state rounds gather).

    ``epoch_keys`` (attribute, trainer's process): a callable saying whether rounds are matched per epoch now; when
    it says False, a round uses hivemind's one key (its epoch is not sent). None: always per epoch.

    ``on_round`` (attribute, trainer's process): a callable given each round's StepControl, its epoch and the
    averager, for rounds started with ``wait=False`` (as the optimizer starts them), e.g. :meth:`LateRounds.watch`.

    A round started without a ``gather`` (a gradient round) gathers its epoch, so that each member learns its
    groupmates' epochs (``SwarmOptimizer`` follows a group one epoch ahead).

    A StepControl returned by ``step`` carries its round's epoch as ``round_epoch`` (None: hivemind's one key);
    :meth:`move_round` changes it.
    """

    round_epoch: Optional[Callable[[], Optional[int]]] = None
    epoch_keys: Optional[Callable[[], bool]] = None
    on_round: Optional[Callable[[StepControl, Optional[int], DecentralizedAverager], None]] = None

    def step(self, gather=None, *args, **kwargs):
        epoch = self.round_epoch() if self.round_epoch is not None else None
        if epoch is None and isinstance(gather, int) and not isinstance(gather, bool):
            epoch = gather
        if gather is None and epoch is not None:
            gather = epoch  # (gradient rounds) the groupmates learn each other's epochs: SwarmOptimizer follows them
        if self.epoch_keys is not None and not self.epoch_keys():
            epoch = None
        if self.is_alive() and hasattr(self, "_set_round_epoch"):  # RoundEpochs receives it
            self._outer_pipe.send(("_set_round_epoch", [], dict(epoch=epoch)))
        result = super().step(gather, *args, **kwargs)
        if isinstance(result, StepControl):
            result.round_epoch = epoch
            if self.on_round is not None:
                self.on_round(result, epoch, self)
        return result

    def move_round(self, control: StepControl, epoch: int) -> bool:
        """Have a round that has not found a group yet look for one among the rounds of ``epoch`` (a later epoch
        than its own) instead, e.g. after this peer caught up with the swarm; returns whether it was moved.

        Args:
            control: a StepControl returned by :meth:`step` (with ``wait=False``).
            epoch: the epoch whose rounds it joins.
        """
        old = getattr(control, "round_epoch", None)
        if (old is None or old >= epoch or control.done() or not self.is_alive() or not hasattr(self, "_move_rounds")
                or control.stage not in (AveragingStage.IDLE, AveragingStage.LOOKING_FOR_GROUP)):
            return False
        self._outer_pipe.send(("_move_rounds", [], dict(from_epoch=old, to_epoch=int(epoch))))
        control.round_epoch = int(epoch)  # (read by LateRounds)
        return True


class LateRounds:
    """Gives up rounds that look for a group of an epoch the swarm has finished (see the module docstring).

    A round is given up (its StepControl cancelled: the optimizer then applies local gradients, or keeps its state,
    as after any failed round) when it has been triggered, is still looking for a group (not yet averaging, not
    waiting for its trigger), and the swarm's epoch has been above the round's epoch for ``grace`` seconds.

    Args:
        swarm_epoch: the swarm's epoch as this peer sees it now: the highest epoch a peer entered (a peer enters
            epoch E + 1 after it began its rounds of E + 1, so its rounds of E have ended or are late themselves).
            Called only while a watched round is triggered and looking for a group. Not the progress tracker's
            ``global_epoch``: hivemind pauses the tracker's updates through a global step, and so through the
            rounds it waits for (``ThrottledProgressTracker.peek_global_epoch`` reads the DHT instead).
        grace: seconds the swarm must have been past the round's epoch (a groupmate still looking for the same
            epoch finds this round within one matchmaking window: the optimizer's ``matchmaking_time``).
        poll_interval: seconds between two checks of the watched rounds (a thread does them; see :meth:`start`).

    A round watched with a ``search_limit`` (:meth:`watch`) is also given up once it has looked for a group that long
    after its trigger, whatever the swarm's epoch: the optimizer gives one to state rounds. A peer's state round comes
    right after its global step, and so does its groupmates' of the same epoch: one that found nobody within a few
    matchmaking windows waits for a peer that is busy elsewhere, often in a gradient round that waits for this peer
    in turn (test_byzantine_swarm.py's nan case: two honest peers one round out of step stalled each other 12-15 s
    per epoch, until averaging_timeout, over several epochs).
    """

    def __init__(self, swarm_epoch: Callable[[], int], grace: float, poll_interval: float = 0.5):
        if grace < 0 or poll_interval <= 0:
            raise ValueError(f"grace must be >= 0 and poll_interval > 0 seconds, got {grace!r}, {poll_interval!r}")
        self.swarm_epoch, self.grace, self.poll_interval = swarm_epoch, grace, poll_interval
        # [control, epoch, averager's class name, since when the swarm is past it, search limit, since when looking]
        self._rounds: List[list] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None
        self.given_up = 0  # rounds given up so far (for tests and diagnostics)

    def watch(self, control: StepControl, epoch: Optional[int], averager: object = None,
              search_limit: Optional[float] = None) -> None:
        """Watch a round of ``epoch`` (a round of unknown epoch is left alone; a ``round_epoch`` on the control,
        which :meth:`RoundEpochSender.move_round` changes, takes over from ``epoch``). ``search_limit``: seconds
        after which a triggered round still looking for a group is given up (None: only when late)."""
        if search_limit is not None and search_limit <= 0:
            raise ValueError(f"search_limit must be > 0 seconds or None, got {search_limit!r}")
        if epoch is not None:
            with self._lock:
                self._rounds.append([control, int(epoch), type(averager).__name__, None, search_limit, None])

    def check(self) -> int:
        """Give up the late rounds now; return how many were given up."""
        with self._lock:
            for entry in list(self._rounds):
                if entry[0].done():
                    self._rounds.remove(entry)
            looking = [entry for entry in self._rounds if entry[0].stage == AveragingStage.LOOKING_FOR_GROUP
                       and entry[0].triggered]  # (looking for a group: its trigger is attached)
            for entry in self._rounds:
                if entry not in looking:
                    entry[3] = entry[5] = None
        if not looking:
            return 0
        swarm_epoch, now, late = self.swarm_epoch(), time.monotonic(), []  # (may read the DHT: only when needed)
        with self._lock:
            for entry in looking:
                control, since, limit = entry[0], entry[3], entry[4]
                if getattr(control, "round_epoch", None) is not None:  # (moved: see RoundEpochSender.move_round)
                    entry[1] = control.round_epoch
                epoch = entry[1]
                if entry[5] is None:
                    entry[5] = now
                if limit is not None and now - entry[5] >= limit and entry in self._rounds:
                    self._rounds.remove(entry)
                    late.append(entry)
                elif swarm_epoch <= epoch or entry not in self._rounds:
                    entry[3] = None
                elif since is None:
                    entry[3] = now
                elif now - since >= self.grace:
                    self._rounds.remove(entry)
                    late.append(entry)
        for control, epoch, averager, since, limit, looking_since in late:
            if control.cancel():
                self.given_up += 1
                if since is not None and now - since >= self.grace:
                    log.info(f"Gave up the {averager} round of epoch {epoch}: it found no group, and the swarm went "
                             f"past that epoch {now - since:.1f} s ago (it is at epoch {swarm_epoch})")
                else:
                    log.info(f"Gave up the {averager} round of epoch {epoch}: it found no group in "
                             f"{now - looking_since:.1f} s (its search limit: {limit:g} s)")
        return len(late)

    def start(self) -> "LateRounds":
        """Check every ``poll_interval`` seconds in a daemon thread until :meth:`stop`."""
        self._thread = threading.Thread(target=self._run, name="lightning_swarm.LateRounds", daemon=True)
        self._thread.start()
        return self

    def _run(self) -> None:
        while not self._stop.wait(self.poll_interval):
            try:
                self.check()
            except Exception as e:  # a tracker shutting down, say: never kill the thread with the peer still up
                log.debug(f"LateRounds check failed: {e!r}")

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=5)
