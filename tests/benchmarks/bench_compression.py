"""Bytes per parameter on the wire and reconstruction error of each wire codec, on real tensors.

The tensors are the gradients and the parameters of a small transformer language model after one backward pass
on random tokens: a realistic mix of sizes (a large token embedding whose gradient is mostly zero rows, square
and 4x projection matrices, small norm gains and biases).

Codecs: none, float16, hivemind's Uniform8BitQuantization and BlockwiseQuantization (their own compress; their
extract crashes under numpy >= 2.4, so their messages are decoded with the same math through the numpy-safe
decoders that lightning_swarm.compression.register_fixed_codecs installs), our Blockwise8BitQuantization, hivemind's
SizeAdaptiveCompression(2**16, Float16, Uniform8Bit) as the seed run configured it, and our default.

    python tests/benchmarks/bench_compression.py [--dim 256] [--vocab 16384] [--layers 4]
"""

import argparse
import time

import torch
from hivemind.compression import (
    BlockwiseQuantization,
    CompressionInfo,
    Float16Compression,
    NoCompression,
    SizeAdaptiveCompression,
    Uniform8BitQuantization,
    deserialize_torch_tensor,
)

from lightning_swarm.compression import Blockwise8BitQuantization, default_compression, register_fixed_codecs


def make_tensors(dim: int, vocab: int, layers: int) -> dict[str, dict[str, torch.Tensor]]:
    """Gradients and parameters of a small causal transformer LM after one batch of random tokens."""
    torch.manual_seed(0)
    layer = torch.nn.TransformerEncoderLayer(dim, nhead=max(1, dim // 64), dim_feedforward=4 * dim, batch_first=True)
    model = torch.nn.ModuleDict(
        dict(
            embedding=torch.nn.Embedding(vocab, dim),
            blocks=torch.nn.TransformerEncoder(layer, layers, enable_nested_tensor=False),
            norm=torch.nn.LayerNorm(dim),
        )
    )
    tokens = torch.randint(0, vocab, (8, 128))
    mask = torch.nn.Transformer.generate_square_subsequent_mask(128)
    hidden = model["norm"](model["blocks"](model["embedding"](tokens), mask=mask, is_causal=True))
    logits = hidden @ model["embedding"].weight.T  # tied output layer
    loss = torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, vocab), tokens[:, 1:].reshape(-1))
    loss.backward()
    named = list(model.named_parameters())
    return {
        "gradients": {name: param.grad.detach().clone() for name, param in named},
        "parameters": {name: param.detach().clone() for name, param in named},
    }


def measure(codec, tensors: dict[str, torch.Tensor]) -> dict[str, float]:
    wire_bytes = numel = 0
    squared_error = squared_norm = 0.0
    max_error = max_value = 0.0
    start = time.perf_counter()
    for name, tensor in tensors.items():
        message = codec.compress(tensor, CompressionInfo.from_tensor(tensor, key=name))
        restored = deserialize_torch_tensor(message)
        wire_bytes += len(message.buffer)
        numel += tensor.numel()
        error = (restored.float() - tensor.float()).abs()
        squared_error += float(error.square().sum())
        squared_norm += float(tensor.float().square().sum())
        max_error = max(max_error, float(error.max()))
        max_value = max(max_value, float(tensor.abs().max()))
    seconds = time.perf_counter() - start
    return dict(
        bytes_per_param=wire_bytes / numel,
        relative_rmse=(squared_error / max(squared_norm, 1e-30)) ** 0.5,
        relative_max_error=max_error / max(max_value, 1e-30),
        ms_per_million=1000 * seconds / (numel / 1e6),
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dim", type=int, default=256, help="model width")
    parser.add_argument("--vocab", type=int, default=16384, help="token embedding rows")
    parser.add_argument("--layers", type=int, default=4, help="transformer layers")
    args = parser.parse_args()

    groups = make_tensors(args.dim, args.vocab, args.layers)
    sizes = sorted(t.numel() for t in groups["gradients"].values())
    large = sum(n for n in sizes if n >= 2**16)
    print(
        f"{len(sizes)} tensors, {sum(sizes) / 1e6:.2f}M values, {large / sum(sizes):.1%} of them in tensors "
        f">= 2**16 values (smallest {sizes[0]}, largest {sizes[-1]})"
    )
    register_fixed_codecs()
    codecs = {
        "none (float32)": NoCompression(),
        "float16": Float16Compression(),
        "hivemind Uniform8Bit": Uniform8BitQuantization(),
        "hivemind Blockwise8Bit": BlockwiseQuantization(),
        "ours Blockwise8Bit": Blockwise8BitQuantization(),
        "seed: adaptive fp16/Uniform8Bit": SizeAdaptiveCompression(
            2**16, less=Float16Compression(), greater_equal=Uniform8BitQuantization()
        ),
        "ours default (fp16/8-bit)": default_compression(),
    }
    for group_name, tensors in groups.items():
        large_tensors = {name: t for name, t in tensors.items() if t.numel() >= 2**16}
        print(f"\n== {group_name} ==")
        print(f"{'codec':34s} {'B/param':>8s} {'B/param>=2^16':>14s} {'rel RMSE':>9s} {'rel max':>9s} {'ms/M':>7s}")
        for codec_name, codec in codecs.items():
            try:
                result = measure(codec, tensors)
                large_result = measure(codec, large_tensors)
            except ValueError as error:  # e.g. a codec that rejects a dtype
                print(f"{codec_name:34s} failed: {error}")
                continue
            print(
                f"{codec_name:34s} {result['bytes_per_param']:8.4f} {large_result['bytes_per_param']:14.4f} "
                f"{result['relative_rmse']:9.5f} {result['relative_max_error']:9.5f} {result['ms_per_million']:7.1f}"
            )


if __name__ == "__main__":
    main()
