"""recipes.dalle.preprocess: folder / tar / datasets sources -> parquet shards the DataModule streams back."""

import io
import json
import tarfile

import numpy as np
import pyarrow.parquet as pq
import pytest
import torch
from PIL import Image

from parquet_damage import assert_pages_carry_checksums
from recipes.dalle.data import DALLEDataModule
from recipes.dalle.preprocess import main, preprocess
from recipes.dalle.preprocess_sources import iter_folder, iter_hf_dataset, iter_tar_shards
from recipes.rows import decode_code
from recipes.shapes import PaletteCodec, generate_example

CODEC = PaletteCodec(cell_pixels=8)  # 128x128 images <-> 16x16 grids of 8 codes, exactly


def shapes_png(index: int) -> tuple[str, np.ndarray, bytes]:
    """(caption, 16x16 codes, PNG bytes of the 128x128 picture) of shapes example `index`."""
    caption, grid, _ = generate_example(index, "train", seed=0)
    pixels = CODEC.decode(torch.from_numpy(grid.astype(np.int64))[None])[0]
    array = (pixels.permute(1, 2, 0).numpy() * 255).round().astype(np.uint8)
    buffer = io.BytesIO()
    Image.fromarray(array).save(buffer, format="PNG")
    return caption, grid.astype(np.int64), buffer.getvalue()


def write_folder(root, num_good: int = 9) -> list[tuple[str, np.ndarray]]:
    """Good pairs img-00.. plus one of each bad kind (sorted last); returns the good (caption, codes) in order."""
    root.mkdir(parents=True, exist_ok=True)
    expected = []
    for i in range(num_good):
        caption, grid, png = shapes_png(i)
        (root / f"img-{i:02d}.png").write_bytes(png)
        (root / f"img-{i:02d}.txt").write_text(caption + "\n")
        expected.append((caption, grid.flatten()))
    _, _, png = shapes_png(100)
    (root / "img-03.json").write_text(json.dumps({"NSFW": "UNLIKELY", "url": "https://example.com/3.png"}))
    (root / "img-05.json").write_text(json.dumps({"original_width": "n/a", "url": 5}))  # odd metadata: kept
    (root / "z-bad-garbage.png").write_bytes(b"this is not a png at all")
    (root / "z-bad-garbage.txt").write_text("a picture that cannot be read")
    (root / "z-bad-truncated.png").write_bytes(png[: len(png) // 2])
    (root / "z-bad-truncated.txt").write_text("a picture cut in half")
    (root / "z-bad-nocaption.png").write_bytes(png)  # no .txt next to it
    (root / "z-bad-short.png").write_bytes(png)
    (root / "z-bad-short.txt").write_text("ab")
    (root / "z-bad-nsfw.png").write_bytes(png)
    (root / "z-bad-nsfw.txt").write_text("a red square")
    (root / "z-bad-nsfw.json").write_text(json.dumps({"NSFW": "NSFW"}))
    Image.new("RGB", (300, 100), "white").save(root / "z-bad-wide.png")  # aspect ratio 3 > 2
    (root / "z-bad-wide.txt").write_text("a very wide picture")
    return expected


def stream_rows(files: str) -> list[tuple[str, tuple[int, ...]]]:
    datamodule = DALLEDataModule(train_files=files, val_files=files, image_grid_size=16, codebook_size=8,
                                 batch_size=4, text_seq_len=16, cycle=False, seed=0, shuffle_buffer=8)
    datamodule.setup("fit")
    rows = []
    for batch in datamodule.train_dataloader():
        assert batch["image"].shape[1] == 256
        rows.extend(zip(batch["caption"], map(tuple, batch["image"].tolist())))
    assert sum(datamodule.skipped.values()) == 0
    return rows


def test_folder_to_shards_streams_back_row_for_row(tmp_path):
    expected = write_folder(tmp_path / "images")
    out = tmp_path / "shards"
    stats = main(["--folder", str(tmp_path / "images"), "--out", str(out), "--codec", "palette",
                  "--rows-per-shard", "5", "--batch-size", "3", "--num-workers", "2"])
    assert stats == {"shards_written": 3, "shards_skipped": 0, "kept": 9, "corrupt_row": 1, "short_caption": 1,
                     "nsfw": 1, "corrupt_image": 2, "aspect_ratio": 1}

    shards = sorted(out.glob("*.parquet"))
    # input pairs 10-14 are all bad: that shard is finished (stats) but has no (empty) parquet file
    assert [p.name for p in shards] == ["train-00000.parquet", "train-00001.parquet"]
    assert json.loads((out / "_stats" / "train-00002.json").read_text())["kept"] == 0
    table = pq.read_table(shards)
    assert table.column_names[:4] == ["caption", "code", "original_width", "original_height"]
    assert pq.ParquetFile(shards[0]).metadata.row_group(0).column(1).compression == "BROTLI"
    rows = table.to_pylist()
    # in input order: captions and codes exactly as generated (the palette codec round-trips exactly)
    assert [(r["caption"], tuple(decode_code(r["code"]))) for r in rows] == [(c, tuple(g)) for c, g in expected]
    assert all(r["original_width"] == r["original_height"] == 128 for r in rows)
    assert rows[3]["NSFW"] == "UNLIKELY" and rows[3]["url"] == "https://example.com/3.png"
    assert rows[0]["NSFW"] is None and rows[0]["key"] == "img-00.png"
    assert rows[5]["url"] == "5" and rows[5]["original_width"] == 128

    streamed = stream_rows(str(out / "*.parquet"))
    assert sorted(streamed) == sorted((c, tuple(g)) for c, g in expected)
    assert_pages_carry_checksums(shards[0])


def test_interrupted_run_resumes_without_redoing_finished_shards(tmp_path):
    write_folder(tmp_path / "images", num_good=12)
    args = dict(codec=CODEC, rows_per_shard=4, batch_size=4, num_workers=1)

    first = preprocess(iter_folder(tmp_path / "images"), out_dir=tmp_path / "out", max_shards=2, **args)
    assert first["shards_written"] == 2
    finished = {p.name: (p.stat().st_ino, p.stat().st_mtime_ns) for p in (tmp_path / "out").glob("*.parquet")}
    assert len(finished) == 2
    (tmp_path / "out" / "tmpcrashed.tmp").write_bytes(b"half a shard")  # what a kill during a write leaves

    second = preprocess(iter_folder(tmp_path / "images"), out_dir=tmp_path / "out", **args)
    total_shards = -(-len(list(iter_folder(tmp_path / "images"))) // 4)
    assert second["shards_skipped"] == 2 and second["shards_written"] == total_shards - 2
    for name, identity in finished.items():  # untouched, not rewritten
        path = tmp_path / "out" / name
        assert (path.stat().st_ino, path.stat().st_mtime_ns) == identity

    uninterrupted = preprocess(iter_folder(tmp_path / "images"), out_dir=tmp_path / "fresh", **args)
    for key in ("kept",) + tuple(k for k in uninterrupted if k not in ("shards_written", "shards_skipped")):
        assert second[key] == uninterrupted[key]
    resumed = pq.read_table(sorted((tmp_path / "out").glob("*.parquet")))
    fresh = pq.read_table(sorted((tmp_path / "fresh").glob("*.parquet")))
    assert resumed.num_rows == 12 and resumed.equals(fresh)


def test_tar_shards_with_corrupt_members_and_truncated_tail(tmp_path):
    samples = []
    with tarfile.open(tmp_path / "00000.tar", "w") as archive:
        def add(name, data):
            info = tarfile.TarInfo(name)
            info.size = len(data)
            archive.addfile(info, io.BytesIO(data))

        for i in range(4):
            caption, grid, png = shapes_png(i)
            add(f"{i:09d}.png", png)
            add(f"{i:09d}.txt", caption.encode())
            add(f"{i:09d}.json", json.dumps({"NSFW": "UNLIKELY", "url": f"http://x/{i}", "width": 128}).encode())
            samples.append((caption, tuple(grid.flatten())))
        add("000000004.txt", b"a caption without its image")
        add("000000005.png", png)
        add("000000005.txt", b"\xff\xfe not utf-8 \xff")
        add("000000006.png", b"\x89PNG garbage")
        add("000000006.txt", b"a blue circle")
        add("000000007.png", png)  # this sample gets cut by the truncation below
        add("000000007.txt", b"a lost sample")
    data = (tmp_path / "00000.tar").read_bytes()
    (tmp_path / "00000.tar").write_bytes(data[: data.rfind(png) + 100])  # cut inside sample 7's image

    stats = preprocess(iter_tar_shards(str(tmp_path / "*.tar")), CODEC, tmp_path / "out", rows_per_shard=100,
                       batch_size=2, num_workers=1)
    assert stats["kept"] == 4 and stats["corrupt_row"] == 2 and stats["corrupt_image"] == 1
    rows = pq.read_table(tmp_path / "out" / "train-00000.parquet").to_pylist()
    assert [(r["caption"], tuple(decode_code(r["code"]))) for r in rows] == samples
    assert rows[2]["url"] == "http://x/2" and rows[2]["NSFW"] == "UNLIKELY"


def test_datasets_source_with_corrupt_image(tmp_path):
    import datasets

    expected, images, captions, nsfw = [], [], [], []
    for i in range(3):
        caption, grid, png = shapes_png(i)
        images.append({"bytes": png, "path": None})
        captions.append(caption)
        nsfw.append("UNLIKELY")
        expected.append((caption, tuple(grid.flatten())))
    images.append({"bytes": b"not an image", "path": None})
    captions.append("a broken one")
    nsfw.append("UNLIKELY")
    images.append({"bytes": png, "path": None})
    captions.append("an unsafe one")
    nsfw.append("UNSURE")
    features = datasets.Features({"image": datasets.Image(), "text": datasets.Value("string"),
                                  "NSFW": datasets.Value("string")})
    datasets.Dataset.from_dict({"image": images, "text": captions, "NSFW": nsfw}, features=features).save_to_disk(
        str(tmp_path / "ds"))

    stats = preprocess(iter_hf_dataset(str(tmp_path / "ds")), CODEC, tmp_path / "out", batch_size=2, num_workers=1)
    assert (stats["kept"], stats["corrupt_image"], stats["nsfw"]) == (3, 1, 1)
    rows = pq.read_table(tmp_path / "out" / "train-00000.parquet").to_pylist()
    assert [(r["caption"], tuple(decode_code(r["code"]))) for r in rows] == expected
    with pytest.raises(ValueError, match="no image column 'picture'"):
        next(iter_hf_dataset(str(tmp_path / "ds"), image_column="picture"))


def test_vqgan_codec_from_taming_files(tmp_path):
    from tests.recipes.test_vqgan import random_vqgan, save_taming_checkpoint

    model = random_vqgan("gumbel")
    model.config.to_taming_yaml(tmp_path / "vqgan.yaml")
    save_taming_checkpoint(model, tmp_path / "vqgan.ckpt")
    (tmp_path / "images").mkdir()
    rng = np.random.default_rng(0)
    pixels = rng.integers(0, 256, size=(2, 32, 48, 3), dtype=np.uint8)  # resized to 16 and centre-cropped
    for i, array in enumerate(pixels):
        Image.fromarray(array).save(tmp_path / "images" / f"{i}.png")
        (tmp_path / "images" / f"{i}.txt").write_text(f"random picture {i}")

    stats = main(["--folder", str(tmp_path / "images"), "--out", str(tmp_path / "out"), "--codec", "vqgan",
                  "--vqgan-config", str(tmp_path / "vqgan.yaml"), "--vqgan-checkpoint", str(tmp_path / "vqgan.ckpt")])
    assert stats["kept"] == 2
    rows = pq.read_table(tmp_path / "out" / "train-00000.parquet").to_pylist()
    for i, row in enumerate(rows):
        # 48x32 -> shorter side 16 (24x16) -> centre 16x16
        image = Image.fromarray(pixels[i]).resize((24, 16), Image.Resampling.BICUBIC, reducing_gap=3.0)
        image = image.crop((4, 0, 20, 16))
        tensor = torch.from_numpy(np.asarray(image).copy()).permute(2, 0, 1).float()[None] / 255
        assert np.array_equal(decode_code(row["code"]), model.encode(tensor).flatten().numpy())
        assert (row["original_width"], row["original_height"]) == (48, 32)


@pytest.mark.slow
def test_killed_process_resumes_to_the_same_rows(tmp_path):
    """A real interruption: SIGKILL the CLI mid-run, rerun it, compare with an uninterrupted run."""
    import subprocess
    import sys
    import time

    write_folder(tmp_path / "images", num_good=90)
    args = ["--folder", str(tmp_path / "images"), "--codec", "palette", "--rows-per-shard", "3",
            "--batch-size", "1", "--num-workers", "1"]
    child = subprocess.Popen([sys.executable, "-m", "recipes.dalle.preprocess", *args, "--out", str(tmp_path / "out")],
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        while len(list((tmp_path / "out").glob("*.parquet"))) < 2 and child.poll() is None:
            time.sleep(0.01)
    finally:
        child.kill()
        child.wait()
    assert child.returncode == -9, "the run ended before it could be interrupted"
    finished_before = len(list((tmp_path / "out" / "_stats").glob("*.json")))

    resumed = main([*args, "--out", str(tmp_path / "out")])
    fresh = main([*args, "--out", str(tmp_path / "fresh")])
    assert resumed["shards_skipped"] == finished_before >= 1
    assert resumed["shards_written"] + resumed["shards_skipped"] == fresh["shards_written"]
    assert resumed["kept"] == fresh["kept"] == 90
    assert pq.read_table(sorted((tmp_path / "out").glob("*.parquet"))).equals(
        pq.read_table(sorted((tmp_path / "fresh").glob("*.parquet"))))
