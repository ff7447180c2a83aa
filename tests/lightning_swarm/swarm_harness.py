"""Spawn real swarm peers (tests/lightning_swarm/peer_worker.py through LightningCLI) as separate processes on
127.0.0.1, read what they record, and always clean them up."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Dict, List, Optional

import yaml
from safetensors.torch import load_file

WORKER = Path(__file__).with_name("peer_worker.py")
REPO = Path(__file__).resolve().parents[2]
JOIN_OPTION = re.compile(r"--trainer\.strategy\.init_args\.initial_peers='(\[.*?\])'")


class Peer:
    """One peer process: its config, output directory and log.

    cpus: if set (e.g. "0"), the peer and every process it starts (DHT, averagers, p2p daemon) run only on these CPU
        cores (taskset), like a peer alone on a machine with that many cores.
    join_later: start the process now (its imports overlap the start of the peer it will join) and give it the
        initial peers with :meth:`join` (``strategy`` then holds no ``initial_peers``).
    command_prefix: run the peer under this command, e.g. ``["ip", "netns", "exec", namespace]`` (netns_harness).
    """

    def __init__(self, root: Path, name: str, strategy: Dict[str, Any], model: Dict[str, Any], data: Dict[str, Any],
                 recorder: Dict[str, Any], trainer: Optional[Dict[str, Any]] = None, extra_args: List[str] = (),
                 cpus: Optional[str] = None, join_later: bool = False, command_prefix: List[str] = ()):
        self.name, self.out_dir = name, root / name
        self.out_dir.mkdir(parents=True, exist_ok=True)
        config = {
            "trainer": {
                "accelerator": "cpu", "max_epochs": 1000, "max_steps": 100_000, "logger": False,
                "enable_checkpointing": False, "enable_progress_bar": False, "enable_model_summary": False,
                "strategy": {"class_path": "lightning_swarm.HivemindStrategy", "init_args": strategy},
                "callbacks": [{"class_path": "peer_worker.SwarmRecorder",
                               "init_args": dict(out_dir=str(self.out_dir), **recorder)}],
                **(trainer or {}),
            },
            "model": model,
            "data": data,
        }
        self.config_path = self.out_dir / "config.yaml"
        self.config_path.write_text(yaml.safe_dump(config))
        self.log_path = self.out_dir / "log.txt"
        env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(WORKER.parent), str(REPO)]), PEER_TORCH_THREADS="1")
        env.pop("LIGHTNING_SWARM_INITIAL_PEERS", None)
        self._initial_peers_path = self.out_dir / "initial_peers.json"
        if join_later:
            env["PEER_INITIAL_PEERS_FILE"] = str(self._initial_peers_path)
        self._log_file = open(self.log_path, "w")
        self.process = subprocess.Popen(
            [*command_prefix, *(["taskset", "-c", cpus] if cpus else []), sys.executable, str(WORKER), "fit", "--config",
             str(self.config_path), *extra_args],
            stdout=self._log_file, stderr=subprocess.STDOUT, env=env, start_new_session=True,
        )

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def events(self) -> List[Dict[str, Any]]:
        path = self.out_dir / "events.jsonl"
        if not path.exists():
            return []
        return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]

    def params(self, epoch: int) -> Dict[str, Any]:
        return load_file(str(self.out_dir / f"params_{epoch}.safetensors"))

    def max_epoch(self) -> int:
        return max((event["epoch"] for event in self.events()), default=-1)

    def join_peers(self, timeout: float = 90) -> List[str]:
        """The initial_peers the peer printed for others to join (waits until it is printed)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            match = JOIN_OPTION.search(self.log())
            if match:
                return json.loads(match.group(1))
            self.check_alive()
            time.sleep(0.2)
        raise TimeoutError(f"{self.name} did not print its join address:\n{self.log()[-3000:]}")

    def join(self, initial_peers: List[str]) -> None:
        """Give a peer started with ``join_later`` the peers to join (it waits for them before it builds its
        strategy)."""
        temporary = self._initial_peers_path.with_suffix(".tmp")
        temporary.write_text(json.dumps(initial_peers))
        os.replace(temporary, self._initial_peers_path)

    def check_alive(self) -> None:
        code = self.process.poll()
        if code not in (None, 0):
            raise RuntimeError(f"{self.name} exited with {code}:\n{self.log()[-4000:]}")

    def wait(self, timeout: float) -> int:
        try:
            code = self.process.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            raise TimeoutError(f"{self.name} still running after {timeout}s:\n{self.log()[-3000:]}") from None
        if code != 0:
            raise RuntimeError(f"{self.name} exited with {code}:\n{self.log()[-4000:]}")
        return code

    def kill(self) -> None:
        """SIGKILL the peer and everything it started (its DHT process and p2p daemon share its session)."""
        try:
            os.killpg(self.process.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        try:
            self.process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            pass
        self._log_file.close()


def wait_until(condition, timeout: float, peers: List[Peer], what: str) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():
            return
        for peer in peers:
            peer.check_alive()
        time.sleep(0.2)
    logs = "\n".join(f"--- {p.name}\n{p.log()[-2000:]}" for p in peers)
    raise TimeoutError(f"timed out after {timeout}s waiting for {what}\n{logs}")
