"""The monitor's dashboard server (fast, one process): the page, plotly.js from the plotly wheel (no CDN), the
JSON the page polls, and sample grids served only when the sampler listed them."""

import json
import os
import urllib.error
import urllib.request

import pytest

from lightning_swarm.monitor.aggregate import PeerContribution, SwarmSnapshot
from lightning_swarm.monitor.dashboard import DashboardServer, DashboardState
from lightning_swarm.monitor.samples import read_sample_results


def get(url):
    with urllib.request.urlopen(url, timeout=10) as response:
        return response.status, response.headers.get("Content-Type", ""), response.read()


def test_dashboard_serves_the_page_plotly_and_the_swarm_state(tmp_path):
    state = DashboardState("run7")
    snapshot = SwarmSnapshot(step=12, loss=2.5, alive_peers=2, samples_per_second=40.0, samples_contributed=900,
                             records={"aaaaaaaaaaaa": {}, "bbbbbbbbbbbb": {}})
    rows = [PeerContribution(peer="aaaaaaaaaaaa", samples=600, seconds=7200.0),
            PeerContribution(peer="bbbbbbbbbbbb", user="alice", samples=300), PeerContribution(peer="cccccccccccc")]
    state.record(snapshot, rows, dict(lr=1e-3, peak_lr=2e-3, length=100), now=1000.0)
    grid = tmp_path / "00_a-red-circle.png"
    grid.write_bytes(b"\x89PNG fake")
    (tmp_path / "secret.png").write_bytes(b"not listed")
    state.set_samples(dict(epoch=10, checkpoint="ckpt/epoch_000010", time=5.0,
                           grids=[dict(prompt="a red circle", file=grid.name, path=str(grid), clip_scores=[0.3])]))
    server = DashboardServer(state, host="127.0.0.1", port=0, poll_seconds=0.5).start()
    try:
        status, kind, page = get(server.url)
        assert status == 200 and kind.startswith("text/html")
        assert b'<script src="/static/plotly.min.js">' in page and b"const POLL_MS = 500;" in page
        assert b"http://" not in page and b"https://" not in page  # nothing from the Internet
        status, _, js = get(server.url + "static/plotly.min.js")
        assert status == 200 and len(js) > 1_000_000 and b"plotly" in js[:2000].lower()
        data = json.loads(get(server.url + "api/state")[2])
        assert data["run_id"] == "run7" and data["current"]["alive_peers"] == 2 and data["current"]["loss"] == 2.5
        assert data["history"] == [dict(time=1000.0, epoch=12, loss=2.5, alive_peers=2, samples_per_second=40.0)]
        assert data["schedule"] == dict(lr=1e-3, peak_lr=2e-3, length=100, epoch=12)
        board = data["leaderboard"]
        assert [row["name"] for row in board] == ["aaaaaaaaaaaa", "alice", "cccccccccccc"]
        assert [row["alive"] for row in board] == [True, True, False] and board[0]["hours"] == 2.0
        assert board[1]["authenticated"] and not board[0]["authenticated"]
        assert data["samples"]["grids"] == [dict(prompt="a red circle", file=grid.name, clip_scores=[0.3])]
        assert get(server.url + "samples/" + grid.name)[2] == b"\x89PNG fake"
        for name in ("secret.png", "..%2Fsecret.png"):
            with pytest.raises(urllib.error.HTTPError, match="404"):
                get(server.url + "samples/" + name)
    finally:
        server.stop()


def test_sample_results_keep_only_png_grids_inside_the_output_dir(tmp_path):
    (tmp_path / "00_ok.png").write_bytes(b"png")
    results = [{"prompt": "ok", "grid": "00_ok.png", "kept": [{"clip_score": 0.25}, {"clip_score": 0.125}]},
               {"prompt": "escape", "grid": "../../etc/passwd.png", "kept": []},
               {"prompt": "missing", "grid": "01_missing.png", "kept": []}]
    (tmp_path / "results.json").write_text(json.dumps(results))
    grids = read_sample_results(str(tmp_path))
    assert grids == [dict(prompt="ok", file="00_ok.png", path=os.path.join(str(tmp_path), "00_ok.png"),
                          clip_scores=[0.25, 0.125])]


def test_a_restarted_monitor_keeps_its_chart_history(tmp_path):
    path = tmp_path / "snapshots.jsonl"
    rows = [dict(time=10.0, step=1, loss=3.0, alive_peers=2, samples_per_second=5.0, samples_contributed=8, records={}),
            "not json", dict(time=11.0, step=2)]  # a torn last line and a partial record are skipped
    path.write_text("\n".join(r if isinstance(r, str) else json.dumps(r) for r in rows) + "\n")
    state = DashboardState("r")
    assert state.load_history(str(path)) == 1 and state.load_history(str(tmp_path / "missing.jsonl")) == 0
    assert state.to_json()["history"] == [dict(time=10.0, epoch=1, loss=3.0, alive_peers=2, samples_per_second=5.0)]
