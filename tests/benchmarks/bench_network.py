"""Benchmarks over shaped links (figures printed, nothing asserted): two peers, each in its own network namespace
behind a link of a profile of tests/lightning_swarm/netns_harness.py (datacenter 1 Gbit/s, home 50, poor 10).

1. averaging: seconds per averaging round (hivemind DecentralizedAverager, 10 equal fp32 tensors) for the codecs
   none / fp16 / adaptive (our default, 8-bit for large tensors), next to the bound: the bytes each peer must send
   (and receive: the links are full duplex) divided by the link rate. In hivemind's all-reduce a peer of a group of
   g sends the (g-1)/g of its tensors that others reduce, and sends the averaged part it reduced to the g-1 others:
   2 (g-1)/g x bytes_on_wire each way, with 2 peers the whole encoded size.
2. state: a newcomer's download (lightning_swarm's verified download) of an uncompressed state, seconds and MB/s,
   and the 1b recipe's state at that rate (its 144M unique fp32 parameters + LAMB8bit's two 8-bit statistics).
3. recipe: the tiny recipe's samples/s (`python -m recipes.dalle fit --config configs/dalle_tiny.yaml`: its model,
   batch 16, target_batch_size 32, strategy settings and default codec as shipped; fp32, no validation or
   checkpoints) of each peer of a 2-peer swarm over shaped links (BENCH_PROFILES, default home), against one peer
   alone and two unrelated one-peer runs side by side (the same machine load as the swarm). Each peer runs 1 torch
   thread: a 1-core volunteer. The steady state: BENCH_SECONDS of training from BENCH_WARMUP seconds after the
   peers' common start (the newcomer has downloaded the state by then), up to the last global step in it.
   Not in 'all': ~8 min at the defaults (three runs, each the recipe's startup, warm-up and steady state).

Run (root, iproute2):  python tests/benchmarks/bench_network.py [averaging|state|all|recipe]
     BENCH_PROFILES=home,poor BENCH_SIZES=25,144 BENCH_ROUNDS=2 python tests/benchmarks/bench_network.py averaging
     BENCH_STATE_MPARAMS=25 python tests/benchmarks/bench_network.py state
     BENCH_SECONDS=90 BENCH_WARMUP=40 BENCH_PROFILES=home python tests/benchmarks/bench_network.py recipe (defaults)
The links have no propagation delay and no loss (no netem in this kernel): the figures are bandwidth- and CPU-bound.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import NamedTuple

sys.path.insert(0, str(Path(__file__).resolve().parent))
from paths import REPO  # noqa: E402

sys.path.insert(0, str(REPO / "tests" / "lightning_swarm"))
from netns_harness import PROFILES, network_harness_available, shaped_network  # noqa: E402
from recipe_peers import RecipePeer, write_overlay  # noqa: E402

PROFILE_NAMES = os.environ.get("BENCH_PROFILES", "datacenter,home,poor").split(",")
SIZES_M = [int(size) for size in os.environ.get("BENCH_SIZES", "25,144").split(",")]
ROUNDS = int(os.environ.get("BENCH_ROUNDS", "2"))
CODECS = os.environ.get("BENCH_CODECS", "adaptive,fp16,none").split(",")
# checkouts whose lightning_swarm the peers import, compared row by row (default: this one); e.g. main's and a branch's
CODE_DIRS = [d for d in os.environ.get("BENCH_CODE_DIRS", "").split(",") if d] or [str(REPO)]
# the peers' stderr (hivemind's log) goes to files in this directory when set, else nowhere
LOG_DIR = os.environ.get("BENCH_LOG_DIR")
STATE_MPARAMS = int(os.environ.get("BENCH_STATE_MPARAMS", "25"))
# 1b recipe (configs/dalle_1b.yaml): 144M unique fp32 parameters + LAMB8bit's two 8-bit statistics (1 byte each; its
# per-block scales add ~0.2%), downloaded uncompressed (load_state_compression "none")
ONE_B_STATE_BYTES = 144e6 * (4 + 1 + 1)
NUM_TENSORS = 10


def _codec(name: str):
    from hivemind.compression import Float16Compression, NoCompression

    from lightning_swarm.compression import default_compression

    return {"none": NoCompression(), "fp16": Float16Compression(), "adaptive": default_compression()}[name]


def _tensors(num_params: int, fill: str):
    import torch

    torch.manual_seed(0)
    make = torch.randn if fill == "randn" else torch.zeros
    return [make(num_params // NUM_TENSORS) for _ in range(NUM_TENSORS)]


def wire_bytes(codec_name: str, num_params: int) -> int:
    """Bytes of all tensors once encoded by the codec (measured on one tensor, times NUM_TENSORS)."""
    from hivemind.compression import CompressionInfo

    tensor = _tensors(num_params, "randn")[0]
    return _codec(codec_name).compress(tensor, CompressionInfo.from_tensor(tensor)).ByteSize() * NUM_TENSORS


# ------------------------------------------------------------------------------------------- worker processes
def session_cpu_seconds() -> dict:
    """CPU seconds (user + system) used so far by the processes of this peer's session (run_pair starts each peer in
    its own): its Python processes (main, DHT, averager) and its p2pd daemon, by program name."""
    session, ticks, totals = os.getsid(0), os.sysconf("SC_CLK_TCK"), {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue  # exited meanwhile
        name, fields = stat[stat.index("(") + 1:stat.rindex(")")], stat[stat.rindex(")") + 2:].split()
        if int(fields[3]) == session:  # fields from the state on: state ppid pgrp session ... utime(11) stime(12)
            kind = "p2pd" if name == "p2pd" else "python"
            totals[kind] = totals.get(kind, 0.0) + (int(fields[11]) + int(fields[12])) / ticks
    return totals


def _dht(address: str, initial_peer: str):
    from lightning_swarm.hivemind_ext.lifetime import SwarmDHT  # hivemind.DHT whose death is noticed

    dht = SwarmDHT(initial_peers=[initial_peer] if initial_peer else None, host_maddrs=[f"/ip4/{address}/tcp/0"],
                   start=True)
    if not initial_peer:
        print("MADDR", dht.get_visible_maddrs()[0], flush=True)
    return dht


def averaging_peer(address: str, initial_peer: str, codec: str, num_params: int, rounds: int) -> None:
    import hivemind

    dht = _dht(address, initial_peer)
    averager = hivemind.averaging.DecentralizedAverager(
        _tensors(num_params, "randn"), dht=dht, prefix="bench_net", target_group_size=2, min_matchmaking_time=3.0,
        request_timeout=1.5, next_chunk_timeout=30.0, compression=_codec(codec), start=True)
    times, cpu = [], []
    for _ in range(rounds):
        start, cpu_start = time.perf_counter(), session_cpu_seconds()
        averager.step(timeout=900)
        times.append(time.perf_counter() - start)
        cpu_end = session_cpu_seconds()
        cpu.append({kind: cpu_end[kind] - cpu_start.get(kind, 0.0) for kind in cpu_end})
    print("RESULT", json.dumps({"seconds": times, "cpu": cpu}), flush=True)
    time.sleep(3)  # let the other peer finish its last round
    averager.shutdown()
    dht.shutdown()


def state_peer(address: str, initial_peer: str, num_params: int) -> None:
    from lightning_swarm.hivemind_ext.state_download import VerifiedStateDownload

    dht = _dht(address, initial_peer)
    donor = not initial_peer
    averager = VerifiedStateDownload(_tensors(num_params, "randn" if donor else "zeros"), dht=dht, prefix="bench_state",
                                     start=True)
    if donor:
        time.sleep(3600)  # serves until killed
    time.sleep(5)  # the donor's declaration reaches this DHT
    start = time.perf_counter()
    loaded = averager.load_state_from_peers(timeout=60)
    elapsed = time.perf_counter() - start
    size = sum(tensor.numel() * 4 for tensor in loaded[1])
    print("RESULT", json.dumps({"seconds": elapsed, "bytes": size}), flush=True)
    averager.shutdown()
    dht.shutdown()


def run_pair(net, first_args: list, second_args, timeout: float = 1800, code_dir: str = str(REPO)) -> list:
    """Peer 0 runs `first_args`, peer 1 `second_args(maddr of peer 0)`; returns peer 1's RESULT lines.
    code_dir: the checkout whose lightning_swarm the peers import (whatever is pip-installed)."""
    me = [sys.executable, __file__]
    env = dict(os.environ, PYTHONPATH=code_dir)
    logs = [open(Path(LOG_DIR) / f"{first_args[0]}-{time.time():.0f}-{index}.log", "w") if LOG_DIR else
            subprocess.DEVNULL for index in (0, 1)]
    first = subprocess.Popen(net.command(0, me + first_args), stdout=subprocess.PIPE, stderr=logs[0],
                             text=True, start_new_session=True, env=env)
    second = None
    try:
        maddr = next((line.split()[1] for line in first.stdout if line.startswith("MADDR")), None)
        if maddr is None:
            raise RuntimeError("the first peer printed no MADDR")
        second = subprocess.Popen(net.command(1, me + second_args(maddr)), stdout=subprocess.PIPE,
                                  stderr=logs[1], text=True, start_new_session=True, env=env)
        out_second, _ = second.communicate(timeout=timeout)
        results = [json.loads(line.split(" ", 1)[1]) for line in out_second.splitlines() if line.startswith("RESULT")]
        return results
    finally:
        for process in (first, second):
            if process is not None and process.poll() is None:
                os.killpg(process.pid, 9)
                process.wait()
        for log in logs:
            if log is not subprocess.DEVNULL:
                log.close()


# ------------------------------------------------------------------------------------------------ benchmarks
def bench_averaging() -> None:
    print(f"== averaging round, 2 peers, {ROUNDS} rounds (seconds per round at the second peer) vs bandwidth bound")
    print(f"{'profile':10s} {'Mparams':>7s} {'codec':9s} {'MB/peer/dir':>11s} {'bound s':>8s} {'rounds s':>16s} "
          f"{'best/bound':>10s} {'CPU s/round: python, p2pd':>26s}" + ("  code" if len(CODE_DIRS) > 1 else ""))
    for profile in PROFILE_NAMES:
        link = PROFILES[profile]
        for size in SIZES_M:
            num_params = size * 1_000_000
            for codec in CODECS:
                per_direction = wire_bytes(codec, num_params) * 2 * (2 - 1) / 2  # 2 (g-1)/g, g = 2 peers
                bound = per_direction / link.bytes_per_second
                for code_dir in CODE_DIRS:
                    with shaped_network([profile, profile]) as net:
                        args = lambda initial: ["averaging-peer", net.addresses[1 if initial else 0], initial,
                                                codec, str(num_params), str(ROUNDS)]
                        results = run_pair(net, args(""), args, code_dir=code_dir)
                    times = results[0]["seconds"] if results else []
                    shown = ", ".join(f"{t:.1f}" for t in times) or "failed"
                    ratio = f"{min(times) / bound:.2f}" if times else "-"
                    cpu = "; ".join(f"{r.get('python', 0):.1f}, {r.get('p2pd', 0):.1f}"
                                    for r in results[0]["cpu"]) if results else "-"
                    print(f"{profile:10s} {size:7d} {codec:9s} {per_direction / 1e6:11.1f} {bound:8.2f} {shown:>16s} "
                          f"{ratio:>10s} {cpu:>26s}" + (f"  {code_dir}" if len(CODE_DIRS) > 1 else ""),
                          flush=True)

def bench_state() -> None:
    num_params = STATE_MPARAMS * 1_000_000
    print(f"== newcomer's state download, {STATE_MPARAMS}M fp32 parameters uncompressed "
          f"({num_params * 4 / 1e6:.0f} MB), and the 1b recipe's state ({ONE_B_STATE_BYTES / 1e9:.2f} GB) at that rate")
    print(f"{'profile':10s} {'link MB/s':>9s} {'seconds':>8s} {'MB/s':>6s} {'of link':>7s} {'1b state, min':>13s}")
    for profile in PROFILE_NAMES:
        link = PROFILES[profile]
        with shaped_network([profile, profile]) as net:
            results = run_pair(net, ["state-peer", net.addresses[0], "", str(num_params)],
                               lambda maddr: ["state-peer", net.addresses[1], maddr, str(num_params)])
        if not results:
            print(f"{profile:10s} failed", flush=True)
            continue
        rate = results[0]["bytes"] / results[0]["seconds"]
        print(f"{profile:10s} {link.bytes_per_second / 1e6:9.2f} {results[0]['seconds']:8.1f} {rate / 1e6:6.2f} "
              f"{rate / link.bytes_per_second:7.2f} {ONE_B_STATE_BYTES / rate / 60:13.1f}", flush=True)


# ----------------------------------------------------------------------------------- the tiny recipe, 2 peers
RECIPE_PROFILE_NAMES = os.environ.get("BENCH_PROFILES", "home").split(",")
RECIPE_SECONDS = float(os.environ.get("BENCH_SECONDS", "90"))  # steady state measured per run
RECIPE_WARMUP = float(os.environ.get("BENCH_WARMUP", "40"))  # from the peers' common start to the steady state


class RecipeSteady(NamedTuple):
    """One recipe peer's steady state: from its "warm" event to its last global step before it stopped."""

    sps: float  # samples/s
    seconds: float
    epochs: int  # global epoch at the end of the run
    steady_epochs: int  # global steps in the steady state
    peers: str  # fewest-most peers its tracker saw at the global steps of the steady state
    main_core: float  # cores used by its training thread, warm to end
    background_core: float  # by everything else it runs (DHT, averagers, p2p daemon, data), warm to end


def recipe_steady(events: list) -> RecipeSteady:
    """The steady state of a peer from the events its SwarmRecorder wrote (warmup_seconds set)."""
    warm = next(event for event in events if event["kind"] == "warm")
    end = next(event for event in events if event["kind"] == "end")
    # up to the last global step, not to the end: a peer whose partner stopped first waits a last round out alone
    steps = [e for e in events if e["kind"] == "step" and e["time"] > warm["time"] and e["epoch"] > warm["epoch"]]
    last = steps[-1] if steps else end
    seconds = last["time"] - warm["time"]
    counts = sorted({e["peers"] for e in steps}) or [0]
    peers = f"{counts[0]}-{counts[-1]}" if len(counts) > 1 else str(counts[0])
    cpu_seconds = end["elapsed"] - warm["elapsed"]
    return RecipeSteady((last["samples"] - warm["samples"]) / seconds, seconds, end["epoch"],
                        last["epoch"] - warm["epoch"], peers, (end["cpu_main"] - warm["cpu_main"]) / cpu_seconds,
                        (end["cpu_background"] - warm["cpu_background"]) / cpu_seconds)


def run_recipe_peers(root: Path, net, run_ids: list, join: bool) -> list:
    """One tiny-recipe peer in each namespace of `net`, of the run ids `run_ids` (the later ones join the first if
    `join`); all start timing together at a barrier (after the newcomer's state download). Returns their
    RecipeSteady."""
    recorder = {"stop_at_epoch": 10**9, "max_seconds": RECIPE_WARMUP + RECIPE_SECONDS, "warmup_seconds": RECIPE_WARMUP,
                "record_params": False, "barrier_dir": str(root / "barrier"), "barrier_count": len(run_ids),
                "barrier_timeout": 600.0, "wait_for_swarm": join}
    peers, initial_peers = [], None
    try:
        for index, run_id in enumerate(run_ids):
            out_dir = root / f"peer{index}"
            out_dir.mkdir(parents=True)
            strategy = {"run_id": run_id, "host_maddrs": net.host_maddrs(index)}
            if initial_peers:
                strategy["initial_peers"] = initial_peers
            # the shipped data (the shapes dataset cached in ~/.cache), each peer with a shuffle seed of its own
            overlay = write_overlay(out_dir, strategy, recorder, data={"seed": index}, trainer={"max_steps": 10**6})
            peers.append(RecipePeer(net, index, out_dir, overlay))
            if join and initial_peers is None:
                initial_peers = peers[0].join_peers(timeout=600)
        for peer in peers:
            peer.wait(timeout=RECIPE_WARMUP + RECIPE_SECONDS + 900)
    finally:
        for peer in peers:
            peer.kill()
    return [recipe_steady(peer.events()) for peer in peers]


def _steady_text(result: RecipeSteady) -> str:
    return (f"{result.sps:6.2f} samples/s over {result.seconds:3.0f} s, {result.steady_epochs:3d} global steps "
            f"(epoch {result.epochs} at the end, {result.peers} peer(s) seen) [training thread "
            f"{result.main_core:.2f} core, the rest {result.background_core:.2f}]")


def bench_recipe() -> None:
    print(f"== the tiny recipe (configs/dalle_tiny.yaml as shipped: batch 16, target_batch_size 32, default codec; "
          f"fp32), 1 torch thread per peer; steady state {RECIPE_SECONDS:.0f} s from {RECIPE_WARMUP:.0f} s after the "
          f"peers' common start\n   'alone x2': two unrelated one-peer runs side by side, the machine load of the "
          f"2-peer swarm (on 2 cores, two peers leave no spare core for their DHT, averagers and p2p daemons)",
          flush=True)
    began = time.monotonic()
    with tempfile.TemporaryDirectory() as tmp:
        for profile in RECIPE_PROFILE_NAMES:
            root = Path(tmp) / profile
            print(f"-- {profile}: {PROFILES[profile].rate_mbit:g} Mbit/s each way per peer; load average "
                  f"{os.getloadavg()[0]:.1f}", flush=True)
            with shaped_network([profile]) as net:
                (alone,) = run_recipe_peers(root / "alone", net, ["bench_recipe_alone"], join=False)
            print(f"alone        peer 0: {_steady_text(alone)}", flush=True)
            with shaped_network([profile, profile]) as net:
                side_by_side = run_recipe_peers(root / "alone_x2", net, ["bench_recipe_solo_a", "bench_recipe_solo_b"],
                                                join=False)
            for index, result in enumerate(side_by_side):
                print(f"alone x2     peer {index}: {_steady_text(result)}", flush=True)
            x2 = sum(result.sps for result in side_by_side) / 2
            with shaped_network([profile, profile]) as net:
                swarm = run_recipe_peers(root / "swarm", net, ["bench_recipe_pair"] * 2, join=True)
            for index, result in enumerate(swarm):
                print(f"2-peer swarm peer {index}: {_steady_text(result)} -> per peer / alone "
                      f"{result.sps / alone.sps:.2f}, / alone x2 {result.sps / x2:.2f}", flush=True)
            total = sum(result.sps for result in swarm)
            print(f"RESULT {profile}: swarm {total:.2f} samples/s = {total / alone.sps:.2f} x one peer alone "
                  f"({alone.sps:.2f}), {total / (2 * x2):.2f} x two peers alone side by side ({2 * x2:.2f}); "
                  f"load average {os.getloadavg()[0]:.1f}", flush=True)
    print(f"wall time {time.monotonic() - began:.0f} s. Left out: propagation delay and loss (tbf only, no netem); "
          f"the peers of each run share this machine's cores (and with the swarm, also its two p2p daemons)",
          flush=True)


if __name__ == "__main__":
    command = sys.argv[1] if len(sys.argv) > 1 else "all"
    if command == "averaging-peer":
        averaging_peer(sys.argv[2], sys.argv[3], sys.argv[4], int(sys.argv[5]), int(sys.argv[6]))
    elif command == "state-peer":
        state_peer(sys.argv[2], sys.argv[3], int(sys.argv[4]))
    elif network_harness_available():  # not root, or no iproute2
        print(f"SKIP: {network_harness_available()}", flush=True)
    else:
        # SIGTERM (e.g. from `timeout`) unwinds like an exception: peers are killed, namespaces deleted
        signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
        print(f"load average at start: {os.getloadavg()}", flush=True)
        if command in ("averaging", "all"):
            bench_averaging()
        if command in ("state", "all"):
            bench_state()
        if command == "recipe":
            bench_recipe()
