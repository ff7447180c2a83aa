"""Image/caption batches of the embedded shapes data for contrastive CLIP training.

Examples come straight from `recipes.shapes.generate_example` (deterministic, ~0.1 ms each), rendered to
RGB by the `PaletteCodec` at the CLIP's image size and normalised with the same mean/std that the exported
model's preprocessing config records; captions are tokenized by open_clip's CLIP tokenizer.

Each example can also carry a "hard negative" caption: the same caption with one detail changed (the
relation reversed, a colour, shape or size word swapped). In-batch negatives almost never differ from a
caption in one detail only, so without them a CLIP learns colours but not which object is where, which is
what a reranker of text-to-image samples must judge.
"""

from __future__ import annotations

import lightning as L
import numpy as np
import open_clip
import torch
from torch.utils.data import DataLoader, Dataset

from recipes.shapes import COLOURS, GRID_SIZE, SHAPES, SIZES, PaletteCodec, generate_example

OPPOSITE = {"to the left of": "to the right of", "to the right of": "to the left of", "above": "below", "below": "above"}


def _caption(labels: dict) -> str:
    objects = [f"{o['colour']} {o['shape']}" for o in labels["objects"]]
    if labels["kind"] == "single":
        return f"a {labels['size']} {objects[0]}"
    return f"a {objects[0]} {labels['relation']} a {objects[1]}"


def hard_negative_caption(labels: dict, rng: np.random.Generator) -> str:
    """A caption of the shapes grammar that differs from the one `labels` describe in exactly one detail.

    Args:
        labels: the labels dict of `generate_example` ("kind", "objects", "size" or "relation").
        rng: numpy Generator choosing which detail changes.
    """
    labels = {**labels, "objects": [dict(o) for o in labels["objects"]]}
    change = rng.choice(["relation", "object"] if labels["kind"] == "pair" else ["size", "object"])
    if change == "size":
        labels["size"] = [s for s in SIZES if s != labels["size"]][0]
    elif change == "relation":
        labels["relation"] = OPPOSITE[labels["relation"]]
    else:
        obj = labels["objects"][rng.integers(len(labels["objects"]))]
        key, choices = ("colour", COLOURS) if rng.random() < 0.5 else ("shape", SHAPES)
        taken = {o["colour"] for o in labels["objects"]} if key == "colour" else {obj["shape"]}
        obj[key] = str(rng.choice([c for c in choices if c not in taken]))
    return _caption(labels)


class ShapesCLIPDataset(Dataset):
    """Map-style dataset of {"codes" [16,16], "text" [context], "negative_text" [context]} examples.

    Args:
        split: "train" or "val" split of the shapes generator.
        size: number of examples (indices 0 .. size-1 of the split).
        context_length: text tokens per caption.
        seed: the shapes generator seed (the same seed as the DALL-E data gives the same examples).
    """

    def __init__(self, split: str, size: int, context_length: int, seed: int = 0):
        self.split, self.size, self.seed = split, size, seed
        self.tokenizer = open_clip.tokenizer.SimpleTokenizer(context_length=context_length)

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        caption, codes, labels = generate_example(index, self.split, self.seed)
        negative = hard_negative_caption(labels, np.random.default_rng([self.seed, 7, index]))
        tokens = self.tokenizer([caption, negative])
        return {"codes": torch.from_numpy(codes.astype(np.int64)), "text": tokens[0], "negative_text": tokens[1]}


class RenderCollate:
    """Collate examples and render the whole batch of codes to normalised RGB in one vectorised call.

    Args:
        image_size: output side in pixels, a multiple of the 16-cell grid.
        mean, std: per-channel normalisation of the [0,1] rendered images.
    """

    def __init__(self, image_size: int, mean: tuple[float, ...], std: tuple[float, ...]):
        if image_size % GRID_SIZE:
            raise ValueError(f"image_size must be a multiple of the {GRID_SIZE}-cell grid, got {image_size}")
        self.codec = PaletteCodec(cell_pixels=image_size // GRID_SIZE)
        self.mean = torch.tensor(mean).view(1, 3, 1, 1)
        self.std = torch.tensor(std).view(1, 3, 1, 1)

    def __call__(self, examples: list[dict]) -> dict[str, torch.Tensor]:
        batch = {key: torch.stack([e[key] for e in examples]) for key in examples[0]}
        batch["image"] = (self.codec.decode(batch.pop("codes")) - self.mean) / self.std
        return batch


class ShapesCLIPDataModule(L.LightningDataModule):
    """The embedded shapes data as CLIP batches {"image", "text", "negative_text"}.

    Args:
        num_train: training examples per epoch (train split indices 0 .. num_train-1).
        num_val: validation examples (val split, which holds the held-out colour+shape pairs).
        batch_size: examples per batch (contrastive: every other caption of the batch is a negative).
        image_size: must equal the CLIP model's vision image_size.
        context_length: must equal the CLIP model's text context_length.
        mean, std: image normalisation (the module records the same values in its exported config).
        seed: shapes generator seed.
        num_workers: DataLoader worker processes (0 keeps everything in the main process).
    """

    def __init__(self, num_train: int = 20000, num_val: int = 512, batch_size: int = 128, image_size: int = 128,
                 context_length: int = 16, mean: tuple[float, float, float] = open_clip.OPENAI_DATASET_MEAN,
                 std: tuple[float, float, float] = open_clip.OPENAI_DATASET_STD, seed: int = 0, num_workers: int = 0):
        super().__init__()
        self.save_hyperparameters()

    def _loader(self, split: str, size: int, shuffle: bool) -> DataLoader:
        h = self.hparams
        dataset = ShapesCLIPDataset(split, size, h.context_length, h.seed)
        collate = RenderCollate(h.image_size, tuple(h.mean), tuple(h.std))
        return DataLoader(dataset, batch_size=h.batch_size, shuffle=shuffle, drop_last=shuffle, collate_fn=collate,
                          num_workers=h.num_workers, persistent_workers=h.num_workers > 0)

    def train_dataloader(self) -> DataLoader:
        return self._loader("train", self.hparams.num_train, shuffle=True)

    def val_dataloader(self) -> DataLoader:
        return self._loader("val", self.hparams.num_val, shuffle=False)
