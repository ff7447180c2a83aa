"""Gradient weights bounded by the progress records (lightning_swarm/hivemind_ext/weight_bounds.py): in a round matched
per epoch the bound is the sender's count of the round's epoch (as the trainer's tracker read it), not of the epoch it
has moved on to."""

from __future__ import annotations

import hivemind
import pytest
import torch
from hivemind.optim.grad_averager import GradientAverager
from hivemind.p2p import PeerID
from hivemind.utils import get_dht_time
from hivemind.utils.timed_storage import ValueWithExpiration

from lightning_swarm.hivemind_ext.epoch_rounds import RoundEpochs, RoundEpochSender
from lightning_swarm.hivemind_ext.group_keys import MovingGroupKeys
from lightning_swarm.hivemind_ext.optimizer import HivemindRpcNames
from lightning_swarm.hivemind_ext.progress_records import note_counts
from lightning_swarm.hivemind_ext.tracker import ThrottledProgressTracker
from lightning_swarm.hivemind_ext.weight_bounds import ProgressBoundedWeights, progress_weight_bounds

LOCAL = ["/ip4/127.0.0.1/tcp/0"]
PROGRESS_KEY = "bounds_progress"


def record(peer: PeerID, epoch: int, samples: int, at: float = 100.0) -> dict:
    return dict(peer_id=peer.to_bytes(), epoch=epoch, samples_accumulated=samples, samples_per_second=10.0,
                time=at, client_mode=False)


A, B, C = PeerID(b"\x00\x01a"), PeerID(b"\x00\x01b"), PeerID(b"\x00\x01c")


def test_a_round_of_an_epoch_bounds_each_sender_by_its_count_of_that_epoch():
    earlier = {b"a": ValueWithExpiration(record(A, 5, 2800), 200.0),
               b"b": ValueWithExpiration(record(B, 5, 280), 200.0),
               b"junk": ValueWithExpiration("not a record", 200.0)}
    seen = {}
    note_counts(seen, earlier)
    note_counts(seen, {b"a": ValueWithExpiration(record(A, 5, 3000), 200.0),
                       b"a_low": ValueWithExpiration(record(A, 5, 10), 200.0)})
    assert seen == {(A, 5): 3000.0, (B, 5): 280.0}
    # A and C moved on to epoch 6 (C was never seen at 5); B is still at 5 with more samples; a stale record of 4
    latest = {b"a": ValueWithExpiration(record(A, 6, 300), 200.0), b"b": ValueWithExpiration(record(B, 5, 300), 200.0),
              b"c": ValueWithExpiration(record(C, 6, 9999), 200.0)}
    assert progress_weight_bounds(latest, epoch=5, seen=seen) == {A: 3000.0, B: 300.0, C: 0.0}
    # a synchronous round (no epoch) reads the latest records as they are
    assert progress_weight_bounds(latest) == {A: 300.0, B: 300.0, C: 9999.0}
    # a sender behind the round's epoch is bounded by what its record says
    assert progress_weight_bounds({b"a": ValueWithExpiration(record(A, 4, 70), 200.0)}, epoch=5, seen=seen) == {A: 70.0}


class BoundedEpochGradientAverager(HivemindRpcNames, RoundEpochs, MovingGroupKeys, ProgressBoundedWeights,
                                   GradientAverager, RoundEpochSender):
    """hivemind's gradient averager with rounds matched per epoch and weights bounded by the progress records, in
    SwarmGradientAverager's order (the trigger, ``step(control=...)``, goes through ProgressBoundedWeights)."""


def overlapped_round(counted: tuple) -> float:
    """Two real gradient averagers in a round of 3000 and 300 samples of epoch 5 (the round leads to epoch 6),
    gradients 1 and 12: the sample-weighted mean is 2. While the round waits for its trigger the records say epoch 5;
    then the fast peer moves on, as overlapped peers do at the epoch's end before the round reads the bounds: it
    already counts 300 samples of epoch 6. Returns the mean gradient the round gives."""
    first = hivemind.DHT(start=True, host_maddrs=LOCAL)
    dhts = [first, hivemind.DHT(start=True, host_maddrs=LOCAL, initial_peers=first.get_visible_maddrs())]
    averagers, tracker_counts = [], {}
    for dht, value, samples in zip(dhts, [1.0, 12.0], [3000, 300]):
        parameter = torch.nn.Parameter(torch.zeros(1000))
        parameter.grad = torch.full_like(parameter, value)
        averager = BoundedEpochGradientAverager([parameter], dht=dht, prefix="bounds_grad_averager",
                                                progress_key=PROGRESS_KEY, start=True, min_matchmaking_time=2.0,
                                                request_timeout=1.0, next_chunk_timeout=5.0)
        averager.accumulate_grads_(batch_size=samples)
        averager.round_epoch = lambda: 6  # the epoch the round leads to
        averager.epoch_keys = lambda: True
        # what each trainer's tracker read of epoch 5 before the peers moved on (ThrottledProgressTracker.epoch_counts)
        averager.round_counts = (lambda epoch: tracker_counts[epoch]) if counted else None
        if len(averagers) in counted:
            tracker_counts.setdefault(5, {})[averager.peer_id.to_bytes()] = float(samples)
        averagers.append(averager)
    try:
        def publish(epoch: int, counts: list) -> None:
            for averager, count in zip(averagers, counts):
                assert first.store(PROGRESS_KEY, subkey=averager.peer_id.to_bytes(),
                                   value=record(averager.peer_id, epoch, count, at=get_dht_time()),
                                   expiration_time=get_dht_time() + 60)

        publish(5, [3000, 300])
        rounds = [averager.schedule_step(timeout=30.0) for averager in averagers]
        assert first.store(PROGRESS_KEY, subkey=averagers[0].peer_id.to_bytes(), expiration_time=get_dht_time() + 60,
                           value=record(averagers[0].peer_id, 6, 300, at=get_dht_time()))
        for averager, control in zip(averagers, rounds):
            averager.step(control=control, wait=False)  # hivemind.Optimizer's trigger at the epoch's end
        for control in rounds:
            assert len(control.result(timeout=30)) == 2
        means = []
        for averager in averagers:
            with averager.get_tensors() as (tensor,):
                means.append(float(tensor.mean()))
        assert means[0] == pytest.approx(means[1])
        return means[0]
    finally:
        for averager in averagers:
            averager.shutdown()
        for dht in dhts:
            dht.shutdown()


def test_an_overlapped_round_weighs_senders_by_their_counts_of_its_epoch_from_the_trainers_tracker():
    """With the counts each trainer's tracker read of epoch 5, handed over at the trigger, the mean is 2 (the
    weights 3000 and 300)."""
    assert overlapped_round(counted=(0, 1)) == pytest.approx(2.0)


def test_counts_that_miss_a_sender_are_merged_with_the_latest_records():
    """The trainer's tracker saw only the fast peer's count of epoch 5 (say the slow one's first record came after its
    last read): the round reads the records too, and bounds the slow one by its record of epoch 5 (300), not by the
    group's largest bound (3000, the mean would be 6.5)."""
    assert overlapped_round(counted=(0,)) == pytest.approx(2.0)


def test_without_the_trackers_counts_an_overlapped_round_bounds_by_the_latest_records():
    """The counts never come (a trainer without a tracker that keeps them): after ``round_counts_timeout`` the round
    reads the latest records, where the fast peer's count of epoch 5 is gone and the slow one's says 300: the fast
    one gets the group's largest bound, 300, as a sender without a record, and the mean is 6.5 (what every other
    overlapped round of 2 peers did before the bounds were read per epoch). The round completes."""
    assert overlapped_round(counted=()) == pytest.approx(6.5)


def test_the_tracker_keeps_each_peers_largest_count_of_an_epoch_after_the_peer_moved_on():
    """ThrottledProgressTracker.epoch_counts: what an overlapped round's bounds come from. Three fetches of the swarm's
    records (as the tracker's fetcher parses them; the DHT's own validators would refuse these unsigned test records)
    while two peers move from epoch 5 to 6; a malformed record is skipped."""
    dht = hivemind.DHT(start=True, host_maddrs=LOCAL)
    tracker = ThrottledProgressTracker(dht, "counts_run", target_batch_size=10**6, start=False)
    try:
        def fetched(epoch: int, counts: dict, **extra) -> None:
            records = {peer.to_bytes(): ValueWithExpiration(record(peer, epoch, count, at=get_dht_time()),
                                                            get_dht_time() + 60) for peer, count in counts.items()}
            tracker._parse_swarm_progress_data({**records, **extra})

        fetched(5, {A: 2800, B: 280}, junk=ValueWithExpiration({"epoch": "five"}, get_dht_time() + 60))
        fetched(5, {A: 3000})
        fetched(6, {A: 300, B: 20})
        assert tracker.epoch_counts(5) == {A.to_bytes(): 3000.0, B.to_bytes(): 280.0}
        assert tracker.epoch_counts(6) == {A.to_bytes(): 300.0, B.to_bytes(): 20.0}
        # this peer's own count comes from its live progress, not from its record
        tracker.report_local_progress(local_epoch=0, samples_accumulated=7)
        fetched(6, {A: 300})
        assert tracker.epoch_counts(0) == {tracker.local_progress.peer_id: 7.0}
        # ... up to its latest report, before any fetch read it (the step that ends the epoch triggers the round)
        tracker.report_local_progress(local_epoch=0, samples_accumulated=9)
        assert tracker.epoch_counts(0) == {tracker.local_progress.peer_id: 9.0}
    finally:
        tracker.shutdown(timeout=5)
        dht.shutdown()
