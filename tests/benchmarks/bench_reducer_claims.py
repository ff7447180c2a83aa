"""What a reducer's claims on its own slice cost next to a member's reports (issue 24, item 9: framing), CPU time.

    PYTHONPATH=$PWD python tests/benchmarks/bench_reducer_claims.py [--params 25000000] [--peers 3] [--repeat 3]

A group of ``--peers`` senders averages ``--params`` values; each reduces a slice of params / peers values in parts
of 2**17 values (uncompressed, the weighted mean). Prints, in one torch thread, the median ``time.process_time`` of

- ``reducer_claims`` on one slice: the projections of the other peers - 1 senders' residuals (what the reducer adds);
- ``member_report`` on the other peers - 1 reducers' slices (what every member already computes);
- both, as the members compute them: part index by part index, each index's sign vectors drawn once (SignSource).
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
import torch

from lightning_swarm import reducer_checks as rc

PART = 2 ** 17


def cpu_seconds(function, repeat: int) -> float:
    times = []
    for _ in range(repeat):
        start = time.process_time()
        function()
        times.append(time.process_time() - start)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--params", type=int, default=25_000_000, help="values averaged by the group")
    parser.add_argument("--peers", type=int, default=3, help="senders in the group (each one reduces a slice)")
    parser.add_argument("--repeat", type=int, default=3, help="timed runs of each (the median is printed)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    size = args.params // args.peers
    sizes = [PART] * (size // PART) + ([size % PART] if size % PART else [])
    generator = torch.Generator().manual_seed(0)
    weights = np.ones(args.peers) / args.peers
    statement = rc.Combination(tuple(weights), 0.0, float(weights[0]), 0.1, float(weights[0]), args.peers,
                               rc.MODE_MEAN)
    reduced = []
    for numel in sizes:
        received = [torch.randn(numel, generator=generator) for _ in range(args.peers)]
        result = sum(w * x for w, x in zip(weights, received))
        reduced.append(rc.ReducedPart(received, result, statement))
    seed = b"s" * 32
    claims = cpu_seconds(lambda: rc.reducer_claims(seed, 0, reduced, args.peers - 1, 0), args.repeat)
    header = rc.parse_header(rc.encode_header(statement, 1))
    received_parts = [rc.ReceivedPart(part.received[1], part.result - part.received[1], header, 1e-3, 1e-3)
                      for part in reduced]

    def reports():
        for reducer in range(1, args.peers):  # this member's reports on the other reducers' slices
            rc.member_report(seed, reducer, received_parts, args.peers - 1)

    def shared():  # as the members compute both: part index by part index, each index's sign vectors drawn once
        signs = rc.SignSource()
        for index in range(len(reduced)):
            for reducer in range(1, args.peers):
                rc.member_report(seed, reducer, received_parts[index:index + 1], args.peers - 1, first=index,
                                 signs=signs)
            rc.reducer_claims(seed, 0, reduced[index:index + 1], args.peers - 1, 0, first=index, signs=signs)

    member = cpu_seconds(reports, args.repeat)
    both = cpu_seconds(shared, args.repeat)
    print(f"{args.params} values, {args.peers} peers: slice of {size} values in {len(sizes)} parts")
    print(f"reducer_claims (its slice, {args.peers - 1} other senders): {claims:.3f} s CPU")
    print(f"member_report ({args.peers - 1} other slices): {member:.3f} s CPU")
    print(f"both, part index by part index with shared sign vectors (what a member computes): {both:.3f} s CPU")


if __name__ == "__main__":
    main()
