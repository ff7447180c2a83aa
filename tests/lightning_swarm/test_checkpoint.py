"""SwarmCheckpoint with a plain Trainer: format round trip, keep-last-K, uploads (fsspec), resume,
failing targets, and a save killed midway."""

import json
import os
import signal
import subprocess
import sys
import time

import lightning.pytorch as pl
import pytest
import torch

from ckpt_tiny_module import RandomRegressionData, TinyRegressor
from lightning_swarm.checkpoint.callback import SwarmCheckpoint
from lightning_swarm.checkpoint.checkpoint_io import (
    flatten_state,
    list_checkpoints,
    load_checkpoint,
    read_checkpoint,
    read_latest_name,
    save_checkpoint,
    unflatten_state,
)
from lightning_swarm.checkpoint.upload import CheckpointUploader
from lightning_swarm.checkpoint.seal import write_seal

HERE = os.path.dirname(os.path.abspath(__file__))


def make_trainer(callback, max_steps):
    return pl.Trainer(
        max_steps=max_steps,
        callbacks=[callback],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        accelerator="cpu",
        devices=1,
    )


def assert_same_state(a: dict, b: dict):
    assert a.keys() == b.keys()
    for key in a:
        if isinstance(a[key], torch.Tensor):
            assert torch.equal(a[key], b[key]), key
        elif isinstance(a[key], dict):
            assert_same_state(a[key], b[key])
        else:
            assert a[key] == b[key], key


def test_flatten_roundtrip_optimizer_and_scheduler_state():
    module = TinyRegressor()
    (opt,), (sched,) = module.configure_optimizers()
    module(torch.randn(2, 8)).sum().backward()
    opt.step()
    sched["scheduler"].step()
    state = dict(opt=opt.state_dict(), sched=sched["scheduler"].state_dict(), odd=dict(inf=float("inf")))
    tensors = {}
    structure = json.loads(json.dumps(flatten_state(state, tensors)))  # must be plain JSON
    restored = unflatten_state(structure, tensors)
    assert set(restored["opt"]["state"]) == set(state["opt"]["state"])  # int keys survive
    assert restored["opt"]["param_groups"][0]["betas"] == (0.9, 0.99)  # tuples survive
    for idx, param_state in state["opt"]["state"].items():
        for name, value in param_state.items():
            assert torch.equal(restored["opt"]["state"][idx][name], value)
    assert restored["sched"] == state["sched"]
    assert restored["odd"]["inf"] == float("inf")

    fresh = TinyRegressor()
    (fresh_opt,), _ = fresh.configure_optimizers()
    fresh_opt.load_state_dict(restored["opt"])  # loads into a real optimizer


def test_callback_saves_keeps_last_uploads_and_loads_back(tmp_path):
    remote = tmp_path / "remote"
    callback = SwarmCheckpoint(
        dirpath=str(tmp_path / "local"), every_n_epochs=2, keep_last=2, upload_to=str(remote),
        upload_backoff_seconds=0.1,
    )
    module = TinyRegressor()
    make_trainer(callback, max_steps=7).fit(module, RandomRegressionData())
    assert callback.uploader.wait(30)

    # saved at global steps 2, 4, 6 and at the end (7); only the newest two stay locally
    assert list_checkpoints(str(tmp_path / "local")) == ["epoch_000006", "epoch_000007"]
    assert read_latest_name(str(tmp_path / "local")) == "epoch_000007"
    assert sorted(p.name for p in remote.iterdir()) == [
        "epoch_000002", "epoch_000004", "epoch_000006", "epoch_000007", "latest"
    ]
    assert callback.uploader.errors == []

    checkpoint = read_checkpoint(str(remote))  # follows remote/latest
    assert checkpoint.meta["global_epoch"] == 7 and checkpoint.meta["local_step"] == 7
    assert checkpoint.meta["samples_seen"] == 7 * 4
    assert abs(checkpoint.meta["loss"] - float(module.trainer.callback_metrics["train/loss"])) < 1e-6
    fresh = TinyRegressor()
    assert not torch.equal(fresh.mid.weight, module.mid.weight)
    checkpoint.load_into(fresh)
    assert_same_state(fresh.state_dict(), module.state_dict())
    assert fresh.head.weight is fresh.embed.weight  # tying survives loading
    assert_same_state(checkpoint.optimizer_states[0]["state"], module.trainer.optimizers[0].state_dict()["state"])
    assert checkpoint.scheduler_states[0]["last_epoch"] == 7


def test_memory_target_and_resume(tmp_path):
    url = "memory://ckpt-test/run"
    callback = SwarmCheckpoint(dirpath=str(tmp_path / "a"), every_n_epochs=3, upload_to=url)
    module = TinyRegressor()
    make_trainer(callback, max_steps=3).fit(module, RandomRegressionData())
    assert callback.uploader.wait(30) and callback.uploader.uploaded == [f"{url}/epoch_000003"]

    # a recipe starts from the remote checkpoint: weights + optimizer + scheduler, epoch counts on
    resumed = TinyRegressor()
    seen_at_start = {}

    class Spy(pl.Callback):
        def on_train_start(self, trainer, pl_module):
            seen_at_start["weights"] = {k: v.clone() for k, v in pl_module.state_dict().items()}
            seen_at_start["adam_step"] = trainer.optimizers[0].state_dict()["state"][0]["step"].item()
            seen_at_start["lr"] = trainer.optimizers[0].param_groups[0]["lr"]

    callback2 = SwarmCheckpoint(dirpath=str(tmp_path / "b"), every_n_epochs=2, resume_from=url)
    trainer = make_trainer(callback2, max_steps=2)
    trainer.callbacks.append(Spy())
    trainer.fit(resumed, RandomRegressionData(seed=1))
    assert_same_state(seen_at_start["weights"], module.state_dict())
    assert seen_at_start["adam_step"] == 3.0
    assert seen_at_start["lr"] == pytest.approx(1e-2 * 0.5)  # StepLR(step_size=3) state came along
    assert read_checkpoint(str(tmp_path / "b")).meta["global_epoch"] == 3 + 2
    assert load_checkpoint(str(tmp_path / "b"), TinyRegressor())["samples_seen"] == 3 * 4 + 2 * 4


def test_time_based_saving(tmp_path, monkeypatch):
    import lightning_swarm.checkpoint.callback as checkpoint_module

    clock = {"steps": 0}  # a fake clock: every training step takes exactly 0.1 s

    class FakeTime:
        @staticmethod
        def monotonic():
            return clock["steps"] / 10

    class TickingSteps(pl.Callback):
        def on_train_batch_start(self, *args):
            clock["steps"] += 1

    monkeypatch.setattr(checkpoint_module, "time", FakeTime)
    callback = SwarmCheckpoint(dirpath=str(tmp_path), every_n_epochs=None, every_n_minutes=0.25 / 60,
                               keep_last=10, save_on_train_end=False)
    trainer = make_trainer(callback, max_steps=7)
    trainer.callbacks.append(TickingSteps())
    trainer.fit(TinyRegressor(), RandomRegressionData())
    saved = [read_checkpoint(str(tmp_path / name)).meta["global_epoch"] for name in list_checkpoints(str(tmp_path))]
    assert saved == [3, 6]  # 0.25 s since the last save: at 0.3 s and 0.6 s


def test_failing_target_is_reported_retried_and_never_blocks(tmp_path):
    blocker = tmp_path / "blocker"
    blocker.write_text("a file where the target's parent directory should be")
    target = blocker / "remote"  # every write under a regular file fails (NotADirectoryError)
    callback = SwarmCheckpoint(
        dirpath=str(tmp_path / "local"), every_n_epochs=2, upload_to=str(target),
        upload_max_attempts=None, upload_backoff_seconds=0.2, final_upload_timeout=0.5,
    )
    module = TinyRegressor()
    started = time.monotonic()
    make_trainer(callback, max_steps=4).fit(module, RandomRegressionData())
    assert time.monotonic() - started < 20  # training finished although no upload could succeed
    uploader = callback.uploader
    deadline = time.monotonic() + 10
    while len(uploader.errors) < 3 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert len(uploader.errors) >= 3 and "NotADirectoryError" in uploader.last_error.error
    assert uploader.uploaded == []
    # the local checkpoint is intact while uploads fail
    assert read_checkpoint(str(tmp_path / "local")).meta["global_epoch"] == 4

    # the target comes back: the retry loop delivers the newest checkpoint
    blocker.unlink()
    deadline = time.monotonic() + 20
    while not uploader.uploaded and time.monotonic() < deadline:
        time.sleep(0.05)
    assert uploader.uploaded and uploader.uploaded[-1].endswith("epoch_000004")
    fresh = TinyRegressor()
    load_checkpoint(str(target), fresh)
    assert_same_state(fresh.state_dict(), module.state_dict())
    uploader.close(timeout=5, force=True)


def test_uploader_gives_up_after_max_attempts_and_keeps_local(tmp_path):
    module = TinyRegressor()
    path = save_checkpoint(str(tmp_path / "local"), module, global_epoch=1)
    (tmp_path / "ro").write_text("not a directory")
    uploader = CheckpointUploader(str(tmp_path / "ro" / "x"), max_attempts=2, backoff_seconds=0.05)
    uploader.submit(path)
    assert uploader.wait(10)
    assert [e.attempt for e in uploader.errors] == [1, 2] and uploader.given_up == [path]
    assert os.path.isdir(path) and read_checkpoint(path).meta["global_epoch"] == 1
    uploader.close()


def plain_model():
    """A plain torch model (the subprocess below then needs no Lightning import, which is slow)."""
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 8))


KILL_MIDWAY_SCRIPT = r"""
import sys, time, torch
from lightning_swarm.checkpoint import checkpoint_io

root = sys.argv[1]
torch.manual_seed(0)
module = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 8))
checkpoint_io.save_checkpoint(root, module, global_epoch=1, loss=1.0)
with torch.no_grad():
    for p in module.parameters():
        p.add_(1.0)
real_save = checkpoint_io._save_tensors

def save_half_then_hang(tensors, path):
    real_save(tensors, path)
    with open(path, "r+b") as f:
        f.truncate(max(1, len(f.read()) // 2))  # half the file is on disk...
    print("HALF", flush=True)
    time.sleep(600)  # ...when the process gets killed

checkpoint_io._save_tensors = save_half_then_hang
checkpoint_io.save_checkpoint(root, module, global_epoch=2, loss=2.0)
"""


def test_save_killed_midway_leaves_previous_checkpoint(tmp_path):
    root = str(tmp_path / "ckpt")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([HERE, os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.Popen(
        [sys.executable, "-c", KILL_MIDWAY_SCRIPT, root], stdout=subprocess.PIPE, env=env, text=True
    )
    try:
        line = proc.stdout.readline()
        assert line.strip() == "HALF"
        proc.send_signal(signal.SIGKILL)
        proc.wait(10)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert any(name.startswith(".tmp-") for name in os.listdir(root))  # the half-written save is there
    checkpoint = read_checkpoint(root)
    assert checkpoint.meta["global_epoch"] == 1 and checkpoint.meta["loss"] == 1.0
    torch.manual_seed(0)
    expected = plain_model()  # same seed and layers as the first save in the subprocess
    loaded = plain_model()
    checkpoint.load_into(loaded)
    assert_same_state(loaded.state_dict(), expected.state_dict())
    # the next save cleans up the leftovers
    save_checkpoint(root, loaded, global_epoch=3, keep_last=2)
    assert not any(name.startswith(".tmp-") for name in os.listdir(root))
    assert list_checkpoints(root) == ["epoch_000001", "epoch_000003"]


def test_bad_arguments_raise_clear_errors(tmp_path):
    with pytest.raises(ValueError, match="every_n_epochs and/or every_n_minutes"):
        SwarmCheckpoint(every_n_epochs=None, every_n_minutes=None)
    with pytest.raises(FileNotFoundError, match="No checkpoint at"):
        read_checkpoint(str(tmp_path))


def test_saver_keeps_checkpoints_in_use_and_records_the_model(tmp_path):
    """A checkpoint someone still reads (the monitor's sampler) survives pruning; meta.json rebuilds the model."""
    from lightning_swarm.checkpoint.saver import CheckpointSaver

    saver = CheckpointSaver(str(tmp_path), keep_last=1)
    first = saver.save(TinyRegressor(dim=5), [], [], global_epoch=1)
    saver.in_use.add(os.path.basename(first))
    saver.save(TinyRegressor(dim=5), [], [], global_epoch=2)
    assert list_checkpoints(str(tmp_path)) == ["epoch_000001", "epoch_000002"]
    saver.in_use.clear()
    saver.save(TinyRegressor(dim=5), [], [], global_epoch=3)
    assert list_checkpoints(str(tmp_path)) == ["epoch_000003"]
    saved = read_checkpoint(str(tmp_path))
    assert saved.meta["model"] == {"class_path": "ckpt_tiny_module.TinyRegressor",
                                   "init_args": {"dim": 5, "hidden": 16, "lr": 1e-2}}
    rebuilt = saved.build_model(allowed_model_packages=["ckpt_tiny_module"])  # a test module: an explicit opt-in
    assert isinstance(rebuilt, TinyRegressor) and rebuilt.embed.weight.shape == (16, 5)


def test_fp16_loss_scale_survives_resume(tmp_path, caplog):
    """Under precision 16-mixed meta.json records the GradScaler's state; resuming starts from that scale,
    a malformed entry is logged and ignored."""
    from lightning.pytorch.plugins.precision import MixedPrecision

    def fp16_trainer(callback, init_scale, spy=None):
        scaler = torch.amp.GradScaler("cpu", init_scale=init_scale)
        return pl.Trainer(max_steps=2, callbacks=[callback] + ([spy] if spy else []), logger=False,
                          enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                          accelerator="cpu", devices=1, plugins=[MixedPrecision("16-mixed", "cpu", scaler)])

    fp16_trainer(SwarmCheckpoint(dirpath=str(tmp_path / "a"), every_n_epochs=2), init_scale=512.0).fit(
        TinyRegressor(), RandomRegressionData())
    assert read_checkpoint(str(tmp_path / "a")).meta["loss_scaler"]["scale"] == 512.0

    scales = []

    class Spy(pl.Callback):
        def on_train_start(self, trainer, pl_module):
            scales.append(trainer.precision_plugin.scaler.get_scale())

    fp16_trainer(SwarmCheckpoint(dirpath=str(tmp_path / "b"), resume_from=str(tmp_path / "a")), 65536.0,
                 Spy()).fit(TinyRegressor(), RandomRegressionData())
    assert scales == [512.0]

    # a tampered entry: refused with a log line, training goes on with the configured scale
    meta_path = os.path.join(str(tmp_path / "a"), read_latest_name(str(tmp_path / "a")), "meta.json")
    meta = json.load(open(meta_path))
    meta["loss_scaler"]["scale"] = float("inf")
    json.dump(meta, open(meta_path, "w"))
    write_seal(os.path.dirname(meta_path), "meta.json")  # as its writer sealed it: only the entry is bad
    with caplog.at_level("WARNING"):
        fp16_trainer(SwarmCheckpoint(dirpath=str(tmp_path / "c"), resume_from=str(tmp_path / "a")), 65536.0,
                     Spy()).fit(TinyRegressor(), RandomRegressionData())
    assert scales[-1] == 65536.0 and "malformed loss_scaler" in caplog.text
