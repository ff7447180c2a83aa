"""Bad parquet shards (corrupt pages, 0 bytes, 0 rows, not parquet) are skipped and counted, not fatal;
page checksums catch a flipped bit; a stream whose every shard is bad is a clear error."""

import itertools
import logging

import lightning.pytorch as pl
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from recipes.dalle.data import DALLEDataModule
from recipes.rows import ROW_GROUP_ROWS, write_parquet_shard
from recipes.dalle.shards import BAD_SHARD_KEY, NoReadableShardError, read_shard
from parquet_damage import flip_inside_code_chunk
from test_data import CODEBOOK, GRID, _rows


def write_bad_shards(folder) -> None:
    """One shard of each kind of problem: a corrupt Brotli page (a shard written elsewhere, without page
    checksums, so decompression is what fails), 0 bytes, 0 rows, and a text file named .parquet."""
    corrupt = folder / "train-corrupt.parquet"
    pq.write_table(pa.table(_rows(1000, 40)), corrupt, compression="brotli")
    flip_inside_code_chunk(corrupt, row_group=0, mask=0xFF, count=16)
    (folder / "train-zero-bytes.parquet").write_bytes(b"")
    write_parquet_shard(folder / "train-zero-rows.parquet",
                        {"caption": pa.array([], pa.string()), "code": pa.array([], pa.binary())})
    (folder / "train-not-parquet.parquet").write_text("caption,code\na red square,0101\n")


class CodeModel(pl.LightningModule):
    """Predicts each image code from its own embedding: enough to run real optimizer steps."""

    def __init__(self):
        super().__init__()
        self.layers = torch.nn.Sequential(torch.nn.Embedding(CODEBOOK, 4), torch.nn.Linear(4, CODEBOOK))

    def training_step(self, batch, batch_idx):
        logits = self.layers(batch["image"])
        return torch.nn.functional.cross_entropy(logits.flatten(0, 1), batch["image"].flatten())

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def test_training_goes_on_over_corrupt_empty_and_non_parquet_shards(tmp_path, caplog):
    for shard in range(2):
        write_parquet_shard(tmp_path / f"train-good-{shard}.parquet", _rows(shard * 20, 20))
    write_bad_shards(tmp_path)
    datamodule = DALLEDataModule(train_files=str(tmp_path / "train-*.parquet"), num_val_rows=8, text_seq_len=8,
                                 image_grid_size=GRID, codebook_size=CODEBOOK, batch_size=8, shuffle_buffer=16,
                                 seed=0, max_val_batches=1)
    trainer = pl.Trainer(max_steps=10, limit_val_batches=0, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, default_root_dir=tmp_path)
    with caplog.at_level(logging.WARNING, logger="recipes.dalle.data"):
        trainer.fit(CodeModel(), datamodule=datamodule)
    assert trainer.global_step == 10  # 80 rows from 32 training rows: several passes, each over the bad shards
    skipped = datamodule.skipped
    passes = skipped["corrupt_row_group"]
    assert passes >= 2 and skipped["empty_shard"] == 2 * passes and skipped["unreadable_shard"] == passes
    assert sum(skipped[reason] for reason in ("caption", "code_type", "code_length", "code_range")) == 0
    log = caplog.text
    assert "skipping corrupt row group" in log and "train-corrupt.parquet: row group 0: " in log
    assert "skipping empty shard" in log and "train-zero-bytes.parquet" in log and "0 rows" in log
    assert "skipping unreadable shard" in log and "magic bytes" in log
    assert "DALLEDataModule skipped rows, shards and row groups" in log  # the totals, at teardown


def test_a_flipped_bit_inside_a_page_is_caught_by_the_checksum(tmp_path):
    path = tmp_path / "train.parquet"
    rows = _rows(0, 3 * ROW_GROUP_ROWS)
    write_parquet_shard(path, rows)
    assert pq.ParquetFile(path).metadata.num_row_groups == 3
    flip_inside_code_chunk(path, row_group=1, mask=0x04)
    read = list(read_shard(str(path), ("caption", "code")))
    problems = [row for row in read if BAD_SHARD_KEY in row]
    assert len(problems) == 1 and problems[0][BAD_SHARD_KEY] == "corrupt_row_group"
    assert "row group 1" in problems[0]["error"] and "CRC checksum" in problems[0]["error"]
    good = [row for row in read if BAD_SHARD_KEY not in row]
    expected = [{"caption": c, "code": k} for c, k in zip(rows["caption"], rows["code"])]
    # row groups 0 and 2 come out intact and in full; nothing of row group 1 does
    assert good == expected[:ROW_GROUP_ROWS] + expected[2 * ROW_GROUP_ROWS:]


def test_a_stream_whose_every_shard_is_bad_is_a_clear_error(tmp_path):
    write_bad_shards(tmp_path)
    write_parquet_shard(tmp_path / "train-no-code.parquet", {"caption": ["a caption without codes"]})
    options = dict(train_files=str(tmp_path / "train-*.parquet"), image_grid_size=GRID, codebook_size=CODEBOOK,
                   batch_size=4, seed=0)
    message = r"every parquet shard of this stream failed to read \(5 shards or row groups skipped"
    with pytest.raises(NoReadableShardError, match=message):  # at setup, taking validation rows
        DALLEDataModule(**options).setup("fit")
    write_parquet_shard(tmp_path / "validation.parquet", _rows(0, 8))
    with pytest.raises(NoReadableShardError, match=message):  # also when validation has its own files
        DALLEDataModule(val_files=str(tmp_path / "validation.parquet"), **options).setup("fit")
    problems = list(read_shard(str(tmp_path / "train-no-code.parquet"), ("caption", "code")))
    assert problems[0][BAD_SHARD_KEY] == "unreadable_shard" and "no column ['code']" in problems[0]["error"]


def test_a_bad_shard_in_a_dataset_folder_given_by_name_is_skipped(tmp_path):
    write_parquet_shard(tmp_path / "train-00000-of-00002.parquet", _rows(0, 12))
    (tmp_path / "train-00001-of-00002.parquet").write_bytes(b"PAR1 truncated")
    datamodule = DALLEDataModule(dataset_name=str(tmp_path), num_val_rows=4, image_grid_size=GRID,
                                 codebook_size=CODEBOOK, text_seq_len=8, batch_size=4, seed=0, cycle=False)
    datamodule.setup("fit")
    assert sum(len(batch["caption"]) for batch in datamodule.train_dataloader()) == 8
    assert datamodule.skipped["unreadable_shard"] == 1


def test_remote_shards_by_url_and_glob(tmp_path):
    import fsspec

    write_parquet_shard(tmp_path / "good.parquet", _rows(0, 12))
    fs, root = fsspec.filesystem("memory"), f"/shards-{id(tmp_path)}"
    fs.pipe_file(f"{root}/train-0.parquet", (tmp_path / "good.parquet").read_bytes())
    fs.pipe_file(f"{root}/train-1.parquet", b"")
    for files in (f"memory://{root}/train-*.parquet", [f"memory://{root}/train-0.parquet",
                                                       f"memory://{root}/train-1.parquet"]):
        datamodule = DALLEDataModule(train_files=files, num_val_rows=4, image_grid_size=GRID, codebook_size=CODEBOOK,
                                     text_seq_len=8, batch_size=4, seed=0, cycle=False)
        datamodule.setup("fit")
        assert sum(len(batch["caption"]) for batch in datamodule.train_dataloader()) == 8
        assert datamodule.skipped["empty_shard"] == 1


def test_a_worker_whose_share_of_shards_all_fail_goes_on_with_its_next_pass(tmp_path):
    write_parquet_shard(tmp_path / "train-0.parquet", _rows(0, 12))
    (tmp_path / "train-1.parquet").write_text("not parquet")
    write_parquet_shard(tmp_path / "validation.parquet", _rows(100, 4))
    datamodule = DALLEDataModule(train_files=str(tmp_path / "train-*.parquet"), image_grid_size=GRID,
                                 val_files=str(tmp_path / "validation.parquet"), codebook_size=CODEBOOK,
                                 text_seq_len=8, batch_size=4, seed=0, num_workers=2)  # one shard per worker
    datamodule.setup("fit")
    batches = list(itertools.islice(datamodule.train_dataloader(), 12))  # 4 passes over the good shard
    assert len(batches) == 12 and all(int(c.rsplit(" ", 1)[1]) < 12 for b in batches for c in b["caption"])
    assert datamodule.skipped["unreadable_shard"] >= 1  # the worker dealt the bad shard went on with its next pass
