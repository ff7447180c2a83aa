"""fp32 CPU linears, forward + backward: plain ``F.linear`` (MKL) against oneDNN (``recipes/dalle/cpu_linear.py``).

Prints, per shape of the DALL-E configs, the median time of each path and the ratio F.linear / oneDNN (> 1: oneDNN
is faster), measured alternately in one process; then the same for the fused linear + cross-entropy
(``linear_cross_entropy``'s fused path in either kernel against ``F.cross_entropy(F.linear(...))``, which sets
``FUSED_MIN_CLASSES``) and the kernel that ``cpu_linear`` picks on this CPU (``kernel_choice``).

The default clock is this process's CPU time on one thread: on a shared machine (other processes on the same cores)
wall time mostly measures the others; CPU time measures the kernels. ``--clock wall --threads 2`` measures what a
trainer alone on the machine sees.

    PYTHONPATH=. python tests/benchmarks/bench_cpu_linear.py [--threads 1] [--repeats 7] [--clock cpu|wall]
    ONEDNN_MAX_CPU_ISA=AVX2 ATEN_CPU_CAPABILITY=avx2 PYTHONPATH=. python tests/benchmarks/bench_cpu_linear.py  # AVX2
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch
import torch.nn.functional as F

from recipes.dalle import cpu_linear

# (name, rows, in_features, out_features, bias): the linears of one training step, rows = batch x positions
SHAPES = [
    ("tiny qkv", 16 * 273, 192, 768, False),
    ("tiny ff in", 16 * 273, 192, 1536, True),
    ("tiny ff out", 16 * 273, 768, 192, True),
    ("tiny text logits", 16 * 17, 192, 49424, True),
    ("small qkv", 8 * 321, 256, 768, False),
    ("small ff out", 8 * 321, 1024, 256, True),
    ("small image logits", 8 * 256, 256, 1024, True),
    ("1b qkv", 1 * 1281, 1024, 3072, False),
    ("1b ff in", 1 * 1281, 1024, 8192, True),
]


CE_SHAPES = [  # (name, rows, in_features, classes): the logits of the DALL-E configs
    ("tiny text logits", 16 * 17, 192, 49424),
    ("tiny image logits", 16 * 256, 192, 8),
    ("small image logits", 8 * 256, 256, 1024),
    ("1b image logits", 1 * 1024, 1024, 8192),
]
clock = time.process_time


def time_step(step, iterations: int) -> float:
    """Seconds per call of ``step`` (median over ``iterations``)."""
    times = []
    for _ in range(iterations):
        start = clock()
        step()
        times.append(clock() - start)
    return statistics.median(times)


def linear_step(path, x, weight, bias, grad_out):
    def step():
        out = path(x, weight, bias)
        torch.autograd.grad(out, [x, weight] + ([bias] if bias is not None else []), grad_out)
    return step


def cross_entropy_step(kind, x, weight, bias, target):
    def step():
        if kind == "plain":
            loss = F.cross_entropy(F.linear(x, weight, bias), target)
        else:
            with cpu_linear.use_onednn(kind == "fused oneDNN"):  # the fused path whatever FUSED_MIN_CLASSES says
                loss = cpu_linear._LinearCrossEntropy.apply(x, weight, bias, target)
        torch.autograd.grad(loss, [x, weight, bias])
    return step


def alternate(steps: dict, repeats: int, iterations: int) -> dict:
    """Median seconds of each named step, measured in alternating rounds after one warm-up call each."""
    for step in steps.values():  # warm-up (oneDNN primitive creation, allocator)
        step()
    times = {name: [] for name in steps}
    for _ in range(repeats):
        for name, step in steps.items():
            times[name].append(time_step(step, iterations))
    return {name: statistics.median(values) for name, values in times.items()}


def main() -> None:
    global clock
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, default=1, help="torch threads (default: 1)")
    parser.add_argument("--repeats", type=int, default=7, help="alternating rounds per shape (default: 7)")
    parser.add_argument("--iterations", type=int, default=3, help="steps per round and path (default: 3)")
    parser.add_argument("--clock", choices=("cpu", "wall"), default="cpu",
                        help="cpu: this process's CPU time (robust to other load); wall: elapsed time")
    parser.add_argument("--part", choices=("all", "linear", "cross-entropy", "step"), default="all",
                        help="what to measure (step: a whole training step of configs/dalle_tiny.yaml's model)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    clock = time.process_time if args.clock == "cpu" else time.perf_counter
    facts = cpu_linear.cpu_facts()
    print(f"CPU: {facts}, torch {torch.__version__}, {args.threads} threads, {args.clock} time, "
          f"load average {os.getloadavg()[0]:.1f}")
    if args.part in ("all", "linear"):
        measure_linears(args)
    if args.part in ("all", "cross-entropy"):
        measure_cross_entropy(args)
    if args.part in ("all", "step"):
        measure_tiny_step(args)
    print(f"\nkernel_choice on this CPU: {cpu_linear.kernel_choice(facts)!r}")


def measure_linears(args) -> None:
    print(f"{'linear fwd+bwd':<20} {'rows x in -> out':>22} {'F.linear ms':>12} {'oneDNN ms':>10} {'F/oneDNN':>9}")
    ratios = []
    for name, rows, in_features, out_features, with_bias in SHAPES:
        torch.manual_seed(0)
        x = torch.randn(rows, in_features, requires_grad=True)
        weight = torch.randn(out_features, in_features, requires_grad=True)
        bias = torch.randn(out_features, requires_grad=True) if with_bias else None
        grad_out = torch.randn(rows, out_features)
        medians = alternate({"plain": linear_step(F.linear, x, weight, bias, grad_out),
                             "onednn": linear_step(cpu_linear._OneDNNLinear.apply, x, weight, bias, grad_out)},
                            args.repeats, args.iterations)
        plain_ms, fast_ms = 1e3 * medians["plain"], 1e3 * medians["onednn"]
        ratios.append(plain_ms / fast_ms)
        print(f"{name:<20} {f'{rows} x {in_features} -> {out_features}':>22} {plain_ms:>12.2f} {fast_ms:>10.2f} "
              f"{plain_ms / fast_ms:>9.2f}")
    print(f"geometric mean F.linear / oneDNN: {statistics.geometric_mean(ratios):.2f}")


def measure_cross_entropy(args) -> None:
    kinds = ("plain", "fused F.linear", "fused oneDNN")
    print(f"\n{'cross-entropy':<20} {'rows x in -> classes':>22} " + " ".join(f"{k + ' ms':>17}" for k in kinds)
          + f" {'plain/fused F':>14} {'plain/fused oneDNN':>19}")
    for name, rows, in_features, classes in CE_SHAPES:
        torch.manual_seed(0)
        x = torch.randn(rows, in_features, requires_grad=True)
        weight = torch.randn(classes, in_features, requires_grad=True)
        bias = torch.randn(classes, requires_grad=True)
        target = torch.randint(0, classes, (rows,))
        medians = alternate({k: cross_entropy_step(k, x, weight, bias, target) for k in kinds}, args.repeats,
                            args.iterations)
        ms = {k: 1e3 * v for k, v in medians.items()}
        print(f"{name:<20} {f'{rows} x {in_features} -> {classes}':>22} "
              + " ".join(f"{ms[k]:>17.2f}" for k in kinds)
              + f" {ms['plain'] / ms['fused F.linear']:>14.2f} {ms['plain'] / ms['fused oneDNN']:>19.2f}")


# (oneDNN on, FUSED_MIN_CLASSES): the kernels a tiny DALL-E step can run with
STEP_VARIANTS = {"oneDNN, fused CE always (before)": (True, 0), "oneDNN, CE threshold": (True, None),
                 "F.linear, CE threshold": (False, None)}


def measure_tiny_step(args) -> None:
    """Forward + backward + AdamW of configs/dalle_tiny.yaml's model on one batch, per kernel variant."""
    from lightning_swarm.recipe_config import read_recipe_config
    from recipes.dalle.tokenizer import TextTokenizer
    from recipes.shapes import generate_example

    torch.manual_seed(0)
    recipe = read_recipe_config("configs/dalle_tiny.yaml")
    module = recipe.build_model()
    model, config = module.model, module.config
    optimizer = module.configure_optimizers()["optimizer"]
    examples = [generate_example(i) for i in range(recipe.data_init_args["batch_size"])]
    text = TextTokenizer(config.text_seq_len)([caption for caption, _, _ in examples])
    image = torch.stack([torch.from_numpy(codes.astype("int64")).flatten() for _, codes, _ in examples])
    threshold = cpu_linear.FUSED_MIN_CLASSES

    def step_with(onednn: bool, min_classes):
        def step():
            cpu_linear.FUSED_MIN_CLASSES = threshold if min_classes is None else min_classes
            with cpu_linear.use_onednn(onednn):
                model.compute_loss(text, image)["loss"].backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        return step

    medians = alternate({name: step_with(*variant) for name, variant in STEP_VARIANTS.items()}, args.repeats,
                        args.iterations)
    cpu_linear.FUSED_MIN_CLASSES = threshold
    base = medians["oneDNN, fused CE always (before)"]
    print(f"\n{'tiny DALL-E step':<34} {'ms':>9} {'x before':>9}")
    for name, seconds in medians.items():
        print(f"{name:<34} {1e3 * seconds:>9.1f} {base / seconds:>9.2f}")


if __name__ == "__main__":
    main()
