import json
import warnings

import numpy as np
import pytest
import lightning as L
import torch
from PIL import Image

from inference import evaluate, generate
from inference.checkpoint import LoadedDALLE, load_dalle
from inference.evaluate import load_candidates, summarize, validation_captions
from recipes.dalle.model import DALLE, DALLEConfig
from recipes.dalle.tokenizer import TextTokenizer, shapes_token_ids
from recipes.shapes import PaletteCodec, check_caption, parse_caption


def test_checkpoint_loads_without_unpickling(tiny_dalle_checkpoint):
    dalle = load_dalle(tiny_dalle_checkpoint)
    assert dalle.model.config.image_vocab_size == dalle.codec.codebook_size == 8
    images = dalle.decode(torch.zeros(2, 256, dtype=torch.long))
    assert images.shape == (2, 3, 128, 128)
    with pytest.raises(ValueError, match="recipes.dalle fit"):
        load_dalle(tiny_dalle_checkpoint.parent / "missing.ckpt")


class NotADalle(L.LightningModule):
    def __init__(self, width: int = 2):
        super().__init__()
        self.save_hyperparameters()
        self.layer = torch.nn.Linear(width, width)


def test_swarm_checkpoints_load_from_a_directory_its_root_or_a_url(tiny_dalle_checkpoint, tmp_path):
    """The format SwarmCheckpoint and the monitor write: meta.json rebuilds the model (codec included)."""
    from lightning_swarm.checkpoint.checkpoint_io import save_checkpoint
    from recipes.dalle.module import DALLEModule

    module = DALLEModule.from_checkpoint(str(tiny_dalle_checkpoint))
    path = save_checkpoint(str(tmp_path / "run"), module, global_epoch=7)
    expected = module.model.state_dict()
    for source in (path, str(tmp_path / "run"), f"file://{tmp_path / 'run'}"):
        dalle = load_dalle(source)
        assert dalle.codec.codebook_size == 8 and dalle.model.config == module.model.config
        for name, tensor in dalle.model.state_dict().items():
            assert torch.equal(tensor, expected[name]), (source, name)
    with pytest.raises(ValueError, match="No checkpoint at"):
        load_dalle(str(tmp_path / "empty"))
    save_checkpoint(str(tmp_path / "other"), NotADalle(width=3), global_epoch=1)
    package = NotADalle.__module__.split(".")[0]
    with pytest.raises(ValueError, match=f"outside the packages allowed .* --allow-model-package {package}"):
        load_dalle(str(tmp_path / "other"))  # a class of this test module: not allowed by default
    with pytest.raises(ValueError, match="holds a NotADalle, not a recipes.dalle.module.DALLEModule"):
        load_dalle(str(tmp_path / "other"), allowed_model_packages=(package,))


def test_generate_cli_writes_grids_and_scores(tiny_dalle_checkpoint, tiny_clip_dir, tmp_path):
    out = tmp_path / "samples"
    prompts = ["a big red circle", "a blue cross above a green square"]
    argv = ["--checkpoint", str(tiny_dalle_checkpoint), "--prompt", prompts[0], "--prompt", prompts[1],
            "--num-candidates", "5", "--keep", "4", "--batch-size", "5", "--top-k", "6", "--top-p", "0.9",
            "--clip-model", str(tiny_clip_dir), "--out", str(out), "--seed", "3"]
    results = generate.main(argv)
    written = json.loads((out / "results.json").read_text())
    assert written == results and [r["prompt"] for r in written] == prompts
    for result in written:
        kept = result["kept"]
        assert [k["rank"] for k in kept] == [1, 2, 3, 4]
        scores = [k["clip_score"] for k in kept]
        assert scores == sorted(scores, reverse=True)  # best first
        assert len({k["candidate"] for k in kept}) == 4 and all(0 <= k["candidate"] < 5 for k in kept)
        grid = np.asarray(Image.open(out / result["grid"]))
        # 4 images of 128 px in a 2x2 grid with 2 px padding
        assert grid.shape == (2 * 128 + 3 * 2, 2 * 128 + 3 * 2, 3)
    assert generate.main(argv) == results  # same seed, same candidates and scores


def test_kept_images_are_the_highest_scoring_candidates(tiny_dalle_checkpoint, tiny_clip_dir):
    from inference.rerank import CLIPReranker

    dalle, reranker = load_dalle(tiny_dalle_checkpoint), CLIPReranker.load(str(tiny_clip_dir))
    codes, scores = generate.sample_and_score(dalle, reranker, "a small black cross", 3, batch_size=2,
                                              generator=torch.Generator().manual_seed(0))
    assert codes.shape == (3, 256) and scores.shape == (3,)
    # scores belong to their candidates: rescoring the decoded codes gives the same numbers
    assert torch.allclose(reranker.score(dalle.decode(codes), "a small black cross"), scores, atol=1e-4)


def test_summary_counts_random_top1_and_best_of_n():
    correct = torch.tensor([[True, False, False, False], [False, False, False, False], [False, True, True, False]])
    scores = torch.tensor([[9.0, 1.0, 2.0, 3.0], [1.0, 2.0, 3.0, 4.0], [5.0, 1.0, 0.0, 0.5]])
    row = summarize(correct, scores)
    assert row["random_acc"] == pytest.approx(3 / 12)
    assert row["clip_top1_acc"] == pytest.approx(1 / 3)  # caption 0 picks its correct image, 2 does not
    assert row["best_of_n"] == pytest.approx(2 / 3)
    gains = torch.tensor([1 - 1 / 4, 0.0, 0 - 2 / 4])  # per caption: CLIP's pick minus the mean candidate
    assert row["top1_gain"] == pytest.approx(row["clip_top1_acc"] - row["random_acc"])
    assert row["gain_se"] == pytest.approx(gains.std().item() / 3**0.5)
    assert summarize(correct[:1], scores[:1])["gain_se"] == 0.0  # no spread to measure from one caption
    assert row["top1_clip"] == pytest.approx((9 + 4 + 5) / 3)


def test_validation_captions_are_distinct_and_flag_held_out_pairs():
    captions = validation_captions(20)
    assert len({c for c, _ in captions}) == 20
    assert any(held for _, held in captions) and not all(held for _, held in captions)


def test_evaluate_cli_prints_a_table_and_writes_json(tiny_dalle_checkpoint, tiny_clip_dir, tmp_path, capsys):
    report_path = tmp_path / "eval.json"
    report = evaluate.main(["--checkpoint", str(tiny_dalle_checkpoint), "--clip-model", str(tiny_clip_dir),
                            "--num-captions", "3", "--num-candidates", "2", "--batch-size", "6",
                            "--json", str(report_path)])
    table = capsys.readouterr().out
    assert "clip_top1_acc" in table and "random_acc" in table and "top1_gain" in table
    assert json.loads(report_path.read_text())["report"] == report
    assert report["all"]["captions"] == 3
    # subsets by held-out pair and by kind, each partitioning the captions (empty subsets are left out)
    items = validation_captions(3)
    kinds = [parse_caption(caption)["kind"] for caption, _ in items]
    expected = {"held_out": sum(h for _, h in items), "not_held_out": sum(not h for _, h in items),
                "single": kinds.count("single"), "pair": kinds.count("pair")}
    assert {name: row["captions"] for name, row in report.items() if name != "all"} == {
        name: count for name, count in expected.items() if count}
    for row in report.values():
        assert 0.0 <= row["random_acc"] <= row["best_of_n"] <= 1.0
        assert row["clip_top1_acc"] <= row["best_of_n"]


def test_evaluate_rescores_saved_candidates_instead_of_sampling(tiny_dalle_checkpoint, tiny_clip_dir, tmp_path, capsys):
    saved = tmp_path / "candidates.safetensors"
    args = ["--checkpoint", str(tiny_dalle_checkpoint), "--clip-model", str(tiny_clip_dir), "--num-captions", "3",
            "--num-candidates", "2", "--batch-size", "4"]
    first = evaluate.main(args + ["--save-candidates", str(saved)])
    captions = [caption for caption, _ in validation_captions(3)]
    codes = load_candidates(saved, captions, 2)
    assert codes.shape == (3, 2, 256)
    # the file holds the judged pictures: the checker's verdicts on them give the report's random accuracy
    correct = [check_caption(caption, grid) for caption, grids in zip(captions, codes) for grid in grids]
    assert sum(correct) / len(correct) == pytest.approx(first["all"]["random_acc"])
    # other sampling settings are unused: the same pictures, the same report
    assert evaluate.main(args + ["--candidates", str(saved), "--seed", "7", "--temperature", "3"]) == first
    assert "the candidates of" in capsys.readouterr().out
    assert load_candidates(saved, captions[:2], 1).shape == (2, 1, 256)  # a prefix of captions and candidates
    with pytest.raises(ValueError, match="do not start with"):
        evaluate.main(args[:4] + ["--num-captions", "4", "--num-candidates", "2", "--candidates", str(saved)])


def test_sampling_warns_about_prompt_words_outside_the_compact_vocabulary():
    config = DALLEConfig(dim=32, depth=2, heads=2, dim_head=16, text_seq_len=16, image_vocab_size=8,
                         image_grid_size=4, attn_types=("axial_row", "axial_col"), conv_kernel_size=3,
                         text_token_ids=shapes_token_ids())
    model = DALLE(config).eval()
    dalle = LoadedDALLE(model, TextTokenizer(16), PaletteCodec())
    with pytest.warns(UserWarning, match="pink"):
        codes, _ = generate.sample_and_score(dalle, None, "a pink circle", num_candidates=1, batch_size=1)
    assert codes.shape == (1, 16)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        generate.sample_and_score(dalle, None, "a red circle", num_candidates=1, batch_size=1)
