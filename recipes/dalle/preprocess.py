"""Encode image-text pairs into parquet shards of image codes (the laion/laion_100m_vqgan_f8 schema).

    python -m recipes.dalle.preprocess --folder photos/ --out shards/ \
        --codec vqgan --vqgan-config vqgan_gumbel_f8.yaml --vqgan-checkpoint last.ckpt
    python -m recipes.dalle.preprocess --tars 'laion/*.tar' --out shards/ --codec vqgan ...
    python -m recipes.dalle.preprocess --hf-dataset user/pairs --image-column image --codec palette ...

Pairs are filtered as the seed run did (caption of at least 3 characters, aspect ratio at most 2, NSFW
label "UNLIKELY" when the source has one), centre-cropped and resized to the codec's resolution,
encoded in batches, and written as Brotli parquet shards `{prefix}-{k:05d}.parquet` with the columns
`caption`, `code` (little-endian int16 codes, row-major grid), `original_width`, `original_height`,
`NSFW`, `url`, `key`. `recipes.dalle.data.DALLEDataModule(train_files="shards/*.parquet")` streams them.

Shard k always holds input pairs [k * rows_per_shard, (k+1) * rows_per_shard) before filtering, and is
written atomically (its `_stats/{shard}.json` last, as the mark of a finished shard; a shard whose
pairs were all dropped has no parquet file), so an interrupted run restarted with the same arguments
skips finished shards and produces the same rows. Corrupt or unreadable images and rows are skipped
and counted per reason (`{out}/_stats/{shard}.json`, summed in the final report).
"""

from __future__ import annotations

import argparse
import itertools
import json
import logging
import os
import tempfile
from collections import Counter, deque
from collections.abc import Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pyarrow as pa
import torch
from tqdm.auto import tqdm

from recipes.dalle.preprocess_sources import (SourceExample, iter_folder, iter_hf_dataset, iter_tar_shards,
                                              load_pil_image)
from recipes.rows import encode_code, write_parquet_shard

log = logging.getLogger(__name__)

STATS_DIR = "_stats"
# the reasons a pair is dropped, in the order the checks run
DROP_REASONS = ("corrupt_row", "short_caption", "nsfw", "corrupt_image", "aspect_ratio")
SCHEMA = pa.schema([("caption", pa.string()), ("code", pa.binary()), ("original_width", pa.int32()),
                    ("original_height", pa.int32()), ("NSFW", pa.string()), ("url", pa.string()),
                    ("key", pa.string())])


class PairFilter:
    """The seed's filters. Args: min_caption_length (after stripping), max_aspect_ratio (longer side /
    shorter side of the original image), nsfw_allowed (NSFW labels kept; pairs without a label pass)."""

    def __init__(self, min_caption_length: int = 3, max_aspect_ratio: float = 2.0,
                 nsfw_allowed: tuple[str, ...] = ("UNLIKELY",)):
        self.min_caption_length = min_caption_length
        self.max_aspect_ratio = max_aspect_ratio
        self.nsfw_allowed = set(nsfw_allowed)

    def check_text(self, example: SourceExample) -> str | None:
        """Reason to drop the pair before its image is decoded, or None."""
        if example.caption is None or example.image is None:
            return "corrupt_row"
        if len(example.caption.strip()) < self.min_caption_length:
            return "short_caption"
        nsfw = example.metadata.get("NSFW")
        if nsfw is not None and normalise_nsfw(nsfw) not in self.nsfw_allowed:
            return "nsfw"
        return None

    def check_size(self, width: int, height: int) -> str | None:
        if min(width, height) < 1 or max(width, height) / min(width, height) > self.max_aspect_ratio:
            return "aspect_ratio"
        return None


def normalise_nsfw(value) -> str:
    """LAION labels stay as they are ("UNLIKELY", "UNSURE", "NSFW"); boolean flags map onto them."""
    if isinstance(value, (bool, np.bool_)):
        return "NSFW" if value else "UNLIKELY"
    return str(value)


def center_crop_resize(image, size: int):
    """Resize the shorter side to `size` (bicubic, antialiased) and crop the centre square."""
    from PIL import Image

    width, height = image.size
    if (width, height) != (size, size):
        scale = size / min(width, height)
        new_size = (max(size, round(width * scale)), max(size, round(height * scale)))
        image = image.resize(new_size, Image.Resampling.BICUBIC, reducing_gap=3.0)
        left, top = (new_size[0] - size) // 2, (new_size[1] - size) // 2
        image = image.crop((left, top, left + size, top + size))
    return image


def _optional_str(value) -> str | None:
    return None if value is None else str(value)


def _positive_int(value) -> int | None:
    try:
        number = int(value)
    except (TypeError, ValueError, OverflowError):
        return None
    return number if number > 0 else None


def prepare_example(example: SourceExample, pair_filter: PairFilter, size: int):
    """(ByteTensor[3, size, size], row without `code`) of a usable pair, or the reason to drop it."""
    reason = pair_filter.check_text(example)
    if reason:
        return reason
    try:
        image = load_pil_image(example.image)
    except Exception as error:  # PIL raises many types for bad data (OSError, ValueError, SyntaxError...)
        log.debug(f"{example.key}: unreadable image ({type(error).__name__}: {error})")
        return "corrupt_image"
    # the source's original size when it records one (img2dataset stores resized images), else the file's;
    # checked before resizing, which would blow a 10000x1 strip up to 2560000x256 pixels
    width = _positive_int(example.metadata.get("original_width")) or image.size[0]
    height = _positive_int(example.metadata.get("original_height")) or image.size[1]
    reason = pair_filter.check_size(width, height) or pair_filter.check_size(*image.size)
    if reason:
        return reason
    pixels = np.asarray(center_crop_resize(image, size), dtype=np.uint8)
    tensor = torch.from_numpy(pixels.copy()).permute(2, 0, 1)  # uint8 until batched: 4x less memory in flight
    nsfw = example.metadata.get("NSFW")
    row = {"caption": example.caption.strip(), "original_width": width, "original_height": height,
           "NSFW": None if nsfw is None else normalise_nsfw(nsfw),
           "url": _optional_str(example.metadata.get("url")), "key": example.key}
    return tensor, row


def bounded_map(pool: ThreadPoolExecutor, fn, items: Iterable, max_in_flight: int) -> Iterator:
    """`pool.map(fn, items)` in order, but with at most `max_in_flight` results waiting: decoding runs
    ahead of the (slower) encoder without holding a whole shard of images in memory."""
    in_flight = deque()
    for item in items:
        in_flight.append(pool.submit(fn, item))
        if len(in_flight) >= max_in_flight:
            yield in_flight.popleft().result()
    while in_flight:
        yield in_flight.popleft().result()


class ShardEncoder:
    """Filters, decodes (in a thread pool) and encodes the pairs of one shard at a time.

    Args:
        codec: the image codec (`encode`, `image_size`).
        pair_filter: the filters.
        batch_size: images per `codec.encode` call.
        pool: threads that decode and resize images.
        num_workers: threads in `pool` (decoding runs at most 2 batches + that many pairs ahead).
        progress: progress bar over input pairs.
    """

    def __init__(self, codec, pair_filter: PairFilter, batch_size: int, pool: ThreadPoolExecutor,
                 num_workers: int, progress: tqdm):
        self.codec, self.pair_filter, self.batch_size = codec, pair_filter, batch_size
        self.pool, self.max_in_flight, self.progress = pool, 2 * batch_size + num_workers, progress
        self.totals = Counter()  # over the whole run, shown on the progress bar

    def _prepare(self, example: SourceExample):
        return prepare_example(example, self.pair_filter, self.codec.image_size)

    def encode(self, examples: list[SourceExample]) -> tuple[dict[str, list], Counter]:
        """(columns of the kept rows, counts of this shard per outcome: "kept" or a drop reason)."""
        columns = {name: [] for name in SCHEMA.names}
        counts = Counter()
        images, rows = [], []
        for result in bounded_map(self.pool, self._prepare, examples, self.max_in_flight):
            outcome = result if isinstance(result, str) else "kept"
            counts[outcome] += 1
            self.totals[outcome] += 1
            self.progress.update(1)
            self.progress.set_postfix(kept=self.totals["kept"], refresh=False,
                                      dropped=sum(self.totals[r] for r in DROP_REASONS))
            if outcome == "kept":
                images.append(result[0])
                rows.append(result[1])
            if len(images) == self.batch_size:
                self._encode_batch(images, rows, columns)
        if images:
            self._encode_batch(images, rows, columns)
        return columns, counts

    def _encode_batch(self, images: list[torch.Tensor], rows: list[dict], columns: dict[str, list]) -> None:
        codes = self.codec.encode(torch.stack(images).float().div_(255.0)).cpu().numpy()
        for row, grid in zip(rows, codes):
            row["code"] = encode_code(grid)
            for name in SCHEMA.names:
                columns[name].append(row[name])
        images.clear()
        rows.clear()


def _write_json_atomically(path: Path, record: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.NamedTemporaryFile("w", dir=path.parent, suffix=".tmp", delete=False) as tmp:
        json.dump(record, tmp)
    os.replace(tmp.name, path)


def preprocess(examples: Iterable[SourceExample], codec, out_dir: str | os.PathLike, rows_per_shard: int = 10000,
               batch_size: int = 32, pair_filter: PairFilter | None = None, prefix: str = "train",
               max_shards: int | None = None, num_workers: int = 4) -> dict:
    """Encode `examples` with `codec` into parquet shards in `out_dir`; resumable.

    Args:
        examples: image-text pairs in a fixed order (see `recipes.dalle.preprocess_sources`).
        codec: an image codec (`encode(images [B,3,S,S] in [0,1]) -> codes [B,h,w]`, `image_size` S).
        out_dir: directory of the shards (created if needed).
        rows_per_shard: input pairs per shard (fewer rows are written when some are dropped).
        batch_size: images per `codec.encode` call.
        pair_filter: the filters (default: the seed's).
        prefix: shard file names are `{prefix}-{k:05d}.parquet`.
        max_shards: stop after writing this many new shards (None: until the input ends).
        num_workers: threads decoding and resizing images.

    Returns: {"shards_written", "shards_skipped", "kept", and one count per drop reason}, counted over
    all shards present (finished ones included).
    """
    if rows_per_shard < 1 or batch_size < 1:
        raise ValueError(f"rows_per_shard and batch_size must be >= 1, got {rows_per_shard}, {batch_size}")
    pair_filter = pair_filter or PairFilter()
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    totals = Counter({"shards_written": 0, "shards_skipped": 0})
    iterator: Iterator[SourceExample] = iter(examples)
    progress = tqdm(desc="encoding pairs", unit="pair")
    with ThreadPoolExecutor(max(1, num_workers)) as pool:
        encoder = ShardEncoder(codec, pair_filter, batch_size, pool, max(1, num_workers), progress)
        for shard in itertools.count():
            if max_shards is not None and totals["shards_written"] >= max_shards:
                break
            chunk = list(itertools.islice(iterator, rows_per_shard))
            if not chunk:
                break
            name = f"{prefix}-{shard:05d}"
            path, stats_path = out_dir / f"{name}.parquet", out_dir / STATS_DIR / f"{name}.json"
            if stats_path.exists():
                done = json.loads(stats_path.read_text())
                if done["kept"] == 0 or path.exists():
                    totals["shards_skipped"] += 1
                    totals.update(done)
                    progress.update(len(chunk))
                    continue
            columns, counts = encoder.encode(chunk)
            totals.update(counts)
            # A shard whose pairs were all dropped gets no parquet file: `datasets` cannot stream an empty
            # one. The stats file is written last and marks the shard as finished.
            if counts["kept"]:
                write_parquet_shard(path, {f.name: pa.array(columns[f.name], type=f.type) for f in SCHEMA})
            _write_json_atomically(stats_path, {"kept": counts["kept"], **{r: counts[r] for r in DROP_REASONS}})
            totals["shards_written"] += 1
    progress.close()
    for reason in ("kept",) + DROP_REASONS:
        totals.setdefault(reason, 0)
    return dict(totals)


def build_codec(name: str, vqgan_config: str | None = None, vqgan_checkpoint: str | None = None,
                vqgan_repo: str | None = None, palette_cell_pixels: int = 8, device: str = "cpu"):
    """The image codec: "palette" (the embedded shapes data) or "vqgan" (taming config + checkpoint,
    local paths, or file names inside the Hub repo `vqgan_repo`)."""
    if name == "palette":
        from recipes.shapes import PaletteCodec

        return PaletteCodec(palette_cell_pixels)
    if name != "vqgan":
        raise ValueError(f"unknown codec {name!r}; use 'palette' or 'vqgan'")
    from recipes.dalle.vqgan import VQGAN

    if not vqgan_config or not vqgan_checkpoint:
        raise ValueError("--codec vqgan needs --vqgan-config and --vqgan-checkpoint "
                         "(paths, or file names in --vqgan-repo)")
    if vqgan_repo:
        model = VQGAN.from_pretrained(vqgan_repo, vqgan_checkpoint, vqgan_config)
    else:
        model = VQGAN.from_taming(vqgan_config, vqgan_checkpoint)
    return model.to(device)


def push_to_hub(out_dir: str | os.PathLike, repo_id: str, private: bool = False) -> None:
    """Upload the shards (and their stats) to a Hub dataset repo under `data/`."""
    from huggingface_hub import HfApi

    api = HfApi()
    api.create_repo(repo_id, repo_type="dataset", private=private, exist_ok=True)
    api.upload_folder(folder_path=str(out_dir), repo_id=repo_id, repo_type="dataset", path_in_repo="data",
                      allow_patterns=["*.parquet", f"{STATS_DIR}/*.json"],
                      commit_message="Add image-code shards (recipes.dalle.preprocess)")


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description="Encode image-text pairs into parquet shards of image codes.")
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--folder", help="folder of images with same-named .txt captions (and optional .json)")
    source.add_argument("--tars", nargs="+", help="glob(s) of webdataset-style tar shards")
    source.add_argument("--hf-dataset", help="datasets dataset: Hub name or save_to_disk directory")
    parser.add_argument("--hf-split", default="train", help="split of --hf-dataset")
    parser.add_argument("--hf-config", default=None, help="configuration of --hf-dataset")
    parser.add_argument("--image-column", default="image", help="image column of --hf-dataset")
    parser.add_argument("--caption-column", default=None,
                        help="caption column of --hf-dataset (default: caption, text or TEXT)")
    parser.add_argument("--out", required=True, help="output directory of the parquet shards")
    parser.add_argument("--codec", choices=["vqgan", "palette"], default="vqgan")
    parser.add_argument("--vqgan-config", help="taming YAML config (path, or file name in --vqgan-repo)")
    parser.add_argument("--vqgan-checkpoint", help="taming .ckpt/.safetensors (path, or file name in --vqgan-repo)")
    parser.add_argument("--vqgan-repo", help="Hub model repo holding the VQGAN config and checkpoint")
    parser.add_argument("--palette-cell-pixels", type=int, default=8, help="pixels per grid cell of the palette codec")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--rows-per-shard", type=int, default=10000, help="input pairs per shard")
    parser.add_argument("--batch-size", type=int, default=32, help="images per encoder call")
    parser.add_argument("--num-workers", type=int, default=4, help="threads decoding images")
    parser.add_argument("--prefix", default="train", help="shard names: PREFIX-00000.parquet")
    parser.add_argument("--max-shards", type=int, default=None, help="stop after writing this many new shards")
    parser.add_argument("--min-caption-length", type=int, default=3)
    parser.add_argument("--max-aspect-ratio", type=float, default=2.0)
    parser.add_argument("--nsfw-allowed", nargs="+", default=["UNLIKELY"], help="NSFW labels kept")
    parser.add_argument("--push-to-hub", metavar="REPO_ID", help="upload the shards to this Hub dataset repo")
    parser.add_argument("--private", action="store_true", help="create the Hub dataset repo as private")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")

    codec = build_codec(args.codec, args.vqgan_config, args.vqgan_checkpoint, args.vqgan_repo,
                        args.palette_cell_pixels, args.device)
    if args.folder:
        examples = iter_folder(args.folder)
    elif args.tars:
        examples = iter_tar_shards(args.tars)
    else:
        examples = iter_hf_dataset(args.hf_dataset, args.hf_split, args.hf_config, args.image_column,
                                   args.caption_column)
    stats = preprocess(examples, codec, args.out, args.rows_per_shard, args.batch_size,
                       PairFilter(args.min_caption_length, args.max_aspect_ratio, tuple(args.nsfw_allowed)),
                       args.prefix, args.max_shards, args.num_workers)
    print(json.dumps(stats))
    if args.push_to_hub:
        push_to_hub(args.out, args.push_to_hub, args.private)
    return stats


if __name__ == "__main__":
    main()
