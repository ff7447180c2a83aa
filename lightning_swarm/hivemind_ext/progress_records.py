"""Progress records read from the DHT, checked before anything counts them.

Every peer publishes a ``LocalTrainingProgress`` record under the run's progress key; hivemind's DHT checks its
types (a pydantic schema) and its signature, not its values: a record with ``samples_per_second=1e308`` or a NaN
``time`` passes, and hivemind's ``ProgressTracker`` then sums them into the swarm's estimate (an infinite rate makes
every peer end the epoch at once), and ``LocalTrainingProgress.parse_obj`` of a record that slipped past the schema
raises inside the tracker's fetch loop. :func:`check_progress_record` checks one record's types, ranges and
finiteness; :func:`well_formed_records` keeps the records that pass and logs each refused sender once.

What stays open: a well-formed record still counts as it says. hivemind extrapolates each record by
``samples_per_second x (now - time)``, so a plausible rate with an old ``time`` still ends the epoch early.
"""

from __future__ import annotations

import logging
import math
import time
from typing import Any, Dict, Iterator, Optional, Tuple

from hivemind.optim.progress_tracker import LocalTrainingProgress
from hivemind.p2p import PeerID
from hivemind.utils import get_dht_time
from hivemind.utils.timed_storage import ValueWithExpiration


logger = logging.getLogger(__name__)

MAX_COUNT = 2**53  # epochs and samples: exact in a float, far beyond any run
MAX_SAMPLES_PER_SECOND = 1e7  # far beyond any one peer (a large GPU node trains thousands of samples/s)
CLOCK_SLACK_SECONDS = 60.0  # clocks of peers differ; hivemind allows 3 s of DHT time discrepancy
MAX_PEER_ID_BYTES = 128  # a libp2p peer id is a multihash of ~40 bytes

LOG_PERIOD_SECONDS = 600.0  # a refused sender is logged again after this long
_LOGGED: Dict[str, float] = {}  # sender -> when its refusal was last logged


def check_progress_record(value: Any, now: float) -> LocalTrainingProgress:
    """One peer's progress record (the dict stored in the DHT) parsed and checked.

    A record's ``time`` may be old: hivemind re-publishes an idle peer's last progress with its old time.

    Args:
        value: the record's value as the DHT returned it.
        now: the current DHT time (a record's ``time`` may be :data:`CLOCK_SLACK_SECONDS` ahead of it).

    Raises:
        ValueError: the reason the record is malformed (not a record, a count out of ``[0, 2**53)``, a negative,
            non-finite or implausible rate, a negative or non-finite time, or one in the future).
    """
    if not isinstance(value, dict):
        raise ValueError(f"a {type(value).__name__}, not a progress record")
    if not isinstance(value.get("peer_id"), bytes):  # pydantic would turn a number or a string into bytes
        raise ValueError(f"a peer id of type {type(value.get('peer_id')).__name__}")
    try:
        record = LocalTrainingProgress.parse_obj(value)
    except Exception as e:
        raise ValueError(f"not a progress record ({type(e).__name__})") from None
    if len(record.peer_id) > MAX_PEER_ID_BYTES:
        raise ValueError(f"a peer id of {len(record.peer_id)} bytes")
    for name in ("epoch", "samples_accumulated"):
        if not 0 <= getattr(record, name) < MAX_COUNT:
            raise ValueError(f"{name} {getattr(record, name)} out of [0, 2**53)")
    if not (math.isfinite(record.samples_per_second) and 0 <= record.samples_per_second <= MAX_SAMPLES_PER_SECOND):
        raise ValueError(f"samples_per_second {record.samples_per_second} out of [0, {MAX_SAMPLES_PER_SECOND:g}]")
    if not (math.isfinite(record.time) and 0 <= record.time <= now + CLOCK_SLACK_SECONDS):
        raise ValueError(f"time {record.time} is not a time before now ({now:.0f})")
    return record


def record_sender(value: Any, subkey: Any) -> str:
    """A printable name for a record's sender: the peer id it claims, else a prefix of its DHT subkey."""
    peer_id = value.get("peer_id") if isinstance(value, dict) else None
    if isinstance(peer_id, bytes) and 0 < len(peer_id) <= MAX_PEER_ID_BYTES:
        try:
            return str(PeerID(peer_id))
        except Exception:
            pass
    return f"subkey {bytes(subkey)[:24].hex() if isinstance(subkey, bytes) else type(subkey).__name__}"


def well_formed_records(metadata: Any, now: float, keep: Optional[Any] = None) -> Dict[Any, Any]:
    """The DHT's progress dict (subkey -> ValueWithExpiration of a record, or of None for "left the run") without
    the malformed entries; each sender refused is logged once per :data:`LOG_PERIOD_SECONDS`.

    Args:
        metadata: what ``dht.get(progress_key, latest=True).value`` returned (anything: nothing kept if not a dict).
        now: the current DHT time, see :func:`check_progress_record`.
        keep: a subkey kept without checks (this peer's own record, which the caller replaces).
    """
    if not isinstance(metadata, dict):
        return {}
    kept = {}
    for subkey, entry in metadata.items():
        value = getattr(entry, "value", None)
        if subkey == keep or (isinstance(entry, ValueWithExpiration) and value is None):
            kept[subkey] = entry
            continue
        try:
            if not isinstance(entry, ValueWithExpiration):
                raise ValueError(f"a {type(entry).__name__}, not a DHT value")
            check_progress_record(value, now)
        except ValueError as e:
            _log_refusal(record_sender(value, subkey), str(e))
            continue
        kept[subkey] = entry
    return kept


def valid_records(records: Any) -> Iterator[Tuple[PeerID, LocalTrainingProgress]]:
    """(peer id, record) of each well-formed record of a DHT progress dict (see :func:`check_progress_record`);
    malformed ones are skipped silently (:func:`well_formed_records` logs them where the tracker reads them)."""
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


def note_counts(seen: Dict[Tuple[PeerID, int], float], records: Any) -> None:
    """Keep in ``seen`` each peer's largest ``samples_accumulated`` per epoch from the progress ``records`` (a DHT
    progress dict). A peer id claimed by several records keeps the largest count (a peer cannot lower another's)."""
    for peer, record in valid_records(records):
        key = (peer, int(record.epoch))
        seen[key] = max(seen.get(key, 0.0), float(record.samples_accumulated))


def _log_refusal(sender: str, reason: str) -> None:
    last = _LOGGED.get(sender)
    if last is None or time.monotonic() - last >= LOG_PERIOD_SECONDS:
        _LOGGED[sender] = time.monotonic()
        logger.warning(f"[lightning_swarm] ignored the progress record of {sender}: {reason}")
