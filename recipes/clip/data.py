"""Image/caption batches of the embedded shapes data for contrastive CLIP training.

Examples come straight from `recipes.shapes.generate_example` (deterministic, ~0.1 ms each), rendered to
RGB by the `PaletteCodec` at the CLIP's image size and normalised with the same mean/std that the exported
model's preprocessing config records; captions are tokenized by open_clip's CLIP tokenizer.

Each example also carries "hard negatives": captions of the shapes grammar that differ from its caption in
one controlled way (`NEGATIVE_KINDS`: the relation reversed, the two objects, colours or shapes swapped, one
colour, shape or size word changed), and the picture one of them describes, drawn by moving or repainting
the example's own shapes. In-batch negatives almost never differ from a caption in one detail only, so
without them a CLIP learns colours but not which object is where; with the negative pictures it must also
tell apart two pictures that differ in that one detail, which is what a reranker of text-to-image samples
has to judge.
"""

from __future__ import annotations

import functools

import lightning as L
import numpy as np
import open_clip
import torch
from torch.utils.data import DataLoader, Dataset

from recipes.shapes import (COLOUR_CODES, COLOURS, GRID_SIZE, SHAPES, SIZES, PaletteCodec, caption_of,
                            check_caption, generate_example, shape_mask)

OPPOSITE = {"to the left of": "to the right of", "to the right of": "to the left of", "above": "below", "below": "above"}
# How a hard negative differs from its caption. Pairs: "relation" reverses the relation word; "swap_objects"
# names the two objects in the other order (same relation word); "swap_colours"/"swap_shapes" exchange the
# two objects' colours/shapes; "colour"/"shape" change one object's word to one that is not in the picture.
# Single shapes: "size", "colour", "shape". Every one of them describes a different picture.
PAIR_NEGATIVES = ("relation", "swap_objects", "swap_colours", "swap_shapes", "colour", "shape")
SINGLE_NEGATIVES = ("size", "colour", "shape")
NEGATIVE_KINDS = tuple(dict.fromkeys(PAIR_NEGATIVES + SINGLE_NEGATIVES))


def negative_kinds(labels: dict) -> list[str]:
    """The hard-negative kinds that apply to a labels dict (a shape swap needs two different shapes)."""
    if labels["kind"] == "single":
        return list(SINGLE_NEGATIVES)
    same_shape = labels["objects"][0]["shape"] == labels["objects"][1]["shape"]
    return [kind for kind in PAIR_NEGATIVES if not (kind == "swap_shapes" and same_shape)]


NUM_LAYOUTS = 2 * len(COLOURS)


def layout_class(labels: dict) -> int:
    """The layout of a two-shape picture as one of `NUM_LAYOUTS` classes: side by side or stacked, and the colour
    of the left/top object; -1 for single shapes. The picture and its caption both tell it."""
    if labels["kind"] != "pair":
        return -1
    stacked = labels["relation"] in ("above", "below")
    first_leads = labels["relation"] in ("to the left of", "above")  # the first-named object is left/top
    leading = labels["objects"][0 if first_leads else 1]["colour"]
    return int(stacked) * len(COLOURS) + COLOURS.index(leading)


def hard_negative(labels: dict, kind: str, rng: np.random.Generator) -> dict:
    """Labels (boxes included) of the picture a `kind` hard negative describes; `labels` is not modified.

    Args:
        labels: the labels dict of `generate_example` ("kind", "objects" with boxes, "size" or "relation").
        kind: one of `negative_kinds(labels)`.
        rng: numpy Generator choosing the new word (and the object) for "colour", "shape" and "size".
    """
    if kind not in negative_kinds(labels):
        raise ValueError(f"{kind!r} does not apply to {labels['kind']} labels; expected one of {negative_kinds(labels)}")
    new = {**labels, "objects": [dict(o) for o in labels["objects"]]}
    objects = new["objects"]
    if kind == "relation":  # "A left of B" -> "A right of B": the two shapes trade places
        new["relation"] = OPPOSITE[labels["relation"]]
        objects[0]["box"], objects[1]["box"] = objects[1]["box"], objects[0]["box"]
    elif kind == "swap_objects":  # "A left of B" -> "B left of A": the same picture with the words reordered
        new["objects"] = objects[::-1]  # ... describes A and B trading places, so the boxes stay
        new["objects"][0]["box"], new["objects"][1]["box"] = objects[0]["box"], objects[1]["box"]
    elif kind in ("swap_colours", "swap_shapes"):
        key = "colour" if kind == "swap_colours" else "shape"
        objects[0][key], objects[1][key] = objects[1][key], objects[0][key]
    elif kind == "size":
        new["size"] = next(s for s in SIZES if s != labels["size"])
        top, left, size = objects[0]["box"]
        side = SIZES[new["size"]]
        centre = (top + size / 2, left + size / 2)  # keep the centre, stay inside the grid
        top, left = (int(np.clip(round(c - side / 2), 0, GRID_SIZE - side)) for c in centre)
        objects[0]["box"] = (top, left, side)
    else:  # "colour" or "shape" of one object, to a word that is not in the picture
        obj = objects[rng.integers(len(objects))]
        if kind == "colour":
            choices = [c for c in COLOURS if c not in {o["colour"] for o in objects}]
        else:
            choices = [s for s in SHAPES if s != obj["shape"]]
        obj[kind] = str(rng.choice(choices))
    return new


def hard_negative_caption(labels: dict, rng: np.random.Generator) -> str:
    """The caption of a random applicable hard negative of `labels` (see `hard_negative`)."""
    kinds = negative_kinds(labels)
    return caption_of(hard_negative(labels, kinds[rng.integers(len(kinds))], rng))


def draw(labels: dict) -> np.ndarray:
    """Paint labels' objects (colour, shape, box = (top, left, side)) on an empty int16 [16, 16] code grid."""
    grid = np.zeros((GRID_SIZE, GRID_SIZE), dtype=np.int16)
    for obj in labels["objects"]:
        top, left, side = obj["box"]
        grid[top : top + side, left : left + side][shape_mask(obj["shape"], side)] = COLOUR_CODES[obj["colour"]]
    return grid


def perturb(labels: dict, rng: np.random.Generator) -> np.ndarray:
    """A sloppy drawing of `labels`, like the samples of a half-trained text-to-image model: one or two of
    its objects drawn at another width/height, as a filled box or with a ragged outline (some empty cells of
    its box filled, some of its cells cleared), broken into pieces (cut by an empty row or column, or kept only
    in scattered 2x2 blocks: how the tiny DALL-E's failed shapes look), part of one painted another colour, one
    moved or dropped, a stray blob added. `check_caption` decides whether it still shows the caption.

    Args:
        labels: the labels dict of `generate_example` (objects with boxes).
        rng: numpy Generator choosing the changes.
    """
    objects = [dict(o) for o in labels["objects"]]
    boxes = {}  # object index -> (top, left, height, width)
    for index, obj in enumerate(objects):
        top, left, side = obj["box"]
        boxes[index] = (top, left, side, side)
    patches, dropped, ragged, broken = [], set(), {}, {}
    for _ in range(rng.integers(1, 3)):
        index = int(rng.integers(len(objects)))
        top, left, height, width = boxes[index]
        change = rng.choice(["reshape", "box", "ragged", "ragged", "recolour", "move", "drop", "stray", "cut", "blocks"])
        if change in ("reshape", "box"):
            height, width = (int(np.clip(d + rng.integers(-3, 3), 2, GRID_SIZE)) for d in (height, width))
            top, left = (int(np.clip(p, 0, GRID_SIZE - d)) for p, d in ((top, height), (left, width)))
            if change == "box":
                objects[index]["shape"] = "square"  # a filled box of those sides
        elif change == "ragged":  # (fill probability, clear probability) of the box's cells
            ragged[index] = (rng.uniform(0.1, 0.7), rng.uniform(0.0, 0.25))
        elif change == "move":
            top, left = (int(np.clip(p + rng.integers(-4, 5), 0, GRID_SIZE - d)) for p, d in ((top, height), (left, width)))
        elif change == "drop":
            dropped.add(index)
        elif change == "cut":  # an empty row or column through the middle part of the box
            axis = int(rng.integers(2))
            broken[index] = functools.partial(cut_line, axis=axis, where=float(rng.uniform(0.25, 0.75)))
        elif change == "blocks":  # only the 2x2 blocks of one checkerboard colour: scattered specks
            broken[index] = functools.partial(keep_blocks, parity=int(rng.integers(2)))
        elif change == "recolour":  # part of the object in another colour
            row, col = top + rng.integers(height), left + rng.integers(width)
            patches.append((row, col, int(rng.integers(1, 4)), int(rng.integers(1, 4)), str(rng.choice(COLOURS))))
        else:  # a stray blob anywhere
            patches.append((*(int(v) for v in rng.integers(0, GRID_SIZE - 2, size=2)), int(rng.integers(1, 4)),
                            int(rng.integers(1, 4)), str(rng.choice(COLOURS))))
        boxes[index] = (top, left, height, width)
    grid = np.zeros((GRID_SIZE, GRID_SIZE), dtype=np.int16)
    for index, obj in enumerate(objects):
        if index not in dropped:
            top, left, height, width = boxes[index]
            mask = shape_mask(obj["shape"], height, width)
            if index in ragged:
                fill, clear = ragged[index]
                noise = rng.random(mask.shape)
                mask = np.where(mask, noise >= clear, noise < fill)
            if index in broken:
                mask = broken[index](mask)
            grid[top : top + height, left : left + width][mask] = COLOUR_CODES[obj["colour"]]
    for row, col, height, width, colour in patches:
        grid[row : row + height, col : col + width] = COLOUR_CODES[colour]
    return grid


def cut_line(mask: np.ndarray, axis: int, where: float) -> np.ndarray:
    """A copy of `mask` with its row (axis 0) or column (axis 1) at fraction `where` of its size cleared."""
    mask = mask.copy()
    line = [slice(None), slice(None)]
    line[axis] = int(where * mask.shape[axis])
    mask[tuple(line)] = False
    return mask


def keep_blocks(mask: np.ndarray, parity: int) -> np.ndarray:
    """`mask` kept only in the 2x2 blocks of one checkerboard colour: (row // 2 + col // 2) % 2 == parity."""
    rows, cols = np.indices(mask.shape)
    return mask & ((rows // 2 + cols // 2) % 2 == parity)


class ShapesCLIPDataset(Dataset):
    """Map-style dataset of CLIP training examples of one shapes split:
    {"codes" [16,16], "text" [context], "negative_text" [num_negatives, context], "negative_kind" [num_negatives],
    "layout" [] (`layout_class`),
    "negative_codes" [16,16] (the picture of the first negative caption), "perturbed_codes" [num_perturbed, 16, 16]
    (sloppy drawings of the caption that `check_caption` rejects)}.

    Args:
        split: "train" or "val" split of the shapes generator.
        size: number of examples (indices 0 .. size-1 of the split).
        context_length: text tokens per caption.
        num_negatives: hard-negative captions per example, of different kinds (single shapes have 3 kinds,
            pairs 5 or 6; an example with fewer kinds than this repeats kinds with other random words).
        num_perturbed: sloppy drawings per example that do not show its caption (see `perturb`).
        sloppy_positive_prob: probability that "codes" is a sloppy drawing that still shows the caption
            (by `check_caption`) instead of the clean one, so that the model accepts imperfect pictures.
        seed: the shapes generator seed (the same seed as the DALL-E data gives the same examples).
    """

    def __init__(self, split: str, size: int, context_length: int, num_negatives: int = 1, num_perturbed: int = 0,
                 sloppy_positive_prob: float = 0.0, seed: int = 0):
        if num_negatives < 1:
            raise ValueError(f"num_negatives must be >= 1, got {num_negatives}")
        self.split, self.size, self.num_negatives, self.seed = split, size, num_negatives, seed
        self.num_perturbed, self.sloppy_positive_prob = num_perturbed, sloppy_positive_prob
        self.tokenizer = open_clip.tokenizer.SimpleTokenizer(context_length=context_length)
        self._tokens: dict[str, torch.Tensor] = {}  # caption -> token row: the grammar has few captions, and
        # open_clip's tokenizer (ftfy clean-up, BPE) was ~1/6 of drawing a batch

    def _tokenize(self, captions: list[str]) -> torch.Tensor:
        """[len(captions), context_length] token rows, as open_clip's tokenizer gives them (cached per caption)."""
        missing = [c for c in dict.fromkeys(captions) if c not in self._tokens]
        if missing:
            self._tokens.update(zip(missing, self.tokenizer(missing)))
        return torch.stack([self._tokens[c] for c in captions])

    def __len__(self) -> int:
        return self.size

    def _sloppy(self, caption: str, labels: dict, rng: np.random.Generator, correct: bool, tries: int = 8):
        """A perturbed drawing that shows the caption (correct=True) or does not; None if `tries` miss."""
        for _ in range(tries):
            grid = perturb(labels, rng)
            if check_caption(caption, grid) == correct:
                return grid
        return None

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        caption, codes, labels = generate_example(index, self.split, self.seed)
        rng = np.random.default_rng([self.seed, 7, index])
        kinds = list(rng.permutation(negative_kinds(labels)))
        kinds = (kinds * self.num_negatives)[: self.num_negatives]
        negatives = [hard_negative(labels, kind, rng) for kind in kinds]
        tokens = self._tokenize([caption] + [caption_of(n) for n in negatives])
        if rng.random() < self.sloppy_positive_prob:
            sloppy = self._sloppy(caption, labels, rng, correct=True)
            codes = codes if sloppy is None else sloppy
        perturbed = [self._sloppy(caption, labels, rng, correct=False) for _ in range(self.num_perturbed)]
        # the fallback is a hard negative's picture (wrong for the caption by construction)
        perturbed = [draw(negatives[-1]) if p is None else p for p in perturbed]
        return {
            "codes": torch.from_numpy(codes.astype(np.int64)),
            "text": tokens[0],
            "negative_text": tokens[1:],
            "negative_kind": torch.tensor([NEGATIVE_KINDS.index(k) for k in kinds]),
            "layout": torch.tensor(layout_class(labels)),
            "negative_codes": torch.from_numpy(draw(negatives[0]).astype(np.int64)),
            "perturbed_codes": torch.from_numpy(np.array(perturbed, dtype=np.int64)).view(-1, GRID_SIZE, GRID_SIZE),
        }


class RenderCollate:
    """Collate examples and render every code grid of the batch to normalised RGB in one vectorised call
    ("codes" -> "image", "negative_codes" -> "negative_image", "perturbed_codes" -> "perturbed_image").

    Args:
        image_size: output side in pixels, a multiple of the 16-cell grid.
        mean, std: per-channel normalisation of the [0,1] rendered images.
    """

    def __init__(self, image_size: int, mean: tuple[float, ...], std: tuple[float, ...]):
        if image_size % GRID_SIZE:
            raise ValueError(f"image_size must be a multiple of the {GRID_SIZE}-cell grid, got {image_size}")
        self.cell_pixels = image_size // GRID_SIZE
        codec = PaletteCodec(cell_pixels=self.cell_pixels)
        # each palette colour normalised once: the same float32 values as normalising the decoded picture
        # (codec.decode), in one pass over the batch's pixels instead of three
        self.normalised_colours = (codec.colours - torch.tensor(mean)) / torch.tensor(std)  # [K, 3]

    def render(self, codes: torch.Tensor) -> torch.Tensor:
        """Normalised RGB [N, 3, H, W] of code grids [N, 16, 16]."""
        if codes.numel() and (codes.min() < 0 or codes.max() >= len(self.normalised_colours)):
            raise ValueError(f"codes must lie in [0, {len(self.normalised_colours)}), got [{codes.min()}, {codes.max()}]")
        cells = self.normalised_colours[codes].permute(0, 3, 1, 2)  # [N, 3, 16, 16]
        n, c = cells.shape[:2]
        pixels = self.cell_pixels
        return (cells[:, :, :, None, :, None].expand(n, c, GRID_SIZE, pixels, GRID_SIZE, pixels)
                .reshape(n, c, GRID_SIZE * pixels, GRID_SIZE * pixels))

    def __call__(self, examples: list[dict]) -> dict[str, torch.Tensor]:
        batch = {key: torch.stack([e[key] for e in examples]) for key in examples[0]}
        for codes_key, image_key in (("codes", "image"), ("negative_codes", "negative_image"),
                                     ("perturbed_codes", "perturbed_image")):
            if codes_key in batch:
                codes = batch.pop(codes_key)
                if codes.numel() == 0:  # no perturbed pictures asked for
                    continue
                images = self.render(codes.flatten(0, -3))
                batch[image_key] = images.view(*codes.shape[:-2], *images.shape[1:])
        return batch


class ShapesCLIPDataModule(L.LightningDataModule):
    """The embedded shapes data as CLIP batches
    {"image", "text", "negative_text", "negative_kind", "layout", "negative_image", "perturbed_image"}.

    Args:
        num_train: training examples per epoch (train split indices 0 .. num_train-1).
        num_val: validation examples (val split, which holds the held-out colour+shape pairs).
        batch_size: examples per batch (contrastive: every other caption of the batch is a negative).
        image_size: must equal the CLIP model's vision image_size.
        context_length: must equal the CLIP model's text context_length.
        num_negatives: hard-negative captions per example (see `ShapesCLIPDataset`).
        num_perturbed: sloppy drawings per example that do not show its caption (extra negative pictures).
        sloppy_positive_prob: probability that an example's picture is a sloppy drawing that still shows it.
        mean, std: image normalisation (the module records the same values in its exported config).
        seed: shapes generator seed.
        num_workers: DataLoader worker processes (0 keeps everything in the main process).
    """

    def __init__(self, num_train: int = 20000, num_val: int = 512, batch_size: int = 128, image_size: int = 128,
                 context_length: int = 16, num_negatives: int = 1, num_perturbed: int = 0,
                 sloppy_positive_prob: float = 0.0,
                 mean: tuple[float, float, float] = open_clip.OPENAI_DATASET_MEAN,
                 std: tuple[float, float, float] = open_clip.OPENAI_DATASET_STD, seed: int = 0, num_workers: int = 0):
        super().__init__()
        self.save_hyperparameters()

    def _loader(self, split: str, size: int, shuffle: bool) -> DataLoader:
        h = self.hparams
        dataset = ShapesCLIPDataset(split, size, h.context_length, h.num_negatives, h.num_perturbed,
                                    h.sloppy_positive_prob, h.seed)
        collate = RenderCollate(h.image_size, tuple(h.mean), tuple(h.std))
        return DataLoader(dataset, batch_size=h.batch_size, shuffle=shuffle, drop_last=shuffle, collate_fn=collate,
                          num_workers=h.num_workers, persistent_workers=h.num_workers > 0)

    def train_dataloader(self) -> DataLoader:
        return self._loader("train", self.hparams.num_train, shuffle=True)

    def val_dataloader(self) -> DataLoader:
        return self._loader("val", self.hparams.num_val, shuffle=False)
