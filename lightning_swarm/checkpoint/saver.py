"""Save checkpoints into a local directory, keep the last K, hand each new one to the background uploader.

Used by :class:`~lightning_swarm.checkpoint.callback.SwarmCheckpoint` inside a Trainer and by the monitor peer,
which has no Trainer.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any, List, Optional, Set

import torch

from lightning_swarm.checkpoint.checkpoint_io import save_checkpoint
from lightning_swarm.checkpoint.upload import CheckpointUploader

if TYPE_CHECKING:
    from hivemind.utils.crypto import RSAPrivateKey

logger = logging.getLogger(__name__)


class CheckpointSaver:
    """Saves checkpoints into a local directory, prunes old ones and hands new ones to an uploader.

    Used by :class:`SwarmCheckpoint` inside a Trainer and by the monitor peer, which has no Trainer.

    Args:
        dirpath: local directory for the checkpoints (``dirpath/epoch_000012/``, ``dirpath/latest``).
        keep_last: how many local checkpoints to keep (checkpoints still being uploaded are kept too).
        upload_to: where to upload each new checkpoint: ``hf://owner/name`` or any fsspec URL; None = local only.
        upload_max_attempts: attempts per checkpoint before the uploader gives it up.
        upload_backoff_seconds: wait before the first retry of a failed upload (doubles each time).
        remote_keep_last: keep only this many checkpoints at an fsspec target (None = all).
        signer: the run authority's private key, held by the monitor of a run with an authority: signs every
            checkpoint, so readers given the authority's public key can verify it (None: unsigned).
    """

    def __init__(
        self,
        dirpath: str,
        keep_last: int = 3,
        upload_to: Optional[str] = None,
        upload_max_attempts: Optional[int] = 10,
        upload_backoff_seconds: float = 5.0,
        remote_keep_last: Optional[int] = None,
        signer: Optional["RSAPrivateKey"] = None,
    ):
        if keep_last < 1:
            raise ValueError(f"keep_last must be >= 1 (got {keep_last}): the newest checkpoint is always kept")
        self.dirpath, self.keep_last, self.signer = dirpath, keep_last, signer
        self.uploader = (
            CheckpointUploader(
                upload_to,
                max_attempts=upload_max_attempts,
                backoff_seconds=upload_backoff_seconds,
                remote_keep_last=remote_keep_last,
            )
            if upload_to
            else None
        )
        self.saved: List[str] = []  # local paths, in order
        # names of checkpoints another thread is reading (e.g. the monitor's sampler): pruning keeps them
        self.in_use: Set[str] = set()

    def save(
        self,
        module: torch.nn.Module,
        optimizer_states: List[dict],
        scheduler_states: List[dict],
        **meta: Any,
    ) -> str:
        """Save one checkpoint (``meta``: global_epoch, run_id, samples_seen, loss, extra_meta), queue its
        upload and return its local path."""
        protected = (self.uploader.pending if self.uploader else set()) | set(self.in_use)
        path = save_checkpoint(
            self.dirpath,
            module,
            optimizer_states,
            scheduler_states,
            keep_last=self.keep_last,
            protected=protected,
            signer=self.signer,
            **meta,
        )
        self.saved.append(path)
        logger.info(f"Saved checkpoint {path}")
        if self.uploader is not None:
            self.uploader.submit(path)
        return path

    def close(self, timeout: Optional[float] = 60.0) -> None:
        """Give pending uploads up to ``timeout`` seconds, then stop the upload thread."""
        if self.uploader is not None:
            self.uploader.close(timeout)
