"""Turn the metrics records every trainer publishes into swarm-wide figures and a per-peer contribution table.

Pure bookkeeping (no DHT, no torch), so it is easy to test and to reuse for a leaderboard.
"""

from __future__ import annotations

import csv
import hashlib
import json
import os
from dataclasses import asdict, dataclass, field
from typing import Dict, List, Mapping, Optional

from lightning_swarm.metrics import LocalMetrics

# a peer whose two consecutive records are further apart than this was away in between: the gap is not
# counted as time it contributed
MAX_CONTRIBUTION_GAP_SECONDS = 120.0


def peer_name(public_key: bytes) -> str:
    """A short stable name for a peer: the first 12 hex digits of the SHA-256 of its public key."""
    return hashlib.sha256(public_key).hexdigest()[:12]


@dataclass
class SwarmSnapshot:
    """The swarm at one moment, computed from the alive peers' latest records.

    step: the highest global epoch any alive peer reports
    loss: mean loss over the alive peers, weighted by the local steps each averaged over
    alive_peers: peers with an unexpired record
    samples_per_second: sum of the alive peers' throughputs
    samples_contributed: samples all peers (alive or not) contributed so far
    records: the records this was computed from, by peer name (for auditing)
    """

    step: int
    loss: float
    alive_peers: int
    samples_per_second: float
    samples_contributed: int
    records: Dict[str, dict] = field(default_factory=dict)

    def as_metrics(self) -> Dict[str, float]:
        """What gets sent to the Lightning loggers."""
        return {
            "swarm/loss": self.loss,
            "swarm/alive_peers": float(self.alive_peers),
            "swarm/samples_per_second": self.samples_per_second,
            "swarm/samples_contributed": float(self.samples_contributed),
            "swarm/epoch": float(self.step),
        }


def aggregate(records: Mapping[bytes, LocalMetrics], samples_contributed: int = 0) -> Optional[SwarmSnapshot]:
    """Swarm-wide figures from ``records`` (public key -> latest record); None if there is no record."""
    if not records:
        return None
    total_steps = sum(r.mini_steps for r in records.values())
    if total_steps > 0:
        loss = sum(r.loss * r.mini_steps for r in records.values()) / total_steps
    else:  # nobody stepped since their last report: plain mean of the reported losses
        loss = sum(r.loss for r in records.values()) / len(records)
    return SwarmSnapshot(
        step=max(r.step for r in records.values()),
        loss=float(loss),
        alive_peers=len(records),
        samples_per_second=float(sum(r.samples_per_second for r in records.values())),
        samples_contributed=int(samples_contributed),
        records={peer_name(key): r.dict() for key, r in records.items()},
    )


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
            json.dump(rows, f, indent=1)
        os.replace(json_tmp, os.path.join(directory, f"{basename}.json"))
