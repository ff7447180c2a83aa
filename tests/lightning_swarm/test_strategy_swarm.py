"""Multi-peer tests of HivemindStrategy: real peers as separate processes on 127.0.0.1, each a LightningCLI run
of tests/lightning_swarm/peer_worker.py configured through YAML (trainer.strategy.class_path)."""

from __future__ import annotations

import csv
import math

import pytest
import torch

from peer_worker import TinyRegression, make_regression_data
from swarm_harness import Peer, wait_until

pytestmark = pytest.mark.slow

LOCAL = ["/ip4/127.0.0.1/tcp/0"]


def strategy_args(run_id: str, target_batch_size: int, **overrides):
    args = dict(run_id=run_id, target_batch_size=target_batch_size, host_maddrs=LOCAL, matchmaking_time=1.5,
                averaging_timeout=15.0, load_state_timeout=20.0, metrics_interval=1.0,
                tracker_opts={"max_refresh_period": 1.0, "min_refresh_period": 0.2, "default_refresh_period": 0.5})
    args.update(overrides)
    return args


def assert_close_params(a, b, atol):
    assert a.keys() == b.keys()
    for name in a:
        assert torch.allclose(a[name], b[name], atol=atol), (name, (a[name] - b[name]).abs().max())


def test_two_peers_train_together_with_different_batch_sizes(tmp_path, peers):
    """Two peers (batch 4 and 8) pass several global epochs together, hold the same parameters after each
    averaging (fp16 wire compression), step the LR once per global epoch and publish metrics to the DHT."""
    recorder = {"stop_at_epoch": 3, "max_seconds": 90, "barrier_dir": str(tmp_path / "barrier"), "barrier_count": 2}
    common = dict(model={"step_delay": 0.02}, recorder=recorder)
    csv_logger = {"logger": {"class_path": "lightning.pytorch.loggers.CSVLogger",
                             "init_args": {"save_dir": str(tmp_path / "logs"), "name": "first"}},
                  "log_every_n_steps": 1}
    first = Peer(tmp_path, "first", strategy_args("two", 96, compression="fp16"), data={"batch_size": 4},
                 trainer=csv_logger, **common)
    peers.append(first)
    second = Peer(tmp_path, "second", strategy_args("two", 96, compression="fp16"),
                  data={"batch_size": 8, "offset": 50_000}, join_later=True, **common)
    peers.append(second)
    second.join(first.join_peers())
    for peer in (first, second):
        peer.wait(timeout=150)

    for peer in (first, second):
        events = peer.events()
        assert peer.max_epoch() >= 3, events
        # the schedule follows global epochs, not the ~dozens of local steps
        for event in events:
            if event["kind"] != "end":
                assert math.isclose(event["lr"], 0.1 * 0.5 ** event["epoch"], rel_tol=1e-6), event
        assert max(event.get("peers", 0) for event in events) == 2
        end = events[-1]
        assert end["kind"] == "end" and end["metrics_steps"] and len(end["metrics_steps"]) == 2, end
    for epoch in (1, 2, 3):
        assert_close_params(first.params(epoch), second.params(epoch), atol=2e-3)
    # the swarm's progress reached Lightning's loggers (SwarmProgress callback added by the strategy)
    rows = list(csv.DictReader(open(next((tmp_path / "logs").rglob("metrics.csv")))))
    assert max(float(row["swarm/epoch"] or 0) for row in rows) >= 2
    assert max(float(row["swarm/peers"] or 0) for row in rows) == 2
    assert max(float(row["swarm/samples_per_sec"] or 0) for row in rows) > 0
    assert max(float(row["swarm/local_samples_per_sec"] or 0) for row in rows) > 0
    # parameters really moved away from the initialisation
    assert not torch.allclose(first.params(0)["net.0.weight"], first.params(3)["net.0.weight"])


# uneven shares only: with equal ones a swarm that weighted peers instead of samples would pass too
@pytest.mark.parametrize("shares, second_late", [((4, 12), 0.0), ((4, 12), 2.5)], ids=["uneven", "uneven-second-late"])
def test_swarm_step_equals_one_peer_on_all_samples(tmp_path, peers, shares, second_late):
    """No compression, deterministic data: peers contributing `shares` samples reach, after one global step,
    the parameters of a single SGD step on all samples together (so samples, not peers, are weighted).

    second_late: the second peer takes its first step this many seconds after the first one (longer than the
    tracker's refresh period), so its tracker has read the first peer's record before publishing its own: it must
    still count itself and average with the first peer (a loaded machine delays a peer like this)."""
    lr, total = 0.1, sum(shares)
    first_share, second_share = shares
    recorder = {"stop_at_epoch": 1, "max_seconds": 60, "barrier_dir": str(tmp_path / "barrier"), "barrier_count": 2}
    args = dict(compression="none", matchmaking_time=2.0)
    first = Peer(tmp_path, "first", strategy_args("eq", total, **args), model={"share_samples": first_share},
                 data={"batch_size": first_share}, recorder=recorder)
    peers.append(first)
    second = Peer(tmp_path, "second", strategy_args("eq", total, **args),
                  model={"share_samples": second_share}, data={"batch_size": second_share, "offset": first_share},
                  recorder=dict(recorder, first_step_delay=second_late), join_later=True)
    peers.append(second)
    second.join(first.join_peers())
    for peer in (first, second):
        peer.wait(timeout=120)

    torch.manual_seed(0)
    reference = TinyRegression(seed=0)
    x, y = make_regression_data(total, in_dim=8, seed=0)
    loss = torch.nn.functional.mse_loss(reference.net(x), y)  # mean over all samples of both peers
    loss.backward()
    with torch.no_grad():
        for param in reference.parameters():
            param -= lr * param.grad
    expected = {k: v.detach() for k, v in reference.state_dict().items()}
    assert_close_params(first.params(0), {k: v.detach() for k, v in TinyRegression(seed=0).state_dict().items()}, 0)
    for peer in (first, second):
        assert_close_params(peer.params(1), expected, atol=1e-5)


def test_late_joiner_and_killed_peer(tmp_path, peers):
    """A peer joining at global epoch >= 2 starts from the swarm's parameters and epoch; after SIGKILL of one of
    the three peers, the other two keep passing global epochs with finite parameters."""
    recorder = {"stop_at_epoch": 1000, "max_seconds": 100}
    model = {"step_delay": 0.05, "lr_decay": 0.95}
    together = dict(recorder, barrier_dir=str(tmp_path / "barrier"), barrier_count=2)
    first = Peer(tmp_path, "first", strategy_args("late", 24, compression="none", averaging_timeout=6.0),
                 model=model, data={"batch_size": 4}, recorder=together)
    peers.append(first)
    doomed = Peer(tmp_path, "doomed", strategy_args("late", 24, compression="none", averaging_timeout=6.0),
                  model=model, data={"batch_size": 4, "offset": 30_000}, recorder=together, join_later=True)
    peers.append(doomed)
    join = first.join_peers()
    doomed.join(join)
    # the late peer's process starts now (its imports overlap the others' first epochs); it joins at epoch 2
    late = Peer(tmp_path, "late", strategy_args("late", 24, compression="none", averaging_timeout=6.0),
                model=dict(model, seed=123), data={"batch_size": 4, "offset": 60_000}, recorder=recorder,
                join_later=True)
    peers.append(late)
    wait_until(lambda: min(first.max_epoch(), doomed.max_epoch()) >= 2, 90, [first, doomed],
               "the two first peers to reach global epoch 2")
    late.join(join)
    wait_until(lambda: late.max_epoch() >= 0, 90, [first, doomed, late], "the late peer to start training")
    start = late.events()[0]
    assert start["kind"] == "start" and start["epoch"] >= 2, start
    first_events = {event["epoch"] for event in first.events()}
    assert start["epoch"] in first_events
    # the late peer was initialised with another seed: it must have taken the swarm's parameters
    assert_close_params(late.params(start["epoch"]), first.params(start["epoch"]), atol=1e-4)

    doomed.kill()
    killed_at = max(first.max_epoch(), late.max_epoch())
    wait_until(lambda: min(first.max_epoch(), late.max_epoch()) >= killed_at + 2, 60, [first, late],
               "the two survivors to pass two more global epochs")
    for peer in (first, late):
        params = peer.params(peer.max_epoch())
        assert all(torch.isfinite(tensor).all() for tensor in params.values())


def test_overlapped_peers_preschedule_state_averaging(tmp_path, peers):
    """With the overlap options, both peers pre-schedule their state averaging rounds before each epoch's end
    (hivemind 1.1.12 alone never does: SwarmOptimizer seeds the delay it waits to measure), and stay in sync."""
    recorder = {"stop_at_epoch": 4, "max_seconds": 90, "barrier_dir": str(tmp_path / "barrier"), "barrier_count": 2}
    overlap = dict(delay_optimizer_step=True, delay_grad_averaging=True, delay_state_averaging=True,
                   average_state_every=1, verbose=True)  # verbose: hivemind logs its scheduling at INFO
    common = dict(model={"step_delay": 0.05}, data={"batch_size": 8}, recorder=recorder)  # ~3 s epochs
    first = Peer(tmp_path, "first", strategy_args("presched", 96, **overlap), **common)
    peers.append(first)
    second = Peer(tmp_path, "second", strategy_args("presched", 96, **overlap),
                  **dict(common, data={"batch_size": 8, "offset": 50_000}), join_later=True)
    peers.append(second)
    second.join(first.join_peers())
    for peer in (first, second):
        peer.wait(timeout=150)
    for peer in (first, second):
        assert peer.max_epoch() >= 4, peer.events()
        assert "Pre-scheduling state averaging round" in peer.log(), peer.log()[-3000:]
    # in sync up to the step in flight: with delay_optimizer_step a peer records epoch 4's parameters as it enters the
    # epoch, before or after its background step (and delayed state round) landed, so the two may differ by one
    # epoch's motion (CI: 0.029 on a bias, above the 0.01 that peers without the overlap options hold)
    a, b, a_before, b_before = first.params(4), second.params(4), first.params(3), second.params(3)
    for name in a:
        motion = max(float((a[name] - a_before[name]).abs().max()), float((b[name] - b_before[name]).abs().max()))
        assert float((a[name] - b[name]).abs().max()) <= 1e-2 + motion, (name, a[name] - b[name], motion)


FP16_PLUGIN = {"plugins": [{
    "class_path": "lightning.pytorch.plugins.precision.MixedPrecision",
    # Lightning turns precision="16-mixed" on a CPU into bf16: fp16 autocast + loss scaling needs the plugin itself.
    # A small initial scale, so that the forced overflows are the only ones (hence the exact scales below)
    "init_args": {"precision": "16-mixed", "device": "cpu",
                  "scaler": {"class_path": "torch.amp.GradScaler", "init_args": {"device": "cpu", "init_scale": 1024}}},
}]}


def all_finite(params) -> bool:
    return all(torch.isfinite(tensor).all() for tensor in params.values())


def test_fp16_swarm_skips_overflowing_batches_on_every_peer(tmp_path, peers):
    """Two peers in fp16 mixed precision with loss scaling (CPU autocast): the first peer's gradients overflow at
    two batches, the second's at one. Each overflowing batch is dropped by its own peer before it reaches the
    accumulators, so no NaN/inf reaches anyone's parameters, both peers keep the same parameters at every global
    epoch, and each peer's loss scale halved once per overflow of its own."""
    recorder = {"stop_at_epoch": 3, "max_seconds": 90, "barrier_dir": str(tmp_path / "barrier"), "barrier_count": 2}
    strategy = dict(compression="none")
    first = Peer(tmp_path, "first", strategy_args("fp16", 32, **strategy), trainer=FP16_PLUGIN,
                 model={"step_delay": 0.02, "overflow_at_batches": [2, 7]}, data={"batch_size": 4}, recorder=recorder)
    peers.append(first)
    second = Peer(tmp_path, "second", strategy_args("fp16", 32, **strategy),
                  trainer=FP16_PLUGIN, model={"step_delay": 0.02, "overflow_at_batches": [4]},
                  data={"batch_size": 4, "offset": 50_000}, recorder=recorder, join_later=True)
    peers.append(second)
    second.join(first.join_peers())
    for peer in (first, second):
        peer.wait(timeout=150)

    for peer, overflows in ((first, 2), (second, 1)):
        assert peer.max_epoch() >= 3, peer.events()
        assert peer.events()[-1]["loss_scale"] == 1024 * 0.5**overflows, peer.events()[-1]
        for epoch in range(peer.max_epoch() + 1):
            assert all_finite(peer.params(epoch)), (peer.name, epoch)
    for epoch in (1, 2, 3):
        assert_close_params(first.params(epoch), second.params(epoch), atol=1e-6)
    assert not torch.allclose(first.params(0)["net.0.weight"], first.params(3)["net.0.weight"])  # it trained


def test_resume_restores_global_epoch_schedule_and_fp16_loss_scale(tmp_path, peers):
    """A single peer in fp16 mixed precision, whose gradients overflow at three batches (loss scale 1024 -> 128),
    stops at global epoch 3 with a Lightning checkpoint; a new run resumed from it starts at global epoch 3 with the
    same parameters, the LR of epoch 3 and the lowered loss scale (part of the checkpoint), and keeps stepping the
    schedule per global epoch with finite parameters. (One resumed run for both: each used to start its own pair.)"""
    ckpt = tmp_path / "swarm.ckpt"
    strategy = strategy_args("resume", 16, compression="none")
    first = Peer(tmp_path, "before", strategy, trainer=FP16_PLUGIN, model={"overflow_at_batches": [1, 3, 5]},
                 data={"batch_size": 4}, recorder={"stop_at_epoch": 3, "checkpoint_at_stop": str(ckpt)})
    peers.append(first)
    first.wait(timeout=90)
    assert ckpt.exists()
    assert first.events()[-1]["loss_scale"] == 128.0

    resumed = Peer(tmp_path, "after", strategy, trainer=FP16_PLUGIN, model={}, data={"batch_size": 4},
                   recorder={"stop_at_epoch": 5}, extra_args=["--ckpt_path", str(ckpt)])
    peers.append(resumed)
    resumed.wait(timeout=90)
    events = resumed.events()
    start = events[0]
    assert start["kind"] == "start" and start["epoch"] == 3 and start["loss_scale"] == 128.0, start
    assert math.isclose(start["lr"], 0.1 * 0.5**3, rel_tol=1e-6)
    assert_close_params(resumed.params(3), first.params(3), atol=1e-6)
    assert resumed.max_epoch() == 5
    assert math.isclose([e for e in events if e["epoch"] == 5][0]["lr"], 0.1 * 0.5**5, rel_tol=1e-6)
    assert all_finite(resumed.params(5))
