"""How fast averaging groups mix a swarm: the parameter spread across N real averagers over rounds (figures printed,
nothing asserted; tests/lightning_swarm/test_group_mixing.py asserts a bound on a smaller swarm).

N peers (BENCH_PEERS, default 16) on 127.0.0.1, each a separate process with a real hivemind DHT and the averager
classes' group-key mixins of the strategy (:class:`MovingGroupKeys`, :class:`ThrottledLeaderSearch`,
:class:`PatientGroupRegistration` on hivemind's DecentralizedAverager), average two tensors every round: BENCH_FLOATS
values (default 65536) that peer i starts at i, and a one-hot "reach" vector of N entries (entry j of peer i above 0:
peer j's contribution has reached peer i). No codec, so both stay exact. Rounds are synchronous: every peer starts
round k's matchmaking at the same wall-clock time (as peers do at the end of a global epoch).

Each configuration of BENCH_CONFIGS (default "4:16,16:0": target_group_size g and averager_opts.expected_peers,
0 for none; a third field "stay" leaves client-mode peers that found no group under their key, as hivemind does)
gets the initial group bits the strategy would set (``moshpit_group_bits(expected_peers, g)``, random per peer) and
prints, per round: the spread (max - min of the peers' values, over the initial spread), the std over the initial
std, the group sizes formed (size:peers in groups of that size; 0: peers without a group), how many distinct group
keys the peers hold, and how many peers every contribution has reached (the least reached peer's count); at the
end, the rounds until the spread fell below 1% and until every contribution reached every peer, against log_g(N).
BENCH_CLIENTS (default 0): the last this many peers run their DHT and averager in client mode (as behind NAT): they
lead no group and declare themselves under no key, they join a reachable leader under their key. A peer that prints
no result within a configuration's time ends the run (its watchdog kills every peer).

Run:  python tests/benchmarks/bench_group_mixing.py
      BENCH_CLIENTS=8 BENCH_CONFIGS=4:16:stay,4:16,4:16:stay,4:16 python tests/benchmarks/bench_group_mixing.py
      BENCH_PEERS=8 BENCH_CONFIGS=2:8,4:8,8:0 BENCH_ROUNDS=6 python tests/benchmarks/bench_group_mixing.py
Peers use 1 torch thread and small tensors: on a 2-core machine the figures are matchmaking-bound, not CPU-bound.
"""

from __future__ import annotations

import json
import math
import os
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from paths import REPO  # noqa: E402

NUM_PEERS = int(os.environ.get("BENCH_PEERS", "16"))
# "g:expected_peers", or "g:expected_peers:stay": client-mode peers that found no group stay under their key, as in
# hivemind (without lightning_swarm's move, for a side-by-side comparison)
CONFIGS = [config.split(":") for config in os.environ.get("BENCH_CONFIGS", "4:16,16:0").split(",")]
ROUNDS = int(os.environ.get("BENCH_ROUNDS", "8"))
FLOATS = int(os.environ.get("BENCH_FLOATS", "65536"))
MATCHMAKING = float(os.environ.get("BENCH_MATCHMAKING", "4"))  # seconds of matchmaking before each round
PERIOD = float(os.environ.get("BENCH_PERIOD", "10"))  # seconds between the starts of two rounds
CLIENTS = int(os.environ.get("BENCH_CLIENTS", "0"))  # the last this many peers run in client mode (behind NAT)
LOG_DIR = os.environ.get("BENCH_LOG_DIR")  # the peers' stderr goes to files here when set, else nowhere
START_TIMEOUT = float(os.environ.get("BENCH_START_TIMEOUT", "300"))  # seconds for all peers to start


def peer(index: int, num_peers: int, initial_peer: str, floats: int, client_mode: bool) -> None:
    """One peer (its DHT and averager in client mode if ``client_mode``): prints MADDR, then for each line
    ``<g> <expected_peers or 0> <rounds> <t0> <move|stay>`` on stdin runs that many
    synchronous rounds starting at wall-clock t0 under a fresh averager and prints one RESULT line; ends at EOF."""
    import hivemind
    import torch
    from hivemind.averaging import DecentralizedAverager
    from hivemind.compression import NoCompression

    from lightning_swarm.hivemind_ext import group_keys
    from lightning_swarm.hivemind_ext.group_keys import MovingGroupKeys, moshpit_group_bits
    from lightning_swarm.hivemind_ext.lifetime import DiesWithParent, SwarmDHT
    from lightning_swarm.hivemind_ext.matchmaking import ThrottledLeaderSearch
    from lightning_swarm.hivemind_ext.round_groups import PatientGroupRegistration

    class MixingAverager(DiesWithParent, PatientGroupRegistration, MovingGroupKeys, ThrottledLeaderSearch,
                         DecentralizedAverager):
        """The strategy's averagers' matchmaking and group keys on a plain DecentralizedAverager."""

    torch.set_num_threads(1)
    dht = SwarmDHT(initial_peers=[initial_peer] if initial_peer else None, host_maddrs=["/ip4/127.0.0.1/tcp/0"],
                   client_mode=client_mode, start=True)
    maddrs = dht.get_visible_maddrs()
    print("MADDR", maddrs[0] if maddrs else "none", flush=True)  # a client-mode DHT has none
    averager = None
    moves = group_keys._move_after_failed_search
    for trial, line in enumerate(sys.stdin):
        group_size, expected_peers, rounds, t0, client_keys = line.split()
        group_size, expected_peers, rounds, t0 = int(group_size), int(expected_peers), int(rounds), float(t0)
        # read in the averager's process, forked below: "stay" leaves a client's key where hivemind leaves it
        group_keys._move_after_failed_search = moves if client_keys == "move" else (lambda matchmaking: None)
        if averager is not None:
            averager.shutdown()
        bits = moshpit_group_bits(expected_peers or None, group_size)
        reach = torch.zeros(num_peers)
        reach[index] = 1.0
        averager = MixingAverager(
            [torch.full((floats,), float(index)), reach], dht=dht, prefix=f"mix{trial}_g{group_size}_e{expected_peers}",
            target_group_size=group_size, min_group_size=2, initial_group_bits=bits,
            min_matchmaking_time=MATCHMAKING, request_timeout=min(1.5, MATCHMAKING / 2), next_chunk_timeout=5.0,
            compression=NoCompression(), client_mode=client_mode, start=True)
        history = []
        for k in range(rounds):
            start_at = t0 + k * PERIOD
            time.sleep(max(0.0, start_at - time.time()))
            bits_before = averager.get_group_bits()
            begin = time.time()
            try:
                group = averager.step(scheduled_time=start_at + MATCHMAKING, timeout=MATCHMAKING + 3.0,
                                      allow_retries=False)
            except Exception as e:  # a failed round leaves this peer's tensors as they were: record it, go on
                print(f"round {k}: {e!r}", file=sys.stderr, flush=True)
                group = None
            seconds = time.time() - begin
            with averager.get_tensors() as (values, reached):
                history.append(dict(value=values.mean().item(), reached=int((reached > 0).sum()),
                                    group_size=len(group) if group else 0, key_before=bits_before,
                                    key_after=averager.get_group_bits(), seconds=seconds))
        print("RESULT", json.dumps(dict(index=index, bits=bits, rounds=history)), flush=True)
    if averager is not None:
        averager.shutdown()
    dht.shutdown()


def start_peers(num_peers: int) -> list:
    """Start the peers (peer 0 first, the others join it); returns their Popen objects, all printed MADDR."""
    env = dict(os.environ, PYTHONPATH=str(REPO))
    processes = []

    def start(index: int, initial: str) -> subprocess.Popen:
        log = open(Path(LOG_DIR) / f"peer{index}.log", "w") if LOG_DIR else None
        client = str(int(index >= num_peers - CLIENTS))
        process = subprocess.Popen([sys.executable, __file__, "peer", str(index), str(num_peers), initial, str(FLOATS),
                                    client],
                                   stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log or subprocess.DEVNULL,
                                   text=True, start_new_session=True, env=env, bufsize=1)
        processes.append(process)
        return process

    first = start(0, "")
    maddr = next((line.split()[1] for line in first.stdout if line.startswith("MADDR")), None)
    if maddr is None:
        raise RuntimeError("peer 0 printed no MADDR")
    for index in range(1, num_peers):
        start(index, maddr)
    for index, process in enumerate(processes[1:], 1):
        if next((line for line in process.stdout if line.startswith("MADDR")), None) is None:
            raise RuntimeError(f"peer {index} printed no MADDR")
    return processes


def stop_peers(processes: list) -> None:
    for process in processes:
        if process.poll() is None:
            try:
                process.stdin.close()
            except BrokenPipeError:
                pass
    for process in processes:
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, 9)
            process.wait()


def run_config(processes: list, group_size: int, expected_peers: int, rounds: int, client_keys: str) -> list:
    """One configuration on the running peers; returns their RESULTs (None for a peer that printed none)."""
    t0 = time.time() + 15.0  # every peer has built its averager by then
    for process in processes:
        process.stdin.write(f"{group_size} {expected_peers} {rounds} {t0} {client_keys}\n")
        process.stdin.flush()
    # a peer that hangs is killed, so that reading its output below ends
    limit = 15.0 + rounds * PERIOD + 60.0
    watchdog = threading.Timer(limit, lambda: [os.killpg(p.pid, 9) for p in processes if p.poll() is None])
    watchdog.daemon = True
    watchdog.start()
    try:
        results = []
        for process in processes:
            line = next((line for line in process.stdout if line.startswith("RESULT")), None)
            results.append(json.loads(line.split(" ", 1)[1]) if line else None)
        return results
    finally:
        watchdog.cancel()


def summarize(results: list, num_peers: int, group_size: int) -> dict:
    """Per-round spread, std, group sizes, keys and reach; the rounds to 1% spread and to full reach."""
    initial = list(range(num_peers))
    spread0, std0 = max(initial) - min(initial), statistics.pstdev(initial)
    done = [r for r in results if r is not None]
    rows, rounds_to_1pct, rounds_to_reach = [], None, None
    for k in range(len(done[0]["rounds"]) if done else 0):
        values = [r["rounds"][k]["value"] for r in done]
        spread = (max(values) - min(values)) / spread0
        sizes = sorted((r["rounds"][k]["group_size"] for r in done), reverse=True)
        members = {}  # group size -> peers that reported a group of that size (0: no group, a failed round)
        for size in sizes:
            members[size] = members.get(size, 0) + 1
        group_sizes = [f"{size}:{count}" for size, count in members.items()]
        min_reach = min(r["rounds"][k]["reached"] for r in done)
        rows.append(dict(round=k + 1, spread=spread, std=statistics.pstdev(values) / std0,
                         groups=" ".join(group_sizes),
                         keys_before=len({r["rounds"][k]["key_before"] for r in done}),
                         min_reach=min_reach, seconds=statistics.median(r["rounds"][k]["seconds"] for r in done)))
        if rounds_to_1pct is None and spread < 0.01:
            rounds_to_1pct = k + 1
        if rounds_to_reach is None and min_reach == num_peers:
            rounds_to_reach = k + 1
    return dict(rows=rows, rounds_to_1pct=rounds_to_1pct, rounds_to_reach=rounds_to_reach,
                missing=len(results) - len(done), log_bound=math.log(num_peers) / math.log(group_size))


def main() -> None:
    print(f"== {NUM_PEERS} peers on 127.0.0.1, {FLOATS} floats + {NUM_PEERS}-entry reach vector each, no codec, "
          f"synchronous rounds every {PERIOD:g} s, matchmaking {MATCHMAKING:g} s, {CLIENTS} in client mode; "
          f"load average at start {os.getloadavg()[0]:.1f}", flush=True)
    started = time.time()
    processes = start_peers(NUM_PEERS)
    try:
        print(f"   {NUM_PEERS} peers started in {time.time() - started:.0f} s", flush=True)
        for config in CONFIGS:
            group_size, expected_peers = int(config[0]), int(config[1])
            client_keys = config[2] if len(config) > 2 else "move"
            results = run_config(processes, group_size, expected_peers, ROUNDS, client_keys)
            bits = sorted({r["bits"] for r in results if r is not None})
            summary = summarize(results, NUM_PEERS, group_size)
            stay = ", client-mode peers stay under their key (hivemind)" if client_keys == "stay" else ""
            print(f"-- target_group_size={group_size}, expected_peers={expected_peers or None}{stay}: initial bits "
                  f"{bits or ['']} (log_g(N) = {summary['log_bound']:.2f}); load average "
                  f"{os.getloadavg()[0]:.1f}", flush=True)
            print(f"{'round':>5s} {'spread':>8s} {'std':>8s} {'keys':>4s} {'min reach':>9s} {'s/round':>7s}  "
                  "group size:peers in such groups (0: no group)")
            for row in summary["rows"]:
                print(f"{row['round']:5d} {row['spread']:8.4f} {row['std']:8.4f} {row['keys_before']:4d} "
                      f"{row['min_reach']:9d} {row['seconds']:7.1f}  {row['groups']}")
            print(f"   rounds to spread < 1%: {summary['rounds_to_1pct']}; rounds until every contribution reached "
                  f"every peer: {summary['rounds_to_reach']}; peers without result: {summary['missing']}", flush=True)
    finally:
        stop_peers(processes)


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "peer":
        peer(int(sys.argv[2]), int(sys.argv[3]), sys.argv[4], int(sys.argv[5]), sys.argv[6] == "1")
    else:
        main()
