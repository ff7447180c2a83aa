"""One peer of a many-peer run: the real HivemindStrategy on a simulated accelerator (sim_accelerator.py), kept lean
(1 torch thread, plain Trainer without CLI, progress bar, logger, checkpointing or model summary; one callback).

Run: python tests/lightning_swarm/sim_peer.py CONFIG.json, where CONFIG holds
    out_dir: where events.jsonl goes; strategy: HivemindStrategy's arguments; model: SimulatedAccelerator's;
    stop_time: wall-clock time (time.time()) at which to stop (a file `stop_time` in out_dir replaces it: it is read
    every ~5 s); initial_peers_file (optional): wait for this JSON list
    of multiaddrs before joining (the process starts, imports and builds its model meanwhile).

events.jsonl gets one JSON line per global epoch this peer reaches ("epoch": how it got there, the samples it had
accumulated, its wait so far, the excess loss of its parameters, whether this epoch's update is delayed: with
``delay_optimizer_step`` it is applied in the background during the next epoch, and how many of the epoch's samples
had their gradient taken before the previous epoch's delayed update landed), one every ~5 s ("tick": samples
processed, wait, CPU seconds of its training thread and of everything else it runs) and one at the end.
"""

from __future__ import annotations

import json
import logging
import os
import re
import sys
import time
from pathlib import Path
from typing import Any, Optional

# hivemind's optimizer reports how each epoch ended at its status level (INFO with verbose=True)
OUTCOMES = [
    ("averaged", re.compile(r"Averaged gradients with (\d+) peers")),
    ("alone", re.compile(r"Skipped averaging: there are no other peers")),
    ("failed", re.compile(r"Averaging gradients failed|Proceeding with local gradients")),
    ("resync", re.compile(r"Peer is out of sync|Catching up with collaboration step")),
]


class OutcomeHandler(logging.Handler):
    """Remembers how this peer's optimizer ended its last epoch (from hivemind's log records in this process)."""

    def __init__(self) -> None:
        super().__init__(level=logging.DEBUG)
        self.outcomes: list = []

    def emit(self, record: logging.LogRecord) -> None:
        message = record.getMessage()
        for name, pattern in OUTCOMES:
            match = pattern.search(message)
            if match:
                self.outcomes.append(name if name != "averaged" else f"averaged:{match.group(1)}")

    def take(self) -> list:
        outcomes, self.outcomes = self.outcomes, []
        return outcomes


def make_recorder(out_dir: str, stop_time: float, handler: OutcomeHandler, tick_seconds: float = 5.0):
    import lightning.pytorch as pl
    import torch

    from peer_worker import cpu_seconds

    class ManyPeerRecorder(pl.Callback):
        """Writes events.jsonl (see the module's docstring) and stops at ``stop_time``."""

        def __init__(self) -> None:
            self.path = Path(out_dir) / "events.jsonl"
            self.epoch: Optional[int] = None
            self.samples = self.epoch_samples = 0
            self.epoch_stale = 0  # samples of this epoch whose gradient was taken before a delayed update landed
            self.update_pending = False  # a global step's delayed update has not changed the parameters yet
            self.batch_stale = False
            self.fingerprint: Optional[Any] = None  # a few parameters as they were when that step began
            self.wait = 0.0  # seconds of local steps beyond the simulated compute time
            self.batch_started = 0.0
            self.next_tick = 0.0
            self.stop_time = stop_time

        def write(self, **event: Any) -> None:
            with open(self.path, "a") as f:
                f.write(json.dumps(dict(event, time=time.time())) + "\n")

        def on_train_batch_start(self, trainer: Any, module: Any, *args: Any) -> None:
            self.batch_started = time.perf_counter()
            if self.epoch is None:  # the strategy joined the swarm (and downloaded its state if it joined late)
                self.epoch = trainer.strategy.global_epoch
                handler.take()
                self.write(kind="start", epoch=self.epoch, loss=module.excess_loss(), batch=module.batch,
                           rate=module.samples_per_second)

        def on_before_backward(self, trainer: Any, module: Any, loss: Any) -> None:
            # here, not at the batch's start: hivemind's Optimizer.step applies a delayed update that finished
            # before it runs the closure (training_step and backward), so the batch in which an update lands takes
            # its gradient after it
            if self.update_pending and not torch.equal(module.weights[0].detach()[:64], self.fingerprint):
                self.update_pending = False
            self.batch_stale = self.update_pending  # this batch's gradient is taken before the update landed

        def on_train_batch_end(self, trainer: Any, module: Any, *args: Any) -> None:
            self.wait += max(0.0, time.perf_counter() - self.batch_started - module.step_seconds)
            self.samples += module.batch
            self.epoch_samples += module.batch
            if self.batch_stale:
                self.epoch_stale += module.batch
            epoch = trainer.strategy.global_epoch
            optimizer = trainer.strategy.optimizer
            if epoch != self.epoch:
                self.write(kind="epoch", previous=self.epoch, epoch=epoch, samples=self.epoch_samples,
                           outcomes=handler.take(), processed=self.samples, wait=self.wait,
                           loss=module.excess_loss(), peers=trainer.strategy.num_peers,
                           delayed=bool(optimizer is not None and optimizer.delay_optimizer_step),
                           stale=self.epoch_stale)
                self.epoch, self.epoch_samples, self.epoch_stale = epoch, 0, 0
                if optimizer is not None and optimizer.delay_optimizer_step:
                    # this global step's update lands in the background during the next local steps: until the
                    # parameters change (local steps leave them as they are), gradients are taken before it
                    self.update_pending, self.fingerprint = True, module.weights[0].detach()[:64].clone()
            now = time.time()
            if now >= self.next_tick:
                self.next_tick = now + tick_seconds
                stop_file = Path(out_dir) / "stop_time"  # the harness sets the stop time once every peer started
                if stop_file.exists():
                    self.stop_time = float(stop_file.read_text() or "inf")
                self.write(kind="tick", epoch=epoch, processed=self.samples, wait=self.wait, **cpu_seconds())
            if now >= self.stop_time:
                trainer.should_stop = True

        def on_train_end(self, trainer: Any, module: Any) -> None:
            self.write(kind="end", epoch=trainer.strategy.global_epoch, processed=self.samples, wait=self.wait,
                       loss=module.excess_loss(), **cpu_seconds())

    return ManyPeerRecorder()


def main(config_path: str) -> None:
    import torch

    torch.set_num_threads(1)
    config = json.loads(Path(config_path).read_text())
    handler = OutcomeHandler()
    logging.getLogger("hivemind").addHandler(handler)
    # lightning_swarm's own lines with times, as hivemind's, so that a run's logs can be read side by side
    timed = logging.StreamHandler()
    timed.setFormatter(logging.Formatter("%(asctime)s.%(msecs)03d [%(levelname)s] [%(name)s] %(message)s",
                                         datefmt="%b %d %H:%M:%S"))
    logging.getLogger("lightning_swarm").addHandler(timed)
    logging.getLogger("lightning_swarm").setLevel(logging.INFO)

    import lightning.pytorch as pl

    from lightning_swarm import HivemindStrategy
    from sim_accelerator import SimulatedAccelerator, endless_loader

    if os.environ.get("BENCH_HIVEMIND_VALIDATORS"):  # benchmarks: hivemind's own, which check each record every time
        from hivemind.dht.crypto import RSASignatureValidator
        from hivemind.dht.schema import SchemaValidator

        from lightning_swarm import metrics

        metrics.make_validators = lambda run_id: [SchemaValidator(metrics.MetricSchema, prefix=run_id),
                                                  RSASignatureValidator()]

    model = SimulatedAccelerator(**config["model"])
    strategy_args = dict(config["strategy"])
    initial_peers_file = config.get("initial_peers_file")
    if initial_peers_file:
        deadline = time.monotonic() + 300
        while not os.path.exists(initial_peers_file):
            if time.monotonic() > deadline:
                raise TimeoutError(f"no initial peers in {initial_peers_file} after 300 s")
            time.sleep(0.1)
        strategy_args["initial_peers"] = json.loads(Path(initial_peers_file).read_text())
    trainer = pl.Trainer(
        accelerator="cpu", max_epochs=-1, max_steps=-1, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
        strategy=HivemindStrategy(**strategy_args),
        callbacks=[make_recorder(config["out_dir"], config["stop_time"], handler)],
    )
    trainer.fit(model, train_dataloaders=endless_loader())


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    main(sys.argv[1])
