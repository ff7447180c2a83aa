"""Peak memory of one DALL-E training step at depth 4 vs 16, reversible on and off (CPU).

Each configuration runs in a fresh subprocess: build the model and the batch, record the resident set size,
run one forward + backward, and report the growth of peak RSS (``ru_maxrss``) over the RSS after the build
(activations + gradients; parameters are counted only once they get gradients). Layers are weight-shared
(4 blocks whatever the depth), so the gradient memory does not grow with depth either: the growth from
depth 4 to 16 is activation memory. Goal: reversible grows by at most 15% from depth 4 to 16.
The workers run with ``MALLOC_MMAP_THRESHOLD_=65536`` so glibc returns freed large buffers to the OS: with its
default dynamic threshold, freed activations stay in a fragmented heap and peak RSS grows with the number of
allocations made, even in a no-grad forward, which would measure the allocator rather than the model.

    python tests/benchmarks/bench_dalle_memory.py [--dim 256] [--batch-size 8]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys


def rss_mib() -> float:
    with open("/proc/self/statm") as statm:
        pages = int(statm.read().split()[1])
    return pages * resource.getpagesize() / 2**20


def worker(depth: int, reversible: bool, dim: int, batch_size: int) -> dict:
    import torch

    from recipes.dalle.model import DALLE, DALLEConfig

    torch.set_num_threads(2)
    torch.manual_seed(0)
    config = DALLEConfig(dim=dim, depth=depth, heads=4, dim_head=64, text_seq_len=64, image_vocab_size=1024,
                         image_grid_size=16, shared_layer_ids=(0, 1, 2, 3), last_layer_conv=False,
                         reversible=reversible)
    model = DALLE(config)
    text = torch.randint(1, config.text_vocab_size, (batch_size, config.text_seq_len))
    image = torch.randint(0, config.image_vocab_size, (batch_size, config.num_image))
    model.tables(torch.device("cpu"))  # masks and rotary tables are part of the model, not the step
    before = rss_mib()
    model.compute_loss(text, image)["loss"].backward()
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB -> MiB on Linux
    # the build's own peak is below the step's (the step adds activations and gradients on top of the model)
    return {"depth": depth, "reversible": reversible, "rss_after_build_mib": before,
            "step_peak_growth_mib": peak - before}


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dim", type=int, default=256, help="model width")
    parser.add_argument("--batch-size", type=int, default=8, help="training batch size")
    parser.add_argument("--depths", type=int, nargs="+", default=[4, 16], help="depths to compare")
    parser.add_argument("--worker", nargs=2, metavar=("DEPTH", "REVERSIBLE"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        print(json.dumps(worker(int(args.worker[0]), args.worker[1] == "1", args.dim, args.batch_size)))
        return
    results = {}
    for reversible in (True, False):
        for depth in args.depths:
            command = [sys.executable, __file__, "--worker", str(depth), str(int(reversible)),
                       "--dim", str(args.dim), "--batch-size", str(args.batch_size)]
            env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="65536")
            out = subprocess.run(command, check=True, capture_output=True, text=True, env=env).stdout
            results[reversible, depth] = json.loads(out.strip().splitlines()[-1])
    print(f"dim={args.dim} batch={args.batch_size} text=64 grid=16x16; peak RSS growth of one training step (MiB)")
    print(f"{'reversible':>10} " + " ".join(f"{'depth ' + str(d):>10}" for d in args.depths) + f" {'growth':>8}")
    for reversible in (True, False):
        values = [results[reversible, d]["step_peak_growth_mib"] for d in args.depths]
        growth = values[-1] / values[0] - 1
        print(f"{str(reversible):>10} " + " ".join(f"{v:10.1f}" for v in values) + f" {growth:+8.0%}")


if __name__ == "__main__":
    main()
