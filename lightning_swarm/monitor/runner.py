"""The monitor's main loop: read the trainers' metrics, log the swarm's figures (and feed the dashboard),
checkpoint every N epochs (and sample from each checkpoint)."""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from typing import Callable, List, Optional

from hivemind.utils import get_dht_time
from lightning.pytorch.loggers import CSVLogger, Logger

from lightning_swarm.checkpoint.saver import CheckpointSaver
from lightning_swarm.metrics import LocalMetrics
from lightning_swarm.monitor.aggregate import ContributionTable, RecordScreen, SwarmSnapshot, aggregate, finite_json
from lightning_swarm.monitor.dashboard import DashboardState
from lightning_swarm.monitor.identity import token_identity
from lightning_swarm.monitor.peer import MonitorPeer
from lightning_swarm.monitor.samples import SampleRunner

logger = logging.getLogger(__name__)

LOGGER_CHOICES = ("auto", "csv", "tensorboard", "wandb")


def tensorboard_available() -> bool:
    import importlib.util

    return any(importlib.util.find_spec(name) is not None for name in ("tensorboard", "tensorboardX"))


def build_loggers(names: List[str], log_dir: str, run_id: str, wandb_project: Optional[str] = None) -> List[Logger]:
    """Lightning loggers by name. ``csv`` and ``tensorboard`` write offline under ``log_dir``; ``wandb`` needs
    the wandb package and ``wandb_project``. ``auto`` = csv, plus tensorboard if it is installed, plus wandb if
    a project is given."""
    if "auto" in names:
        names = [n for n in names if n != "auto"] + ["csv"]
        names += ["tensorboard"] if tensorboard_available() else []
        names += ["wandb"] if wandb_project else []
    loggers: List[Logger] = []
    for name in dict.fromkeys(names):  # unique, in order
        if name == "csv":
            loggers.append(CSVLogger(log_dir, name="monitor", version=run_id))
        elif name == "tensorboard":
            from lightning.pytorch.loggers import TensorBoardLogger

            loggers.append(TensorBoardLogger(log_dir, name="monitor", version=run_id))
        elif name == "wandb":
            if not wandb_project:
                raise ValueError("The wandb logger needs --wandb-project NAME")
            from lightning.pytorch.loggers import WandbLogger

            loggers.append(WandbLogger(project=wandb_project, name=f"{run_id}-monitor", save_dir=log_dir))
        else:
            raise ValueError(f"Unknown logger {name!r}: choose from {LOGGER_CHOICES}")
    return loggers


class Monitor:
    """Runs the auxiliary peer: every ``refresh_period`` seconds it reads the metrics records, logs the
    aggregate to ``loggers``, rewrites the contribution table and appends the snapshot to
    ``log_dir/snapshots.jsonl``; every ``save_every_epochs`` global epochs it downloads the state and saves
    (and uploads) a checkpoint with ``saver``.

    Args:
        peer: the monitor's swarm presence.
        loggers: Lightning loggers that receive ``swarm/loss``, ``swarm/alive_peers``, ...
        log_dir: directory for ``contributions.csv/json`` and ``snapshots.jsonl``.
        saver: checkpoint saver (None: no checkpoints).
        save_every_epochs: global epochs between two checkpoints.
        refresh_period: seconds between two reads of the metrics.
        revert_window: after a revert, keep announcing the reverted epoch for this many seconds.
        dashboard: receives every refresh's figures (served by :class:`~.dashboard.DashboardServer`).
        sampler: draws samples from every new checkpoint (for the dashboard).
        identify: maps (a metrics record's public key, the record) to its authenticated user, or None to keep the
            record out of the figures and the contribution table (see :class:`RecordScreen`). Default: in a run with
            an authority (``peer.auth``), the user of the access token in the record
            (:func:`~lightning_swarm.monitor.identity.token_identity`); in an open run every signed record counts.
    """

    def __init__(
        self,
        peer: MonitorPeer,
        loggers: List[Logger],
        log_dir: str,
        saver: Optional[CheckpointSaver] = None,
        save_every_epochs: int = 10,
        refresh_period: float = 30.0,
        revert_window: float = 300.0,
        dashboard: Optional[DashboardState] = None,
        sampler: Optional[SampleRunner] = None,
        identify: Optional[Callable[[bytes, LocalMetrics], Optional[str]]] = None,
    ):
        if save_every_epochs < 1:
            raise ValueError(f"save_every_epochs must be >= 1, got {save_every_epochs}")
        self.peer, self.loggers, self.log_dir, self.saver = peer, loggers, log_dir, saver
        self.save_every_epochs, self.refresh_period, self.revert_window = save_every_epochs, refresh_period, revert_window
        self.dashboard, self.sampler = dashboard, sampler
        self.contributions = ContributionTable()
        if identify is None and peer.auth is not None:
            identify = token_identity(peer.auth)
        self.screen = RecordScreen(peer.target_batch_size, identify=identify)
        self.last_snapshot: Optional[SwarmSnapshot] = None
        self.last_saved_epoch = peer.epoch
        self._newest_record_time = -float("inf")
        self._revert_started: Optional[float] = None
        self.stop_event = threading.Event()
        os.makedirs(log_dir, exist_ok=True)

    def revert_to(self, url: str, discovery_seconds: float = 0.0, epoch_margin: int = 5) -> int:
        """Revert the run to the checkpoint at ``url`` (see :meth:`MonitorPeer.revert_to`)."""
        epoch = self.peer.revert_to(url, discovery_seconds, epoch_margin, order_lifetime=self.revert_window)
        self._revert_started = time.monotonic()
        self.last_saved_epoch = epoch
        return epoch

    def step(self) -> Optional[SwarmSnapshot]:
        """One refresh; returns the snapshot if new records arrived."""
        if self.peer.reverted_epoch is not None:
            if time.monotonic() - self._revert_started < self.revert_window:
                self.peer.announce_revert()
            else:
                self.peer.end_revert()
        records = self.screen.screen(self.peer.fetch_metrics(), self.peer.swarm_epoch, now=get_dht_time())
        self.contributions.update(records, users=self.screen.users)
        snapshot = aggregate(records, self.contributions.total_samples, dict(self.screen.refused))
        newest = max((r.time for r in records.values()), default=-float("inf"))
        if snapshot is None or newest <= self._newest_record_time:
            return None
        self._newest_record_time = newest
        self.last_snapshot = snapshot
        self._log(snapshot)
        if self.dashboard is not None:
            self.dashboard.record(snapshot, self.contributions.sorted_rows(), self.peer.lr_schedule(snapshot.step))
        if self.saver is not None and snapshot.step >= self.last_saved_epoch + self.save_every_epochs:
            self.save_checkpoint()
        return snapshot

    def _log(self, snapshot: SwarmSnapshot) -> None:
        for pl_logger in self.loggers:
            pl_logger.log_metrics(snapshot.as_metrics(), step=snapshot.step)
            pl_logger.save()
        self.contributions.write(self.log_dir)
        with open(os.path.join(self.log_dir, "snapshots.jsonl"), "a") as f:
            f.write(json.dumps(finite_json(dict(time=time.time(), **snapshot.__dict__)), allow_nan=False) + "\n")
        logger.info(
            f"epoch {snapshot.step}: loss {snapshot.loss:.4f}, {snapshot.alive_peers} alive peers, "
            f"{snapshot.samples_per_second:.1f} samples/s, {snapshot.samples_contributed} samples contributed"
        )

    def save_checkpoint(self) -> Optional[str]:
        """Download the newest state from the trainers and save/upload it (if it is newer than the last)."""
        if not self.peer.load_state_from_peers() and self.peer.epoch <= self.last_saved_epoch:
            logger.warning("Could not download a newer state from the peers; will try again next refresh")
            return None
        epoch = self.peer.epoch
        path = self.saver.save(
            self.peer.module,
            self.peer.optimizer_states(),
            self.peer.scheduler_states(),
            global_epoch=epoch,
            run_id=self.peer.run_id,
            samples_seen=epoch * self.peer.target_batch_size,
            loss=self.last_snapshot.loss if self.last_snapshot else None,
            extra_meta=dict(
                alive_peers=self.last_snapshot.alive_peers if self.last_snapshot else 0,
                samples_contributed=self.contributions.total_samples,
                saved_by="lightning_swarm.monitor",
            ),
        )
        self.last_saved_epoch = epoch
        if self.sampler is not None:
            self.sampler.submit(path, epoch)
        return path

    def run(self, max_runtime: Optional[float] = None) -> None:
        """Refresh until :attr:`stop_event` is set (or ``max_runtime`` seconds passed)."""
        deadline = time.monotonic() + max_runtime if max_runtime else None
        while not self.stop_event.is_set() and (deadline is None or time.monotonic() < deadline):
            try:
                self.step()
            except Exception:  # a bad refresh (network hiccup) must not end the monitor
                logger.exception("Monitor refresh failed; continuing")
            self.stop_event.wait(self.refresh_period)

    def shutdown(self, upload_timeout: float = 60.0) -> None:
        for pl_logger in self.loggers:
            pl_logger.finalize("success")
        if self.sampler is not None:
            self.sampler.close()
        if self.saver is not None:
            self.saver.close(timeout=upload_timeout)
        self.peer.shutdown()
