"""What a tiny DALL-E draws for the colour/shape pairs it never saw, and why its two-shape pictures fail.

- Held-out single-shape captions ("a big red triangle", `--samples` each): the colour and shape the caption checker
  reads in each sample, tallied: right, the right colour in another shape, the right shape in another colour, both
  wrong, or no single readable shape; which one it is says what the model failed to combine.
- Evaluate's two-shape captions, seen and held out (`--pair-samples` each): why each sample fails the checker (the
  number of shapes, an unreadable shape, a colour, the shapes swapped between the colours, both drawn as one shape,
  a third shape, the relation).
- First, how many of evaluate's two-shape captions name a held-out pair, and so the best two-shape accuracy of a
  model that draws none of them right.

    python tests/benchmarks/probe_held_out_errors.py --checkpoint runs/dalle_tiny/checkpoints [--samples 16]
"""

from __future__ import annotations

import argparse
import sys
from collections import Counter
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from inference.checkpoint import load_dalle  # noqa: E402
from inference.sampling import sample_codes  # noqa: E402
from inference.evaluate import validation_captions  # noqa: E402
from recipes.shapes import HELD_OUT_PAIRS, SIZES, check_caption, find_blobs, parse_caption  # noqa: E402


NUM_CAPTIONS = 128  # inference.evaluate's --num-captions default


def two_shape_captions(num_captions: int = NUM_CAPTIONS) -> list[tuple[str, bool]]:
    """(caption, held out) of the two-shape captions among evaluate's first `num_captions` validation captions."""
    return [(caption, held) for caption, held in validation_captions(num_captions)
            if parse_caption(caption)["kind"] == "pair"]


def two_shape_ceiling(num_captions: int = NUM_CAPTIONS) -> tuple[int, int, float]:
    """(two-shape captions, of them held out, the best two-shape accuracy of a model that draws every seen pair
    right and no held-out pair) over evaluate's first `num_captions` validation captions."""
    pairs = [held for _, held in two_shape_captions(num_captions)]
    return len(pairs), sum(pairs), (len(pairs) - sum(pairs)) / len(pairs)


def outcome(wanted_colour: str, wanted_shape: str, codes: torch.Tensor) -> str:
    blobs = find_blobs(codes)
    if len(blobs) != 1:
        return f"{len(blobs)} shapes"
    colour, shape = blobs[0]["colour"], blobs[0]["shape"]
    if shape is None:
        return "unreadable shape"
    if (colour, shape) == (wanted_colour, wanted_shape):
        return "right"
    if colour == wanted_colour:
        return "right colour, other shape"
    if shape == wanted_shape:
        return "right shape, other colour"
    return "both wrong"


def pair_outcome(caption: str, codes: torch.Tensor) -> str:
    """Why a two-shape drawing fails the checker, in the order `check_caption` tests: the number of shapes, a shape
    it cannot read, the wanted colour+shape pairs, the relation."""
    if check_caption(caption, codes):
        return "right"
    wanted, blobs = parse_caption(caption), find_blobs(codes)
    if len(blobs) != 2:
        return f"{len(blobs)} shapes"
    if any(blob["shape"] is None for blob in blobs):
        return "unreadable shape"
    found = {(blob["colour"], blob["shape"]) for blob in blobs}
    missing = [(obj["colour"], obj["shape"]) for obj in wanted["objects"] if (obj["colour"], obj["shape"]) not in found]
    if missing:
        if sorted(blob["colour"] for blob in blobs) != sorted(obj["colour"] for obj in wanted["objects"]):
            return "a colour wrong"
        if sorted(blob["shape"] for blob in blobs) == sorted(obj["shape"] for obj in wanted["objects"]):
            return "shapes swapped between the colours"
        if blobs[0]["shape"] == blobs[1]["shape"] and blobs[0]["shape"] in [obj["shape"] for obj in wanted["objects"]]:
            return "colours right, both drawn as one of the shapes"
        return "colours right, a shape wrong"
    return "relation wrong"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--checkpoint", required=True, help="a checkpoint directory as inference.evaluate takes it")
    parser.add_argument("--samples", type=int, default=16, help="samples per held-out single-shape caption (0: skip)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--pair-samples", type=int, default=4,
                        help="samples of each of evaluate's two-shape captions (seen and held out), tallied by why "
                             "they fail (0: skip)")
    args = parser.parse_args(argv)
    pairs, held_out, ceiling = two_shape_ceiling()
    print(f"evaluate's {NUM_CAPTIONS} captions: {pairs} two-shape, {held_out} of them held out: without held-out pairs drawn "
          f"right, two-shape accuracy is at most {ceiling:.3f}")
    loaded = load_dalle(args.checkpoint)
    generator = torch.Generator().manual_seed(args.seed)
    totals: Counter = Counter()
    drawn: Counter = Counter()  # what the wrong single shapes were
    for colour, shape in sorted(HELD_OUT_PAIRS) if args.samples else ():
        for size in SIZES:
            caption = f"a {size} {colour} {shape}"
            text = loaded.tokenizer([caption] * args.samples)
            codes = sample_codes(loaded.model, text, generator=generator)
            outcomes = Counter()
            for row in codes:
                result = outcome(colour, shape, row)
                outcomes[result] += 1
                if result in ("right colour, other shape", "right shape, other colour", "both wrong"):
                    blob = find_blobs(row)[0]
                    drawn[f"{colour} {shape} -> {blob['colour']} {blob['shape']}"] += 1
            totals.update(outcomes)
            print(f"{caption:28s} " + ", ".join(f"{k}: {v}" for k, v in outcomes.most_common()), flush=True)
    n = sum(totals.values())
    if n:
        print("\nall held-out single-shape samples: " + ", ".join(f"{k}: {v / n:.2f}" for k, v in totals.most_common()))
        print("most drawn instead: " + ", ".join(f"{k} ({v})" for k, v in drawn.most_common(8)))
    if args.pair_samples:
        tallies = {True: Counter(), False: Counter()}
        for caption, held in two_shape_captions():
            codes = sample_codes(loaded.model, loaded.tokenizer([caption] * args.pair_samples), generator=generator)
            tallies[held].update(pair_outcome(caption, row) for row in codes)
        for held, tally in tallies.items():
            n = sum(tally.values())
            print(f"two-shape captions, {'held out' if held else 'seen'} ({n} samples): "
                  + ", ".join(f"{k}: {v / n:.2f}" for k, v in tally.most_common()))


if __name__ == "__main__":
    main()
