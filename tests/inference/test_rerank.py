import huggingface_hub.constants
import open_clip
import pytest
import torch

from inference.rerank import CLIPReranker, rerank, resolve_clip_name
from recipes.shapes import PaletteCodec, generate_example


def test_rerank_orders_by_score_and_keeps_the_best():
    scores = torch.tensor([0.2, 0.9, -1.0, 0.5, 0.9, 0.1])
    assert rerank(scores, 3).tolist() == [1, 4, 3]  # ties keep candidate order
    assert rerank(scores, 10).tolist() == [1, 4, 3, 0, 5, 2]
    with pytest.raises(ValueError, match="keep"):
        rerank(scores, 0)


def test_resolve_validates_names_tags_and_local_dirs(tmp_path, tiny_clip_dir):
    assert ("ViT-B-32", "openai") in open_clip.list_pretrained()
    assert resolve_clip_name("ViT-B-32", "openai") == ("ViT-B-32", "openai")
    assert resolve_clip_name("ViT-B-32") == ("ViT-B-32", None)
    assert resolve_clip_name(str(tiny_clip_dir)) == (f"local-dir:{tiny_clip_dir}", None)
    with pytest.raises(ValueError, match="no pretrained tag"):
        resolve_clip_name("ViT-B-32", "not-a-tag")
    with pytest.raises(ValueError, match="unknown CLIP model"):
        resolve_clip_name("ViT-Nope")
    with pytest.raises(ValueError, match="recipes.clip fit"):
        resolve_clip_name(str(tmp_path / "missing_clip"))
    with pytest.raises(ValueError, match="open_clip_config.json"):
        resolve_clip_name(str(tmp_path))


def test_real_open_clip_name_is_wired_without_downloading(monkeypatch):
    # architecture only: the real ViT-B-32 with its real preprocessing (224 px, OpenAI mean/std)
    reranker = CLIPReranker.load("ViT-B-32")
    assert reranker.image_size == (224, 224)
    assert reranker.mean == pytest.approx(open_clip.OPENAI_DATASET_MEAN)
    assert reranker.preprocess(torch.rand(2, 3, 128, 128)).shape == (2, 3, 224, 224)
    # with weights: the download is attempted and, offline, fails with an actionable message
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    with pytest.raises(RuntimeError, match="--clip-pretrained"):
        CLIPReranker.load("ViT-B-32", "openai")


def test_tiny_clip_scores_images(tiny_clip_dir):
    reranker = CLIPReranker.load(str(tiny_clip_dir))
    codec = PaletteCodec()
    caption, codes, _ = generate_example(0, "val")
    images = codec.decode(torch.from_numpy(codes.astype("int64"))[None].repeat(3, 1, 1))
    images[1] = 1.0  # a blank image
    scores = reranker.score(images, caption, batch_size=2)
    assert scores.shape == (3,) and torch.isfinite(scores).all()
    assert float(scores[0]) == pytest.approx(float(scores[2]), abs=1e-4)  # same image, same score
    assert scores.abs().max() <= 100.0
