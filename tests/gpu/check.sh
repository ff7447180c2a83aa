#!/usr/bin/env bash
# The GPU path, on a machine with CUDA (tests/gpu/check.sh, from anywhere in the checkout). Checks, in order:
#   1. the tiny recipe (configs/dalle_tiny.yaml) for 200 steps at precision: auto (bf16-mixed from compute
#      capability 8.0, else 16-mixed), one peer, its validation loss below the step-0 loss;
#   2. a 2-peer swarm of the tiny recipe at fp16 (16-mixed, loss scaling) on this GPU: both peers see each other,
#      the loss scale stays finite, their parameters agree (tests/gpu/swarm_fp16.py);
#   3. LAMB8bit's step on GPU tensors: 8-bit state on the GPU, the same update as on the CPU (tests/gpu/lamb8bit_gpu.py);
#   4. configs/dalle_1b.yaml's first steps (batch 1, LAMB8bit on the GPU), its peak memory printed beside the memory
#      calculator's estimate (tests/gpu/first_steps_1b.py).
# Without CUDA it says so and exits 0. Output: one log per check under $GPU_CHECK_OUT (default: a temporary folder).
set -uo pipefail
cd "$(dirname "$0")/../.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
PYTHON=${PYTHON:-python}

if ! "$PYTHON" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)' 2>/dev/null; then
    echo "tests/gpu/check.sh: no CUDA device here (torch.cuda.is_available() is False): nothing to check, exiting 0"
    exit 0
fi
out=${GPU_CHECK_OUT:-$(mktemp -d /tmp/gpu-check.XXXXXX)}
mkdir -p "$out"
"$PYTHON" -c 'import torch; p = torch.cuda.get_device_properties(0); print(f"GPU: {p.name}, compute capability {p.major}.{p.minor}, {p.total_memory / 2**30:.1f} GiB; torch {torch.__version__}, CUDA {torch.version.cuda}")'
echo "logs: $out"
failed=()

check() {  # check NAME COMMAND...: run it, its output to $out/NAME.log, its last lines and time shown
    local name=$1; shift
    local start=$SECONDS
    echo "== $name: $*"
    if "$@" >"$out/$name.log" 2>&1; then
        echo "-- $name: OK in $((SECONDS - start)) s"
    else
        echo "-- $name: FAILED in $((SECONDS - start)) s"
        failed+=("$name")
    fi
    grep -E "precision auto|step [0-9]+:|peak|OK|peer [0-9]|2-peer|LAMB8bit|Error|error" "$out/$name.log" | tail -12
}

check tiny_200_steps "$PYTHON" -m recipes.dalle fit --config configs/dalle_tiny.yaml --trainer.max_steps 200 \
    --trainer.default_root_dir "$out/tiny" --trainer.callbacks.init_args.dirpath "$out/tiny/checkpoints" \
    --trainer.logger lightning.pytorch.loggers.CSVLogger --trainer.logger.save_dir "$out/tiny" \
    --trainer.enable_progress_bar false --data.init_args.data_dir "$out/data"
"$PYTHON" - "$out/tiny" <<'PY' || failed+=("tiny_200_steps_loss")
import csv, glob, sys
rows = [r for path in glob.glob(f"{sys.argv[1]}/lightning_logs/*/metrics.csv") for r in csv.DictReader(open(path))]
ratios = [float(r["val/image_loss_ratio"]) for r in rows if r.get("val/image_loss_ratio")]
print(f"tiny 200 steps: val/image_loss_ratio (validation loss / step-0 loss) at each validation: {ratios}")
sys.exit(0 if ratios and ratios[-1] < 1.0 else 1)
PY
check swarm_fp16 "$PYTHON" tests/gpu/swarm_fp16.py --device cuda --precision 16-mixed --out "$out/swarm_fp16"
check lamb8bit_gpu "$PYTHON" tests/gpu/lamb8bit_gpu.py --device cuda
check dalle_1b_first_steps "$PYTHON" tests/gpu/first_steps_1b.py --device cuda --steps 3 --batch-size 1

if [ ${#failed[@]} -gt 0 ]; then
    echo "tests/gpu/check.sh: FAILED: ${failed[*]} (logs in $out)"
    exit 1
fi
echo "tests/gpu/check.sh: all GPU checks passed (logs in $out)"
