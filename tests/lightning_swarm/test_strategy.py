"""Fast tests of HivemindStrategy's configuration checks, peer addresses, schedule re-binding and DHT metrics.
(The multi-peer behaviour is in test_strategy_swarm.py.)"""

from __future__ import annotations

import hivemind
import pytest
import torch
from hivemind.dht.crypto import RSASignatureValidator
from hivemind.utils import get_dht_time
from hivemind.utils.crypto import RSAPrivateKey

from lightning_swarm import HivemindStrategy
from lightning_swarm.metrics import LocalMetrics, fetch_metrics, local_public_key, make_validators, metrics_key, publish_metrics
from lightning_swarm.peers import INITIAL_PEERS_ENV, join_message, resolve_initial_peers
from lightning_swarm.scheduler import GlobalEpochScheduler, rebind_scheduler
from lightning_swarm.hivemind_ext.lifetime import SwarmDHT

PEER = "/ip4/127.0.0.1/tcp/31337/p2p/12D3KooWArQAx4zYSmHJMxr7inBhM9DWVPcPa8S6SooKYcX5FJPP"


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(initial_peers=["/ip4/127.0.0.1/tcp/notaport/p2p/Qm"]), "notaport"),
        (dict(initial_peers=["/ip4/127.0.0.1/tcp/31337"]), "no peer id"),
        (dict(initial_peers="hello"), "'hello' is not a valid multiaddr"),
        (dict(host_maddrs=["/ip4/300.0.0.1/tcp/0"]), "host_maddrs"),
        (dict(announce_maddrs=[PEER]), "must not contain '/p2p/"),
        (dict(target_batch_size=0), "target_batch_size"),
        (dict(run_id="has space"), "run_id"),
        (dict(run_id="v1.2"), "run_id must be a non-empty name of letters, digits, '_' and '-'"),
        (dict(delay_grad_averaging=True, delay_optimizer_step=False), "requires delay_optimizer_step"),
        (dict(delay_optimizer_step=True, offload_optimizer=False), "offload_optimizer"),
        (dict(reuse_grad_buffers=True, delay_grad_averaging=True), "reuse_grad_buffers"),
        (dict(client_mode=True, announce_maddrs=["/ip4/1.2.3.4/tcp/5"]), "client_mode"),
        (dict(use_auto_relay=True, use_relay=False), "use_relay"),
        (dict(matchmaking_time=10.0, averaging_timeout=5.0), "larger than matchmaking_time"),
        (dict(compression="zip"), "compression"),
        (dict(load_state_compression="8bit"), "load_state_compression"),
        (dict(average_state_every=0), "average_state_every"),
        (dict(averager_opts={"leader_poll_interval": -1}), "leader_poll_interval"),
        (dict(tracker_opts={"min_report_interval": "often"}), "min_report_interval"),
    ],
)
def test_invalid_configurations_are_rejected_at_construction(kwargs, message):
    args = dict(run_id="run", target_batch_size=64)
    args.update(kwargs)
    with pytest.raises(ValueError, match=message.replace("(", r"\(")):
        HivemindStrategy(**args)


def test_valid_configuration_keeps_options():
    strategy = HivemindStrategy(
        run_id="run", target_batch_size=64, initial_peers=f"{PEER}, {PEER}", delay_grad_averaging=True,
        client_mode=True, use_auto_relay=True,
    )
    assert strategy.initial_peers == [PEER, PEER]
    assert strategy.global_epoch == 0 and strategy.num_peers == 1 and strategy.dht is None


def test_initial_peers_come_from_the_environment(monkeypatch):
    monkeypatch.setenv(INITIAL_PEERS_ENV, f"{PEER} {PEER}")
    assert HivemindStrategy(run_id="run", target_batch_size=8).initial_peers == [PEER, PEER]
    # an explicit argument wins over the environment
    assert resolve_initial_peers([]) == []
    monkeypatch.setenv(INITIAL_PEERS_ENV, "/ip4/1.2.3.4/tcp/1")
    with pytest.raises(ValueError, match=INITIAL_PEERS_ENV):
        HivemindStrategy(run_id="run", target_batch_size=8)


def test_join_message_names_the_cli_option_and_the_environment_variable():
    message = join_message("run", [PEER])
    assert f"--trainer.strategy.init_args.initial_peers='[\"{PEER}\"]'" in message
    assert f'{INITIAL_PEERS_ENV}="{PEER}"' in message


def _schedule(scheduler_factory, steps, rebind_after=None):
    """Learning rates over `steps` scheduler steps; optionally move the scheduler to a new optimizer midway."""
    optimizer = torch.optim.SGD(torch.nn.Linear(2, 2).parameters(), lr=0.1)
    scheduler = scheduler_factory(optimizer)
    lrs = []
    for step in range(steps):
        if step == rebind_after:
            # what the strategy does: a new optimizer on the same param groups, the schedule re-bound onto it
            optimizer = torch.optim.SGD(optimizer.param_groups, **optimizer.defaults)
            scheduler = rebind_scheduler(scheduler, optimizer)
        optimizer.step()
        scheduler.step()
        lrs.append(optimizer.param_groups[0]["lr"])
    return lrs


@pytest.mark.parametrize(
    "factory",
    [
        lambda opt: torch.optim.lr_scheduler.LambdaLR(opt, lambda epoch: 0.5**epoch),
        lambda opt: torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=1.0, total_steps=20),
        lambda opt: torch.optim.lr_scheduler.SequentialLR(
            opt,
            [torch.optim.lr_scheduler.LinearLR(opt, 0.1, total_iters=2), torch.optim.lr_scheduler.ExponentialLR(opt, 0.9)],
            milestones=[2],
        ),
    ],
    ids=["lambda", "onecycle", "sequential"],
)
def test_rebound_scheduler_continues_the_same_schedule_on_the_new_optimizer(factory):
    assert _schedule(factory, steps=6, rebind_after=2) == pytest.approx(_schedule(factory, steps=6))


def test_global_epoch_scheduler_ignores_lightning_steps_but_keeps_state():
    optimizer = torch.optim.SGD(torch.nn.Linear(2, 2).parameters(), lr=1.0)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda epoch: 0.5**epoch)
    wrapper = GlobalEpochScheduler(scheduler, optimizer)
    wrapper.step()
    wrapper.step()
    assert optimizer.param_groups[0]["lr"] == 1.0
    optimizer.step()
    scheduler.step()  # what hivemind does once per global epoch
    state = wrapper.state_dict()
    assert state["last_epoch"] == 1 and wrapper.get_last_lr() == [0.5] and wrapper.last_epoch == 1
    with pytest.raises(ValueError, match="ReduceLROnPlateau"):
        rebind_scheduler(torch.optim.lr_scheduler.ReduceLROnPlateau(optimizer), optimizer)


def test_metrics_are_signed_schema_checked_and_fetched():
    dht = SwarmDHT(start=True, host_maddrs=["/ip4/127.0.0.1/tcp/0"], record_validators=make_validators("mrun"))
    try:
        record = LocalMetrics(step=3, loss=0.25, samples_per_second=12.5, samples_accumulated=96, mini_steps=4,
                              time=get_dht_time())
        assert publish_metrics(dht, "mrun", record)
        # a record that doesn't match the schema (a float step) is refused by the validators
        assert not dht.store(metrics_key("mrun"), dict(record.dict(), step=1.5), get_dht_time() + 30,
                             subkey=local_public_key())
        # a record under somebody else's public key can't be signed by us
        stranger = RSASignatureValidator(RSAPrivateKey()).local_public_key
        assert not dht.store(metrics_key("mrun"), record.dict(), get_dht_time() + 30, subkey=stranger)
        fetched = fetch_metrics(dht, "mrun")
        assert list(fetched.values()) == [record] and list(fetched) == [local_public_key()]
        assert fetch_metrics(dht, "another_run") == {}
    finally:
        dht.shutdown()


def test_fp16_loss_scaling_with_reused_grad_buffers_is_a_clear_error(tmp_path):
    """Lightning's GradScaler unscales .grad every local step: with reuse_grad_buffers the accumulated sum would be
    unscaled again and again, so the combination is refused before the peer starts (fp16 alone is supported)."""
    from lightning.pytorch import Trainer
    from lightning.pytorch.demos.boring_classes import BoringModel
    from lightning.pytorch.plugins.precision import MixedPrecision

    trainer = Trainer(strategy=HivemindStrategy(run_id="run", target_batch_size=8, reuse_grad_buffers=True),
                      plugins=[MixedPrecision("16-mixed", "cpu")], accelerator="cpu", max_steps=1, logger=False,
                      enable_checkpointing=False, enable_progress_bar=False, default_root_dir=tmp_path)
    with pytest.raises(ValueError, match="reuse_grad_buffers"):
        trainer.fit(BoringModel())
    assert trainer.strategy.dht is None  # refused before joining anything
