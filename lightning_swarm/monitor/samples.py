"""Draw samples from each new checkpoint for the dashboard, in a background process of low priority.

The monitor knows nothing about the model: it runs a sampling command line on the checkpoint it just saved,
``python -m MODULE --checkpoint DIR --prompt P1 --prompt P2 ... --out OUT [extra args]``, where MODULE is
``inference.generate`` for the recipes of this repository (CLIP-reranked grids). The command must write
``OUT/results.json``: a list of ``{"prompt", "grid" (PNG file name in OUT), "kept": [{"clip_score"}, ...]}``.
"""

from __future__ import annotations

import json
import logging
import os
import shlex
import subprocess
import sys
import threading
import time
from typing import Callable, Dict, List, Optional, Sequence, Set

logger = logging.getLogger(__name__)


def read_sample_results(out_dir: str) -> List[Dict]:
    """The grids a sampling run wrote into ``out_dir`` (its results.json), checked: a list of
    ``{"prompt", "file", "path", "clip_scores"}`` for the PNGs that exist inside ``out_dir``."""
    with open(os.path.join(out_dir, "results.json")) as f:
        results = json.load(f)
    if not isinstance(results, list):
        raise ValueError(f"{out_dir}/results.json: expected a list of results, got {type(results).__name__}")
    grids = []
    for result in results:
        name = os.path.basename(str(result.get("grid", "")))  # only files inside out_dir
        path = os.path.join(out_dir, name)
        if not name.endswith(".png") or not os.path.isfile(path):
            logger.warning(f"Sample results in {out_dir}: no PNG grid {name!r}; skipped")
            continue
        scores = [float(k["clip_score"]) for k in result.get("kept", []) if k.get("clip_score") is not None]
        grids.append(dict(prompt=str(result.get("prompt", "")), file=name, path=path, clip_scores=scores))
    return grids


class SampleRunner:
    """Runs the sampling command on submitted checkpoints, one at a time, newest first; reports each result.

    Args:
        prompts: captions to draw.
        out_root: directory for the samples (``out_root/epoch_000012/``).
        on_samples: called (on the runner's thread) with ``{"epoch", "checkpoint", "time", "grids"}`` after each run.
        module: the sampling module run with ``python -m``.
        extra_args: more arguments for it, as one shell-quoted string (e.g. ``"--clip-model ckpt/clip --keep 4"``).
        timeout: seconds a sampling run may take before it is stopped.
        niceness: added to the sampling process's niceness, so that it yields the CPU to the monitor's DHT.
        in_use: a set that holds the name of the checkpoint being sampled from while it is (the saver's
            ``in_use``, so that pruning keeps it).
    """

    def __init__(
        self,
        prompts: Sequence[str],
        out_root: str,
        on_samples: Callable[[Dict], None],
        module: str = "inference.generate",
        extra_args: str = "",
        timeout: float = 1800.0,
        niceness: int = 10,
        in_use: Optional[Set[str]] = None,
    ):
        if not prompts:
            raise ValueError("SampleRunner needs at least one prompt")
        self.prompts, self.out_root, self.on_samples = list(prompts), out_root, on_samples
        self.module, self.extra_args = module, shlex.split(extra_args)
        self.timeout, self.niceness = timeout, niceness
        self.in_use = in_use if in_use is not None else set()
        self.runs = 0  # finished runs (successful or not)
        self._pending: Optional[tuple] = None  # (checkpoint dir, epoch) of the newest submission not yet run
        self._wakeup = threading.Condition()
        self._stop = False
        self._process: Optional[subprocess.Popen] = None
        self._thread = threading.Thread(target=self._run, name="sampler", daemon=True)
        self._thread.start()

    def submit(self, checkpoint_dir: str, epoch: int) -> None:
        """Sample from ``checkpoint_dir`` when the current run ends (replaces an older waiting submission)."""
        with self._wakeup:
            self._pending = (checkpoint_dir, epoch)
            self._wakeup.notify()

    def command(self, checkpoint_dir: str, out_dir: str) -> List[str]:
        prompts = [arg for prompt in self.prompts for arg in ("--prompt", prompt)]
        return [sys.executable, "-m", self.module, "--checkpoint", checkpoint_dir, *prompts, "--out", out_dir,
                *self.extra_args]

    def _run(self) -> None:
        while True:
            with self._wakeup:
                while self._pending is None and not self._stop:
                    self._wakeup.wait()
                if self._stop:
                    return
                (checkpoint_dir, epoch), self._pending = self._pending, None
            try:
                self._sample(checkpoint_dir, epoch)
            except Exception as e:  # a failed sampling run must not stop the monitor
                if not self._stop:  # (a run killed by close() is no failure)
                    logger.warning(f"Sampling from {checkpoint_dir} failed: {e}")
            self.runs += 1

    def _sample(self, checkpoint_dir: str, epoch: int) -> None:
        name = os.path.basename(os.path.normpath(checkpoint_dir))
        self.in_use.add(name)
        try:
            if not os.path.isdir(checkpoint_dir):  # pruned before its turn came: a newer one is queued
                logger.info(f"Not sampling from {checkpoint_dir}: it was pruned meanwhile")
                return
            self._run_sampler(checkpoint_dir, epoch, os.path.join(self.out_root, name))
        finally:
            self.in_use.discard(name)

    def _run_sampler(self, checkpoint_dir: str, epoch: int, out_dir: str) -> None:
        os.makedirs(out_dir, exist_ok=True)
        started = time.monotonic()
        with open(os.path.join(out_dir, "sampling.log"), "w") as log:
            self._process = subprocess.Popen(
                self.command(checkpoint_dir, out_dir), stdout=log, stderr=subprocess.STDOUT,
                preexec_fn=lambda: os.nice(self.niceness),
            )
            try:
                code = self._process.wait(self.timeout)
            except subprocess.TimeoutExpired:
                self._process.kill()
                self._process.wait()
                raise RuntimeError(f"took more than {self.timeout}s; stopped") from None
        if code != 0:
            raise RuntimeError(f"{self.module} exited with code {code}; see {out_dir}/sampling.log")
        grids = read_sample_results(out_dir)
        logger.info(f"Sampled {len(grids)} grids from {checkpoint_dir} in {time.monotonic() - started:.0f}s")
        self.on_samples(dict(epoch=int(epoch), checkpoint=checkpoint_dir, time=time.time(), grids=grids))

    def close(self, timeout: float = 10.0) -> None:
        """Stop: the running sampling process is killed (it is only for the dashboard)."""
        with self._wakeup:
            self._stop = True
            self._wakeup.notify()
        process = self._process
        if process is not None and process.poll() is None:
            process.kill()
        self._thread.join(timeout)
