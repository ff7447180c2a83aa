"""Readers of image-text pairs for `recipes.dalle.preprocess`.

Each reader yields `SourceExample`s in a fixed order (so that shard k of a rerun holds the same pairs)
without decoding images: decoding happens later, where failures are counted instead of raised.

- `iter_folder(root)`: image files with a caption in a `.txt` file of the same name (and optional
  metadata in a `.json` of the same name), found recursively, in sorted path order.
- `iter_tar_shards(paths)`: webdataset-style tar shards (img2dataset's output): the members of one
  sample share a key (the path up to the first dot of the file name): `key.jpg`, `key.txt`, `key.json`.
- `iter_hf_dataset(name, ...)`: a `datasets` dataset with an image column (a Hub name, streamed, or a
  directory written by `Dataset.save_to_disk`).
"""

from __future__ import annotations

import glob
import io
import json
import logging
import os
import tarfile
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

IMAGE_EXTENSIONS = (".jpg", ".jpeg", ".png", ".webp", ".bmp", ".gif", ".tif", ".tiff")
CAPTION_COLUMNS = ("caption", "text", "TEXT")  # tried in order when no caption column is given
METADATA_ALIASES = {"NSFW": ("NSFW", "nsfw"), "url": ("url", "URL"),
                    "original_width": ("original_width",), "original_height": ("original_height",)}


@dataclass
class SourceExample:
    """One image-text pair before decoding.

    Attributes:
        key: where it came from (relative path, tar member key or row index), stored in the `key` column.
        caption: the caption, or None when it is missing or unreadable (the row is counted as corrupt).
        image: file path, encoded bytes, a PIL image, or None when missing.
        metadata: optional LAION-style fields: NSFW, url, original_width, original_height.
    """

    key: str
    caption: str | None
    image: Any
    metadata: dict = field(default_factory=dict)


def _decode_text(data: bytes) -> str | None:
    try:
        return data.decode("utf-8").strip()
    except UnicodeDecodeError:
        return None


def pick_metadata(record: dict) -> dict:
    """LAION-style metadata fields found in a json sidecar or a dataset row (other fields dropped)."""
    found = {}
    for name, aliases in METADATA_ALIASES.items():
        for alias in aliases:
            if record.get(alias) is not None:
                found[name] = record[alias]
                break
    return found


def _read_json(data: bytes) -> dict:
    try:
        record = json.loads(data)
    except (UnicodeDecodeError, json.JSONDecodeError):
        return {}
    return record if isinstance(record, dict) else {}


def iter_folder(root: str | os.PathLike) -> Iterator[SourceExample]:
    """Image files under `root` (recursively, sorted) with their `.txt` captions and `.json` metadata."""
    root = Path(root)
    if not root.is_dir():
        raise ValueError(f"image folder {root} does not exist or is not a directory")
    images = sorted(p for p in root.rglob("*") if p.suffix.lower() in IMAGE_EXTENSIONS and p.is_file())
    if not images:
        raise ValueError(f"no image files ({', '.join(IMAGE_EXTENSIONS)}) under {root}")
    for path in images:
        caption_path, json_path = path.with_suffix(".txt"), path.with_suffix(".json")
        caption = _decode_text(caption_path.read_bytes()) if caption_path.is_file() else None
        metadata = pick_metadata(_read_json(json_path.read_bytes())) if json_path.is_file() else {}
        yield SourceExample(str(path.relative_to(root)), caption, path, metadata)


def resolve_tar_paths(patterns: str | list[str]) -> list[str]:
    """Sorted tar files matching the glob pattern(s); a ValueError when a pattern matches nothing."""
    patterns = [patterns] if isinstance(patterns, str) else list(patterns)
    paths = []
    for pattern in patterns:
        matches = sorted(glob.glob(os.path.expanduser(pattern)))
        if not matches:
            raise ValueError(f"no tar shard matches {pattern!r}")
        paths.extend(matches)
    return paths


def _sample_from_members(key: str, members: dict[str, bytes]) -> SourceExample:
    image = next((data for ext, data in members.items() if "." + ext.lower() in IMAGE_EXTENSIONS), None)
    caption = _decode_text(members["txt"]) if "txt" in members else None
    metadata = pick_metadata(_read_json(members["json"])) if "json" in members else {}
    return SourceExample(key, caption, image, metadata)


def iter_tar_shards(patterns: str | list[str]) -> Iterator[SourceExample]:
    """Samples of webdataset-style tar shards, in file order then member order.

    An unreadable tar file (or its unreadable tail) is logged and skipped: the samples it still gave
    are kept, the rest of that file is lost.
    """
    for tar_path in resolve_tar_paths(patterns):
        key, members = None, {}
        try:
            with tarfile.open(tar_path, "r:*") as archive:
                for member in archive:
                    if not member.isfile():
                        continue
                    directory, name = os.path.split(member.name)
                    if "." not in name:
                        continue
                    stem, extension = name.split(".", 1)
                    member_key = f"{os.path.basename(tar_path)}/{os.path.join(directory, stem)}"
                    if member_key != key and key is not None:
                        yield _sample_from_members(key, members)
                        members = {}
                    key = member_key
                    members[extension] = archive.extractfile(member).read()
        except (tarfile.TarError, OSError, EOFError) as error:
            log.warning(f"{tar_path}: unreadable after {key!r} ({error}); skipping the rest of this file")
        if key is not None and members:
            yield _sample_from_members(key, members)


def iter_hf_dataset(name: str, split: str = "train", config: str | None = None, image_column: str = "image",
                    caption_column: str | None = None) -> Iterator[SourceExample]:
    """Rows of a `datasets` dataset: a Hub name (streamed) or a `save_to_disk` directory.

    Args:
        name: Hub dataset name, or a local directory written by `Dataset(Dict).save_to_disk`.
        split: split to read.
        config: the dataset's configuration name, if it has several.
        image_column: column with the images (an `Image` feature, encoded bytes, or file paths).
        caption_column: column with the captions; None tries "caption", "text", "TEXT".
    """
    import datasets

    saved_to_disk = ("dataset_info.json", "dataset_dict.json", "state.json")
    if Path(name).is_dir() and any((Path(name) / f).exists() for f in saved_to_disk):
        dataset = datasets.load_from_disk(name)
        if isinstance(dataset, datasets.DatasetDict):
            dataset = dataset[split]
        dataset = dataset.to_iterable_dataset()
    else:
        dataset = datasets.load_dataset(name, config, split=split, streaming=True)
    features = dataset.features or {}
    if features and image_column not in features:
        raise ValueError(f"dataset {name} has no image column {image_column!r}; columns: {list(features)}")
    if caption_column is None:
        caption_column = next((c for c in CAPTION_COLUMNS if c in features), CAPTION_COLUMNS[0])
    if features and caption_column not in features:
        raise ValueError(f"dataset {name} has no caption column {caption_column!r}; columns: {list(features)}")
    if isinstance(features.get(image_column), datasets.Image):
        # decode ourselves, so that a corrupt image is counted instead of stopping the stream
        dataset = dataset.cast_column(image_column, datasets.Image(decode=False))
    for index, row in enumerate(dataset):
        caption = row.get(caption_column)
        caption = caption.strip() if isinstance(caption, str) else None
        image = row.get(image_column)
        if isinstance(image, dict):  # {"bytes": ..., "path": ...} of an undecoded Image feature
            image = image.get("bytes") or image.get("path")
        yield SourceExample(f"{split}/{index}", caption, image, pick_metadata(row))


def load_pil_image(image: Any):
    """PIL image (fully read, RGB) from a path, encoded bytes or a PIL image; raises on corrupt data."""
    from PIL import Image

    if isinstance(image, (str, os.PathLike)):
        opened = Image.open(image)
    elif isinstance(image, (bytes, bytearray, memoryview)):
        opened = Image.open(io.BytesIO(bytes(image)))
    elif isinstance(image, Image.Image):
        opened = image
    else:
        raise ValueError(f"no image (got {type(image).__name__})")
    opened.load()  # decode now: truncated or corrupt data fails here
    if opened.mode in ("RGBA", "LA", "PA") or (opened.mode == "P" and "transparency" in opened.info):
        # transparent pixels become white rather than whatever colour they happen to hold
        rgba = opened.convert("RGBA")
        background = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
        return Image.alpha_composite(background, rgba).convert("RGB")
    return opened.convert("RGB")
