"""Multiaddr checking, initial peers from the environment, and the "how to join" message.

A multiaddr names a way to reach a peer, e.g. ``/ip4/203.0.113.7/tcp/31337/p2p/QmPeerId...``. Initial peers
(the peers a new peer first connects to) must end with ``/p2p/<peer id>``; listen/announce addresses must not.
"""

from __future__ import annotations

import ipaddress
import json
import os
import re
from typing import List, Optional, Sequence, Union

from hivemind.utils.multiaddr import Multiaddr

# Environment variable read when `initial_peers` is not given: multiaddrs separated by commas and/or spaces.
INITIAL_PEERS_ENV = "LIGHTNING_SWARM_INITIAL_PEERS"


def parse_multiaddr(address: str, option: str, require_peer_id: bool = False) -> Multiaddr:
    """Parse one multiaddr or raise a ValueError that names the option and the bad address."""
    if not isinstance(address, str) and not isinstance(address, Multiaddr):
        raise ValueError(f"{option}: expected a multiaddr string, got {address!r} ({type(address).__name__})")
    try:
        maddr = Multiaddr(str(address).strip())
    except Exception as e:  # hivemind's multiaddr raises several ParseError subclasses (ValueErrors)
        raise ValueError(
            f"{option}: {str(address)!r} is not a valid multiaddr ({e}). "
            f"Expected something like '/ip4/203.0.113.7/tcp/31337/p2p/QmPeerId...'"
        ) from None
    has_peer_id = "p2p" in [protocol.name for protocol in maddr.protocols()]
    if require_peer_id and not has_peer_id:
        raise ValueError(
            f"{option}: {str(address)!r} has no peer id. Copy the full address printed by the first peer, "
            f"ending in '/p2p/<peer id>'"
        )
    return maddr


def split_peer_list(peers: Union[None, str, Sequence[str]]) -> Optional[List[str]]:
    """Accept a list of multiaddrs, a JSON list in a string, or a comma/space separated string."""
    if peers is None:
        return None
    if isinstance(peers, str):
        text = peers.strip()
        if text.startswith("["):
            try:
                loaded = json.loads(text)
            except json.JSONDecodeError as e:
                raise ValueError(f"initial_peers: could not parse {text!r} as a JSON list ({e})") from None
            return [str(item) for item in loaded]
        return [item for item in re.split(r"[,\s]+", text) if item]
    return [str(item) for item in peers]


def resolve_initial_peers(initial_peers: Union[None, str, Sequence[str]]) -> List[str]:
    """The explicit `initial_peers` if given, else the ones in the environment variable, else none (new swarm).
    Every address is checked and must carry a peer id."""
    peers = split_peer_list(initial_peers)
    option = "initial_peers"
    if peers is None:
        peers = split_peer_list(os.environ.get(INITIAL_PEERS_ENV, "")) or []
        option = f"${INITIAL_PEERS_ENV}"
    for address in peers:
        parse_multiaddr(address, option, require_peer_id=True)
    return peers


def check_listen_maddrs(addresses: Optional[Sequence[str]], option: str) -> Optional[List[str]]:
    """Check `host_maddrs`/`announce_maddrs`: valid multiaddrs without a peer id (that is appended by libp2p)."""
    if addresses is None:
        return None
    if isinstance(addresses, str):
        addresses = split_peer_list(addresses)
    for address in addresses:
        maddr = parse_multiaddr(address, option)
        if "p2p" in [protocol.name for protocol in maddr.protocols()]:
            raise ValueError(f"{option}: {address!r} must not contain '/p2p/<peer id>'; only the transport part")
    return [str(address) for address in addresses]


def is_loopback(maddr: Multiaddr) -> bool:
    for protocol in ("ip4", "ip6"):
        try:
            return ipaddress.ip_address(maddr.value_for_protocol(protocol)).is_loopback
        except Exception:
            continue
    return False


def reachable_maddrs(visible_maddrs: Sequence[Multiaddr]) -> List[str]:
    """Addresses worth telling other machines about: non-loopback ones, or loopback ones if that's all we have."""
    non_loopback = [str(maddr) for maddr in visible_maddrs if not is_loopback(maddr)]
    return non_loopback or [str(maddr) for maddr in visible_maddrs]


def join_message(run_id: str, addresses: Sequence[str]) -> str:
    """The text a peer prints so that others can join its swarm."""
    addresses_json = json.dumps(list(addresses))
    return (
        f"\n[lightning_swarm] Swarm '{run_id}' is reachable at:\n"
        + "".join(f"    {address}\n" for address in addresses)
        + "To join this swarm from another machine, run the same command and add:\n"
        f"    --trainer.strategy.init_args.initial_peers='{addresses_json}'\n"
        f"or set the environment variable:\n"
        f"    {INITIAL_PEERS_ENV}=\"{','.join(addresses)}\"\n"
        f"or in Python: HivemindStrategy(..., initial_peers={addresses_json})\n"
    )
