"""hivemind's DHT record validators, remembering the records they accepted.

A peer's DHT process validates every record it receives: each ``get`` answer and each ``store`` request. The trackers
of a swarm of N peers fetch the N progress (and metrics) records every refresh period, and a record stays the same
bytes until its owner stores it again, so the same record is checked again and again: its owner's key parsed from
the subkey, its RSA signature verified, its value parsed by pydantic. At 16 peers on 2 cores these checks were the
DHT processes' largest cost (py-spy, docs/swarm-at-scale.md). A validator here checks a record once and remembers its
digest; the same bytes later (key, subkey, value and expiration time: a new expiration is a new record) pass without
the work. Only accepted records are remembered (a check is deterministic: the same bytes get the same answer), in a
bounded table, so a stranger's flood of records costs what it cost before.

Both are the hivemind classes (public API) with the same arguments. Passed first to the DHT (``record_validators``),
they absorb the ones hivemind's progress tracker adds later (hivemind merges an ``RSASignatureValidator`` into the
first one it has, and a ``SchemaValidator`` into the first ``SchemaValidator``).
"""

from __future__ import annotations

import dataclasses
import hashlib
from collections import OrderedDict

from hivemind.dht.crypto import RSASignatureValidator
from hivemind.dht.schema import SchemaValidator
from hivemind.dht.validation import DHTRecord
from hivemind.utils import MSGPackSerializer

__all__ = ["CachedSchemaValidator", "CachedSignatureValidator", "RememberAccepted"]

DEFAULT_REMEMBERED = 8192  # records: 32-byte digests, ~1 MB with the table's overhead


class RememberAccepted:
    """Mixin for a hivemind ``RecordValidatorBase``: ``validate`` checks a record once; the same record later passes
    at the cost of one SHA-256 of its bytes.

    Args:
        remembered: how many accepted records to remember (the least recently seen are forgotten first).
    """

    def __init__(self, *args, remembered: int = DEFAULT_REMEMBERED, **kwargs):
        if remembered < 1:
            raise ValueError(f"remembered must be at least 1 record, got {remembered!r}")
        super().__init__(*args, **kwargs)
        self._accepted: OrderedDict[bytes, None] = OrderedDict()
        self._remembered = remembered
        self.checked = 0  # records checked in full (for benchmarks)
        self.recalled = 0  # records that passed because they were accepted before

    def validate(self, record: DHTRecord) -> bool:
        digest = hashlib.sha256(MSGPackSerializer.dumps(dataclasses.astuple(record))).digest()
        if digest in self._accepted:
            self._accepted.move_to_end(digest)
            self.recalled += 1
            return True
        self.checked += 1
        accepted = super().validate(record)
        if accepted:
            self._accepted[digest] = None
            if len(self._accepted) > self._remembered:
                self._accepted.popitem(last=False)
        return accepted

    def merge_with(self, other) -> bool:
        merged = super().merge_with(other)
        if merged:  # another schema may now know a key that passed as unknown: check everything again
            self._accepted.clear()
        return merged


class CachedSignatureValidator(RememberAccepted, RSASignatureValidator):
    """hivemind's ``RSASignatureValidator`` (same arguments, and ``remembered``), checking each record once."""


class CachedSchemaValidator(RememberAccepted, SchemaValidator):
    """hivemind's ``SchemaValidator`` (same arguments, and ``remembered``), checking each record once. It forgets
    what it accepted when another schema is merged in (a record that passed under an unknown key may now be checked
    against a schema)."""
