"""The monitor's live dashboard: a page that updates itself with the swarm's loss, peers, throughput, epoch and LR
schedule, the contributors leaderboard and the newest CLIP-reranked samples.

``python -m lightning_swarm.monitor --config ... --dashboard-port 8080`` serves it at ``http://127.0.0.1:8080/``
(this machine only; ``--dashboard-host 0.0.0.0`` serves it on every interface).
It works without Internet: the page and plotly.js (the file bundled in the ``plotly`` wheel) are served by this
process with aiohttp, on a thread of its own next to the monitor's refresh loop. The page polls ``/api/state``
(JSON) every few seconds and redraws.

Routes:
    /                    the page (``dashboard.html`` beside this file)
    /static/plotly.min.js
    /api/state           everything the page shows, see :meth:`DashboardState.to_json` (valid JSON: no NaN/Infinity)
    /samples/<file>.png  the newest sample grids (only files the sampler listed)
"""

from __future__ import annotations

import asyncio
import collections
import importlib.resources
import json
import logging
import math
import os
import socket
import threading
import time
from typing import Any, Deque, Dict, List, Optional

from lightning_swarm.monitor.aggregate import PeerContribution, SwarmSnapshot, finite_json

logger = logging.getLogger(__name__)

PAGE_FILE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "dashboard.html")


def plotly_js_path() -> str:
    """The plotly.js file that ships inside the plotly wheel (no CDN)."""
    path = importlib.resources.files("plotly") / "package_data" / "plotly.min.js"
    if not path.is_file():
        raise FileNotFoundError(f"plotly.js not found at {path}: reinstall plotly (pip install plotly)")
    return str(path)


class DashboardState:
    """What the page shows, updated by the monitor's refresh loop and read by the web server (thread-safe).

    Args:
        run_id: the run's name (page title).
        max_points: history points kept for the charts (the oldest are dropped).
    """

    def __init__(self, run_id: str, max_points: int = 10000):
        self.run_id = run_id
        self._lock = threading.Lock()
        self._history: Deque[Dict[str, float]] = collections.deque(maxlen=max_points)
        self._current: Dict[str, Any] = {}
        self._leaderboard: List[Dict[str, Any]] = []
        self._schedule: Dict[str, Any] = {}
        self._samples: Dict[str, Any] = {}

    def record(
        self,
        snapshot: SwarmSnapshot,
        contributions: List[PeerContribution],
        schedule: Optional[Dict[str, Any]] = None,
        now: Optional[float] = None,
    ) -> None:
        """Add one monitor refresh.

        Args:
            snapshot: the swarm's figures at this refresh.
            contributions: the contribution table's rows (most samples first).
            schedule: the LR schedule at the swarm's epoch: ``lr``, ``peak_lr``, ``length`` (global epochs, or
                None if unknown); None if the model has no scheduler.
            now: the time of the refresh (default: now).
        """
        now = time.time() if now is None else now
        point = dict(time=now, epoch=snapshot.step, loss=snapshot.loss, alive_peers=snapshot.alive_peers,
                     samples_per_second=snapshot.samples_per_second)
        with self._lock:
            self._history.append(point)
            self._current = dict(point, samples_contributed=snapshot.samples_contributed)
            self._leaderboard = [
                dict(name=row.user or row.peer, peer=row.peer, authenticated=bool(row.user), samples=row.samples,
                     hours=row.seconds / 3600, samples_per_second=row.samples_per_second,
                     last_seen=row.last_seen, alive=row.peer in snapshot.records)
                for row in contributions
            ]
            self._schedule = dict(schedule or {}, epoch=snapshot.step)

    def load_history(self, snapshots_path: str) -> int:
        """Fill the charts from the monitor's ``snapshots.jsonl`` of an earlier run (a restarted monitor keeps its
        history); returns the number of points read. Lines that are not valid snapshots are skipped."""
        if not os.path.isfile(snapshots_path):
            return 0
        points = []
        with open(snapshots_path) as f:
            for line in f:
                try:
                    row = json.loads(line)
                    point = dict(time=float(row["time"]), epoch=int(row["step"]), loss=float(row["loss"]),
                                 alive_peers=int(row["alive_peers"]),
                                 samples_per_second=float(row["samples_per_second"]))
                except (ValueError, KeyError, TypeError, OverflowError, RecursionError):
                    continue
                if all(math.isfinite(value) for value in point.values()):  # a file of an older monitor may hold inf
                    points.append(point)
        with self._lock:
            self._history.extend(points)
        return len(points)

    def set_samples(self, samples: Dict[str, Any]) -> None:
        """The newest sample grids: ``{"epoch": E, "checkpoint": path, "time": t, "grids": [{"prompt", "file",
        "path", "clip_scores"}]}`` (``path`` is the PNG on disk, served as ``/samples/<file>``)."""
        with self._lock:
            self._samples = samples

    def sample_path(self, name: str) -> Optional[str]:
        """The PNG on disk for ``/samples/<name>``, only if it is one of the current grids."""
        with self._lock:
            for grid in self._samples.get("grids", []):
                if grid["file"] == name:
                    return grid["path"]
        return None

    def to_json(self) -> Dict[str, Any]:
        """The page's data: run id, current figures, chart history, LR schedule, leaderboard, samples (JSON data
        without a non-finite float: those become null)."""
        with self._lock:
            samples = dict(self._samples)
            if samples:
                samples["grids"] = [{k: v for k, v in g.items() if k != "path"} for g in samples.get("grids", [])]
            return finite_json(dict(run_id=self.run_id, server_time=time.time(), current=dict(self._current),
                                    history=list(self._history), schedule=dict(self._schedule),
                                    leaderboard=list(self._leaderboard), samples=samples))


class DashboardServer:
    """Serves :class:`DashboardState` over HTTP on a background thread (aiohttp).

    Args:
        state: what to show.
        host: address to listen on (``127.0.0.1``: this machine only; ``0.0.0.0``: every interface).
        port: TCP port (0: any free port, see :attr:`url`).
        poll_seconds: how often the page asks for new data.
    """

    def __init__(self, state: DashboardState, host: str = "127.0.0.1", port: int = 8080, poll_seconds: float = 3.0):
        from aiohttp import web

        self.state, self.host, self.poll_seconds = state, host, poll_seconds
        self._sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._sock.bind((host, port))  # bound here so that a busy port fails at once, in the caller
        self.port = self._sock.getsockname()[1]
        with open(PAGE_FILE) as f:
            page = f.read()
        self._page = page.replace("__POLL_MS__", str(int(poll_seconds * 1000)))
        self._plotly_js = plotly_js_path()
        self.app = web.Application()
        self.app.add_routes([
            web.get("/", self._index),
            web.get("/static/plotly.min.js", self._plotly),
            web.get("/api/state", self._api_state),
            web.get("/samples/{name}", self._sample),
        ])
        self._loop: Optional[asyncio.AbstractEventLoop] = None
        self._runner = None
        self._started = threading.Event()
        self._thread = threading.Thread(target=self._serve, name="dashboard", daemon=True)

    @property
    def url(self) -> str:
        host = "127.0.0.1" if self.host in ("0.0.0.0", "") else self.host
        return f"http://{host}:{self.port}/"

    def start(self, timeout: float = 30.0) -> "DashboardServer":
        self._thread.start()
        if not self._started.wait(timeout):
            raise RuntimeError(f"the dashboard did not start within {timeout}s")
        logger.info(f"Dashboard at {self.url}")
        return self

    def stop(self, timeout: float = 10.0) -> None:
        if self._loop is None or not self._thread.is_alive():
            return
        future = asyncio.run_coroutine_threadsafe(self._runner.cleanup(), self._loop)
        try:
            future.result(timeout)
        except Exception as e:  # stopping must not raise at shutdown
            logger.warning(f"Dashboard cleanup failed: {e!r}")
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout)

    def _serve(self) -> None:
        from aiohttp import web

        self._loop = asyncio.new_event_loop()
        asyncio.set_event_loop(self._loop)
        self._runner = web.AppRunner(self.app, access_log=None)
        self._loop.run_until_complete(self._runner.setup())
        self._loop.run_until_complete(web.SockSite(self._runner, self._sock).start())
        self._started.set()
        self._loop.run_forever()
        self._loop.close()

    async def _index(self, request):
        from aiohttp import web

        return web.Response(text=self._page, content_type="text/html")

    async def _plotly(self, request):
        from aiohttp import web

        return web.FileResponse(self._plotly_js, headers={"Cache-Control": "max-age=86400"})

    async def _api_state(self, request):
        from aiohttp import web

        return web.Response(text=json.dumps(self.state.to_json(), allow_nan=False), content_type="application/json",
                            headers={"Cache-Control": "no-store"})

    async def _sample(self, request):
        from aiohttp import web

        path = self.state.sample_path(request.match_info["name"])
        if path is None or not os.path.isfile(path):
            raise web.HTTPNotFound()
        return web.FileResponse(path, headers={"Cache-Control": "no-store"})
