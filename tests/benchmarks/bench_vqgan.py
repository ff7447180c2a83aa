"""VQGAN encode / decode throughput (images/s) on CPU for the seed's f8-8192 Gumbel architecture.

Random weights: speed does not depend on the values. Prints one line per (direction, batch size).

    python tests/benchmarks/bench_vqgan.py [--batch-sizes 1 4] [--repeats 2] [--threads 2] [--resolution 256]
"""

import argparse
import os
import time

import torch

from recipes.dalle.vqgan import VQGAN, VQGANConfig


def measure(fn, batch_size: int, repeats: int) -> tuple[float, float]:
    """(images per wall-clock second, CPU seconds per image summed over threads). The second figure
    is less sensitive to other processes sharing the machine."""
    fn()  # warm-up (allocations, oneDNN kernel selection)
    wall, cpu = time.perf_counter(), time.process_time()
    for _ in range(repeats):
        fn()
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    return batch_size * repeats / wall, cpu / (batch_size * repeats)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 4])
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--resolution", type=int, default=256)
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    parser.add_argument("--channels-last", action="store_true", help="NHWC memory format (oneDNN convs)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)

    config = VQGANConfig(resolution=args.resolution)  # defaults: ch 128, ch_mult [1,1,2,4], 8192 codes, Gumbel
    model = VQGAN(config).to(getattr(torch, args.dtype))
    if args.channels_last:
        model = model.to(memory_format=torch.channels_last)
    params = sum(p.numel() for p in model.parameters())
    print(f"VQGAN f{config.downsample_factor}-{config.n_embed} ({config.quantizer}), {params / 1e6:.1f}M params, "
          f"{args.resolution}x{args.resolution} -> {model.grid_size}x{model.grid_size} codes, {args.dtype}, "
          f"{args.threads} threads, channels_last={args.channels_last}, torch {torch.__version__}, "
          f"load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs (other processes skew the figures)")
    for batch_size in args.batch_sizes:
        images = torch.rand(batch_size, 3, args.resolution, args.resolution)
        if args.channels_last:
            images = images.to(memory_format=torch.channels_last)
        codes = model.encode(images)
        encode, encode_cpu = measure(lambda: model.encode(images), batch_size, args.repeats)
        decode, decode_cpu = measure(lambda: model.decode(codes), batch_size, args.repeats)
        print(f"batch {batch_size:3d}: encode {encode:6.2f} images/s ({encode_cpu:5.2f} CPU-s/image)   "
              f"decode {decode:6.2f} images/s ({decode_cpu:5.2f} CPU-s/image)")


if __name__ == "__main__":
    main()
