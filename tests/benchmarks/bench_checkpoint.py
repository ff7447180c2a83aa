"""Checkpoint figures for a recipe's model: save time, size on disk, upload (local fsspec) and load time.

    python tests/benchmarks/bench_checkpoint.py --config configs/dalle_tiny.yaml

Builds the model from the config like the monitor does, gives its optimizer real state (one step), then
saves, uploads to a local fsspec directory, and loads the checkpoint back into a fresh model; it also times
the sha256 pass over the files that saving records and reading verifies.
"""

import argparse
import os
import tempfile
import time

import torch

from lightning_swarm.checkpoint.checkpoint_io import HASHED_FILES, read_checkpoint, save_checkpoint
from lightning_swarm.checkpoint.integrity import record_files
from lightning_swarm.checkpoint.upload import upload_to_fsspec
from lightning_swarm.monitor.config import load_monitor_config
from lightning_swarm.torch_ext import configure_single_optimizer


def dir_size(path: str) -> int:
    return sum(os.path.getsize(os.path.join(path, name)) for name in os.listdir(path))


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--config", default="configs/dalle_tiny.yaml")
    parser.add_argument("--model-class", default=None)
    args = parser.parse_args()

    module, _ = load_monitor_config(args.config, args.model_class)
    optimizer, scheduler = configure_single_optimizer(module)
    for param in module.parameters():
        param.grad = torch.randn_like(param) * 1e-3
    optimizer.step()
    num_params = sum(p.numel() for p in module.parameters())

    with tempfile.TemporaryDirectory() as tmp:
        start = time.perf_counter()
        path = save_checkpoint(
            os.path.join(tmp, "local"), module, [optimizer.state_dict()],
            [scheduler.state_dict()] if scheduler else [], global_epoch=1,
        )
        save_seconds = time.perf_counter() - start
        size = dir_size(path)
        start = time.perf_counter()
        record_files(path, HASHED_FILES)  # the sha256 pass that both save and read include
        hash_seconds = time.perf_counter() - start
        start = time.perf_counter()
        upload_to_fsspec(path, os.path.join(tmp, "remote"))
        upload_seconds = time.perf_counter() - start
        fresh, _ = load_monitor_config(args.config, args.model_class)
        start = time.perf_counter()
        checkpoint = read_checkpoint(os.path.join(tmp, "remote"))
        checkpoint.load_into(fresh)
        load_seconds = time.perf_counter() - start
        identical = all(torch.equal(a, b) for a, b in zip(module.state_dict().values(), fresh.state_dict().values()))

    print(f"model: {type(module).__name__} from {args.config}, {num_params / 1e6:.2f}M parameters")
    print(f"checkpoint size (weights + optimizer state + JSON): {size / 2**20:.1f} MiB")
    print(f"save (atomic, fsync): {save_seconds:.2f} s")
    print(f"upload to a local fsspec directory: {upload_seconds:.2f} s")
    print(f"read + load into a fresh module: {load_seconds:.2f} s; weights identical: {identical}")
    print(f"of which sha256 of the files (once in save, once in read): {hash_seconds:.2f} s")


if __name__ == "__main__":
    main()
