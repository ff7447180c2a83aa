"""A peer dies mid-round: three peers train over shaped links (netns_harness), and one of them loses its whole process
group to SIGKILL (a machine that dies) while its gradient round is under way. What did that round cost the others?

Used by tests/lightning_swarm/test_leaver.py and tests/benchmarks/bench_newcomer.py.
"""

from __future__ import annotations

import os
import re
import signal
import statistics
import time
from pathlib import Path
from typing import Any, Dict, List, Optional

from netns_harness import shaped_network
from swarm_harness import Peer, wait_until

NEXT_CHUNK_TIMEOUT = 5.0
MATCHMAKING_TIME = 2.0
AVERAGING_TIMEOUT = 30.0
HIDDEN = 100_000  # a 4 MB gradient, uncompressed: a round of ~3 s over 10 Mbit/s links (a victim dies mid-round)
LOG_LINE = re.compile(r"^\w{3} +\d+ (\d\d):(\d\d):(\d\d\.\d+) \[\w+\] (.*)$", re.MULTILINE)
BEGIN = re.compile(r"Beginning optimizer step #(\d+)")
TRANSITION = re.compile(r"Transitioning to epoch (\d+)")


def _timed_lines(log: str) -> List[tuple]:
    return [(int(h) * 3600 + int(m) * 60 + float(s), text) for h, m, s, text in LOG_LINE.findall(log)]


def _in_round(log: str) -> bool:
    begins, transitions = list(BEGIN.finditer(log)), list(TRANSITION.finditer(log))
    return bool(begins) and (not transitions or begins[-1].start() > transitions[-1].start())


def rounds(log: str) -> Dict[int, Dict[str, Any]]:
    """{epoch: {"seconds": from "Beginning optimizer step #epoch" to "Transitioning to epoch epoch+1",
    "outcome": the gradient round's log line (e.g. "Averaged gradients with 3 peers"), "start": its time}}."""
    found, current = {}, None
    for when, text in _timed_lines(log):
        begin = BEGIN.search(text)
        if begin:
            current = int(begin.group(1))
            found[current] = {"start": when, "outcome": None, "seconds": None}
        elif current is not None and ("Averaged gradients with" in text or "Averaging gradients failed" in text
                                      or "Proceeding with local gradients" in text or "Skipped averaging" in text):
            found[current]["outcome"] = found[current]["outcome"] or text.strip()
        elif current is not None and TRANSITION.search(text) and int(TRANSITION.search(text).group(1)) > current:
            found[current]["seconds"] = (when - found[current]["start"]) % 86400
            current = None
    return found


def run_leaver_scenario(root: Path, rounds_before: int = 3, rounds_after: int = 3) -> Dict[str, Any]:
    """Three peers (a, b, victim) train until each made ``rounds_before`` gradient rounds with 3 peers; the victim's
    process group is SIGKILLed 1 s after all three began a gradient round; returns once both survivors finished the
    round under way and ``rounds_after`` more (or after 240 s). Returns the survivors' rounds (see :func:`rounds`), the epoch of the victim's last round
    (``killed_in``) and how far into it the kill came (``kill_after_s``)."""
    peers: List[Peer] = []
    strategy = dict(run_id="leaver", target_batch_size=48, matchmaking_time=MATCHMAKING_TIME,
                    averaging_timeout=AVERAGING_TIMEOUT, next_chunk_timeout=NEXT_CHUNK_TIMEOUT, compression="none",
                    load_state_timeout=20.0, verbose=True)
    model = {"hidden": HIDDEN, "step_delay": 0.2, "lr": 1e-6, "lr_decay": 1.0}
    recorder = {"stop_at_epoch": 100_000, "max_seconds": 600, "record_params": False}
    with shaped_network(["poor", "poor", "poor"]) as net:
        try:
            # all three processes start at once (b and the victim import while a starts), then join one by one
            for index, name in enumerate(["a", "b", "victim"]):
                peers.append(Peer(root, name, dict(strategy, host_maddrs=net.host_maddrs(index)), model=model,
                                  data={"batch_size": 4}, recorder=recorder, command_prefix=net.command(index, []),
                                  join_later=index > 0))
            a, b, victim = peers
            joins: List[str] = a.join_peers(timeout=240)
            for peer in (b, victim):
                peer.join(joins)
                joins = joins + peer.join_peers(timeout=240)

            def with_three(peer: Peer) -> int:
                return peer.log().count("Averaged gradients with 3 peers")

            wait_until(lambda: all(with_three(peer) >= rounds_before for peer in peers), 300, peers,
                       f"{rounds_before} rounds of 3 peers")
            # peers' epochs may differ by one, and their rounds by a few seconds: wait until all three are in a round
            # (a "Beginning optimizer step" after their last transition), so that the death hits the survivors' too
            wait_until(lambda: all(_in_round(peer.log()) for peer in peers), 120, peers, "all three in a round")
            began = time.monotonic()
            killed_in = int(BEGIN.findall(victim.log())[-1])
            time.sleep(1.0)
            os.killpg(victim.process.pid, signal.SIGKILL)  # the machine dies: every process of the peer at once
            kill_after = time.monotonic() - began
            local = time.localtime()  # hivemind's log lines carry the local time of day
            killed_at = local.tm_hour * 3600 + local.tm_min * 60 + local.tm_sec + time.time() % 1
            victim.kill()

            def finished_after_kill(peer: Peer) -> int:  # the round the death hit, and those after it
                return sum(1 for r in rounds(peer.log()).values()
                           if r["seconds"] is not None and r["start"] + r["seconds"] >= killed_at)

            wait_until(lambda: all(finished_after_kill(p) > rounds_after for p in (a, b)), 240, [a, b],
                       f"{rounds_after} global steps of the survivors after the kill")
            return dict(killed_in=killed_in, kill_after_s=kill_after, killed_at=killed_at,
                        survivors={p.name: rounds(p.log()) for p in (a, b)}, next_chunk_timeout=NEXT_CHUNK_TIMEOUT)
        finally:
            for peer in peers:
                peer.kill()


def summarize(result: Dict[str, Any]) -> Dict[str, Any]:
    """Per survivor: the median seconds of its rounds before the kill, the seconds and outcome of the first round
    that ended after the victim died (``killed_mid_round``: whether it was under way at the kill), and the epochs it
    advanced through afterwards."""
    summary = {}
    killed_at = result["killed_at"]
    for name, found in result["survivors"].items():
        # the survivor's first round that ended after the victim died (peers' epochs may differ by one: align by
        # time). Usually the round under way at the kill; when the victim was late for that round's matchmaking
        # (a loaded machine), the survivors may have averaged without it and the death hits their next round,
        # whose group the dead peer's DHT records still invite it to.
        hit_epoch = next((epoch for epoch, r in sorted(found.items()) if r["seconds"] is not None
                          and r["start"] + r["seconds"] >= killed_at), None)
        hit = found.get(hit_epoch) or {}
        before = [r["seconds"] for epoch, r in found.items() if hit_epoch is not None and epoch < hit_epoch
                  and r["seconds"] is not None and r["outcome"] and "with 3 peers" in r["outcome"]]
        summary[name] = dict(normal_median_s=statistics.median(before) if before else None,
                             normal_max_s=max(before) if before else None, killed_round_epoch=hit_epoch,
                             killed_round_s=hit.get("seconds"), killed_round_outcome=hit.get("outcome"),
                             killed_mid_round=bool(hit) and hit["start"] <= killed_at,
                             after=[(epoch, r["outcome"]) for epoch, r in sorted(found.items())
                                    if hit_epoch is not None and epoch > hit_epoch])
    return summary
