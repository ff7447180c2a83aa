"""The 1b config's first training steps on one GPU, its peak memory beside the memory calculator's estimate
(tests/gpu/check.sh).

Builds configs/dalle_1b.yaml's model at ``precision: auto`` on ``--device``, with its optimizer (LAMB8bit) on the
device too (no hivemind offloading: the calculator is asked for the same setup, ``--optimizer lamb
--optimizer-bits 8``), and trains ``--steps`` steps on random batches of the config's shape (the LAION stream needs the
Internet), ``--batch-size`` samples each. Prints each step's loss and time, then the peak of
``torch.cuda.max_memory_allocated`` beside the calculator's peak for the same precision and batch.

    python tests/gpu/first_steps_1b.py [--steps 3] [--batch-size 1] [--device cuda] [--config configs/dalle_1b.yaml]
"""

import argparse
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))
from lightning_swarm.memory.cli import build_parser, human_bytes, run as estimate  # noqa: E402
from lightning_swarm.precision import choose_precision, probe_hardware  # noqa: E402
from lightning_swarm.recipe_config import build_model, load_yaml  # noqa: E402

CONFIG = REPO / "configs" / "dalle_1b.yaml"
AUTOCAST = {"bf16-mixed": torch.bfloat16, "16-mixed": torch.float16, "32-true": None}
CALCULATOR = {"bf16-mixed": "bf16-mixed", "16-mixed": "fp16-mixed", "32-true": "fp32"}


def run(steps: int, batch_size: int, device: str, config_path: Path = CONFIG) -> None:
    precision, why = choose_precision(probe_hardware("cuda" if device.startswith("cuda") else "cpu"))
    print(f"precision auto -> {precision}: {why}")
    torch.manual_seed(0)
    module = build_model(load_yaml(config_path)).to(device)
    config = module.config
    optimizer = module.configure_optimizers()["optimizer"]
    dtype = AUTOCAST[precision]
    scaler = torch.amp.GradScaler(device.split(":")[0]) if precision == "16-mixed" else None
    if device.startswith("cuda"):
        torch.cuda.reset_peak_memory_stats()
    for step in range(steps):
        start = time.perf_counter()
        text = torch.randint(1, config.text_vocab_size, (batch_size, config.text_seq_len), device=device)  # BPE ids
        image = torch.randint(0, config.image_vocab_size, (batch_size, config.image_grid_size ** 2), device=device)
        with torch.autocast(device.split(":")[0], dtype=dtype, enabled=dtype is not None):
            loss = module.model.compute_loss(text, image)["loss"]
        if scaler is not None:
            scaler.scale(loss).backward()
            scaler.step(optimizer)
            scaler.update()
        else:
            loss.backward()
            optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        print(f"{config_path.stem} step {step}: loss {loss.item():.4f}, {time.perf_counter() - start:.2f} s", flush=True)
        assert torch.isfinite(loss), "non-finite loss"
    report = estimate(build_parser().parse_args([str(config_path), "--precision", CALCULATOR[precision], "--batch-size",
                                                 str(batch_size), "--optimizer", "lamb", "--optimizer-bits", "8"]))
    predicted = report["estimates"][0].gpu.peak
    if device.startswith("cuda"):
        measured = torch.cuda.max_memory_allocated()
        print(f"{config_path.stem} peak GPU memory at batch {batch_size}, {precision}: measured {human_bytes(measured)} "
              f"(torch.cuda.max_memory_allocated), calculator {human_bytes(predicted)} "
              f"(python -m lightning_swarm.memory {config_path} --precision {CALCULATOR[precision]} "
              f"--batch-size {batch_size} --optimizer lamb --optimizer-bits 8): measured/calculated "
              f"{measured / predicted:.2f}")
    else:
        print(f"{config_path.stem} on {device}: calculator's GPU peak {human_bytes(predicted)} (nothing measured off CUDA)")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--batch-size", type=int, default=1)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--config", type=Path, default=CONFIG, help="another recipe config (a CPU smoke run: the tiny one)")
    args = parser.parse_args()
    run(args.steps, args.batch_size, args.device, args.config)
