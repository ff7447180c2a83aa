"""Per-file sha256 records of a checkpoint (kept in meta.json) and their verification when reading.

This catches corruption (a flipped bit on disk, a truncated download, a half-copied file). meta.json's own sha256
is in seal.json (:mod:`.seal`); whoever can replace all the files can rewrite both, which only the authority's
signature in the seal (checked when the reader is given the run's authority key) rules out.
"""

from __future__ import annotations

import hashlib
import os
from typing import Any, Dict, Iterable


class CheckpointIntegrityError(ValueError):
    """A checkpoint file does not match the sha256 (or size) recorded in its meta.json."""


def file_sha256(path: str, chunk_bytes: int = 1 << 22) -> str:
    """Hex sha256 of a local file, read in chunks (a checkpoint may not fit in memory twice)."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(chunk_bytes):
            digest.update(chunk)
    return digest.hexdigest()


def record_files(directory: str, names: Iterable[str]) -> Dict[str, Dict[str, Any]]:
    """{name: {"sha256": hex, "bytes": size}} of the files ``names`` inside ``directory``."""
    record = {}
    for name in names:
        path = os.path.join(directory, name)
        record[name] = dict(sha256=file_sha256(path), bytes=os.path.getsize(path))
    return record


def verify_files(directory: str, record: Any, names: Iterable[str], source: str) -> None:
    """Check the files ``names`` inside ``directory`` against ``record`` (from :func:`record_files`).

    Args:
        directory: local directory holding the files.
        record: the "files" entry of meta.json (validated here: it comes from disk or a remote store).
        names: the files that must be recorded and match.
        source: where the checkpoint came from, for error messages.
    Raises CheckpointIntegrityError naming the first file that is missing from the record or differs.
    """
    names = list(names)
    if not isinstance(record, dict):
        raise CheckpointIntegrityError(f"Checkpoint {source}: meta.json records no sha256 of its files {names}")
    for name in names:
        expected = record.get(name)
        if not isinstance(expected, dict) or not isinstance(expected.get("sha256"), str):
            raise CheckpointIntegrityError(f"Checkpoint {source}: meta.json records no sha256 of {name}")
        size = os.path.getsize(os.path.join(directory, name))
        if size != expected.get("bytes"):
            raise CheckpointIntegrityError(
                f"Checkpoint {source}: {name} has {size} bytes, meta.json records {expected.get('bytes')}: "
                f"the file is truncated or was replaced; refusing to load it"
            )
        actual = file_sha256(os.path.join(directory, name))
        if actual != expected["sha256"]:
            raise CheckpointIntegrityError(
                f"Checkpoint {source}: {name} has sha256 {actual}, meta.json records {expected['sha256']}: "
                f"the file is corrupt or was replaced; refusing to load it"
            )
