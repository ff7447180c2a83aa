"""LAMB8bit's step on GPU tensors (tests/gpu/check.sh): 8-bit state on the device, and the same update as on the CPU.

Steps LAMB8bit on a copy of the same parameters and gradients on ``--device`` (default cuda) and on the CPU, for
``--steps`` steps, and fails unless the device's state is uint8 on the device for the large tensors and the
parameters agree with the CPU's (the quantization is the same; only float rounding differs).

    python tests/gpu/lamb8bit_gpu.py [--device cuda] [--steps 5]
"""

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from lightning_swarm.optim import LAMB8bit  # noqa: E402


def run(device: str, steps: int) -> None:
    torch.manual_seed(0)
    shapes = [(1024, 1024), (4096, 256), (1024,)]  # two tensors with 8-bit state, one with float32 state
    weights = [torch.randn(shape) * 0.02 for shape in shapes]
    grads = [[torch.randn(shape) * 0.01 for shape in shapes] for _ in range(steps)]
    results = {}
    for where in ("cpu", device):
        params = [torch.nn.Parameter(w.clone().to(where)) for w in weights]
        optimizer = LAMB8bit(params, lr=1e-3, weight_decay=0.01, max_grad_norm=1.0, min_8bit_size=65536)
        for step_grads in grads:
            for p, g in zip(params, step_grads):
                p.grad = g.to(where)
            optimizer.step()
        for p in params[:2]:
            state = optimizer.state[p]
            assert state["exp_avg"].dtype == torch.uint8 and state["exp_avg"].device.type == torch.device(where).type, \
                (state["exp_avg"].dtype, state["exp_avg"].device)
        results[where] = [p.detach().cpu() for p in params]
    for shape, on_cpu, on_device, before in zip(shapes, results["cpu"], results[device], weights):
        moved = (on_cpu - before).abs().max().item()
        differ = (on_cpu - on_device).abs().max().item()
        print(f"LAMB8bit {tuple(shape)}: max update {moved:.3e}, max |{device} - cpu| {differ:.3e}")
        assert torch.isfinite(on_device).all() and moved > 0
        assert differ <= 0.05 * moved, f"{device} and cpu disagree by {differ:.3e} (update {moved:.3e})"
    print(f"LAMB8bit on {device}: OK ({steps} steps, 8-bit state on the device)")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--steps", type=int, default=5)
    args = parser.parse_args()
    run(args.device, args.steps)
