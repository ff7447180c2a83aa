"""The README's test command (`-n 2 --dist loadgroup`) runs the multi-peer tests one at a time on one worker, beside
the fast tests on the other (tests/conftest.py): two swarms at once on 2 cores would measure each other's load. A
child pytest over three files of multi-peer tests and one fast file, each test skipped at setup, records which
worker got which test. With pytest-xdist's grouping broken (pytest 9.2 with pytest-xdist 3.8: pyproject's pin) the
26 slow tests landed on both workers."""

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
FILES = ["tests/lightning_swarm/test_lying_reducer.py", "tests/lightning_swarm/test_strategy_swarm.py",
         "tests/lightning_swarm/test_byzantine_swarm.py", "tests/lightning_swarm/test_alignment_screen.py"]

RECORDER = '''
import json, os, pytest

@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item):
    with open(os.environ["LANES_OUT"], "a") as out:
        out.write(json.dumps([os.environ.get("PYTEST_XDIST_WORKER"), item.get_closest_marker("slow") is not None,
                              item.nodeid]) + "\\n")
    pytest.skip("only the worker is recorded")
'''


def test_multi_peer_tests_share_one_worker(tmp_path):
    (tmp_path / "lanes_recorder.py").write_text(RECORDER)
    out = tmp_path / "lanes.jsonl"
    env = dict(os.environ, LANES_OUT=str(out),
               PYTHONPATH=os.pathsep.join([str(tmp_path), str(REPO), os.environ.get("PYTHONPATH", "")]))
    result = subprocess.run([sys.executable, "-m", "pytest", "-m", "slow or not slow", "-n", "2", "--dist", "loadgroup",
                             "-p", "lanes_recorder", "-p", "no:cacheprovider", "-q", *FILES],
                            cwd=REPO, env=env, capture_output=True, text=True, timeout=150)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    slow_workers = {worker for worker, slow, _ in rows if slow}
    assert sum(slow for _, slow, _ in rows) >= 20
    assert len(slow_workers) == 1, f"the multi-peer tests ran on {sorted(slow_workers)}: not one at a time"
