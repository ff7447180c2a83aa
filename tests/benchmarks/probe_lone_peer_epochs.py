"""Does the machine's timing change what a lone peer of the tiny recipe learns? (issue 28, item 2)

A one-peer swarm takes a global step (an optimizer update and a step of the LR schedule) when it has accumulated
``target_batch_size`` samples, or as soon as hivemind's estimate of the next epoch's time has passed
(``ProgressTracker.ready_to_update_epoch``), e.g. after a validation or when the machine stalled the process.
This runs ``python -m recipes.dalle fit --config configs/dalle_tiny.yaml`` with a tiny model, the shipped batch and
``target_batch_size`` (2 local steps a global step), seed and data, once per timing variant, each in a fresh
directory, and prints the global steps taken, the local steps after which a global step took a single batch, and
the validation image losses:

    steady   every local step followed by the same pause (``--pause``)
    stalls   the same plus a seeded random extra pause (up to ``--spread``) and a ``--stall`` every 7th step,
             as other processes on a loaded machine do

    python tests/benchmarks/probe_lone_peer_epochs.py [--steps 80] [--variants steady steady stalls]
"""

from __future__ import annotations

import argparse
import os
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import lightning.pytorch as pl

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_readme_flow import val_image_losses  # noqa: E402
from paths import REPO  # noqa: E402

TINY = ["--model.init_args.config.dim", "32", "--model.init_args.config.depth", "2",
        "--model.init_args.config.heads", "2", "--model.init_args.config.dim_head", "8",
        "--model.init_args.config.attn_types", "[axial_row, axial_col]", "--trainer.enable_progress_bar", "false",
        "--data.init_args.num_shapes_train", "2000", "--data.init_args.num_shapes_val", "200"]


class Pauses(pl.Callback):
    """Sleeps after every training batch (``pause`` + uniform(0, ``spread``), plus ``stall`` every
    ``stall_every``-th batch; seeded) and prints, at the end, the swarm optimizer's epoch after each local step."""

    def __init__(self, pause: float = 0.3, spread: float = 0.0, stall_every: int = 0, stall: float = 0.0,
                 seed: int = 0):
        self.pause, self.spread, self.stall_every, self.stall = pause, spread, stall_every, stall
        self.rng = random.Random(seed)
        self.epochs: list[int] = []

    def on_train_batch_end(self, trainer, *args, **kwargs):
        optimizer = trainer.optimizers[0]  # the hivemind optimizer (or a wrapper holding it)
        optimizer = optimizer if hasattr(optimizer, "local_epoch") else optimizer.optimizer
        self.epochs.append(int(optimizer.local_epoch))  # its global steps so far
        extra = self.stall if self.stall_every and len(self.epochs) % self.stall_every == 0 else 0.0
        time.sleep(self.pause + self.rng.uniform(0, self.spread) + extra)

    def on_train_end(self, trainer, *args, **kwargs):
        print("EPOCHS " + " ".join(map(str, self.epochs)), flush=True)


def run_variant(name: str, args: argparse.Namespace, workdir: Path) -> dict:
    pauses = {"steady": [], "stalls": ["--trainer.callbacks.init_args.spread", str(args.spread),
                                       "--trainer.callbacks.init_args.stall_every", "7",
                                       "--trainer.callbacks.init_args.stall", str(args.stall)]}[name]
    argv = [sys.executable, "-m", "recipes.dalle", "fit", "--config", str(REPO / "configs" / "dalle_tiny.yaml"), *TINY,
            "--trainer.max_steps", str(args.steps), "--trainer.val_check_interval", str(args.val_every),
            "--data.init_args.data_dir", str(workdir.parent / "data"),
            "--trainer.callbacks+=probe_lone_peer_epochs.Pauses", "--trainer.callbacks.init_args.pause",
            str(args.pause), *pauses]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join(
        [str(REPO), str(Path(__file__).resolve().parent), os.environ.get("PYTHONPATH", "")]))
    workdir.mkdir(parents=True)
    done = subprocess.run(argv, cwd=workdir, env=env, capture_output=True, text=True, timeout=args.timeout)
    if done.returncode != 0:
        raise RuntimeError(f"{name} failed:\n{done.stdout[-2000:]}\n{done.stderr[-3000:]}")
    epochs = [int(e) for line in done.stdout.splitlines() if line.startswith("EPOCHS ") for e in line.split()[1:]]
    # a global step after a single batch: the epoch changed at this local step and at the one before
    changes = [step for step in range(1, len(epochs)) if epochs[step] != epochs[step - 1]]
    single = [changes[i] + 1 for i in range(1, len(changes)) if changes[i] - changes[i - 1] == 1]
    return {"global_steps": epochs[-1] if epochs else None, "local_steps": len(epochs), "single_batch_steps": single,
            "val_image_loss": val_image_losses(workdir / "runs" / "dalle_tiny")}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--variants", nargs="+", default=["steady", "steady", "stalls"], choices=["steady", "stalls"])
    parser.add_argument("--steps", type=int, default=80, help="local steps of each fit")
    parser.add_argument("--val-every", type=int, default=20, help="local steps between validations")
    parser.add_argument("--pause", type=float, default=0.3, help="seconds after every step")
    parser.add_argument("--spread", type=float, default=1.0, help="stalls: up to this many more seconds a step")
    parser.add_argument("--stall", type=float, default=3.0, help="stalls: seconds more every 7th step")
    parser.add_argument("--timeout", type=float, default=900)
    args = parser.parse_args()
    root = Path(tempfile.mkdtemp(prefix="lone_peer_epochs_"))
    print(f"uptime before: {os.getloadavg()}")
    for index, name in enumerate(args.variants):
        result = run_variant(name, args, root / f"{index}_{name}")
        losses = ", ".join(f"{step}: {loss:.6f}" for step, loss in result["val_image_loss"])
        print(f"{name}: {result['global_steps']} global steps in {result['local_steps']} local steps; single-batch "
              f"global steps after local steps {result['single_batch_steps']}; val image loss {losses}", flush=True)
    print(f"uptime after: {os.getloadavg()}")


if __name__ == "__main__":
    main()
