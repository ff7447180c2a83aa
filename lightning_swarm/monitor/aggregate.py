"""Turn the metrics records every trainer publishes into swarm-wide figures and a per-peer contribution table.

Pure bookkeeping (no DHT, no torch), so it is easy to test and to reuse for a leaderboard.
"""

from __future__ import annotations

import csv
import json
import logging
import math
import os
from collections import Counter
from dataclasses import asdict, dataclass, field
from typing import Callable, Dict, List, Mapping, Optional

from lightning_swarm.metrics import LocalMetrics
from lightning_swarm.monitor.records import BOUNDS, peer_name  # noqa: F401 (peer_name: part of this module's API)

# a peer whose two consecutive records are further apart than this was away in between: the gap is not
# counted as time it contributed
MAX_CONTRIBUTION_GAP_SECONDS = 120.0
# a record may be stamped this far ahead of the monitor's DHT clock (peers' clocks differ by a few seconds)
MAX_CLOCK_SKEW_SECONDS = 60.0

logger = logging.getLogger(__name__)


@dataclass
class SwarmSnapshot:
    """The swarm at one moment, computed from the alive peers' latest records.

    step: the highest global epoch any alive peer reports
    loss: mean loss over the alive peers, weighted by the local steps each averaged over
    alive_peers: peers with an unexpired record
    samples_per_second: sum of the alive peers' throughputs
    samples_contributed: samples all peers (alive or not) contributed so far
    records: the records this was computed from, by peer name (for auditing)
    refused_records: records the monitor refused so far, by reason (see :class:`RecordScreen`)
    """

    step: int
    loss: float
    alive_peers: int
    samples_per_second: float
    samples_contributed: int
    records: Dict[str, dict] = field(default_factory=dict)
    refused_records: Dict[str, int] = field(default_factory=dict)

    def as_metrics(self) -> Dict[str, float]:
        """What gets sent to the Lightning loggers."""
        return {
            "swarm/loss": self.loss,
            "swarm/alive_peers": float(self.alive_peers),
            "swarm/samples_per_second": self.samples_per_second,
            "swarm/samples_contributed": float(self.samples_contributed),
            "swarm/epoch": float(self.step),
            "swarm/refused_records": float(sum(self.refused_records.values())),
        }


def clip(value: float, name: str) -> float:
    """``value`` clipped into the plausible bounds of the record field ``name`` (NaN: the lower bound)."""
    low, high = BOUNDS[name]
    return float(min(max(value, low), high)) if value == value else float(low)


def finite_json(obj):
    """``obj`` (JSON data) with every non-finite float replaced by None: what ``json.dumps(allow_nan=False)``
    accepts, so that what the monitor writes and serves stays valid JSON."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {key: finite_json(value) for key, value in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [finite_json(value) for value in obj]
    return obj


def aggregate(records: Mapping[bytes, LocalMetrics], samples_contributed: int = 0,
              refused_records: Optional[Mapping[str, int]] = None) -> Optional[SwarmSnapshot]:
    """Swarm-wide figures from ``records`` (public key -> latest record); None if there is no record.
    ``refused_records``: counts of refused records by reason, passed into the snapshot.

    Every input is clipped into the plausible bounds of :data:`~lightning_swarm.monitor.records.BOUNDS` first
    and the sums are exact (``math.fsum``), so no set of records makes a figure infinite or NaN."""
    if not records:
        return None
    steps = [clip(r.mini_steps, "mini_steps") for r in records.values()]
    losses = [clip(r.loss, "loss") for r in records.values()]
    total_steps = math.fsum(steps)
    if total_steps > 0:
        loss = math.fsum(l * n for l, n in zip(losses, steps)) / total_steps
    else:  # nobody stepped since their last report: plain mean of the reported losses
        loss = math.fsum(losses) / len(losses)
    samples_per_second = math.fsum(clip(r.samples_per_second, "samples_per_second") for r in records.values())
    if not (math.isfinite(loss) and math.isfinite(samples_per_second)):  # bounded inputs: cannot happen
        raise ArithmeticError(f"swarm figures not finite from {len(records)} clipped records")
    return SwarmSnapshot(
        step=int(clip(max(r.step for r in records.values()), "step")),
        loss=float(loss),
        alive_peers=len(records),
        samples_per_second=float(samples_per_second),
        samples_contributed=int(samples_contributed),
        records={peer_name(key): r.dict() for key, r in records.items()},
        refused_records=dict(refused_records or {}),
    )


class RecordScreen:
    """Drops implausible metrics records before they reach the figures or the contribution table, and counts them.

    A record's signature only proves which key made it, not that its figures are true: anyone can mint a key and
    publish a schema-valid NaN loss, 1e15 samples or a time in the future. Refused (reason in :attr:`refused`):

    - ``non_finite``: loss, samples/s or time is NaN or infinite;
    - ``future_time``: stamped more than ``max_clock_skew`` seconds after the monitor's DHT time;
    - ``epoch_beyond_swarm``: a global epoch more than one past the swarm's (as the progress tracker sees it);
    - ``samples_beyond_epochs``: more samples than the swarm's epochs hold (``(epoch + 2) * target_batch_size``:
      every epoch so far, the current one, and one epoch's worth of slack for overshoot);
    - ``out_of_bounds``: any other field outside its plausible bounds (:data:`~lightning_swarm.monitor.records.BOUNDS`,
      e.g. a loss of 1e308, whose sum over a few records would be infinite);
    - ``unauthenticated``: ``identify`` (if given) knows no user for the record.

    Args:
        target_batch_size: the run's samples per global epoch.
        max_clock_skew: seconds a record's time may be ahead of the monitor's.
        identify: the authentication hook: maps (a record's public key, the DHT subkey; the record) to the user the
            key was issued to, or None to refuse the record (e.g. :func:`~lightning_swarm.monitor.identity.token_identity`).
            None (runs without an authority): every validly signed key counts.
    """

    def __init__(self, target_batch_size: int, max_clock_skew: float = MAX_CLOCK_SKEW_SECONDS,
                 identify: Optional[Callable[[bytes, LocalMetrics], Optional[str]]] = None):
        self.target_batch_size, self.max_clock_skew, self.identify = target_batch_size, max_clock_skew, identify
        self.refused: Counter = Counter()
        self.users: Dict[bytes, str] = {}  # public key -> user, for the keys ``identify`` accepted
        self._seen_refusals: set = set()  # (key, reason, record time): each refused record counted once

    def reason_to_refuse(self, key: bytes, record: LocalMetrics, swarm_epoch: int, now: float) -> Optional[str]:
        """Why ``record`` is implausible, or None if it is accepted."""
        if not all(math.isfinite(value) for value in (record.loss, record.samples_per_second, record.time)):
            return "non_finite"
        if record.time > now + self.max_clock_skew:
            return "future_time"
        if record.step > swarm_epoch + 1:
            return "epoch_beyond_swarm"
        if record.samples_accumulated > (max(swarm_epoch, record.step) + 2) * self.target_batch_size:
            return "samples_beyond_epochs"
        if not all(BOUNDS[name][0] <= getattr(record, name) <= BOUNDS[name][1] for name in BOUNDS):
            return "out_of_bounds"
        if self.identify is not None:
            user = self.identify(key, record)
            if user is None:
                return "unauthenticated"
            self.users[key] = user
        return None

    def screen(self, records: Mapping[bytes, LocalMetrics], swarm_epoch: int, now: float) -> Dict[bytes, LocalMetrics]:
        """The plausible ``records``; each refused record is counted (once) and logged."""
        accepted = {}
        for key, record in records.items():
            reason = self.reason_to_refuse(key, record, swarm_epoch, now)
            if reason is None:
                accepted[key] = record
                continue
            if (key, reason, record.time) not in self._seen_refusals:
                self._seen_refusals.add((key, reason, record.time))
                self.refused[reason] += 1
                logger.warning(f"refused a metrics record of peer {peer_name(key)} ({reason}): step {record.step}, "
                               f"loss {record.loss}, samples {record.samples_accumulated}, time {record.time}")
        return accepted


@dataclass
class PeerContribution:
    """What one peer contributed to the run (one row of the contribution table)."""

    peer: str
    user: str = ""  # filled in once peers authenticate with a user name
    samples: int = 0
    seconds: float = 0.0
    last_step: int = 0
    samples_per_second: float = 0.0
    first_seen: float = 0.0
    last_seen: float = 0.0


class ContributionTable:
    """Accumulates per-peer contributions from successive metrics records and writes them as CSV + JSON.

    ``samples`` is the peer's own running total (``samples_accumulated``); ``seconds`` adds up the time between
    consecutive records of a peer, ignoring gaps longer than ``max_gap`` (the peer was gone).
    """

    FIELDS = [f for f in PeerContribution.__dataclass_fields__]

    def __init__(self, max_gap: float = MAX_CONTRIBUTION_GAP_SECONDS):
        self.max_gap = max_gap
        self.rows: Dict[str, PeerContribution] = {}

    def update(self, records: Mapping[bytes, LocalMetrics], users: Optional[Mapping[bytes, str]] = None) -> None:
        """Fold in the latest records (a record seen before changes nothing)."""
        for key, record in records.items():
            name = peer_name(key)
            row = self.rows.get(name)
            if row is None:
                row = self.rows[name] = PeerContribution(peer=name, first_seen=record.time, last_seen=record.time)
            elif record.time <= row.last_seen:
                continue
            else:
                gap = record.time - row.last_seen
                if gap <= self.max_gap:
                    row.seconds += gap
                row.last_seen = record.time
            row.samples = max(row.samples, record.samples_accumulated)
            row.last_step = max(row.last_step, record.step)
            row.samples_per_second = record.samples_per_second
            if users and key in users:
                row.user = users[key]

    @property
    def total_samples(self) -> int:
        return sum(row.samples for row in self.rows.values())

    def sorted_rows(self) -> List[PeerContribution]:
        return sorted(self.rows.values(), key=lambda row: (-row.samples, row.peer))

    def write(self, directory: str, basename: str = "contributions") -> None:
        """Write ``basename.csv`` and ``basename.json`` into ``directory`` (each replaced atomically)."""
        os.makedirs(directory, exist_ok=True)
        rows = [asdict(row) for row in self.sorted_rows()]
        csv_tmp = os.path.join(directory, f".{basename}.csv.tmp")
        with open(csv_tmp, "w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=self.FIELDS)
            writer.writeheader()
            writer.writerows(rows)
        os.replace(csv_tmp, os.path.join(directory, f"{basename}.csv"))
        json_tmp = os.path.join(directory, f".{basename}.json.tmp")
        with open(json_tmp, "w") as f:
            json.dump(finite_json(rows), f, indent=1, allow_nan=False)
        os.replace(json_tmp, os.path.join(directory, f"{basename}.json"))
