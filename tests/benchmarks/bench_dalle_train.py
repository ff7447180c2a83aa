"""Training throughput of the DALL-E model on the CPU ("bench-small"), optionally against DALLE-pytorch 1.6.6.

bench-small: dim 256, depth 8, 4 heads of 64, text 64 tokens, 16x16 grid, 1024 codes, axial
row/col/row/row with 4 shared blocks, reversible, rotary, batch 8, 2 threads (the config of
../shared/peers/dalle_pytorch_anchor.py). Each measurement runs in a fresh subprocess; with
``--anchor-python`` ours and the anchor alternate ``--repeats`` times and the ratio of medians is printed
(other processes share the cores, so single figures are noisy). Ours runs in fp32 (like the anchor) and,
by default, also under bf16 autocast (``precision="bf16-mixed"`` in Lightning), which this machine's
AVX512-BF16 CPU runs much faster. Our fp32 step owes its speed to oneDNN matmuls (recipes/dalle/cpu_linear.py:
PyTorch's MKL sgemm takes its AVX2 path on AMD CPUs), the fused linear + cross-entropy, grouped attention
(``attention_impl``), AdamW's fused CPU kernel (``--adamw``; the anchor's AdamW runs PyTorch's default
per-parameter loop) and glibc malloc keeping freed memory (``--malloc``, recipes/dalle/cpu_malloc.py: no
page faults on every step's large temporaries; the anchor runs with the default malloc).

    python tests/benchmarks/bench_dalle_train.py [--anchor-python /tmp/anchor-venv/bin/python] [--repeats 3]
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from paths import REPO, SHARED  # noqa: E402

sys.path.insert(0, str(REPO))  # `recipes` when run as a script from any directory (the workers run this file too)

ANCHOR = SHARED / "peers" / "dalle_pytorch_anchor.py"


def bench_small_config(**overrides):
    from recipes.dalle.model import DALLEConfig

    values = dict(dim=256, depth=8, heads=4, dim_head=64, text_seq_len=64, image_vocab_size=1024, image_grid_size=16,
                  attn_types=("axial_row", "axial_col", "axial_row", "axial_row"), last_layer_conv=False,
                  shared_layer_ids=(0, 1, 2, 3), reversible=True, rotary=True)
    values.update(overrides)
    return DALLEConfig(**values)


def worker(threads: int, batch_size: int, steps: int, sample: bool, precision: str, adamw: str = "fused",
           malloc: str = "keep", warmup: int = 3) -> dict:
    """Measure in this process: training samples/s (fwd + bwd + AdamW) and seconds to sample one image."""
    import contextlib

    import torch

    from recipes.dalle.cpu_malloc import keep_freed_memory

    if malloc == "keep":
        keep_freed_memory()

    from recipes.dalle.model import DALLE

    torch.manual_seed(0)
    torch.set_num_threads(threads)
    config = bench_small_config()
    model = DALLE(config)
    # fused: one multi-tensor kernel per step (CPU support since torch 2.4); default: PyTorch's own choice
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True if adamw == "fused" else None)
    text = torch.randint(1, config.text_vocab_size, (batch_size, config.text_seq_len))
    image = torch.randint(0, config.image_vocab_size, (batch_size, config.num_image))

    def autocast():  # bf16-mixed: what Lightning's precision="bf16-mixed" does on the CPU
        if precision == "bf16-mixed":
            return torch.autocast("cpu", dtype=torch.bfloat16)
        return contextlib.nullcontext()

    def step():
        with autocast():
            loss = model.compute_loss(text, image)["loss"]
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    for _ in range(warmup):  # one-time costs: optimizer state, oneDNN kernel caches, the malloc heap's growth
        step()
    start = time.perf_counter()
    for _ in range(steps):
        step()
    step_seconds = (time.perf_counter() - start) / steps
    result = {"params_unique_M": model.num_parameters(unique=True) / 1e6, "step_s": step_seconds,
              "samples_per_s": batch_size / step_seconds}
    if sample:
        model.eval()
        start = time.perf_counter()
        with torch.no_grad(), autocast():
            cache = model.new_cache(1)
            logits = model.prefill(text[:1], cache)
            for _ in range(config.num_image - 1):
                # keep the top 10% of logits, as the anchor's filter_thres=0.9
                top = logits.topk(max(1, logits.shape[-1] // 10), dim=-1)
                probs = torch.zeros_like(logits).scatter_(-1, top.indices, top.values.softmax(-1))
                logits = model.decode_step(torch.multinomial(probs, 1).view(-1), cache)
        result["sample_s"] = time.perf_counter() - start
    return result


def run_ours(args, precision: str) -> dict:
    command = [sys.executable, __file__, "--worker", "--threads", str(args.threads), "--batch-size",
               str(args.batch_size), "--steps", str(args.steps), "--precisions", precision, "--adamw", args.adamw,
               "--malloc", args.malloc, "--warmup", str(args.warmup)]
    command += [] if args.no_sample else ["--sample"]
    out = subprocess.run(command, check=True, capture_output=True, text=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def run_anchor(args) -> dict:
    """Run the anchor script; unless ``--anchor-generate``, stop it once it printed its training figure
    (its image generation has no KV cache and takes many minutes on this CPU)."""
    process = subprocess.Popen([args.anchor_python, str(ANCHOR), str(args.threads)], stdout=subprocess.PIPE,
                               stderr=subprocess.DEVNULL, text=True)
    result = {}
    for line in process.stdout:
        train = re.search(r"train samples/s=([\d.]+)", line)
        generate = re.search(r"generate 1 image \(256 tokens\) s=([\d.]+)", line)
        if train:
            result["samples_per_s"] = float(train.group(1))
            if not args.anchor_generate:
                process.terminate()
                break
        if generate:
            result["sample_s"] = float(generate.group(1))
    process.wait()
    if "samples_per_s" not in result:
        raise RuntimeError(f"the anchor printed no training figure (exit code {process.returncode})")
    return result


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, default=2, help="torch threads per measurement")
    parser.add_argument("--batch-size", type=int, default=8, help="training batch size (the anchor uses 8)")
    parser.add_argument("--steps", type=int, default=5, help="timed training steps per measurement")
    parser.add_argument("--warmup", type=int, default=3,
                        help="untimed training steps before them (ours; the anchor script warms up with 1)")
    parser.add_argument("--repeats", type=int, default=2, help="measurements of each side, alternating")
    parser.add_argument("--anchor-python", default=None, help="python of a venv with dalle-pytorch==1.6.6")
    parser.add_argument("--anchor-generate", action="store_true",
                        help="also wait for the anchor's (slow, cache-less) one-image generation figure")
    parser.add_argument("--no-sample", action="store_true", help="skip timing one image sample")
    parser.add_argument("--precisions", nargs="+", default=["fp32", "bf16-mixed"], choices=["fp32", "bf16-mixed"],
                        help="our precisions to measure (the anchor always runs fp32)")
    parser.add_argument("--adamw", default="fused", choices=["fused", "default"],
                        help="our AdamW: the fused CPU kernel, or PyTorch's default implementation (as the anchor)")
    parser.add_argument("--malloc", default="keep", choices=["keep", "default"],
                        help="keep: glibc malloc reuses freed memory (cpu_malloc.keep_freed_memory); default: as is")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--sample", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        print(json.dumps(worker(args.threads, args.batch_size, args.steps, args.sample, args.precisions[0], args.adamw,
                                args.malloc, args.warmup)))
        return
    ours = {precision: [] for precision in args.precisions}
    anchor = []
    for repeat in range(args.repeats):
        for precision in args.precisions:
            ours[precision].append(run_ours(args, precision))
            figures = " ".join(f"{k}={v:.3f}" for k, v in ours[precision][-1].items())
            print(f"[{repeat}] ours {precision}: {figures}", flush=True)
        if args.anchor_python:
            anchor.append(run_anchor(args))
            print(f"[{repeat}] anchor fp32: " + " ".join(f"{k}={v:.3f}" for k, v in anchor[-1].items()), flush=True)
    anchor_median = statistics.median(r["samples_per_s"] for r in anchor) if anchor else None
    for precision, results in ours.items():
        median = statistics.median(r["samples_per_s"] for r in results)
        print(f"ours {precision}: train samples/s (median of {len(results)}) = {median:.2f}")
        if not args.no_sample:
            sample_median = statistics.median(r["sample_s"] for r in results)
            print(f"ours {precision}: sample one image with KV cache s (median) = {sample_median:.2f}")
        if anchor_median:
            print(f"throughput ratio ours {precision} / anchor fp32 = {median / anchor_median:.2f}x")
    if anchor:
        print(f"anchor fp32: train samples/s (median of {len(anchor)}) = {anchor_median:.2f}")
        if all("sample_s" in r for r in anchor):
            print(f"anchor fp32: sample one image s (median) = {statistics.median(r['sample_s'] for r in anchor):.2f}")


if __name__ == "__main__":
    main()
