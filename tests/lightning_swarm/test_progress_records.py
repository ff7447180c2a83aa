"""Progress records from the DHT: malformed ones are ignored for their sender alone, logged once (issue 24, item 1).

The tracker test uses a real DHT and a real ThrottledProgressTracker, and hands its parser the dict the DHT returns
for the progress key (hivemind's ``_parse_swarm_progress_data``: what the tracker's fetch loop calls)."""

from __future__ import annotations

import logging

import hivemind
import pytest
from hivemind.p2p import PeerID
from hivemind.utils import get_dht_time
from hivemind.utils.timed_storage import ValueWithExpiration

from lightning_swarm.hivemind_ext.progress_records import check_progress_record, well_formed_records
from lightning_swarm.hivemind_ext.tracker import ThrottledProgressTracker
from lightning_swarm.hivemind_ext.weight_bounds import progress_weight_bounds
from lightning_swarm.hivemind_ext.lifetime import SwarmDHT


def record(peer: bytes, **changes) -> dict:
    value = dict(peer_id=PeerID(peer).to_bytes(), epoch=3, samples_accumulated=40, samples_per_second=10.0,
                 time=get_dht_time() - 1.0, client_mode=False)
    value.update(changes)
    return value


MALFORMED = {
    "infinite rate": dict(samples_per_second=float("inf")),
    "huge rate": dict(samples_per_second=1e308),
    "NaN time": dict(time=float("nan")),
    "future time": dict(time=get_dht_time() + 3600),
    "huge epoch": dict(epoch=2**60),
    "huge samples": dict(samples_accumulated=2**60),
    "negative samples": dict(samples_accumulated=-1),
    "string epoch": dict(epoch="3"),
    "float samples": dict(samples_accumulated=4.5),
}


@pytest.mark.parametrize("case", sorted(MALFORMED))
def test_a_malformed_record_is_refused_with_its_reason(case):
    with pytest.raises(ValueError):
        check_progress_record(record(b"\x00\x01x", **MALFORMED[case]), get_dht_time())


def test_well_formed_records_pass_unchanged():
    value = record(b"\x00\x01a")
    assert check_progress_record(value, get_dht_time()).samples_accumulated == 40
    # an idle peer's record is re-published with its old time: still well-formed
    assert check_progress_record(record(b"\x00\x01a", time=get_dht_time() - 86400), get_dht_time()).epoch == 3


@pytest.mark.timeout(120)
def test_tracker_ignores_malformed_records_and_counts_the_honest_ones(caplog):
    dht = SwarmDHT(start=True, host_maddrs=["/ip4/127.0.0.1/tcp/0"])
    try:
        tracker = ThrottledProgressTracker(dht, "records_test", target_batch_size=1000, start=False)
        expiration = get_dht_time() + 60
        honest = {b"honest%d" % i: ValueWithExpiration(record(b"\x00\x02h%d" % i), expiration) for i in range(2)}
        attackers = {case.encode(): ValueWithExpiration(record(b"\x00\x02" + case[:6].encode(), **changes), expiration)
                     for case, changes in MALFORMED.items()}
        attackers[b"not a dict"] = ValueWithExpiration([1, 2, 3], expiration)
        attackers[b"not a DHT value"] = record(b"\x00\x02raw")
        with caplog.at_level(logging.WARNING):
            clean = tracker._parse_swarm_progress_data(dict(honest))
            attacked = tracker._parse_swarm_progress_data({**honest, **attackers})
            logged_once = caplog.text.count("ignored the progress record")
            tracker._parse_swarm_progress_data({**honest, **attackers})  # the next fetch: not logged again
        assert (attacked.num_peers, attacked.samples_accumulated, attacked.epoch) == (2, 80, 3)
        assert (clean.num_peers, clean.samples_accumulated, clean.epoch) == (2, 80, 3)
        assert abs(attacked.eta_next_epoch - clean.eta_next_epoch) < 1.0  # the infinite rate did not end the epoch
        assert logged_once == len(attackers)
        assert caplog.text.count("ignored the progress record") == logged_once
        assert str(PeerID(b"\x00\x02huge r")) in caplog.text  # named by the peer id it claims
        # the weight bounds of the averaging round read the same records
        bounds = progress_weight_bounds({**honest, **attackers})
        assert set(bounds) == {PeerID(b"\x00\x02h0"), PeerID(b"\x00\x02h1")} and set(bounds.values()) == {40.0}
    finally:
        dht.shutdown()


def test_well_formed_records_keeps_own_and_departed_entries():
    expiration = get_dht_time() + 60
    metadata = {b"own": ValueWithExpiration({"anything": 1}, expiration), b"left": ValueWithExpiration(None, expiration)}
    assert well_formed_records(metadata, get_dht_time(), keep=b"own") == metadata
    assert well_formed_records("not a dict", get_dht_time()) == {}
