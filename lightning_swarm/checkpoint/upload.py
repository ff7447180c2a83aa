"""Background upload of checkpoint directories to a Hugging Face Hub repo or any fsspec URL.

Targets:
- ``hf://owner/name`` (or ``hf://owner/name/subdir``): a Hub model repo, one commit per checkpoint through
  ``HfApi().upload_folder``; the checkpoint files sit at the repo root (or ``subdir``), the Hub keeps history.
  ``read_checkpoint("hf://owner/name")`` reads it back (fsspec's ``hf://`` file system).
- anything else fsspec opens (a local path, ``memory://``, ``s3://bucket/run``, ...): the same layout as the
  local root, ``target/epoch_000012/...`` plus ``target/latest``, written last so readers never see a partial
  checkpoint.

Uploads run on one daemon thread fed by a queue, so training never waits for the network. A failed upload
is retried with exponential backoff, reported with ``logger.warning`` and recorded in :attr:`errors`; the
local copy is never touched by the uploader. When newer checkpoints are waiting, an older one that keeps
failing is dropped as superseded (only the newest state matters).
"""

from __future__ import annotations

import logging
import os
import queue
import threading
import time
from dataclasses import dataclass
from typing import Callable, List, Optional, Set

import fsspec

from lightning_swarm.checkpoint.checkpoint_io import CHECKPOINT_FILES, META_FILE
from lightning_swarm.checkpoint.layout import LATEST_FILE, sort_checkpoint_names

logger = logging.getLogger(__name__)

HUB_PREFIX = "hf://"


def is_hub_target(url: str) -> bool:
    return url.startswith(HUB_PREFIX)


def upload_to_hub(local_dir: str, url: str, commit_message: str) -> None:
    """One commit that puts the checkpoint files of ``local_dir`` at ``hf://owner/name[/subdir]``."""
    from huggingface_hub import HfApi

    parts = url[len(HUB_PREFIX) :].strip("/").split("/")
    if len(parts) < 2:
        raise ValueError(f"Hub target must look like hf://owner/name[/subdir], got {url!r}")
    repo_id, subdir = "/".join(parts[:2]), "/".join(parts[2:])
    api = HfApi()
    api.create_repo(repo_id, repo_type="model", exist_ok=True)
    api.upload_folder(
        repo_id=repo_id,
        repo_type="model",
        folder_path=local_dir,
        path_in_repo=subdir or None,
        allow_patterns=list(CHECKPOINT_FILES),
        commit_message=commit_message,
    )


def upload_to_fsspec(local_dir: str, url: str, keep_last: Optional[int] = None) -> str:
    """Copy ``local_dir`` to ``url/<its name>`` then point ``url/latest`` at it; returns the remote URL.

    meta.json is copied last and ``latest`` after it, so a reader that follows ``latest`` (or checks for
    meta.json) never sees a half-uploaded checkpoint. ``keep_last`` prunes older remote checkpoints.
    """
    fs, root = fsspec.core.url_to_fs(url)
    root = root.rstrip("/")
    name = os.path.basename(os.path.normpath(local_dir))
    fs.makedirs(f"{root}/{name}", exist_ok=True)
    for file in sorted(CHECKPOINT_FILES, key=lambda f: f == META_FILE):
        fs.put_file(os.path.join(local_dir, file), f"{root}/{name}/{file}")
    fs.pipe_file(f"{root}/{LATEST_FILE}", (name + "\n").encode())
    if keep_last is not None:
        names = sort_checkpoint_names(
            os.path.basename(p.rstrip("/"))
            for p in fs.ls(root, detail=False)
            if fs.isfile(f"{p.rstrip('/')}/{META_FILE}")
        )
        for old in names[:-keep_last]:
            if old != name:
                fs.rm(f"{root}/{old}", recursive=True)
    return f"{url.rstrip('/')}/{name}"


@dataclass
class UploadError:
    """One failed attempt: which checkpoint, which attempt (1-based), what went wrong and when."""

    checkpoint: str
    attempt: int
    error: str
    time: float


class CheckpointUploader:
    """Uploads checkpoint directories to ``target`` on a background thread, retrying failures.

    Args:
        target: ``hf://owner/name[/subdir]`` or any fsspec URL (see module docstring).
        max_attempts: attempts per checkpoint before it is given up (None = retry until a newer one arrives).
        backoff_seconds: wait before the first retry; doubled after every failure.
        max_backoff_seconds: cap on the wait between retries.
        remote_keep_last: for fsspec targets, keep only this many checkpoints remotely (None = keep all).
        on_uploaded: called with (local_dir, remote_url) after each successful upload (on the upload thread).
    """

    def __init__(
        self,
        target: str,
        max_attempts: Optional[int] = 10,
        backoff_seconds: float = 5.0,
        max_backoff_seconds: float = 300.0,
        remote_keep_last: Optional[int] = None,
        on_uploaded: Optional[Callable[[str, str], None]] = None,
    ):
        if not target:
            raise ValueError("CheckpointUploader needs a target URL (hf://owner/name, a path, s3://..., ...)")
        self.target = target
        self.max_attempts, self.backoff_seconds, self.max_backoff_seconds = (
            max_attempts,
            backoff_seconds,
            max_backoff_seconds,
        )
        self.remote_keep_last, self.on_uploaded = remote_keep_last, on_uploaded
        self.uploaded: List[str] = []  # remote URLs of finished uploads, in order
        self.errors: List[UploadError] = []  # every failed attempt
        self.given_up: List[str] = []  # local dirs that were never uploaded (out of attempts or superseded)
        self._queue: "queue.Queue[Optional[str]]" = queue.Queue()
        self._pending: Set[str] = set()  # local dirs queued or being uploaded (the saver must not prune them)
        self._lock = threading.Lock()
        self._idle = threading.Event()
        self._idle.set()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="checkpoint-uploader", daemon=True)
        self._thread.start()

    @property
    def pending(self) -> Set[str]:
        """Names (basenames) of the checkpoints waiting for or in upload."""
        with self._lock:
            return {os.path.basename(os.path.normpath(p)) for p in self._pending}

    @property
    def last_error(self) -> Optional[UploadError]:
        return self.errors[-1] if self.errors else None

    def submit(self, local_dir: str) -> None:
        """Queue ``local_dir`` for upload and return immediately."""
        with self._lock:
            self._pending.add(local_dir)
            self._idle.clear()
        self._queue.put(local_dir)

    def wait(self, timeout: Optional[float] = None) -> bool:
        """Block until nothing is queued or uploading; True if that happened within ``timeout`` seconds."""
        return self._idle.wait(timeout)

    def close(self, timeout: Optional[float] = 60.0, force: bool = False) -> None:
        """Wait up to ``timeout`` seconds for queued uploads, then stop the thread once it is idle.

        Uploads still pending after ``timeout`` keep retrying in the background (the thread is a daemon,
        so they end with the process) unless ``force`` stops them now.
        """
        if not self.wait(timeout) and not force:
            logger.warning(
                f"{len(self.pending)} checkpoint upload(s) to {self.target} still pending after {timeout}s; "
                f"they keep retrying in the background. Local copies: {sorted(self.pending)}"
            )
            return
        self._stop.set()
        self._queue.put(None)
        self._thread.join(timeout=5)

    def _upload_once(self, local_dir: str) -> str:
        name = os.path.basename(os.path.normpath(local_dir))
        if is_hub_target(self.target):
            upload_to_hub(local_dir, self.target, commit_message=f"Checkpoint {name}")
            return self.target
        return upload_to_fsspec(local_dir, self.target, keep_last=self.remote_keep_last)

    def _run(self) -> None:
        while not self._stop.is_set():
            local_dir = self._queue.get()
            if local_dir is None:
                break
            self._upload_with_retries(local_dir)
            with self._lock:
                self._pending.discard(local_dir)
                if not self._pending:
                    self._idle.set()

    def _upload_with_retries(self, local_dir: str) -> None:
        attempt, delay = 0, self.backoff_seconds
        while not self._stop.is_set():
            attempt += 1
            try:
                remote = self._upload_once(local_dir)
            except Exception as e:  # any failure (network, permissions, quota) is retried, never raised
                self.errors.append(UploadError(local_dir, attempt, f"{type(e).__name__}: {e}", time.time()))
                superseded = not self._queue.empty()
                out_of_attempts = self.max_attempts is not None and attempt >= self.max_attempts
                if superseded or out_of_attempts:
                    why = "a newer checkpoint is queued" if superseded else f"{attempt} attempts failed"
                    logger.warning(f"Upload of {local_dir} to {self.target} failed ({e!r}); giving up: {why}")
                    self.given_up.append(local_dir)
                    return
                logger.warning(
                    f"Upload of {local_dir} to {self.target} failed (attempt {attempt}: {e!r}); "
                    f"retrying in {delay:.0f}s. The local copy is kept."
                )
                self._stop.wait(delay)
                delay = min(delay * 2, self.max_backoff_seconds)
                continue
            logger.info(f"Uploaded {local_dir} to {remote}")
            self.uploaded.append(remote)
            if self.on_uploaded is not None:
                self.on_uploaded(local_dir, remote)
            return
