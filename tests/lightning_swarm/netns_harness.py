"""Peers on shaped links: Linux network namespaces joined by a bridge, each link limited by a token bucket (tc tbf).

    with shaped_network(["home", "home"]) as net:        # two peers, each behind a 50 Mbit/s link
        net.namespaces[0], net.addresses[0]                # run peer 0 with `ip netns exec <ns> ...` on that address

Topology: one hub namespace holds a bridge; every peer namespace is joined to it by a veth pair whose two ends are
shaped (peer end: upload, hub end: download), so two peers talk through two links of their profiles, like two
homes over the Internet. All interfaces are created inside namespaces of this harness (never in the caller's
namespace), addressed from the benchmarking range 198.18.0.0/15, and every namespace is deleted at exit, also on
failure (which deletes their interfaces).

What the links leave out: this kernel has no netem, so there is no propagation delay and no random loss; the only
delay is the queueing of the token bucket (at most `latency` per direction, packets beyond it are dropped).
Needs root and iproute2 (`ip`, `tc`).

libp2p's DHT drops addresses of 198.18.0.0/15 (go-multiaddr counts the range as neither public nor private): peers
find each other only through addresses they are given. Give each new peer the addresses of all (reachable) peers
started before it as initial peers; with only the first one's, the others' all-reduce parts between each other never
arrive (4 peers: "Reducer: received 50.0% of input tensors" in every round).
"""

from __future__ import annotations

import contextlib
import ipaddress
import os
import secrets
import shutil
import subprocess
from dataclasses import dataclass
from typing import Dict, Iterator, List, Sequence

BENCHMARK_RANGE = ipaddress.ip_network("198.18.0.0/15")  # RFC 2544: never routed on the Internet


@dataclass(frozen=True)
class LinkProfile:
    """One direction's shaping of a peer's link: `rate_mbit` megabits per second, token bucket `burst_kb` kilobytes,
    packets queued longer than `latency_ms` milliseconds are dropped."""

    rate_mbit: float
    burst_kb: int
    latency_ms: int = 200

    @property
    def bytes_per_second(self) -> float:
        return self.rate_mbit * 1e6 / 8


PROFILES: Dict[str, LinkProfile] = {
    # burst must hold at least one timer tick of traffic (rate / HZ), or tbf cannot reach its rate
    "datacenter": LinkProfile(rate_mbit=1000, burst_kb=512),
    "home": LinkProfile(rate_mbit=50, burst_kb=64),
    "poor": LinkProfile(rate_mbit=10, burst_kb=64),
}


def network_harness_available() -> str:
    """An empty string if this process can build the namespaces, else why not."""
    if os.geteuid() != 0:
        return "network namespaces need root"
    missing = [tool for tool in ("ip", "tc") if shutil.which(tool) is None]
    return f"missing {', '.join(missing)} (apt-get install iproute2)" if missing else ""


def _run(*command: str) -> None:
    result = subprocess.run(command, capture_output=True, text=True)
    if result.returncode != 0:
        raise RuntimeError(f"{' '.join(command)} failed ({result.returncode}): {result.stderr.strip()}")


def _shape(namespace: str, interface: str, profile: LinkProfile) -> None:
    _run("tc", "-n", namespace, "qdisc", "add", "dev", interface, "root", "tbf", "rate", f"{profile.rate_mbit}mbit",
         "burst", f"{profile.burst_kb}kb", "latency", f"{profile.latency_ms}ms")


@dataclass
class ShapedNetwork:
    """What shaped_network built: peer i lives in `namespaces[i]` with address `addresses[i]` on a link of
    `profiles[i]`."""

    namespaces: List[str]
    addresses: List[str]
    profiles: List[LinkProfile]

    def command(self, index: int, argv: Sequence[str]) -> List[str]:
        """argv run inside peer `index`'s namespace (ip netns exec keeps the pid: signals reach the program)."""
        return ["ip", "netns", "exec", self.namespaces[index], *argv]

    def host_maddrs(self, index: int) -> List[str]:
        """hivemind listen addresses of peer `index`: its link address, any free TCP port."""
        return [f"/ip4/{self.addresses[index]}/tcp/0"]


def _random_subnet() -> ipaddress.IPv4Network:
    """A random /24 of the benchmarking range, so that parallel harnesses don't share addresses."""
    subnets = 2 ** (24 - BENCHMARK_RANGE.prefixlen)
    index = secrets.randbelow(subnets)
    return ipaddress.ip_network((int(BENCHMARK_RANGE.network_address) + index * 256, 24))


@contextlib.contextmanager
def shaped_network(profiles: Sequence[str]) -> Iterator[ShapedNetwork]:
    """Build one namespace per entry of `profiles` (names of PROFILES) behind a shaped link to a shared bridge.

    Names carry a random tag (namespaces ``lsw<tag>-hub``, ``lsw<tag>-<i>``) so parallel runs don't clash. Stop the
    processes you started inside before leaving the block: a namespace lives as long as a process is in it.
    """
    reason = network_harness_available()
    if reason:
        raise RuntimeError(f"cannot build network namespaces: {reason}")
    if len(profiles) > 250:
        raise ValueError("at most 250 peers per shaped network (one /24)")
    links = [PROFILES[name] for name in profiles]
    tag = secrets.token_hex(3)
    hub = f"lsw{tag}-hub"
    subnet = _random_subnet()
    created: List[str] = []
    try:
        _run("ip", "netns", "add", hub)
        created.append(hub)
        _run("ip", "-n", hub, "link", "add", "br0", "type", "bridge")
        _run("ip", "-n", hub, "link", "set", "br0", "up")
        namespaces, addresses = [], []
        for index, link in enumerate(links):
            namespace = f"lsw{tag}-{index}"
            _run("ip", "netns", "add", namespace)
            created.append(namespace)
            _run("ip", "-n", namespace, "link", "set", "lo", "up")
            # both ends are created directly inside their namespaces: nothing appears in the caller's namespace
            _run("ip", "link", "add", "eth0", "netns", namespace, "type", "veth", "peer", "name", f"p{index}",
                 "netns", hub)
            address = str(subnet.network_address + index + 1)
            _run("ip", "-n", namespace, "addr", "add", f"{address}/{subnet.prefixlen}", "dev", "eth0")
            _run("ip", "-n", namespace, "link", "set", "eth0", "up")
            _run("ip", "-n", hub, "link", "set", f"p{index}", "master", "br0")
            _run("ip", "-n", hub, "link", "set", f"p{index}", "up")
            _shape(namespace, "eth0", link)  # upload
            _shape(hub, f"p{index}", link)  # download
            namespaces.append(namespace)
            addresses.append(address)
        yield ShapedNetwork(namespaces=namespaces, addresses=addresses, profiles=links)
    finally:
        for namespace in reversed(created):
            subprocess.run(["ip", "netns", "del", namespace], capture_output=True)
