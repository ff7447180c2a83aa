"""Starting a peer's DHT node: record validators, authentication and the message telling others how to join."""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
from typing import List, Optional

import hivemind
from lightning.pytorch.utilities.rank_zero import rank_zero_warn

from lightning_swarm import metrics as swarm_metrics
from lightning_swarm.auth.peer import SwarmAuth
from lightning_swarm.hivemind_ext.lifetime import SwarmDHT
from lightning_swarm.hivemind_ext.relayed_messages import write_identity
from lightning_swarm.peers import INITIAL_PEERS_ENV, join_message, reachable_maddrs

log = logging.getLogger(__name__)


def start_peer_dht(
    run_id: str,
    *,
    initial_peers: List[str],
    host_maddrs: List[str],
    announce_maddrs: Optional[List[str]],
    client_mode: bool,
    use_relay: bool,
    use_auto_relay: bool,
    identity_path: Optional[str],
    swarm_auth: Optional[SwarmAuth],
) -> hivemind.DHT:
    """Start this peer's DHT node and print how other peers can join (arguments as in HivemindStrategy).

    Args:
        swarm_auth: this peer's credentials in a run with an authority (None: an open run). Its token is fetched
            first, so a peer with no, expired or refused token stops here with one line saying so.
    """
    dht_kwargs = dict(
        host_maddrs=host_maddrs,
        client_mode=client_mode,
        use_relay=use_relay,
        use_auto_relay=use_auto_relay,
        identity_path=identity_path,
    )
    if announce_maddrs:
        dht_kwargs["announce_maddrs"] = announce_maddrs
    if swarm_auth is not None:
        from lightning_swarm.auth.authorizer import OwnerIsRequesterValidator, SwarmAuthorizer

        swarm_auth.token()  # no, expired or refused token: stop here with one line saying so
        swarm_auth.install()  # sign records with the token's key (before the validators take it)
        dht_kwargs["authorizer"] = SwarmAuthorizer(swarm_auth)
    # the metrics validators sign with the process's key: made only after install() set it. Always (a peer that
    # publishes nothing still stores others' records): first in line, they absorb the progress tracker's validators
    # and check each record once (lightning_swarm.record_validators)
    validators = swarm_metrics.make_validators(run_id)
    if swarm_auth is not None:
        validators = validators + [OwnerIsRequesterValidator()]
    generated = None
    if identity_path is None:
        # a fresh identity whose key this peer holds (p2pd's own would be out of reach): client-mode members sign the
        # verification messages that reachable members relay between them with it. Read by p2pd at start, then removed.
        generated = tempfile.mkdtemp(prefix="lightning_swarm_identity_")
        dht_kwargs["identity_path"] = os.path.join(generated, "identity.key")
        identity_der = write_identity(dht_kwargs["identity_path"])
        dht_kwargs["check_if_identity_free"] = False  # new: nobody holds it
    try:
        # SwarmDHT: its process and p2pd die with this one, also when it is SIGKILLed
        dht = SwarmDHT(initial_peers=initial_peers or None, start=True, record_validators=validators, **dht_kwargs)
        if generated is not None:
            dht.identity_key_der = identity_der
    except Exception as e:
        if not initial_peers:
            raise
        # a swarm with an authority does not answer a peer without a valid token: say so, in one line
        hint = ("" if swarm_auth is not None else " If the run has an authority, this peer needs an "
                "access token (HivemindStrategy(auth=...) or $LIGHTNING_SWARM_AUTH_*, see docs/security.md).")
        raise RuntimeError(f"[lightning_swarm] could not join run {run_id!r}: none of its initial peers "
                           f"answered ({e}).{hint}") from e
    finally:
        if generated is not None:
            shutil.rmtree(generated, ignore_errors=True)
    if not client_mode:
        message = join_message(run_id, reachable_maddrs(dht.get_visible_maddrs()))
        log.info(message)
        print(message, flush=True)  # visible whatever the logging configuration
    elif not initial_peers:
        rank_zero_warn(f"client_mode=True with no initial_peers (nor ${INITIAL_PEERS_ENV}): nobody to join")
    return dht
