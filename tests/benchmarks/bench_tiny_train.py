"""Training-step cost of the tiny recipes' models on this CPU, variants side by side in one run.

DALL-E (configs/dalle_tiny.yaml's model and batch, fp32): a forward + backward + fused AdamW step on real shapes
batches, per variant:

    before        the full CLIP BPE text vocabulary (49,408 rows) and reversible layers (the config before issue 15)
    compact       the compact shapes vocabulary (model.text_vocabulary: shapes), reversible layers
    compact-plain the compact vocabulary and plain residual layers (no recomputation in backward)
    plain         the full vocabulary and plain residual layers
    plain-full-attn  plain, and every layer's image queries attending to all earlier cells (``full``)

CLIP (configs/clip_tiny.yaml's model and batch, fp32): a step of `CLIPModule` on a real batch (``--clip``), and
the CPU time of drawing a batch (what the DataLoader worker does beside the model; the median of 3 batches after
a first one), per variant of the data settings (``--clip-variants``):

    clip_tiny     the config as shipped (128 examples a batch, 2 sloppy wrong drawings each: 512 pictures)
    batch80       80 examples a batch (320 pictures)
    perturbed1    1 sloppy wrong drawing per example (384 pictures)
    batch96-p1    96 examples a batch, 1 sloppy wrong drawing each (288 pictures)

Each measurement runs in a fresh subprocess; the variants alternate ``--repeats`` times and the medians are
printed, with the CPU time per step (user + system of the process, all threads) next to the wall time: other
processes share the cores, so the wall time says as much about the load (printed by ``uptime`` before and
after) as about the step, and the CPU time is the steadier figure. A run's time is about steps x wall time per
step plus start-up and validation.

    python tests/benchmarks/bench_tiny_train.py [--threads 1 2] [--repeats 2] [--steps 4] [--clip]
    python tests/benchmarks/bench_tiny_train.py --variants --clip --clip-variants clip_tiny perturbed1  # CLIP only

``--flops`` also counts each DALL-E variant's floating-point operations per step (torch's FlopCounterMode: matmuls,
convolutions and attention, forward, backward and the reversible layers' recomputation) and measures, in the same
process and thread count, this CPU's fp32 matmul rate on large square matrices: a step that runs near that rate
can only get faster by doing fewer operations.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from paths import REPO  # noqa: E402

DALLE_VARIANTS = {
    "before": {"text_vocabulary": "full", "reversible": True},
    "compact": {"text_vocabulary": "shapes", "reversible": True},
    "compact-plain": {"text_vocabulary": "shapes", "reversible": False},
    "plain": {"text_vocabulary": "full", "reversible": False},
    "plain-full-attn": {"text_vocabulary": "full", "reversible": False, "attn_types": ["full"] * 4},
}

CLIP_VARIANTS = {  # data settings over configs/clip_tiny.yaml's
    "clip_tiny": {},
    "batch80": {"batch_size": 80},
    "perturbed1": {"num_perturbed": 1},
    "batch96-p1": {"batch_size": 96, "num_perturbed": 1},
}


def _recipe(name: str, model_class: str | None = None):
    from lightning_swarm.recipe_config import read_recipe_config

    return read_recipe_config(REPO / "configs" / name, model_class=model_class)


def matmul_gflops(threads: int, size: int = 2048, repeats: int = 8) -> float:
    """This CPU's fp32 matmul rate (GFLOP/s) on square `size` matrices with `threads` torch threads."""
    import torch

    torch.set_num_threads(threads)
    a, b = torch.randn(size, size), torch.randn(size, size)
    a @ b  # warm-up: the library's kernel selection and buffers
    start = time.perf_counter()
    for _ in range(repeats):
        a @ b
    return 2 * size**3 * repeats / (time.perf_counter() - start) / 1e9


def count_flops(step) -> float:
    """Floating-point operations of one call of `step`, counted with torch's FlopCounterMode formulas (matmuls,
    convolutions, attention). Without FlopCounterMode's module tracking: its hooks break the reversible layers'
    backward, which calls autograd.grad."""
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils.flop_counter import flop_registry

    class CountFlops(TorchDispatchMode):
        total = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            out = func(*args, **kwargs)
            formula = flop_registry.get(func._overloadpacket)
            if formula is not None:
                CountFlops.total += formula(*args, **kwargs, out_val=out)
            return out

    with CountFlops():
        step()
    return float(CountFlops.total)


def dalle_worker(variant: str, threads: int, steps: int, warmup: int, flops: bool = False) -> dict:
    """Time training steps of the tiny DALL-E in this process."""
    import torch

    from recipes.dalle.cpu_malloc import keep_freed_memory

    keep_freed_memory()  # as `python -m recipes.dalle` does
    from recipes.dalle.tokenizer import TextTokenizer
    from recipes.shapes import generate_example

    torch.manual_seed(0)
    torch.set_num_threads(threads)
    recipe = _recipe("dalle_tiny.yaml")  # the module and optimizer exactly as the recipe builds them
    settings = DALLE_VARIANTS[variant]
    recipe.model_init_args["text_vocabulary"] = settings["text_vocabulary"]
    recipe.model_init_args["config"]["reversible"] = settings["reversible"]
    if "attn_types" in settings:
        recipe.model_init_args["config"]["attn_types"] = settings["attn_types"]
    module = recipe.build_model()
    model, config = module.model, module.config
    optimizer = module.configure_optimizers()["optimizer"]
    batch_size = recipe.data_init_args["batch_size"]
    examples = [generate_example(i) for i in range(batch_size)]
    text = TextTokenizer(config.text_seq_len)([caption for caption, _, _ in examples])
    image = torch.stack([torch.from_numpy(codes.astype("int64")).flatten() for _, codes, _ in examples])

    def step():
        model.compute_loss(text, image)["loss"].backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    result = _time_steps(step, steps, warmup, batch_size, model_params=sum(p.numel() for p in model.parameters()))
    if flops:
        result["gflop_per_step"] = count_flops(step) / 1e9
        result["gflops"] = result["gflop_per_step"] / result["wall_s_per_step"]
        result["matmul_gflops"] = matmul_gflops(threads)
        result["of_matmul_rate"] = result["gflops"] / result["matmul_gflops"]
    return result


def clip_worker(variant: str, threads: int, steps: int, warmup: int) -> dict:
    """Time training steps of the tiny CLIP in this process (the batch is drawn outside the timing), and drawing
    batches."""
    import torch

    from recipes.clip.data import ShapesCLIPDataModule

    torch.manual_seed(0)
    torch.set_num_threads(threads)
    recipe = _recipe("clip_tiny.yaml", model_class="recipes.clip.module.CLIPModule")
    data_args = {k: v for k, v in recipe.data_init_args.items() if k != "num_workers"}
    data_args.update(CLIP_VARIANTS[variant])
    batches = iter(ShapesCLIPDataModule(**data_args, num_workers=0).train_dataloader())
    batch = next(batches)
    data_cpu = []
    for _ in range(3):  # after the first batch, as in a run: the worker's caches are warm
        start = time.process_time()
        next(batches)
        data_cpu.append(time.process_time() - start)
    module = recipe.build_model()
    optimizer = module.configure_optimizers()["optimizer"]

    def step():
        module._step(batch)[0].backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    result = _time_steps(step, steps, warmup, len(batch["image"]),
                         model_params=sum(p.numel() for p in module.parameters()))
    result["data_cpu_s_per_batch"] = statistics.median(data_cpu)  # DataLoader workers do it beside the model
    result["pictures"] = sum(len(batch[k].flatten(0, -4)) for k in ("image", "negative_image", "perturbed_image")
                             if k in batch)
    return result


def _time_steps(step, steps: int, warmup: int, batch_size: int, model_params: int) -> dict:
    for _ in range(warmup):  # one-time costs: optimizer state, kernel caches, the heap's growth
        step()
    wall, cpu = time.perf_counter(), time.process_time()
    for _ in range(steps):
        step()
    wall, cpu = (time.perf_counter() - wall) / steps, (time.process_time() - cpu) / steps
    return {"params_M": model_params / 1e6, "wall_s_per_step": wall, "cpu_s_per_step": cpu,
            "samples_per_s": batch_size / wall}


def measure(args, kind: str, variant: str, threads: int) -> dict:
    command = [sys.executable, __file__, "--worker", kind, "--variant", variant, "--threads", str(threads),
               "--steps", str(args.steps), "--warmup", str(args.warmup)] + (["--flops"] if args.flops else [])
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}  # this checkout
    out = subprocess.run(command, check=True, capture_output=True, text=True, cwd=REPO, env=env).stdout
    return json.loads(out.strip().splitlines()[-1])


def load() -> str:
    return subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2], help="torch threads to measure")
    parser.add_argument("--variants", nargs="*", default=list(DALLE_VARIANTS), choices=list(DALLE_VARIANTS),
                        help="DALL-E variants (none: --variants alone)")
    parser.add_argument("--steps", type=int, default=4, help="timed steps per measurement")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps before them")
    parser.add_argument("--repeats", type=int, default=2, help="measurements of each variant, alternating")
    parser.add_argument("--clip", action="store_true", help="also measure the tiny CLIP's step")
    parser.add_argument("--flops", action="store_true",
                        help="also count DALL-E operations per step and measure this CPU's fp32 matmul rate")
    parser.add_argument("--clip-variants", nargs="+", default=["clip_tiny"], choices=list(CLIP_VARIANTS))
    parser.add_argument("--worker", choices=["dalle", "clip"], help=argparse.SUPPRESS)
    parser.add_argument("--variant", default="compact", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker == "dalle":
        print(json.dumps(dalle_worker(args.variant, args.threads[0], args.steps, args.warmup, args.flops)))
        return
    if args.worker == "clip":
        print(json.dumps(clip_worker(args.variant, args.threads[0], args.steps, args.warmup)))
        return
    import torch

    print(f"torch {torch.__version__}, CPU capability {torch.backends.cpu.get_cpu_capability()}, "
          f"native bf16 {torch.ops.mkldnn._is_mkldnn_bf16_supported()}")
    print(f"load before: {load()}", flush=True)
    runs = [("dalle", v, t) for t in args.threads for v in args.variants]
    runs += [("clip", v, t) for t in args.threads for v in args.clip_variants] if args.clip else []
    results = {run: [] for run in runs}
    for repeat in range(args.repeats):
        for run in runs:
            results[run].append(measure(args, *run))
            figures = " ".join(f"{k}={v:.3f}" for k, v in results[run][-1].items())
            print(f"[{repeat}] {run[0]} {run[1]} threads={run[2]}: {figures}", flush=True)
    print(f"load after: {load()}")
    print(f"{'model':6} {'variant':14} {'threads':>7} {'params M':>9} {'cpu s/step':>11} {'wall s/step':>12} "
          f"{'samples/s':>10} {'data cpu s/batch':>17}")
    for (kind, variant, threads), rows in results.items():
        cpu = statistics.median(r["cpu_s_per_step"] for r in rows)
        wall = statistics.median(r["wall_s_per_step"] for r in rows)
        samples = statistics.median(r["samples_per_s"] for r in rows)
        data = f"{statistics.median(r['data_cpu_s_per_batch'] for r in rows):>17.3f}" if kind == "clip" else ""
        print(f"{kind:6} {variant:14} {threads:>7} {rows[0]['params_M']:>9.2f} {cpu:>11.3f} {wall:>12.3f} "
              f"{samples:>10.2f} {data}")
    for threads in args.threads:  # the CLIP variants' model + data CPU time against the shipped config's
        base = results.get(("clip", "clip_tiny", threads))
        for variant in args.clip_variants if args.clip and base else []:
            total = [statistics.median(r["cpu_s_per_step"] + r["data_cpu_s_per_batch"] for r in rows)
                     for rows in (results[("clip", variant, threads)], base)]
            print(f"clip threads={threads}: {variant} model + data CPU s per step {total[0]:.3f} "
                  f"= {total[0] / total[1]:.2f}x clip_tiny")
    for (kind, variant, threads), rows in results.items():
        if kind == "dalle" and args.flops:
            print(f"dalle {variant} threads={threads}: {rows[0]['gflop_per_step']:.1f} GFLOP a step, "
                  f"{statistics.median(r['gflops'] for r in rows):.1f} GFLOP/s = "
                  f"{statistics.median(r['of_matmul_rate'] for r in rows):.2f} of the fp32 matmul rate "
                  f"({statistics.median(r['matmul_gflops'] for r in rows):.1f} GFLOP/s on 2048x2048 matrices)")
    for threads in args.threads:
        base = ("dalle", "before", threads)
        if base in results:
            base_cpu = statistics.median(r["cpu_s_per_step"] for r in results[base])
            for variant in args.variants:
                cpu = statistics.median(r["cpu_s_per_step"] for r in results[("dalle", variant, threads)])
                print(f"dalle threads={threads}: {variant} CPU time per step = {cpu / base_cpu:.2f}x before")


if __name__ == "__main__":
    main()
