"""Moderator-signed revert orders: "in run R, the state of epoch E served by peer P is the run's state".

Reverting makes every trainer reload the state from one peer. Without an authority that is done by announcing a
higher epoch (any peer can do that); in a run with an authority, trainers jump epochs or prefer a state source
beyond what the other peers confirm only when a valid revert order names that epoch and that peer (see
:mod:`lightning_swarm.hivemind_ext.auth_guards`). The monitor publishes the order under the DHT key
``f"{run_id}_revert"``, subkey its own ``[owner:...]`` key (so no one else can overwrite its entry).
"""

from __future__ import annotations

import logging
from dataclasses import asdict, dataclass
from typing import Any, Optional

import hivemind
from hivemind.utils.crypto import RSAPrivateKey, RSAPublicKey
from hivemind.utils.timed_storage import get_dht_time

from lightning_swarm.logs import RateLimitedLog

logger = logging.getLogger(__name__)
_refusals = RateLimitedLog(logger, period=300.0)


def revert_key(run_id: str) -> str:
    """The DHT key of the run's revert orders."""
    return f"{run_id}_revert"


@dataclass(frozen=True)
class RevertOrder:
    """A moderator's order, signed with the run's authority key.

    run_id: the run; epoch: the epoch the reverted state is served as; peer_id: base58 libp2p id of the peer
    serving it (the monitor); checkpoint: where the state came from (for the logs); expires: unix time after
    which the order no longer counts; signature: the authority's signature over all of the above.
    """

    run_id: str
    epoch: int
    peer_id: str
    checkpoint: str
    expires: float
    signature: str = ""

    def signed_bytes(self) -> bytes:
        return "\n".join(["lightning-swarm-revert/v1", self.run_id, str(self.epoch), self.peer_id, self.checkpoint,
                          repr(float(self.expires))]).encode()

    @classmethod
    def create(cls, authority_key: RSAPrivateKey, run_id: str, epoch: int, peer_id: str, checkpoint: str,
               lifetime: float) -> "RevertOrder":
        unsigned = cls(run_id, int(epoch), str(peer_id), str(checkpoint), float(get_dht_time() + lifetime))
        return cls(**dict(asdict(unsigned), signature=authority_key.sign(unsigned.signed_bytes()).decode()))

    @classmethod
    def parse(cls, value: Any) -> Optional["RevertOrder"]:
        """The order in a DHT value, or None if it is not shaped like one."""
        if not isinstance(value, dict):
            return None
        try:
            order = cls(str(value["run_id"]), int(value["epoch"]), str(value["peer_id"]), str(value["checkpoint"]),
                        float(value["expires"]), str(value["signature"]))
        except (KeyError, TypeError, ValueError):
            return None
        return order

    def is_valid(self, authority_public_key: RSAPublicKey, run_id: str) -> bool:
        return (self.run_id == run_id and self.expires > get_dht_time()
                and authority_public_key.verify(self.signed_bytes(), self.signature.encode()))


def publish_revert_order(dht: hivemind.DHT, order: RevertOrder) -> None:
    """Store ``order`` under the run's revert key, signed (subkey) with this process's key; expires with it."""
    from hivemind.dht.crypto import RSASignatureValidator

    dht.store(revert_key(order.run_id), subkey=RSASignatureValidator().local_public_key, value=asdict(order),
              expiration_time=order.expires)


def fetch_revert_order(dht: hivemind.DHT, run_id: str, authority_public_key: RSAPublicKey) -> Optional[RevertOrder]:
    """The newest valid revert order of the run (None if there is none); forged ones are logged and ignored."""
    found = dht.get(revert_key(run_id), latest=True)
    if found is None or not isinstance(found.value, dict):
        return None
    best = None
    for entry in found.value.values():
        order = RevertOrder.parse(getattr(entry, "value", None))
        if order is None or not order.is_valid(authority_public_key, run_id):
            _refusals(logging.WARNING, f"[lightning_swarm] ignored a revert order of run {run_id!r} that is not "
                                       f"signed by its authority (or expired): {str(getattr(entry, 'value', None))[:160]}")
            continue
        if best is None or order.epoch > best.epoch:
            best = order
    return best
