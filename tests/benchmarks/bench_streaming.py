"""Throughput of the streaming DALLEDataModule on one core: rows/s from Brotli parquet shards to batches.

Writes LAION-like shards to a temporary folder (captions of 5-20 Zipf-distributed pseudo-words, random
int16 codes of a 32x32 grid = 1024 codes per row, and of a 16x16 grid = 256 codes), then times the
training DataLoader (num_workers=0, torch threads 1): parquet decoding, shuffle buffer, row checks,
CLIP BPE tokenization and collation. It also times the bare `datasets` stream, to show what the rest costs.

    python tests/benchmarks/bench_streaming.py [--rows 4000] [--batch-size 64]
"""

from __future__ import annotations

import argparse
import logging
import string
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from recipes.dalle.data import DALLEDataModule, encode_code, write_parquet_shard


def write_laion_like_shards(folder: Path, grid: int, rows: int, shards: int, seed: int = 0) -> None:
    rng = np.random.default_rng(seed)
    letters = np.array(list(string.ascii_lowercase))
    vocabulary = ["".join(rng.choice(letters, size=rng.integers(2, 10))) for _ in range(5000)]
    zipf_weights = 1.0 / np.arange(1, len(vocabulary) + 1)
    zipf_weights /= zipf_weights.sum()
    rows_per_shard = rows // shards
    for shard in range(shards):
        captions, codes = [], []
        for _ in range(rows_per_shard):
            words = rng.choice(len(vocabulary), size=rng.integers(5, 21), p=zipf_weights)
            captions.append(" ".join(vocabulary[w] for w in words))
            codes.append(encode_code(rng.integers(0, 8192, size=grid * grid)))
        write_parquet_shard(folder / f"train-{shard:05d}-of-{shards:05d}.parquet", {"caption": captions, "code": codes})


def time_rows(iterable, count_rows) -> tuple[float, float]:
    """(rows per wall-clock second, rows per CPU second of this process). On a shared machine the second
    is the figure for one dedicated core (num_workers=0 keeps all the work in this process)."""
    wall, cpu, rows = time.perf_counter(), time.process_time(), 0
    for item in iterable:
        rows += count_rows(item)
    return rows / (time.perf_counter() - wall), rows / (time.process_time() - cpu)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=4000, help="rows written per grid size")
    parser.add_argument("--shards", type=int, default=4, help="parquet files per grid size")
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--shuffle-buffer", type=int, default=1024)
    args = parser.parse_args()
    torch.set_num_threads(1)
    logging.basicConfig(level=logging.ERROR)
    for grid in (32, 16):
        with tempfile.TemporaryDirectory() as folder:
            write_laion_like_shards(Path(folder), grid, args.rows, args.shards)
            size_mb = sum(p.stat().st_size for p in Path(folder).glob("*.parquet")) / 2**20
            datamodule = DALLEDataModule(
                train_files=f"{folder}/train-*.parquet", num_val_rows=args.batch_size, image_grid_size=grid,
                codebook_size=8192, text_seq_len=32, batch_size=args.batch_size,
                shuffle_buffer=args.shuffle_buffer, seed=0, cycle=False, num_workers=0,
            )
            datamodule.setup("fit")
            bare = time_rows(datamodule._train_rows, lambda row: 1)
            full = time_rows(datamodule.train_dataloader(), lambda batch: len(batch["caption"]))
            assert sum(datamodule.skipped.values()) == 0
            print(f"{grid}x{grid} = {grid * grid} codes/row, {args.rows} rows in {args.shards} Brotli shards "
                  f"({size_mb:.1f} MiB), num_workers=0, batch {args.batch_size}, buffer {args.shuffle_buffer}: "
                  f"DataModule {full[1]:,.0f} rows per CPU-second ({full[0]:,.0f} rows/s wall); "
                  f"bare datasets stream {bare[1]:,.0f} rows per CPU-second ({bare[0]:,.0f} rows/s wall)")


if __name__ == "__main__":
    main()
