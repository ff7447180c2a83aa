"""Sampling speed of the DALL-E with and without the key/value cache (prints figures; not a test).

Config "bench-small" (the same as ../shared/peers/dalle_pytorch_anchor.py, which prints DALLE-pytorch
1.6.6's seconds per image): dim 256, depth 8, 4 heads of 64, text 64 tokens, 16x16 grid, 1024 codes,
axial row/col/row/row, 4 shared blocks, reversible, rotary (no conv last layer, like the anchor).

    python tests/benchmarks/bench_sampling.py [--threads 2] [--batch-sizes 1 16] [--top-k 102]

Each figure is one full image (256 codes) per row; the first call warms up. Without the cache every code
costs one full-sequence forward, so `--no-cache-codes 32` times 32 codes and scales by 256/32. top-k 102 = DALLE-pytorch's
filter_thres=0.9 on 1024 codes. Sampling only (no codec decode; the anchor's includes its small dVAE).
"""

from __future__ import annotations

import argparse
import time

import torch

from inference.sampling import sample_codes
from recipes.dalle.model import DALLE, DALLEConfig

BENCH_SMALL = dict(dim=256, depth=8, heads=4, dim_head=64, text_seq_len=64, image_vocab_size=1024,
                   image_grid_size=16, attn_types=("axial_row", "axial_col", "axial_row", "axial_row"),
                   last_layer_conv=False, shared_layer_ids=(0, 1, 2, 3), reversible=True, rotary=True)


class StopSampling(Exception):
    pass


def images_per_second(model: DALLE, batch_size: int, use_cache: bool, top_k: int, repeats: int = 1,
                      max_codes: int | None = None) -> float:
    """Images per second of `sample_codes`; with `max_codes`, time only the first codes and scale to the
    full image (valid without the cache, where every code costs the same full-sequence forward)."""
    text = torch.randint(1, 49408, (batch_size, model.config.text_seq_len))
    num_codes = model.config.num_image if max_codes is None else min(max_codes, model.config.num_image)

    def stop_early(j: int) -> None:
        if j + 1 == num_codes:
            raise StopSampling

    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        try:
            sample_codes(model, text, top_k=top_k, use_cache=use_cache, generator=torch.Generator().manual_seed(0),
                         on_step=stop_early)
        except StopSampling:
            pass
        best = min(best, (time.perf_counter() - start) * model.config.num_image / num_codes)
    return batch_size / best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=int, default=2, help="torch CPU threads")
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 16], help="images sampled together")
    parser.add_argument("--top-k", type=int, default=102, help="top-k filter")
    parser.add_argument("--repeats", type=int, default=2, help="timed runs per cached figure (best is kept)")
    parser.add_argument("--no-cache-codes", type=int, default=None,
                        help="time only this many codes without the cache and scale to 256 (default: all)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    model = DALLE(DALLEConfig(**BENCH_SMALL)).eval()
    print(f"bench-small: {model.num_parameters() / 1e6:.2f}M unique params, threads={args.threads}")
    sample_codes(model, torch.ones(1, 64, dtype=torch.long), use_cache=True)  # warm-up
    for batch_size in args.batch_sizes:
        cached = images_per_second(model, batch_size, True, args.top_k, args.repeats)
        full = images_per_second(model, batch_size, False, args.top_k, max_codes=args.no_cache_codes)  # one run
        print(f"batch {batch_size:>3}: with cache {cached:8.3f} img/s ({1 / cached:7.3f} s/img) | "
              f"without cache {full:8.3f} img/s ({1 / full:7.3f} s/img) | cache speed-up {cached / full:5.1f}x")


if __name__ == "__main__":
    main()
