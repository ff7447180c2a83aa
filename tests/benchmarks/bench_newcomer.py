"""Newcomers and leavers over shaped links (issue 25 item 6): prints what a newcomer does when the swarm steps faster
than it downloads, with hivemind's rule (max_stale_epochs=0) and with the default, and what a peer SIGKILLed mid-round
costs its group. Needs root (network namespaces, tc tbf).

Run: PYTHONPATH=$PWD python tests/benchmarks/bench_newcomer.py [--window 90] [--skip-leaver]
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from paths import REPO  # noqa: E402

sys.path.insert(0, str(REPO / "tests" / "lightning_swarm"))
from leaver_scenario import NEXT_CHUNK_TIMEOUT, run_leaver_scenario, summarize  # noqa: E402
from netns_harness import network_harness_available  # noqa: E402
from newcomer_scenario import run_newcomer_scenario  # noqa: E402

from lightning_swarm.hivemind_ext.catch_up import DEFAULT_MAX_STALE_EPOCHS  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--window", type=float, default=90.0, help="seconds B is watched after it joins")
    parser.add_argument("--skip-leaver", action="store_true")
    args = parser.parse_args()
    reason = network_harness_available()
    if reason:
        sys.exit(f"cannot build network namespaces: {reason}")
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=REPO).stdout
    print(f"commit {commit.strip()}, load average {os.getloadavg()[0]:.1f} at start")
    print("newcomer B (10 Mbit/s link, 8 MB state) joins A (global step ~1 s) after A's epoch 3; "
          f"watched up to {args.window:.0f} s or 3 rounds with A")
    print(f"{'max_stale_epochs':>17} {'downloads':>9} {'download s':>10} {'behind':>6} {'rounds with A':>13} "
          f"{'1st round after download s':>26} {'watched s':>9}")
    for max_stale in (0, DEFAULT_MAX_STALE_EPOCHS):
        with tempfile.TemporaryDirectory() as root:
            r = run_newcomer_scenario(Path(root), max_stale, rounds=3, window=args.window)
        behind = r["caught_up"][0][2] if r["caught_up"] else "-"
        after = r["first_round_after_download_s"]
        print(f"{max_stale:>17} {r['downloads']:>9} {r['download_s'] or 0:>10.1f} {behind:>6} {r['rounds_b']:>13} "
              f"{'-' if after is None else f'{after:.1f}':>26} {r['elapsed']:>9.0f}")
    if args.skip_leaver:
        return
    with tempfile.TemporaryDirectory() as root:
        result = run_leaver_scenario(Path(root))
    print(f"leaver: 3 peers on 10 Mbit/s links, one SIGKILLed (process group) {result['kill_after_s']:.1f} s into its "
          f"gradient round; next_chunk_timeout {NEXT_CHUNK_TIMEOUT:.0f} s")
    print(f"{'survivor':>8} {'normal round s (median/max)':>27} {'round with the kill s':>21} outcome; next rounds")
    for name, s in summarize(result).items():
        print(f"{name:>8} {s['normal_median_s'] or 0:>13.1f} / {s['normal_max_s'] or 0:<11.1f} "
              f"{s['killed_round_s'] or 0:>21.1f} {s['killed_round_outcome']}; "
              f"{', '.join(str(outcome) for _, outcome in s['after'] if outcome)}")
    print(f"load average {os.getloadavg()[0]:.1f} at end")


if __name__ == "__main__":
    main()
