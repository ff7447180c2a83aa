"""DALL-E recipe peers (`python -m recipes.dalle fit --config configs/dalle_tiny.yaml --config <overlay>`), each inside
a network namespace of netns_harness.py, for the tests and the benchmarks: an overlay config with what they share,
the process, its log and the events its peer_worker.SwarmRecorder wrote."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Optional

import yaml

REPO = Path(__file__).resolve().parents[2]
JOIN_OPTION = re.compile(r"--trainer\.strategy\.init_args\.initial_peers='(\[.*?\])'")


def write_overlay(out_dir: Path, strategy: dict, recorder: dict, data: dict, model: Optional[dict] = None,
                  trainer: Optional[dict] = None) -> Path:
    """Write `out_dir`/overlay.yaml, a second --config for configs/dalle_tiny.yaml: fp32 (32-true), no validation,
    checkpoints, logger or progress bar, and a peer_worker.SwarmRecorder writing into `out_dir`.

    strategy: HivemindStrategy init_args that replace the recipe's (host_maddrs, initial_peers...).
    recorder: SwarmRecorder init_args other than out_dir.
    data: DALLEDataModule init_args that replace the recipe's.
    model: DALLEModule init_args that replace the recipe's (None: its model as configured).
    trainer: further Trainer settings (e.g. max_steps)."""
    overlay = {
        "trainer": {
            "precision": "32-true", "num_sanity_val_steps": 0, "limit_val_batches": 0,
            "enable_progress_bar": False, "enable_checkpointing": False, "logger": False,
            "default_root_dir": str(out_dir),
            "strategy": {"init_args": strategy},
            # replaces the recipe's callbacks (its SwarmCheckpoint)
            "callbacks": [{"class_path": "peer_worker.SwarmRecorder",
                           "init_args": {"out_dir": str(out_dir), **recorder}}],
            **(trainer or {}),
        },
        "data": {"init_args": data},
    }
    if model:
        overlay["model"] = {"init_args": model}
    path = out_dir / "overlay.yaml"
    path.write_text(yaml.safe_dump(overlay))
    return path


class RecipePeer:
    """`python -m recipes.dalle fit` inside peer `index`'s namespace of `net` (1 torch thread), its log and recorded
    events in `out_dir`; `overlay`: the second --config (write_overlay).

    join_later: start the process now through tests/join_later.py, which imports while it waits for this file (the
        peers to join, written by ``join_later.write_initial_peers``) and then runs the same command line with
        ``--trainer.strategy.init_args.initial_peers``: its imports overlap the start of the peer it joins."""

    def __init__(self, net, index: int, out_dir: Path, overlay: Path, join_later: Optional[Path] = None):
        self.out_dir = out_dir
        self.log_path = out_dir / "log.txt"
        env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(Path(__file__).parent), str(REPO)]),
                   PEER_TORCH_THREADS="1", OMP_NUM_THREADS="1")
        env.pop("LIGHTNING_SWARM_INITIAL_PEERS", None)
        self._log = open(self.log_path, "w")
        waiting = [str(REPO / "tests" / "join_later.py"), str(join_later)] if join_later else []
        argv = [sys.executable, *waiting, "-m", "recipes.dalle", "fit", "--config",
                str(REPO / "configs/dalle_tiny.yaml"), "--config", str(overlay)]
        self.process = subprocess.Popen(net.command(index, argv), stdout=self._log, stderr=subprocess.STDOUT,
                                        env=env, cwd=REPO, start_new_session=True)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def events(self) -> list:
        path = self.out_dir / "events.jsonl"
        return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []

    def join_peers(self, timeout: float) -> list:
        """The initial_peers the peer printed for others to join (waits until it is printed)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            match = JOIN_OPTION.search(self.log())
            if match:
                return json.loads(match.group(1))
            assert self.process.poll() is None, self.log()[-4000:]
            time.sleep(0.5)
        raise TimeoutError(self.log()[-4000:])

    def wait_for(self, condition, timeout: float, what: str) -> None:
        """Wait until ``condition()`` holds; fails if the peer exits first or ``timeout`` seconds pass (``what``:
        what it waited for, in the error)."""
        deadline = time.monotonic() + timeout
        while not condition():
            assert self.process.poll() is None, self.log()[-4000:]
            if time.monotonic() > deadline:
                raise TimeoutError(f"no {what} after {timeout} s:\n{self.log()[-4000:]}")
            time.sleep(0.2)

    def wait(self, timeout: float) -> None:
        try:
            code = self.process.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            raise TimeoutError(f"still running after {timeout} s:\n{self.log()[-4000:]}") from None
        assert code == 0, self.log()[-4000:]

    def kill(self) -> None:
        """SIGKILL the peer and everything it started (its DHT, averagers and p2p daemon share its session)."""
        try:
            os.killpg(self.process.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.process.wait(timeout=30)
        self._log.close()
