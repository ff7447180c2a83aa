"""Memory calculator vs a real CPU training step of the DALL-E recipe.

    python tests/benchmarks/bench_memory.py [--config configs/dalle_tiny.yaml] [--batch-size 8]

Builds the config's model for real in a fresh process, runs two fwd+bwd+Adam steps on random text and
image codes (gradients kept between steps, as when accumulating for a swarm) and prints the peak RSS
growth next to ``lightning_swarm.memory``'s CPU-only estimate, with reversible layers on and off.
glibc is told to serve allocations of 64 KiB or more with mmap so that RSS follows live tensor memory
(with the default heap the measured figure also holds memory the allocator keeps after frees).
"""

import argparse
import json
import os
import subprocess
import sys
import textwrap

import yaml

from lightning_swarm.memory import TrainingSetup, estimate, from_config

CHILD = textwrap.dedent('''
    import gc, json, os, resource, sys
    import torch
    import yaml
    from lightning_swarm.recipe_config import instantiate_model_config

    config_path, batch_size, reversible = sys.argv[1], int(sys.argv[2]), sys.argv[3] == "1"
    torch.set_num_threads(2)
    model_config = yaml.safe_load(open(config_path))["model"]
    model_config["init_args"]["config"]["reversible"] = reversible

    def rss():
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")

    def steps(module, batch_size, count):
        c = module.config
        optimizer = torch.optim.Adam(module.parameters(), lr=1e-4)
        text = torch.randint(1, c.text_vocab_size, (batch_size, c.text_seq_len))
        image = torch.randint(c.image_vocab_size, (batch_size, c.image_grid_size ** 2))
        for _ in range(count):
            module.model.compute_loss(text, image)["loss"].backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=False)

    steps(instantiate_model_config(model_config), 1, 1)  # warm-up: load kernels, then measure a fresh model
    gc.collect()
    before = rss()
    module = instantiate_model_config(model_config)
    steps(module, batch_size, 2)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    print(json.dumps({"peak_delta": peak - before}))
''')


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", default="configs/dalle_tiny.yaml")
    parser.add_argument("--batch-size", type=int, default=8)
    args = parser.parse_args()
    source = from_config(args.config)
    print(f"{args.config}: {source.shared.numel:,} parameters, shape {source.shape}")
    for reversible in (True, False):
        env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="65536")
        run = subprocess.run([sys.executable, "-c", CHILD, args.config, str(args.batch_size), str(int(reversible))],
                             capture_output=True, text=True, env=env, check=True)
        measured = json.loads(run.stdout.strip().splitlines()[-1])["peak_delta"]
        setup = TrainingSetup(batch_size=args.batch_size, device="cpu", reversible=reversible)
        result = estimate(source.shared, source.shape, setup)
        print(f"reversible={reversible!s:5}  measured peak {measured / 2**20:8.1f} MiB   "
              f"estimated {result.cpu.peak / 2**20:8.1f} MiB   ratio {result.cpu.peak / measured:.2f}   "
              f"(activations {result.cpu.activations / 2**20:.1f} MiB)")


if __name__ == "__main__":
    main()
