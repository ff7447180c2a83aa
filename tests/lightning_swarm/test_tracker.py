"""ThrottledProgressTracker: exact local bookkeeping, few DHT stores, latest progress still published."""

from __future__ import annotations

import time

import hivemind
import pytest
from hivemind.utils.crypto import RSAPrivateKey

from lightning_swarm.hivemind_ext.tracker import ThrottledProgressTracker
from lightning_swarm.hivemind_ext.lifetime import SwarmDHT


@pytest.fixture(scope="module")
def dht():
    """One DHT node for the module (starting one takes seconds): each test's trackers use a prefix of their own."""
    node = SwarmDHT(start=True, host_maddrs=["/ip4/127.0.0.1/tcp/0"])
    yield node
    node.shutdown()


def _published(tracker: ThrottledProgressTracker):
    """(epoch, samples_accumulated) this peer's record in the DHT holds, or None."""
    found = tracker.dht.get(tracker.training_progress_key, latest=True)
    if found is None:
        return None
    record = found.value[tracker._local_public_key].value
    return record["epoch"], record["samples_accumulated"]


def _wait_for(predicate, timeout: float) -> float:
    start = time.monotonic()
    while time.monotonic() - start < timeout:
        if predicate():
            return time.monotonic() - start
        time.sleep(0.05)
    raise TimeoutError


def _counting_stores(tracker, monkeypatch):
    """Count the tracker's DHT stores (the real store still runs; the shared DHT gets its own back after the test)."""
    calls = []
    real_store = tracker.dht.store

    def store(*args, **kwargs):
        calls.append(kwargs.get("value"))
        return real_store(*args, **kwargs)

    monkeypatch.setattr(tracker.dht, "store", store)
    return calls


def test_reports_are_throttled_but_the_latest_progress_is_published(dht, monkeypatch):
    tracker = ThrottledProgressTracker(dht=dht, prefix="throttle", target_batch_size=10_000,
                                       min_report_interval=0.5, start=True)
    try:
        stores = _counting_stores(tracker, monkeypatch)
        tracker.report_local_progress(0, 8)  # first report after a while: published at once
        for step in range(2, 101):  # 99 more steps in well under one interval
            tracker.report_local_progress(0, 8 * step)
        # local bookkeeping is exact on every call: the epoch must end exactly at target_batch_size
        assert tracker.local_progress.samples_accumulated == 800
        assert tracker.global_progress.samples_accumulated == 800
        _wait_for(lambda: _published(tracker) == (0, 800), timeout=5)
        assert 1 <= len([v for v in stores if v is not None]) <= 3, f"{len(stores)} DHT stores for 100 reports"
    finally:
        tracker.shutdown(timeout=5)


@pytest.mark.parametrize("fetch_period", [4.0, 0.2])
def test_reports_are_spaced_by_half_the_fetch_interval(dht, fetch_period, monkeypatch):
    # far from the end of its epoch, a tracker fetches every max_refresh_period (default_refresh_period before
    # it has a record): its reports follow half of that, never less than min_report_interval
    tracker = ThrottledProgressTracker(dht=dht, prefix=f"spaced_{fetch_period}", target_batch_size=10**9,
                                       min_report_interval=0.1, min_refresh_period=0.1,
                                       default_refresh_period=fetch_period, max_refresh_period=fetch_period, start=True)
    try:
        assert tracker.fetched_global_progress_this_epoch.wait(timeout=10)
        assert tracker.should_report_progress.interval == pytest.approx(max(0.1, fetch_period / 2), abs=0.05)
        stores = _counting_stores(tracker, monkeypatch)
        start = time.monotonic()
        samples = 0
        while time.monotonic() - start < 1.5:  # a local step every 20 ms
            samples += 8
            tracker.report_local_progress(0, samples)
            time.sleep(0.02)
        published = len([v for v in stores if v is not None])
        if fetch_period / 2 > 1.5:
            assert published <= 1, f"{published} DHT stores in 1.5 s at a {fetch_period / 2} s interval"
        else:
            assert 5 <= published <= 16, f"{published} DHT stores in 1.5 s at a 0.1 s interval"
        _wait_for(lambda: _published(tracker) == (0, samples), timeout=fetch_period / 2 + 3)  # the latest arrives
    finally:
        tracker.shutdown(timeout=5)


@pytest.fixture
def stale_tracker(dht, request):
    """A tracker (target 1000) that published 60 samples and has 120, unpublished for the next 30 s."""
    tracker = ThrottledProgressTracker(dht=dht, prefix=f"stale_{request.node.name}", target_batch_size=1000,
                                       min_report_interval=30.0, start=True)
    tracker.report_local_progress(0, 60)
    _wait_for(lambda: _published(tracker) == (0, 60), timeout=5)
    tracker.report_local_progress(0, 120)
    time.sleep(0.5)
    assert _published(tracker) == (0, 60)
    yield tracker
    tracker.shutdown(timeout=5)


def test_a_new_epoch_is_published_at_once(stale_tracker):
    with stale_tracker.pause_updates():
        stale_tracker.update_epoch(1)
    waited = _wait_for(lambda: _published(stale_tracker) == (1, 0), timeout=10)
    assert waited < 10 < 30


def test_the_step_that_ends_the_epoch_is_published_at_once(stale_tracker):
    # the averaging round that follows bounds this peer's gradient weight by its published samples
    assert not stale_tracker.ready_to_update_epoch
    stale_tracker.report_local_progress(0, 1000)
    waited = _wait_for(lambda: _published(stale_tracker) == (0, 1000), timeout=10)
    assert waited < 10 < 30


def test_own_samples_are_counted_live_not_from_the_throttled_record(stale_tracker):
    fetched = stale_tracker.dht.get(stale_tracker.training_progress_key, latest=True).value
    progress = stale_tracker._parse_swarm_progress_data(fetched)  # what the fetcher computes from the DHT
    assert progress.samples_accumulated == 120 and progress.num_peers == 1


def test_negative_interval_is_rejected(dht):
    with pytest.raises(ValueError, match="min_report_interval"):
        ThrottledProgressTracker(dht=dht, prefix="bad", target_batch_size=1, min_report_interval=-1, start=False)


def test_a_peer_counts_itself_before_its_own_record_is_in_the_dht(dht):
    # Peer A has published 4 samples; peer B took its first step (12 samples) but its record is not stored yet.
    # B must see 2 peers and 16 samples: with num_peers=1, hivemind.Optimizer would skip the all-reduce and step
    # on B's gradients alone (the race of issue 16).
    other = SwarmDHT(start=True, host_maddrs=["/ip4/127.0.0.1/tcp/0"],
                         initial_peers=[str(a) for a in dht.get_visible_maddrs()])
    first = ThrottledProgressTracker(dht=dht, prefix="self", target_batch_size=16, start=True)
    # its own key: in one process, both trackers would sign with the same process-wide key (one peer)
    second = ThrottledProgressTracker(dht=other, prefix="self", target_batch_size=16, private_key=RSAPrivateKey(),
                                      start=False)
    try:
        first.report_local_progress(0, 4)
        _wait_for(lambda: _published(first) == (0, 4), timeout=10)
        second.local_progress = second._get_local_progress(local_epoch=0, samples_accumulated=12)
        metadata = other.get(second.training_progress_key, latest=True).value
        assert list(metadata) == [first._local_public_key]  # only A's record is in the DHT
        progress = second._parse_swarm_progress_data(metadata)
        assert (progress.num_peers, progress.samples_accumulated) == (2, 16)
        # a peer that has contributed nothing yet is not counted (as in hivemind, it reports no record either)...
        second.local_progress = second._get_local_progress(local_epoch=0, samples_accumulated=0)
        second.global_progress = second._parse_swarm_progress_data(metadata)
        assert (second.global_progress.num_peers, second.global_progress.samples_accumulated) == (1, 4)
        # ... until its first samples, which must count it before the next fetch: the epoch may end on this step
        second.report_local_progress(0, 12)
        assert (second.global_progress.num_peers, second.global_progress.samples_accumulated) == (2, 16)
        assert second.ready_to_update_epoch
        second.report_local_progress(0, 20)
        assert second.global_progress.num_peers == 2
    finally:
        first.shutdown(timeout=5)
        other.shutdown()


def _estimate_passed(tracker: ThrottledProgressTracker) -> None:
    """What a pause longer than the estimate (a validation, a stalled process) leaves: the estimated end of the
    epoch in the past while the samples are short of target_batch_size."""
    from dataclasses import replace

    from hivemind.utils import get_dht_time

    with tracker.lock_global_progress:
        tracker.global_progress = replace(tracker.global_progress, eta_next_epoch=get_dht_time() - 1.0)


def test_a_lone_peer_ends_its_epoch_exactly_at_target_batch_size(dht):
    # issue 28: hivemind's time estimate made a lone peer step on a single batch after a pause, so a fit's updates
    # depended on the machine's timing
    tracker = ThrottledProgressTracker(dht=dht, prefix="lone", target_batch_size=32, min_report_interval=0.1,
                                       start=True)
    try:
        tracker.report_local_progress(0, 16)
        assert tracker.fetched_global_progress_this_epoch.wait(timeout=10)
        _estimate_passed(tracker)
        assert tracker.global_progress.num_peers <= 1
        assert not tracker.ready_to_update_epoch, "a lone peer ended its epoch on half the target after a pause"
        tracker.report_local_progress(0, 32)
        assert tracker.ready_to_update_epoch
    finally:
        tracker.shutdown(timeout=5)


def test_in_a_swarm_the_estimated_end_still_ends_the_epoch(dht):
    # peers of a swarm keep in step by the estimate: a peer whose partner's samples are late still steps on time
    first = ThrottledProgressTracker(dht=dht, prefix="pair", target_batch_size=1000, min_report_interval=0.1,
                                     min_refresh_period=0.1, default_refresh_period=0.2, max_refresh_period=0.2,
                                     start=True)
    other = SwarmDHT(start=True, host_maddrs=["/ip4/127.0.0.1/tcp/0"],
                         initial_peers=[str(a) for a in dht.get_visible_maddrs()])
    second = ThrottledProgressTracker(dht=other, prefix="pair", target_batch_size=1000, min_report_interval=0.1,
                                      min_refresh_period=0.1, default_refresh_period=0.2, max_refresh_period=0.2,
                                      private_key=RSAPrivateKey(), start=True)
    try:
        first.report_local_progress(0, 16)
        second.report_local_progress(0, 16)
        _wait_for(lambda: first.global_progress.num_peers == 2, timeout=10)
        _estimate_passed(first)
        assert first.global_progress.samples_accumulated < 1000
        assert first.ready_to_update_epoch
    finally:
        first.shutdown(timeout=5)
        second.shutdown(timeout=5)
        other.shutdown()


def test_peek_global_epoch_reads_the_swarm_while_a_global_step_holds_the_tracker(dht):
    """hivemind holds the tracker's lock through a global step (``pause_updates``): its ``global_epoch`` stays as it
    was while the step's rounds run. ``peek_global_epoch`` (LateRounds' view) reads the DHT instead."""
    other = SwarmDHT(start=True, host_maddrs=["/ip4/127.0.0.1/tcp/0"],
                         initial_peers=[str(a) for a in dht.get_visible_maddrs()])
    waiting = ThrottledProgressTracker(dht=dht, prefix="peek", target_batch_size=16, min_report_interval=0.1,
                                       start=True)
    ahead = ThrottledProgressTracker(dht=other, prefix="peek", target_batch_size=16, private_key=RSAPrivateKey(),
                                     min_report_interval=0.1, start=True)
    try:
        waiting.report_local_progress(3, 4)
        ahead.report_local_progress(3, 4)
        _wait_for(lambda: waiting.global_epoch == 3 and waiting.peek_global_epoch() == 3, timeout=10)
        with waiting.pause_updates():  # a global step under way
            ahead.report_local_progress(5, 0)  # the other peer averaged and moved on
            _wait_for(lambda: _published(ahead) == (5, 0), timeout=10)
            time.sleep(2 * waiting.min_refresh_period)
            assert waiting.global_epoch == 3
            assert waiting.peek_global_epoch() == 5
            assert waiting.global_epoch == 3  # peeking changed nothing
    finally:
        ahead.shutdown(timeout=5)
        waiting.shutdown(timeout=5)
        other.shutdown()
