import numpy as np
import pyarrow.parquet as pq
import pytest
import torch

from parquet_damage import assert_pages_carry_checksums
from recipes.rows import decode_code
from recipes.dalle.tokenizer import TextTokenizer
from recipes.shapes import (
    GRID_SIZE,
    HELD_OUT_PAIRS,
    PALETTE,
    PaletteCodec,
    check_caption,
    find_blobs,
    generate_example,
    main,
    parse_caption,
    write_shapes_dataset,
)


def test_generator_is_deterministic_and_seeded():
    for index in (0, 7, 123):
        caption, codes, labels = generate_example(index, "train", seed=3)
        caption_again, codes_again, labels_again = generate_example(index, "train", seed=3)
        assert caption == caption_again and labels == labels_again
        np.testing.assert_array_equal(codes, codes_again)
        assert codes.dtype == np.int16 and codes.shape == (GRID_SIZE, GRID_SIZE)
    grids = [generate_example(i, "train", seed=0)[1] for i in range(20)]
    other_seed = [generate_example(i, "train", seed=1)[1] for i in range(20)]
    assert any(not np.array_equal(a, b) for a, b in zip(grids, other_seed))
    with pytest.raises(ValueError, match="split"):
        generate_example(0, "test")


def test_palette_codec_round_trips_exactly():
    codec = PaletteCodec(cell_pixels=4)
    assert codec.codebook_size == len(PALETTE) and codec.grid_size == 16 and codec.image_size == 64
    codes = torch.randint(0, codec.codebook_size, (5, 16, 16))
    images = codec.decode(codes)
    assert images.shape == (5, 3, 64, 64) and images.min() >= 0 and images.max() <= 1
    torch.testing.assert_close(codec.encode(images), codes)
    torch.testing.assert_close(codec.decode(codes.reshape(5, 256)), images)  # flat codes decode the same
    # slightly noisy pictures still encode to the same cells
    torch.testing.assert_close(codec.encode((images + 0.03 * torch.randn_like(images)).clamp(0, 1)), codes)
    with pytest.raises(ValueError, match="codes must lie"):
        codec.decode(torch.full((1, 256), codec.codebook_size))


def test_checker_agrees_with_generator_labels():
    for split in ("train", "val"):
        for index in range(150):
            caption, codes, labels = generate_example(index, split, seed=0)
            verdict = check_caption(caption, codes)
            assert verdict is True, caption  # a Python bool: callers store it into tensors
            assert check_caption(caption, torch.from_numpy(codes).reshape(-1))  # flat tensors too
            assert parse_caption(caption)["kind"] == labels["kind"]
            blobs = find_blobs(codes)
            assert sorted((b["colour"], b["shape"]) for b in blobs) == sorted(
                (o["colour"], o["shape"]) for o in labels["objects"]
            )


def test_checker_rejects_other_examples_captions():
    rejected = total = 0
    for index in range(300):
        _, codes, _ = generate_example(index, "train", seed=0)
        other_caption, _, _ = generate_example(index + 1000, "train", seed=0)
        total += 1
        rejected += not check_caption(other_caption, codes)
    assert rejected / total > 0.95
    _, codes, _ = generate_example(0, "train", seed=0)
    assert not check_caption("a photo of a dog", codes)
    assert not check_caption("a big red circle", np.zeros((16, 16), dtype=np.int16))


def test_checker_reads_each_attribute():
    grid = np.zeros((16, 16), dtype=np.int16)
    red, blue = (next(i for i, (name, _) in enumerate(PALETTE) if name == c) for c in ("red", "blue"))
    grid[5:11, 1:7] = red  # a small red square on the left
    grid[5:11, 9:15] = blue  # a small blue square on the right
    assert check_caption("a red square to the left of a blue square", grid)
    assert check_caption("a blue square to the right of a red square", grid)
    assert not check_caption("a red square to the right of a blue square", grid)
    assert not check_caption("a red square above a blue square", grid)
    assert not check_caption("a red circle to the left of a blue square", grid)
    assert not check_caption("a small red square", grid)  # two shapes, one captioned
    grid[:, 8:] = 0
    assert check_caption("a small red square", grid) and not check_caption("a big red square", grid)
    assert not check_caption("a small blue square", grid)


def test_checker_tolerates_small_drawing_errors():
    rng = np.random.default_rng(0)
    accepted = total = 0
    for index in range(100):
        caption, codes, labels = generate_example(index, "train", seed=0)
        if labels["kind"] != "single" or labels["size"] != "big":
            continue
        noisy = codes.copy()
        shape_cells = np.argwhere(noisy != 0)
        row, col = shape_cells[rng.integers(len(shape_cells))]
        noisy[row, col] = rng.integers(1, len(PALETTE))  # one cell of a wrong colour inside the shape
        row, col = shape_cells[rng.integers(len(shape_cells))]
        noisy[row, col] = 0  # and one cell missing
        background = np.argwhere(noisy == 0)
        row, col = background[rng.integers(len(background))]
        if not (noisy[max(row - 1, 0) : row + 2, max(col - 1, 0) : col + 2] != 0).any():
            noisy[row, col] = 1  # an isolated speck is noise, not a shape
        total += 1
        accepted += check_caption(caption, noisy)
    assert total > 10 and accepted / total > 0.9


def test_held_out_pairs_only_in_validation():
    val_held_out = 0
    for index in range(1000):
        _, _, labels = generate_example(index, "train", seed=0)
        assert not labels["held_out"]
        assert all((o["colour"], o["shape"]) not in HELD_OUT_PAIRS for o in labels["objects"])
        _, _, labels = generate_example(index, "val", seed=0)
        val_held_out += labels["held_out"]
    assert 0.3 < val_held_out / 1000 < 0.8


def test_default_rows_are_those_already_cached_on_peers_disks():
    # Shards written by earlier versions sit in ~/.cache under a folder named by row counts only, and are reused:
    # the default generator must keep drawing exactly those rows. The digest was taken from the generator of
    # 4032175 (before `pair_fraction` existed); a change here needs a new cache folder (SHAPES_CACHE_DIR).
    import hashlib

    digest = hashlib.sha256()
    for split in ("train", "val"):
        for index in range(200):
            caption, codes, _ = generate_example(index, split, 0)
            digest.update(caption.encode())
            digest.update(codes.tobytes())
    assert digest.hexdigest() == "bfc376d123f4fb4d375385e45e219c9d8e04b9a3d3a39920a0c74584ec609d0b"


def test_pair_fraction_changes_which_rows_are_pairs_not_how_they_are_drawn():
    mixes = {f: [generate_example(i, "train", 0, f) for i in range(400)] for f in (0.0, 0.5, 0.8, 1.0)}
    share = {f: sum(labels["kind"] == "pair" for _, _, labels in rows) / 400 for f, rows in mixes.items()}
    assert share[0.0] == 0.0 and share[1.0] == 1.0 and 0.4 < share[0.5] < 0.6 and 0.72 < share[0.8] < 0.88
    default = [generate_example(i, "train", 0) for i in range(400)]
    assert [c for c, _, _ in default] == [c for c, _, _ in mixes[0.5]]
    # a row that is of the same kind in two mixes is the same row: the mix decides the kind and nothing else
    same_kind = [(a, b) for a, b in zip(mixes[0.5], mixes[0.8]) if a[2]["kind"] == b[2]["kind"]]
    assert len(same_kind) > 200
    for (caption, codes, _), (caption_too, codes_too, _) in same_kind:
        assert caption == caption_too
        np.testing.assert_array_equal(codes, codes_too)
    with pytest.raises(ValueError, match="pair_fraction"):
        generate_example(0, "train", 0, 1.5)


def test_captions_fit_in_the_text_block():
    tokenizer = TextTokenizer(32)
    lengths = [len(tokenizer.encode(generate_example(i, "val")[0])) for i in range(300)]
    assert max(lengths) <= 16


def test_written_shards_have_the_laion_schema(tmp_path):
    written = write_shapes_dataset(tmp_path, num_train=250, num_val=40, rows_per_shard=100, seed=0)
    assert [p.rsplit("/", 1)[1] for p in written["train"]] == [
        f"train-0000{i}-of-00003.parquet" for i in range(3)
    ]
    assert len(written["validation"]) == 1
    table = pq.read_table(written["train"][1])
    assert table.schema.field("caption").type == "string" and table.schema.field("code").type == "binary"
    assert pq.ParquetFile(written["train"][1]).metadata.row_group(0).column(0).compression == "BROTLI"
    first = table.to_pylist()[0]
    caption, codes, _ = generate_example(100, "train", seed=0)
    assert first["caption"] == caption
    np.testing.assert_array_equal(decode_code(first["code"]).reshape(16, 16), codes)
    more_pairs = write_shapes_dataset(tmp_path / "pairs", num_train=250, num_val=40, rows_per_shard=100, seed=0,
                                      train_pair_fraction=1.0)
    assert pq.read_table(more_pairs["validation"][0]).equals(pq.read_table(written["validation"][0]))
    assert all(parse_caption(c)["kind"] == "pair" for c in pq.read_table(more_pairs["train"][0])["caption"].to_pylist())
    main(["--out", str(tmp_path / "cli"), "--num-train", "30", "--num-val", "10"])
    assert pq.read_table(tmp_path / "cli" / "validation-00000-of-00001.parquet").num_rows == 10
    assert_pages_carry_checksums(written["train"][1])
