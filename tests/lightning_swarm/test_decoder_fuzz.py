"""The fuzzers of decoder_fuzz.py (every codec, the reducer's part handling, the state download's assembly, the
progress records, the reducer's reports), a fixed-seed bounded run in a child process (the suite's fuzz harnesses
share one: fuzz_harnesses.py): no signal death, no tensor (or record) accepted for a malformed message, no other
exception than the checks' refusals, bounded time per message. ``tests/benchmarks/fuzz_decoders.py`` runs more,
with another seed."""

from __future__ import annotations

import json

import pytest

from decoder_fuzz import TARGETS
from fuzz_harnesses import DECODER_MESSAGES as MESSAGES, harness_output


@pytest.fixture(scope="module")
def fuzzed(fuzz_harness_output):
    """{target: its outcome} (decoder_fuzz.py prints one JSON line per target)."""
    output = harness_output(fuzz_harness_output, "decoders")
    outcomes = [json.loads(line) for line in output.splitlines() if line.startswith("{")]
    return {outcome["target"]: outcome for outcome in outcomes}


@pytest.mark.timeout(320)
@pytest.mark.parametrize("target", TARGETS)
def test_fuzzed_messages_are_refused_or_decoded_as_announced(fuzzed, target):
    outcome = fuzzed[target]
    assert outcome["messages"] == MESSAGES
    assert outcome["violations"] == [] and outcome["other_errors"] == 0, outcome
    assert outcome["refused"] > MESSAGES / 4 and outcome["decoded"] > 0, outcome  # the mutations reach both ways
    assert outcome["slowest_seconds"] < 5.0, outcome
