"""The fuzzers of decoder_fuzz.py (every codec, the reducer's part handling, the state download's assembly, the
progress records), a fixed-seed bounded run in one child process: no signal death, no tensor (or record) accepted
for a malformed message, no other exception than the checks' refusals, bounded time per message.
``tests/benchmarks/fuzz_decoders.py`` runs more, with another seed."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from decoder_fuzz import TARGETS, run_fuzzers  # noqa: E402

MESSAGES = 1000  # per target; the child takes ~8 s of CPU (imports included)
SEED = 24


@pytest.fixture(scope="module")
def fuzzed():
    return run_fuzzers(TARGETS, seed=SEED, count=MESSAGES, timeout=300)


@pytest.mark.timeout(320)
@pytest.mark.parametrize("target", TARGETS)
def test_fuzzed_messages_are_refused_or_decoded_as_announced(fuzzed, target):
    outcomes, returncode, stderr = fuzzed
    assert returncode == 0, f"the fuzzing child died (return code {returncode}, <0 is a signal)\n{stderr}"
    outcome = outcomes[target]
    assert outcome["messages"] == MESSAGES
    assert outcome["violations"] == [] and outcome["other_errors"] == 0, outcome
    assert outcome["refused"] > MESSAGES / 4 and outcome["decoded"] > 0, outcome  # the mutations reach both ways
    assert outcome["slowest_seconds"] < 5.0, outcome
