"""Client-mode peers (behind NAT: they only connect out) train in a swarm with a reachable peer: real peers as
separate processes on 127.0.0.1, each a LightningCLI run of tests/lightning_swarm/peer_worker.py."""

from __future__ import annotations

import pytest
import torch

from swarm_harness import Peer

pytestmark = pytest.mark.slow

LOCAL = ["/ip4/127.0.0.1/tcp/0"]


def strategy_args(run_id: str, target_batch_size: int, **overrides):
    args = dict(run_id=run_id, target_batch_size=target_batch_size, host_maddrs=LOCAL, matchmaking_time=1.5,
                averaging_timeout=15.0, load_state_timeout=20.0, metrics_interval=1.0, compression="none",
                tracker_opts={"max_refresh_period": 1.0, "min_refresh_period": 0.2, "default_refresh_period": 0.5})
    args.update(overrides)
    return args


def test_client_mode_peers_train_with_a_reachable_one(tmp_path, peers, monkeypatch):
    """One reachable peer and two client-mode peers (the README's setting for peers behind NAT) pass global epochs
    together: no client-mode peer dies at its first global step (hivemind 1.1.12's inverted ``client_mode``
    derivation made it set a state sharing priority its averagers refuse), all three reach epoch 3, the client-mode
    peers took the reachable peer's parameters when they joined, and all end every epoch with the same finite
    parameters (the reachable peer reduces every part: client-mode peers accept no connection), its results checked
(the client-mode peers' verification messages relayed by the reachable peer)."""
    recorder = {"stop_at_epoch": 3, "max_seconds": 120, "barrier_dir": str(tmp_path / "barrier"), "barrier_count": 3}
    common = dict(model={"step_delay": 0.02}, recorder=recorder)
    # why a client-mode peer stopped asking a relay (pre-checks saw both clients lack each other's relayed report)
    monkeypatch.setenv("PEER_DEBUG_LOGGERS", "lightning_swarm.hivemind_ext.result_verification")
    reachable = Peer(tmp_path, "reachable", strategy_args("nat", 48), data={"batch_size": 4}, **common)
    peers.append(reachable)
    clients = []
    for index in range(2):
        client = Peer(tmp_path, f"client{index}", strategy_args("nat", 48, client_mode=True),
                      data={"batch_size": 4, "offset": 30_000 * (index + 1)},
                      **dict(common, model={"step_delay": 0.02, "seed": 100 + index}), join_later=True)
        peers.append(client)
        clients.append(client)
    join = reachable.join_peers()
    for client in clients:
        client.join(join)
    for peer in (reachable, *clients):
        peer.wait(timeout=180)

    for peer in (reachable, *clients):
        assert peer.max_epoch() >= 3, (peer.name, peer.events())
        assert max(event.get("peers", 0) for event in peer.events()) == 3, (peer.name, peer.events())
    for client in clients:
        log = client.log()
        assert "State sharing priority is unused" not in log and "cannot share its state" not in log, log[-3000:]
    for peer in (reachable, *clients):  # the reducer's results were checked: the reachable peer relayed
        log = peer.log()
        assert "not checked" not in log and "refused the slice" not in log and "kept out" not in log, log[-3000:]
    for epoch in (1, 2, 3):
        expected = reachable.params(epoch)
        for client in clients:
            got = client.params(epoch)
            assert expected.keys() == got.keys()
            for name in expected:
                assert torch.isfinite(got[name]).all(), (client.name, epoch, name)
                assert torch.allclose(expected[name], got[name], atol=1e-5), (
                    client.name, epoch, name, (expected[name] - got[name]).abs().max())
    assert not torch.allclose(reachable.params(0)["net.0.weight"], reachable.params(3)["net.0.weight"])  # it trained
