"""One swarm peer for the multi-peer tests and the benchmark: a tiny regression model trained through LightningCLI.

Run: python tests/lightning_swarm/peer_worker.py fit --config peer.yaml [--trainer.strategy.init_args.... ]
The SwarmRecorder callback writes into `out_dir`: `params_<epoch>.safetensors` (this peer's parameters when it
reached each global epoch) and `events.jsonl` (epoch, lr, peers, local step, samples/s...).
"""

from __future__ import annotations

import json
import logging
import os
import time
from pathlib import Path
from typing import Any, Optional

import torch
import lightning.pytorch as pl
from lightning.pytorch.cli import LightningCLI
from safetensors.torch import save_file
from torch.utils.data import DataLoader, TensorDataset


def cpu_seconds() -> dict:
    """CPU seconds used so far by this peer: its training thread ("main", the caller's thread) and everything else
    it runs ("background": its other threads, and its child processes: DHT, averagers, p2p daemon), from /proc."""
    ticks = os.sysconf("SC_CLK_TCK")

    def stat_seconds(path: str) -> float:
        fields = open(path).read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / ticks  # utime + stime

    children: dict = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                children.setdefault(int(open(f"/proc/{entry}/stat").read().rsplit(")", 1)[1].split()[1]), []).append(
                    int(entry))
            except OSError:  # exited meanwhile
                pass
    descendants, stack = [], list(children.get(os.getpid(), []))
    while stack:
        pid = stack.pop()
        descendants.append(pid)
        stack += children.get(pid, [])
    background = 0.0
    for pid in descendants:
        try:
            background += stat_seconds(f"/proc/{pid}/stat")
        except OSError:
            pass
    main = time.thread_time()
    own = os.times()
    return {"cpu_main": main, "cpu_background": background + own.user + own.system - main}


def make_regression_data(num_samples: int, in_dim: int, seed: int, noise: float = 0.1,
                         ) -> tuple[torch.Tensor, torch.Tensor]:
    """Deterministic synthetic regression data: y = x @ w + noise x N(0, 1) (w: N(0, 1), x: N(0, I)), so that the best
    possible mean squared error (the noise floor) is ``noise ** 2``."""
    # separate generators, so that sample i is the same whatever num_samples is
    x = torch.randn(num_samples, in_dim, generator=torch.Generator().manual_seed(seed))
    w = torch.randn(in_dim, 1, generator=torch.Generator().manual_seed(1234))
    y = x @ w + noise * torch.randn(num_samples, 1, generator=torch.Generator().manual_seed(seed + 1))
    return x, y


class TinyRegression(pl.LightningModule):
    """An MLP regressor with SGD and a per-epoch exponential LR decay (a schedule that must follow global epochs).

    hidden: the MLP's hidden width; 0: a linear model (least squares, whose optimum is known: the data's noise floor).
    lr_harmonic: the LR at global epoch k is ``lr / (1 + k)`` instead of ``lr * lr_decay ** k``. On least squares with
        inputs N(0, I) (loss Hessian 2 I) and ``lr`` 0.5, the parameters after k epochs are then the mean of the k
        epochs' least-squares fits, so no single epoch's gradient noise (a step on a few samples) is left whole.

    share_samples: if > 0, only the first `share_samples` samples count towards the swarm (later steps report
        batch size 0), so tests can control exactly what each peer contributes.
    step_delay: seconds to sleep in each training step (to emulate a slower peer).
    overflow_at_batches: batch indices whose loss is multiplied by 1e8, so that its fp16 gradients overflow.
    nan_at_batches: batch indices whose loss (and so every gradient) is NaN, as after a diverged step.
    nan_parameters: start with a NaN in the first layer's weight (a peer whose state went bad).
    """

    def __init__(self, in_dim: int = 8, hidden: int = 32, lr: float = 0.1, lr_decay: float = 0.5,
                 momentum: float = 0.0, seed: int = 0, share_samples: int = 0, step_delay: float = 0.0,
                 lr_harmonic: bool = False,
                 overflow_at_batches: tuple[int, ...] = (), nan_at_batches: tuple[int, ...] = (),
                 nan_parameters: bool = False):
        super().__init__()
        self.save_hyperparameters()
        torch.manual_seed(seed)
        if hidden:
            self.net = torch.nn.Sequential(torch.nn.Linear(in_dim, hidden), torch.nn.Tanh(), torch.nn.Linear(hidden, 1))
        else:
            self.net = torch.nn.Sequential(torch.nn.Linear(in_dim, 1))
        if nan_parameters:
            with torch.no_grad():
                self.net[0].weight[0, 0] = float("nan")
        self.samples_seen = 0

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        if self.hparams.step_delay:
            time.sleep(self.hparams.step_delay)
        loss = torch.nn.functional.mse_loss(self.net(x), y)
        self.log("train/loss", loss, prog_bar=True)
        if batch_idx in self.hparams.overflow_at_batches:
            loss = loss * 1e8  # x the loss scale: far beyond float16's 65504 in the backward pass
        if batch_idx in self.hparams.nan_at_batches:
            loss = loss * float("nan")
        return loss

    def swarm_batch_size(self, batch: Any) -> int:
        size = len(batch[0])
        share = self.hparams.share_samples
        if share:
            size = max(0, min(size, share - self.samples_seen))
        self.samples_seen += len(batch[0])
        return size

    def configure_optimizers(self):
        optimizer = torch.optim.SGD(self.parameters(), lr=self.hparams.lr, momentum=self.hparams.momentum)
        decay, harmonic = self.hparams.lr_decay, self.hparams.lr_harmonic
        scheduler = torch.optim.lr_scheduler.LambdaLR(
            optimizer, (lambda epoch: 1.0 / (1 + epoch)) if harmonic else (lambda epoch: decay**epoch))
        # interval "step": without the strategy, Lightning would decay the LR every local step
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


class RegressionData(pl.LightningDataModule):
    """Samples [offset, offset + num_samples) of the deterministic regression data, in order (``noise``: its noise's
    standard deviation, see make_regression_data)."""

    def __init__(self, batch_size: int = 4, num_samples: int = 100_000, offset: int = 0, in_dim: int = 8,
                 seed: int = 0, noise: float = 0.1):
        super().__init__()
        self.save_hyperparameters()

    def train_dataloader(self) -> DataLoader:
        h = self.hparams
        x, y = make_regression_data(h.offset + h.num_samples, h.in_dim, h.seed, h.noise)
        dataset = TensorDataset(x[h.offset:], y[h.offset:])
        return DataLoader(dataset, batch_size=h.batch_size, shuffle=False)


def loss_scale(trainer: pl.Trainer) -> dict:
    """{"loss_scale": the fp16 GradScaler's scale} under precision 16-mixed, else {}."""
    scaler = getattr(trainer.precision_plugin, "scaler", None)
    return {"loss_scale": scaler.get_scale()} if scaler is not None else {}


class SwarmRecorder(pl.Callback):
    """Record parameters and swarm state at every global epoch; stop at `stop_at_epoch` (or after `max_seconds`).

    barrier_dir, barrier_count: before the first step, write a file into `barrier_dir` and wait (up to
        `barrier_timeout` seconds) until `barrier_count` peers did, so that peers start together; before the second step, fetch the
        swarm's progress until this peer's tracker sees them all (hivemind lists a peer only once it has reported samples), unless
        `wait_for_swarm` is False (peers of different runs that only start together).
    first_step_delay: seconds to sleep after the barrier, before the first step: the other peers report their
        samples first, and this peer's tracker reads them before its own record exists (a peer late by one
        refresh period, as a loaded machine makes it).
    checkpoint_at_stop: if set, save a Lightning checkpoint to this path when stopping.
    record_params: save the parameters at every global epoch (benchmarks turn it off: it is not training work).
    warmup_seconds: if set, write a "warm" event (samples so far, elapsed) at the first step after this many seconds,
        so that benchmarks can measure the steady state without the join (state download) and the first epoch.
    """

    def __init__(self, out_dir: str, stop_at_epoch: int = 3, max_seconds: float = 120.0,
                 barrier_dir: Optional[str] = None, barrier_count: int = 1, checkpoint_at_stop: Optional[str] = None,
                 wait_for_swarm: bool = True, record_params: bool = True, warmup_seconds: Optional[float] = None,
                 first_step_delay: float = 0.0, barrier_timeout: float = 90.0):
        self.out_dir = Path(out_dir)
        self.stop_at_epoch, self.max_seconds = stop_at_epoch, max_seconds
        self.barrier_dir, self.barrier_count, self.wait_for_swarm = barrier_dir, barrier_count, wait_for_swarm
        self.barrier_timeout = barrier_timeout
        self.checkpoint_at_stop, self.record_params = checkpoint_at_stop, record_params
        self.warmup_seconds, self._warm = warmup_seconds, False
        self.first_step_delay = first_step_delay
        self._last_epoch: Optional[int] = None
        self._start: Optional[float] = None

    def _write_event(self, **event: Any) -> None:
        with open(self.out_dir / "events.jsonl", "a") as f:
            f.write(json.dumps(event) + "\n")

    def _record(self, trainer: pl.Trainer, pl_module: pl.LightningModule, kind: str) -> None:
        strategy = trainer.strategy
        epoch = strategy.global_epoch
        if epoch != self._last_epoch:
            self._last_epoch = epoch
            if self.record_params:
                params = {k: v.detach().cpu().contiguous() for k, v in pl_module.state_dict().items()}
                save_file(params, str(self.out_dir / f"params_{epoch}.safetensors"))
            self._write_event(
                kind=kind, epoch=epoch, lr=strategy.optimizer.param_groups[0]["lr"], peers=strategy.num_peers,
                local_step=trainer.global_step, samples=strategy.stats.samples_contributed,
                local_sps=strategy.local_samples_per_second, swarm_sps=strategy.stats.swarm_samples_per_second,
                time=time.time(), pid=os.getpid(), **loss_scale(trainer),
            )
        if not trainer.should_stop and (epoch >= self.stop_at_epoch or time.perf_counter() - self._start > self.max_seconds):
            trainer.should_stop = True
            if self.checkpoint_at_stop:
                trainer.save_checkpoint(self.checkpoint_at_stop)

    def _wait_for_barrier(self) -> None:
        barrier = Path(self.barrier_dir)
        barrier.mkdir(parents=True, exist_ok=True)
        (barrier / str(os.getpid())).touch()
        deadline = time.perf_counter() + self.barrier_timeout
        while len(list(barrier.iterdir())) < self.barrier_count and time.perf_counter() < deadline:
            time.sleep(0.05)

    def _wait_for_peers(self, strategy: Any) -> None:
        # the swarm's progress is fetched here, not at the tracker's next refresh (up to max_refresh_period away): a
        # peer that waited for it started up to a second after the others, which then made most of the first epoch's
        # samples (test_byzantine_swarm.py's nan case: the attacker's ~80%, and the honest step on 32 samples each)
        tracker = getattr(getattr(strategy, "_optimizer", None), "tracker", None)
        fetch = getattr(tracker, "fetch_global_progress", None)
        deadline = time.perf_counter() + 60
        while strategy.num_peers < self.barrier_count and time.perf_counter() < deadline:
            if fetch is not None:
                fetch(timeout=1.0)
            time.sleep(0.05)

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any) -> None:
        if self._start is None:  # first batch: the strategy has joined the swarm (and maybe loaded its state)
            self.out_dir.mkdir(parents=True, exist_ok=True)
            if self.barrier_dir:
                self._wait_for_barrier()
            time.sleep(self.first_step_delay)
            self._start = time.perf_counter()
            self._record(trainer, pl_module, "start")
        elif trainer.global_step == 1 and self.barrier_dir and self.wait_for_swarm:
            self._wait_for_peers(trainer.strategy)

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any) -> None:
        self._record(trainer, pl_module, "step")
        elapsed = time.perf_counter() - self._start
        if self.warmup_seconds is not None and not self._warm and elapsed >= self.warmup_seconds:
            self._warm = True
            self._write_event(kind="warm", epoch=trainer.strategy.global_epoch, elapsed=elapsed,
                              samples=trainer.strategy.stats.samples_contributed, time=time.time(), pid=os.getpid(),
                              **cpu_seconds())

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        from lightning_swarm.metrics import fetch_metrics

        strategy = trainer.strategy
        published = fetch_metrics(strategy.dht, strategy.run_id)
        self._write_event(kind="end", epoch=strategy.global_epoch, local_step=trainer.global_step,
                          metrics_steps=sorted(record.step for record in published.values()),
                          elapsed=time.perf_counter() - self._start if self._start is not None else 0.0,  # 0: no batch
                          samples=strategy.stats.samples_contributed,
                          time=time.time(), pid=os.getpid(), **cpu_seconds(), **loss_scale(trainer))


def wait_for_initial_peers() -> None:
    """With $PEER_INITIAL_PEERS_FILE, this peer was started before the peer it joins printed its address, so that its
    imports overlap that peer's start: wait for the file (a JSON list of multiaddrs), then join the peers it lists
    through the strategy's $LIGHTNING_SWARM_INITIAL_PEERS."""
    path = os.environ.get("PEER_INITIAL_PEERS_FILE")
    if not path:
        return
    import lightning_swarm.strategy  # noqa: F401  (hivemind and the strategy: imported while waiting too)

    deadline = time.monotonic() + 300
    while not os.path.exists(path):
        if time.monotonic() > deadline:
            raise TimeoutError(f"no initial peers in {path} after 300 s")
        time.sleep(0.05)
    with open(path) as f:
        os.environ["LIGHTNING_SWARM_INITIAL_PEERS"] = ",".join(json.load(f))


if __name__ == "__main__":
    torch.set_num_threads(int(os.environ.get("PEER_TORCH_THREADS", "1")))
    if os.environ.get("PEER_HIVEMIND_PART_HANDLING") == "1":  # benchmarks: hivemind's BAD_GROUP_ID race, as before
        from lightning_swarm.hivemind_ext.round_groups import PatientGroupRegistration
        PatientGroupRegistration.wait_for_registration = False
    if os.environ.get("PEER_EPOCH_ROUNDS") == "0":  # benchmarks: one group key for all epochs, no bound, as before
        from lightning_swarm.hivemind_ext.epoch_rounds import RoundEpochs
        RoundEpochs.enabled = False
    for name in filter(None, os.environ.get("PEER_DEBUG_LOGGERS", "").split(",")):  # tests that keep the why
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
        logging.getLogger(name).addHandler(handler)
        logging.getLogger(name).setLevel(logging.DEBUG)
        logging.getLogger(name).propagate = False
    wait_for_initial_peers()
    LightningCLI(TinyRegression, RegressionData, save_config_callback=None, seed_everything_default=0)
