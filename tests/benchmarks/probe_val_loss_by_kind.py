"""Where a tiny DALL-E's validation image loss sits: per kind of caption (one shape, two shapes) and per held-out
status, next to the loss a perfect model would still pay for the positions the generator draws at random.

The final `val/image_loss` mixes four kinds of examples; two-shape captions are the ones issue 28 asks to draw
right, and held-out pairs are never seen in training. This splits the loss of a checkpoint over the first
`--num-examples` validation examples (the same rows the recipe validates on: `recipes.shapes.generate_example`,
split "val", seed 0) so two checkpoints can be compared where it matters.

    python tests/benchmarks/probe_val_loss_by_kind.py --checkpoint runs/dalle_tiny/checkpoints [--checkpoint ...]

The floor column is the entropy per image code of the positions alone (a single shape: its jitter, 3 x 3 cells
big, 7 x 7 small; two shapes: 2 x 2 offsets inside the halves and 7 x 7 positions across), averaged over the
subset's examples: a model that knows everything else pays at least that.
"""

from __future__ import annotations

import argparse
import math
import sys
from collections import defaultdict
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from inference.checkpoint import load_dalle  # noqa: E402
from recipes.shapes import GRID_SIZE, generate_example  # noqa: E402

NUM_CODES = GRID_SIZE * GRID_SIZE


def position_entropy(labels: dict) -> float:
    """Nats a perfect model still pays per image for where the generator put the shapes."""
    if labels["kind"] == "single":
        return math.log(9 if labels["size"] == "big" else 49)
    return math.log(2 * 2 * 7 * 7)


def subset_names(labels: dict) -> list[str]:
    kind = "two-shape" if labels["kind"] == "pair" else "single"
    held = "held-out" if labels["held_out"] else "seen"
    return ["all", kind, held, f"{kind}, {held}"]


@torch.no_grad()
def losses_by_kind(checkpoint: str, num_examples: int, batch_size: int = 50) -> dict[str, dict[str, float]]:
    loaded = load_dalle(checkpoint)
    model, tokenizer = loaded.model, loaded.tokenizer
    sums, floors, counts = defaultdict(float), defaultdict(float), defaultdict(int)
    for start in range(0, num_examples, batch_size):
        examples = [generate_example(i, "val") for i in range(start, min(num_examples, start + batch_size))]
        text = tokenizer([caption for caption, _, _ in examples])
        image = torch.stack([torch.from_numpy(codes.astype("int64")).flatten() for _, codes, _ in examples])
        image_logits = model(text, image)[1]
        per_example = F.cross_entropy(image_logits.transpose(1, 2).float(), image, reduction="none").mean(1)
        for loss, (_, _, labels) in zip(per_example.tolist(), examples):
            for name in subset_names(labels):
                sums[name] += loss
                floors[name] += position_entropy(labels) / NUM_CODES
                counts[name] += 1
    return {name: {"examples": counts[name], "image_loss": sums[name] / counts[name],
                   "floor": floors[name] / counts[name]} for name in sums}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--checkpoint", action="append", required=True,
                        help="a checkpoint directory as inference.evaluate takes it (repeat to compare)")
    parser.add_argument("--num-examples", type=int, default=1000, help="validation examples (the recipe's 1000)")
    args = parser.parse_args(argv)
    torch.manual_seed(0)
    print("| checkpoint | subset | examples | image loss | floor (positions) | excess nats per image |")
    print("|---|---|---|---|---|---|")
    for checkpoint in args.checkpoint:
        for name, row in losses_by_kind(checkpoint, args.num_examples).items():
            excess = (row["image_loss"] - row["floor"]) * NUM_CODES
            print(f"| {checkpoint} | {name} | {row['examples']} | {row['image_loss']:.4f} | {row['floor']:.4f} | "
                  f"{excess:.1f} |", flush=True)


if __name__ == "__main__":
    main()
