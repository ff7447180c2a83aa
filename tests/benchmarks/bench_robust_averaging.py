"""Benchmarks of robust averaging (figures printed, nothing asserted).

1. round: time of one all-reduce round of a 25M-parameter model (10 tensors of 2.5M values) among 3 local peers, each
   a hivemind DecentralizedAverager in its own process, with the swarm's default wire codec (8-bit): hivemind's own
   all-reduce, our screened weighted mean (aggregation="mean"), CenteredClip (aggregation="centered_clip") and
   CenteredClip with its alignment screen (centered_clip_min_alignment=0.5, "centered_clip+align"), in interleaved
   repeats. Timed from the moment the group is formed (matchmaking excluded) to the peer's last update; a round's
   time is its slowest peer's. A round that fails for a peer (its step raised, e.g. no group of 3 within
   STEP_TIMEOUT) is counted and left out of the medians, and a group whose peer gives no result by its deadline is
   killed (BENCH_PEER_LOG=path keeps the peers' logs: hivemind's "retrying" lines show a round one peer redid).
2. part: the arithmetic alone, in this process with 1 torch thread: screening + weighted mean, screening +
   CenteredClip, and CenteredClip with the alignment screen (honest senders, and one negated) of one all-reduce part
   (3 senders x 524,288 float32 values, the part size of a 25M-parameter round with the 8-bit codec), median of 30
   calls each, in CPU time of the calling thread (less sensitive than wall time to other processes on a shared
   machine).
3. attacks: the honest peers' validation loss in a 3-peer HivemindStrategy swarm (tests/lightning_swarm/byzantine.py:
   least squares to its noise floor, STOP_AT_EPOCH global epochs; before 2e13298 an MLP, 4 epochs) without an
   attacker and with a third peer that sends gradients x1e3, NaN gradients, or claims weight 1e9 with negated
   gradients; each with aggregation="mean" and "centered_clip", with each worker momentum of BENCH_WORKER_MOMENTA
   (default 0: off), attacker included, and for CenteredClip each alignment screen of BENCH_MIN_ALIGNMENTS
   (default 0.5; "off": none).

   The robust variants check each reducer's result (issue 24 item 9) unless "+unverified" is in their name
   (BENCH_VARIANTS=centered_clip,centered_clip+unverified,mean,mean+unverified: the check's cost side by side);
   "+clients" puts every peer but the first in client mode (the first then reduces every part and relays the
   others' signed verification messages: BENCH_VARIANTS=centered_clip+clients,centered_clip+clients+unverified).
Run: python tests/benchmarks/bench_robust_averaging.py [round|part|attacks|all]
     BENCH_REPEATS=5 BENCH_ROUNDS=3 python tests/benchmarks/bench_robust_averaging.py round   (5 x 3 rounds each)
     BENCH_AGGREGATIONS=mean python tests/benchmarks/bench_robust_averaging.py attacks
     BENCH_AGGREGATIONS=centered_clip BENCH_MIN_ALIGNMENTS=off,0.5 BENCH_ATTACKS=none,weight \
         python tests/benchmarks/bench_robust_averaging.py attacks
The machine is shared (2 cores, 3 peers): say what else ran when quoting the figures.
"""

from __future__ import annotations

import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
TESTS = REPO / "tests" / "lightning_swarm"
NUM_PEERS = 3
# +align: min_alignment 0.5; +unverified: without the check of the reducers' results (verify_reducers=False)
STEP_TIMEOUT = 60.0  # seconds a peer's round may take, matchmaking included
VARIANTS = tuple(os.environ.get("BENCH_VARIANTS", "hivemind,mean,centered_clip,centered_clip+align").split(","))


def round_peer(variant: str, initial_peer: str, rounds: int) -> None:
    """One peer of the round benchmark (run in its own process); prints RESULT [seconds per round]."""
    import torch
    from lightning_swarm.hivemind_ext.lifetime import SwarmDHT  # hivemind.DHT whose death is noticed
    from hivemind.averaging import DecentralizedAverager
    from hivemind.averaging.control import AveragingStage

    from lightning_swarm.aggregation import DEFAULT_MIN_ALIGNMENT
    from lightning_swarm.compression import default_compression
    from lightning_swarm.hivemind_ext.robust_allreduce import RobustAveraging
    from lightning_swarm.hivemind_ext.round_groups import PatientGroupRegistration

    # as the strategy's averagers: a groupmate's part that arrives before this peer registered the group waits for
    # it (without, a client-mode group sometimes lost every result, "received 0.0% results", and hung)
    class ScreenedAverager(PatientGroupRegistration, RobustAveraging, DecentralizedAverager):
        pass

    import tempfile

    from lightning_swarm.hivemind_ext.relayed_messages import write_identity

    torch.set_num_threads(1)
    # "+clients": every peer but the first in client mode (the first reduces everything and relays the others'
    # verification messages, which they sign with their identity keys, as the strategy's peers do)
    client_mode = "clients" in variant.split("+") and bool(initial_peer)
    identity = os.path.join(tempfile.mkdtemp(prefix="bench_round_"), "identity.key")
    write_identity(identity)
    dht = SwarmDHT(initial_peers=[initial_peer] if initial_peer else None, host_maddrs=["/ip4/127.0.0.1/tcp/0"],
                   client_mode=client_mode, identity_path=identity, check_if_identity_free=False, start=True)
    if not initial_peer:
        print("MADDR", dht.get_visible_maddrs()[0], flush=True)
    generator = torch.Generator().manual_seed(os.getpid())
    tensors = [torch.randn(25_000_000 // 10, generator=generator) for _ in range(10)]
    options = dict(dht=dht, prefix=f"bench_robust_{variant}", target_group_size=NUM_PEERS, min_group_size=NUM_PEERS,
                   min_matchmaking_time=3.0, request_timeout=1.0, compression=default_compression(),
                   client_mode=client_mode, start=True)
    if variant == "hivemind":
        averager = DecentralizedAverager(tensors, **options)
    else:
        aggregation, *flags = variant.split("+")
        averager = ScreenedAverager(tensors, aggregation=aggregation, verify_reducers="unverified" not in flags,
                                    centered_clip_min_alignment=DEFAULT_MIN_ALIGNMENT if "align" in flags else None,
                                    **options)
    times = []
    for index in range(rounds):
        control = averager.step(wait=False, require_trigger=True, timeout=STEP_TIMEOUT)
        while control.stage != AveragingStage.AWAITING_TRIGGER and not control.done():
            time.sleep(0.005)
        start = time.perf_counter()
        control.allow_allreduce()
        try:
            control.result()
            times.append(time.perf_counter() - start)
        except Exception as e:  # a failed round (most often matchmaking: no group of NUM_PEERS in time) is reported
            print(f"round {index} failed: {e!r}", file=sys.stderr, flush=True)
            times.append(None)
    print("RESULT", json.dumps(times), flush=True)
    time.sleep(2)  # let the groupmates finish receiving before this peer leaves
    averager.shutdown()
    dht.shutdown()


def _kill_group(process: subprocess.Popen) -> None:
    """Kill a round peer and what it started (its averager and DHT processes, p2pd: its own session)."""
    try:
        os.killpg(process.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    process.wait()


def run_round_group(variant: str, rounds: int) -> list:
    """Start NUM_PEERS round peers of ``variant``; return each round's time (slowest peer; None: the round failed
    for a peer, or a peer gave no result by its deadline: each round's step timeout plus start and shutdown)."""
    command = [sys.executable, __file__, "_round_peer", variant]
    env = dict(os.environ, PYTHONPATH=str(REPO))
    # BENCH_PEER_LOG=path: the peers' stderr appended there (default: discarded)
    errors = open(os.environ["BENCH_PEER_LOG"], "a") if os.environ.get("BENCH_PEER_LOG") else subprocess.DEVNULL
    first = subprocess.Popen(command + ["", str(rounds)], stdout=subprocess.PIPE, stderr=errors, text=True,
                             start_new_session=True, env=env)
    others = []
    try:
        maddr = next(line.split()[1] for line in first.stdout if line.startswith("MADDR"))
        others = [subprocess.Popen(command + [maddr, str(rounds)], stdout=subprocess.PIPE, stderr=errors,
                                   text=True, start_new_session=True, env=env) for _ in range(NUM_PEERS - 1)]
        results = []
        deadline = time.monotonic() + 120 + rounds * (STEP_TIMEOUT + 10)
        for process in [first] + others:
            try:
                output, _ = process.communicate(timeout=max(deadline - time.monotonic(), 1.0))
            except subprocess.TimeoutExpired:
                print(f"  {variant}: a peer gave no result by its deadline (killed)", flush=True)
                _kill_group(process)
                results.append([None] * rounds)
                continue
            line = next((line for line in output.splitlines() if line.startswith("RESULT")), None)
            results.append(json.loads(line.split(" ", 1)[1]) if line else [None] * rounds)
        rounds_times = [None if None in times else max(times) for times in zip(*results)]
        if None in rounds_times:
            print(f"  {variant}: {rounds_times.count(None)} of {rounds} rounds failed (BENCH_PEER_LOG=path keeps "
                  f"the peers' logs)", flush=True)
        return rounds_times
    finally:
        for process in [first] + others:
            _kill_group(process)


def bench_round() -> None:
    repeats, rounds = int(os.environ.get("BENCH_REPEATS", "3")), int(os.environ.get("BENCH_ROUNDS", "3"))
    times = {variant: [] for variant in VARIANTS}
    for _ in range(repeats):
        for variant in VARIANTS:  # interleaved, so that a change of machine load hits every variant
            times[variant] += run_round_group(variant, rounds)
    failed = {variant: values.count(None) for variant, values in times.items()}
    times = {variant: [t for t in values if t is not None] or [float("nan")] for variant, values in times.items()}
    medians = {variant: statistics.median(values) for variant, values in times.items()}
    print(f"\nall-reduce round, 25M float32 parameters, {NUM_PEERS} peers on 127.0.0.1, 8-bit codec, "
          f"{repeats} x {rounds} rounds each (median; slowest peer of each round)")
    reference = "hivemind" if "hivemind" in medians else VARIANTS[0]
    for variant in VARIANTS:
        print(f"  {variant:>26}: {medians[variant]:.2f} s  (min {min(times[variant]):.2f}, max "
              f"{max(times[variant]):.2f})  x{medians[variant] / medians[reference]:.2f} of {reference}'s"
              + (f"  ({failed[variant]} of {repeats * rounds} rounds failed)" if failed[variant] else ""))
    for variant in VARIANTS:
        if variant + "+unverified" in medians:
            print(f"  {variant} / {variant}+unverified (the reducer check's cost): "
                  f"x{medians[variant] / medians[variant + '+unverified']:.2f}")
    if "centered_clip" in medians and "mean" in medians:
        print(f"  centered_clip / mean: x{medians['centered_clip'] / medians['mean']:.2f}")


def bench_part() -> None:
    import torch

    from lightning_swarm.aggregation import DEFAULT_MIN_ALIGNMENT
    from lightning_swarm.hivemind_ext.robust_allreduce import screen_and_aggregate

    torch.set_num_threads(1)
    generator = torch.Generator().manual_seed(0)
    common = torch.randn(524_288, generator=generator)
    parts = [common + 0.5 * torch.randn(524_288, generator=generator) for _ in range(NUM_PEERS)]
    weights = [1.0] * NUM_PEERS
    # (aggregation, min_alignment, the last sender negated: the screen lowers its weight)
    cases = {"mean": ("mean", None, False), "centered_clip": ("centered_clip", None, False),
             "centered_clip+align": ("centered_clip", DEFAULT_MIN_ALIGNMENT, False),
             "centered_clip+align, 1 negated": ("centered_clip", DEFAULT_MIN_ALIGNMENT, True)}
    medians = {}
    for name, (aggregation, min_alignment, negated) in cases.items():
        senders = parts[:-1] + [-parts[-1]] if negated else parts
        screen_and_aggregate(senders, weights, None, aggregation, None, 20, min_alignment)  # warm-up
        times = []
        for _ in range(30):
            start = time.thread_time()
            screen_and_aggregate(senders, weights, None, aggregation, None, 20, min_alignment)
            times.append(time.thread_time() - start)
        medians[name] = statistics.median(times)
    print(f"\none part ({NUM_PEERS} x 524,288 float32), screening + aggregation, 1 thread, CPU time, median of 30:")
    for name, median in medians.items():
        print(f"  {name:>30}: {median * 1e3:.2f} ms (x{median / medians['mean']:.1f} of mean)")


def bench_attacks() -> None:
    sys.path[:0] = [str(TESTS), str(REPO)]
    os.environ["PYTHONPATH"] = os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])
    from byzantine import STOP_AT_EPOCH, run_swarm, validation_loss

    from lightning_swarm.aggregation import DEFAULT_MIN_ALIGNMENT

    aggregations = os.environ.get("BENCH_AGGREGATIONS", "mean,centered_clip").split(",")
    momenta = [float(beta) for beta in os.environ.get("BENCH_WORKER_MOMENTA", "0").split(",")]
    alignments = [None if value == "off" else float(value)
                  for value in os.environ.get("BENCH_MIN_ALIGNMENTS", str(DEFAULT_MIN_ALIGNMENT)).split(",")]
    attacks = os.environ.get("BENCH_ATTACKS", "none,scale,nan,weight").split(",")
    columns = [(aggregation, beta, alignment) for aggregation in aggregations for beta in momenta
               for alignment in (alignments if aggregation == "centered_clip" else [None])]
    print(f"\nhonest peers' validation loss after {STOP_AT_EPOCH} global epochs (initialisation: "
          f"{validation_loss():.3f})")
    names = [f"{aggregation} m={beta:g} a={'off' if alignment is None else alignment}"
             for aggregation, beta, alignment in columns]
    print(f"  {'attack':>8} | " + " | ".join(f"{name:>28}" for name in names))
    for attack in attacks:
        cells = []
        for aggregation, beta, alignment in columns:
            with tempfile.TemporaryDirectory() as root:
                try:
                    params, _ = run_swarm(Path(root), None if attack == "none" else attack, aggregation,
                                          worker_momentum=beta, min_alignment=alignment)
                    losses = [validation_loss(p) for p in params]
                    cells.append(" / ".join(f"{loss:.4g}" for loss in losses))
                except Exception as e:  # an attack that stops the honest peers is a result too
                    cells.append(f"failed: {type(e).__name__}")
        print(f"  {attack:>8} | " + " | ".join(f"{cell:>28}" for cell in cells), flush=True)


if __name__ == "__main__":
    if sys.argv[1:2] == ["_round_peer"]:
        round_peer(sys.argv[2], sys.argv[3], int(sys.argv[4]))
        sys.exit(0)
    which = sys.argv[1] if len(sys.argv) > 1 else "all"
    if which in ("round", "all"):
        bench_round()
    if which in ("part", "all"):
        bench_part()
    if which in ("attacks", "all"):
        bench_attacks()
