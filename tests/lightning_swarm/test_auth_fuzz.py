"""The authority's request parser, the client's answer parser, the join-proof check and the proof of a state-download
request, fuzzed in a child process
(tests/benchmarks/fuzz_auth.py, fixed seed, bounded): no crash, no exception but the documented refusal, fixed
messages only."""

import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "fuzz_auth.py"


@pytest.mark.timeout(240)
def test_auth_parsers_survive_mutated_inputs():
    result = subprocess.run([sys.executable, str(SCRIPT), "--cases", "1000", "--seed", "0"], capture_output=True,
                            text=True, timeout=200)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]  # a signal death is negative
    assert "FUZZ OK requests=1000 answers=1000 proofs=1000 downloads=1000" in result.stdout
