"""What a shapes CLIP can tell apart: per hard-negative kind, on clean pictures and on a DALL-E's samples.

    python tests/benchmarks/probe_clip_negatives.py --clip-model checkpoints/clip_tiny \\
        [--candidates cands.safetensors]   # saved by inference.evaluate --save-candidates

Prints, on clean pictures of the first `--num-examples` validation examples:
- per kind of hard negative (`recipes.clip.data.NEGATIVE_KINDS`), how often the picture scores its caption above
  the negative caption ("text") and the caption scores its picture above the negative's picture ("picture");
  0.5 is chance;
- the mean cosine between a two-shape caption's embedding and its relation-reversed caption's ("a red circle
  to the left of a blue square" against "... to the right of ..."), and between a picture and the picture with
  the two shapes' places swapped: 1.000 means the model cannot see the difference at all.
With `--candidates`, also on the DALL-E's two-shape samples that show both named colours: how often CLIP prefers
the right one of (sample, the sample with its two colours swapped) when exactly one of them shows the caption,
i.e. whether it binds each colour to its shape and place on sloppy pictures (with the relation unseen, what it
gets right comes from the colour+shape pairs).
"""

import argparse
import collections
import json

import numpy as np
import torch
from safetensors import safe_open

from inference.rerank import CLIPReranker
from recipes.clip.data import NEGATIVE_KINDS, caption_of, draw, hard_negative, negative_kinds
from recipes.shapes import COLOUR_CODES, GRID_SIZE, PaletteCodec, check_caption, find_blobs, generate_example, parse_caption


def clean_picture_figures(reranker: CLIPReranker, codec: PaletteCodec, num_examples: int) -> None:
    rng = np.random.default_rng(0)
    text_hits, picture_hits = collections.defaultdict(list), collections.defaultdict(list)
    caption_cos, picture_cos = [], []
    for index in range(num_examples):
        caption, codes, labels = generate_example(index, "val")
        kinds = negative_kinds(labels)
        negatives = [hard_negative(labels, kind, rng) for kind in kinds]
        captions = [caption] + [caption_of(n) for n in negatives]
        pictures = codec.decode(torch.from_numpy(np.stack([codes] + [draw(n) for n in negatives]).astype(np.int64)))
        texts, images = reranker.embed_texts(captions).cpu(), reranker.embed_images(pictures).cpu()
        scores = images @ texts.T  # [pictures, captions]: row 0 is the example's picture, column 0 its caption
        for column, kind in enumerate(kinds, start=1):
            text_hits[kind].append(bool(scores[0, 0] > scores[0, column]))
            picture_hits[kind].append(bool(scores[0, 0] > scores[column, 0]))
        if labels["kind"] == "pair":
            relation = kinds.index("relation") + 1
            caption_cos.append(float(texts[0] @ texts[relation]))
            picture_cos.append(float(images[0] @ images[relation]))
    print(f"clean pictures of {num_examples} validation examples: accuracy against each kind of hard negative")
    print(f"  {'kind':14s} {'text':>6s} {'picture':>8s}")
    for kind in NEGATIVE_KINDS:
        if text_hits[kind]:
            print(f"  {kind:14s} {np.mean(text_hits[kind]):6.3f} {np.mean(picture_hits[kind]):8.3f}")
    print(f"cosine(caption, relation-reversed caption) {np.mean(caption_cos):.3f}; "
          f"cosine(picture, picture with the two shapes' places swapped) {np.mean(picture_cos):.3f}")


def binding_on_samples(reranker: CLIPReranker, codec: PaletteCodec, path: str) -> None:
    with safe_open(path, framework="pt") as file:
        captions, codes = json.loads(file.metadata()["captions"]), file.get_tensor("codes").long()
    samples, swapped, sample_captions, correct = [], [], [], []
    for caption, caption_codes in zip(captions, codes):
        wanted = parse_caption(caption)
        if wanted["kind"] != "pair":
            continue
        first, second = (COLOUR_CODES[o["colour"]] for o in wanted["objects"])
        for grid in caption_codes.view(-1, GRID_SIZE, GRID_SIZE):
            if {b["colour"] for b in find_blobs(grid)} != {o["colour"] for o in wanted["objects"]}:
                continue
            other = grid.clone()
            other[grid == first], other[grid == second] = second, first
            samples.append(grid)
            swapped.append(other)
            sample_captions.append(caption)
            correct.append((check_caption(caption, grid), check_caption(caption, other)))
    correct = torch.tensor(correct)
    with torch.no_grad():
        score = [torch.cat([reranker.score_pairs(codec.decode(torch.stack(grids[i : i + 64])), sample_captions[i : i + 64])
                            for i in range(0, len(grids), 64)]) for grids in (samples, swapped)]
    one_right = correct[:, 0] != correct[:, 1]
    prefers_sample = score[0] > score[1]
    right = (prefers_sample == correct[:, 0])[one_right].float().mean()
    print(f"{path}: {len(samples)} two-shape samples with both colours; of the {int(one_right.sum())} where exactly one "
          f"of (sample, colours swapped) shows the caption, CLIP prefers that one {right:.3f} of the time (0.5 = chance)")


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--clip-model", default="checkpoints/clip_tiny")
    parser.add_argument("--num-examples", type=int, default=512)
    parser.add_argument("--candidates", default=None, help="codes saved by inference.evaluate --save-candidates")
    args = parser.parse_args()
    reranker = CLIPReranker.load(args.clip_model, None, "cpu")
    codec = PaletteCodec()
    clean_picture_figures(reranker, codec, args.num_examples)
    if args.candidates:
        binding_on_samples(reranker, codec, args.candidates)


if __name__ == "__main__":
    main()
