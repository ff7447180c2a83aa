"""The monitor's decoder of the trainers' metrics records, as they come out of the DHT: checked field by field.

A record is whatever a peer stored under the run's metrics key (hivemind decoded its msgpack bytes; the DHT's
schema validator checks types, not values). Anyone can mint a key and publish one, so before a record reaches the
figures it must be a mapping of exactly :class:`~lightning_swarm.metrics.LocalMetrics`'s fields, each of its type
(no bool for an int, no int for a float) and inside plausible bounds (:data:`BOUNDS`): finite, not negative where
a count is meant, not so large that a sum of them overflows. A malformed record is ignored for that peer and
logged once per peer and reason; the others are unaffected.
"""

from __future__ import annotations

import hashlib
import itertools
import logging
import math
from typing import Any, Dict, Mapping, Optional, Tuple

from lightning_swarm.metrics import LocalMetrics

logger = logging.getLogger(__name__)

# (low, high) of each numeric field: far beyond any real run, small enough that the sum of a million records stays
# finite (|loss| * mini_steps * records < 1e6 * 1e9 * 1e6)
BOUNDS: Dict[str, Tuple[float, float]] = {
    "step": (0, 2 ** 40),  # global epochs
    "loss": (-1e6, 1e6),
    "samples_per_second": (0.0, 1e9),
    "samples_accumulated": (0, 2 ** 53),  # exact as a float
    "mini_steps": (0, 10 ** 9),
    "time": (0.0, 1e11),  # unix seconds: the year 5138
}
INT_FIELDS = ("step", "samples_accumulated", "mini_steps")
FLOAT_FIELDS = ("loss", "samples_per_second", "time")
MAX_TOKEN_CHARS = 16384  # an access token's JSON is well under 2 KiB
MAX_LOGGED = 10000  # (peer, reason) pairs remembered as logged


def peer_name(public_key: bytes) -> str:
    """A short stable name for a peer: the first 12 hex digits of the SHA-256 of its public key."""
    return hashlib.sha256(public_key).hexdigest()[:12]


class MalformedRecord(ValueError):
    """A metrics record that is not a plausible :class:`LocalMetrics`: ``reason`` is a short code (``fields``,
    ``type:loss``, ``range:loss``, ...), the message says more."""

    def __init__(self, reason: str, message: str):
        super().__init__(f"{reason}: {message}")
        self.reason = reason


def decode_metrics_record(value: Any) -> LocalMetrics:
    """The :class:`LocalMetrics` in ``value`` (a DHT value), or :class:`MalformedRecord` naming what is wrong."""
    if not isinstance(value, dict):
        raise MalformedRecord("not_a_mapping", f"a {type(value).__name__}")
    expected = set(INT_FIELDS) | set(FLOAT_FIELDS) | {"token"}
    if set(value) - expected or set(value) - {"token"} != expected - {"token"}:
        raise MalformedRecord("fields", f"fields differ from LocalMetrics' (missing "
                                        f"{sorted(expected - {'token'} - set(value))}, unknown "
                                        f"{[repr(k)[:40] for k in itertools.islice(set(value) - expected, 5)]})")
    fields: Dict[str, Any] = {}
    for name in INT_FIELDS + FLOAT_FIELDS:
        item = value[name]
        kinds = (int,) if name in INT_FIELDS else (float,)
        if type(item) not in kinds:  # exact type: bool is an int subclass, an int is not a float
            raise MalformedRecord(f"type:{name}", f"{name} is a {type(item).__name__}, not {kinds[0].__name__}")
        if isinstance(item, float) and not math.isfinite(item):
            raise MalformedRecord(f"range:{name}", f"{name} is not finite")
        low, high = BOUNDS[name]
        if not low <= item <= high:
            raise MalformedRecord(f"range:{name}", f"{name} lies outside [{low:g}, {high:g}]")
        fields[name] = item
    token = value.get("token", "")
    if type(token) is not str or len(token) > MAX_TOKEN_CHARS:
        raise MalformedRecord("type:token", f"token is not a string of at most {MAX_TOKEN_CHARS} characters")
    return LocalMetrics(token=token, **fields)


class MetricsDecoder:
    """Decodes every peer's record of one DHT read; a malformed record is dropped for its peer and logged once per
    (peer, reason). :attr:`malformed` counts the drops."""

    def __init__(self) -> None:
        self.malformed = 0
        self._logged: set = set()

    def decode_all(self, entries: Mapping[Any, Any]) -> Dict[bytes, LocalMetrics]:
        """``{public key: record}`` from the DHT's ``{subkey: ValueWithExpiration}`` of the metrics key."""
        records: Dict[bytes, LocalMetrics] = {}
        for key, entry in entries.items():
            if not isinstance(key, bytes):
                continue
            try:
                records[key] = decode_metrics_record(getattr(entry, "value", None))
            except MalformedRecord as e:
                self.malformed += 1
                if (key, e.reason) not in self._logged:
                    if len(self._logged) >= MAX_LOGGED:  # minted keys are free: the memory of who was logged is not
                        self._logged.clear()
                    self._logged.add((key, e.reason))
                    logger.warning(f"ignored a malformed metrics record of peer {peer_name(key)} ({e})")
        return records


def fetch_metric_records(dht: Any, run_id: str, decoder: Optional[MetricsDecoder] = None) -> Dict[bytes, LocalMetrics]:
    """The checked metrics records of every peer of ``run_id`` (see :class:`MetricsDecoder`)."""
    from lightning_swarm.metrics import metrics_key

    found = dht.get(metrics_key(run_id), latest=True)
    if found is None or not isinstance(found.value, dict):
        return {}
    return (decoder or MetricsDecoder()).decode_all(found.value)
