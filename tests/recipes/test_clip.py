import json

import numpy as np
import open_clip
import pytest
import torch
from safetensors import safe_open

from recipes.clip.__main__ import main
from recipes.clip.data import (NEGATIVE_KINDS, NUM_LAYOUTS, OPPOSITE, RenderCollate, ShapesCLIPDataModule,
                               ShapesCLIPDataset, caption_of, cut_line, draw, hard_negative, hard_negative_caption, keep_blocks, layout_class,
                               negative_kinds)
from recipes.clip.module import CLIPModule, contrastive_loss, same_caption_mask
from recipes.shapes import COLOURS, SHAPES, PaletteCodec, check_caption, find_blobs, generate_example, parse_caption, shape_mask

TINY = {
    "embed_dim": 16,
    "vision_cfg": {"image_size": 32, "layers": 1, "width": 32, "head_width": 16, "patch_size": 8},
    "text_cfg": {"context_length": 16, "vocab_size": 49408, "width": 32, "heads": 2, "layers": 1},
}


def _describe(labels: dict) -> tuple:
    objects = tuple((o["colour"], o["shape"]) for o in labels["objects"])
    return labels["kind"], labels.get("size"), labels.get("relation"), objects


@pytest.mark.parametrize("split", ["train", "val"])
def test_caption_of_rewrites_the_generator_captions(split):
    for index in range(300):
        caption, codes, labels = generate_example(index, split)
        assert caption_of(labels) == caption  # articles included ("an orange ...")
        assert np.array_equal(draw(labels), codes)


def test_each_hard_negative_kind_changes_the_intended_detail_and_its_picture_shows_it():
    rng = np.random.default_rng(0)
    seen = set()
    for index in range(300):
        caption, codes, labels = generate_example(index, "train")
        kind_, size, relation, objects = _describe(labels)
        for kind in negative_kinds(labels):
            seen.add(kind)
            negative = hard_negative(labels, kind, rng)
            text = caption_of(negative)
            assert parse_caption(text) is not None and text != caption, (kind, text)
            _, new_size, new_relation, new_objects = _describe(negative)
            expected = {
                "relation": (size, OPPOSITE.get(relation), objects),
                "swap_objects": (size, relation, objects[::-1]),
                "swap_colours": (size, relation, objects[1:] and ((objects[1][0], objects[0][1]), (objects[0][0], objects[1][1]))),
                "swap_shapes": (size, relation, objects[1:] and ((objects[0][0], objects[1][1]), (objects[1][0], objects[0][1]))),
            }
            if kind in expected:
                assert (new_size, new_relation, new_objects) == expected[kind], (kind, caption, text)
            else:  # one word changed: one colour (to one not in the picture), one shape or the size
                changed = [(a, b) for a, b in zip(objects, new_objects) if a != b]
                if kind == "size":
                    assert new_size != size and not changed
                else:
                    assert len(changed) == 1 and new_relation == relation
                    (old, new), = changed
                    position = 0 if kind == "colour" else 1
                    assert old[position] != new[position] and old[1 - position] == new[1 - position]
                    if kind == "colour":
                        assert new[0] not in {colour for colour, _ in objects}
            picture = draw(negative)  # the negative's picture shows the negative and not the caption
            assert check_caption(text, picture) and not check_caption(caption, picture), (kind, caption, text)
            assert not check_caption(text, codes), (kind, caption, text)
        assert hard_negative_caption(labels, rng) != caption
    assert seen == set(NEGATIVE_KINDS)
    with pytest.raises(ValueError, match="does not apply"):
        hard_negative(generate_example(1, "train")[2], "relation", rng)  # example 1 is a single shape


def test_sloppy_drawings_are_judged_by_the_caption_checker():
    dataset = ShapesCLIPDataset("train", 64, context_length=16, num_negatives=2, num_perturbed=2, sloppy_positive_prob=1.0)
    clean_pictures = 0
    for index in range(len(dataset)):
        caption, clean, _ = generate_example(index, "train")
        example = dataset[index]
        assert example["perturbed_codes"].shape == (2, 16, 16) and example["negative_text"].shape == (2, 16)
        assert check_caption(caption, example["codes"])  # sloppy or clean, it shows the caption
        clean_pictures += np.array_equal(example["codes"].numpy(), clean)
        for picture in example["perturbed_codes"]:
            assert not check_caption(caption, picture)
    assert clean_pictures < len(dataset) // 2  # most pictures were redrawn sloppily


def test_broken_shapes_fall_apart_into_pieces_the_checker_rejects():
    for shape in SHAPES:
        whole = shape_mask(shape, 6)
        for axis in (0, 1):
            cut = cut_line(whole, axis, 0.5)
            assert (cut <= whole).all() and cut.sum() < whole.sum()
            assert not cut.take(3, axis=axis).any()  # the middle row/column is empty
        for parity in (0, 1):
            blocks = keep_blocks(whole, parity)
            assert (blocks <= whole).all()
            rows, cols = np.nonzero(blocks)
            assert (((rows // 2 + cols // 2) % 2) == parity).all()  # only 2x2 blocks of one checkerboard colour
    # a big square cut through the middle is two blobs: not "a big red square" any more
    grid = np.zeros((16, 16), dtype=np.int16)
    grid[2:14, 2:14][cut_line(shape_mask("square", 12), 1, 0.5)] = 1
    assert len(find_blobs(grid)) == 2 and not check_caption("a big red square", grid)


def test_loss_leaves_out_duplicate_captions_and_counts_extra_pictures():
    torch.manual_seed(0)
    images = torch.nn.functional.normalize(torch.randn(4, 16), dim=-1)
    texts = torch.nn.functional.normalize(torch.randn(6, 16), dim=-1)
    tokens = torch.tensor([[1, 2], [3, 4], [1, 2], [5, 6], [3, 4], [7, 8]])  # 0 = 2 and 1 = 4 are one caption
    same = same_caption_mask(tokens[:4], tokens)
    assert same.tolist()[0] == [True, False, True, False, False, False]
    scale = torch.tensor(10.0)
    masked = contrastive_loss(images, texts, scale, same)
    # the duplicates are no negatives: the same loss as by hand with their logits removed
    logits = scale * images @ texts.T
    keep = ~same | torch.eye(4, 6, dtype=torch.bool)
    image_to_text = torch.stack([-torch.log_softmax(logits[i][keep[i]], 0)[keep[i][: i + 1].sum() - 1] for i in range(4)])
    text_logits = logits[:, :4].T
    keep_text = keep[:, :4].T
    text_to_image = torch.stack([-torch.log_softmax(text_logits[j][keep_text[j]], 0)[keep_text[j][: j + 1].sum() - 1]
                                 for j in range(4)])
    assert masked.item() == pytest.approx(((image_to_text.mean() + text_to_image.mean()) / 2).item(), rel=1e-5)
    assert masked < contrastive_loss(images, texts, scale)
    extra = torch.nn.functional.normalize(torch.randn(3, 16), dim=-1)
    assert contrastive_loss(images, texts, scale, same, extra) > masked


def test_layout_class_names_how_the_picture_is_arranged_and_the_left_or_top_colour():
    seen = set()
    for index in range(200):
        caption, codes, labels = generate_example(index, "val")
        layout = layout_class(labels)
        if labels["kind"] == "single":
            assert layout == -1
            continue
        assert 0 <= layout < NUM_LAYOUTS
        seen.add(layout)
        stacked, colour = divmod(layout, len(COLOURS))
        # read the arrangement off the picture itself: the blob whose centre comes first along the longer offset
        blobs = find_blobs(codes)
        offset = blobs[1]["centre"] - blobs[0]["centre"]
        axis = 0 if abs(offset[0]) > abs(offset[1]) else 1
        leading = min(blobs, key=lambda blob: blob["centre"][axis])
        assert bool(stacked) == (axis == 0), caption
        assert COLOURS[colour] == leading["colour"], caption
        assert layout_class(hard_negative(labels, "relation", np.random.default_rng(0))) != layout
        assert layout_class(hard_negative(labels, "swap_objects", np.random.default_rng(0))) != layout
    assert len(seen) > 10


def test_layout_head_learns_from_both_towers_and_stays_out_of_the_export(tmp_path):
    torch.manual_seed(0)
    module = CLIPModule(model_cfg=TINY, lr=3e-3, warmup_steps=1, total_steps=30, layout_weight=1.0)
    batch = next(iter(ShapesCLIPDataModule(num_train=64, batch_size=64, image_size=32, num_negatives=2).train_dataloader()))
    pairs = batch["layout"] >= 0
    assert pairs.any() and not pairs.all()

    def layout_hits():
        with torch.no_grad():
            images, texts = module(batch["image"], batch["text"])
            return [(module.layout_head(f).argmax(-1) == batch["layout"])[pairs].float().mean() for f in (images, texts)]

    optimizer = module.configure_optimizers()["optimizer"]
    assert any(p is module.layout_head.weight for group in optimizer.param_groups for p in group["params"])
    before = layout_hits()
    for _ in range(30):
        loss = module._step(batch)[0]
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    after = layout_hits()
    assert after[0] > before[0] + 0.2 and after[1] > before[1] + 0.2, (before, after)
    module.export(tmp_path)
    with safe_open(str(tmp_path / "open_clip_model.safetensors"), framework="pt") as exported:
        assert not any("layout" in key for key in exported.keys())
    with torch.no_grad():
        weighted = module._step(batch)[0]
        module.hparams.layout_weight = 0.0  # the same weights without the term
        assert module._step(batch)[0] < weighted


def test_batches_render_palette_images_at_the_model_size():
    data = ShapesCLIPDataModule(num_train=8, num_val=4, batch_size=4, image_size=32, context_length=16)
    batch = next(iter(data.train_dataloader()))
    assert batch["image"].shape == (4, 3, 32, 32) and batch["text"].shape == (4, 16)
    assert not torch.equal(batch["text"], batch["negative_text"])


def test_batch_pictures_and_tokens_are_the_codec_and_tokenizer_outputs():
    """The batch path renders and tokenizes its own (faster) way: the result must stay what the palette codec
    (normalised as the exported preprocess config says) and open_clip's tokenizer give."""
    dataset = ShapesCLIPDataset("train", 8, context_length=16, num_negatives=2, num_perturbed=1)
    examples = [dataset[i] for i in range(8)] + [dataset[0]]  # a repeated caption comes from the cache
    mean, std = open_clip.OPENAI_DATASET_MEAN, open_clip.OPENAI_DATASET_STD
    batch = RenderCollate(32, mean, std)(examples)
    codes = torch.stack([e["perturbed_codes"] for e in examples])  # [9, 1, 16, 16]
    expected = (PaletteCodec(cell_pixels=2).decode(codes.flatten(0, 1)) - torch.tensor(mean).view(1, 3, 1, 1)) \
        / torch.tensor(std).view(1, 3, 1, 1)
    assert torch.equal(batch["perturbed_image"].flatten(0, 1), expected)
    captions = [generate_example(i, "train", 0)[0] for i in range(8)] + [generate_example(0, "train", 0)[0]]
    assert torch.equal(batch["text"], open_clip.tokenizer.SimpleTokenizer(context_length=16)(captions))
    with pytest.raises(ValueError, match="codes must lie in"):
        RenderCollate(32, mean, std).render(torch.full((1, 16, 16), 8))


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
