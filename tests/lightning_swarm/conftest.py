import pytest

from fuzz_harnesses import HARNESSES, run_harnesses

# the test that checks each fuzz harness's outcome (fuzz_harnesses.py): the shared child runs the collected ones
FUZZ_TESTS = {
    "decoders": "test_decoder_fuzz.py::",
    "checkpoint_meta": "test_checkpoint_trust.py::test_fuzzed_checkpoint_meta_never_runs_code_or_crashes",
    "metric_records": "test_monitor_records.py::test_fuzzed_metric_records_never_crash_the_decoder",
    "auth": "test_auth_fuzz.py::test_auth_parsers_survive_mutated_inputs",
}
FUZZ_TIMEOUT = 280  # seconds for the child (~25 s of CPU); the tests' pytest timeouts are above it


def pytest_itemcollected(item):
    # under pytest-xdist the fuzz tests share one worker, so one child runs the harnesses (a session fixture runs in
    # every worker that asks for it); marked as collected, before pytest-xdist reads the marks (tests/conftest.py)
    if any(test in item.nodeid for test in FUZZ_TESTS.values()):
        item.add_marker(pytest.mark.xdist_group("fuzz_harnesses"))


@pytest.fixture
def peers():
    """Processes a test starts (anything with ``kill()``); all of them are killed when the test ends."""
    started = []
    yield started
    for peer in started:
        peer.kill()


@pytest.fixture(scope="session")
def fuzz_harness_output(request):
    """The fuzz harnesses whose tests this session collected, run in one child process (fuzz_harnesses.py) when the
    first of those tests starts: ({harness: (status, stdout)}, the child's return code, its stderr's tail)."""
    collected = [item.nodeid for item in request.session.items]
    names = [name for name, test in FUZZ_TESTS.items() if any(test in nodeid for nodeid in collected)]
    assert set(FUZZ_TESTS) == set(HARNESSES)
    return run_harnesses(names or list(HARNESSES), timeout=FUZZ_TIMEOUT)

