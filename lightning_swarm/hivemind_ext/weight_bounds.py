"""Gradient weights bounded by the progress records: a sender may weigh at most the samples it reported.

hivemind takes each sender's weight from its own message; :class:`ProgressBoundedWeights` (a
:class:`~lightning_swarm.hivemind_ext.robust_allreduce.RobustAveraging` for gradient averagers) lowers it to the
``samples_accumulated`` of the sender's latest progress record in the DHT.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Dict, Optional

from hivemind.averaging.group_info import GroupInfo
from hivemind.p2p import PeerID
from hivemind.utils import get_dht_time

from lightning_swarm.hivemind_ext.progress_records import check_progress_record
from lightning_swarm.hivemind_ext.robust_allreduce import RobustAveraging
from lightning_swarm.hivemind_ext.state import progress_key as run_progress_key

log = logging.getLogger(__name__)


class ProgressBoundedWeights(RobustAveraging):
    """RobustAveraging for gradients: a sender's weight is at most the samples it reported to the progress tracker.

    The bound is ``samples_accumulated`` in the sender's latest progress record (a sender without a record, or with
    0 samples in it: the largest bound in the group; no bound at all if the records can't be read), nothing more:
    extrapolating with the samples/s a record declares would let a sender raise its own bound. An honest peer
    publishes its progress when its step ends the epoch
    (:class:`~lightning_swarm.hivemind_ext.tracker.ThrottledProgressTracker`), so its record is at most a step or two
    behind its weight, which then counts a little less (with ``delay_grad_averaging``, more: the record may already
    count the next epoch's samples).

    Args:
        progress_key: the run's progress key in the DHT (``f"{run_id}_progress"``). Default: derived from the
            averager's prefix as hivemind.Optimizer names it (``f"{run_id}_grad_averager"``).
        *args, **kwargs: as :class:`RobustAveraging`.
    """

    def __init__(self, *args, progress_key: Optional[str] = None, **kwargs):
        if progress_key is None:
            prefix = kwargs.get("prefix", "")
            if not prefix.endswith("_grad_averager"):
                raise ValueError(f"give progress_key: it can't be derived from the averager's prefix {prefix!r}")
            progress_key = run_progress_key(prefix[: -len("_grad_averager")])
        self.progress_key = progress_key
        super().__init__(*args, **kwargs)

    async def sender_weight_bounds(self, group_info: GroupInfo) -> Optional[Dict[PeerID, float]]:
        try:
            found = await asyncio.wait_for(self.dht.get(self.progress_key, latest=True, return_future=True),
                                           timeout=self.request_timeout)
        except Exception as e:  # refusing everyone would split the swarm: CenteredClip's median cap still holds
            log.warning(f"[lightning_swarm] averaging: could not read the progress records ({e!r}): "
                        "no weight bounds this round")
            return None
        # a record of 0 samples says nothing about this round: with delay_grad_averaging its peer may already have
        # published the next epoch's (a sender refused by every reducer would keep its own gradient, out of sync)
        bounds = {peer: bound for peer, bound in progress_weight_bounds(found.value if found else None).items()
                  if bound > 0}
        if not bounds:
            return None
        # a sender without a record (it expired, was reset, or was not yet stored) may claim as much as the
        # best-documented peer of the group
        fallback = max(bounds.values())
        return {peer: bounds.get(peer, fallback) for peer in group_info.peer_ids}


def progress_weight_bounds(records: object) -> Dict[PeerID, float]:
    """Per-peer bound on a gradient weight from the progress records in the DHT (subkey -> ValueWithExpiration of
    hivemind's ``LocalTrainingProgress`` dict): its ``samples_accumulated``. Malformed records
    (:func:`~lightning_swarm.hivemind_ext.progress_records.check_progress_record`) are skipped. A peer id claimed by
    several records gets the largest bound (a peer cannot lower another's)."""
    bounds: Dict[PeerID, float] = {}
    if not isinstance(records, dict):
        return bounds
    now = get_dht_time()
    for entry in records.values():
        try:
            record = check_progress_record(getattr(entry, "value", None), now)
            peer = PeerID(record.peer_id)
        except Exception:
            continue
        bounds[peer] = max(bounds.get(peer, 0.0), float(record.samples_accumulated))
    return bounds
