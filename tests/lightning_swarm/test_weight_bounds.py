"""Gradient weights bounded by the progress records (lightning_swarm/hivemind_ext/weight_bounds.py): in a round matched
per epoch the bound is the sender's count of the round's epoch, not of the epoch it has moved on to."""

from __future__ import annotations

import time

import hivemind
import torch
from hivemind.p2p import PeerID
from hivemind.utils import get_dht_time
from hivemind.utils.timed_storage import ValueWithExpiration

from lightning_swarm.hivemind_ext.epoch_rounds import RoundEpochs, RoundEpochSender
from lightning_swarm.hivemind_ext.group_keys import MovingGroupKeys
from lightning_swarm.hivemind_ext.optimizer import HivemindRpcNames
from lightning_swarm.hivemind_ext.weight_bounds import ProgressBoundedWeights, note_counts, progress_weight_bounds

LOCAL = ["/ip4/127.0.0.1/tcp/0"]
PROGRESS_KEY = "bounds_progress"
POLL = 0.3


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


class BoundedEpochAverager(HivemindRpcNames, RoundEpochs, MovingGroupKeys, ProgressBoundedWeights, RoundEpochSender):
    """hivemind's averager with rounds matched per epoch and weights bounded by the progress records."""


def test_an_overlapped_round_weighs_senders_by_their_samples_after_they_moved_on_to_the_next_epoch():
    """Two real averagers in a round of 3000 and 300 samples of epoch 5 (the round leads to epoch 6), tensors 1 and
    12: the sample-weighted mean is 2. While they wait for the trigger the records say epoch 5; then both move on, as
    overlapped peers do at the epoch's end before the round reads the bounds: the fast one already counts 300 samples
    of epoch 6, the slow one 0. Bounded by those, the weights were 300 and 300 (the mean 6.5); bounded by the counts
    of epoch 5 read while the round waited, the mean is 2."""
    first = hivemind.DHT(start=True, host_maddrs=LOCAL)
    dhts = [first, hivemind.DHT(start=True, host_maddrs=LOCAL, initial_peers=first.get_visible_maddrs())]
    averagers = [BoundedEpochAverager([torch.full((1000,), value)], dht=dht, prefix="bounds_grad_averager",
                                      progress_key=PROGRESS_KEY, record_poll_interval=POLL, start=True,
                                      min_matchmaking_time=2.0, request_timeout=1.0, next_chunk_timeout=5.0)
                 for dht, value in zip(dhts, [1.0, 12.0])]
    try:
        def publish(epoch: int, counts: list) -> None:
            for averager, count in zip(averagers, counts):
                assert first.store(PROGRESS_KEY, subkey=averager.peer_id.to_bytes(),
                                   value=record(averager.peer_id, epoch, count, at=get_dht_time()),
                                   expiration_time=get_dht_time() + 60)

        publish(5, [3000, 300])
        for averager in averagers:
            averager.round_epoch = lambda: 6  # the epoch the round leads to
            averager.epoch_keys = lambda: True
        rounds = [averager.step(weight=weight, timeout=30.0, require_trigger=True, wait=False)
                  for averager, weight in zip(averagers, [3000.0, 300.0])]
        time.sleep(4 * POLL)  # the watchers read epoch 5's records
        publish(6, [300, 0])
        time.sleep(2 * POLL)
        for control in rounds:
            control.allow_allreduce()
        for control in rounds:
            assert len(control.result(timeout=30)) == 2
        for averager in averagers:
            with averager.get_tensors() as (tensor,):
                assert torch.allclose(tensor, torch.full_like(tensor, 2.0)), float(tensor.mean())
    finally:
        for averager in averagers:
            averager.shutdown()
        for dht in dhts:
            dht.shutdown()
