import numpy as np
import pytest
import torch

from recipes.dalle.data import DALLEDataModule, decode_code, encode_code, write_parquet_shard
from recipes.dalle.tokenizer import TextTokenizer

GRID = 4  # 16 codes per image keeps the shards tiny
CODEBOOK = 50


def _rows(start: int, count: int) -> dict[str, list]:
    """Rows whose caption names their index and whose codes all equal index % CODEBOOK."""
    return {
        "caption": [f"picture number {i}" for i in range(start, start + count)],
        "code": [encode_code(np.full(GRID * GRID, i % CODEBOOK)) for i in range(start, start + count)],
    }


def _write_shards(folder, prefix: str, num_shards: int, rows_per_shard: int) -> None:
    for shard in range(num_shards):
        rows = _rows(shard * rows_per_shard, rows_per_shard)
        write_parquet_shard(folder / f"{prefix}-{shard:05d}-of-{num_shards:05d}.parquet", rows)


def _datamodule(**kwargs) -> DALLEDataModule:
    options = dict(text_seq_len=8, image_grid_size=GRID, codebook_size=CODEBOOK, batch_size=8,
                   shuffle_buffer=64, seed=0, cycle=False)
    options.update(kwargs)
    datamodule = DALLEDataModule(**options)
    datamodule.prepare_data()
    datamodule.setup("fit")
    return datamodule


def _indices(loader, max_batches: int | None = None) -> list[int]:
    seen = []
    for number, batch in enumerate(loader):
        if max_batches is not None and number == max_batches:
            break
        seen += [int(caption.rsplit(" ", 1)[1]) for caption in batch["caption"]]
    return seen


def test_code_bytes_round_trip():
    codes = np.array([[0, 1, 16383], [-1, 7, 2]], dtype=np.int64)
    data = encode_code(codes)
    assert len(data) == 12 and data[:4] == b"\x00\x00\x01\x00"  # little-endian int16, row-major
    np.testing.assert_array_equal(decode_code(data), codes.ravel())
    with pytest.raises(ValueError, match="odd number of bytes"):
        decode_code(b"abc")
    with pytest.raises(ValueError, match="int16"):
        encode_code(np.array([40000]))


def test_tokenizer_pads_truncates_and_decodes():
    tokenizer = TextTokenizer(text_seq_len=6)
    ids = tokenizer(["a red circle", "one two three four five six seven eight"])
    assert ids.shape == (2, 6) and ids.dtype == torch.long
    assert ids.max() < tokenizer.vocab_size
    assert ids[0, 3] == tokenizer.eot_id and (ids[0, 4:] == 0).all()  # 3 words, end-of-text, pads
    assert ids[1, -1] == tokenizer.eot_id and (ids[1] != 0).all()  # cut, still ends with end-of-text
    assert tokenizer.decode(ids[0]) == "a red circle"
    assert tokenizer.decode(ids[1]) == "one two three four five"
    with pytest.raises(ValueError, match="text_seq_len"):
        TextTokenizer(1)


def test_streams_local_shards_in_shaped_batches(tmp_path):
    _write_shards(tmp_path, "train", num_shards=3, rows_per_shard=20)
    _write_shards(tmp_path, "validation", num_shards=1, rows_per_shard=12)
    datamodule = _datamodule(train_files=str(tmp_path / "train-*.parquet"),
                             val_files=[str(tmp_path / "validation-00000-of-00001.parquet")])
    batches = list(datamodule.train_dataloader())
    assert [len(b["caption"]) for b in batches] == [8] * 7 + [4]
    batch = batches[0]
    assert batch["text"].shape == (8, 8) and batch["text"].dtype == torch.long
    assert batch["image"].shape == (8, GRID * GRID) and batch["image"].dtype == torch.long
    for caption, text, image in zip(batch["caption"], batch["text"], batch["image"]):
        index = int(caption.rsplit(" ", 1)[1])
        # CLIP's BPE spells numbers digit by digit, so decoding puts spaces between the digits
        assert datamodule.tokenizer.decode(text).replace(" ", "") == caption.replace(" ", "")
        assert (image == index % CODEBOOK).all()
    assert sorted(_indices(batches)) == list(range(60))  # one pass sees every row once
    assert sorted(_indices(datamodule.val_dataloader())) == list(range(12))
    assert sum(datamodule.skipped.values()) == 0


def test_skips_and_counts_corrupted_rows(tmp_path):
    good = _rows(0, 10)
    bad_captions = [None, "", "ab", "   ", "wrong length", "odd bytes", "out of range", "negative", "no code"]
    bad_codes = [good["code"][0]] * 4 + [
        encode_code(np.zeros(GRID * GRID + 1)),
        b"\x01" * (2 * GRID * GRID - 1),
        encode_code(np.full(GRID * GRID, CODEBOOK)),
        encode_code(np.full(GRID * GRID, -3)),
        None,
    ]
    write_parquet_shard(tmp_path / "train.parquet",
                        {"caption": good["caption"] + bad_captions, "code": good["code"] + bad_codes})
    datamodule = _datamodule(train_files=str(tmp_path / "train.parquet"), num_val_rows=3)
    assert sorted(_indices(datamodule.train_dataloader())) == list(range(3, 10))  # first 3 went to validation
    assert sorted(_indices(datamodule.val_dataloader())) == [0, 1, 2]
    assert datamodule.skipped == {"caption": 4, "nsfw": 0, "aspect_ratio": 0, "code_type": 1,
                                  "code_bytes": 1, "code_length": 1, "code_range": 2,
                                  "unreadable_shard": 0, "empty_shard": 0, "corrupt_row_group": 0}


def test_metadata_filters(tmp_path):
    rows = _rows(0, 6)
    rows["NSFW"] = ["UNLIKELY", "NSFW", "UNLIKELY", "UNSURE", "UNLIKELY", None]
    rows["original_width"] = [100, 100, 500, 100, 100, 100]
    rows["original_height"] = [100, 100, 100, 200, 0, 100]
    write_parquet_shard(tmp_path / "train.parquet", rows)
    datamodule = _datamodule(train_files=str(tmp_path / "train.parquet"), val_files=str(tmp_path / "train.parquet"))
    assert sorted(_indices(datamodule.val_dataloader())) == [0, 5]
    assert datamodule.skipped["nsfw"] == 2 and datamodule.skipped["aspect_ratio"] == 2
    lenient = _datamodule(train_files=str(tmp_path / "train.parquet"), val_files=str(tmp_path / "train.parquet"),
                          nsfw_allowed=("UNLIKELY", "UNSURE"), max_aspect_ratio=None)
    assert sorted(_indices(lenient.val_dataloader())) == [0, 2, 3, 4, 5]


def test_per_peer_seed_changes_the_order(tmp_path):
    _write_shards(tmp_path, "train", num_shards=2, rows_per_shard=40)
    files = str(tmp_path / "train-*.parquet")
    first = _indices(_datamodule(train_files=files, seed=1, num_val_rows=8).train_dataloader())
    again = _indices(_datamodule(train_files=files, seed=1, num_val_rows=8).train_dataloader())
    other = _indices(_datamodule(train_files=files, seed=2, num_val_rows=8).train_dataloader())
    assert first == again and first != other and sorted(first) == sorted(other) == list(range(8, 80))


def test_peers_start_on_different_shards(tmp_path):
    # With shuffle_buffer=1 only the shard order mixes rows: peers must not all begin with the same shard,
    # also when validation rows were taken from the training stream.
    _write_shards(tmp_path, "train", num_shards=8, rows_per_shard=4)
    files = str(tmp_path / "train-*.parquet")
    first_shards = set()
    for seed in range(4):
        datamodule = _datamodule(train_files=files, seed=seed, num_val_rows=2, shuffle_buffer=1, batch_size=1)
        first_shards.add(_indices(datamodule.train_dataloader(), max_batches=1)[0] // 4)
    assert len(first_shards) > 1


def test_training_stream_cycles_with_fresh_shuffles(tmp_path):
    _write_shards(tmp_path, "train", num_shards=2, rows_per_shard=12)
    datamodule = _datamodule(train_files=str(tmp_path / "train-*.parquet"), num_val_rows=4, cycle=True)
    seen = _indices(datamodule.train_dataloader(), max_batches=10)  # 80 rows from a 20-row stream
    passes = [seen[i : i + 20] for i in range(0, 80, 20)]
    assert all(sorted(p) == list(range(4, 24)) for p in passes)
    assert len({tuple(p) for p in passes}) > 1  # each pass reshuffled


def test_worker_processes_share_skip_counts(tmp_path):
    for shard in range(2):
        rows = _rows(shard * 10, 10)
        rows["code"][0] = b"\x00"  # one odd-byte row per shard
        write_parquet_shard(tmp_path / f"train-{shard}.parquet", rows)
    datamodule = _datamodule(train_files=str(tmp_path / "train-*.parquet"),
                             val_files=str(tmp_path / "train-0.parquet"), num_workers=2)
    seen = _indices(datamodule.train_dataloader())
    assert sorted(seen) == sorted(set(range(20)) - {0, 10})
    assert datamodule.skipped["code_bytes"] == 2


def test_dataset_by_name_from_a_local_directory(tmp_path):
    _write_shards(tmp_path, "train", num_shards=2, rows_per_shard=10)
    _write_shards(tmp_path, "validation", num_shards=1, rows_per_shard=5)
    datamodule = _datamodule(dataset_name=str(tmp_path), val_split="validation")
    assert sorted(_indices(datamodule.train_dataloader())) == list(range(20))
    assert sorted(_indices(datamodule.val_dataloader())) == list(range(5))
    no_val_split = _datamodule(dataset_name=str(tmp_path), num_val_rows=6, max_val_batches=1, batch_size=4)
    assert len(_indices(no_val_split.val_dataloader())) == 4
    assert len(_indices(no_val_split.train_dataloader())) == 14


def test_embedded_shapes_dataset_when_no_source(tmp_path):
    datamodule = DALLEDataModule(data_dir=str(tmp_path / "shapes"), num_shapes_train=64, num_shapes_val=16,
                                 batch_size=16, seed=0, cycle=False, max_val_batches=1)
    datamodule.prepare_data()
    assert (tmp_path / "shapes" / "rows-64-16" / "train-00000-of-00001.parquet").exists()
    datamodule.setup("fit")
    batch = next(iter(datamodule.train_dataloader()))
    assert batch["text"].shape == (16, 32) and batch["image"].shape == (16, 256)
    assert 0 <= batch["image"].min() and batch["image"].max() < 8
    from recipes.shapes import check_caption

    assert all(check_caption(c, image) for c, image in zip(batch["caption"], batch["image"]))
    assert len(list(datamodule.val_dataloader())) == 1
    with pytest.raises(ValueError, match="image_grid_size=16"):
        DALLEDataModule(data_dir=str(tmp_path / "other"), image_grid_size=32).prepare_data()
    more_pairs = DALLEDataModule(data_dir=str(tmp_path / "shapes"), num_shapes_train=64, num_shapes_val=16,
                                 shapes_pair_fraction=0.75, seed=0)
    assert more_pairs.shapes_dir == tmp_path / "shapes" / "rows-64-16-pairs0.75"  # its own folder beside the default
    more_pairs.prepare_data()
    assert (more_pairs.shapes_dir / "DONE").exists()
    with pytest.raises(ValueError, match="shapes_pair_fraction"):
        DALLEDataModule(shapes_pair_fraction=-0.1)


def test_bad_configs_raise_clear_errors(tmp_path):
    with pytest.raises(ValueError, match="not both"):
        DALLEDataModule(train_files="a.parquet", dataset_name="laion/laion_100m_vqgan_f8")
    with pytest.raises(ValueError, match="no parquet file matches"):
        _datamodule(train_files=str(tmp_path / "missing-*.parquet"))
    write_parquet_shard(tmp_path / "train.parquet", _rows(0, 20))
    wrong_grid = _datamodule(train_files=str(tmp_path / "train.parquet"), image_grid_size=5, cycle=True,
                             num_val_rows=2)
    with pytest.raises(ValueError, match="no usable row"):
        next(iter(wrong_grid.train_dataloader()))
    assert wrong_grid.skipped["code_length"] == 18


def test_configurable_from_lightning_cli_yaml(tmp_path):
    from jsonargparse import ArgumentParser

    write_parquet_shard(tmp_path / "train.parquet", _rows(0, 20))
    parser = ArgumentParser()
    parser.add_class_arguments(DALLEDataModule, "data")
    config = parser.parse_string(
        f"data:\n  train_files: [{tmp_path}/train*.parquet]\n  image_grid_size: {GRID}\n  codebook_size: {CODEBOOK}\n"
        "  nsfw_allowed: [UNLIKELY, UNSURE]\n  seed: 5\n  num_val_rows: 4\n"
    )
    datamodule = parser.instantiate(config).data
    assert isinstance(datamodule, DALLEDataModule) and datamodule.seed == 5
    assert datamodule.row_filter.nsfw_allowed == {"UNLIKELY", "UNSURE"}


def test_feeds_a_lightning_trainer(tmp_path):
    import lightning.pytorch as pl

    class CountingModule(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.embedding = torch.nn.Embedding(CODEBOOK, 4)
            self.head = torch.nn.Linear(4, CODEBOOK)
            self.val_rows = 0

        def training_step(self, batch, batch_idx):
            assert batch["image"].shape == (8, GRID * GRID) and batch["text"].shape == (8, 8)
            logits = self.head(self.embedding(batch["image"]))
            return torch.nn.functional.cross_entropy(logits.flatten(0, 1), batch["image"].flatten())

        def validation_step(self, batch, batch_idx):
            self.val_rows += len(batch["caption"])

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    write_parquet_shard(tmp_path / "train.parquet", _rows(0, 30))
    datamodule = DALLEDataModule(train_files=str(tmp_path / "train.parquet"), num_val_rows=10, text_seq_len=8,
                                 image_grid_size=GRID, codebook_size=CODEBOOK, batch_size=8, shuffle_buffer=16,
                                 seed=0, max_val_batches=1)
    module = CountingModule()
    trainer = pl.Trainer(max_steps=12, val_check_interval=6, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, default_root_dir=tmp_path)
    trainer.fit(module, datamodule=datamodule)
    assert trainer.global_step == 12  # 96 rows from a 20-row training stream: it cycled
    assert module.val_rows == 8 * 2 + 8  # sanity check, then 2 validations of max_val_batches=1
