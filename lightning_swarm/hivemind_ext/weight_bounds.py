"""Gradient weights bounded by the progress records: a sender may weigh at most the samples it reported.

hivemind takes each sender's weight from its own message; :class:`ProgressBoundedWeights` (a
:class:`~lightning_swarm.hivemind_ext.robust_allreduce.RobustAveraging` for gradient averagers) lowers it to the
``samples_accumulated`` of the sender's latest progress record in the DHT.

A round matched per epoch (overlapped rounds, :mod:`~lightning_swarm.hivemind_ext.epoch_rounds`) runs while its
members already count the next epoch's samples: their latest records are of the next epoch, with a step or two of
samples (an honest sender's weight of 3000 samples was lowered to 300 in every other round of 2 overlapped peers, and
the loss at those steps went 9-27% above one process's: docs/notes/swarm-at-scale-measurements.md). Such a round
bounds each sender by its largest count of the epoch whose samples the round averages (the one before the epoch the
round leads to, its ``round_epoch``), even once its latest record is of a later epoch. Those counts come from the
trainer's progress tracker, which reads every record of the swarm through the epoch anyway (as often as every
``min_refresh_period`` near its end): when the optimizer triggers the round, :meth:`ProgressBoundedWeights.step`
hands the averager's process the largest count the tracker saw of each peer in the ending epoch, with the round
(an averager that polled the DHT itself cost one read per second per waiting round, on the cores that train). The
round still reads the latest records once (a sender the tracker never read, or a later count) and takes the larger
count per sender; when the tracker's counts name every member of the group that read waits at most
``ROUND_RECORDS_TIMEOUT`` and, failing, the counts alone bound the senders. A sender's record of the step that ends
its epoch is stored as the round starts, mostly too late for that read: an overlapped round bounds an honest
sender a step below its weight (4 peers, 15 s epochs: every sender of every round, by 10%), which keeps the
weights' proportions only where the peers' steps take equal times.
"""

from __future__ import annotations

import asyncio
import contextvars
import logging
from typing import Any, Callable, Dict, Mapping, Optional, Tuple

from hivemind.averaging.group_info import GroupInfo
from hivemind.p2p import PeerID

from lightning_swarm.hivemind_ext.progress_records import valid_records
from lightning_swarm.hivemind_ext.robust_allreduce import RobustAveraging
from lightning_swarm.hivemind_ext.state import progress_key as run_progress_key

log = logging.getLogger(__name__)


ROUND_COUNTS_TIMEOUT = 1.0  # seconds a round matched per epoch waits for its counts from the trainer's tracker
ROUND_COUNTS_KEPT = 4  # epochs of counts the averager's process keeps
ROUND_RECORDS_TIMEOUT = 1.0  # at most this long (s) a round with the tracker's counts of every sender reads records

# (averager process) the StepControl of the round whose _step runs in this task
_ROUND: contextvars.ContextVar = contextvars.ContextVar("lightning_swarm_weight_bounds_round", default=None)


class ProgressBoundedWeights(RobustAveraging):
    """RobustAveraging for gradients: a sender's weight is at most the samples it reported to the progress tracker.

    The bound is ``samples_accumulated`` in the sender's latest progress record (a sender without a record, or with
    0 samples in it: the largest bound in the group; no bound at all if the records can't be read), nothing more:
    extrapolating with the samples/s a record declares would let a sender raise its own bound. An honest peer
    publishes its progress when its step ends the epoch
    (:class:`~lightning_swarm.hivemind_ext.tracker.ThrottledProgressTracker`), so its record is at most a step or two
    behind its weight, which then counts a little less. In a round matched per epoch (its ``StepControl`` has a
    ``round_epoch``), the bound is the largest count of the epoch whose samples the round averages, from the
    trainer's tracker (see the module docstring) or the latest record.

    ``round_counts`` (attribute, trainer's process): a callable giving, for an epoch, the largest count this peer's
    tracker saw of each peer in it (peer id bytes -> samples), e.g.
    :meth:`~lightning_swarm.hivemind_ext.tracker.ThrottledProgressTracker.epoch_counts`; :meth:`step` (the
    optimizer's trigger of a gradient round) hands the averager's process those of the epoch a round matched per
    epoch averages. None: such rounds are bounded by the latest records only.

    Args:
        progress_key: the run's progress key in the DHT (``f"{run_id}_progress"``). Default: derived from the
            averager's prefix as hivemind.Optimizer names it (``f"{run_id}_grad_averager"``).
        round_counts_timeout: seconds a round matched per epoch waits, when it reads the bounds, for the counts the
            trainer sends with its trigger (they come within milliseconds; without them the latest records bound).
        *args, **kwargs: as :class:`RobustAveraging`.
    """

    round_counts: Optional[Callable[[int], Mapping[bytes, float]]] = None

    def __init__(self, *args, progress_key: Optional[str] = None,
                 round_counts_timeout: float = ROUND_COUNTS_TIMEOUT, **kwargs):
        if progress_key is None:
            prefix = kwargs.get("prefix", "")
            if not prefix.endswith("_grad_averager"):
                raise ValueError(f"give progress_key: it can't be derived from the averager's prefix {prefix!r}")
            progress_key = run_progress_key(prefix[: -len("_grad_averager")])
        if not round_counts_timeout >= 0:
            raise ValueError(f"round_counts_timeout must be >= 0 seconds, got {round_counts_timeout!r}")
        self.progress_key = progress_key
        self.round_counts_timeout = float(round_counts_timeout)
        super().__init__(*args, **kwargs)

    def step(self, *args, **kwargs):
        """(trainer's process) As the averager's ``step``; first, for a round matched per epoch, hands the averager's
        process the counts of the epoch whose samples it averages (see ``round_counts``)."""
        epoch = self._samples_epoch(kwargs["control"] if "control" in kwargs else args[0] if args else None)
        if epoch is not None and self.round_counts is not None and self.is_alive():
            self._outer_pipe.send(("_note_round_counts", [], dict(epoch=epoch, counts=dict(self.round_counts(epoch)))))
        return super().step(*args, **kwargs)

    def _samples_epoch(self, control: Any) -> Optional[int]:
        """(trainer's process) The epoch whose samples the round that ``step(control=control)`` triggers averages, if
        that round is matched per epoch (a gradient round's ``round_epoch`` is the epoch it leads to); None if not."""
        if control is not None:  # a round scheduled before (RoundEpochSender named its epoch then)
            round_epoch = getattr(control, "round_epoch", None)
        else:  # a round started and triggered at once: RoundEpochSender names its epoch as it starts it
            round_epoch_of, epoch_keys = getattr(self, "round_epoch", None), getattr(self, "epoch_keys", None)
            if round_epoch_of is None or (epoch_keys is not None and not epoch_keys()):
                return None
            round_epoch = round_epoch_of()
        return None if round_epoch is None else int(round_epoch) - 1

    async def _note_round_counts(self, epoch: int, counts: Dict[bytes, float]) -> None:
        """(averager process) The counts of ``epoch`` from the trainer's tracker, for the round that averages its
        samples.

        Args:
            epoch: the epoch the trainer is ending.
            counts: peer id bytes -> the largest ``samples_accumulated`` of that epoch its tracker saw.
        """
        rounds = self.__dict__.setdefault("_round_counts", {})
        rounds[int(epoch)] = counts
        for old in sorted(rounds)[:-ROUND_COUNTS_KEPT]:
            del rounds[old]
        arrived = self.__dict__.setdefault("_round_counts_arrived", {}).pop(int(epoch), None)
        if arrived is not None:
            arrived.set()

    async def _counts_of(self, epoch: int) -> Dict[PeerID, float]:
        """(averager process) The counts of ``epoch`` the trainer sent (those above 0), waiting for them at most
        ``round_counts_timeout`` seconds."""
        rounds = self.__dict__.setdefault("_round_counts", {})
        if epoch not in rounds and self.round_counts_timeout > 0:
            arrived = self.__dict__.setdefault("_round_counts_arrived", {}).setdefault(epoch, asyncio.Event())
            try:
                await asyncio.wait_for(arrived.wait(), timeout=self.round_counts_timeout)
            except asyncio.TimeoutError:
                self.__dict__["_round_counts_arrived"].pop(epoch, None)
                log.warning(f"[lightning_swarm] averaging: no counts of epoch {epoch} from this peer's tracker within "
                         f"{self.round_counts_timeout} s: the senders are bounded by their latest records")
        counted: Dict[PeerID, float] = {}
        for peer, count in rounds.get(epoch, {}).items():
            try:
                if count > 0:
                    counted[PeerID(peer)] = float(count)
            except Exception:  # (from this peer's own trainer: never malformed, but never trusted to crash a round)
                continue
        return counted

    async def _step(self, *, step: Any, **kwargs):
        # (averager process) hivemind runs each _step in a task of its own: the round's control is this task's
        _ROUND.set(step)
        return await super()._step(step=step, **kwargs)

    async def sender_weight_bounds(self, group_info: GroupInfo) -> Optional[Dict[PeerID, float]]:
        step = _ROUND.get()
        # a gradient round's epoch is the one its step leads to: its samples were counted in the epoch before
        round_epoch = getattr(step, "round_epoch", None)
        epoch = None if round_epoch is None else int(round_epoch) - 1
        counted = await self._counts_of(epoch) if epoch is not None else {}
        named_all = bool(counted) and all(peer in counted for peer in group_info.peer_ids)
        # the latest records may hold a later count, or a sender the tracker never read. With counts for every
        # sender the read waits less (under load it timed out at request_timeout in about one round in four of 16
        # peers on 2 cores) and a read that fails leaves the counts' bounds instead of none.
        timeout = min(self.request_timeout, ROUND_RECORDS_TIMEOUT) if named_all else self.request_timeout
        try:
            found = await asyncio.wait_for(self.dht.get(self.progress_key, latest=True, return_future=True),
                                           timeout=timeout)
        except Exception as e:
            if named_all:
                return {peer: counted[peer] for peer in group_info.peer_ids}
            # refusing everyone would split the swarm: CenteredClip's median cap still holds
            log.warning(f"[lightning_swarm] averaging: could not read the progress records ({e!r}): "
                        "no weight bounds this round")
            return None
        # a record of 0 samples says nothing about this round: with delay_grad_averaging its peer may already have
        # published the next epoch's (a sender refused by every reducer would keep its own gradient, out of sync)
        seen = {(peer, epoch): count for peer, count in counted.items()}
        bounds = {peer: bound for peer, bound in
                  progress_weight_bounds(found.value if found else None, epoch=epoch, seen=seen).items() if bound > 0}
        if not bounds:
            return None
        # a sender without a record (it expired, was reset, or was not yet stored) may claim as much as the
        # best-documented peer of the group
        fallback = max(bounds.values())
        return {peer: bounds.get(peer, fallback) for peer in group_info.peer_ids}


def progress_weight_bounds(records: object, epoch: Optional[int] = None,
                           seen: Optional[Dict[Tuple[PeerID, int], float]] = None) -> Dict[PeerID, float]:
    """Per-peer bound on a gradient weight from the progress records in the DHT (subkey -> ValueWithExpiration of
    hivemind's ``LocalTrainingProgress`` dict): its ``samples_accumulated``. Malformed records
    (:func:`~lightning_swarm.hivemind_ext.progress_records.check_progress_record`) are skipped. A peer id claimed by
    several records gets the largest bound (a peer cannot lower another's).

    With ``epoch`` (a round matched per epoch: the epoch whose samples it averages) and the counts ``seen`` before
    (by the trainer's tracker, see :func:`~lightning_swarm.hivemind_ext.progress_records.note_counts`): a peer's
    bound is its largest count of that epoch, read now or before; a peer whose latest record is of a later epoch
    and whose count of that epoch was never seen gets no bound here (the caller's fallback: the largest bound in the
    group), and a record of an earlier epoch bounds as it says."""
    bounds: Dict[PeerID, float] = {}
    seen = seen or {}
    for peer, record in valid_records(records):
        if epoch is None or record.epoch < epoch:
            bound = float(record.samples_accumulated)
        else:
            bound = seen.get((peer, int(epoch)), 0.0)
            if record.epoch == epoch:
                bound = max(bound, float(record.samples_accumulated))
        bounds[peer] = max(bounds.get(peer, 0.0), bound)
    return bounds
