"""Repeated 3-peer Byzantine swarms (tests/lightning_swarm/byzantine.py, the swarm of test_byzantine_swarm.py: least
squares to its noise floor, README open-swarm settings), figures printed, nothing asserted: how far the clean swarm's
loss moves from run to run, and each attack's, to size the test's bounds.

For each entry of the sequence (``none``: honest third peer; or an attack of byzantine.ATTACKS), one swarm: the two
honest peers' validation losses after STOP_AT_EPOCH global epochs, the run's wall time and each peer's training time,
and how many lines of the honest peers' logs name a lone sender refused, a loud sender of 2, a lowered alignment, a
partial round, a failed gradient round, a NaN part or a lowered weight. Interleave clean and attacked runs, so that
the machine's load falls on both alike.

Run: BENCH_SEQUENCE=none,ascent,scale,nan,weight,none python tests/benchmarks/bench_byzantine_swarm.py
     BENCH_MIN_ALIGNMENT=off (no alignment screen), BENCH_VERBOSE=1 (hivemind logs each round), BENCH_LOG_DIR=dir
     (every peer's log of run k goes to dir/k_<attack>/).
The machine is shared (2 cores, 3 peers a run): say what else ran when quoting the figures.
"""

from __future__ import annotations

import json
import os
import re
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1].parent
sys.path[:0] = [str(REPO / "tests" / "lightning_swarm"), str(REPO)]
os.environ["PYTHONPATH"] = os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])

from byzantine import noise_floor, run_swarm, validation_loss  # noqa: E402

LOG_LINES = {"lone": "the only sender of a part", "loud": "more than 10 times as long",
             "lowered": "goes along less than", "partial": r"received [\d.]+% results",
             "grad failed": "Averaging gradients failed", "local": "local gradients", "nan": "NaN or Inf",
             "weight": "lowered to"}


def main() -> None:
    sequence = os.environ.get("BENCH_SEQUENCE", "none,ascent,scale,nan,weight,none").split(",")
    screen = os.environ.get("BENCH_MIN_ALIGNMENT", "0.5")
    min_alignment = None if screen == "off" else float(screen)
    overrides = {"verbose": True} if os.environ.get("BENCH_VERBOSE") else {}
    log_dir = os.environ.get("BENCH_LOG_DIR")
    floor = noise_floor()
    print(f"initial loss {validation_loss():.4f}, noise floor {floor:.4f}, screen {min_alignment}", flush=True)
    for k, attack in enumerate(sequence):
        start = time.time()
        with tempfile.TemporaryDirectory() as root:
            try:
                params, logs = run_swarm(Path(root), None if attack == "none" else attack, min_alignment=min_alignment,
                                         log_dir=Path(log_dir) / f"{k}_{attack}" if log_dir else None, **overrides)
            except Exception as e:  # a run the machine's load stopped (or an attack that stopped the peers) is a result
                print(f"{attack}: failed: {type(e).__name__}: {str(e)[-300:]}", flush=True)
                continue
            losses = [validation_loss(p) for p in params]
            training = []
            for name in ("first", "second", "third"):
                path = Path(root) / name / "events.jsonl"
                events = [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []
                training += [round(event["elapsed"]) for event in events if event["kind"] == "end"]
            counts = {key: sum(len(re.findall(pattern, log)) for log in logs) for key, pattern in LOG_LINES.items()}
            print(f"{attack}: {losses[0]:.4f} {losses[1]:.4f} (x{max(losses) / floor:.3f} the floor; "
                  f"{time.time() - start:.0f} s, training {training} s) "
                  f"{ {key: count for key, count in counts.items() if count} }", flush=True)


if __name__ == "__main__":
    main()
