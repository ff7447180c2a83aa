"""Groups that change every round: the initial group bits of averager_opts.expected_peers and hivemind's own key
updates (GroupKeyManager.update_key_on_group_assembled, run as hivemind runs it after each assembled group)."""

from __future__ import annotations

import asyncio
import random

import hivemind
import pytest
from hivemind.averaging.group_info import GroupInfo
from hivemind.averaging.key_manager import GroupKeyManager

from lightning_swarm.hivemind_ext.group_keys import MovingGroupKeyManager, moshpit_group_bits
from lightning_swarm.strategy_options import hivemind_optimizer_options
from lightning_swarm.hivemind_ext.lifetime import SwarmDHT

LOCAL = ["/ip4/127.0.0.1/tcp/0"]


@pytest.fixture(scope="module")
def dht():
    node = SwarmDHT(start=True, host_maddrs=LOCAL)
    yield node
    node.shutdown()


def test_one_key_per_target_group_of_expected_peers():
    assert len(moshpit_group_bits(16, 4)) == 2  # 4 keys of ~4 peers
    assert len(moshpit_group_bits(1000, 32)) == 4  # 16 keys of ~62 peers: never fewer than g per key on average
    assert len(moshpit_group_bits(31, 4)) == 2
    assert moshpit_group_bits(4, 4) == moshpit_group_bits(None, 4) == moshpit_group_bits(16, None) == ""
    assert {moshpit_group_bits(16, 4, random.Random(seed)) for seed in range(20)} == {"00", "01", "10", "11"}
    with pytest.raises(ValueError, match="averager_opts.expected_peers"):
        moshpit_group_bits(0, 4)


def test_strategy_options_turn_expected_peers_into_initial_group_bits():
    options = lambda averager_opts: hivemind_optimizer_options(  # noqa: E731
        matchmaking_time=5.0, averaging_timeout=60.0, allreduce_timeout=None, load_state_timeout=60.0,
        next_chunk_timeout=None, delay_optimizer_step=None, delay_grad_averaging=False, delay_state_averaging=True,
        offload_optimizer=None, reuse_grad_buffers=False, average_state_every=1, averager_opts=averager_opts,
        tracker_opts=None, verbose=False)["averager_opts"]
    opts = options({"target_group_size": 4, "expected_peers": 64})
    assert "expected_peers" not in opts and len(opts["initial_group_bits"]) == 4  # not passed on to hivemind
    assert "initial_group_bits" not in options({"target_group_size": 4})  # hivemind's default: one key
    assert options({"target_group_size": 4, "expected_peers": 64, "initial_group_bits": "1"})["initial_group_bits"] == "1"


def simulate_rounds(dht, bits, num_peers, group_size, rounds, seed=0, manager_class=MovingGroupKeyManager):
    """Peers with these initial bits; each round, the peers under one key form groups of up to group_size (in random
    order), and every member updates its key as hivemind does after an assembled group; a peer left alone under its
    key updates it as after a search that found nobody. Returns, per round, the keys and, for each peer, the set of
    peers whose contribution has reached it."""
    rng = random.Random(seed)
    random.seed(seed)  # MovingGroupKeyManager's moves
    managers = []
    for index in range(num_peers):
        manager = manager_class(dht, "run_grad_averager", bits[index], group_size)
        manager.peer_id = f"peer{index}"  # hivemind only compares it with the group's peer ids
        managers.append(manager)
    reached = [{index} for index in range(num_peers)]
    history = []
    for _ in range(rounds):
        by_key = {}
        for index, manager in enumerate(managers):
            by_key.setdefault(manager.current_key, []).append(index)
        for members in by_key.values():
            rng.shuffle(members)  # who groups with whom under one key, and who is left out, is up to timing
            for start in range(0, len(members), group_size):
                group = members[start:start + group_size]
                if len(group) == 1:  # no group: hivemind's matchmaking fails, then calls this
                    asyncio.run(managers[group[0]].update_key_on_not_enough_peers())
                    continue
                info = GroupInfo(group_id=rng.randbytes(32), peer_ids=tuple(f"peer{i}" for i in group),
                                 gathered=tuple(b"" for _ in group))
                union = set().union(*(reached[i] for i in group))
                for i in group:
                    reached[i] = set(union)
                    asyncio.run(managers[i].update_key_on_group_assembled(info))
        history.append(([manager.current_key for manager in managers], [set(r) for r in reached]))
    return history


def test_group_keys_change_every_round_and_mix_all_peers_in_log_g_rounds(dht):
    """16 peers, groups of 4, expected_peers=16: keys change after every round, and every peer's contribution has
    reached all 16 after 2 rounds from a full grid (log_4 16), within 5 from random initial keys (uneven at first).
    With hivemind's default bits ("") the key never changes (mixing then rests on who happens to group with whom)."""
    num_peers, g = 16, 4
    grid = [format(index % 4, "02b") for index in range(num_peers)]  # 4 keys of 4 peers
    history = simulate_rounds(dht, grid, num_peers, g, rounds=2)
    assert all(len(reached) == num_peers for reached in history[-1][1])
    before = [f"run_grad_averager.0b{bits}" for bits in grid]
    for keys, _ in history:
        assert sum(new != old for new, old in zip(keys, before)) >= num_peers // 2, (before, keys)
        before = keys

    # random initial keys are uneven (a key of 5 leaves one peer alone, which then moves): slower at first
    rng = random.Random(1)
    random_bits = [moshpit_group_bits(num_peers, g, rng) for _ in range(num_peers)]
    history = simulate_rounds(dht, random_bits, num_peers, g, rounds=5)
    assert all(len(reached) == num_peers for reached in history[-1][1]), [len(r) for r in history[-1][1]]

    one_key = simulate_rounds(dht, [""] * num_peers, num_peers, g, rounds=3, manager_class=GroupKeyManager)
    assert all(keys == ["run_grad_averager.0b"] * num_peers for keys, _ in one_key)


def test_a_peer_alone_under_its_key_moves_to_another(dht):
    manager = MovingGroupKeyManager(dht, "run_grad_averager", "01", 4)
    seen = set()
    for _ in range(20):
        before = manager.group_bits
        asyncio.run(manager.update_key_on_not_enough_peers())
        assert manager.group_bits != before and len(manager.group_bits) == 2
        seen.add(manager.group_bits)
    assert seen == {"00", "01", "10", "11"}
    alone = MovingGroupKeyManager(dht, "run_grad_averager", "", 4)
    asyncio.run(alone.update_key_on_not_enough_peers())
    assert alone.group_bits == ""


def test_an_averager_that_found_no_group_moves_to_another_key(dht):
    """In a real averager's process (the key manager is switched as hivemind builds its matchmaking): a peer alone
    under its key fails its round and then looks under another key; hivemind's own would stay where it was."""
    import torch
    from hivemind.averaging import DecentralizedAverager

    from lightning_swarm.hivemind_ext.group_keys import MovingGroupKeys
    from lightning_swarm.hivemind_ext.matchmaking import ThrottledLeaderSearch

    class Averager(MovingGroupKeys, ThrottledLeaderSearch, DecentralizedAverager):
        pass

    # 16 bits: it may move several times during the round, and comes back here with odds below 1e-3
    initial = "0" * 15 + "1"
    averager = Averager([torch.zeros(4)], dht=dht, prefix="lonely", initial_group_bits=initial, target_group_size=2,
                        min_matchmaking_time=0.5, request_timeout=0.25, start=True)
    try:
        assert averager.get_group_bits() == initial
        with pytest.raises(Exception, match="could not find a group"):
            averager.step(timeout=5)  # declarations last 0.5 s: the first ends with nobody found, and it moves
        bits = averager.get_group_bits()
        assert bits != initial and len(bits) == 16
    finally:
        averager.shutdown()


def test_a_client_mode_averager_that_found_no_leader_moves_to_another_key(dht):
    """A client-mode peer declares itself nowhere, so hivemind never moves it: under a key without a reachable peer
    it would fail every round. After a search that found no group it looks under another key."""
    import torch
    from hivemind.averaging import DecentralizedAverager

    from lightning_swarm.hivemind_ext.group_keys import MovingGroupKeys
    from lightning_swarm.hivemind_ext.matchmaking import ThrottledLeaderSearch

    class Averager(MovingGroupKeys, ThrottledLeaderSearch, DecentralizedAverager):
        pass

    class Plain(ThrottledLeaderSearch, DecentralizedAverager):
        pass

    initial = "0" * 15 + "1"
    moving, plain = (klass([torch.zeros(4)], dht=dht, prefix=f"client_{klass.__name__}", initial_group_bits=initial,
                           target_group_size=2, min_matchmaking_time=0.5, request_timeout=0.25, client_mode=True,
                           start=True) for klass in (Averager, Plain))
    try:
        steps = [averager.step(timeout=2, wait=False) for averager in (moving, plain)]  # both at once
        for step in steps:
            with pytest.raises(Exception, match="could not find a group"):
                step.result()
        assert plain.get_group_bits() == initial  # hivemind's: stays under a key nobody leads
        bits = moving.get_group_bits()
        assert bits != initial and len(bits) == 16
    finally:
        moving.shutdown()
        plain.shutdown()
