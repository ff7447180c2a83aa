"""What checking a received part costs next to decoding it (issue 24): per part of an all-reduce.

    PYTHONPATH=$PWD python tests/benchmarks/bench_wire_checks.py [--repeat 200]

For a part as hivemind's all-reduce sends it (2**17 values in BLOCKWISE_8BIT, 2**16 in FLOAT16: the
default_compression() sizes), prints the median time of lightning_swarm.wire_checks.check_tensor_message (what the
reducer and each sender run before decoding) and of hivemind's deserialize_torch_tensor through the checked codecs.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from hivemind.compression import deserialize_torch_tensor, serialize_torch_tensor
from hivemind.proto import runtime_pb2

from lightning_swarm.compression import register_fixed_codecs
from lightning_swarm.wire_checks import check_tensor_message


def median_seconds(function, repeat: int) -> float:
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        function()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeat", type=int, default=200, help="timed calls per figure")
    args = parser.parse_args()
    register_fixed_codecs()
    torch.set_num_threads(1)
    print(f"{'part':<28}{'check us':>10}{'decode us':>11}{'check/decode':>14}")
    for kind, numel in (("BLOCKWISE_8BIT", 2**17), ("FLOAT16", 2**16), ("NONE", 2**16)):
        part = torch.randn(numel)
        message = serialize_torch_tensor(part, getattr(runtime_pb2, kind))
        check = median_seconds(lambda: check_tensor_message(message, part.shape, part.dtype), args.repeat)
        decode = median_seconds(lambda: deserialize_torch_tensor(message), args.repeat)
        print(f"{kind + f' x {numel}':<28}{check * 1e6:>10.1f}{decode * 1e6:>11.1f}{check / decode:>14.3f}")


if __name__ == "__main__":
    main()
