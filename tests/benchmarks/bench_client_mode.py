"""What client-mode peers cost the reachable ones (figures printed, nothing asserted).

N peers (BENCH_PEERS, default 4), each in its own network namespace behind a shaped link (BENCH_PROFILE, default home:
50 Mbit/s each way, tests/lightning_swarm/netns_harness.py), average BENCH_MPARAMS million fp32 values (no codec)
in one group of all N, BENCH_ROUNDS times, with hivemind's DecentralizedAverager as the strategy builds it
(load balancing included). Each configuration of BENCH_CLIENTS (default "0,2,3": how many of the N peers run their
DHT and averager in client mode) prints, per kind of peer, the seconds per round and the bytes its link sent and
received per round (the interface counters of its namespace, DHT traffic included), next to the model:

    a client-mode peer accepts no connection, so hivemind's load balancing gives it nothing to reduce: the r reachable
    peers of a group of g reduce everything, and each sends and receives S (1 + (g - 2) / r) per round (S: the
    tensors' bytes), against S 2 (g - 1) / g when all g are reachable; a client-mode peer sends and receives S.

Run (root, iproute2):  python tests/benchmarks/bench_client_mode.py
     BENCH_PEERS=8 BENCH_CLIENTS=0,4,6 BENCH_MPARAMS=2 BENCH_PROFILE=home python tests/benchmarks/bench_client_mode.py
The links have no propagation delay and no loss (no netem in this kernel): the figures are bandwidth- and CPU-bound.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from paths import REPO  # noqa: E402

sys.path.insert(0, str(REPO / "tests" / "lightning_swarm"))
from netns_harness import PROFILES, network_harness_available, shaped_network  # noqa: E402

NUM_PEERS = int(os.environ.get("BENCH_PEERS", "4"))
CLIENTS = [int(count) for count in os.environ.get("BENCH_CLIENTS", "0,2,3").split(",")]
MPARAMS = float(os.environ.get("BENCH_MPARAMS", "5"))
ROUNDS = int(os.environ.get("BENCH_ROUNDS", "4"))
PROFILE = os.environ.get("BENCH_PROFILE", "home")
LOG_DIR = os.environ.get("BENCH_LOG_DIR")  # the peers' stderr goes to files here when set, else nowhere
TIMEOUT = float(os.environ.get("BENCH_TIMEOUT", "600"))  # seconds per configuration, then its peers are killed
NUM_TENSORS = 10


def link_bytes() -> tuple:
    """(sent, received) bytes of this namespace's link so far."""
    stats = Path("/sys/class/net/eth0/statistics")
    return int((stats / "tx_bytes").read_text()), int((stats / "rx_bytes").read_text())


def peer(address: str, initial_peers: str, client_mode: bool, num_params: int, group_size: int, rounds: int) -> None:
    """One averaging peer (runs inside its namespace): joins ``initial_peers`` (comma-separated multiaddrs, none:
    the first peer), prints MADDR, then one RESULT line, then stays online until its stdin is closed (its groupmates
    may still be receiving its last parts)."""
    from lightning_swarm.hivemind_ext.lifetime import SwarmDHT  # hivemind.DHT whose death is noticed
    import torch
    from hivemind.averaging import DecentralizedAverager
    from hivemind.compression import NoCompression

    torch.set_num_threads(1)
    dht = SwarmDHT(initial_peers=initial_peers.split(",") if initial_peers else None,
                   host_maddrs=[f"/ip4/{address}/tcp/0"], client_mode=client_mode, start=True)
    print("MADDR", dht.get_visible_maddrs()[0], flush=True)
    torch.manual_seed(len(address))
    tensors = [torch.randn(num_params // NUM_TENSORS) for _ in range(NUM_TENSORS)]
    averager = DecentralizedAverager(
        tensors, dht=dht, prefix="bench_client", target_group_size=group_size, min_group_size=group_size,
        min_matchmaking_time=3.0, request_timeout=1.5, next_chunk_timeout=30.0, compression=NoCompression(),
        client_mode=client_mode, start=True)
    seconds, sent, received, sizes = [], [], [], []
    for _ in range(rounds):
        start, (tx, rx) = time.perf_counter(), link_bytes()
        group = averager.step(timeout=600)
        seconds.append(time.perf_counter() - start)
        tx_end, rx_end = link_bytes()
        sent.append(tx_end - tx)
        received.append(rx_end - rx)
        sizes.append(len(group) if group else 0)
    print("RESULT", json.dumps(dict(client_mode=client_mode, seconds=seconds, sent=sent, received=received,
                                    group_sizes=sizes)), flush=True)
    sys.stdin.read()
    averager.shutdown()
    dht.shutdown()


def run_swarm(num_clients: int) -> list:
    """Run one configuration; returns every peer's RESULT (the last ``num_clients`` peers are in client mode)."""
    me = [sys.executable, __file__, "peer"]
    num_params = int(MPARAMS * 1e6)
    env = dict(os.environ, PYTHONPATH=str(REPO))
    processes = []
    with shaped_network([PROFILE] * NUM_PEERS) as net:
        try:
            def start(index: int, initial: str) -> subprocess.Popen:
                client = index >= NUM_PEERS - num_clients
                args = [net.addresses[index], initial, str(int(client)), str(num_params), str(NUM_PEERS), str(ROUNDS)]
                log = open(Path(LOG_DIR) / f"clients{num_clients}-peer{index}.log", "w") if LOG_DIR else None
                process = subprocess.Popen(net.command(index, me + args), stdin=subprocess.PIPE,
                                           stdout=subprocess.PIPE, stderr=log or subprocess.DEVNULL, text=True,
                                           start_new_session=True, env=env)
                processes.append(process)
                return process

            # every peer joins all reachable peers started before it: libp2p's DHT drops addresses of the benchmarking
            # range 198.18.0.0/15 (unroutable to go-multiaddr), so peers could not find each other through peer 0
            reachable_maddrs = []
            for index in range(NUM_PEERS):
                process = start(index, ",".join(reachable_maddrs))
                maddr = next((line.split()[1] for line in process.stdout if line.startswith("MADDR")), None)
                if maddr is None:
                    raise RuntimeError(f"peer {index} printed no MADDR")
                if index < NUM_PEERS - num_clients:
                    reachable_maddrs.append(maddr)
            # a peer that hangs is killed, so that reading its output below ends
            watchdog = threading.Timer(TIMEOUT, lambda: [os.killpg(p.pid, 9) for p in processes if p.poll() is None])
            watchdog.daemon = True
            watchdog.start()
            results = []
            for process in processes:
                line = next((line for line in process.stdout if line.startswith("RESULT")), None)
                results.append(json.loads(line.split(" ", 1)[1]) if line else None)
            return results
        finally:
            for process in processes:
                if process.poll() is None:
                    try:
                        process.stdin.close()
                        process.wait(timeout=20)
                    except (subprocess.TimeoutExpired, BrokenPipeError):
                        os.killpg(process.pid, 9)
                        process.wait()


def model_bytes(size: float, group: int, reachable: int, client: bool) -> float:
    """Bytes each way per round of one peer, by the load-balancing model in the module docstring."""
    if client:
        return size
    return size * (1 + (group - 2) / reachable)


def main() -> None:
    reason = network_harness_available()
    if reason:
        sys.exit(f"cannot run: {reason}")
    size = int(MPARAMS * 1e6) // NUM_TENSORS * NUM_TENSORS * 4
    rate = PROFILES[PROFILE].bytes_per_second
    print(f"== {NUM_PEERS} peers, one group, {MPARAMS:g}M fp32 values ({size / 1e6:.0f} MB), {PROFILE} links "
          f"({PROFILES[PROFILE].rate_mbit:g} Mbit/s each way), {ROUNDS} rounds; round 1 (warm-up) left out")
    print(f"{'clients':>7s} {'peer kind':>9s} {'s/round':>8s} {'MB sent/round':>13s} {'MB recv/round':>13s} "
          f"{'model MB':>8s} {'model s':>7s} {'groups':>8s}")
    for num_clients in CLIENTS:
        results = run_swarm(num_clients)
        reachable = NUM_PEERS - num_clients
        for kind, client in (("reachable", False), ("client", True)):
            mine = [r for r in results if r is not None and r["client_mode"] == client]
            if not mine:
                continue
            steady = lambda key: statistics.mean(v for r in mine for v in r[key][1:])  # noqa: E731
            expected = model_bytes(size, NUM_PEERS, reachable, client)
            groups = sorted({g for r in mine for g in r["group_sizes"]})
            print(f"{num_clients:7d} {kind:>9s} {steady('seconds'):8.1f} {steady('sent') / 1e6:13.1f} "
                  f"{steady('received') / 1e6:13.1f} {expected / 1e6:8.1f} {expected / rate:7.1f} "
                  f"{','.join(map(str, groups)):>8s}")
        if any(r is None for r in results):
            print(f"{num_clients:7d} {sum(r is None for r in results)} peer(s) printed no result")


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "peer":
        address, initial, client, num_params, group_size, rounds = sys.argv[2:8]
        peer(address, initial, client == "1", int(num_params), int(group_size), int(rounds))
    else:
        main()
