"""Offline quality benchmark on the embedded shapes data: does CLIP reranking pick correct images?

    python -m inference.evaluate --checkpoint runs/dalle_tiny/checkpoints \\
        --clip-model checkpoints/clip_tiny --num-captions 32 --num-candidates 16 --json eval.json

For each of the first `num-captions` distinct validation captions (about half name a colour+shape pair
never seen in training), sample `num-candidates` images and judge each with `recipes.shapes.check_caption`.
Reported per subset (all; captions naming a held-out colour+shape pair; the others; single-shape captions;
two-shape captions):
- random_acc: accuracy of a random candidate (the mean correctness over all candidates),
- clip_top1_acc: accuracy of the candidate CLIP scores highest,
- best_of_n: share of captions with at least one correct candidate (the ceiling of any reranker),
- top1_gain: clip_top1_acc - random_acc, what reranking adds; gain_se: its standard error over the captions
  (the benchmark's noise from which captions are drawn; the sampling seed adds more),
- mean_clip: mean CLIP score of all candidates; top1_clip: mean score of CLIP's picks.

`--save-candidates FILE` writes the sampled codes (safetensors, captions and sampling settings in its
metadata); `--candidates FILE` scores those same pictures again instead of sampling (seconds instead of
minutes), e.g. to compare two CLIPs on identical candidates.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from tqdm.auto import tqdm

from inference.checkpoint import LoadedDALLE, load_dalle
from inference.options import add_sampling_arguments
from inference.rerank import CLIPReranker
from inference.sampling import sample_codes
from recipes.shapes import check_caption, generate_example, parse_caption


def validation_captions(num_captions: int, seed: int = 0, split: str = "val") -> list[tuple[str, bool]]:
    """The first `num_captions` distinct captions of the shapes `split`, each with its held-out flag.

    Args:
        num_captions: how many distinct captions to return.
        seed: the shapes generator seed the DALL-E data was written with (0 for the recipes' defaults).
        split: "val" (held-out combinations included) or "train".
    """
    captions, seen = [], set()
    index = 0
    while len(captions) < num_captions:
        if index > 100 * num_captions + 1000:
            raise ValueError(f"the {split} split has fewer than {num_captions} distinct captions")
        caption, _, labels = generate_example(index, split, seed)
        index += 1
        if caption not in seen:
            seen.add(caption)
            captions.append((caption, bool(labels["held_out"])))
    return captions


@torch.no_grad()
def score_candidates(dalle: LoadedDALLE, reranker: CLIPReranker, captions: list[str], num_candidates: int,
                     batch_size: int = 16, seed: int = 0, candidates: torch.Tensor | None = None,
                     **sampling) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Sample `num_candidates` images per caption (rows of several captions share a batch) and judge them.

    Returns (correct BoolTensor [C, N], clip_scores FloatTensor [C, N], codes LongTensor [C, N, codes]) for
    C captions and N candidates. `candidates` (codes [C, N, codes], e.g. from `load_candidates`) are scored
    instead of sampling new ones. `sampling` holds temperature, top_k, top_p, guidance_scale (see
    `inference.sampling.sample_codes`).
    """
    device = dalle.model.image_emb.weight.device
    generator = torch.Generator(device=device).manual_seed(seed)
    tokens = dalle.tokenizer(captions).to(device)
    rows = torch.arange(len(captions)).repeat_interleave(num_candidates)  # caption index of every candidate
    if candidates is not None and tuple(candidates.shape[:2]) != (len(captions), num_candidates):
        raise ValueError(f"candidates hold {tuple(candidates.shape[:2])} captions x images, "
                         f"expected {(len(captions), num_candidates)}")
    correct = torch.zeros(len(rows), dtype=torch.bool)
    scores = torch.zeros(len(rows))
    all_codes = torch.zeros(len(rows), dalle.model.config.num_image, dtype=torch.long)
    with tqdm(total=len(rows), desc="candidates", unit="img") as progress:
        for start in range(0, len(rows), batch_size):
            batch = rows[start : start + batch_size]
            if candidates is None:
                codes = sample_codes(dalle.model, tokens[batch.to(device)], generator=generator, **sampling)
            else:
                codes = candidates.flatten(0, 1)[start : start + len(batch)].to(device)
            all_codes[start : start + len(batch)] = codes.cpu()
            batch_captions = [captions[i] for i in batch.tolist()]
            scores[start : start + len(batch)] = reranker.score_pairs(dalle.decode(codes), batch_captions)
            for offset, caption in enumerate(batch_captions):
                correct[start + offset] = check_caption(caption, codes[offset].cpu())
            progress.update(len(batch))
    shape = (len(captions), num_candidates)
    return correct.view(shape), scores.view(shape), all_codes.view(*shape, -1)


def save_candidates(path: str | Path, captions: list[str], codes: torch.Tensor, settings: dict) -> None:
    """Write sampled candidates (codes [C, N, codes]) as safetensors; captions and settings go in its metadata."""
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    metadata = {"captions": json.dumps(captions), "settings": json.dumps(settings)}
    save_file({"codes": codes.to(torch.int16).contiguous()}, str(path), metadata=metadata)


def load_candidates(path: str | Path, captions: list[str], num_candidates: int) -> torch.Tensor:
    """Codes LongTensor [C, N, codes] of `save_candidates`'s file for these captions (the file's first C
    captions must be them) and its first `num_candidates` candidates each."""
    with safe_open(str(path), framework="pt") as file:
        saved = json.loads(file.metadata()["captions"])
        codes = file.get_tensor("codes").long()
    if saved[: len(captions)] != captions or codes.shape[1] < num_candidates:
        raise ValueError(f"{path} holds {len(saved)} captions x {codes.shape[1]} candidates that do not start with "
                         f"these {len(captions)} captions x {num_candidates} (other --num-captions or --data-seed?)")
    return codes[: len(captions), :num_candidates]


def summarize(correct: torch.Tensor, scores: torch.Tensor) -> dict[str, float]:
    """Accuracy of a random candidate, of CLIP's top-1, best-of-N, the top-1 gain over random (with its standard
    error over captions; 0 for a single caption) and CLIP scores for [C, N] results."""
    top1 = scores.argmax(-1)
    picked = correct.gather(1, top1[:, None]).squeeze(1)
    gains = picked.float() - correct.float().mean(-1)  # per caption: CLIP's pick against a random candidate
    num_captions = int(correct.shape[0])
    return {
        "captions": num_captions,
        "random_acc": correct.float().mean().item(),
        "clip_top1_acc": picked.float().mean().item(),
        "best_of_n": correct.any(-1).float().mean().item(),
        "top1_gain": gains.mean().item(),
        "gain_se": (gains.std() / num_captions**0.5).item() if num_captions > 1 else 0.0,
        "mean_clip": scores.mean().item(),
        "top1_clip": scores.gather(1, top1[:, None]).mean().item(),
    }


def format_table(report: dict[str, dict]) -> str:
    """A fixed-width text table of `summarize` results, one row per subset."""
    columns = ["captions", "random_acc", "clip_top1_acc", "best_of_n", "top1_gain", "gain_se", "mean_clip", "top1_clip"]
    lines = [f"{'subset':<12}" + "".join(f"{c:>14}" for c in columns)]
    for subset, row in report.items():
        cells = "".join(f"{row[c]:>14d}" if c == "captions" else f"{row[c]:>14.3f}" for c in columns)
        lines.append(f"{subset:<12}{cells}")
    return "\n".join(lines)


def evaluate(dalle: LoadedDALLE, reranker: CLIPReranker, num_captions: int = 32, num_candidates: int = 16,
             data_seed: int = 0, items: list[tuple[str, bool]] | None = None,
             **kwargs) -> tuple[dict[str, dict], torch.Tensor]:
    """Run the benchmark; returns ({"all": ..., "held_out": ..., "not_held_out": ..., "single": ..., "pair": ...}
    rows of `summarize` (subsets without captions are left out), the candidates' codes [C, N, codes]).
    `items` are `validation_captions(num_captions, data_seed)` if the caller already has them.
    `kwargs` are those of `score_candidates` (batch_size, seed, candidates, sampling arguments)."""
    if items is None:
        items = validation_captions(num_captions, data_seed)
    correct, scores, codes = score_candidates(dalle, reranker, [c for c, _ in items], num_candidates, **kwargs)
    held_out = torch.tensor([h for _, h in items])
    single = torch.tensor([parse_caption(c)["kind"] == "single" for c, _ in items])
    report = {"all": summarize(correct, scores)}
    for name, mask in (("held_out", held_out), ("not_held_out", ~held_out), ("single", single), ("pair", ~single)):
        if mask.any():
            report[name] = summarize(correct[mask], scores[mask])
    return report, codes


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    add_sampling_arguments(parser, checkpoint_help="a DALL-E trained on shapes", num_candidates=16, batch_size=32,
                           top_k=0)
    parser.add_argument("--num-captions", type=int, default=128,
                        help="distinct validation captions (the gain's standard error is ~5 points at 32, ~3 at 128)")
    parser.add_argument("--data-seed", type=int, default=0, help="seed the shapes data was generated with")
    parser.add_argument("--json", default=None, help="also write the report (and the settings) to this JSON file")
    parser.add_argument("--save-candidates", default=None, help="also write the sampled codes to this .safetensors file")
    parser.add_argument("--candidates", default=None,
                        help="score the codes of a --save-candidates file instead of sampling (sampling options unused)")
    return parser


def main(argv: list[str] | None = None) -> dict[str, dict]:
    args = build_parser().parse_args(argv)
    dalle = load_dalle(args.checkpoint, args.device, tuple(args.allow_model_packages), args.authority_public_key)
    reranker = CLIPReranker.load(args.clip_model, args.clip_pretrained, args.device)
    items = validation_captions(args.num_captions, args.data_seed)
    captions = [caption for caption, _ in items]
    candidates = load_candidates(args.candidates, captions, args.num_candidates) if args.candidates else None
    report, codes = evaluate(dalle, reranker, args.num_captions, args.num_candidates, args.data_seed, items=items,
                             batch_size=args.batch_size, seed=args.seed, candidates=candidates,
                             temperature=args.temperature, top_k=args.top_k or None, top_p=args.top_p,
                             guidance_scale=args.guidance_scale)
    if args.save_candidates:
        save_candidates(args.save_candidates, captions, codes, vars(args))
    source = f"the candidates of {args.candidates}" if args.candidates else f"{args.num_candidates} candidates"
    print(f"{args.num_captions} validation captions x {source}, CLIP {args.clip_model}")
    print(format_table(report))
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps({"settings": vars(args), "report": report}, indent=2) + "\n")
    return report


if __name__ == "__main__":
    main()
