"""Many peers on one machine (figures printed, nothing asserted): swarms of simulated accelerators
(tests/lightning_swarm/many_peers.py) of uneven speeds, with and without overlap, client-mode peers and churn.

Each peer runs the real HivemindStrategy (DHT, matchmaking, averaging, 8-bit codec) in its own process group on
127.0.0.1; its "accelerator" sleeps B / rate seconds per step of B samples and computes a real gradient of a
known-optimum least-squares problem (tests/lightning_swarm/sim_accelerator.py, P = BENCH_MPARAMS million
parameters). Speeds spread 1x-10x: peer i of N runs at BENCH_BASE_RATE * (1 + 9 i / (N - 1)) samples/s. The
target batch is sized as docs/swarm-at-scale.md says (an epoch several times the communication time): the sum of
the rates times BENCH_EPOCH_SECONDS.

Per run (one row), over the steady window (from BENCH_WARMUP s after every peer took its first step to the stop):
- swarm/ideal: samples that entered a global step per second, over the sum of the simulated rates of the N slots
  (a replaced peer's start-up counts as lost time);
- entered: the share of the samples peers processed that entered a global step (the rest: a peer that fell behind
  and loaded the state, a failed round, a peer killed before its round);
- partial: hivemind's partial-round warnings ("Reducer/Averaging: received x%") in all logs of the run;
- failed, resync: the window's epoch transitions after a failed gradient round (local gradients) or a catch-up
  (counted in the window only since 2026-11-28: rounds under way when the peers stop at the run's end fail too);
  with overlap a round's outcome is logged in the background during the next epoch, so each transition carries the
  outcome of the round before it (the counts hold, one epoch late); entered judges an epoch's samples by the
  outcome logged with the peer's next transition (since 4e3862d; a peer's last epoch, whose outcome never came,
  counts as entered);
- wait s/step: per peer, seconds of its local steps beyond the simulated compute, per global step (mean of peers);
- loss/ref: the peers' excess loss after the last global step of the window (median of peers), over one process
  (computed here) that took SGD steps with the same number of samples per global step (the sum of what the peers
  reported as entered), as many steps as the peer has applied, with the same staleness. With overlap
  (delay_optimizer_step) an epoch's update lands during the next epoch: a peer that reached epoch K holds K - 1
  updates, and the samples it processed before an update landed had their gradient taken at the parameters before it
  (stale: their share, mean over steps; the reference takes that share of each step's gradient at its previous
  parameters). Against plain SGD at K (plain) overlapped peers whose parameters agreed to 5 digits read 1.22-1.32
  (docs/notes/swarm-at-scale-measurements.md, 2026-11-29). (spread): the largest minus the smallest peer's, over the
  plain reference's at K; (delayed): how many of the peers at K had their update delayed;
- RSS/PSS GB per peer (its processes summed: trainer, DHT, averagers, p2pd; max over the run, mean of peers) and
  background cores per peer (everything but its training thread) beside its training thread's cores.

Run: python tests/benchmarks/bench_many_peers.py                      (2, 4, 8, 16 peers, base variant; then the
                                                                       variants at 16 peers, ~30 min)
     BENCH_PEER_COUNTS=8 BENCH_VARIANTS=base,churn python tests/benchmarks/bench_many_peers.py
Variants: base (synchronous rounds, all reachable), overlap (delay_optimizer_step + delay_grad_averaging forced at
any size: overlap_max_peers null), fallback (the same options with the default overlap_max_peers: what a user who
asks for overlap gets, synchronous rounds beyond that many peers), client50 (every second peer in client mode), churn (a peer, never the first, is
SIGKILLed with its whole process group every BENCH_CHURN_SECONDS and a new one of the same speed joins), goal
(client50 + churn: the issue's goal, >= 0.85 of ideal); a suffix "-sync" (e.g. goal-sync) also makes the state
rounds synchronous (delay_state_averaging False); unchecked (a diagnostic: the averagers apply every reducer's result
unchecked, verify_reducers False, to tell what the rounds that can't be checked cost); hivemindvalidators (the peers' DHTs use hivemind's record validators,
which check each record every time, instead of lightning_swarm.record_validators); kinds combine with "+"
(goal+overlap: the goal with overlap forced).
BENCH_KEEP_DIR=/tmp/many keeps every peer's config, log and events; `python tests/benchmarks/bench_many_peers.py
--epochs /tmp/many/16-goal` then prints that run's loss over the reference at every global step and how many rounds
could not be checked. BENCH_LINKS=home (or poor, datacenter: profiles
of tests/lightning_swarm/netns_harness.py; needs root and iproute2) puts each peer in a network namespace behind a
shaped link of that profile instead of 127.0.0.1.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from paths import REPO  # noqa: E402

sys.path.insert(0, str(REPO / "tests" / "lightning_swarm"))
from many_peers import (ManyPeerSwarm, PeerSpec, entered, epoch_events, global_batch_sizes,  # noqa: E402
                        global_stale_fractions, peer_epoch_events, read_events)
from netns_harness import shaped_network  # noqa: E402
from sim_accelerator import reference_losses  # noqa: E402

PEER_COUNTS = [int(n) for n in os.environ.get("BENCH_PEER_COUNTS", "2,4,8,16").split(",")]
VARIANTS = os.environ.get("BENCH_VARIANTS", "base").split(",")
BIG_VARIANTS = os.environ.get("BENCH_BIG_VARIANTS", "overlap,client50,churn,goal").split(",")  # at the largest N
DURATION = float(os.environ.get("BENCH_DURATION", "120"))
WARMUP = float(os.environ.get("BENCH_WARMUP", "20"))
BASE_RATE = float(os.environ.get("BENCH_BASE_RATE", "20"))
EPOCH_SECONDS = float(os.environ.get("BENCH_EPOCH_SECONDS", "15"))
CHURN_SECONDS = float(os.environ.get("BENCH_CHURN_SECONDS", "30"))
MPARAMS = float(os.environ.get("BENCH_MPARAMS", "1"))
KEEP_DIR = os.environ.get("BENCH_KEEP_DIR")
LINKS = os.environ.get("BENCH_LINKS")  # a netns_harness profile name, or None: 127.0.0.1
PEER_GB = 0.95  # measured PSS of one peer (trainer, DHT, averagers, p2pd) at 1M parameters
MEMORY_WAIT = float(os.environ.get("BENCH_MEMORY_WAIT", "600"))  # seconds to wait for free memory before a run
PARTIAL = re.compile(r"(Reducer|Averaging): received \d")
STEP_SECONDS = float(os.environ.get("BENCH_STEP_SECONDS", "0.5"))  # a simulated local step (the 1b recipe's: seconds)
MODEL = dict(num_params=int(MPARAMS * 1e6), num_tensors=4, step_seconds=STEP_SECONDS)


def _kinds(variant: str) -> set:
    """The variant's kinds: "goal+overlap-sync" -> {"goal", "overlap"} (the suffix "-sync" is read apart)."""
    return set(variant.split("-")[0].split("+"))


def strategy_for(num_peers: int, variant: str, ideal: float) -> dict:
    strategy = dict(
        run_id=f"many{num_peers}{variant.replace('+', '_')}", target_batch_size=int(ideal * EPOCH_SECONDS),
        host_maddrs=["/ip4/127.0.0.1/tcp/0"], matchmaking_time=3.0, averaging_timeout=30.0, load_state_timeout=30.0,
        metrics_interval=10.0, tracker_opts={"min_refresh_period": 0.5, "max_refresh_period": 3.0},
    )
    if variant.endswith("-sync"):  # state rounds synchronous too (hivemind's default runs them in the background)
        strategy["delay_state_averaging"] = False
    if "overlap" in _kinds(variant):
        strategy.update(delay_optimizer_step=True, delay_grad_averaging=True, overlap_max_peers=None)
    if "fallback" in _kinds(variant):  # overlap asked for, with the default overlap_max_peers: synchronous beyond it
        strategy.update(delay_optimizer_step=True, delay_grad_averaging=True)
    if "unchecked" in _kinds(variant):  # diagnostic: every reducer's result applied unchecked (not for a public swarm)
        strategy["averager_opts"] = {"verify_reducers": False}
    return strategy


def specs_for(num_peers: int, variant: str) -> list:
    rates = [BASE_RATE * (1 + 9 * i / max(1, num_peers - 1)) for i in range(num_peers)]
    client = bool(_kinds(variant) & {"client50", "goal"})
    return [PeerSpec(rate, client_mode=client and i % 2 == 1) for i, rate in enumerate(rates)]


def available_gb() -> float:
    for line in open("/proc/meminfo"):
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) / 2**20
    return 0.0


def run(num_peers: int, variant: str) -> dict:
    # a peer takes ~0.95 GB (PSS): on a shared machine, wait for room rather than push others' processes out
    needed = num_peers * PEER_GB + 1.0
    deadline = time.monotonic() + MEMORY_WAIT
    while available_gb() < needed:
        if time.monotonic() > deadline:
            return {"peers": num_peers, "variant": variant,
                    "error": f"skipped: {available_gb():.1f} GB available, {needed:.1f} GB needed"}
        time.sleep(10)
    specs = specs_for(num_peers, variant)
    ideal = sum(spec.samples_per_second for spec in specs)
    root = Path(KEEP_DIR) / f"{num_peers}-{variant}" if KEEP_DIR else Path(tempfile.mkdtemp(prefix="many_peers_"))
    shutil.rmtree(root, ignore_errors=True)
    root.mkdir(parents=True)
    churn = bool(_kinds(variant) & {"churn", "goal"})
    # the peers' DHTs check each record every time, as hivemind's validators do (lightning_swarm's check it once)
    os.environ["BENCH_HIVEMIND_VALIDATORS"] = "1" if "hivemindvalidators" in _kinds(variant) else ""
    load = os.getloadavg()[0]
    try:
        links = shaped_network([LINKS] * num_peers) if LINKS else contextlib.nullcontext()
        with links as network, ManyPeerSwarm(root, specs, strategy_for(num_peers, variant, ideal), MODEL,
                                             duration=DURATION, network=network) as swarm:
            swarm.start(timeout=400)
            start = time.time()
            victims = 0
            while time.time() < swarm.stop_time:
                swarm.check_alive()
                if churn and time.time() >= start + CHURN_SECONDS * (victims + 1) < swarm.stop_time - 40:
                    swarm.replace(1 + victims % (num_peers - 1))
                    victims += 1
                time.sleep(0.5)
            swarm.wait(grace=120)
            leftovers_before_close = len(swarm.leftovers())
        result = analyse(swarm, start + WARMUP, swarm.stop_time, ideal)
        result.update(peers=num_peers, variant=variant, load=load, replaced=victims, leftovers=len(swarm.leftovers()),
                      leftovers_at_stop=leftovers_before_close, target=int(ideal * EPOCH_SECONDS))
        return result
    finally:
        if not KEEP_DIR:
            shutil.rmtree(root, ignore_errors=True)


def references(transitions: list, last: int, model: dict) -> tuple:
    """For global steps 1..last: the samples that entered each, the share of them taken before the previous
    update landed (delay_optimizer_step), and the losses of one process taking those steps: plain SGD, and with that
    share of each step's gradient taken at the parameters before the previous step."""
    problem = {k: v for k, v in model.items() if k in ("num_params", "num_tensors")}
    sizes = [max(1, n) for n in global_batch_sizes(transitions, last)]
    stale = global_stale_fractions(transitions, last)
    plain = reference_losses(sizes, **problem)
    return sizes, stale, plain, reference_losses(sizes, stale_fractions=stale, **problem) if any(stale) else plain


def loss_over_reference(event: dict, reference: list) -> float:
    """A peer's loss at the epoch an event reached over the reference's at the updates it holds: one fewer while
    its update of that epoch is delayed (delay_optimizer_step)."""
    return event["loss"] / reference[event["epoch"] - 1 if event.get("delayed") else event["epoch"]]


def analyse(swarm: ManyPeerSwarm, t0: float, t1: float, ideal: float) -> dict:
    everyone = swarm.retired + swarm.peers
    events = {peer.name: peer.events() for peer in everyone}
    transitions = epoch_events(everyone)
    step_time = {}  # global epoch -> when the first peer reached it
    for e in transitions:
        step_time[e["epoch"]] = min(step_time.get(e["epoch"], float("inf")), e["time"])
    in_window = sorted(k for k, t in step_time.items() if t0 <= t <= t1)
    if len(in_window) < 2:
        return {"error": f"{len(in_window)} global steps in the window"}
    first, last = in_window[0], in_window[-1]
    span = step_time[last] - step_time[first]

    window = [e for e in transitions if first < e["epoch"] <= last]
    entered_samples = sum(e["samples"] for e in window if entered(e))
    processed = sum(e["samples"] for e in window)
    for peer in swarm.retired:  # samples a killed peer processed after its last global step
        ticks = [e for e in events[peer.name] if e["kind"] in ("tick", "epoch")]
        if ticks and peer.killed and step_time[first] <= peer.killed <= step_time[last]:
            last_epoch = max((e for e in ticks if e["kind"] == "epoch"), key=lambda e: e["time"], default=None)
            processed += ticks[-1]["processed"] - (last_epoch["processed"] if last_epoch else 0)

    waits = []
    for name, peer_events in events.items():
        epochs = [e for e in peer_events if e["kind"] == "epoch"]
        deltas = [b["wait"] - a["wait"] for a, b in zip(epochs, epochs[1:]) if first < b["epoch"] <= last]
        if deltas:
            waits.append(sum(deltas) / len(deltas))

    _, stale, reference, delayed_reference = references(transitions, last, MODEL)
    at_last = [e for e in transitions if e["epoch"] == last]
    losses = [e["loss"] for e in at_last]
    ratios = [loss_over_reference(e, delayed_reference) for e in at_last]
    cpu_main, cpu_background = [], []
    for peer_events in events.values():
        ticks = [e for e in peer_events if e["kind"] == "tick" and t0 <= e["time"] <= t1]
        if len(ticks) >= 2 and ticks[-1]["time"] - ticks[0]["time"] > 10:
            seconds = ticks[-1]["time"] - ticks[0]["time"]
            cpu_main.append((ticks[-1]["cpu_main"] - ticks[0]["cpu_main"]) / seconds)
            cpu_background.append((ticks[-1]["cpu_background"] - ticks[0]["cpu_background"]) / seconds)
    memory = [max(s["rss_gb"] for s in peer.memory) for peer in everyone if peer.memory]
    pss = [max(s["pss_gb"] for s in peer.memory) for peer in everyone if peer.memory]
    return dict(
        swarm_sps=entered_samples / span, ideal=ideal, ratio=entered_samples / span / ideal,
        entered=entered_samples / max(1, processed), steps=last - first, partial=sum(
            len(PARTIAL.findall(peer.log())) for peer in everyone),
        wait=statistics.mean(waits) if waits else float("nan"),
        loss_ratio=statistics.median(ratios) if ratios else float("nan"),
        delayed=sum(1 for e in at_last if e.get("delayed")), stale=statistics.mean(stale) if stale else 0.0,
        plain_ratio=statistics.median(losses) / reference[last] if losses else float("nan"),
        loss_spread=(max(losses) - min(losses)) / reference[last] if losses else float("nan"), last_epoch=last,
        rss=statistics.mean(memory) if memory else float("nan"), pss=statistics.mean(pss) if pss else float("nan"),
        cpu_main=statistics.mean(cpu_main) if cpu_main else float("nan"),
        cpu_background=statistics.mean(cpu_background) if cpu_background else float("nan"),
        # in the window only: a round under way when the peers stop at the run's end fails for its members
        failed=sum(1 for e in window if "failed" in e["outcomes"]),
        resync=sum(1 for e in window if "resync" in e["outcomes"]),
    )


HEADER = ("| peers | variant | target | swarm samples/s (ideal) | swarm/ideal | entered | global steps | partial | "
          "wait s/step | loss/ref (spread, delayed; stale, plain) | failed, resync | replaced | RSS (PSS) GB/peer | "
          "cores/peer main, background | load avg at start |")


def row(r: dict) -> str:
    if "error" in r:
        return f"| {r['peers']} | {r['variant']} | {r.get('target')} | {r['error']} |"
    return (f"| {r['peers']} | {r['variant']} | {r['target']} | {r['swarm_sps']:.0f} ({r['ideal']:.0f}) | "
            f"{r['ratio']:.2f} | {r['entered']:.3f} | {r['steps']} | {r['partial']} | {r['wait']:.2f} | "
            f"{r['loss_ratio']:.4f} ({r['loss_spread']:.4f}, {r['delayed']}; {r['stale']:.3f}, "
            f"{r['plain_ratio']:.4f}) | "
            f"{r['failed']}, {r['resync']} | {r['replaced']} | "
            f"{r['rss']:.2f} ({r['pss']:.2f}) | {r['cpu_main']:.3f}, {r['cpu_background']:.3f} | {r['load']:.1f} |")


def main() -> None:
    runs = [(n, v) for n in PEER_COUNTS for v in VARIANTS]
    runs += [(max(PEER_COUNTS), v) for v in BIG_VARIANTS if v and v not in VARIANTS]
    print(f"== many peers: P = {MPARAMS}M, base rate {BASE_RATE}/s (x1-x10), local steps of {STEP_SECONDS} s, epochs of ~{EPOCH_SECONDS} s, "
          f"{DURATION} s per run (window from {WARMUP} s), churn every {CHURN_SECONDS} s, "
          f"links: {LINKS or '127.0.0.1'}", flush=True)
    print(HEADER)
    print("|" + "---|" * HEADER.count(" | ") + "---|", flush=True)
    for num_peers, variant in runs:
        started = time.strftime("%H:%M:%S", time.gmtime())
        try:
            result = run(num_peers, variant)
        except Exception as e:  # one failed run must not hide the others' figures
            result = {"peers": num_peers, "variant": variant, "error": f"{type(e).__name__}: {str(e)[:300]!r}"}
        print(row(result), f"<!-- {started} UTC {json.dumps(result)} -->", flush=True)


def kept_run_epochs(run_dir: Path) -> None:
    """Print, for a run kept under BENCH_KEEP_DIR (its folder ``<peers>-<variant>``), each global step's median loss
    over the reference (with the staleness the peers recorded; a delayed peer at K against the reference at K - 1),
    and how many of the peers' gradient and state rounds could not be checked ("no verification this round": every
    other member's slice kept local)."""
    peer_dirs = sorted(d for d in run_dir.iterdir() if (d / "events.jsonl").exists())
    events = []
    for d in peer_dirs:
        events.extend(peer_epoch_events(d.name, read_events(d)))
    last = max(e["epoch"] for e in events)
    config = json.loads((peer_dirs[0] / "config.json").read_text())
    sizes, stale, _, delayed = references(events, last, config["model"])
    print(f"== {run_dir.name}: per global step")
    print("| step | peers | delayed | samples | stale share | median loss | loss/ref |")
    print("|---|---|---|---|---|---|---|")
    for k in range(1, last + 1):
        at_k = [e for e in events if e["epoch"] == k]
        if not at_k:
            continue
        ratios = sorted(loss_over_reference(e, delayed) for e in at_k)
        losses = sorted(e["loss"] for e in at_k)
        print(f"| {k} | {len(at_k)} | {sum(1 for e in at_k if e.get('delayed'))} | {sizes[k - 1]} | "
              f"{stale[k - 1]:.2f} | {losses[len(losses) // 2]:.5f} | {ratios[len(ratios) // 2]:.4f} |")
    counts = {"gradient": [0, 0], "state": [0, 0]}  # rounds, unverified
    for d in peer_dirs:
        unverified = False
        for line in (d / "log.txt").read_text(errors="replace").splitlines():
            if "no verification this round" in line:
                unverified = True
                continue
            kind = ("gradient" if "Averaged gradients with" in line or "Averaging gradients failed" in line else
                    "state" if "Averaged parameters with" in line or "Averaging failed with" in line else None)
            if kind:
                counts[kind][0] += 1
                counts[kind][1] += unverified
                unverified = False
    print("rounds (per peer) that could not be checked: " + ", ".join(
        f"{kind} {bad} of {total}" for kind, (total, bad) in counts.items()))


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--epochs":
        kept_run_epochs(Path(sys.argv[2]))
    else:
        main()
