"""Overlapping rounds: a part waits for its group (real DHT and averager processes); the overlap options switch off
in a swarm larger than overlap_max_peers (a real SwarmOptimizer)."""

from __future__ import annotations

import logging
import time

import pytest
import torch
from hivemind.averaging import DecentralizedAverager

from lightning_swarm.hivemind_ext.lifetime import SwarmDHT
from lightning_swarm.hivemind_ext.optimizer import (
    HivemindRpcNames, SwarmGradientAverager, SwarmOptimizer, SwarmStateAverager, check_overlap_max_peers,
)
from lightning_swarm.hivemind_ext.round_groups import PatientGroupRegistration

LOCAL = ["/ip4/127.0.0.1/tcp/0"]


class RoundAverager(HivemindRpcNames, PatientGroupRegistration, DecentralizedAverager):
    """hivemind's averager with the mixin, as SwarmGradientAverager and SwarmStateAverager have it."""


def test_swarm_averagers_wait_for_registration():
    for averager in (SwarmGradientAverager, SwarmStateAverager):
        assert issubclass(averager, PatientGroupRegistration)


@pytest.fixture
def dhts():
    first = SwarmDHT(start=True, host_maddrs=LOCAL)
    nodes = [first, SwarmDHT(start=True, host_maddrs=LOCAL, initial_peers=first.get_visible_maddrs())]
    yield nodes
    for node in nodes:
        node.shutdown()


@pytest.mark.slow
def test_a_part_sent_before_its_group_is_registered_waits_for_it(dhts):
    """Two peers, two overlapping rounds, as with the overlap options: round 2 is matched while round 1 runs, then
    round 2 is triggered on the first peer 1.5 s before the second. The first peer's part reaches the second
    before it registered round 2's group; hivemind answers BAD_GROUP_ID at once (round 1
    left the registration event set), and both peers end with a partial average after next_chunk_timeout. Here
    the part waits: both get the mean. (Without the fix this fails only when round 2 was matched before round 1
    ended, about every other run here; with it, it passes either way.)"""
    averagers = [RoundAverager([torch.full((1000,), value)], dht=dht, prefix="rounds", start=True,
                               min_matchmaking_time=3.0, request_timeout=2.0, next_chunk_timeout=8.0)
                 for dht, value in zip(dhts, [1.0, 3.0])]
    try:
        first_rounds = [averager.step(gather=1, timeout=50.0, wait=False) for averager in averagers]
        second_rounds = [averager.step(gather=2, timeout=50.0, require_trigger=True, wait=False)
                         for averager in averagers]
        for control in first_rounds:  # round 1 ends while round 2 is matched: it leaves the event set
            assert len(control.result(timeout=50)) == 2
        deadline = time.monotonic() + 45
        while not all(control.stage.name == "AWAITING_TRIGGER" for control in second_rounds):
            assert time.monotonic() < deadline, [control.stage.name for control in second_rounds]
            time.sleep(0.05)
        for averager in averagers:  # round 1 averaged 1 and 3 into 2: start round 2 from 1 and 3 again
            with averager.get_tensors() as (tensor,):
                tensor.fill_(1.0 if averager is averagers[0] else 3.0)
        second_rounds[0].allow_allreduce()
        time.sleep(1.5)  # the first peer's part is on its way; the second peer has not registered the group
        second_rounds[1].allow_allreduce()
        for control in second_rounds:
            assert len(control.result(timeout=30)) == 2
        for averager in averagers:
            with averager.get_tensors() as (tensor,):
                assert torch.allclose(tensor, torch.full_like(tensor, 2.0)), "a partial average"
    finally:
        for averager in averagers:
            averager.shutdown()


def test_overlap_max_peers_is_checked():
    assert check_overlap_max_peers(None) is None and check_overlap_max_peers(2) == 2
    for bad in (0, -1, 2.5, True, "2"):
        with pytest.raises(ValueError, match="overlap_max_peers"):
            check_overlap_max_peers(bad)


def test_overlap_options_follow_the_swarm_size(caplog):
    """Alone (1 peer) with overlap_max_peers=1, the overlap options stay on. Once the swarm is larger than the limit
    (here: the limit lowered to 0) they are off, training goes on synchronously and the log says why; they come
    back when the swarm fits the limit again."""
    dht = SwarmDHT(start=True, host_maddrs=LOCAL)
    model = torch.nn.Linear(8, 1)
    optimizer = SwarmOptimizer(
        dht=dht, run_id="overlap_switch", target_batch_size=32, batch_size_per_step=16,
        optimizer=lambda params: torch.optim.SGD(params, lr=0.1), params=model.parameters(), matchmaking_time=1.0,
        averaging_timeout=5.0, delay_optimizer_step=True, delay_grad_averaging=True, delay_state_averaging=True,
        offload_optimizer=True, overlap_max_peers=1, verbose=False,
    )

    def train(steps: int) -> None:
        for _ in range(steps):
            model(torch.randn(16, 8)).pow(2).mean().backward()
            optimizer.step()
            optimizer.zero_grad()

    try:
        train(4)
        assert optimizer.overlapping and optimizer.delay_grad_averaging
        optimizer.overlap_max_peers = 0  # the swarm (1 peer) is now larger than the limit
        with caplog.at_level(logging.WARNING, logger="lightning_swarm.hivemind_ext.optimizer"):
            train(4)
        assert not optimizer.overlapping
        assert not (optimizer.delay_optimizer_step or optimizer.delay_grad_averaging or optimizer.delay_state_averaging)
        assert "averaging synchronously" in caplog.text and "overlap_max_peers=0" in caplog.text
        epoch = optimizer.local_epoch
        optimizer.overlap_max_peers = 1
        train(4)
        assert optimizer.overlapping and optimizer.delay_optimizer_step and optimizer.delay_state_averaging
        assert optimizer.local_epoch >= epoch + 1  # trained on through both switches
    finally:
        optimizer.shutdown()
        dht.shutdown()


def test_delay_state_averaging_alone_is_left_as_it_is():
    """hivemind's default (state averaged in the background, gradients not) is not switched, whatever the size."""
    dht = SwarmDHT(start=True, host_maddrs=LOCAL)
    model = torch.nn.Linear(8, 1)
    optimizer = SwarmOptimizer(
        dht=dht, run_id="state_delay_only", target_batch_size=32, batch_size_per_step=16,
        optimizer=lambda params: torch.optim.SGD(params, lr=0.1), params=model.parameters(), matchmaking_time=1.0,
        averaging_timeout=5.0, delay_state_averaging=True, overlap_max_peers=1, verbose=False,
    )
    try:
        optimizer.overlap_max_peers = 0  # the swarm (1 peer) is larger than the limit
        for _ in range(4):
            model(torch.randn(16, 8)).pow(2).mean().backward()
            optimizer.step()
            optimizer.zero_grad()
        assert optimizer.local_epoch == 2
        assert optimizer.overlapping and optimizer.delay_state_averaging
    finally:
        optimizer.shutdown()
        dht.shutdown()


@pytest.mark.slow
def test_a_peer_that_leaves_its_group_at_the_all_reduce_costs_the_others_no_timeout():
    """A peer that finds a member it keeps out in its group leaves at the all-reduce. Its groupmates used to wait
    next_chunk_timeout for its parts and its results (its reducer's handler waited for the leaver's next group,
    hivemind's registration event being cleared by its next search): 10 s of a 1.3 s epoch in the NaN swarm test,
    which put one honest peer's rounds out of step with the other's. The leaver now tells its groupmates' reducers
    at once, and refuses parts for the round it left: the others end the round within a second or two. Its own
    round fails at once, not retried."""
    from hivemind.p2p import PeerID

    from lightning_swarm.hivemind_ext.robust_allreduce import RobustAveraging

    class LeavingAverager(HivemindRpcNames, PatientGroupRegistration, RobustAveraging, DecentralizedAverager):
        """hivemind's averager with the robust all-reduce (which leaves groups with kept-out members)."""

    next_chunk_timeout = 10.0
    first = SwarmDHT(start=True, host_maddrs=LOCAL)
    dhts = [first] + [SwarmDHT(start=True, host_maddrs=LOCAL, initial_peers=first.get_visible_maddrs())
                      for _ in range(2)]
    averagers = []
    try:
        averagers = [LeavingAverager([torch.full((3000,), float(value))], dht=dht, prefix="leaving", start=True,
                                     target_group_size=3, min_matchmaking_time=3.0, request_timeout=1.0,
                                     next_chunk_timeout=next_chunk_timeout)
                     for value, dht in enumerate(dhts)]
        # the leaver's round allows retries: it is not retried all the same (it would meet its groupmates' next
        # round, one round out of step with them) and fails at once, not at its 60 s deadline
        controls = [averager.step(timeout=60.0, require_trigger=True, allow_retries=index == 0, wait=False)
                    for index, averager in enumerate(averagers)]
        deadline = time.monotonic() + 45
        while not all(control.stage.name == "AWAITING_TRIGGER" for control in controls):
            assert time.monotonic() < deadline, [control.stage.name for control in controls]
            assert not any(control.done() for control in controls), "a peer found no group: the three did not meet"
            time.sleep(0.05)
        # the group of three is formed; only now does the first peer keep the third out (it leaves at the all-reduce)
        averagers[0].exclude_peer(PeerID.from_base58(str(dhts[2].peer_id)), "a test")
        started = time.monotonic()
        for control in controls:
            control.allow_allreduce()
        with pytest.raises(Exception, match="kept out"):
            controls[0].result(timeout=10)
        for control in controls[1:]:
            assert len(control.result(timeout=30)) == 3  # the round of the three, without the leaver's parts
        took = time.monotonic() - started
        assert took < next_chunk_timeout / 2, f"the others waited {took:.1f} s for the peer that left"
        with averagers[0].get_tensors() as (tensor,):
            assert torch.all(tensor == 0.0), "the leaver applied something of the round it left"
    finally:
        for averager in averagers:
            averager.shutdown()
        for dht in dhts:
            dht.shutdown()
