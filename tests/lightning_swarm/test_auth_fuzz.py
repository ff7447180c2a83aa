"""The authority's request parser, the client's answer parser, the join-proof check and the proof of a state-download
request, fuzzed in a child process (tests/benchmarks/fuzz_auth.py, fixed seed, bounded; the suite's fuzz harnesses
share one child: fuzz_harnesses.py): no crash, no exception but the documented refusal, fixed messages only."""

import pytest

from fuzz_harnesses import AUTH_CASES as CASES, harness_output


@pytest.mark.timeout(320)
def test_auth_parsers_survive_mutated_inputs(fuzz_harness_output):
    output = harness_output(fuzz_harness_output, "auth")  # fails on a signal death or an exception in the harness
    assert f"FUZZ OK requests={CASES} answers={CASES} proofs={CASES} downloads={CASES}" in output, output[-3000:]
