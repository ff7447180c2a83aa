"""Tiny checkpoints built (and trained a few steps) by the tests themselves: a DALL-E Lightning checkpoint
on the palette codec and an exported tiny CLIP directory."""

import lightning as L
import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader

from recipes.clip.data import ShapesCLIPDataModule
from recipes.clip.module import CLIPModule
from recipes.dalle.model import DALLEConfig
from recipes.dalle.module import DALLEModule
from recipes.dalle.tokenizer import TextTokenizer
from recipes.shapes import generate_example

TINY_DALLE = dict(dim=32, depth=2, heads=2, dim_head=16, text_seq_len=12, image_vocab_size=8, image_grid_size=16,
                  attn_types=("axial_row", "axial_col"), shared_layer_ids=None, reversible=True, rotary=True)
TINY_CLIP = {
    "embed_dim": 16,
    "vision_cfg": {"image_size": 32, "layers": 1, "width": 32, "head_width": 16, "patch_size": 8},
    "text_cfg": {"context_length": 16, "vocab_size": 49408, "width": 32, "heads": 2, "layers": 1},
}


def _shapes_batches(text_seq_len: int, count: int, batch_size: int = 8):
    tokenizer = TextTokenizer(text_seq_len)
    rows = [generate_example(i, "train") for i in range(count)]
    text = tokenizer([caption for caption, _, _ in rows])
    image = torch.from_numpy(np.stack([codes for _, codes, _ in rows]).astype(np.int64)).flatten(1)
    return [{"text": t, "image": i} for t, i in zip(text.split(batch_size), image.split(batch_size))]


@pytest.fixture(scope="session")
def tiny_dalle_checkpoint(tmp_path_factory):
    """A DALLEModule checkpoint written by a real Trainer after 3 optimizer steps."""
    torch.manual_seed(0)
    module = DALLEModule(DALLEConfig(**TINY_DALLE), image_codec="palette", warmup_steps=1)
    trainer = L.Trainer(max_steps=3, accelerator="cpu", logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0)
    trainer.fit(module, DataLoader(_shapes_batches(TINY_DALLE["text_seq_len"], 24), batch_size=None))
    path = tmp_path_factory.mktemp("dalle") / "tiny.ckpt"
    trainer.save_checkpoint(path)
    return path


@pytest.fixture(scope="session")
def tiny_clip_dir(tmp_path_factory):
    """A tiny CLIP trained 3 steps on shapes batches and exported in open_clip local-dir format."""
    torch.manual_seed(0)
    directory = tmp_path_factory.mktemp("clip") / "clip_tiny"
    module = CLIPModule(model_cfg=TINY_CLIP, export_dir=str(directory), warmup_steps=1, total_steps=3)
    data = ShapesCLIPDataModule(num_train=48, num_val=16, batch_size=16, image_size=32, context_length=16)
    trainer = L.Trainer(max_steps=3, accelerator="cpu", logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
                        limit_val_batches=0)
    trainer.fit(module, data)  # exports on train end
    return directory


