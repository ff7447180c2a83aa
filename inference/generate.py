"""CLIP-reranked text-to-image sampling from a DALL-E checkpoint.

    python -m inference.generate --checkpoint runs/dalle_tiny/checkpoints \\
        --prompt "a big red circle" --prompt "a blue cross above a green square" \\
        --num-candidates 128 --keep 4 --top-k 256 --clip-model checkpoints/clip_tiny --out samples

For each prompt: sample `num-candidates` images in batches (key/value cache), score each with CLIP,
keep the best `keep`, and write `OUT/NN_prompt-words.png` (a grid, best first) plus `OUT/results.json`
(each kept image's candidate index and CLIP score). Real use: `--clip-model ViT-B-32 --clip-pretrained openai`.
"""

from __future__ import annotations

import argparse
import warnings
from pathlib import Path

import torch
from tqdm.auto import tqdm

from inference.checkpoint import LoadedDALLE, load_dalle
from inference.grid import prompt_slug, save_grid, save_results
from inference.options import add_sampling_arguments
from inference.rerank import CLIPReranker, rerank
from inference.sampling import sample_codes


@torch.no_grad()
def sample_and_score(
    dalle: LoadedDALLE,
    reranker: CLIPReranker | None,
    prompt: str,
    num_candidates: int,
    batch_size: int = 16,
    temperature: float = 1.0,
    top_k: int | None = None,
    top_p: float | None = None,
    guidance_scale: float = 1.0,
    generator: torch.Generator | None = None,
    progress: tqdm | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Sample `num_candidates` images for `prompt` in batches of `batch_size` and CLIP-score them.

    Returns (codes LongTensor [num_candidates, N], scores FloatTensor [num_candidates] or None without a
    reranker). Sampling arguments are those of `inference.sampling.sample_codes`; `progress` is advanced
    by each finished batch.
    """
    device = dalle.model.image_emb.weight.device
    text = dalle.tokenizer([prompt]).to(device)
    unknown = dalle.model.unknown_text_ids(text)
    if unknown:  # a compact text vocabulary (e.g. the tiny recipe's shapes words) has no row for these
        warnings.warn(f"prompt {prompt!r}: the model knows none of the words {dalle.tokenizer.bpe.decode(unknown)!r} "
                      f"(outside its text vocabulary); it reads each of them as one unknown word", stacklevel=2)
    all_codes, all_scores = [], []
    for start in range(0, num_candidates, batch_size):
        count = min(batch_size, num_candidates - start)
        codes = sample_codes(dalle.model, text.expand(count, -1), temperature, top_k, top_p, guidance_scale,
                             use_cache=True, generator=generator)
        all_codes.append(codes.cpu())
        if reranker is not None:
            all_scores.append(reranker.score(dalle.decode(codes), prompt))
        if progress is not None:
            progress.update(count)
    return torch.cat(all_codes), (torch.cat(all_scores) if reranker is not None else None)


def generate(
    dalle: LoadedDALLE,
    reranker: CLIPReranker,
    prompts: list[str],
    out_dir: str | Path,
    num_candidates: int = 128,
    keep: int = 4,
    seed: int = 0,
    **sampling,
) -> list[dict]:
    """Sample, rerank and save every prompt; returns the results written to `out_dir/results.json`.

    Args:
        dalle: the loaded DALL-E (model, tokenizer, codec).
        reranker: the CLIP that scores candidates.
        prompts: captions to draw.
        out_dir: directory for the PNG grids and results.json.
        num_candidates: images sampled per prompt.
        keep: images kept per prompt (the best CLIP scores), shown best first.
        seed: seeds the sampling generator (same seed and arguments, same images).
        **sampling: batch_size, temperature, top_k, top_p, guidance_scale (see `sample_and_score`).
    """
    if num_candidates < 1 or not 1 <= keep <= num_candidates:
        raise ValueError(f"need num_candidates >= 1 and 1 <= keep <= num_candidates, got {num_candidates}, {keep}")
    out_dir = Path(out_dir)
    device = dalle.model.image_emb.weight.device
    generator = torch.Generator(device=device).manual_seed(seed)
    results = []
    with tqdm(total=num_candidates * len(prompts), desc="candidates", unit="img") as progress:
        for index, prompt in enumerate(prompts):
            codes, scores = sample_and_score(dalle, reranker, prompt, num_candidates, generator=generator,
                                             progress=progress, **sampling)
            best = rerank(scores, keep)
            grid_path = save_grid(dalle.decode(codes[best].to(device)), out_dir / f"{prompt_slug(prompt, index)}.png")
            results.append({
                "prompt": prompt,
                "grid": grid_path.name,
                "num_candidates": num_candidates,
                "kept": [{"rank": rank + 1, "candidate": int(i), "clip_score": round(float(scores[i]), 4)}
                         for rank, i in enumerate(best)],
            })
    save_results(results, out_dir / "results.json")
    return results


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    add_sampling_arguments(parser, checkpoint_help="the DALL-E", num_candidates=128, batch_size=16, top_k=256)
    parser.add_argument("--prompt", action="append", required=True, help="a caption; repeat for several")
    parser.add_argument("--keep", type=int, default=4, help="best images kept per prompt")
    parser.add_argument("--out", default="samples", help="output directory for grids and results.json")
    return parser


def main(argv: list[str] | None = None) -> list[dict]:
    args = build_parser().parse_args(argv)
    dalle = load_dalle(args.checkpoint, args.device, tuple(args.allow_model_packages), args.authority_public_key)
    reranker = CLIPReranker.load(args.clip_model, args.clip_pretrained, args.device)
    results = generate(dalle, reranker, args.prompt, args.out, args.num_candidates, args.keep, args.seed,
                       batch_size=args.batch_size, temperature=args.temperature, top_k=args.top_k or None,
                       top_p=args.top_p, guidance_scale=args.guidance_scale)
    for result in results:
        scores = ", ".join(f"{k['clip_score']:.2f}" for k in result["kept"])
        print(f"{args.out}/{result['grid']}: {result['prompt']!r} (CLIP scores {scores})")
    return results


if __name__ == "__main__":
    main()
