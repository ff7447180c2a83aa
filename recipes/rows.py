"""The row format of image-code datasets (laion/laion_100m_vqgan_f8 and the embedded shapes data).

`code` cells hold little-endian int16 image codes of a row-major grid; shards are Brotli parquet files
with a CRC checksum on every page (readers verify them: see `recipes.dalle.shards`).
Kept free of heavy imports so that writing shards (e.g. `python -m recipes.shapes`) starts fast.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

# rows per row group: the unit a reader skips when a page inside fails its checksum or to decompress
ROW_GROUP_ROWS = 1024


def encode_code(codes: np.ndarray) -> bytes:
    """Image codes (any shape, row-major) as little-endian int16 bytes, the `code` column's format."""
    codes = np.asarray(codes)
    if codes.size and (codes.min() < np.iinfo(np.int16).min or codes.max() > np.iinfo(np.int16).max):
        raise ValueError("codes do not fit in int16")
    return codes.astype("<i2").tobytes()


def decode_code(data: bytes) -> np.ndarray:
    """Flat int64 array of the codes in a `code` cell (little-endian int16 bytes)."""
    if len(data) % 2:
        raise ValueError(f"code has an odd number of bytes ({len(data)}); expected little-endian int16")
    return np.frombuffer(data, dtype="<i2").astype(np.int64)


def write_parquet_shard(path: str | os.PathLike, columns: dict[str, list]) -> None:
    """Write one parquet shard (Brotli, page checksums, row groups of ROW_GROUP_ROWS rows) atomically: to a
    temporary name in the same folder, then renamed, so a reader (or a second peer writing the same cache)
    never sees half a file."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    table = pa.table(columns)
    with tempfile.NamedTemporaryFile(dir=path.parent, suffix=".tmp", delete=False) as tmp:
        pq.write_table(table, tmp.name, compression="brotli", write_page_checksum=True,
                       row_group_size=ROW_GROUP_ROWS)
    os.chmod(tmp.name, 0o644)
    os.replace(tmp.name, path)
