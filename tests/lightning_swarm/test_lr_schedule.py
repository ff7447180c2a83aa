"""The one LR schedule of the recipes: linear warm-up, then linear or cosine decay (or constant)."""

import io
import math

import pytest
import torch
import yaml

from lightning_swarm.lr_schedule import lr_multiplier, warmup_decay_scheduler


def test_the_seed_runs_linear_schedule():
    """31,250 global steps, 10% warm-up, linear to 0 (configs/dalle_1b.yaml)."""
    m = lambda step: lr_multiplier(step, warmup_steps=3125, decay_steps=28125, decay="linear", min_lr_ratio=0.0)
    assert m(0) == pytest.approx(1 / 3125)
    assert m(3124) == m(3125) == 1.0                     # the peak after exactly warmup_steps steps
    assert m(3125 + 28125 // 2) == pytest.approx(0.5, abs=1e-4)
    assert m(31250) == 0.0 and m(40000) == 0.0
    steps = [m(s) for s in range(3125, 31251, 1000)]
    assert all(a > b for a, b in zip(steps, steps[1:]))   # strictly decreasing after the warm-up


def test_cosine_decays_to_the_floor_and_constant_keeps_the_peak():
    m = lambda step: lr_multiplier(step, warmup_steps=10, decay_steps=100, decay="cosine", min_lr_ratio=0.1)
    assert m(9) == 1.0
    assert m(60) == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 0.5)))
    assert m(110) == pytest.approx(0.1) and m(500) == pytest.approx(0.1)
    assert lr_multiplier(10_000, warmup_steps=5, decay_steps=None) == 1.0
    assert lr_multiplier(0, warmup_steps=0, decay_steps=10, decay="linear", min_lr_ratio=0.0) == 1.0


@pytest.mark.parametrize("kwargs, match", [
    (dict(warmup_steps=-1, decay_steps=None), "warmup_steps"), (dict(warmup_steps=1, decay_steps=0), "decay_steps"),
    (dict(warmup_steps=1, decay_steps=5, decay="step"), "decay"),
    (dict(warmup_steps=1, decay_steps=5, min_lr_ratio=1.5), "min_lr_ratio"),
])
def test_bad_schedules_are_clear_errors(kwargs, match):
    with pytest.raises(ValueError, match=match):
        warmup_decay_scheduler(torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0), **kwargs)


def _lrs_of(module, steps):
    config = module.configure_optimizers()
    optimizer, scheduler = config["optimizer"], config["lr_scheduler"]["scheduler"]
    peak = scheduler.base_lrs[0]
    lrs = []
    for _ in range(steps):
        lrs.append(optimizer.param_groups[0]["lr"] / peak)
        optimizer.step()
        scheduler.step()
    return lrs, scheduler


def test_both_recipes_follow_the_one_schedule():
    from recipes.clip.module import CLIPModule
    from recipes.dalle.model import DALLEConfig
    from recipes.dalle.module import DALLEModule

    config = DALLEConfig(dim=32, depth=2, heads=2, dim_head=8, text_seq_len=8, image_vocab_size=8, image_grid_size=4,
                         conv_kernel_size=3)
    dalle = DALLEModule(config, warmup_steps=3, decay_steps=10, decay="linear", min_lr_ratio=0.0)
    lrs, scheduler = _lrs_of(dalle, 16)
    assert lrs == pytest.approx([lr_multiplier(s, 3, 10, "linear", 0.0) for s in range(16)])
    # the schedule is code, not state: a checkpoint holds plain types only and loads without unpickling
    buffer = io.BytesIO()
    torch.save(scheduler.state_dict(), buffer)
    buffer.seek(0)
    assert torch.load(buffer, weights_only=True)["last_epoch"] == 16

    tiny_clip = dict(embed_dim=16, vision_cfg=dict(image_size=32, layers=1, width=32, head_width=16, patch_size=16),
                     text_cfg=dict(context_length=8, vocab_size=49408, width=32, heads=2, layers=1))
    clip = CLIPModule(model_cfg=tiny_clip, warmup_steps=2, total_steps=12, layout_weight=0.0, export_dir=None)
    lrs, _ = _lrs_of(clip, 14)
    assert lrs == pytest.approx([lr_multiplier(s, 2, 10, "cosine", 0.1) for s in range(14)])
    with pytest.raises(ValueError, match="decay"):
        CLIPModule(model_cfg=tiny_clip, decay="exponential", export_dir=None)


def test_the_1b_config_uses_the_seed_runs_schedule_and_lamb_thresholds():
    with open("configs/dalle_1b.yaml") as f:
        config = yaml.safe_load(f)
    model = config["model"]["init_args"]
    assert (model["warmup_steps"], model["decay_steps"], model["decay"], model["min_lr_ratio"]) == (3125, 28125,
                                                                                                   "linear", 0.0)
    optimizer = model["optimizer"]["init_args"]
    assert optimizer["lr"] == 0.0025
    assert (optimizer["min_8bit_size"], optimizer["block_size"]) == (65536, 4096)
