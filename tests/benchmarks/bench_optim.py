"""Optimizer state bytes per parameter and CPU step time of LAMB8bit against 32-bit LAMB.

Parameters: a small transformer language model (token embedding, attention and feed-forward matrices, norms and
biases), as hivemind's offloaded optimizer would hold them on the host. Gradients are random (the step time does
not depend on their values).

Rows: LAMB8bit (defaults: 8-bit state for tensors >= 4096 values, blocks of 256), the same class with float32
state everywhere (the 32-bit LAMB reference, 8 bytes per parameter), and bitsandbytes' own LAMB8bit for scale
(a different LAMB: no trust-ratio clamp, no global clipping).

    python tests/benchmarks/bench_optim.py [--dim 512] [--vocab 16384] [--layers 4] [--steps 5]
"""

import argparse
import time

import torch

from lightning_swarm.optim import LAMB8bit


def make_model(dim: int, vocab: int, layers: int) -> torch.nn.Module:
    layer = torch.nn.TransformerEncoderLayer(dim, nhead=max(1, dim // 64), dim_feedforward=4 * dim, batch_first=True)
    return torch.nn.ModuleDict(
        dict(
            embedding=torch.nn.Embedding(vocab, dim),
            blocks=torch.nn.TransformerEncoder(layer, layers, enable_nested_tensor=False),
            norm=torch.nn.LayerNorm(dim),
        )
    )


def state_bytes(optimizer: torch.optim.Optimizer) -> int:
    seen, total = set(), 0
    for state in optimizer.state.values():
        for value in state.values():
            # bitsandbytes shares its quantization maps between parameters: count each tensor once
            if isinstance(value, torch.Tensor) and value.data_ptr() not in seen:
                seen.add(value.data_ptr())
                total += value.numel() * value.element_size()
    return total


def bench(name: str, make_optimizer, model: torch.nn.Module, steps: int) -> None:
    params = list(model.parameters())
    num_params = sum(p.numel() for p in params)
    optimizer = make_optimizer(params)
    generator = torch.Generator().manual_seed(0)
    for param in params:
        param.grad = torch.randn(param.shape, generator=generator) * 1e-3
    optimizer.step()  # first step allocates lazily created state
    start = time.perf_counter()
    for _ in range(steps):
        optimizer.step()
    seconds = (time.perf_counter() - start) / steps
    print(
        f"{name:42s} {state_bytes(optimizer) / num_params:8.3f} {seconds * 1000:10.1f} "
        f"{seconds * 1000 / (num_params / 1e6):10.1f}"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dim", type=int, default=512, help="model width")
    parser.add_argument("--vocab", type=int, default=16384, help="token embedding rows")
    parser.add_argument("--layers", type=int, default=4, help="transformer layers")
    parser.add_argument("--steps", type=int, default=5, help="timed steps per optimizer")
    args = parser.parse_args()

    torch.manual_seed(0)
    model = make_model(args.dim, args.vocab, args.layers)
    num_params = sum(p.numel() for p in model.parameters())
    print(f"{num_params / 1e6:.2f}M parameters in {len(list(model.parameters()))} tensors, "
          f"{torch.get_num_threads()} torch threads")
    print(f"{'optimizer':42s} {'state B/p':>8s} {'ms/step':>10s} {'ms/M params':>10s}")
    hyper = dict(lr=1e-3, betas=(0.9, 0.96), eps=1e-6, weight_decay=0.01)
    bench("lightning_swarm LAMB8bit (8-bit state)",
          lambda p: LAMB8bit(p, **hyper, clamp_value=10.0, max_grad_norm=4.0), model, args.steps)
    bench("lightning_swarm LAMB8bit, 32-bit state",
          lambda p: LAMB8bit(p, **hyper, clamp_value=10.0, max_grad_norm=4.0, min_8bit_size=2**62),
          model, args.steps)
    try:
        import bitsandbytes as bnb

        bench("bitsandbytes.optim.LAMB8bit (for scale)", lambda p: bnb.optim.LAMB8bit(p, **hyper), model, args.steps)
    except (ImportError, RuntimeError, NotImplementedError) as error:
        print(f"bitsandbytes.optim.LAMB8bit unavailable: {error}")


if __name__ == "__main__":
    main()
