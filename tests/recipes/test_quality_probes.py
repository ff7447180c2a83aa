"""The issue-28 quality probes (tests/benchmarks/probe_val_loss_by_kind.py, probe_held_out_errors.py): the floor they
subtract is the generator's, and their readings of a checkpoint and of a drawing are right."""

import math
import sys
from collections import Counter
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
from probe_held_out_errors import outcome, pair_outcome, two_shape_ceiling  # noqa: E402
from probe_val_loss_by_kind import losses_by_kind, position_entropy  # noqa: E402

from recipes.dalle.model import DALLEConfig  # noqa: E402
from recipes.dalle.module import DALLEModule  # noqa: E402
from recipes.shapes import GRID_SIZE, _paint, generate_example  # noqa: E402


def test_the_floor_counts_every_position_the_generator_draws():
    """position_entropy is the log of how many placements the generator picks from, uniformly."""
    placements: dict[str, Counter] = {}
    for index in range(20000):
        _, _, labels = generate_example(index, "train")
        kind = labels["size"] if labels["kind"] == "single" else labels["relation"]
        placements.setdefault(kind, Counter())[tuple(obj["box"][:2] for obj in labels["objects"])] += 1
    assert len(placements) == 6  # 2 sizes, 4 relations
    for kind, counts in placements.items():
        labels = {"kind": "single", "size": kind} if kind in ("big", "small") else {"kind": "pair"}
        assert len(counts) == round(math.exp(position_entropy(labels))), kind
        values = np.array(list(counts.values()))
        assert values.min() > 0.2 * values.mean(), f"{kind}: placements not drawn about uniformly"


def test_the_held_out_probe_reads_a_drawing_as_the_checker_does():
    grid = np.zeros((GRID_SIZE, GRID_SIZE), dtype=np.int16)
    _paint(grid, "square", "red", 2, 2, 12)
    assert outcome("red", "square", torch.from_numpy(grid)) == "right"
    assert outcome("red", "triangle", torch.from_numpy(grid)) == "right colour, other shape"
    assert outcome("blue", "square", torch.from_numpy(grid)) == "right shape, other colour"
    assert outcome("blue", "cross", torch.from_numpy(grid)) == "both wrong"
    assert outcome("red", "square", torch.zeros(GRID_SIZE * GRID_SIZE, dtype=torch.long)) == "0 shapes"


def test_the_loss_probe_splits_a_checkpoints_loss_over_the_subsets(tmp_path):
    config = DALLEConfig(dim=32, depth=2, heads=2, dim_head=8, text_seq_len=16, image_vocab_size=8,
                         image_grid_size=16, attn_types=("axial_row", "axial_col"))
    module = DALLEModule(config, text_vocabulary="shapes")
    torch.save({"hyper_parameters": dict(module.hparams), "state_dict": module.state_dict()}, tmp_path / "m.ckpt")
    rows = losses_by_kind(str(tmp_path / "m.ckpt"), num_examples=40, batch_size=16)
    assert rows["all"]["examples"] == 40
    assert rows["seen"]["examples"] + rows["held-out"]["examples"] == 40
    assert rows["single"]["examples"] + rows["two-shape"]["examples"] == 40
    # an untrained model's codes are close to uniform over the 8 codes, far above any floor
    assert abs(rows["all"]["image_loss"] - math.log(8)) < 0.5
    assert 0 < rows["all"]["floor"] < rows["all"]["image_loss"]
    counts = rows["single"]["examples"], rows["two-shape"]["examples"]
    weighted = (rows["single"]["floor"] * counts[0] + rows["two-shape"]["floor"] * counts[1]) / 40
    assert abs(weighted - rows["all"]["floor"]) < 1e-9


def test_the_ceiling_counts_evaluates_two_shape_captions():
    pairs, held_out, ceiling = two_shape_ceiling(128)
    assert 0 < held_out < pairs < 128
    assert ceiling == (pairs - held_out) / pairs


def test_the_pair_probe_says_why_a_two_shape_drawing_fails():
    caption = "a red square above a blue circle"

    def drawing(top: tuple[str, str], bottom: tuple[str, str] | None) -> torch.Tensor:
        grid = np.zeros((GRID_SIZE, GRID_SIZE), dtype=np.int16)
        _paint(grid, top[1], top[0], 1, 3, 6)
        if bottom is not None:
            _paint(grid, bottom[1], bottom[0], 9, 5, 6)
        return torch.from_numpy(grid)

    assert pair_outcome(caption, drawing(("red", "square"), ("blue", "circle"))) == "right"
    assert pair_outcome(caption, drawing(("blue", "circle"), ("red", "square"))) == "relation wrong"
    assert pair_outcome(caption, drawing(("red", "circle"), ("blue", "square"))) == "shapes swapped between the colours"
    assert pair_outcome(caption, drawing(("red", "square"), ("blue", "cross"))) == "colours right, a shape wrong"
    assert pair_outcome(caption, drawing(("red", "square"), ("blue", "square"))) == \
        "colours right, both drawn as one of the shapes"
    assert pair_outcome(caption, drawing(("red", "square"), ("green", "circle"))) == "a colour wrong"
    assert pair_outcome(caption, drawing(("red", "square"), None)) == "1 shapes"
