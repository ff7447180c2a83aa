"""Rounds matched per epoch (real DHT and averager processes)."""

from __future__ import annotations

import time

import hivemind
import pytest
import torch

from lightning_swarm.hivemind_ext.epoch_rounds import (
    EpochGroupKeyManager, RoundEpochs, RoundEpochSender, epoch_group_prefix,
)
from lightning_swarm.hivemind_ext.group_keys import MovingGroupKeys
from lightning_swarm.hivemind_ext.optimizer import HivemindRpcNames, SwarmGradientAverager, SwarmStateAverager

LOCAL = ["/ip4/127.0.0.1/tcp/0"]
MATCHMAKING_TIME = 2.0


class EpochAverager(HivemindRpcNames, RoundEpochs, MovingGroupKeys, RoundEpochSender):
    """hivemind's averager with the epoch mixins, as SwarmGradientAverager and SwarmStateAverager have them."""


def test_swarm_averagers_match_rounds_per_epoch():
    for averager in (SwarmGradientAverager, SwarmStateAverager):
        mro = averager.__mro__
        assert issubclass(averager, RoundEpochs) and issubclass(averager, RoundEpochSender)
        # the epoch is read before AuthenticatedAveraging's _step awaits; hivemind's schedule_step / _do reach
        # DecentralizedAverager.step through RoundEpochSender
        assert mro.index(RoundEpochs) < min(i for i, k in enumerate(mro) if "_step" in k.__dict__ and k is not RoundEpochs)
        hivemind_class = next(k for k in mro if k.__module__.startswith("hivemind.optim"))
        assert mro.index(hivemind_class) < mro.index(RoundEpochSender) < mro.index(hivemind.DecentralizedAverager)
        assert averager.group_key_manager_class is EpochGroupKeyManager


def test_epoch_group_prefix():
    assert epoch_group_prefix("run_grad_averager", None) == "run_grad_averager"
    assert epoch_group_prefix("run_grad_averager", 12) == "run_grad_averager_e12"
    assert hivemind.averaging.key_manager.is_valid_group(epoch_group_prefix("run_state_averager", 3) + ".0b01")


@pytest.fixture
def averagers():
    first = hivemind.DHT(start=True, host_maddrs=LOCAL)
    dhts = [first, hivemind.DHT(start=True, host_maddrs=LOCAL, initial_peers=first.get_visible_maddrs())]
    made = [EpochAverager([torch.full((1000,), value)], dht=dht, prefix="epochs", start=True,
                          min_matchmaking_time=MATCHMAKING_TIME, request_timeout=1.0, next_chunk_timeout=5.0)
            for dht, value in zip(dhts, [1.0, 3.0])]
    yield made
    for averager in made:
        averager.shutdown()
    for dht in dhts:
        dht.shutdown()


# a round that finds no group fails at its own timeout (its search is not cut short)
LONE_TIMEOUT = 3 * MATCHMAKING_TIME


@pytest.mark.slow
def test_rounds_of_different_epochs_never_share_a_group(averagers):
    """Two peers start rounds at once, one for epoch 5, one for epoch 6, both triggered at once: under hivemind's one
    key they would average together (1 and 3 into 2). Here neither finds a group: each fails at its timeout with its
    tensors untouched. Then both start a round of epoch 7: it averages."""
    rounds = [averager.step(gather=epoch, timeout=LONE_TIMEOUT, wait=False) for averager, epoch in zip(averagers, [5, 6])]
    for control in rounds:
        with pytest.raises(BaseException):  # no group by its timeout
            control.result(timeout=LONE_TIMEOUT + 20)
    for averager, value in zip(averagers, [1.0, 3.0]):
        with averager.get_tensors() as (tensor,):
            assert torch.equal(tensor, torch.full_like(tensor, value)), "rounds of different epochs averaged"

    rounds = [averager.step(gather=7, timeout=30.0, wait=False) for averager in averagers]
    for control in rounds:
        assert len(control.result(timeout=30)) == 2
    for averager in averagers:
        with averager.get_tensors() as (tensor,):
            assert torch.allclose(tensor, torch.full_like(tensor, 2.0))


@pytest.mark.slow
def test_a_next_epoch_round_cannot_take_a_seat_in_the_current_epochs_group(averagers):
    """Mechanism 2 of docs/swarm-at-scale.md. The first peer's round of epoch 3 searches alone (its groupmates are
    gone) and holds its matchmaking; its round of epoch 4 is queued behind it. The second peer's round of epoch 4
    searches meanwhile. Under hivemind's one key it takes a seat in the first peer's epoch-3 round (they average 1
    and 3 into 2 as "epoch 3"), and the first peer's epoch-4 round then searches alone until its timeout. Here the
    epoch-3 round finds nobody and fails at its timeout; the two epoch-4 rounds then group together."""
    first, second = averagers
    lonely = first.step(gather=3, timeout=LONE_TIMEOUT, require_trigger=True, wait=False)
    time.sleep(0.5)  # the epoch-3 round holds the first peer's matchmaking
    queued = first.step(gather=4, timeout=40.0, require_trigger=True, wait=False)
    partner = second.step(gather=4, timeout=40.0, require_trigger=True, wait=False)
    lonely.allow_allreduce()  # triggered without a group
    with pytest.raises(BaseException):
        lonely.result(timeout=LONE_TIMEOUT + 20)
    queued.allow_allreduce()
    partner.allow_allreduce()
    assert len(partner.result(timeout=30)) == 2 and len(queued.result(timeout=30)) == 2
    for averager in averagers:
        with averager.get_tensors() as (tensor,):
            assert torch.allclose(tensor, torch.full_like(tensor, 2.0))
