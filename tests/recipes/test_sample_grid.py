"""The sample-grid callback of configs/dalle_tiny.yaml on a few steps of a real fit: a PNG per validation, of one row
per prompt, and the same grid in TensorBoard's event file when TensorBoard (or tensorboardX) is installed."""

import importlib.util
import struct

import pytest
import torch
from PIL import Image

from recipes.cli import main
from recipes.dalle.sample_grid import DEFAULT_PROMPTS, SampleGrid

from test_cli import TINY  # tests/recipes is on sys.path (no __init__.py)

TENSORBOARD = any(importlib.util.find_spec(name) for name in ("tensorboardX", "tensorboard"))


def event_images(directory) -> list:
    """(tag, step, height, width) of every image summary in the TensorBoard event files under ``directory``."""
    try:
        from tensorboardX.proto.event_pb2 import Event
    except ImportError:
        from tensorboard.compat.proto.event_pb2 import Event
    found = []
    for path in sorted(directory.rglob("events.out.tfevents.*")):
        data = path.read_bytes()
        offset = 0
        while offset < len(data):  # TFRecord: u64 length, u32 crc, payload, u32 crc
            (length,) = struct.unpack_from("<Q", data, offset)
            event = Event.FromString(data[offset + 12: offset + 12 + length])
            offset += 16 + length
            for value in event.summary.value:
                if value.HasField("image"):
                    found.append((value.tag, event.step, value.image.height, value.image.width))
    return found


def test_sample_grid_writes_a_png_per_validation_and_logs_it(tmp_path, one_thread):
    logger = (["--trainer.logger", "lightning.pytorch.loggers.TensorBoardLogger",
               "--trainer.logger.save_dir", str(tmp_path / "run")] if TENSORBOARD else [])
    cli = main(["fit", *TINY, "--trainer.default_root_dir", str(tmp_path / "run"),
                "--trainer.callbacks.init_args.dirpath", str(tmp_path / "run" / "checkpoints"),
                "--data.init_args.data_dir", str(tmp_path / "data"), *logger])
    (grid,) = [c for c in cli.trainer.callbacks if isinstance(c, SampleGrid)]  # named in configs/dalle_tiny.yaml
    assert cli.trainer.global_step == 4
    # validations after local steps 2 and 4 (val_check_interval 2); the sanity check draws none
    expected = [tmp_path / "run" / "samples" / f"step_{step}.png" for step in (2, 4)]
    assert sorted((tmp_path / "run" / "samples").iterdir()) == expected and grid.paths == expected
    cell = 16 * 8 + 2  # the palette codec draws 8 pixels per code of the 16 x 16 grid, then 2 of padding
    for path in expected:
        with Image.open(path) as image:
            assert image.format == "PNG" and image.size == (2 + cell * grid.samples_per_prompt,
                                                            2 + cell * len(DEFAULT_PROMPTS))
    if TENSORBOARD:
        assert event_images(tmp_path / "run") == [("samples", 2, 2 + cell * len(DEFAULT_PROMPTS),
                                                   2 + cell * grid.samples_per_prompt),
                                                  ("samples", 4, 2 + cell * len(DEFAULT_PROMPTS),
                                                   2 + cell * grid.samples_per_prompt)]


def test_sample_grid_draws_the_same_noise_each_time_and_leaves_the_mode_alone(one_thread):
    from recipes.dalle.model import DALLEConfig
    from recipes.dalle.module import DALLEModule

    module = DALLEModule(DALLEConfig(dim=32, depth=2, heads=2, dim_head=8, text_seq_len=16, image_vocab_size=8,
                                     image_grid_size=16, attn_types=("axial_row", "axial_col")),
                         text_vocabulary="shapes")
    module.train()
    callback = SampleGrid(prompts=["a small blue triangle"], samples_per_prompt=3)
    first, second = callback.sample_grid(module), callback.sample_grid(module)
    assert module.training and torch.equal(first, second) and first.shape == (3, 2 + 130, 2 + 130 * 3)
    # three draws of one prompt differ: the generator advances within a grid
    cells = [first[:, 2:130, 2 + 130 * i: 130 * (i + 1)] for i in range(3)]
    assert not torch.equal(cells[0], cells[1]) or not torch.equal(cells[1], cells[2])
    with pytest.raises(ValueError, match="samples_per_prompt"):
        SampleGrid(prompts=["a red circle"], samples_per_prompt=0)
