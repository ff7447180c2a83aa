"""The monitor against hostile metrics records: the decoder refuses malformed and implausible records per peer (logged
once), the figures stay finite whatever the records say, /api/state is valid JSON (also after a restart), the
dashboard listens on 127.0.0.1 unless told otherwise, and a fuzzer of the decoder runs in a child process."""

import json
import urllib.request

import pytest
from hivemind.utils import get_dht_time

from fuzz_harnesses import METRIC_RECORDS, harness_output
from lightning_swarm.metrics import LocalMetrics, metrics_key
from lightning_swarm.monitor.aggregate import ContributionTable, RecordScreen, aggregate
from lightning_swarm.monitor.dashboard import DashboardServer, DashboardState
from lightning_swarm.monitor.records import MalformedRecord, MetricsDecoder, decode_metrics_record, fetch_metric_records
from lightning_swarm.hivemind_ext.lifetime import SwarmDHT


def record_dict(loss=1.0, step=3, t=1000.0):
    return dict(step=step, loss=loss, samples_per_second=2.0, samples_accumulated=10, mini_steps=2, time=t, token="")


def strict_json(text):
    """json.loads that refuses NaN/Infinity (what browsers' JSON.parse refuses)."""
    def refuse(constant):
        raise ValueError(f"not JSON: {constant}")
    return json.loads(text, parse_constant=refuse)


def test_records_of_loss_1e308_are_refused_and_cannot_make_the_figures_infinite():
    loud = {f"peer{i}".encode(): LocalMetrics(**record_dict(loss=1e308)) for i in range(4)}
    with pytest.raises(MalformedRecord, match="range:loss"):
        decode_metrics_record(record_dict(loss=1e308))
    screen = RecordScreen(target_batch_size=100)
    assert screen.screen(loud, swarm_epoch=3, now=1000.0) == {} and screen.refused == {"out_of_bounds": 4}
    # aggregated without the screen (the public function), the inputs are clipped: the sums stay finite
    before = sum(r.loss * r.mini_steps for r in loud.values()) / sum(r.mini_steps for r in loud.values())
    assert before == float("inf")  # what the monitor served before
    snapshot = aggregate(loud)
    assert snapshot.loss == 1e6 and snapshot.samples_per_second == 8.0
    state = DashboardState("run")
    state.record(snapshot, ContributionTable().sorted_rows())
    assert strict_json(json.dumps(state.to_json(), allow_nan=False))["current"]["loss"] == 1e6
    # and with honest peers beside them, the screened figures are the honest ones
    honest = {b"honest": LocalMetrics(**record_dict(loss=2.0))}
    assert aggregate(screen.screen({**loud, **honest}, swarm_epoch=3, now=1000.0)).loss == 2.0


def test_api_state_is_valid_json_after_a_restart_and_the_dashboard_binds_loopback(tmp_path):
    from lightning_swarm.monitor.__main__ import make_parser

    # snapshots.jsonl as a monitor of the previous version wrote it under the 1e308 attack: "loss": Infinity
    lines = [json.dumps(dict(time=1.0, step=1, loss=2.0, alive_peers=1, samples_per_second=3.0)),
             json.dumps(dict(time=2.0, step=2, loss=float("inf"), alive_peers=3, samples_per_second=3.0)),
             json.dumps(dict(time=3.0, step=3, loss=float("nan"), alive_peers=3, samples_per_second=3.0)),
             "[" * 100000]
    (tmp_path / "snapshots.jsonl").write_text("\n".join(lines) + "\n")
    state = DashboardState("run")
    assert state.load_history(str(tmp_path / "snapshots.jsonl")) == 1
    state.set_samples(dict(epoch=1, grids=[dict(prompt="p", file="a.png", path="/x", clip_scores=[float("nan")])]))
    assert make_parser().parse_args(["--config", "c.yaml"]).dashboard_host == "127.0.0.1"
    server = DashboardServer(state, port=0).start()  # the default host
    try:
        assert server.host == "127.0.0.1" and server._sock.getsockname()[0] == "127.0.0.1"
        with urllib.request.urlopen(server.url + "api/state", timeout=10) as response:
            data = strict_json(response.read())
        assert [point["loss"] for point in data["history"]] == [2.0]
        assert data["samples"]["grids"][0]["clip_scores"] == [None]
    finally:
        server.stop()


def test_malformed_records_from_a_real_dht_are_ignored_per_peer_and_logged_once(caplog):
    run_id = "records_test"
    dht = SwarmDHT(start=True, host_maddrs=["/ip4/127.0.0.1/tcp/0"])
    try:
        expiration = get_dht_time() + 60
        values = {b"honest": record_dict(loss=2.0), b"loud": record_dict(loss=1e308),
                  b"typed": dict(record_dict(), step=True), b"extra": dict(record_dict(), class_path="os.system"),
                  b"not_a_dict": [record_dict()]}
        for subkey, value in values.items():
            assert dht.store(metrics_key(run_id), value, expiration, subkey=subkey)
        decoder = MetricsDecoder()
        with caplog.at_level("WARNING", logger="lightning_swarm.monitor.records"):
            for _ in range(3):
                records = fetch_metric_records(dht, run_id, decoder)
                assert list(records) == [b"honest"] and records[b"honest"].loss == 2.0
        warnings = [r.message for r in caplog.records if "malformed metrics record" in r.message]
        assert len(warnings) == 4 and decoder.malformed == 12
        assert any("range:loss" in w for w in warnings) and any("type:step" in w for w in warnings)
    finally:
        dht.shutdown()


@pytest.mark.timeout(320)
def test_fuzzed_metric_records_never_crash_the_decoder(fuzz_harness_output):
    """3000 mutated records (structured edits: edge values 0, -1, huge, NaN, wrong types, missing and unknown fields;
    msgpack bytes truncated, extended, flipped) decoded in a child process with a fixed seed (fuzz_metric_records.py,
    in the child the suite's fuzz harnesses share: fuzz_harnesses.py)."""
    output = harness_output(fuzz_harness_output, "metric_records")  # fails on a signal death or an exception
    counts = json.loads(output.strip().splitlines()[-1])
    assert counts["inputs"] == METRIC_RECORDS and counts["refused"] > 500 and counts["accepted"] > 500
