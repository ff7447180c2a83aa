"""A 2-peer swarm of the tiny recipe at fp16 (``precision: 16-mixed``, loss scaling) on one machine
(tests/gpu/check.sh).

Two ``python -m recipes.dalle fit --config configs/dalle_tiny.yaml`` peers on 127.0.0.1 (both on the one GPU with
``--device cuda``): the first starts the swarm, the second joins it from the address the first prints. Each records
its global epochs (tests/lightning_swarm/peer_worker.SwarmRecorder) and stops at ``--epochs``. Fails unless both
exit cleanly, each saw the other (2 peers), the loss scale stayed finite, and their parameters agree at the last
epoch both reached (gradients are averaged every epoch).

    python tests/gpu/swarm_fp16.py [--epochs 6] [--device cuda] [--precision 16-mixed] [--out DIR]
"""

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from safetensors.torch import load_file

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "tests" / "lightning_swarm"))
from recipe_peers import JOIN_OPTION, write_overlay  # noqa: E402


def start_peer(out_dir: Path, overlay: Path, env: dict) -> subprocess.Popen:
    log = open(out_dir / "log.txt", "w")
    return subprocess.Popen([sys.executable, "-m", "recipes.dalle", "fit", "--config",
                             str(REPO / "configs/dalle_tiny.yaml"), "--config", str(overlay)],
                            stdout=log, stderr=subprocess.STDOUT, env=env, cwd=REPO, start_new_session=True)


def events(out_dir: Path) -> list:
    path = out_dir / "events.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def run(epochs: int, device: str, precision: str, timeout: float, out: str | None) -> None:
    root = Path(out) if out else Path(tempfile.mkdtemp(prefix="swarm_fp16_"))
    root.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO / "tests" / "lightning_swarm"), str(REPO)]))
    env.pop("LIGHTNING_SWARM_INITIAL_PEERS", None)
    accelerator = "gpu" if device.startswith("cuda") else "cpu"
    strategy = dict(run_id="gpu_fp16_swarm", host_maddrs=["/ip4/127.0.0.1/tcp/0"], compression="none",
                    matchmaking_time=2.0, averaging_timeout=30.0,
                    tracker_opts=dict(min_refresh_period=0.1, max_refresh_period=0.5, default_refresh_period=0.2))
    recorder = dict(stop_at_epoch=epochs, max_seconds=timeout - 60, barrier_count=2)
    peers, dirs = [], []
    try:
        for index in range(2):
            out_dir = root / f"peer{index}"
            out_dir.mkdir()
            dirs.append(out_dir)
            recorder_index = dict(recorder, barrier_dir=str(root / "barrier"))
            overlay = write_overlay(out_dir, dict(strategy), recorder_index, {"data_dir": str(root / "data")},
                                    trainer={"precision": precision, "accelerator": accelerator})
            if index == 1:  # join the first peer at the address it printed
                deadline = time.monotonic() + 180
                while not (match := JOIN_OPTION.search((dirs[0] / "log.txt").read_text(errors="replace"))):
                    assert peers[0].poll() is None and time.monotonic() < deadline, \
                        (dirs[0] / "log.txt").read_text()[-3000:]
                    time.sleep(0.5)
                strategy["initial_peers"] = json.loads(match.group(1))
                overlay = write_overlay(out_dir, dict(strategy), recorder_index, {"data_dir": str(root / "data")},
                                        trainer={"precision": precision, "accelerator": accelerator})
            peers.append(start_peer(out_dir, overlay, env))
        for peer, out_dir in zip(peers, dirs):
            code = peer.wait(timeout=timeout)
            assert code == 0, (out_dir / "log.txt").read_text()[-4000:]
    finally:
        for peer in peers:
            if peer.poll() is None:
                os.killpg(peer.pid, signal.SIGKILL)
                peer.wait()
    recorded = [events(d) for d in dirs]
    for index, peer_events in enumerate(recorded):
        steps = [e for e in peer_events if e["kind"] == "step"]
        scales = [e["loss_scale"] for e in steps if "loss_scale" in e]
        print(f"peer {index}: epochs {steps[0]['epoch']}..{steps[-1]['epoch']} in {len(steps)} local steps, "
              f"max peers seen {max(e['peers'] for e in steps)}, loss scale {scales[-1] if scales else 'n/a'}")
        assert steps[-1]["epoch"] >= epochs and max(e["peers"] for e in steps) == 2
        if precision == "16-mixed":
            assert scales and all(0 < s < float("inf") for s in scales), scales
    common = sorted(set.intersection(*[{int(p.stem.split("_")[1]) for p in d.glob("params_*.safetensors")}
                                       for d in dirs]))
    last = [e for e in common if e >= 2][-1]
    first, second = (load_file(str(d / f"params_{last}.safetensors")) for d in dirs)
    difference = max((first[k].float() - second[k].float()).abs().max().item() for k in first)
    print(f"2-peer {precision} swarm on {device}: parameters at epoch {last} differ by at most {difference:.2e}")
    assert difference < 1e-3, difference
    print(f"2-peer {precision} swarm on {device}: OK")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--epochs", type=int, default=6, help="global epochs each peer trains")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--precision", default="16-mixed")
    parser.add_argument("--timeout", type=float, default=420.0, help="seconds each peer may take")
    parser.add_argument("--out", default=None, help="folder for the peers' logs and records (default: a new temporary one)")
    args = parser.parse_args()
    run(args.epochs, args.device, args.precision, args.timeout, args.out)
