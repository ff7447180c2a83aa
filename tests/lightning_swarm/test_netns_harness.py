"""The network harness: shaped links between namespaces, and nothing left behind."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest

from netns_harness import PROFILES, network_harness_available, shaped_network

pytestmark = pytest.mark.skipif(bool(network_harness_available()), reason=network_harness_available() or "ok")

SERVER = """
import socket, sys
server = socket.socket(); server.bind((sys.argv[1], 5001)); server.listen(1)
print("ready", flush=True)
connection, _ = server.accept(); received = 0
while True:
    data = connection.recv(1 << 16)
    if not data:
        break
    received += len(data)
print(received, flush=True)
"""
CLIENT = """
import socket, sys
connection = socket.create_connection((sys.argv[1], 5001), timeout=30)
connection.sendall(b"x" * int(sys.argv[2])); connection.close()
"""


def _our_namespaces(tag_prefix: str) -> list:
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=True).stdout
    return [line.split()[0] for line in listed.splitlines() if line.startswith(tag_prefix)]


def test_a_transfer_takes_at_least_the_link_time_and_everything_is_removed():
    size = 3_000_000  # 0.48 s at 50 Mbit/s: a lower bound that no machine load can beat
    with shaped_network(["home", "home"]) as net:
        prefix = net.namespaces[0].split("-")[0]
        assert len(_our_namespaces(prefix)) == 3  # two peers and the hub
        assert all(address.startswith("198.1") for address in net.addresses)
        qdiscs = subprocess.run(["tc", "-n", net.namespaces[0], "qdisc", "show", "dev", "eth0"], capture_output=True,
                                text=True, check=True).stdout
        assert "tbf" in qdiscs and "50Mbit" in qdiscs, qdiscs
        server = subprocess.Popen(net.command(1, [sys.executable, "-c", SERVER, net.addresses[1]]),
                                  stdout=subprocess.PIPE, text=True)
        try:
            assert server.stdout.readline().strip() == "ready"
            start = time.perf_counter()
            subprocess.run(net.command(0, [sys.executable, "-c", CLIENT, net.addresses[1], str(size)]), check=True,
                           timeout=60)
            received = int(server.stdout.readline())
            elapsed = time.perf_counter() - start
        finally:
            server.kill()
            server.wait()
        assert received == size
        bound = size / PROFILES["home"].bytes_per_second
        burst = PROFILES["home"].burst_kb * 1024 / PROFILES["home"].bytes_per_second
        assert elapsed >= bound - burst, (elapsed, bound)
    assert _our_namespaces(prefix) == []


def test_namespaces_are_removed_when_the_block_fails():
    with pytest.raises(KeyError):
        with shaped_network(["poor"]) as net:
            prefix = net.namespaces[0].split("-")[0]
            raise KeyError("boom")
    assert _our_namespaces(prefix) == []


def test_an_unknown_profile_is_refused_before_anything_is_built():
    with pytest.raises(KeyError):
        with shaped_network(["fibre"]):
            pass
