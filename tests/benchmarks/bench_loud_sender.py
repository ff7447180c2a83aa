"""How far one loud sender moves a 3-sender part under the alignment screen (figures printed, nothing asserted).

Random parts of 1-9 values (a small model's slices, as in round 0 of tests/lightning_swarm/test_byzantine_swarm.py):
a true gradient plus noise up to twice its scale for each of 3 senders with random sample counts, the third
multiplied by each of ``--multipliers``; aggregated by :func:`lightning_swarm.aggregation.aligned_centered_clip`
(min_alignment 0.5, as the README advises for open swarms), once with the reducer sending no part of its own and once
as the loud sender's own reducer (``own``, with the exact-combination statement the swarm makes). Printed per
multiplier: the result's distance from the two honest parts' mean, over their spread (median, p99, max).

    python tests/benchmarks/bench_loud_sender.py [--trials 3000] [--max-samples 400]
"""

import argparse

import numpy as np
import torch

from lightning_swarm.aggregation import DEFAULT_MIN_ALIGNMENT, aligned_centered_clip


def distances(multiplier: float, trials: int, max_samples: int, own) -> np.ndarray:
    torch.manual_seed(0)
    out = []
    for _ in range(trials):
        size = int(torch.randint(1, 10, ()))
        true = torch.randn(size)
        noise = float(torch.rand(())) * 2
        first, second, third = (true + noise * torch.randn(size) for _ in range(3))
        weights = [float(w) for w in torch.randint(16, max_samples, (3,))]
        result, _, _ = aligned_centered_clip([first, second, multiplier * third], weights,
                                             min_alignment=DEFAULT_MIN_ALIGNMENT,
                                             statement=None if own is None else [], own=own)
        out.append(float((result - (first + second) / 2).norm()) / max(float((first - second).norm()), 1e-9))
    return np.array(out)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--trials", type=int, default=3000)
    parser.add_argument("--max-samples", type=int, default=400, help="sample counts are drawn from [16, this)")
    parser.add_argument("--multipliers", type=float, nargs="+", default=[1e3, -1e3, 10.0])
    args = parser.parse_args()
    print(f"{args.trials} random 3-sender parts of 1-9 values, 16-{args.max_samples} samples each; "
          "distance from the honest mean / the honest spread")
    for own, label in ((None, "reducer sends no part"), (2, "the loud sender reduces")):
        for multiplier in args.multipliers:
            d = distances(multiplier, args.trials, args.max_samples, own)
            print(f"{label:24s} x{multiplier:<8g} median {np.median(d):.2f}  p99 {np.quantile(d, 0.99):.2f}  "
                  f"max {d.max():.2f}")


if __name__ == "__main__":
    main()
