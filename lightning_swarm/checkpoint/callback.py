"""Save the swarm's state every N global epochs and/or T minutes, keep the last K, upload in the background.

Works with any LightningModule, with or without ``HivemindStrategy``: the global epoch is
``trainer.strategy.global_epoch`` when the strategy has one, else ``trainer.global_step``.

    Trainer(callbacks=[SwarmCheckpoint(dirpath="ckpt", every_n_epochs=10, upload_to="hf://me/my-run")])

A recipe starts from a checkpoint with ``SwarmCheckpoint(resume_from=URL)`` or
``checkpoint_io.load_checkpoint(URL, module)``. The format is described in ``checkpoint_io``.
"""

from __future__ import annotations

import logging
import math
import time
from typing import Any, Dict, List, Optional

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities.data import extract_batch_size

from lightning_swarm.checkpoint.checkpoint_io import Checkpoint, read_checkpoint
from lightning_swarm.checkpoint.saver import CheckpointSaver
from lightning_swarm.checkpoint.upload import CheckpointUploader

logger = logging.getLogger(__name__)


def _optimizer_state(optimizer: Any) -> dict:
    return optimizer.state_dict()


_LOSS_SCALER_KEYS = {"scale": float, "growth_factor": float, "backoff_factor": float, "growth_interval": int,
                     "_growth_tracker": int}


def _loss_scale_meta(trainer: "pl.Trainer") -> dict:
    """{"loss_scaler": the fp16 GradScaler's state} under precision 16-mixed (plain numbers, for meta.json)."""
    scaler = getattr(trainer.precision_plugin, "scaler", None)
    if scaler is None or not scaler.is_enabled():
        return {}
    return {"loss_scaler": {key: cast(value) for key, value in scaler.state_dict().items()
                            if (cast := _LOSS_SCALER_KEYS.get(key)) is not None}}


def _load_loss_scale(trainer: "pl.Trainer", state: Any, url: str) -> None:
    """Restore the fp16 loss scale saved by ``_loss_scale_meta``; a malformed one is logged and ignored."""
    scaler = getattr(trainer.precision_plugin, "scaler", None)
    if scaler is None or state is None:
        return
    valid = isinstance(state, dict) and set(state) == set(_LOSS_SCALER_KEYS) and all(
        isinstance(state[key], (int, float)) and not isinstance(state[key], bool) and math.isfinite(state[key])
        and state[key] >= 0 for key in state) and state["scale"] > 0
    if not valid:
        logger.warning(f"Checkpoint {url}: ignoring a malformed loss_scaler entry {state!r}; the scale starts afresh")
        return
    scaler.load_state_dict(state)


class SwarmCheckpoint(Callback):
    """Lightning callback: checkpoint every ``every_n_epochs`` global epochs and/or ``every_n_minutes``.

    Args:
        dirpath: local directory for the checkpoints.
        every_n_epochs: save when the global epoch advanced by this many since the last save (None = off).
        every_n_minutes: save when this many minutes passed since the last save (None = off).
        keep_last: how many local checkpoints to keep.
        upload_to: ``hf://owner/name`` (Hugging Face Hub model repo) or any fsspec URL (local path,
            ``memory://``, ``s3://``...); None = local only. Uploads run in the background.
        resume_from: a checkpoint URL (a checkpoint directory, or a root with ``latest``) to start from:
            weights are loaded before the strategy sets up, optimizer/scheduler states when fit starts.
        resume_authority_key: the run's authority public key (``ssh-rsa ...`` or a file holding it): resume only
            from a checkpoint the run's moderators' monitor signed (see ``lightning_swarm.checkpoint.seal``).
        run_id: recorded in meta.json; defaults to ``trainer.strategy.run_id`` if the strategy has one.
        loss_key: logged metric recorded as the loss; falls back to the ``loss`` of the last training step.
        save_on_train_end: also save when training ends (if the state changed since the last save).
        upload_max_attempts: attempts per checkpoint before the uploader gives it up.
        upload_backoff_seconds: wait before retrying a failed upload (doubles each time).
        final_upload_timeout: at the end of training, wait at most this many seconds for pending uploads.
    """

    def __init__(
        self,
        dirpath: str = "checkpoints",
        every_n_epochs: Optional[int] = 1,
        every_n_minutes: Optional[float] = None,
        keep_last: int = 3,
        upload_to: Optional[str] = None,
        resume_from: Optional[str] = None,
        resume_authority_key: Optional[str] = None,
        run_id: Optional[str] = None,
        loss_key: str = "train/loss",
        save_on_train_end: bool = True,
        upload_max_attempts: Optional[int] = 10,
        upload_backoff_seconds: float = 5.0,
        final_upload_timeout: float = 60.0,
    ):
        if every_n_epochs is None and every_n_minutes is None:
            raise ValueError("SwarmCheckpoint needs every_n_epochs and/or every_n_minutes (both are None)")
        if every_n_epochs is not None and every_n_epochs < 1:
            raise ValueError(f"every_n_epochs must be >= 1 or None, got {every_n_epochs}")
        self.every_n_epochs, self.every_n_minutes = every_n_epochs, every_n_minutes
        self.resume_from, self.run_id, self.loss_key = resume_from, run_id, loss_key
        self.resume_authority_key = resume_authority_key
        self.save_on_train_end, self.final_upload_timeout = save_on_train_end, final_upload_timeout
        self.saver_kwargs = dict(
            dirpath=dirpath,
            keep_last=keep_last,
            upload_to=upload_to,
            upload_max_attempts=upload_max_attempts,
            upload_backoff_seconds=upload_backoff_seconds,
        )
        self.saver: Optional[CheckpointSaver] = None
        self.resumed_meta: Optional[Dict[str, Any]] = None  # meta.json of the checkpoint we started from
        self._resumed: Optional[Checkpoint] = None
        self._last_saved_epoch: Optional[int] = None
        self._last_save_time = time.monotonic()
        self._last_loss: Optional[float] = None
        self._local_samples = 0

    # ------------------------------------------------------------------ what gets recorded

    def global_epoch(self, trainer: "pl.Trainer") -> int:
        """The swarm's collaborative step if the strategy has one, else the local optimizer step (counted on
        from the resumed checkpoint's epoch)."""
        epoch = getattr(trainer.strategy, "global_epoch", None)
        if epoch is not None:
            return int(epoch)
        return int(trainer.global_step) + int((self.resumed_meta or {}).get("global_epoch") or 0)

    def samples_seen(self, trainer: "pl.Trainer") -> int:
        """Samples the whole run trained on: the strategy's count if it has one, else epochs x target batch
        size for a swarm, else the samples this trainer processed (plus those of the resumed checkpoint)."""
        for attr in ("samples_seen", "global_samples"):
            value = getattr(trainer.strategy, attr, None)
            if isinstance(value, (int, float)):
                return int(value)
        target = getattr(getattr(trainer.strategy, "optimizer", None), "target_batch_size", None)
        if isinstance(target, int) and getattr(trainer.strategy, "global_epoch", None) is not None:
            return int(self.global_epoch(trainer) * target)
        resumed = (self.resumed_meta or {}).get("samples_seen") or 0
        return int(resumed + self._local_samples)

    def _loss(self, trainer: "pl.Trainer") -> Optional[float]:
        value = trainer.callback_metrics.get(self.loss_key)
        if value is not None:
            return float(value)
        return self._last_loss

    # ------------------------------------------------------------------ hooks

    def setup(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", stage: str) -> None:
        if trainer.is_global_zero and self.saver is None:
            self.saver = CheckpointSaver(**self.saver_kwargs)
        if stage == "fit" and self.resume_from and self._resumed is None:
            # weights go in before strategy.setup, so a swarm strategy shares/averages the loaded weights
            self._resumed = read_checkpoint(self.resume_from, authority_public_key=self.resume_authority_key)
            self._resumed.load_into(pl_module)
            self.resumed_meta = self._resumed.meta
            logger.info(f"Starting from checkpoint {self._resumed.url} (epoch {self.resumed_meta['global_epoch']})")

    def on_fit_start(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        if self._resumed is not None:
            optimizers = trainer.optimizers
            schedulers = [config.scheduler for config in trainer.lr_scheduler_configs]
            if len(self._resumed.optimizer_states) != len(optimizers):
                raise ValueError(
                    f"Checkpoint {self._resumed.url} holds {len(self._resumed.optimizer_states)} optimizer states "
                    f"but the module configures {len(optimizers)} optimizers: configure_optimizers must match"
                )
            for opt, state in zip(optimizers, self._resumed.optimizer_states):
                opt.load_state_dict(state)
            for sched, state in zip(schedulers, self._resumed.scheduler_states):
                sched.load_state_dict(state)
            _load_loss_scale(trainer, self._resumed.meta.get("loss_scaler"), self._resumed.url)
            self._resumed = None  # free the tensors
        self._last_saved_epoch = None  # set at the first batch: a swarm strategy may still load the state
        self._last_save_time = time.monotonic()

    def on_train_batch_start(
        self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", batch: Any, batch_idx: int
    ) -> None:
        if self._last_saved_epoch is None:
            # the epoch we start from (after joining the swarm) is already saved elsewhere: count from it
            self._last_saved_epoch = self.global_epoch(trainer)

    def on_train_batch_end(
        self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        loss = outputs.get("loss") if isinstance(outputs, dict) else outputs
        if isinstance(loss, torch.Tensor) and loss.numel() == 1:
            loss = float(loss.detach())
            if math.isfinite(loss):
                self._last_loss = loss
        try:
            self._local_samples += extract_batch_size(batch)
        except Exception:  # unusual batch structures: fall back to counting batches
            self._local_samples += 1
        if self._should_save(trainer):
            self.save(trainer, pl_module)

    def on_train_end(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        if self.save_on_train_end and self.global_epoch(trainer) != self._last_saved_epoch:
            self.save(trainer, pl_module)
        if self.saver is not None:
            self.saver.close(timeout=self.final_upload_timeout)

    def _should_save(self, trainer: "pl.Trainer") -> bool:
        epoch = self.global_epoch(trainer)
        if epoch == self._last_saved_epoch:
            return False  # nothing changed since the last save
        if self.every_n_epochs is not None and epoch - self._last_saved_epoch >= self.every_n_epochs:
            return True
        if self.every_n_minutes is not None:
            return time.monotonic() - self._last_save_time >= 60 * self.every_n_minutes
        return False

    # ------------------------------------------------------------------ saving

    def save(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> Optional[str]:
        """Save a checkpoint now (rank zero only); returns its local path."""
        epoch = self.global_epoch(trainer)
        self._last_saved_epoch, self._last_save_time = epoch, time.monotonic()
        if not trainer.is_global_zero or self.saver is None:
            return None
        return self.saver.save(
            pl_module,
            [_optimizer_state(opt) for opt in trainer.optimizers],
            [config.scheduler.state_dict() for config in trainer.lr_scheduler_configs],
            global_epoch=epoch,
            run_id=self.run_id or getattr(trainer.strategy, "run_id", None),
            samples_seen=self.samples_seen(trainer),
            loss=self._loss(trainer),
            extra_meta=dict(local_step=int(trainer.global_step), **_loss_scale_meta(trainer)),
        )

    @property
    def uploader(self) -> Optional[CheckpointUploader]:
        """The background uploader (``uploaded``, ``errors``, ``given_up`` report its progress)."""
        return self.saver.uploader if self.saver is not None else None
