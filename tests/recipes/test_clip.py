import json

import numpy as np
import open_clip
import pytest
import torch

from recipes.clip.__main__ import main
from recipes.clip.data import ShapesCLIPDataModule, hard_negative_caption
from recipes.clip.module import CLIPModule, contrastive_loss
from recipes.shapes import generate_example, parse_caption

TINY = {
    "embed_dim": 16,
    "vision_cfg": {"image_size": 32, "layers": 1, "width": 32, "head_width": 16, "patch_size": 8},
    "text_cfg": {"context_length": 16, "vocab_size": 49408, "width": 32, "heads": 2, "layers": 1},
}


def differences(a: dict, b: dict) -> int:
    count = sum(a.get(k) != b.get(k) for k in ("size", "relation"))
    for x, y in zip(a["objects"], b["objects"]):
        count += (x["colour"] != y["colour"]) + (x["shape"] != y["shape"])
    return count


def test_hard_negatives_change_exactly_one_detail():
    rng = np.random.default_rng(0)
    for index in range(200):
        caption, _, labels = generate_example(index, "train")
        negative = hard_negative_caption(labels, rng)
        parsed, original = parse_caption(negative), parse_caption(caption)
        assert parsed is not None, negative
        assert differences(parsed, original) == 1, (caption, negative)


def test_loss_without_extra_texts_is_open_clip_clip_loss():
    images = torch.nn.functional.normalize(torch.randn(8, 16), dim=-1)
    texts = torch.nn.functional.normalize(torch.randn(8, 16), dim=-1)
    scale = torch.tensor(10.0)
    assert contrastive_loss(images, texts, scale) == pytest.approx(open_clip.ClipLoss()(images, texts, scale).item())
    negatives = torch.nn.functional.normalize(torch.randn(8, 16), dim=-1)
    assert contrastive_loss(images, torch.cat([texts, negatives]), scale) > contrastive_loss(images, texts, scale)


def test_batches_render_palette_images_at_the_model_size():
    data = ShapesCLIPDataModule(num_train=8, num_val=4, batch_size=4, image_size=32, context_length=16)
    batch = next(iter(data.train_dataloader()))
    assert batch["image"].shape == (4, 3, 32, 32) and batch["text"].shape == (4, 16)
    assert not torch.equal(batch["text"], batch["negative_text"])


def test_training_steps_reduce_the_loss():
    torch.manual_seed(0)
    module = CLIPModule(model_cfg=TINY, lr=3e-3, warmup_steps=1, total_steps=25)
    batch = next(iter(ShapesCLIPDataModule(num_train=32, batch_size=32, image_size=32).train_dataloader()))
    optimizer = module.configure_optimizers()["optimizer"]
    first = module._step(batch)[0].item()
    for _ in range(25):
        loss = module._step(batch)[0]
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    assert module._step(batch)[0].item() < 0.9 * first


def test_cli_fits_and_exports_an_open_clip_local_dir(tmp_path):
    export = tmp_path / "clip"
    # strategy=auto: the swarm (HivemindStrategy, as in the config) is exercised by lightning_swarm tests
    main(["fit", "--config", "configs/clip_tiny.yaml", "--trainer.strategy=auto", f"--model.model_cfg={json.dumps(TINY)}",
          f"--model.export_dir={export}", "--trainer.max_steps=2", "--trainer.val_check_interval=2",
          "--trainer.limit_val_batches=1", "--trainer.enable_progress_bar=false", "--trainer.enable_model_summary=false",
          f"--trainer.default_root_dir={tmp_path}", "--data.num_train=16", "--data.num_val=8",
          "--data.batch_size=8", "--data.image_size=32"])
    config = json.loads((export / "open_clip_config.json").read_text())
    assert config["model_cfg"] == TINY and config["preprocess_cfg"]["size"] == 32
    model, _, _ = open_clip.create_model_and_transforms(f"local-dir:{export}")
    tokens = open_clip.get_tokenizer(f"local-dir:{export}")(["a big red circle"])
    assert tokens.shape == (1, 16)
    with torch.no_grad():
        assert model.encode_text(tokens).shape == (1, 16)
    assert any(p.abs().sum() > 0 for p in model.parameters())


def test_unknown_image_size_is_a_clear_error():
    with pytest.raises(ValueError, match="multiple of the 16-cell grid"):
        ShapesCLIPDataModule(image_size=40).train_dataloader()
