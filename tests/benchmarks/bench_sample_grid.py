"""What the sample grid (recipes.dalle.SampleGrid, in configs/dalle_tiny.yaml) costs the tiny run.

Builds configs/dalle_tiny.yaml's model, data and callbacks (strategy ``auto``: no swarm, no logger), trains
``--steps`` local steps (the median step time, after ``--warmup`` steps), then validates ``--validations`` times with
the config's callbacks, timing each validation with and without its grid (SampleGrid records the seconds it takes).
Prints the seconds per validation with and without the grid, and the grid's share of one validation interval of the
run (``val_check_interval`` steps + a validation), which should stay under 10%.

    python tests/benchmarks/bench_sample_grid.py [--steps 12] [--validations 4] [--threads 2]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
from lightning.pytorch.callbacks import Callback

sys.path.insert(0, str(Path(__file__).resolve().parent))
from paths import REPO  # noqa: E402

sys.path.insert(0, str(REPO))
from recipes.cli import main  # noqa: E402
from recipes.dalle.sample_grid import SampleGrid  # noqa: E402


class Clock(Callback):
    """Wall time of each training step and each validation loop (grid included: SampleGrid runs in
    on_validation_end, which Lightning calls before this callback's, as it comes later in the list)."""

    def __init__(self):
        self.steps, self.validations = [], []  # (wall, CPU) seconds each

    def on_train_batch_start(self, *args):
        self._step = (time.perf_counter(), time.process_time())

    def on_train_batch_end(self, *args):
        self.steps.append((time.perf_counter() - self._step[0], time.process_time() - self._step[1]))

    def on_validation_start(self, *args):
        self._validation = (time.perf_counter(), time.process_time())

    def on_validation_end(self, *args):
        self.validations.append((time.perf_counter() - self._validation[0],
                                 time.process_time() - self._validation[1]))


def run(steps: int, warmup: int, validations: int) -> None:
    root = tempfile.mkdtemp(prefix="bench_sample_grid_")
    cli = main(["--config", str(REPO / "configs/dalle_tiny.yaml"), "--trainer.strategy", "auto",
                "--trainer.logger", "false", "--trainer.enable_progress_bar", "false",
                "--trainer.enable_checkpointing", "false", "--trainer.num_sanity_val_steps", "0",
                "--trainer.default_root_dir", root, "--trainer.max_steps", str(steps),
                "--trainer.val_check_interval", str(steps)], run=False)
    trainer, module, data = cli.trainer, cli.model, cli.datamodule
    interval = 100  # configs/dalle_tiny.yaml's val_check_interval (overridden above to validate once, at the end)
    (grid,) = [c for c in trainer.callbacks if isinstance(c, SampleGrid)]
    clock = Clock()
    trainer.callbacks.append(clock)
    trainer.fit(module, datamodule=data)  # steps, then one validation with its grid
    for _ in range(validations - 1):
        trainer.validate(module, datamodule=data, verbose=False)
    print(f"precision {trainer.precision}, {torch.get_num_threads()} threads, {len(grid.prompts)} prompts x "
          f"{grid.samples_per_prompt} samples, {data.hparams.get('max_val_batches', '?')} validation batches; "
          f"the first grid (loads the tokenizer and codec) is left out")
    for kind, index, grid_times in (("wall", 0, grid.seconds), ("CPU", 1, grid.cpu_seconds)):
        step = statistics.median(s[index] for s in clock.steps[warmup:])
        with_grid = statistics.median(v[index] for v in clock.validations[1:])
        grid_seconds = statistics.median(grid_times[1:])
        share = grid_seconds / (interval * step + with_grid)
        print(f"{kind}: train step {step:.3f} s (median of {len(clock.steps) - warmup}); validation without the grid "
              f"{with_grid - grid_seconds:.2f} s, with it {with_grid:.2f} s (grid {grid_seconds:.2f} s, each: "
              f"{[round(t, 2) for t in grid_times]}); the grid's share of a validation interval ({interval} steps + "
              f"a validation): {100 * share:.1f}%")
    print(f"PNGs: {[str(p) for p in grid.paths]}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=12, help="training steps to time")
    parser.add_argument("--warmup", type=int, default=2, help="first steps left out of the median")
    parser.add_argument("--validations", type=int, default=4, help="validations (each with its grid) to time")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    run(args.steps, args.warmup, args.validations)
