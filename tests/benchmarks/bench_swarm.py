"""Benchmarks of the swarm (figures printed, nothing asserted).

1. averaging: time of one averaging round of a 25M-parameter model between two local peers (hivemind
   DecentralizedAverager, 10 tensors of 2.5M values), with our default wire codec and with none/fp16, next to
   ../shared/peers/hivemind_averaging_anchor.py run the same way (if present).
2. throughput: one peer's samples/s inside a 2-peer HivemindStrategy swarm divided by its samples/s alone, same
   model, batch and thread count (1 torch thread per peer), with the overlap options
   (delay_optimizer_step + delay_grad_averaging + delay_state_averaging). "Alone" is measured twice: one peer
   on the machine, and two unrelated one-peer runs side by side (the same machine load as the 2-peer swarm).

   Two figures per peer: over the whole timed window, and in the steady state (from BENCH_WARMUP seconds, 30 by
   default, to the end: without the join, where the second peer downloads the state, and the first epochs).
   For the steady state it also prints where the CPU went (from /proc, far less noisy than samples/s): cores used
   by the peer's training thread and by everything else it runs (DHT, averagers, p2p daemon, other threads), and
   samples per CPU second of the training thread (lower when it shares caches and cores with busy neighbours).

3. peers: one swarm of 1, 2, 4 peers (BENCH_PEER_COUNTS) on 127.0.0.1: each peer's samples/s and the CPU its swarm
   work takes (everything but its training thread), per second and per global epoch.

4. overlap: swarms of BENCH_OVERLAP_PEERS peers (default 4 and 2; the MLP of "throughput"), one after the other:
   the overlap options with rounds matched per epoch (now, overlap_max_peers None), the same with one group key for
   all epochs (before), synchronous rounds, and the fallback
   (overlap_max_peers=2); BENCH_OVERLAP_VARIANTS picks some (epoch,before,sync,fallback). Swarm samples/s in the
   steady state, global epochs, the partial rounds the peers' logs report and the reducers kept out by the reducer
   check; epoch_nocheck and sync_nocheck: epoch and sync with verify_reducers off.

Run: python tests/benchmarks/bench_swarm.py [averaging|throughput|all|peers|overlap]
     BENCH_AVERAGE_STATE_EVERY=4 python tests/benchmarks/bench_swarm.py throughput   (state averaging every 4 epochs)
     BENCH_TARGET=16384 BENCH_SECONDS=60 BENCH_WARMUP=15 python tests/benchmarks/bench_swarm.py throughput  (~4 s epochs)
     BENCH_MATCHMAKING_TIME=1.0 python tests/benchmarks/bench_swarm.py throughput     (matchmaking_time, default 2 s)
     BENCH_REPEATS=3 python tests/benchmarks/bench_swarm.py throughput   (3 interleaved repeats, median ratios)
     BENCH_PEER_COUNTS=4 BENCH_KEEP_DIR=/tmp/peers python tests/benchmarks/bench_swarm.py peers   (logs kept, verbose)
     BENCH_OVERLAP=0 BENCH_TARGET=8192 BENCH_PEER_COUNTS=4 python tests/benchmarks/bench_swarm.py peers   (synchronous)
     BENCH_TARGET=8192 BENCH_SECONDS=60 BENCH_WARMUP=20 python tests/benchmarks/bench_swarm.py overlap   (the table
                                                  of docs/notes/swarm-at-scale-measurements.md, ~15 min)
     BENCH_OVERLAP_PEERS=8 BENCH_OVERLAP_VARIANTS=epoch,sync ... overlap   (8 peers, two variants)
     BENCH_PIN=1 python tests/benchmarks/bench_swarm.py throughput   (each peer with all its processes on its own core,
                                                                     like one peer per 1-core machine; alone too)
The machine is shared (2 cores): run it when nothing else runs, the ratio moves a lot with background load. The host
moves it too: the same one-peer run gives samples/s 10% apart minutes apart (the training thread's samples per CPU
second change, not its share of a core), so compare medians over BENCH_REPEATS.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import NamedTuple, Optional

sys.path.insert(0, str(Path(__file__).resolve().parent))
from paths import REPO, SHARED  # noqa: E402

ANCHOR = SHARED / "peers" / "hivemind_averaging_anchor.py"
sys.path.insert(0, str(REPO / "tests" / "lightning_swarm"))


# ------------------------------------------------------------------------------------------- averaging round
def averaging_peer(initial_peer: str, compression: str, rounds: int) -> None:
    """One side of the averaging benchmark (run in its own process)."""
    import torch
    import hivemind
    from lightning_swarm.hivemind_ext.lifetime import SwarmDHT  # hivemind.DHT whose death is noticed
    from hivemind.compression import Float16Compression, NoCompression

    from lightning_swarm.compression import default_compression

    dht = SwarmDHT(initial_peers=[initial_peer] if initial_peer else None, host_maddrs=["/ip4/127.0.0.1/tcp/0"],
                   start=True)
    if not initial_peer:
        print("MADDR", dht.get_visible_maddrs()[0], flush=True)
    tensors = [torch.randn(25_000_000 // 10) for _ in range(10)]
    codec = {"none": NoCompression(), "fp16": Float16Compression(), "adaptive": default_compression()}[compression]
    averager = hivemind.averaging.DecentralizedAverager(
        tensors, dht=dht, prefix="bench_avg", target_group_size=2, min_matchmaking_time=2.0, request_timeout=1.0,
        compression=codec, start=True,
    )
    times = []
    for _ in range(rounds):
        start = time.perf_counter()
        averager.step(timeout=120)
        times.append(time.perf_counter() - start)
    print("RESULT", json.dumps(times), flush=True)
    averager.shutdown()
    dht.shutdown()


def run_pair(command_first, command_second, timeout: float = 400) -> list:
    """Start two processes (the second gets the MADDR printed by the first) and return their RESULT lines."""
    first = subprocess.Popen(command_first, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
                             start_new_session=True)
    second = None
    try:
        maddr = None
        for line in first.stdout:
            if line.startswith("MADDR"):
                maddr = line.split()[1]
                break
        if maddr is None:
            raise RuntimeError("first averaging peer printed no MADDR")
        second = subprocess.Popen(command_second(maddr), stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                                  text=True, start_new_session=True)
        out_second, _ = second.communicate(timeout=timeout)
        out_first = first.stdout.read()
        first.wait(timeout=60)
        return [line for line in (out_first + out_second).splitlines() if line.startswith("RESULT")]
    finally:
        for process in (first, second):
            if process is not None and process.poll() is None:
                os.killpg(process.pid, 9)


def bench_averaging(rounds: int = 3) -> None:
    print("== one averaging round, 25M fp32 parameters, 2 local peers (seconds per round, per peer)")
    me = [sys.executable, __file__]
    for compression in ("adaptive", "fp16", "none"):
        results = run_pair(me + ["averaging-peer", "", compression, str(rounds)],
                           lambda maddr: me + ["averaging-peer", maddr, compression, str(rounds)])
        print(f"lightning_swarm  {compression:9s}", " | ".join(r.split(" ", 1)[1] for r in results), flush=True)
    if ANCHOR.exists():
        for compression in ("fp16", "none"):
            results = run_pair([sys.executable, str(ANCHOR), "0", compression],
                               lambda maddr: [sys.executable, str(ANCHOR), "1", compression, maddr])
            print(f"anchor           {compression:9s}", " | ".join(results), flush=True)


# ----------------------------------------------------------------------------------------------- throughput
# samples per global epoch: 131072 is about 25 s of the 2-peer swarm's work between averaging rounds. hivemind suggests
# matchmaking_time 3-5 s for local runs, 10-15 s over the Internet, and epochs several times longer than that; with
# 16384 (4 s epochs) each epoch's fixed costs show much more
TARGET = int(os.environ.get("BENCH_TARGET", "131072"))
SECONDS = float(os.environ.get("BENCH_SECONDS", "120"))  # timed training per run
WARMUP = float(os.environ.get("BENCH_WARMUP", "30"))  # the steady state starts this many seconds into the window
PIN = os.environ.get("BENCH_PIN", "0") == "1"  # peer i and all its processes on core i % 2 (taskset)
MATCHMAKING_TIME = float(os.environ.get("BENCH_MATCHMAKING_TIME", "2.0"))
AVERAGE_STATE_EVERY = int(os.environ.get("BENCH_AVERAGE_STATE_EVERY", "1"))
REPEATS = int(os.environ.get("BENCH_REPEATS", "1"))  # alone / alone x2 / swarm, interleaved, this many times
PEER_COUNTS = [int(n) for n in os.environ.get("BENCH_PEER_COUNTS", "1,2,4").split(",")]  # mode "peers"
# mode "peers": keep each peer's directory (config, log, events) under this directory, with hivemind's round outcomes
# in the logs (verbose), instead of a temporary directory
KEEP_DIR = os.environ.get("BENCH_KEEP_DIR")
# BENCH_OVERLAP=0: synchronous rounds (no delay_optimizer_step / delay_grad_averaging / delay_state_averaging)
OVERLAP = os.environ.get("BENCH_OVERLAP", "1") == "1"
LEADER_POLL_INTERVAL = os.environ.get("BENCH_LEADER_POLL_INTERVAL")  # seconds; unset: the strategy's default
MODEL = {"in_dim": 1024, "hidden": 4096, "lr": 0.01, "lr_decay": 1.0}  # peer_worker.TinyRegression's MLP
DATA = {"batch_size": 64, "in_dim": 1024, "num_samples": 30_000}


class PeerResult(NamedTuple):
    sps: float  # samples/s over the timed window
    steady: float  # samples/s in the steady state
    epochs: int  # global epochs reached
    cpu: dict  # steady state: cores of the training thread ("main") and of the rest ("background"), samples per
    # training-thread CPU second ("per_main_second")


def _run_peers(root: Path, specs: list, seconds: float, join: bool, options: Optional[dict] = None,
               logs: Optional[list] = None) -> list[PeerResult]:
    """Start peers (name, run_id, data offset), the later ones joining the first if `join`; return their results.
    All peers start timing together, at a barrier. `options` override the strategy's; `logs`, if given, receives
    each peer's log."""
    from swarm_harness import Peer

    overlap = dict(delay_optimizer_step=OVERLAP, delay_grad_averaging=OVERLAP, delay_state_averaging=OVERLAP,
                   matchmaking_time=MATCHMAKING_TIME, averaging_timeout=30.0, host_maddrs=["/ip4/127.0.0.1/tcp/0"],
                   metrics_interval=5.0, average_state_every=AVERAGE_STATE_EVERY, verbose=bool(KEEP_DIR))
    overlap.update(options or {})
    if LEADER_POLL_INTERVAL is not None:
        overlap["averager_opts"] = dict(overlap.get("averager_opts") or {},
                                        leader_poll_interval=float(LEADER_POLL_INTERVAL))
    recorder = {"stop_at_epoch": 100_000, "max_seconds": seconds, "barrier_dir": str(root / "barrier"),
                "barrier_count": len(specs), "wait_for_swarm": join, "record_params": False, "warmup_seconds": WARMUP}
    peers = []
    try:
        initial_peers = None
        for name, run_id, offset in specs:
            strategy = dict(run_id=run_id, target_batch_size=TARGET, **overlap)
            if join and initial_peers:
                strategy["initial_peers"] = initial_peers
            peers.append(Peer(root, name, strategy, model=MODEL, data=dict(DATA, offset=offset), recorder=recorder,
                              cpus=str(len(peers) % 2) if PIN else None))
            if join and initial_peers is None:
                initial_peers = peers[0].join_peers(timeout=240)
        for peer in peers:
            peer.wait(timeout=seconds + 300)
    finally:
        for peer in peers:
            peer.kill()
    if logs is not None:
        logs.extend(peer.log() for peer in peers)
    results = []
    for peer in peers:
        events = peer.events()
        end, warm = events[-1], next(event for event in events if event["kind"] == "warm")
        seconds = end["elapsed"] - warm["elapsed"]
        steady = (end["samples"] - warm["samples"]) / seconds
        cpu = dict(main=(end["cpu_main"] - warm["cpu_main"]) / seconds,  # cores used by the training thread
                   background=(end["cpu_background"] - warm["cpu_background"]) / seconds,  # by all the rest
                   per_main_second=(end["samples"] - warm["samples"]) / (end["cpu_main"] - warm["cpu_main"]))
        cpu.update(steady_seconds=seconds, steady_epochs=end["epoch"] - warm["epoch"])
        results.append(PeerResult(end["samples"] / end["elapsed"], steady, end["epoch"], cpu))
    return results


def _cpu_text(cpu: dict) -> str:
    return (f"   [steady: training thread {cpu['main']:.2f} core, background {cpu['background']:.3f} core, "
            f"{cpu['per_main_second']:.0f} samples per training-thread CPU second]")


def bench_throughput(seconds: float = SECONDS, repeats: int = REPEATS) -> None:
    in_dim, hidden = MODEL["in_dim"], MODEL["hidden"]
    params = in_dim * hidden + hidden + hidden + 1
    print(f"== throughput: MLP with {params / 1e6:.2f}M parameters, batch {DATA['batch_size']}, 1 torch thread per peer, "
          f"{seconds:.0f} s of training per run (steady state from {WARMUP:.0f} s), target_batch_size {TARGET}, "
          f"{repeats} interleaved repeat(s) of alone / alone x2 / swarm"
          + (", each peer pinned to its own core" if PIN else ""))
    print("   Each peer process also runs hivemind's DHT, two averager processes and a p2p daemon. On a 2-core machine\n"
          "   a single peer has a spare core for them, two peers do not: 'alone x2' runs two unrelated one-peer\n"
          "   swarms side by side, i.e. the same machine load without the swarm, and isolates the swarm's own cost.\n"
          "   The machine's speed drifts by 10% over minutes: each repeat's ratios use that repeat's alone runs.\n"
          "   samples/s: whole window | steady state")
    ratios = {"first": [], "second": []}  # steady-state ratios to alone, one per repeat
    ratios_x2 = {"first": [], "second": []}
    with tempfile.TemporaryDirectory() as tmp:
        for repeat in range(repeats):
            root = Path(tmp) / f"repeat_{repeat}"
            (alone, alone_steady, alone_epochs, cpu), = _run_peers(root / "alone", [("alone", "bench_alone", 0)],
                                                                    seconds, join=False)
            print(f"[{repeat}] alone       : {alone:8.1f} | {alone_steady:8.1f} samples/s ({alone_epochs} global epochs)"
                  + _cpu_text(cpu), flush=True)
            side_by_side = _run_peers(root / "alone_x2", [("solo_a", "bench_solo_a", 0),
                                                          ("solo_b", "bench_solo_b", 30_000)], seconds, join=False)
            for name, (sps, steady, epochs, cpu) in zip(("solo_a", "solo_b"), side_by_side):
                print(f"[{repeat}] alone x2    : {sps:8.1f} | {steady:8.1f} samples/s ({name}, {epochs} global epochs)"
                      + _cpu_text(cpu), flush=True)
            x2 = sum(result.sps for result in side_by_side) / 2
            x2_steady = sum(result.steady for result in side_by_side) / 2
            swarm = _run_peers(root / "swarm", [("first", "bench_pair", 0), ("second", "bench_pair", 30_000)], seconds,
                               join=True)
            for name, (sps, steady, epochs, cpu) in zip(("first", "second"), swarm):
                ratios[name].append(steady / alone_steady)
                ratios_x2[name].append(steady / x2_steady)
                print(f"[{repeat}] 2-peer swarm: {sps:8.1f} | {steady:8.1f} samples/s ({name}, {epochs} global epochs) -> "
                      f"ratio to alone {sps / alone:.2f} | {steady / alone_steady:.2f}, to alone x2 {sps / x2:.2f} | "
                      f"{steady / x2_steady:.2f}" + _cpu_text(cpu), flush=True)
    for name in ("first", "second"):
        print(f"steady-state ratio, {name} peer: to alone " + " ".join(f"{r:.2f}" for r in ratios[name])
              + f" (median {statistics.median(ratios[name]):.2f}, min {min(ratios[name]):.2f}), to alone x2 "
              + " ".join(f"{r:.2f}" for r in ratios_x2[name]) + f" (median {statistics.median(ratios_x2[name]):.2f})", flush=True)


def bench_peers(seconds: float = SECONDS) -> None:
    """N peers of one swarm on 127.0.0.1 (N in BENCH_PEER_COUNTS): what each peer's swarm work costs it, i.e. the CPU
    of everything but its training thread (DHT, averagers, p2p daemon), per second and per global epoch."""
    print(f"== peers: one swarm of N peers on 127.0.0.1, the MLP of 'throughput', target_batch_size {TARGET}, "
          f"{seconds:.0f} s per run, steady state from {WARMUP:.0f} s; load average at start {os.getloadavg()[0]:.1f}")
    print("   N  peer   samples/s steady  global epochs (steady)  background core  background CPU s per epoch")
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(KEEP_DIR or tmp)
        for count in PEER_COUNTS:
            specs = [(f"peer{i}", f"bench_peers_{count}", 30_000 * i) for i in range(count)]
            results = _run_peers(root / f"n{count}", specs, seconds, join=count > 1)
            for index, result in enumerate(results):
                cpu = result.cpu
                per_epoch = cpu["background"] * cpu["steady_seconds"] / cpu["steady_epochs"] \
                    if cpu["steady_epochs"] else float("nan")
                print(f"  {count:2d}  {index:4d}  {result.steady:16.1f}  {result.epochs:6d} ({cpu['steady_epochs']:3d})"
                      f"           {cpu['background']:15.3f}  {per_epoch:26.2f}", flush=True)
            print(f"  {count:2d}  all   {sum(result.steady for result in results):16.1f}  (swarm samples/s)", flush=True)


# mode "overlap": variants (tag, name, strategy options, environment of the peers, smallest swarm run with)
SYNCHRONOUS = dict.fromkeys(("delay_optimizer_step", "delay_grad_averaging", "delay_state_averaging"), False)
OVERLAP_VARIANTS = [
    ("epoch", "overlap, rounds matched per epoch (now)", {"overlap_max_peers": None}, {}, 1),
    ("before", "overlap, one key for all epochs (before)", {"overlap_max_peers": None}, {"PEER_EPOCH_ROUNDS": "0"}, 3),
    ("sync", "synchronous (overlap options off)", SYNCHRONOUS, {}, 1),
    ("fallback", "overlap_max_peers=2 (the fallback)", {"overlap_max_peers": 2}, {}, 3),
    # without the reducer check (verify_reducers, on by default), whose exclusions split overlapped swarms
    ("epoch_nocheck", "overlap per epoch, verify_reducers off", {"overlap_max_peers": None, "averager_opts":
                                                                {"verify_reducers": False}}, {}, 1),
    ("sync_nocheck", "synchronous, verify_reducers off", dict(SYNCHRONOUS, averager_opts={"verify_reducers": False}),
     {}, 1),
]
OVERLAP_PEERS = [int(n) for n in os.environ.get("BENCH_OVERLAP_PEERS", "4,2").split(",")]
OVERLAP_TAGS = os.environ.get("BENCH_OVERLAP_VARIANTS", "epoch,before,sync,fallback").split(",")
# hivemind's warnings (logged whatever `verbose`) when a round ends without some peer's parts or results
PARTIAL_ROUND_LINES = ("Reducer: received", "Averaging: received")
# the reducer check's line when a peer keeps a reducer out of its later groups (result_verification)
EXCLUSION_LINE = "is kept out of this peer's later groups"


def bench_overlap(seconds: float = SECONDS) -> None:
    """The overlap options in swarms of BENCH_OVERLAP_PEERS peers (default 4 and 2), the variants of OVERLAP_VARIANTS
    named in BENCH_OVERLAP_VARIANTS (all by default; "before" and "fallback" only from 3 peers)."""
    print(f"== overlap: swarms of N peers on 127.0.0.1, the MLP of 'throughput', target_batch_size {TARGET}, "
          f"{seconds:.0f} s per run, steady state from {WARMUP:.0f} s")
    print("   N  variant                                    swarm samples/s  global epochs  partial-round lines"
          "  exclusions  load average at start")
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(KEEP_DIR or tmp)
        for count in OVERLAP_PEERS:
            for tag, name, options, env, min_peers in OVERLAP_VARIANTS:
                if tag not in OVERLAP_TAGS or count < min_peers:
                    continue
                load = os.getloadavg()[0]
                specs = [(f"peer{i}", f"bench_overlap_{tag}_{count}", 30_000 * i) for i in range(count)]
                logs = []
                saved = dict(os.environ)
                os.environ.update(env)  # the peers inherit it
                try:
                    results = _run_peers(root / f"{tag}_{count}", specs, seconds, join=True, options=options, logs=logs)
                except RuntimeError as e:  # a peer died (e.g. the OOM killer on a shared machine): the next row
                    print(f"  {count:2d}  {name:40s}  failed: {str(e).splitlines()[0]}", flush=True)
                    continue
                finally:
                    os.environ.clear()
                    os.environ.update(saved)
                partial = sum(line.count(marker) for line in logs for marker in PARTIAL_ROUND_LINES)
                excluded = sum(line.count(EXCLUSION_LINE) for line in logs)
                epochs = "-".join(sorted({str(result.epochs) for result in results}, key=int))
                print(f"  {count:2d}  {name:40s}  {sum(result.steady for result in results):15.1f}  {epochs:>13s}"
                      f"  {partial:19d}  {excluded:10d}  {load:.1f}", flush=True)


if __name__ == "__main__":
    mode = sys.argv[1] if len(sys.argv) > 1 else "all"
    if mode == "averaging-peer":
        averaging_peer(sys.argv[2], sys.argv[3], int(sys.argv[4]))
    else:
        if mode in ("averaging", "all"):
            bench_averaging()
        if mode in ("throughput", "all"):
            bench_throughput()
        if mode == "peers":
            bench_peers()
        if mode == "overlap":
            bench_overlap()
