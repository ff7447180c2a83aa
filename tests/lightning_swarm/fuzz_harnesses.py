"""The suite's four fuzz harnesses in one child process: one interpreter start and one import of torch, Lightning and
hivemind instead of four. The tests that check their outcomes (test_decoder_fuzz.py, test_auth_fuzz.py,
test_checkpoint_trust.py, test_monitor_records.py) share the child through the ``fuzz_harness_output`` fixture of
conftest.py, which runs the harnesses whose tests were collected.

    python tests/lightning_swarm/fuzz_harnesses.py [HARNESS...]   # default: all, in the order of HARNESSES

For each harness the child prints ``BEGIN <name>``, whatever the harness prints, and ``END <name> <status>`` (0: it
returned 0 or None; 1: it raised, the traceback printed before END, or returned another status). A signal death (a
native crash) ends the child: the harness with a BEGIN and no END line is the one that was running.
:func:`run_harnesses` starts the child and splits its output by harness.
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import traceback
from pathlib import Path
from typing import Dict, List, Tuple

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
BENCHMARKS = REPO / "tests" / "benchmarks"

# name: (module, argv) with the fixed seeds and counts the tests assert on
DECODER_SEED, DECODER_MESSAGES = 24, 1000  # per target of decoder_fuzz.py
AUTH_CASES = 1000  # per parser of tests/benchmarks/fuzz_auth.py
CHECKPOINT_META_CASES = 600
METRIC_RECORDS = 3000
HARNESSES: Dict[str, Tuple[str, List[str]]] = {
    "decoders": ("decoder_fuzz", ["--seed", str(DECODER_SEED), "--count", str(DECODER_MESSAGES)]),
    "checkpoint_meta": ("fuzz_checkpoint_meta", ["--seed", "0", "--count", str(CHECKPOINT_META_CASES)]),
    "metric_records": ("fuzz_metric_records", ["--seed", "0", "--count", str(METRIC_RECORDS)]),
    # last: it disables logging below ERROR (undone after it, but nothing runs after it anyway)
    "auth": ("fuzz_auth", ["--cases", str(AUTH_CASES), "--seed", "0"]),
}


def _run_one(name: str) -> int:
    import importlib

    module_name, argv = HARNESSES[name]
    saved_argv = sys.argv
    sys.argv = [f"{module_name}.py", *argv]  # fuzz_auth's main parses sys.argv itself
    try:
        module = importlib.import_module(module_name)
        status = module.main(argv) if module_name != "fuzz_auth" else module.main()
        return 0 if status in (None, 0) else 1
    except BaseException:  # noqa: BLE001 (a harness's failure, reported under its name; the others still run)
        traceback.print_exc(file=sys.stdout)
        return 1
    finally:
        sys.argv = saved_argv
        logging.disable(logging.NOTSET)
        sys.stdout.flush()


def main(names: List[str]) -> int:
    sys.path[:0] = [str(HERE), str(BENCHMARKS), str(REPO)]
    worst = 0
    for name in names or list(HARNESSES):
        print(f"BEGIN {name}", flush=True)
        status = _run_one(name)
        print(f"END {name} {status}", flush=True)
        worst = max(worst, status)
    return worst


def run_harnesses(names: List[str], timeout: float) -> Tuple[Dict[str, Tuple[int, str]], int, str]:
    """Run the harnesses ``names`` in one child process. Returns ({name: (status, its stdout)} for each harness that
    ended, the child's return code (negative: a signal death), its stderr's tail; a harness missing from the dict was
    running when the child died (named in the tail)."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]))
    process = subprocess.run([sys.executable, str(Path(__file__)), *names], capture_output=True, text=True,
                             timeout=timeout, env=env)
    ended: Dict[str, Tuple[int, str]] = {}
    current, lines = None, []
    for line in process.stdout.splitlines():
        if line.startswith("BEGIN "):
            current, lines = line.split()[1], []
        elif line.startswith("END ") and current is not None:
            ended[current] = (int(line.split()[2]), "\n".join(lines))
            current = None
        else:
            lines.append(line)
    tail = process.stderr[-3000:]
    if current is not None:
        tail += f"\n(the child was running {current}; its output:)\n" + "\n".join(lines)[-3000:]
    return ended, process.returncode, tail


def harness_output(shared: Tuple[Dict[str, Tuple[int, str]], int, str], name: str) -> str:
    """What harness ``name`` printed in the shared child (``shared``: :func:`run_harnesses`'s result); fails the
    calling test if the child died while it ran or it failed."""
    ended, returncode, tail = shared
    assert name in ended, f"the fuzzing child died in or before {name} (return code {returncode}, <0 is a signal)\n{tail}"
    status, output = ended[name]
    assert status == 0, f"the {name} harness failed:\n{output[-3000:]}"
    return output


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
