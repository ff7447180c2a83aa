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


# With pytest-xdist (`-n 2 --dist loadgroup`, README and .ci/run) the multi-peer tests run one after the other on one
# worker, as without it: each starts several processes and some bound round times, so two at once on 2 cores would
# measure each other's load. The fast tests run on the other worker beside them. The slow tests that start no swarm
# (a recipe's commands, the notebook, pip queries) go first, beside the fast tests, so the swarms start once that
# worker is free (docs/test-suite.md).
MULTI_PEER_GROUP = "multi_peer"
SLOW_WITHOUT_A_SWARM = ("tests/recipes/", "tests/test_join_notebook.py", "tests/lightning_swarm/test_platforms.py")


def pytest_itemcollected(item):
    # marked as each item is collected, before any pytest_collection_modifyitems: pytest-xdist reads the marks in its
    # own, whose order beside this conftest's is pluggy's to choose
    if item.get_closest_marker("slow") is not None:
        item.add_marker(pytest.mark.xdist_group(MULTI_PEER_GROUP))


def pytest_collection_modifyitems(items):
    for item in items:
        if item.get_closest_marker("slow") is None and item.get_closest_marker("timeout") is None:
            item.add_marker(pytest.mark.timeout(FAST_TEST_TIMEOUT))
    # stable: within each class the collection order stays
    items.sort(key=lambda item: item.get_closest_marker("slow") is not None
               and not item.nodeid.startswith(SLOW_WITHOUT_A_SWARM))


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


def _exclusions_folder():
    import tempfile

    return os.path.join(tempfile.gettempdir(), "lightning_swarm_exclusions")


def _exclusion_files():
    folder = _exclusions_folder()
    return set(os.listdir(folder)) if os.path.isdir(folder) else set()


_EXCLUSION_FILES_BEFORE = pytest.StashKey[set]()


def pytest_sessionstart(session):
    session.config.stash[_EXCLUSION_FILES_BEFORE] = _exclusion_files()


def pytest_sessionfinish(session):
    """Each peer keeps the peers it keeps out of its groups in a file named for its peer id under the temporary folder
    (``ReportMailbox.exclude_peer``: its averagers share it, and a later run under the same identity keeps them out
    too). Test peers have fresh identities: the files they wrote are removed after the session (467 were left behind
    by a few runs of the suite). Under pytest-xdist only the controller removes them, once every worker is done: a
    worker that finished early would delete the files of peers still running on the other."""
    if hasattr(session.config, "workerinput"):  # a pytest-xdist worker
        return
    for name in _exclusion_files() - session.config.stash.get(_EXCLUSION_FILES_BEFORE, set()):
        try:
            os.remove(os.path.join(_exclusions_folder(), name))
        except OSError:
            pass
