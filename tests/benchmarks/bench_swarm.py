"""Benchmarks of the swarm (figures printed, nothing asserted).

1. averaging: time of one averaging round of a 25M-parameter model between two local peers (hivemind
   DecentralizedAverager, 10 tensors of 2.5M values), with our default wire codec and with none/fp16, next to
   /work/shared/peers/hivemind_averaging_anchor.py run the same way (if present).
2. throughput: one peer's samples/s inside a 2-peer HivemindStrategy swarm divided by its samples/s alone, same
   model, batch and thread count (1 torch thread per peer), with the overlap options
   (delay_optimizer_step + delay_grad_averaging + delay_state_averaging).

Run: python tests/benchmarks/bench_swarm.py [averaging|throughput|all]
     BENCH_AVERAGE_STATE_EVERY=4 python tests/benchmarks/bench_swarm.py throughput   (state averaging every 4 epochs)
The machine is shared (2 cores): run it when nothing else runs, the ratio moves a lot with background load.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
ANCHOR = Path("/work/shared/peers/hivemind_averaging_anchor.py")
sys.path.insert(0, str(REPO / "tests" / "lightning_swarm"))


# ------------------------------------------------------------------------------------------- averaging round
def averaging_peer(initial_peer: str, compression: str, rounds: int) -> None:
    """One side of the averaging benchmark (run in its own process)."""
    import torch
    import hivemind
    from hivemind.compression import Float16Compression, NoCompression

    from lightning_swarm.compression import default_compression

    dht = hivemind.DHT(initial_peers=[initial_peer] if initial_peer else None, host_maddrs=["/ip4/127.0.0.1/tcp/0"],
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
TARGET = 16384  # samples per global epoch: several seconds of work between averaging rounds


def bench_throughput(seconds: float = 60.0) -> None:
    from swarm_harness import Peer

    model = {"in_dim": 1024, "hidden": 4096, "lr": 0.01, "lr_decay": 1.0}
    data = {"batch_size": 64, "in_dim": 1024, "num_samples": 30_000}
    overlap = dict(delay_optimizer_step=True, delay_grad_averaging=True, delay_state_averaging=True,
                   matchmaking_time=2.0, averaging_timeout=30.0, host_maddrs=["/ip4/127.0.0.1/tcp/0"],
                   metrics_interval=5.0, average_state_every=int(os.environ.get("BENCH_AVERAGE_STATE_EVERY", "1")))
    recorder = {"stop_at_epoch": 100_000, "max_seconds": seconds}
    params = (1024 * 4096 + 4096 + 4096 + 1)
    print(f"== throughput: MLP with {params / 1e6:.2f}M parameters, batch 64, 1 torch thread per peer, "
          f"{seconds:.0f} s of training per run, target_batch_size {TARGET}")
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        alone = Peer(root, "alone", dict(run_id="bench_alone", target_batch_size=TARGET, **overlap), model=model,
                     data=data, recorder=recorder)
        try:
            alone.wait(timeout=seconds + 240)
        finally:
            alone.kill()
        end = alone.events()[-1]
        solo_sps = end["samples"] / end["elapsed"]
        print(f"alone:   {solo_sps:8.1f} samples/s ({end['samples']} samples in {end['elapsed']:.1f} s, "
              f"{end['epoch']} global epochs)", flush=True)

        barrier = dict(recorder, barrier_dir=str(root / "barrier"), barrier_count=2)
        first = Peer(root, "first", dict(run_id="bench_pair", target_batch_size=TARGET, **overlap), model=model,
                     data=data, recorder=barrier)
        second = None
        try:
            join = first.join_peers(timeout=240)
            second = Peer(root, "second", dict(run_id="bench_pair", target_batch_size=TARGET, initial_peers=join,
                                               **overlap), model=model, data=dict(data, offset=30_000),
                          recorder=barrier)
            for peer in (first, second):
                peer.wait(timeout=seconds + 300)
        finally:
            for peer in (first, second):
                if peer is not None:
                    peer.kill()
        for peer in (first, second):
            end = peer.events()[-1]
            sps = end["samples"] / end["elapsed"]
            print(f"{peer.name:7s}: {sps:8.1f} samples/s in the 2-peer swarm ({end['epoch']} global epochs) -> "
                  f"ratio to alone {sps / solo_sps:.2f}", flush=True)


if __name__ == "__main__":
    mode = sys.argv[1] if len(sys.argv) > 1 else "all"
    if mode == "averaging-peer":
        averaging_peer(sys.argv[2], sys.argv[3], int(sys.argv[4]))
    else:
        if mode in ("averaging", "all"):
            bench_averaging()
        if mode in ("throughput", "all"):
            bench_throughput()
