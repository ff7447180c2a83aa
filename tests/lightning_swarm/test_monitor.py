"""The monitor peer: metrics aggregation, contribution table, config loading (fast), and a real swarm on
127.0.0.1 (slow): two trainers + the monitor, its checkpoint, then a revert and a new peer starting from it."""

import csv
import json
import os
import subprocess
import sys
import time

import pytest
import torch
import yaml

from ckpt_tiny_module import TinyRegressor
from lightning_swarm.checkpoint.checkpoint_io import read_checkpoint
from lightning_swarm.metrics import LocalMetrics
from lightning_swarm.monitor.aggregate import ContributionTable, aggregate, peer_name
from lightning_swarm.monitor.config import build_strategy, load_monitor_config
from lightning_swarm.recipe_config import build_model
from lightning_swarm.strategy import HivemindStrategy
from processes import Proc, free_port, wait_for

HERE = os.path.dirname(os.path.abspath(__file__))


def record(step=3, loss=1.0, sps=2.0, samples=10, mini_steps=2, t=100.0):
    return LocalMetrics(step=step, loss=loss, samples_per_second=sps, samples_accumulated=samples,
                        mini_steps=mini_steps, time=t)


def test_aggregate_weights_loss_by_local_steps():
    records = {b"a": record(step=3, loss=1.0, sps=2.0, mini_steps=1), b"b": record(step=4, loss=4.0, sps=3.5, mini_steps=3)}
    snapshot = aggregate(records, samples_contributed=20)
    assert snapshot.loss == pytest.approx((1.0 * 1 + 4.0 * 3) / 4)
    assert snapshot.alive_peers == 2 and snapshot.step == 4
    assert snapshot.samples_per_second == pytest.approx(5.5)
    assert set(snapshot.records) == {peer_name(b"a"), peer_name(b"b")}
    no_steps = {b"a": record(loss=1.0, mini_steps=0), b"b": record(loss=2.0, mini_steps=0)}
    assert aggregate(no_steps).loss == pytest.approx(1.5)
    assert aggregate({}) is None


def test_contribution_table_counts_samples_and_time_without_gaps(tmp_path):
    table = ContributionTable(max_gap=60)
    table.update({b"a": record(samples=8, t=100.0), b"b": record(samples=4, t=100.0)})
    table.update({b"a": record(samples=16, t=130.0)})
    table.update({b"a": record(samples=16, t=130.0)})  # the same record again changes nothing
    table.update({b"a": record(samples=40, t=500.0), b"b": record(samples=12, t=140.0)})  # a was away 370 s
    rows = {row.peer: row for row in table.sorted_rows()}
    assert rows[peer_name(b"a")].samples == 40 and rows[peer_name(b"a")].seconds == pytest.approx(30.0)
    assert rows[peer_name(b"b")].samples == 12 and rows[peer_name(b"b")].seconds == pytest.approx(40.0)
    assert table.total_samples == 52
    table.write(str(tmp_path))
    with open(tmp_path / "contributions.csv") as f:
        written = list(csv.DictReader(f))
    assert [r["peer"] for r in written] == [peer_name(b"a"), peer_name(b"b")]  # most samples first
    assert json.loads((tmp_path / "contributions.json").read_text())[1]["samples"] == 12


def test_config_builds_the_trainers_module_and_strategy(tmp_path):
    config = {
        "model": {"class_path": "ckpt_tiny_module.TinyRegressor", "init_args": {"dim": 6, "hidden": 10}},
        "trainer": {"strategy": {"class_path": "lightning_swarm.HivemindStrategy",
                                 "init_args": {"run_id": "r1", "target_batch_size": 64, "compression": "none",
                                               "initial_peers": "[]"}}},
        "data": {"whatever": 1},
    }
    path = tmp_path / "cfg.yaml"
    path.write_text(yaml.safe_dump(config))
    module, strategy = load_monitor_config(str(path), target_batch_size=32, host_maddrs=["/ip4/127.0.0.1/tcp/0"])
    assert isinstance(module, TinyRegressor) and module.embed.weight.shape == (10, 6)
    assert isinstance(strategy, HivemindStrategy)
    assert (strategy.run_id, strategy.target_batch_size, strategy.compression) == ("r1", 32, "none")
    assert strategy.initial_peers == [] and strategy.host_maddrs == ["/ip4/127.0.0.1/tcp/0"]
    # the strategy's own checks apply to the monitor too
    with pytest.raises(ValueError, match="averaging_timeout"):
        build_strategy(config, matchmaking_time=100.0)
    with pytest.raises(ValueError, match="run id and target batch size"):
        build_strategy({"trainer": {}}, run_id="r")
    assert build_strategy({"trainer": {}}, run_id="r", target_batch_size=8).run_id == "r"
    # recipes whose CLI fixes the model class have no class_path: --model-class names it
    module = build_model({"model": {"dim": 4}}, model_class="ckpt_tiny_module.TinyRegressor")
    assert module.embed.weight.shape == (16, 4)
    with pytest.raises(ValueError, match="--model-class"):
        build_model({"model": {"dim": 4}})


@pytest.mark.timeout(120)
def test_monitor_runs_on_the_trainers_stack_with_every_strategy_option(tmp_path):
    """A config with the strategy's own averager/tracker keys: the monitor's swarm optimizer is the trainers'."""
    code = """
import sys, yaml
from lightning_swarm.monitor.config import load_monitor_config
from lightning_swarm.monitor.peer import MonitorPeer
from lightning_swarm.hivemind_ext.optimizer import SwarmOptimizer
module, strategy = load_monitor_config(sys.argv[1], host_maddrs=["/ip4/127.0.0.1/tcp/0"], initial_peers=[])
peer = MonitorPeer(module, strategy)
try:
    opt = peer.optimizer
    assert isinstance(opt, SwarmOptimizer) and opt.grad_averager is None  # never steps: no gradient averager
    print("FOUND", opt.tracker.min_report_interval, opt.state_averager.leader_poll_interval,
          opt.state_averager.scheduler is not None, len(peer.addresses) > 0, flush=True)
finally:
    peer.shutdown()
"""
    config = {
        "model": {"class_path": "ckpt_tiny_module.TinyRegressor"},
        "trainer": {"strategy": {"class_path": "lightning_swarm.HivemindStrategy", "init_args": {
            "run_id": "opts_test", "target_batch_size": 16, "matchmaking_time": 1.0, "averaging_timeout": 5.0,
            "averager_opts": {"leader_poll_interval": 0.25}, "tracker_opts": {"min_report_interval": 0.75},
            "delay_optimizer_step": True, "offload_optimizer": True}}},
    }
    (tmp_path / "cfg.yaml").write_text(yaml.safe_dump(config))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([HERE, os.environ.get("PYTHONPATH", "")]), OMP_NUM_THREADS="1")
    result = subprocess.run([sys.executable, "-c", code, str(tmp_path / "cfg.yaml")], env=env, cwd=str(tmp_path),
                            capture_output=True, text=True, timeout=100)
    found = [line for line in result.stdout.splitlines() if line.startswith("FOUND")]
    assert result.returncode == 0 and found, result.stderr[-3000:]
    assert found[0].split()[1:] == ["0.75", "0.25", "True", "True"]
    assert "To join this swarm" in result.stdout  # the join message of lightning_swarm.peers


def test_cli_needs_run_settings_and_builds_loggers(tmp_path):
    from lightning_swarm.monitor.__main__ import main
    from lightning_swarm.monitor.runner import build_loggers, tensorboard_available

    path = tmp_path / "cfg.yaml"
    path.write_text(yaml.safe_dump({"model": {"class_path": "ckpt_tiny_module.TinyRegressor"}}))
    with pytest.raises(ValueError, match="run_id and target_batch_size"):
        main(["--config", str(path)])
    loggers = build_loggers(["auto"], str(tmp_path), "r")
    expected = ["CSVLogger"] + (["TensorBoardLogger"] if tensorboard_available() else [])
    assert [type(logger).__name__ for logger in loggers] == expected
    with pytest.raises(ValueError, match="wandb-project"):
        build_loggers(["wandb"], str(tmp_path), "r")
    with pytest.raises(ValueError, match="Unknown logger"):
        build_loggers(["mlflowish"], str(tmp_path), "r")


def test_monitor_drops_its_own_address_from_the_trainers_initial_peers(tmp_path):
    from hivemind.p2p import P2P, PeerID

    from lightning_swarm.monitor.__main__ import without_own_address

    identity = str(tmp_path / "monitor.id")
    P2P.generate_identity(identity)
    own = PeerID.from_identity(open(identity, "rb").read()).to_base58()
    other = "/ip4/10.0.0.2/tcp/31337/p2p/QmYyQSo1c1Ym7orWxLYvCrM2EmxFTANf8wXmmE7DWjhx5N"
    peers = [f"/ip4/10.0.0.1/tcp/31337/p2p/{own}", other]
    assert without_own_address(peers, identity) == [other]
    assert without_own_address(peers, str(tmp_path / "missing.id")) == peers


# --------------------------------------------------------------------------------------------- real swarm


def read_jsonl(path):
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def write_atomically(path, text):
    with open(path + ".tmp", "w") as f:
        f.write(text)
    os.replace(path + ".tmp", path)


@pytest.mark.slow
@pytest.mark.timeout(420)
def test_monitor_with_two_trainers_checkpoint_and_revert(tmp_path):
    run_id = "ckpt_monitor_test"
    config = {
        "model": {"class_path": "ckpt_tiny_module.TinyRegressor", "init_args": {"dim": 8, "hidden": 16}},
        "trainer": {"strategy": {"class_path": "lightning_swarm.HivemindStrategy", "init_args": {
            "run_id": run_id, "target_batch_size": 16, "compression": "none", "load_state_timeout": 20,
            "tracker_opts": {"min_refresh_period": 0.1, "max_refresh_period": 0.5, "default_refresh_period": 0.2},
        }}},
    }
    (tmp_path / "cfg.yaml").write_text(yaml.safe_dump(config))
    remote = tmp_path / "remote"  # a local fsspec upload target
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([HERE, os.environ.get("PYTHONPATH", "")]),
               OMP_NUM_THREADS="1")
    port = free_port()

    def monitor(log_name, *extra):
        return Proc([sys.executable, "-m", "lightning_swarm.monitor", "--config", "cfg.yaml",
                     "--host_maddrs", f"/ip4/127.0.0.1/tcp/{port}", "--identity_path", "monitor.id",
                     "--refresh_period", "0.5", "--save_every_epochs", "2", "--upload_to", str(remote),
                     "--upload_backoff_seconds", "0.5", "--max_runtime", "400", *extra],
                    str(tmp_path / log_name), env)

    def trainer(name, seed, peers_file, *extra):
        return Proc([sys.executable, os.path.join(HERE, "ckpt_swarm_trainer.py"), "--run_id", run_id,
                     "--peers_file", peers_file, "--out_dir", str(tmp_path / name),
                     "--stop_file", str(tmp_path / f"stop_{name}"), "--seed", str(seed), *extra],
                    str(tmp_path / f"{name}.log"), env)

    procs = []
    try:
        # the monitor is the swarm's first peer; trainers import meanwhile and join once it prints its address
        procs.append(monitor("monitor.log", "--log_dir", "logs", "--checkpoint_dir", "ckpt"))
        peers_file = str(tmp_path / "peers.txt")
        procs += [trainer("a", 1, peers_file), trainer("b", 2, peers_file)]
        address = procs[0].wait_line("MONITOR_ADDRESS", 150).split()[1]
        write_atomically(peers_file, address)

        snapshots_path = str(tmp_path / "logs" / "snapshots.jsonl")
        wait_for(lambda: any(s["alive_peers"] == 2 for s in read_jsonl(snapshots_path))
                 and (remote / "latest").exists(), 150, "2 alive peers in the monitor's log and an upload")

        # the logged figures are exactly what the trainers published
        published = [r for name in "ab" for r in read_jsonl(str(tmp_path / name / "published.jsonl"))]
        snapshots = read_jsonl(snapshots_path)
        both = [s for s in snapshots if s["alive_peers"] == 2]
        assert both and max(s["alive_peers"] for s in snapshots) == 2
        for snapshot in snapshots:
            assert all(r in published for r in snapshot["records"].values())
            assert len(snapshot["records"]) == snapshot["alive_peers"]
            steps = sum(r["mini_steps"] for r in snapshot["records"].values())
            expected = sum(r["loss"] * r["mini_steps"] for r in snapshot["records"].values()) / steps
            assert snapshot["loss"] == pytest.approx(expected)
        with open(tmp_path / "logs" / "monitor" / run_id / "metrics.csv") as f:
            logged = list(csv.DictReader(f))
        assert [float(row["swarm/alive_peers"]) for row in logged[: len(snapshots)]] == [
            s["alive_peers"] for s in snapshots[: len(logged)]]
        assert [float(row["swarm/loss"]) for row in logged[: len(snapshots)]] == pytest.approx(
            [s["loss"] for s in snapshots[: len(logged)]])
        contributions = json.loads((tmp_path / "logs" / "contributions.json").read_text())
        assert len(contributions) == 2 and all(row["samples"] > 0 for row in contributions)

        # the uploaded checkpoint loads into a fresh module, identical to the monitor's local copy, and trained
        uploaded = read_checkpoint(str(remote))
        assert uploaded.meta["run_id"] == run_id and uploaded.meta["global_epoch"] >= 2
        fresh, local = TinyRegressor(), TinyRegressor()
        uploaded.load_into(fresh)
        read_checkpoint(str(tmp_path / "ckpt" / os.path.basename(uploaded.url))).load_into(local)
        for key, value in local.state_dict().items():
            assert torch.equal(fresh.state_dict()[key], value), key
        from safetensors.torch import load_file

        # the state moved away from where each trainer started: it is trained state. A trainer that joined late
        # started from the swarm's state at its join epoch, which is the uploaded state if that is the same epoch
        start_epochs = {name: read_jsonl(str(tmp_path / name / "start.json"))[0]["global_epoch"] for name in "ab"}
        started_before = [name for name, epoch in start_epochs.items() if epoch < uploaded.meta["global_epoch"]]
        assert started_before  # the first trainer started at epoch 0
        for name in started_before:
            started = load_file(str(tmp_path / name / "start.safetensors"))
            assert not torch.equal(started["mid.weight"], fresh.mid.weight.detach())

        # moderators revert: trainers stop, the monitor restarts (same identity and address) with --revert_to
        for name in "ab":
            (tmp_path / f"stop_{name}").touch()
        for proc in procs:
            proc.stop()
        procs = []
        revert_url = uploaded.url
        peers_file_c = str(tmp_path / "peers_c.txt")
        procs.append(monitor("monitor2.log", "--log_dir", "logs2", "--checkpoint_dir", "ckpt2",
                             "--revert_to", revert_url, "--revert_discovery_seconds", "0"))
        procs.append(trainer("c", 3, peers_file_c, "--ckpt_dir", str(tmp_path / "c_ckpt")))
        reverted_epoch = int(procs[0].wait_line("[lightning_swarm.monitor] REVERTED", 150).split()[-1])
        assert reverted_epoch >= uploaded.meta["global_epoch"]
        write_atomically(peers_file_c, address)

        # the new peer starts from the reverted checkpoint, exactly, and trains on from there
        start = wait_for(lambda: read_jsonl(str(tmp_path / "c" / "start.json")), 120, "trainer c to start")[0]
        assert start["global_epoch"] == reverted_epoch
        started_with = load_file(str(tmp_path / "c" / "start.safetensors"))
        saved = uploaded.model_state_dict()
        assert set(saved) <= set(started_with)
        for key in ("embed.weight", "mid.weight", "mid.bias", "tie"):
            assert torch.equal(started_with[key], saved[key]), key
        wait_for(lambda: (read_jsonl(str(tmp_path / "c" / "progress.json")) or [{}])[0].get("global_epoch", 0)
                 >= reverted_epoch + 2, 90, "trainer c to train two epochs past the revert")

        # SwarmCheckpoint inside the swarm trainer: named by the global epoch, with the run's figures
        own = wait_for(lambda: os.path.exists(tmp_path / "c_ckpt" / "latest") and read_checkpoint(
            str(tmp_path / "c_ckpt")), 30, "trainer c's own checkpoint")
        assert own.meta["run_id"] == run_id and own.meta["global_epoch"] > reverted_epoch
        assert own.meta["samples_seen"] == own.meta["global_epoch"] * 16
        assert own.optimizer_states[0]["state"]["local_epoch"] == own.meta["global_epoch"]
        own.load_into(TinyRegressor())
    finally:
        for name in "abc":
            (tmp_path / f"stop_{name}").touch()
        for proc in procs:
            proc.stop()


def test_record_screen_drops_and_counts_implausible_records():
    from lightning_swarm.monitor.aggregate import RecordScreen

    screen = RecordScreen(target_batch_size=100, max_clock_skew=30.0)
    good = record(step=5, samples=300, t=1000.0)
    records = {
        b"good": good,
        b"nan_loss": record(step=5, loss=float("nan"), t=1000.0),
        b"inf_speed": record(step=5, sps=float("inf"), t=1000.0),
        b"future": record(step=5, t=1000.0 + 3600),
        b"epoch": record(step=10**15, t=1000.0),
        b"samples": record(step=5, samples=10**15, t=1000.0),
    }
    accepted = screen.screen(records, swarm_epoch=5, now=1000.0)
    assert accepted == {b"good": good}
    assert screen.refused == {"non_finite": 2, "future_time": 1, "epoch_beyond_swarm": 1, "samples_beyond_epochs": 1}
    screen.screen(records, swarm_epoch=5, now=1001.0)  # the same records again are not counted twice
    assert sum(screen.refused.values()) == 5
    # the snapshot and the contribution table see only the good record
    table = ContributionTable()
    table.update(accepted)
    snapshot = aggregate(accepted, table.total_samples, dict(screen.refused))
    assert snapshot.step == 5 and snapshot.loss == 1.0 and table.total_samples == 300
    assert snapshot.as_metrics()["swarm/refused_records"] == 5.0


def test_record_screen_authentication_hook_keeps_unknown_keys_out_of_the_table():
    from lightning_swarm.monitor.aggregate import RecordScreen

    screen = RecordScreen(target_batch_size=100, identify=lambda key, record: {b"alice_key": "alice"}.get(key))
    accepted = screen.screen({b"alice_key": record(), b"stranger": record()}, swarm_epoch=3, now=100.0)
    assert list(accepted) == [b"alice_key"] and screen.refused == {"unauthenticated": 1}
    table = ContributionTable()
    table.update(accepted, users=screen.users)
    assert [(row.peer, row.user) for row in table.sorted_rows()] == [(peer_name(b"alice_key"), "alice")]


def test_token_identity_names_the_user_whose_token_is_for_the_key_that_signed_the_record():
    """In a run with an authority, a metrics record's user is the one its token names, only if the authority signed
    that token for this run, it is unexpired, and it is for the key that signed the record."""
    from hivemind.utils.crypto import RSAPrivateKey

    from lightning_swarm.auth.peer import SwarmAuth
    from lightning_swarm.auth.tokens import issue_token, public_key_text, token_to_json
    from lightning_swarm.monitor.aggregate import RecordScreen
    from lightning_swarm.monitor.identity import token_identity

    authority, stranger_authority = RSAPrivateKey(), RSAPrivateKey()
    alice, bob = RSAPrivateKey(), RSAPrivateKey()
    subkey = {user: b"[owner:" + key.get_public_key().to_bytes() + b"]" for user, key in (("alice", alice), ("bob", bob))}

    def with_token(issuer, user, key, run_id="run", lifetime=3600.0):
        token = issue_token(issuer, run_id, user, key.get_public_key(), lifetime)
        return LocalMetrics(**dict(record().dict(), token=token_to_json(token)))

    identify = token_identity(SwarmAuth("run", public_key_text(authority.get_public_key())))
    alice_record = with_token(authority, "alice", alice)
    assert identify(subkey["alice"], alice_record) == "alice"
    assert identify(subkey["bob"], alice_record) is None  # alice's token copied into a record bob signed
    assert identify(subkey["bob"], record()) is None  # no token
    assert identify(subkey["bob"], LocalMetrics(**dict(record().dict(), token="{not json"))) is None
    assert identify(subkey["bob"], with_token(stranger_authority, "bob", bob)) is None  # another authority
    assert identify(subkey["bob"], with_token(authority, "bob", bob, run_id="other")) is None  # another run
    expired = with_token(authority, "bob", bob, lifetime=1e-3)
    time.sleep(0.01)
    assert identify(subkey["bob"], expired) is None

    screen = RecordScreen(target_batch_size=100, identify=identify)
    accepted = screen.screen({subkey["alice"]: alice_record, subkey["bob"]: expired}, swarm_epoch=3, now=100.0)
    table = ContributionTable()
    table.update(accepted, users=screen.users)
    assert [row.user for row in table.sorted_rows()] == ["alice"] and screen.refused == {"unauthenticated": 1}
