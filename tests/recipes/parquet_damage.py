"""Damage parquet shards the way disks and networks do, to test that readers notice."""

import pyarrow.parquet as pq
import pytest


def flip_inside_code_chunk(path, row_group: int, mask: int, count: int = 1) -> None:
    """XOR `count` bytes just before the end of the `code` column's chunk in `row_group`: the compressed
    body of its last data page (a page's header comes first and is not covered by the checksum)."""
    chunk = pq.ParquetFile(path).metadata.row_group(row_group).column(1)
    end = (chunk.dictionary_page_offset or chunk.data_page_offset) + chunk.total_compressed_size
    with open(path, "r+b") as file:
        file.seek(end - 1 - count)
        damaged = bytes(byte ^ mask for byte in file.read(count))
        file.seek(end - 1 - count)
        file.write(damaged)


def assert_pages_carry_checksums(path) -> None:
    """A flipped bit in the shard's first `code` page makes a checksum-verifying read fail."""
    flip_inside_code_chunk(path, row_group=0, mask=0x04)
    with pytest.raises(OSError, match="CRC checksum verification failed"):
        pq.ParquetFile(path, page_checksum_verification=True).read_row_group(0)
