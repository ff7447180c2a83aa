"""Checkpoint integrity: per-file sha256 in meta.json, pruning by epoch number, `latest` kept inside its root."""

import json
import os

import fsspec
import pytest
import torch

from lightning_swarm.checkpoint.checkpoint_io import (
    MODEL_FILE,
    STATE_JSON_FILE,
    CheckpointIntegrityError,
    list_checkpoints,
    read_checkpoint,
    save_checkpoint,
)
from lightning_swarm.checkpoint.upload import upload_to_fsspec


def small_model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 8))


def flip_byte(path, offset_from_end):
    with open(path, "r+b") as f:
        f.seek(-offset_from_end, os.SEEK_END)
        byte = f.read(1)
        f.seek(-offset_from_end, os.SEEK_END)
        f.write(bytes([byte[0] ^ 0x01]))


def test_meta_records_sha256_and_a_flipped_bit_is_refused(tmp_path):
    model = small_model()
    optimizer = torch.optim.Adam(model.parameters())
    model(torch.randn(2, 8)).sum().backward()
    optimizer.step()
    path = save_checkpoint(str(tmp_path), model, [optimizer.state_dict()], global_epoch=3)
    with open(os.path.join(path, "meta.json")) as f:
        files = json.load(f)["files"]
    assert files[MODEL_FILE]["bytes"] == os.path.getsize(os.path.join(path, MODEL_FILE))
    assert len(files[MODEL_FILE]["sha256"]) == 64
    read_checkpoint(str(tmp_path))  # intact: loads

    flip_byte(os.path.join(path, MODEL_FILE), offset_from_end=5)  # inside the last tensor's data
    with pytest.raises(CheckpointIntegrityError, match=f"{MODEL_FILE} has sha256 .* corrupt or was replaced"):
        read_checkpoint(str(tmp_path))


def test_truncated_or_edited_state_file_is_refused(tmp_path):
    path = save_checkpoint(str(tmp_path), small_model(), global_epoch=1)
    with open(os.path.join(path, STATE_JSON_FILE), "a") as f:
        f.write(" ")
    with pytest.raises(CheckpointIntegrityError, match=f"{STATE_JSON_FILE} has .* bytes, meta.json records"):
        read_checkpoint(path)


def test_remote_copy_is_verified_after_download(tmp_path):
    path = save_checkpoint(str(tmp_path / "local"), small_model(), global_epoch=2)
    url = f"memory://integrity-{os.getpid()}"
    upload_to_fsspec(path, url)
    assert read_checkpoint(url, cache_dir=str(tmp_path / "cache1")).meta["global_epoch"] == 2
    fs = fsspec.filesystem("memory")
    remote_model = f"{url[len('memory://'):]}/epoch_000002/{MODEL_FILE}"
    data = bytearray(fs.cat_file(remote_model))
    data[-3] ^= 0x80
    fs.pipe_file(remote_model, bytes(data))
    with pytest.raises(CheckpointIntegrityError, match=MODEL_FILE):
        read_checkpoint(url, cache_dir=str(tmp_path / "cache2"))


def test_pruning_keeps_the_highest_epoch_numbers(tmp_path):
    root = str(tmp_path)
    os.makedirs(os.path.join(root, "notes", "keep"))  # not a checkpoint name: never pruned
    model = small_model()
    for epoch in (999998, 999999, 1000000, 1000001):
        save_checkpoint(root, model, global_epoch=epoch, keep_last=2)
    save_checkpoint(root, model, global_epoch=1000001, keep_last=2)  # a re-save gets the suffix .1
    assert list_checkpoints(root) == ["epoch_1000001", "epoch_1000001.1"]
    assert os.path.isdir(os.path.join(root, "notes", "keep"))
    assert read_checkpoint(root).url.endswith("epoch_1000001.1")


def test_remote_pruning_keeps_the_highest_epoch_numbers(tmp_path):
    url = f"memory://prune-{os.getpid()}"
    for epoch in (999998, 999999, 1000000):
        path = save_checkpoint(str(tmp_path), small_model(), global_epoch=epoch)
        upload_to_fsspec(path, url, keep_last=2)
    fs = fsspec.filesystem("memory")
    names = sorted(os.path.basename(p.rstrip("/")) for p in fs.ls(url[len("memory://"):], detail=False))
    assert names == ["epoch_1000000", "epoch_999999", "latest"]


@pytest.mark.parametrize("pointer", ["../elsewhere/epoch_000001", "/tmp/epoch_000001", "..", "epoch_1/../../x"])
def test_latest_pointing_outside_the_root_is_refused(tmp_path, pointer):
    root = tmp_path / "root"
    save_checkpoint(str(root), small_model(), global_epoch=1)
    save_checkpoint(str(tmp_path / "elsewhere"), small_model(), global_epoch=1)
    (root / "latest").write_text(pointer + "\n")
    with pytest.raises(ValueError, match="not a checkpoint directory inside that root .*; refusing to follow it"):
        read_checkpoint(str(root))


def test_latest_naming_a_symlink_out_of_the_root_is_refused(tmp_path):
    outside = save_checkpoint(str(tmp_path / "elsewhere"), small_model(), global_epoch=7)
    root = tmp_path / "root"
    root.mkdir()
    os.symlink(outside, root / "epoch_000007")
    (root / "latest").write_text("epoch_000007\n")
    with pytest.raises(ValueError, match="symlink .* outside the checkpoint root"):
        read_checkpoint(str(root))


def test_remote_latest_outside_the_root_is_refused():
    fs = fsspec.filesystem("memory")
    root = f"/latest-outside-{os.getpid()}"
    fs.pipe_file(f"{root}/latest", b"../other/epoch_000001\n")
    with pytest.raises(ValueError, match="refusing to follow it"):
        read_checkpoint(f"memory://{root}")
