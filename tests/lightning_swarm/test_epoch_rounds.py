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
from lightning_swarm.hivemind_ext.lifetime import SwarmDHT
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
    first = SwarmDHT(start=True, host_maddrs=LOCAL)
    dhts = [first, SwarmDHT(start=True, host_maddrs=LOCAL, initial_peers=first.get_visible_maddrs())]
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
    """Mechanism 2 of docs/notes/swarm-at-scale-measurements.md. The first peer's round of epoch 3 searches alone
    (its groupmates are gone) and holds its matchmaking; its round of epoch 4 is queued behind it. The second peer's
    round of epoch 4 searches meanwhile. Under hivemind's one key it takes a seat in the first peer's epoch-3 round
    (they average 1 and 3 into 2 as "epoch 3"), and the first peer's epoch-4 round then searches alone until its
    timeout. Here the epoch-3 round finds nobody and fails at its timeout; the two epoch-4 rounds then group
    together."""
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


def test_rounds_under_one_key_gather_their_epochs(averagers):
    """Synchronous gradient rounds share one key across epochs (``epoch_keys`` says False), so a peer one epoch behind
    averages with its peers' next round; each round gathers the epoch it leads to, and every member learns its
    groupmates' (SwarmOptimizer._follow_group_epoch then follows a group one epoch ahead)."""
    for averager, epoch in zip(averagers, [5, 6]):
        averager.round_epoch = lambda epoch=epoch: epoch
        averager.epoch_keys = lambda: False
    rounds = [averager.step(timeout=30.0, wait=False) for averager in averagers]
    for averager, control in zip(averagers, rounds):
        assert control.round_epoch is None  # hivemind's one key
        gathered = control.result(timeout=30)
        assert sorted(gathered.values()) == [5, 6] and gathered[averager.peer_id] == [5, 6][averagers.index(averager)]
    for averager in averagers:
        with averager.get_tensors() as (tensor,):
            assert torch.allclose(tensor, torch.full_like(tensor, 2.0))


def test_a_moved_round_averages_with_the_rounds_of_its_new_epoch(averagers):
    """A peer that caught up with the swarm (catch_up) moves its triggered round of epoch 5, still looking for a
    group, to epoch 6: it then averages with the other peer's round of epoch 6 (under epoch 5 it found nobody:
    test_rounds_of_different_epochs_never_share_a_group). A round that found its group, or one already at a later
    epoch, is not moved."""
    first, second = averagers
    behind = first.step(gather=5, timeout=40.0, require_trigger=True, wait=False)
    assert behind.round_epoch == 5
    behind.allow_allreduce()
    time.sleep(MATCHMAKING_TIME)  # looking under epoch 5, alone
    assert not behind.done()
    assert first.move_round(behind, 6) and behind.round_epoch == 6
    assert not first.move_round(behind, 6) and not first.move_round(behind, 4)  # not to its own or an earlier epoch
    swarm = second.step(gather=6, timeout=40.0, require_trigger=True, wait=False)
    swarm.allow_allreduce()
    assert len(behind.result(timeout=30)) == 2 and len(swarm.result(timeout=30)) == 2
    for averager in averagers:
        with averager.get_tensors() as (tensor,):
            assert torch.allclose(tensor, torch.full_like(tensor, 2.0))
    assert not first.move_round(behind, 7)  # done


def test_a_round_of_an_epoch_the_swarm_finished_is_given_up_after_its_grace(averagers):
    """A peer triggers its round of epoch 5 and finds nobody (the other peer is not averaging). While the swarm is at
    epoch 4 or 5 the round keeps looking (peers enter epoch 5 while their delayed rounds of 5 may still look for a
    group); once the swarm is at 6 (its peers averaged epoch 5 without this one), it is given up one grace later:
    its result raises at once instead of at its timeout, its tensors untouched."""
    from concurrent.futures import CancelledError

    from lightning_swarm.hivemind_ext.epoch_rounds import LateRounds

    first, _ = averagers
    swarm = {"epoch": 4}
    late = LateRounds(lambda: swarm["epoch"], grace=1.0, poll_interval=0.1)
    first.on_round = late.watch
    control = first.step(gather=5, timeout=60.0, require_trigger=True, wait=False)
    late.start()
    try:
        control.allow_allreduce()
        time.sleep(MATCHMAKING_TIME)  # triggered and looking, the swarm still at the round's epoch - 1
        assert not control.done() and late.given_up == 0
        swarm["epoch"] = 5
        time.sleep(MATCHMAKING_TIME)  # the swarm in the round's epoch: its peers' rounds may look for a group still
        assert not control.done() and late.given_up == 0
        swarm["epoch"] = 6
        began = time.monotonic()
        with pytest.raises(CancelledError):
            control.result(timeout=30)
        waited = time.monotonic() - began
        assert late.grace <= waited < late.grace + 5, waited
        assert late.given_up == 1
        with first.get_tensors() as (tensor,):
            assert torch.equal(tensor, torch.full_like(tensor, 1.0))
        # (not asserted: that a round started right after the give-up averages. hivemind's averager does not wait
        # for a cancelled search to unwind, and the next round queues behind it: under load, 1 of 4 such rounds
        # failed at its timeout and 1 took 14 s, none without the cancel. A round left to its timeout holds the
        # search longer still.)
    finally:
        late.stop()


def test_late_rounds_leaves_rounds_that_found_a_group_or_wait_for_their_trigger():
    """Only a triggered round still looking for a group is given up: not one waiting for its trigger, not one of an
    unknown epoch, and a bad grace is refused."""
    from hivemind.averaging.control import AveragingStage, StepControl
    from hivemind.utils.mpfuture import MPFuture

    from lightning_swarm.hivemind_ext.epoch_rounds import LateRounds

    with pytest.raises(ValueError, match="grace"):
        LateRounds(lambda: 0, grace=-1.0)
    late = LateRounds(lambda: 10, grace=0.0)
    MPFuture()  # first: a StepControl made first sets hivemind 1.1.12's backend up on its own class, not MPFuture's
    untriggered = StepControl(scheduled_time=0.0, deadline=1e12, allow_retries=True, weight=1.0, data_for_gather=b"")
    untriggered.attach(MPFuture(), MPFuture())
    untriggered.stage = AveragingStage.LOOKING_FOR_GROUP
    late.watch(untriggered, 3)
    late.watch(untriggered, 10)  # the swarm at the round's epoch
    late.watch(untriggered, None)
    for _ in range(3):
        assert late.check() == 0
    assert not untriggered.cancelled()
    untriggered.allow_allreduce()  # triggered, looking, the swarm past its epoch: given up (grace 0)
    assert late.check() == 0 and late.check() == 1 and untriggered.cancelled()
    assert late.check() == 0  # the entry of epoch 10 is done (cancelled) now: dropped
    grouped = StepControl(scheduled_time=0.0, deadline=1e12, allow_retries=True, weight=1.0, data_for_gather=b"")
    grouped.attach(MPFuture(), MPFuture())
    grouped.allow_allreduce()
    grouped.stage = AveragingStage.RUNNING_ALLREDUCE
    late.watch(grouped, 3)
    assert late.check() == 0 and late.check() == 0 and not grouped.cancelled()
    grouped.cancel()


def test_a_round_with_a_search_limit_is_given_up_after_it_whatever_the_swarm_epoch():
    """The optimizer gives state rounds a search limit: a triggered round still looking for a group that long after
    its trigger is given up even though the swarm is still at its epoch (its groupmates are busy elsewhere, e.g. in
    a gradient round that waits for this peer); the clock restarts when the round stops looking, a round without a
    limit is left alone, and a limit <= 0 is refused."""
    from hivemind.averaging.control import AveragingStage, StepControl
    from hivemind.utils.mpfuture import MPFuture

    from lightning_swarm.hivemind_ext.epoch_rounds import LateRounds

    def looking_round():
        MPFuture()  # first: a StepControl made first sets hivemind 1.1.12's backend up on its own class, not MPFuture's
        control = StepControl(scheduled_time=0.0, deadline=1e12, allow_retries=True, weight=1.0, data_for_gather=b"")
        control.attach(MPFuture(), MPFuture())
        control.stage = AveragingStage.LOOKING_FOR_GROUP
        control.allow_allreduce()
        return control

    late = LateRounds(lambda: 5, grace=0.0)
    with pytest.raises(ValueError, match="search_limit"):
        late.watch(looking_round(), 5, search_limit=0.0)
    limited, unlimited = looking_round(), looking_round()
    late.watch(limited, 5, search_limit=0.3)
    late.watch(unlimited, 5)
    assert late.check() == 0  # both looking from now on
    time.sleep(0.2)
    limited.stage = AveragingStage.AWAITING_TRIGGER  # found a group for a moment: its clock restarts
    assert late.check() == 0
    limited.stage = AveragingStage.LOOKING_FOR_GROUP
    assert late.check() == 0
    time.sleep(0.2)
    assert late.check() == 0 and not limited.cancelled()  # 0.2 s of looking since it restarted
    time.sleep(0.15)
    assert late.check() == 1 and limited.cancelled()
    assert not unlimited.cancelled() and late.check() == 0  # the swarm is at its epoch: only the limit applies
