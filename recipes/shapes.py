"""The embedded offline dataset: captioned pictures of coloured shapes on a 16x16 grid of palette codes.

Every image is a 16x16 grid of codes, one per cell; code 0 is the (white) background and code i > 0 is
the i-th named colour of `PALETTE`. The `PaletteCodec` turns codes into RGB pictures and back exactly, so
the grid plays the part that VQGAN codes play for real photos: the rows written by `write_shapes_dataset`
have the same schema as laion/laion_100m_vqgan_f8 (`caption: str`, `code: bytes` = little-endian int16,
row-major), and the DALL-E recipe trains on either without changes.

Captions come from a tiny grammar:
    single shape:  "a {small|big} {colour} {shape}"
    two shapes:    "a {colour} {shape} {to the left of|to the right of|above|below} a {colour} {shape}"
Some colour+shape pairs (`HELD_OUT_PAIRS`) never appear in the training split; about half of the
validation examples contain one, which measures compositional generalisation (labels["held_out"]).

`check_caption(caption, codes)` reads a grid back and says whether it shows what the caption says; the
inference helpers use it to score text-to-image samples.

    python -m recipes.shapes --out DIR --num-train 20000 --num-val 1000
"""

from __future__ import annotations

import argparse
import functools
import os
import re
from pathlib import Path

import numpy as np
import torch
from scipy import ndimage

from recipes.rows import encode_code, write_parquet_shard

GRID_SIZE = 16
PALETTE: list[tuple[str, tuple[int, int, int]]] = [
    ("background", (255, 255, 255)),
    ("red", (220, 40, 40)),
    ("orange", (245, 140, 30)),
    ("yellow", (235, 210, 40)),
    ("green", (40, 160, 60)),
    ("blue", (40, 80, 220)),
    ("purple", (140, 60, 190)),
    ("black", (20, 20, 20)),
]
COLOURS = [name for name, _ in PALETTE[1:]]
COLOUR_CODES = {name: code for code, (name, _) in enumerate(PALETTE)}
SHAPES = ["square", "circle", "triangle", "cross"]
SIZES = {"small": 6, "big": 12}  # side of the shape's box, in cells
PAIR_SIZE = 6  # side of each shape's box in two-shape images (no size word in their captions)
RELATIONS = ["to the left of", "to the right of", "above", "below"]
# Colour+shape pairs that appear only in validation (each colour and shape still appears in train).
HELD_OUT_PAIRS = {("red", "triangle"), ("green", "circle"), ("blue", "square"), ("yellow", "cross")}
SPLITS = {"train": 0, "val": 1}


def caption_words() -> list[str]:
    """Every word the caption grammar uses (both articles, sizes, colours, shapes, the relation words)."""
    words = ["a", "an", *SIZES, *COLOURS, *SHAPES, *(word for relation in RELATIONS for word in relation.split())]
    return list(dict.fromkeys(words))


# ---------------------------------------------------------------- drawing
@functools.lru_cache(maxsize=None)
def _cached_mask(shape: str, height: int, width: int) -> np.ndarray:
    mask = _draw_mask(shape, height, width)
    mask.flags.writeable = False
    return mask


def shape_mask(shape: str, height: int, width: int | None = None) -> np.ndarray:
    """Boolean [height, width] mask (read-only) of `shape` filling a box of that size: the generator uses
    square boxes; the checker renders templates at the bounding box of what it finds."""
    return _cached_mask(shape, height, height if width is None else width)


def _draw_mask(shape: str, height: int, width: int) -> np.ndarray:
    # cell centres in box coordinates normalised to [-1, 1]
    rows = (np.arange(height) + 0.5) / height * 2 - 1
    cols = (np.arange(width) + 0.5) / width * 2 - 1
    y, x = np.meshgrid(rows, cols, indexing="ij")
    if shape == "square":
        return np.ones((height, width), dtype=bool)
    if shape == "circle":
        # the circle through the middle cells of the box's edges: it spans the whole box (so the checker
        # finds it at its box) and small circles lose their corners (so they differ from squares)
        radius_squared = (1 - 1 / max(height, width)) ** 2 + (1 / max(height, width)) ** 2 + 1e-9
        return x**2 + y**2 <= radius_squared
    if shape == "triangle":
        # apex at the top centre, full-width base at the bottom row
        half_width = (np.arange(height)[:, None] + 1) / height  # grows linearly per row, 1 at the base
        return np.abs(x) <= half_width + 1e-9
    if shape == "cross":
        band = 1 / 3 + 1e-9
        return (np.abs(x) <= band) | (np.abs(y) <= band)
    raise ValueError(f"unknown shape {shape!r}; expected one of {SHAPES}")


def _paint(grid: np.ndarray, shape: str, colour: str, top: int, left: int, size: int) -> dict:
    grid[top : top + size, left : left + size][shape_mask(shape, size)] = COLOUR_CODES[colour]
    return {"colour": colour, "shape": shape, "box": (top, left, size)}


def _article(word: str) -> str:
    return "an" if word[0] in "aeiou" else "a"


def caption_of(labels: dict) -> str:
    """The caption of a labels dict (as :func:`generate_example` returns them): the grammar's one definition.

    Single shapes: "a {size} {colour} {shape}"; pairs: "{a/an} {colour} {shape} {relation} {a/an} {colour} {shape}".
    """
    if labels["kind"] == "single":
        obj = labels["objects"][0]
        return f"a {labels['size']} {obj['colour']} {obj['shape']}"
    first, second = (f"{_article(o['colour'])} {o['colour']} {o['shape']}" for o in labels["objects"])
    return f"{first} {labels['relation']} {second}"


def _pick_object(rng: np.random.Generator, split: str, force_held_out: bool) -> tuple[str, str]:
    if force_held_out:
        pairs = sorted(HELD_OUT_PAIRS)
        return pairs[rng.integers(len(pairs))]
    while True:  # rejection sampling keeps held-out pairs out of the training split
        colour, shape = COLOURS[rng.integers(len(COLOURS))], SHAPES[rng.integers(len(SHAPES))]
        if split == "val" or (colour, shape) not in HELD_OUT_PAIRS:
            return colour, shape


def generate_example(index: int, split: str = "train", seed: int = 0,
                     pair_fraction: float = 0.5) -> tuple[str, np.ndarray, dict]:
    """Deterministically draw example `index` of `split` ("train" or "val").

    `pair_fraction` is the chance that the example shows two shapes (else one). At the default 0.5 the rows are
    those of every earlier version; another value changes which rows are pairs, not how either kind is drawn.

    Returns (caption, codes int16 [16, 16], labels) where labels has "kind" ("single" or "pair"),
    "objects" (colour, shape, box per shape), "size" (single) or "relation" (pair) and "held_out".
    """
    if split not in SPLITS:
        raise ValueError(f"split must be one of {list(SPLITS)}, got {split!r}")
    if not 0.0 <= pair_fraction <= 1.0:
        raise ValueError(f"pair_fraction must lie in [0, 1], got {pair_fraction}")
    rng = np.random.default_rng([seed, SPLITS[split], index])
    grid = np.zeros((GRID_SIZE, GRID_SIZE), dtype=np.int16)
    force_held_out = split == "val" and rng.random() < 0.5
    if rng.random() < 1.0 - pair_fraction:
        size_name = ["small", "big"][rng.integers(2)]
        size = SIZES[size_name]
        colour, shape = _pick_object(rng, split, force_held_out)
        centre_offset = (GRID_SIZE - size) // 2
        jitter = 1 if size_name == "big" else 3
        top, left = centre_offset + rng.integers(-jitter, jitter + 1, size=2)
        obj = _paint(grid, shape, colour, int(top), int(left), size)
        labels = {"kind": "single", "size": size_name, "objects": [obj]}
    else:
        relation = RELATIONS[rng.integers(len(RELATIONS))]
        first = _pick_object(rng, split, force_held_out)
        second = _pick_object(rng, split, False)
        while second[0] == first[0]:  # different colours keep the two blobs apart for the checker
            second = _pick_object(rng, split, False)
        if rng.random() < 0.5:  # which of the two holds the held-out pair (if any)
            first, second = second, first
        # The first-named object sits in the half the relation names; the two boxes are >= 2 cells apart.
        near, far = rng.integers(0, 2), rng.integers(0, 2)  # offsets inside the 8-cell halves
        across = rng.integers(2, GRID_SIZE - PAIR_SIZE - 1, size=2)  # position along the other axis
        low_half, high_half = int(near), int(GRID_SIZE // 2 + 1 + far)
        first_at, second_at = (low_half, high_half) if relation in ("to the left of", "above") else (high_half, low_half)
        horizontal = relation in ("to the left of", "to the right of")
        objects = []
        for (colour, shape), along, other in ((first, first_at, across[0]), (second, second_at, across[1])):
            top, left = (int(other), along) if horizontal else (along, int(other))
            objects.append(_paint(grid, shape, colour, top, left, PAIR_SIZE))
        labels = {"kind": "pair", "relation": relation, "objects": objects}
    labels["held_out"] = any((o["colour"], o["shape"]) in HELD_OUT_PAIRS for o in labels["objects"])
    return caption_of(labels), grid, labels


# ---------------------------------------------------------------- codec
class PaletteCodec:
    """Image codec of the shapes data: one palette code per `cell_pixels` x `cell_pixels` cell.

    Same contract as the VQGAN: `encode(images [B,3,H,W] in [0,1]) -> codes [B,16,16]`,
    `decode(codes [B,16,16] or [B,256]) -> images [B,3,H,W] in [0,1]`; decode then encode is exact.
    """

    def __init__(self, cell_pixels: int = 8):
        self.cell_pixels = cell_pixels
        self.grid_size = GRID_SIZE
        self.codebook_size = len(PALETTE)
        self.image_size = GRID_SIZE * cell_pixels
        self.colours = torch.tensor([rgb for _, rgb in PALETTE], dtype=torch.float32) / 255.0  # [K, 3]

    @torch.no_grad()
    def encode(self, images: torch.Tensor) -> torch.Tensor:
        """Nearest palette colour of each cell's mean colour."""
        if images.dim() != 4 or images.shape[1] != 3 or images.shape[-1] != self.image_size:
            raise ValueError(f"expected images [B, 3, {self.image_size}, {self.image_size}], got {tuple(images.shape)}")
        cells = torch.nn.functional.avg_pool2d(images.float(), self.cell_pixels)  # [B, 3, 16, 16]
        cells = cells.permute(0, 2, 3, 1)  # [B, 16, 16, 3]
        distances = (cells[..., None, :] - self.colours.to(cells.device)).pow(2).sum(-1)  # [B, 16, 16, K]
        return distances.argmin(-1)

    @torch.no_grad()
    def decode(self, codes: torch.Tensor) -> torch.Tensor:
        codes = torch.as_tensor(codes).long()
        codes = codes.reshape(codes.shape[0], self.grid_size, self.grid_size)
        if codes.min() < 0 or codes.max() >= self.codebook_size:
            raise ValueError(f"codes must lie in [0, {self.codebook_size}), got [{codes.min()}, {codes.max()}]")
        images = self.colours.to(codes.device)[codes].permute(0, 3, 1, 2)  # [B, 3, 16, 16]
        return images.repeat_interleave(self.cell_pixels, 2).repeat_interleave(self.cell_pixels, 3)


# ---------------------------------------------------------------- caption checker
_OBJECT = rf"({'|'.join(COLOURS)}) ({'|'.join(SHAPES)})"
_SINGLE_RE = re.compile(rf"^an? ({'|'.join(SIZES)}) {_OBJECT}$")
_PAIR_RE = re.compile(rf"^an? {_OBJECT} ({'|'.join(RELATIONS)}) an? {_OBJECT}$")
MIN_BLOB_CELLS = 4  # smaller specks are treated as noise, not as shapes
MIN_SHAPE_IOU = 0.6  # a blob must overlap its best template at least this much to count as that shape


def parse_caption(caption: str) -> dict | None:
    """Parse a caption of the shapes grammar into labels like generate_example's, or None if it isn't one."""
    text = " ".join(caption.lower().replace(".", " ").split())
    if match := _SINGLE_RE.match(text):
        size, colour, shape = match.groups()
        return {"kind": "single", "size": size, "objects": [{"colour": colour, "shape": shape}]}
    if match := _PAIR_RE.match(text):
        colour1, shape1, relation, colour2, shape2 = match.groups()
        objects = [{"colour": colour1, "shape": shape1}, {"colour": colour2, "shape": shape2}]
        return {"kind": "pair", "relation": relation, "objects": objects}
    return None


def _components(mask: np.ndarray) -> list[np.ndarray]:
    """8-connected components of a boolean grid, as arrays of (row, col) cells, in raster order of their first
    cell (8-connected, so that a shape drawn with a missing cell still reads as one blob; generated shapes are
    >= 2 cells apart)."""
    labels, count = ndimage.label(mask, structure=np.ones((3, 3), dtype=bool))
    return [np.argwhere(labels == label) for label in range(1, count + 1)]


def find_blobs(codes: np.ndarray | torch.Tensor) -> list[dict]:
    """Shapes in a code grid: each connected non-background blob of >= MIN_BLOB_CELLS cells, with its
    dominant colour, best-matching shape (template IoU at its bounding box), size word and centre."""
    grid = np.asarray(torch.as_tensor(codes).cpu()).reshape(GRID_SIZE, GRID_SIZE)
    blobs = []
    for cells in _components(grid != 0):
        if len(cells) < MIN_BLOB_CELLS:
            continue
        (top, left), (bottom, right) = cells.min(0), cells.max(0) + 1
        blob = np.zeros((bottom - top, right - left), dtype=bool)
        blob[cells[:, 0] - top, cells[:, 1] - left] = True
        ious = {}
        for shape in SHAPES:
            template = shape_mask(shape, *blob.shape)
            ious[shape] = (blob & template).sum() / (blob | template).sum()
        shape = max(ious, key=ious.get)
        colour_counts = np.bincount(grid[cells[:, 0], cells[:, 1]], minlength=len(PALETTE))
        extent = max(blob.shape)
        blobs.append(
            {
                "colour": PALETTE[int(colour_counts.argmax())][0],
                "shape": shape if ious[shape] >= MIN_SHAPE_IOU else None,
                "size": "small" if extent <= (SIZES["small"] + SIZES["big"]) // 2 else "big",
                "centre": cells.mean(0),
                "cells": len(cells),
            }
        )
    return blobs


def _relation_holds(relation: str, first: np.ndarray, second: np.ndarray) -> bool:
    d_row, d_col = second - first  # from the first-named object to the second
    if relation in ("to the left of", "to the right of"):
        return abs(d_col) > abs(d_row) and (d_col > 0) == (relation == "to the left of")
    return abs(d_row) > abs(d_col) and (d_row > 0) == (relation == "above")


def check_caption(caption: str, codes: np.ndarray | torch.Tensor) -> bool:
    """Whether a code grid ([16, 16] or [256]) shows what `caption` says: the right number of shapes, each
    named colour+shape present, the size word (single shapes) and the relation (pairs). False for captions
    outside the shapes grammar."""
    wanted = parse_caption(caption)
    if wanted is None:
        return False
    blobs = find_blobs(codes)
    if len(blobs) != len(wanted["objects"]):
        return False
    matched = []
    for obj in wanted["objects"]:
        candidates = [b for b in blobs if (b["colour"], b["shape"]) == (obj["colour"], obj["shape"])]
        candidates = [b for b in candidates if all(b is not m for m in matched)]
        if not candidates:
            return False
        matched.append(max(candidates, key=lambda b: b["cells"]))
    if wanted["kind"] == "single":
        return bool(matched[0]["size"] == wanted["size"])
    return bool(_relation_holds(wanted["relation"], matched[0]["centre"], matched[1]["centre"]))


# ---------------------------------------------------------------- writing shards
def write_shapes_dataset(
    out_dir: str | os.PathLike,
    num_train: int = 20000,
    num_val: int = 1000,
    rows_per_shard: int = 10000,
    seed: int = 0,
    train_pair_fraction: float = 0.5,
) -> dict[str, list[str]]:
    """Write `num_train` training and `num_val` validation rows as Brotli parquet shards named
    `train-00000-of-000NN.parquet` / `validation-00000-of-000NN.parquet` in `out_dir`.
    `train_pair_fraction`: the share of two-shape rows in the training split (the validation split keeps 0.5, so
    evaluations stay comparable). Returns {"train": [paths], "validation": [paths]}."""
    if rows_per_shard < 1:
        raise ValueError(f"rows_per_shard must be >= 1, got {rows_per_shard}")
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    written = {}
    for split, file_prefix, num_rows in (("train", "train", num_train), ("val", "validation", num_val)):
        num_shards = max(1, -(-num_rows // rows_per_shard))
        paths = []
        pair_fraction = train_pair_fraction if split == "train" else 0.5
        for shard in range(num_shards):
            captions, codes = [], []
            for index in range(shard * rows_per_shard, min(num_rows, (shard + 1) * rows_per_shard)):
                caption, grid, _ = generate_example(index, split, seed, pair_fraction)
                captions.append(caption)
                codes.append(encode_code(grid))
            path = out_dir / f"{file_prefix}-{shard:05d}-of-{num_shards:05d}.parquet"
            write_parquet_shard(path, {"caption": captions, "code": codes})
            paths.append(str(path))
        written[file_prefix] = paths
    return written


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="Write the embedded shapes dataset as parquet shards.")
    parser.add_argument("--out", required=True, help="output directory")
    parser.add_argument("--num-train", type=int, default=20000, help="training rows")
    parser.add_argument("--num-val", type=int, default=1000, help="validation rows")
    parser.add_argument("--rows-per-shard", type=int, default=10000, help="rows per parquet file")
    parser.add_argument("--seed", type=int, default=0, help="generator seed (same seed, same rows)")
    parser.add_argument("--train-pair-fraction", type=float, default=0.5, help="share of two-shape training rows")
    args = parser.parse_args(argv)
    written = write_shapes_dataset(args.out, args.num_train, args.num_val, args.rows_per_shard, args.seed,
                                   args.train_pair_fraction)
    for split, paths in written.items():
        print(f"{split}: {len(paths)} shard(s) in {args.out}")


if __name__ == "__main__":
    main()
