"""Who made a metrics record, in a run with an authority: the user named by the access token the record carries.

A metrics record is signed by its peer's key (the DHT subkey ``[owner:ssh-rsa ...]``), but any key can be minted.
In a run with an authority every trainer puts its access token into its records
(:attr:`lightning_swarm.metrics.LocalMetrics.token`); the record's user is the token's, if the token is signed by
the run's authority for this run, is unexpired, and is for the very key that signed the record (a token copied
from another peer's record names a key the copier cannot sign with). Anything else is no one: the monitor keeps
such records out of its figures and its contribution table (:class:`~lightning_swarm.monitor.aggregate.RecordScreen`).
"""

from __future__ import annotations

from typing import Callable, Optional

from lightning_swarm.auth.peer import SwarmAuth
from lightning_swarm.auth.tokens import token_from_json
from lightning_swarm.metrics import LocalMetrics

OWNER_MARKER = b"[owner:%s]"  # hivemind.dht.crypto.RSASignatureValidator's subkey for a public key


def token_identity(auth: SwarmAuth) -> Callable[[bytes, LocalMetrics], Optional[str]]:
    """The monitor's ``identify`` hook for a run with an authority.

    Args:
        auth: the monitor's credentials (it needs only the run id and the authority's public key).

    Returns a function of (record's signing key, record) -> the token's user name, or None (no valid token for that
    key).
    """

    def identify(key: bytes, record: LocalMetrics) -> Optional[str]:
        if not record.token:
            return None
        try:
            token = token_from_json(record.token)
        except ValueError:
            return None
        if key != OWNER_MARKER % token.public_key:
            return None
        return token.username if auth.check(token).ok else None

    return identify
