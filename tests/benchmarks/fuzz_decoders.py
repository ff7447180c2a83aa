"""Fuzz every decoder of received bytes on the averaging path and print the counts (issue 24).

    PYTHONPATH=$PWD python tests/benchmarks/fuzz_decoders.py --seed 1 --count 20000 [TARGET ...]

Runs tests/lightning_swarm/decoder_fuzz.py in a child process (a signal death is reported, not suffered) and prints,
per target: messages, refused, decoded as announced, other errors (exceptions that are not the checks' refusals),
oracle violations (a malformed message accepted, a well-formed one refused, a result of another shape/dtype), the
slowest message. Exit status 1 if the child died or any violation or other error was seen.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "lightning_swarm"))
from decoder_fuzz import TARGETS, run_fuzzers  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("targets", nargs="*", default=list(TARGETS), help=f"of {', '.join(TARGETS)} (default: all)")
    parser.add_argument("--seed", type=int, default=0, help="random seed of the mutations")
    parser.add_argument("--count", type=int, default=5000, help="messages per target")
    parser.add_argument("--timeout", type=float, default=3600, help="seconds for the whole child process")
    args = parser.parse_args()
    outcomes, returncode, stderr = run_fuzzers(args.targets, args.seed, args.count, args.timeout)
    print(f"seed {args.seed}, {args.count} messages per target")
    print(f"{'target':<18}{'messages':>9}{'refused':>9}{'decoded':>9}{'other':>7}{'violations':>11}{'slowest s':>10}")
    bad = returncode != 0
    for target in args.targets:
        o = outcomes.get(target)
        if o is None:
            print(f"{target:<18} did not finish (child return code {returncode})")
            continue
        print(f"{target:<18}{o['messages']:>9}{o['refused']:>9}{o['decoded']:>9}{o['other_errors']:>7}"
              f"{len(o['violations']):>11}{o['slowest_seconds']:>10.3f}")
        for violation in o["violations"]:
            print(f"    {violation}")
        bad = bad or bool(o["violations"]) or o["other_errors"] > 0
    if returncode != 0:
        print(f"the child died with return code {returncode} (negative: killed by that signal)\n{stderr}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
