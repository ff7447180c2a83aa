import os
import sys

import pytest
import torch

# The models in tests are tiny: one thread avoids OpenMP barrier stalls when other processes (peers,
# other tests) share the machine's cores. TEST_TORCH_THREADS overrides it.
torch.set_num_threads(int(os.environ.get("TEST_TORCH_THREADS", "1")))

# A test that is not marked slow and names no timeout of its own fails after this many seconds instead of pyproject's
# 420 (the slow tests' default): the fast tests take seconds, and one that hangs costs the suite 3 minutes, not 7.
FAST_TEST_TIMEOUT = 180


def pytest_collection_modifyitems(items):
    for item in items:
        if item.get_closest_marker("slow") is None and item.get_closest_marker("timeout") is None:
            item.add_marker(pytest.mark.timeout(FAST_TEST_TIMEOUT))


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


@pytest.fixture(autouse=True)
def _hivemind_result_locks_free():
    """hivemind's MPFuture sends results under multiprocessing locks shared by every process forked from this one: a
    hivemind child of a test killed while holding one leaves it held, and every later test that starts a DHT or an
    averager in this process hangs until its timeout (CI, docs/notes/ci-failures.md). The test that left them held
    fails here, by name, and the locks are replaced for the tests after it."""
    yield
    if "hivemind.utils.mpfuture" not in sys.modules:  # no test of this session used hivemind yet
        return
    from lightning_swarm.hivemind_ext.lifetime import replace_result_locks, result_locks

    held = []
    for name, lock in result_locks().items():
        if lock.acquire(timeout=5):
            lock.release()
        else:
            held.append(name)
    if held:
        replace_result_locks()
        pytest.fail(f"this test left hivemind's {held} held (a child killed while holding it): later tests that start "
                    "hivemind processes would hang")


@pytest.fixture(autouse=True, scope="session")
def _no_exclusion_files_left():
    """Each peer keeps the peers it keeps out of its groups in a file named for its peer id under the temporary folder
    (``ReportMailbox.exclude_peer``: its averagers share it, and a later run under the same identity keeps them out
    too). Test peers have fresh identities: the files they wrote are removed after the session (467 were left behind
    by a few runs of the suite)."""
    import tempfile

    folder = os.path.join(tempfile.gettempdir(), "lightning_swarm_exclusions")
    before = set(os.listdir(folder)) if os.path.isdir(folder) else set()
    yield
    if os.path.isdir(folder):
        for name in set(os.listdir(folder)) - before:
            try:
                os.remove(os.path.join(folder, name))
            except OSError:
                pass
