"""Data for the DALL-E recipe: image-code rows streamed from parquet shards or a Hub dataset.

Rows have the schema of laion/laion_100m_vqgan_f8: `caption: str` and `code: bytes` (little-endian int16
image codes of a row-major grid), plus optional metadata (`NSFW`, `original_width`, `original_height`).
Nothing is downloaded as a whole: `datasets` streams the rows, a shuffle buffer mixes them (each peer with
its own seed), and bad rows and bad shards (corrupt, empty, not parquet: see `recipes.dalle.shards`) are
skipped and counted instead of crashing a run that may last for weeks.
"""

from __future__ import annotations

import itertools
import logging
import multiprocessing
import secrets
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import torch
from lightning.pytorch import LightningDataModule
from torch.utils.data import DataLoader, IterableDataset, get_worker_info

from recipes.rows import decode_code, encode_code, write_parquet_shard  # noqa: F401 (public API)
from recipes.dalle.shards import BAD_SHARD_KEY, SHARD_SKIP_REASONS, ShardCheck, stream_shards
from recipes.dalle.tokenizer import TextTokenizer

log = logging.getLogger(__name__)

SHAPES_CACHE_DIR = Path("~/.cache/lightning_swarm/shapes-v2")  # v2: shards carry page checksums
# a DataLoader worker gives up after this many passes in a row over its share of the shards kept no row
MAX_EMPTY_PASSES_PER_WORKER = 20
SKIP_REASONS = ("caption", "nsfw", "aspect_ratio", "code_type", "code_bytes", "code_length", "code_range")


class SkipCounters:
    """Counts of skipped rows (and shards, row groups) per reason, shared with DataLoader worker processes."""

    def __init__(self):
        self._values = {reason: multiprocessing.Value("q", 0) for reason in SKIP_REASONS + SHARD_SKIP_REASONS}

    def add(self, reason: str) -> None:
        with self._values[reason].get_lock():
            self._values[reason].value += 1

    def as_dict(self) -> dict[str, int]:
        return {reason: value.value for reason, value in self._values.items()}


class RowFilter:
    """Decides whether a row is usable and why not.

    Args:
        num_codes: codes per image (grid * grid).
        codebook_size: codes must lie in [0, codebook_size).
        min_caption_length: shorter captions (after stripping) are skipped.
        max_aspect_ratio: rows whose original image was more elongated than this are skipped (needs the
            width and height columns; rows without them pass).
        width_column, height_column: metadata columns with the original image size.
        nsfw_column: metadata column with the NSFW label; rows whose label is not in `nsfw_allowed` are
            skipped (rows without it pass).
        nsfw_allowed: labels of rows to keep.
    """

    def __init__(
        self,
        num_codes: int,
        codebook_size: int,
        min_caption_length: int = 3,
        max_aspect_ratio: float | None = 2.0,
        width_column: str = "original_width",
        height_column: str = "original_height",
        nsfw_column: str = "NSFW",
        nsfw_allowed: tuple[str, ...] = ("UNLIKELY",),
    ):
        self.num_codes = num_codes
        self.codebook_size = codebook_size
        self.min_caption_length = min_caption_length
        self.max_aspect_ratio = max_aspect_ratio
        self.width_column, self.height_column = width_column, height_column
        self.nsfw_column, self.nsfw_allowed = nsfw_column, set(nsfw_allowed)

    def __call__(self, row: dict) -> tuple[str, np.ndarray] | str:
        """(caption, codes) of a good row, or the name of the reason to skip it."""
        caption = row.get("caption")
        if not isinstance(caption, str) or len(caption.strip()) < self.min_caption_length:
            return "caption"
        if row.get(self.nsfw_column) is not None and row[self.nsfw_column] not in self.nsfw_allowed:
            return "nsfw"
        width, height = row.get(self.width_column), row.get(self.height_column)
        if self.max_aspect_ratio is not None and width is not None and height is not None:
            if width <= 0 or height <= 0 or max(width / height, height / width) > self.max_aspect_ratio:
                return "aspect_ratio"
        data = row.get("code")
        if not isinstance(data, (bytes, bytearray, memoryview)):
            return "code_type"
        if len(data) % 2:
            return "code_bytes"
        if len(data) != 2 * self.num_codes:
            return "code_length"
        codes = decode_code(data)
        if codes.min() < 0 or codes.max() >= self.codebook_size:
            return "code_range"
        return caption, codes


class CaptionCodeStream(IterableDataset):
    """Batches {"text", "image", "caption"} from a streaming `datasets.IterableDataset` of rows.

    Args:
        rows: the streaming dataset (already shuffled if wanted); DataLoader workers split its shards.
        tokenizer: captions to text ids.
        row_filter: keeps good rows, names the reason for the others.
        counters: where skipped rows are counted.
        batch_size: rows per batch.
        cycle: start a new pass (reshuffled through `set_epoch`) when the stream ends, forever.
        max_batches: stop after this many batches (None: no limit).
        held_out: (caption, code) pairs of rows to leave out (validation rows taken from this stream).
    """

    def __init__(self, rows, tokenizer: TextTokenizer, row_filter: RowFilter, counters: SkipCounters,
                 batch_size: int, cycle: bool, max_batches: int | None = None, held_out: frozenset = frozenset()):
        super().__init__()
        self.rows, self.tokenizer, self.row_filter, self.counters = rows, tokenizer, row_filter, counters
        self.batch_size, self.cycle, self.max_batches, self.held_out = batch_size, cycle, max_batches, held_out

    def _collate(self, captions: list[str], codes: list[np.ndarray]) -> dict:
        return {
            "text": self.tokenizer(captions),
            "image": torch.from_numpy(np.stack(codes)),
            "caption": captions,
        }

    @staticmethod
    def _one_of_several_workers() -> bool:
        """In one of several DataLoader workers, a pass covers only this worker's share of the shards, which
        `datasets` deals out anew each pass: a share with nothing usable does not mean the data has none
        (DALLEDataModule.setup checked that the whole stream has a readable shard)."""
        worker = get_worker_info()
        return worker is not None and worker.num_workers > 1

    def __iter__(self) -> Iterator[dict]:
        captions, codes, num_batches, epoch, empty_passes = [], [], 0, 0, 0
        while True:
            if hasattr(self.rows, "set_epoch"):
                self.rows.set_epoch(epoch)
            kept, skipped, shard_check = 0, {}, ShardCheck()
            for row in self.rows:
                if shard_check.is_skip(row):
                    reason = row[BAD_SHARD_KEY]
                    log.warning(f"skipping {reason.replace('_', ' ')} {row['shard']}: {row['error']}")
                    self.counters.add(reason)
                    skipped[reason] = skipped.get(reason, 0) + 1
                    continue
                if self.held_out and (row.get("caption"), row.get("code")) in self.held_out:
                    continue
                result = self.row_filter(row)
                if isinstance(result, str):
                    if not sum(self.counters.as_dict()[reason] for reason in SKIP_REASONS):
                        log.warning(f"skipping a bad row ({result}); further skips are counted in datamodule.skipped")
                    self.counters.add(result)
                    skipped[result] = skipped.get(result, 0) + 1
                    continue
                kept += 1
                captions.append(result[0])
                codes.append(result[1])
                if len(captions) == self.batch_size:
                    yield self._collate(captions, codes)
                    captions, codes, num_batches = [], [], num_batches + 1
                    if self.max_batches is not None and num_batches >= self.max_batches:
                        return
            if skipped:
                log.warning(f"pass {epoch} over the data kept {kept} rows and skipped {skipped}")
            in_a_worker = self._one_of_several_workers()
            if not in_a_worker:
                shard_check.raise_if_nothing_read()
            if not self.cycle:
                if captions:
                    yield self._collate(captions, codes)
                return
            empty_passes = empty_passes + 1 if kept == 0 else 0
            if empty_passes and in_a_worker and empty_passes < MAX_EMPTY_PASSES_PER_WORKER:
                log.warning(f"pass {epoch} over this DataLoader worker's share of the shards kept no row; "
                            "going on with the next pass (the shards are dealt out anew)")
            elif empty_passes:
                shard_check.raise_if_nothing_read()
                raise ValueError(f"a whole pass over the training data yielded no usable row (skipped: {skipped}); "
                                 "check image_grid_size, codebook_size, the caption/code columns, and that "
                                 "the data has more rows than num_val_rows (taken for validation)")
            epoch += 1


class DALLEDataModule(LightningDataModule):
    """Streams (caption, image codes) rows for DALL-E training; never downloads a whole dataset.

    Data source, in order of precedence: local parquet files (`train_files`, `val_files`), a Hub dataset
    (`dataset_name`), or, with neither, the embedded shapes dataset written to `data_dir` on first use
    (so a fresh offline machine can train). Batches: {"text": LongTensor[B, text_seq_len],
    "image": LongTensor[B, image_grid_size**2], "caption": list[str]}.

    Args:
        train_files: glob(s) of local (or fsspec URL) parquet files with training rows.
        val_files: glob(s) of parquet files with validation rows; if None, validation takes the first
            `num_val_rows` rows of the training stream (kept in memory) and training leaves them out.
        dataset_name: Hub dataset name (e.g. "laion/laion_100m_vqgan_f8") or a local dataset directory.
        dataset_config: the Hub dataset's configuration name, if it has several.
        train_split: split of `dataset_name` to train on.
        val_split: split of `dataset_name` to validate on; if None, the first `num_val_rows` rows of
            `train_split` (unshuffled, kept in memory), which training then leaves out.
        num_val_rows: validation rows taken from the training stream when no validation source is given.
        data_dir: where the embedded shapes dataset is written when no source is given, in a subfolder
            per row count (default ~/.cache/lightning_swarm/shapes-v2).
        num_shapes_train: training rows of the embedded shapes dataset.
        num_shapes_val: validation rows of the embedded shapes dataset.
        shapes_pair_fraction: share of two-shape rows in the embedded dataset's training split (its validation
            split always holds half, so validation losses and evaluations compare across values).
        text_seq_len: text ids per caption (CLIP BPE, 0-padded, cut captions end with end-of-text).
        image_grid_size: codes per image row; each `code` must hold image_grid_size**2 codes.
        codebook_size: rows with a code outside [0, codebook_size) are skipped.
        batch_size: rows per batch on this peer.
        shuffle_buffer: rows held in the shuffle buffer (bigger mixes better, costs memory).
        seed: shuffle seed of this peer. Every peer of a swarm should use a different one, or they all
            see the same rows in the same order; None picks a random seed and logs it.
        num_workers: DataLoader worker processes for training (at most the number of shards are used);
            validation always reads in the main process.
        max_val_batches: validate on at most this many batches (None: the whole validation source).
        cycle: restart the training stream, reshuffled, when it ends (training stops by max_steps).
        min_caption_length: rows with a shorter caption are skipped.
        max_aspect_ratio: rows whose original image is more elongated than this are skipped (None: keep).
        width_column: metadata column with the original image width (filter applies only if present).
        height_column: metadata column with the original image height.
        nsfw_column: metadata column with the NSFW label (filter applies only if present).
        nsfw_allowed: NSFW labels of rows to keep.
    """

    def __init__(
        self,
        train_files: str | list[str] | None = None,
        val_files: str | list[str] | None = None,
        dataset_name: str | None = None,
        dataset_config: str | None = None,
        train_split: str = "train",
        val_split: str | None = None,
        num_val_rows: int = 1024,
        data_dir: str | None = None,
        num_shapes_train: int = 20000,
        num_shapes_val: int = 1000,
        shapes_pair_fraction: float = 0.5,
        text_seq_len: int = 32,
        image_grid_size: int = 16,
        codebook_size: int = 8,
        batch_size: int = 32,
        shuffle_buffer: int = 4096,
        seed: int | None = None,
        num_workers: int = 0,
        max_val_batches: int | None = None,
        cycle: bool = True,
        min_caption_length: int = 3,
        max_aspect_ratio: float | None = 2.0,
        width_column: str = "original_width",
        height_column: str = "original_height",
        nsfw_column: str = "NSFW",
        nsfw_allowed: tuple[str, ...] = ("UNLIKELY",),
    ):
        super().__init__()
        if train_files is not None and dataset_name is not None:
            raise ValueError("give either train_files (local parquet) or dataset_name (Hub), not both")
        if val_files is not None and train_files is None:
            raise ValueError("val_files needs train_files as well")
        for name, value in (("text_seq_len", text_seq_len), ("image_grid_size", image_grid_size),
                            ("codebook_size", codebook_size), ("batch_size", batch_size)):
            if value < 1:
                raise ValueError(f"{name} must be >= 1, got {value}")
        if not 0.0 <= shapes_pair_fraction <= 1.0:
            raise ValueError(f"shapes_pair_fraction must lie in [0, 1], got {shapes_pair_fraction}")
        self.save_hyperparameters()
        if seed is None:
            seed = secrets.randbits(31)
            log.warning(f"DALLEDataModule: no data seed given, using seed={seed} (set data.seed to reproduce)")
        self.seed = self.hparams.seed = seed  # the seed in use is what hyperparameter logs show
        self.tokenizer = TextTokenizer(text_seq_len)
        self.row_filter = RowFilter(
            image_grid_size**2, codebook_size, min_caption_length, max_aspect_ratio,
            width_column, height_column, nsfw_column, tuple(nsfw_allowed),
        )
        self.counters = SkipCounters()
        self._train_rows = self._val_rows = None
        self._held_out = frozenset()  # (caption, code) of validation rows taken from the training stream

    @property
    def skipped(self) -> dict[str, int]:
        """Rows, shards and row groups skipped so far, per reason (summed over DataLoader workers; a bad shard
        counts again on every pass over the data)."""
        return self.counters.as_dict()

    @property
    def uses_shapes(self) -> bool:
        return self.hparams.train_files is None and self.hparams.dataset_name is None

    @property
    def shapes_dir(self) -> Path:
        """Folder of the embedded shapes shards; one per row count and mix, so peers sharing a cache never clash."""
        root = Path(self.hparams.data_dir or SHAPES_CACHE_DIR).expanduser()
        name = f"rows-{self.hparams.num_shapes_train}-{self.hparams.num_shapes_val}"
        if self.hparams.shapes_pair_fraction != 0.5:  # the default keeps the folder of earlier versions
            name += f"-pairs{self.hparams.shapes_pair_fraction:g}"
        return root / name

    def prepare_data(self) -> None:
        """Write the embedded shapes dataset on first use (only when no data source is configured)."""
        if not self.uses_shapes:
            return
        from recipes.shapes import GRID_SIZE, PALETTE, write_shapes_dataset

        if self.hparams.image_grid_size != GRID_SIZE or self.hparams.codebook_size < len(PALETTE):
            raise ValueError(f"the embedded shapes data needs image_grid_size={GRID_SIZE} and "
                             f"codebook_size>={len(PALETTE)}; set them or give train_files/dataset_name")
        done = self.shapes_dir / "DONE"
        if done.exists():
            return
        log.warning(f"writing the embedded shapes dataset to {self.shapes_dir}")
        # shards are written atomically and deterministically, so two peers doing this at once is harmless
        write_shapes_dataset(self.shapes_dir, self.hparams.num_shapes_train, self.hparams.num_shapes_val,
                             train_pair_fraction=self.hparams.shapes_pair_fraction)
        done.touch()

    def setup(self, stage: str | None = None) -> None:
        hp = self.hparams
        if self.uses_shapes:
            self.prepare_data()  # no-op when done; covers setups that skip prepare_data
            train_files = str(self.shapes_dir / "train-*.parquet")
            val_files = str(self.shapes_dir / "validation-*.parquet")
        else:
            train_files, val_files = hp.train_files, hp.val_files
        if train_files is not None:
            train = self._load_parquet(train_files)
            val = self._load_parquet(val_files) if val_files is not None else None
        else:
            train = self._load_named(hp.train_split)
            val = self._load_named(hp.val_split) if hp.val_split is not None else None
        train = self._select_columns(train)
        self._held_out = frozenset()
        # bad shards are dropped here (training counts and logs them) and a stream without one readable shard
        # is refused now, before DataLoader workers split the shards among themselves
        shard_check = ShardCheck()
        good_rows = (row for row in train if not shard_check.is_skip(row))
        if val is None:
            # The first rows of the (unshuffled) stream validate; training excludes them by content. Not
            # train.skip(n): with skip, datasets stops shuffling the shard order, and every peer of a swarm
            # would then read the shards in the same order.
            if hp.num_val_rows < 1:
                raise ValueError("no validation source: give val_files/val_split or num_val_rows >= 1")
            val = list(itertools.islice(good_rows, hp.num_val_rows))
            self._held_out = frozenset((row.get("caption"), row.get("code")) for row in val)
        else:
            next(good_rows, None)
            val = self._select_columns(val)
        shard_check.raise_if_nothing_read()
        # max_buffer_input_shards=1: datasets 5.x fills the buffer from several shards through a thread pool
        # whose shutdown can deadlock when Lightning restarts the stream; shard order is still shuffled.
        self._train_rows = train.shuffle(seed=self.seed, buffer_size=hp.shuffle_buffer, max_buffer_input_shards=1)
        self._val_rows = val

    def _load_parquet(self, files: str | list[str]):
        """Rows of local or fsspec parquet shards; a bad shard is skipped, not fatal (see recipes.dalle.shards)."""
        f = self.row_filter
        return stream_shards(files, ("caption", "code", f.nsfw_column, f.width_column, f.height_column))

    def _load_named(self, split: str):
        """A split of `dataset_name`: a parquet dataset (e.g. laion/laion_100m_vqgan_f8, or a local folder of
        shards) streams its files through `_load_parquet`, so bad shards are skipped; other formats
        stream with their `datasets` builder."""
        import datasets

        hp = self.hparams
        builder = datasets.load_dataset_builder(hp.dataset_name, hp.dataset_config)
        data_files = getattr(builder.config, "data_files", None)
        if builder.name == "parquet" and data_files and split in data_files:
            return self._load_parquet(list(data_files[split]))
        return datasets.load_dataset(hp.dataset_name, hp.dataset_config, split=split, streaming=True)

    def _select_columns(self, rows):
        """Decode only the columns the filters read (parquet reads columns separately)."""
        if rows.features is None:
            return rows
        f = self.row_filter
        wanted = ["caption", "code", f.nsfw_column, f.width_column, f.height_column]
        present = [name for name in wanted if name in rows.features]
        return rows.select_columns(present)

    def _loader(self, rows, cycle: bool, max_batches: int | None, num_workers: int,
                held_out: frozenset = frozenset()) -> DataLoader:
        if rows is None:
            raise RuntimeError("call datamodule.setup() first")
        stream = CaptionCodeStream(rows, self.tokenizer, self.row_filter, self.counters,
                                   self.hparams.batch_size, cycle, max_batches, held_out)
        return DataLoader(stream, batch_size=None, num_workers=num_workers, persistent_workers=num_workers > 0)

    def train_dataloader(self) -> DataLoader:
        return self._loader(self._train_rows, self.hparams.cycle, None, self.hparams.num_workers, self._held_out)

    def val_dataloader(self) -> DataLoader:
        # validation reads in this process: it is short, and max_val_batches then counts all batches
        return self._loader(self._val_rows, False, self.hparams.max_val_batches, num_workers=0)

    def teardown(self, stage: str | None = None) -> None:
        skipped = {reason: count for reason, count in self.skipped.items() if count}
        if skipped:
            log.warning(f"DALLEDataModule skipped rows, shards and row groups: {skipped}")
