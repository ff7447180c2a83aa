"""What the seam's authentication guards need from a run's credentials, without importing who provides them.

:class:`~lightning_swarm.auth.peer.SwarmAuth` implements :class:`PeerCredentials`; the guards in
:mod:`~lightning_swarm.hivemind_ext.auth_guards` and :class:`~lightning_swarm.hivemind_ext.optimizer.SwarmOptimizer`
only call the methods below, so ``lightning_swarm.auth`` can build on this package (its keys live here) and this
package never imports it.
"""

from __future__ import annotations

from typing import Any, Optional, Protocol


class CredentialsError(PermissionError):
    """This peer has no valid credentials for the run (no, expired or refused token): the message says which.
    ``lightning_swarm.auth.tokens.AuthError`` is one."""


class Verdict(Protocol):
    """Whether another peer's credentials are good, and if not a reason a person can act on; if they are, the
    ``user`` they name (one vote per person: a group seats each user once)."""

    ok: bool
    reason: str
    user: str


class RevertOrder(Protocol):
    """A moderator's signed order to reload the run's state of ``epoch`` from peer ``peer_id`` (base58)."""

    epoch: int
    peer_id: str
    checkpoint: str


class PeerCredentials(Protocol):
    """This peer's credentials in a run with an authority, and the checks of the other peers' ones."""

    def join_proof(self, prefix: str, peer_id: bytes) -> Any:
        """The proof this peer sends to the members of an averaging group of ``prefix`` (its libp2p id: ``peer_id``);
        raises :class:`CredentialsError` if this peer has no valid token."""

    def check_join_proof(self, proof: Any, prefix: str, peer_id: bytes) -> Verdict:
        """Whether ``proof`` (None or anything a peer sent) admits peer ``peer_id`` to a group of ``prefix``: a valid
        token, signed over ``prefix`` and ``peer_id``, and not superseded by a newer key of the same user."""

    def revert_order(self, dht: Any) -> Optional[RevertOrder]:
        """The newest valid revert order of the run in ``dht`` (a hivemind.DHT), or None."""
