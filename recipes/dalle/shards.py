"""Stream rows from parquet shards with `datasets`, so that one bad shard cannot end a run.

`datasets.load_dataset("parquet", streaming=True)` stops the whole stream at the first shard it cannot read:
a corrupt Brotli page raises OSError (its `on_bad_files` option only covers ArrowInvalid and ValueError),
and every later good shard is lost with it. Here each shard is read on its own, inside a
`datasets.IterableDataset.from_generator` stream (shard order shuffling, `set_epoch` and the split of shards
between DataLoader workers stay those of `datasets`), and a shard that cannot be read is skipped:

- "unreadable_shard": not a parquet file (bad magic bytes, truncated footer), missing the `caption` or
  `code` column, or not openable;
- "empty_shard": 0 bytes, or 0 rows;
- "corrupt_row_group": a page fails its CRC checksum (`page_checksum_verification=True`; shards written by
  `recipes.rows.write_parquet_shard` carry page checksums) or fails to decompress. The row group's
  remaining rows are skipped and reading goes on with the next row group, so a flipped bit costs at most
  one row group, never garbage codes trained on.

Each skipped shard or row group comes out of the stream as one marker row `{BAD_SHARD_KEY: reason,
"shard": path, "error": message}`, which the consumer counts and logs (`datasets` hashes the generator's
arguments, so a shared counter cannot travel with it). A pass over a stream in which every shard fails is
an error (`ShardCheck`, `NoReadableShardError`), not an empty epoch.
"""

from __future__ import annotations

import glob
import logging
import os
from collections.abc import Iterator

import pyarrow as pa
import pyarrow.parquet as pq

log = logging.getLogger(__name__)

BAD_SHARD_KEY = "__bad_shard__"
SHARD_SKIP_REASONS = ("unreadable_shard", "empty_shard", "corrupt_row_group")
REQUIRED_COLUMNS = ("caption", "code")
BATCH_ROWS = 256  # rows decoded at a time inside a row group (a row group can hold a whole shard)


class NoReadableShardError(ValueError):
    """Every shard of a stream failed to read."""


def resolve_shards(files: str | list[str]) -> list[str]:
    """Sorted shard paths of local glob patterns (with `~`) or fsspec URLs (globs resolved by fsspec).

    Raises ValueError naming a pattern that matches nothing.
    """
    patterns = [files] if isinstance(files, str) else list(files)
    resolved = []
    for pattern in patterns:
        if "://" in pattern and not any(char in pattern for char in "*?["):
            matches = [pattern]  # a remote file named outright: no listing request per file
        elif "://" in pattern:
            import fsspec

            fs, path = fsspec.core.url_to_fs(pattern)
            matches = sorted(fs.unstrip_protocol(match) for match in fs.glob(path))
        else:
            matches = sorted(glob.glob(os.path.expanduser(pattern)))
        if not matches:
            raise ValueError(f"no parquet file matches {pattern!r}")
        resolved.extend(matches)
    return resolved


def _open(shard: str):
    if "://" in shard:
        import fsspec

        return fsspec.open(shard, "rb").open()
    return open(shard, "rb")


def _problem(reason: str, shard: str, error: BaseException | str) -> dict:
    message = error if isinstance(error, str) else f"{type(error).__name__}: {error}"
    return {BAD_SHARD_KEY: reason, "shard": shard, "error": message}


def read_shard(shard: str, columns: tuple[str, ...]) -> Iterator[dict]:
    """Rows (dicts of the wanted `columns` the shard has) of one parquet shard, then marker rows for
    what was skipped. Never raises for bad data."""
    try:
        with _open(shard) as file:
            try:
                parquet = pq.ParquetFile(file, page_checksum_verification=True)
            except (pa.ArrowInvalid, OSError) as error:
                empty = "size is 0 bytes" in str(error)
                yield _problem("empty_shard" if empty else "unreadable_shard", shard, error)
                return
            names = parquet.schema_arrow.names
            missing = [name for name in REQUIRED_COLUMNS if name not in names]
            if missing:
                yield _problem("unreadable_shard", shard, f"no column {missing} (has {names})")
                return
            if parquet.metadata.num_rows == 0:
                yield _problem("empty_shard", shard, "0 rows")
                return
            present = [name for name in columns if name in names]
            for row_group in range(parquet.num_row_groups):
                try:
                    for batch in parquet.iter_batches(BATCH_ROWS, row_groups=[row_group], columns=present):
                        yield from batch.to_pylist()
                except (pa.ArrowException, OSError) as error:  # CRC mismatch, bad compression, bad encoding
                    yield _problem("corrupt_row_group", shard, f"row group {row_group}: {type(error).__name__}: "
                                                               f"{error}")
    except OSError as error:  # the file itself cannot be opened or read
        yield _problem("unreadable_shard", shard, error)


def read_shards(shards: list[str], columns: tuple[str, ...]) -> Iterator[dict]:
    """Rows of `shards` in order (see `read_shard`): the generator of `stream_shards`. `datasets` splits
    and shuffles the `shards` list, and calls this once per shard."""
    for shard in shards:
        yield from read_shard(shard, columns)


class ShardCheck:
    """Watches one pass over a stream of rows and marker rows: rows read, and what was skipped.

    `is_skip(row)` tells marker rows apart (and notes them); `raise_if_nothing_read()` raises
    NoReadableShardError at the end of a pass in which shards were skipped and not one row was read.
    """

    def __init__(self):
        self.rows_read = self.num_skipped = 0
        self.first_skipped: list[dict] = []  # a few, for the error message

    def is_skip(self, row: dict) -> bool:
        if BAD_SHARD_KEY not in row:
            self.rows_read += 1
            return False
        self.num_skipped += 1
        if len(self.first_skipped) < 5:
            self.first_skipped.append(row)
        return True

    @property
    def nothing_read(self) -> bool:
        """Shards were skipped and not one row was read."""
        return self.num_skipped > 0 and self.rows_read == 0

    def describe(self) -> str:
        return "; ".join(f"{p['shard']}: {p[BAD_SHARD_KEY]} ({p['error']})" for p in self.first_skipped)

    def raise_if_nothing_read(self) -> None:
        if not self.nothing_read:
            return
        raise NoReadableShardError(
            f"every parquet shard of this stream failed to read ({self.num_skipped} shards or row groups "
            f"skipped, not one row read), so there is nothing to train on. Check the files, e.g. with "
            f"pyarrow.parquet.ParquetFile. First: {self.describe()}"
        )


def stream_shards(files: str | list[str], columns: tuple[str, ...]):
    """A streaming `datasets.IterableDataset` of the rows of the parquet `files` (glob patterns or URLs).

    Args:
        files: glob(s) of local parquet files, or fsspec URLs (globs allowed).
        columns: columns to read, where a shard has them (`caption` and `code` are required).
    """
    import datasets

    shards = resolve_shards(files)
    return datasets.IterableDataset.from_generator(
        read_shards, gen_kwargs={"shards": shards, "columns": tuple(columns)}
    )
