"""A newcomer joins a swarm that does not wait for it: peer A trains with global steps much shorter than B's state
download over a shaped link (two namespaces, netns_harness), and B joins while A trains. No barrier: A never waits.

Used by tests/lightning_swarm/test_newcomer.py and tests/benchmarks/bench_newcomer.py.
"""

from __future__ import annotations

import re
import time
from pathlib import Path
from typing import Any, Dict

from netns_harness import shaped_network
from swarm_harness import Peer, wait_until

# 10 * HIDDEN + 1 float32 parameters (TinyRegression, SGD without momentum: no optimizer statistics): an 8 MB state,
# ~7 s over the newcomer's 10 Mbit/s link, while the swarm steps every ~1 s (4 local steps of >= 0.2 s)
HIDDEN = 200_000
LINKS = ["home", "poor"]  # A, B: the download is bounded by B's 10 Mbit/s
DOWNLOADED = re.compile(r"Downloaded state from \S+: ([\d.]+) MB, \d+ tensors in ([\d.]+) s")
CAUGHT_UP = re.compile(r"training at the swarm's epoch (\d+) on a state of epoch (\d+) \((\d+) behind")
AVERAGED_WITH_TWO = "Averaged gradients with 2 peers"
LOG_TIME = re.compile(r"^\w{3} +\d+ (\d\d):(\d\d):(\d\d\.\d+) ", re.MULTILINE)  # hivemind's log lines


def _seconds_between(log: str, first: str, then: str):
    """Seconds from the first log line holding ``first`` to the next one holding ``then`` (None if either is missing;
    hivemind's timestamps, within one day)."""
    start = log.find(first)
    end = log.find(then, start) if start >= 0 else -1
    if end < 0:
        return None

    def time_of(position: int) -> float:
        line_start = log.rfind("\n", 0, position) + 1
        match = LOG_TIME.match(log, line_start)
        hours, minutes, seconds = match.groups()
        return int(hours) * 3600 + int(minutes) * 60 + float(seconds)

    return (time_of(end) - time_of(start)) % 86400


def strategy_options(root: Path, max_stale_epochs: int, host_maddrs) -> Dict[str, Any]:
    return dict(run_id="newcomer", target_batch_size=16, host_maddrs=host_maddrs, matchmaking_time=2.0,
                averaging_timeout=30.0, load_state_timeout=20.0, compression="fp16", verbose=True,
                max_stale_epochs=max_stale_epochs)


def run_newcomer_scenario(root: Path, max_stale_epochs: int, donor_epochs: int = 3, rounds: int = 3,
                          window: float = 150.0) -> Dict[str, Any]:
    """A trains alone until its epoch ``donor_epochs``, then B joins; returns once B averaged ``rounds`` gradient
    rounds with A, or after ``window`` seconds from B's join. Both peers and the namespaces are removed at exit.

    Returns: downloads (B's completed state downloads), download_s and download_mb (the first one's), caught_up
    (B's log lines: swarm epoch, state epoch, behind), rounds_b (B's gradient rounds with 2 peers), peers_a/peers_b
    (the largest swarm size each recorded), first_round_s (seconds from B's join to its first round with A, None if
    none; B's own start-up included), first_round_after_download_s (from the end of B's first download to its
    first round with A), a_epochs (A's epochs during the window), elapsed."""
    peers = []
    with shaped_network(LINKS) as net:
        try:
            model = {"hidden": HIDDEN, "step_delay": 0.2, "lr": 1e-6, "lr_decay": 1.0}
            data = {"batch_size": 4}
            recorder = {"stop_at_epoch": 100_000, "max_seconds": window + 300, "record_params": False}
            a = Peer(root, "a", strategy_options(root, max_stale_epochs, net.host_maddrs(0)), model=model, data=data,
                     recorder=recorder, command_prefix=net.command(0, []))
            peers.append(a)
            b = Peer(root, "b", strategy_options(root, max_stale_epochs, net.host_maddrs(1)), model=model, data=data,
                     recorder=recorder, command_prefix=net.command(1, []), join_later=True)
            peers.append(b)
            join = a.join_peers(timeout=180)
            wait_until(lambda: a.max_epoch() >= donor_epochs, 180, peers, f"A to reach epoch {donor_epochs}")
            a_epoch_at_join = a.max_epoch()
            b.join(join)
            start = time.monotonic()
            first_round = None
            while time.monotonic() - start < window:
                count = b.log().count(AVERAGED_WITH_TWO)
                if count and first_round is None:
                    first_round = time.monotonic() - start
                if count >= rounds:
                    break
                for peer in peers:
                    peer.check_alive()
                time.sleep(0.5)
            elapsed = time.monotonic() - start
            log_b = b.log()
            downloads = DOWNLOADED.findall(log_b)
            return dict(
                downloads=len(downloads),
                download_mb=float(downloads[0][0]) if downloads else None,
                download_s=float(downloads[0][1]) if downloads else None,
                caught_up=[tuple(map(int, match)) for match in CAUGHT_UP.findall(log_b)],
                rounds_b=log_b.count(AVERAGED_WITH_TWO),
                peers_a=max((event.get("peers", 0) for event in a.events()), default=0),
                peers_b=max((event.get("peers", 0) for event in b.events()), default=0),
                first_round_s=first_round,
                first_round_after_download_s=_seconds_between(log_b, "Downloaded state from", AVERAGED_WITH_TWO),
                a_epochs=a.max_epoch() - a_epoch_at_join,
                elapsed=elapsed,
                log_b=log_b,
            )
        finally:
            for peer in peers:
                peer.kill()
