"""The README's flow as tests/benchmarks/bench_readme_flow.py runs it (train, reranker, evaluate: three real
commands in a fresh directory with a fresh HOME), on tiny models and a few steps: every command exits 0 and the
summary holds the machine record and the evaluate table the full benchmark prints.

Slow: four Python processes that import torch and Lightning (the probe, two fits with a one-peer swarm each,
evaluate) cost ~35-40 s of CPU; 34-42 s wall at a load average of 2.5-3 on 2 cores, 180 s at 15."""

import json
import math
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
from bench_readme_flow import STEPS, format_summary, run_flow  # noqa: E402

TINY_DALLE = [
    "--model.init_args.config.dim", "32", "--model.init_args.config.depth", "2",
    "--model.init_args.config.heads", "2", "--model.init_args.config.dim_head", "8",
    "--model.init_args.config.attn_types", "[axial_row, axial_col]",
    "--trainer.max_steps", "4", "--trainer.val_check_interval", "2", "--trainer.enable_progress_bar", "false",
    "--trainer.callbacks.init_args.every_n_epochs", "1",
    "--trainer.strategy.init_args.target_batch_size", "8",  # a global step every 2 local steps
    "--data.init_args.batch_size", "4", "--data.init_args.max_val_batches", "1",
    "--data.init_args.num_shapes_train", "64", "--data.init_args.num_shapes_val", "16",
    "--data.init_args.shuffle_buffer", "16",
]
TINY_CLIP_MODEL = {"embed_dim": 16,
                   "vision_cfg": {"image_size": 32, "layers": 1, "width": 32, "head_width": 16, "patch_size": 8},
                   "text_cfg": {"context_length": 16, "vocab_size": 49408, "width": 32, "heads": 2, "layers": 1}}
TINY_CLIP = [
    "--model.init_args.model_cfg", json.dumps(TINY_CLIP_MODEL), "--model.init_args.warmup_steps", "1",
    "--model.init_args.total_steps", "2", "--trainer.max_steps", "2", "--trainer.val_check_interval", "2",
    "--trainer.limit_val_batches", "1", "--trainer.enable_progress_bar", "false",
    "--trainer.strategy.init_args.target_batch_size", "8",
    "--data.init_args.num_train", "16", "--data.init_args.num_val", "8", "--data.init_args.batch_size", "8",
    "--data.init_args.image_size", "32", "--data.init_args.num_workers", "0",
]
# 6 captions: single and two-shape ones, held-out compositions and others (every subset of the table)
TINY_EVALUATE = ["--num-captions", "6", "--num-candidates", "2", "--batch-size", "12"]


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_the_readme_flow_runs_end_to_end_and_prints_the_evaluate_table(tmp_path):
    summary = run_flow(tmp_path / "work", home=tmp_path / "home", seed=3, timeout=600,
                       extra={"dalle": TINY_DALLE, "clip": TINY_CLIP, "evaluate": TINY_EVALUATE})

    assert list(summary["runs"]) == list(STEPS)
    for name, run in summary["runs"].items():
        assert run["returncode"] == 0, f"{name} failed, see {run['log']}"
        assert run["wall_s"] > 0 and run["cpu_s"] > 0
    # the README's commands, configs by absolute path, then the seed, then the overrides
    dalle = summary["runs"]["dalle"]["argv"]
    assert dalle[1:5] == ["-m", "recipes.dalle", "fit", "--config"] and Path(dalle[5]).is_absolute()
    assert dalle[6:10] == ["--seed_everything", "3", "--data.init_args.seed", "3"]
    assert summary["runs"]["evaluate"]["argv"][1:7] == [
        "-m", "inference.evaluate", "--checkpoint", "runs/dalle_tiny/checkpoints", "--json", "eval.json"]
    # the data went to the fresh HOME's cache, the reranker where evaluate looks for it by default
    assert (tmp_path / "home" / ".cache" / "lightning_swarm" / "shapes-v2" / "rows-64-16" / "DONE").exists()
    assert (tmp_path / "work" / "checkpoints" / "clip_tiny" / "open_clip_config.json").exists()

    machine = summary["machine"]
    assert machine["precision_auto"] in ("32-true", "bf16-mixed") and machine["onednn_isa"]
    assert summary["commit"] and summary["commit"] != "unknown"
    assert summary["commit_at_end"] is None  # nothing was committed while it ran

    # validations after local steps 2 and 4 (logged at steps 1 and 3), the last is the final val image loss
    assert [step for step, _ in summary["val_image_losses"]] == [1, 3]
    # 2 local steps a global step, or fewer where hivemind's time estimate ran out first (timing, not asserted)
    assert summary["checkpoint"]["local_step"] == 4 and 2 <= summary["checkpoint"]["global_epoch"] <= 4
    figures = summary["figures"]
    assert figures["final_val_image_loss"] == summary["val_image_losses"][-1][1]
    assert figures["captions"] == 6
    for key in ("random", "clip_top1", "two_shape_random", "two_shape_top1", "held_out_random", "held_out_top1"):
        assert 0.0 <= figures[key] <= 1.0, key
    assert -1.0 <= figures["top1_gain"] <= 1.0 and math.isfinite(figures["gain_se"])
    assert set(summary["report"]) == {"all", "held_out", "not_held_out", "single", "pair"}
    assert summary["report"]["single"]["captions"] + summary["report"]["pair"]["captions"] == 6
    assert [line.split()[0] for line in summary["evaluate_table"]] == [
        "subset", "all", "held_out", "not_held_out", "single", "pair"]

    text = format_summary(summary)
    assert "precision: auto -> " in text and "| final val image loss |" in text and summary["commit"] in text
