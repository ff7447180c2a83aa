"""Gradient weights bounded by the progress records: a sender may weigh at most the samples it reported.

hivemind takes each sender's weight from its own message; :class:`ProgressBoundedWeights` (a
:class:`~lightning_swarm.hivemind_ext.robust_allreduce.RobustAveraging` for gradient averagers) lowers it to the
``samples_accumulated`` of the sender's latest progress record in the DHT.

A round matched per epoch (overlapped rounds, :mod:`~lightning_swarm.hivemind_ext.epoch_rounds`) runs while its
members already count the next epoch's samples: their latest records are of the next epoch, with a step or two of
samples (an honest sender's weight of 3000 samples was lowered to 300 in every other round of 2 overlapped peers, and
the loss at those steps went 9-27% above one process's: docs/notes/swarm-at-scale-measurements.md). So while such a round waits for its group and its trigger, the
averager reads the records every ``record_poll_interval`` seconds and keeps each sender's largest count per epoch;
a sender is bounded by its count of the epoch whose samples the round averages (the one before the epoch the round
leads to, its ``round_epoch``), even once its latest record is of a later epoch.
"""

from __future__ import annotations

import asyncio
import contextvars
import logging
from typing import Any, Dict, Optional, Tuple

from hivemind.averaging.group_info import GroupInfo
from hivemind.p2p import PeerID
from hivemind.utils import get_dht_time

from lightning_swarm.hivemind_ext.progress_records import check_progress_record
from lightning_swarm.hivemind_ext.robust_allreduce import RobustAveraging
from lightning_swarm.hivemind_ext.state import progress_key as run_progress_key

log = logging.getLogger(__name__)


RECORD_POLL_INTERVAL = 1.0  # seconds between reads of the records while a round matched per epoch waits

# (averager process) the round whose _step runs in this task: its StepControl and the counts seen for its epoch
_ROUND: contextvars.ContextVar = contextvars.ContextVar("lightning_swarm_weight_bounds_round", default=None)


class ProgressBoundedWeights(RobustAveraging):
    """RobustAveraging for gradients: a sender's weight is at most the samples it reported to the progress tracker.

    The bound is ``samples_accumulated`` in the sender's latest progress record (a sender without a record, or with
    0 samples in it: the largest bound in the group; no bound at all if the records can't be read), nothing more:
    extrapolating with the samples/s a record declares would let a sender raise its own bound. An honest peer
    publishes its progress when its step ends the epoch
    (:class:`~lightning_swarm.hivemind_ext.tracker.ThrottledProgressTracker`), so its record is at most a step or two
    behind its weight, which then counts a little less. In a round matched per epoch (its ``StepControl`` has a
    ``round_epoch``), the bound is the largest count of the epoch whose samples the round averages, read while the
    round waited (see the module docstring) or in the latest record.

    Args:
        progress_key: the run's progress key in the DHT (``f"{run_id}_progress"``). Default: derived from the
            averager's prefix as hivemind.Optimizer names it (``f"{run_id}_grad_averager"``).
        record_poll_interval: seconds between reads of the progress records while a round matched per epoch waits
            for its group and its trigger.
        *args, **kwargs: as :class:`RobustAveraging`.
    """

    def __init__(self, *args, progress_key: Optional[str] = None,
                 record_poll_interval: float = RECORD_POLL_INTERVAL, **kwargs):
        if progress_key is None:
            prefix = kwargs.get("prefix", "")
            if not prefix.endswith("_grad_averager"):
                raise ValueError(f"give progress_key: it can't be derived from the averager's prefix {prefix!r}")
            progress_key = run_progress_key(prefix[: -len("_grad_averager")])
        if not record_poll_interval > 0:
            raise ValueError(f"record_poll_interval must be a positive number of seconds, got {record_poll_interval!r}")
        self.progress_key = progress_key
        self.record_poll_interval = float(record_poll_interval)
        super().__init__(*args, **kwargs)

    async def _step(self, *, step: Any, **kwargs):
        # (averager process) hivemind runs each _step in a task of its own: the round's state is this task's
        seen: Dict[Tuple[PeerID, int], float] = {}
        _ROUND.set((step, seen))
        watcher = asyncio.create_task(self._watch_records(step, seen))
        try:
            return await super()._step(step=step, **kwargs)
        finally:
            watcher.cancel()

    async def _watch_records(self, step: Any, seen: Dict[Tuple[PeerID, int], float]) -> None:
        """Until the round's all-reduce reads the bounds, keep each sender's largest count per epoch in ``seen``
        (rounds matched per epoch only: a synchronous round starts once its members ended their epoch)."""
        while getattr(step, "round_epoch", None) is not None and not getattr(step, "weight_bounds_read", False):
            try:
                found = await asyncio.wait_for(self.dht.get(self.progress_key, latest=True, return_future=True),
                                               timeout=self.request_timeout)
                note_counts(seen, found.value if found else None)
            except asyncio.CancelledError:
                raise
            except Exception:  # the read at the all-reduce says so if the records stay unreadable
                pass
            await asyncio.sleep(self.record_poll_interval)

    async def sender_weight_bounds(self, group_info: GroupInfo) -> Optional[Dict[PeerID, float]]:
        round_state = _ROUND.get()
        step, seen = round_state if round_state is not None else (None, {})
        # a gradient round's epoch is the one its step leads to: its samples were counted in the epoch before
        round_epoch = getattr(step, "round_epoch", None)
        epoch = None if round_epoch is None else int(round_epoch) - 1
        if step is not None:
            step.weight_bounds_read = True  # (stops the watcher)
        try:
            found = await asyncio.wait_for(self.dht.get(self.progress_key, latest=True, return_future=True),
                                           timeout=self.request_timeout)
        except Exception as e:  # refusing everyone would split the swarm: CenteredClip's median cap still holds
            log.warning(f"[lightning_swarm] averaging: could not read the progress records ({e!r}): "
                        "no weight bounds this round")
            return None
        # a record of 0 samples says nothing about this round: with delay_grad_averaging its peer may already have
        # published the next epoch's (a sender refused by every reducer would keep its own gradient, out of sync)
        bounds = {peer: bound for peer, bound in
                  progress_weight_bounds(found.value if found else None, epoch=epoch, seen=seen).items() if bound > 0}
        if not bounds:
            return None
        # a sender without a record (it expired, was reset, or was not yet stored) may claim as much as the
        # best-documented peer of the group
        fallback = max(bounds.values())
        return {peer: bounds.get(peer, fallback) for peer in group_info.peer_ids}


def _valid_records(records: object):
    """(peer id, record) of each well-formed record (see check_progress_record); malformed ones are skipped."""
    if not isinstance(records, dict):
        return
    now = get_dht_time()
    for entry in records.values():
        try:
            record = check_progress_record(getattr(entry, "value", None), now)
            peer = PeerID(record.peer_id)
        except Exception:
            continue
        yield peer, record


def note_counts(seen: Dict[Tuple[PeerID, int], float], records: object) -> None:
    """Keep in ``seen`` each peer's largest ``samples_accumulated`` per epoch from the progress ``records``."""
    for peer, record in _valid_records(records):
        key = (peer, int(record.epoch))
        seen[key] = max(seen.get(key, 0.0), float(record.samples_accumulated))


def progress_weight_bounds(records: object, epoch: Optional[int] = None,
                           seen: Optional[Dict[Tuple[PeerID, int], float]] = None) -> Dict[PeerID, float]:
    """Per-peer bound on a gradient weight from the progress records in the DHT (subkey -> ValueWithExpiration of
    hivemind's ``LocalTrainingProgress`` dict): its ``samples_accumulated``. Malformed records
    (:func:`~lightning_swarm.hivemind_ext.progress_records.check_progress_record`) are skipped. A peer id claimed by
    several records gets the largest bound (a peer cannot lower another's).

    With ``epoch`` (a round matched per epoch: the epoch whose samples it averages) and the counts ``seen`` while it
    waited (see :func:`note_counts`): a peer's bound is its largest count of that epoch, read now or before; a peer
    whose latest record is of a later epoch and whose count of that epoch was never seen gets no bound here (the
    caller's fallback: the largest bound in the group), and a record of an earlier epoch bounds as it says."""
    bounds: Dict[PeerID, float] = {}
    seen = seen or {}
    for peer, record in _valid_records(records):
        if epoch is None or record.epoch < epoch:
            bound = float(record.samples_accumulated)
        else:
            bound = seen.get((peer, int(epoch)), 0.0)
            if record.epoch == epoch:
                bound = max(bound, float(record.samples_accumulated))
        bounds[peer] = max(bounds.get(peer, 0.0), bound)
    return bounds
