"""A many-peer harness: N peers of the real HivemindStrategy on simulated accelerators (sim_peer.py), each a separate
process group on 127.0.0.1, with per-peer speeds, client-mode peers, churn (SIGKILL a peer's whole process group,
start a new peer in its place) and per-peer memory sampling, optionally each peer in a network namespace behind a
shaped link (``network``: a :class:`netns_harness.ShapedNetwork`). Everything it starts is killed when the swarm is
closed, at interpreter exit, and on failure; :meth:`ManyPeerSwarm.leftovers` lists any process still alive.

    with ManyPeerSwarm(tmp_path, specs, strategy=..., model=..., duration=120) as swarm:
        swarm.start()
        swarm.replace(3)            # churn: peer 3's machine dies, a new one joins with the same speed
        swarm.wait()
    swarm.peers / swarm.retired     # events, logs, memory samples of every peer that ran
"""

from __future__ import annotations

import atexit
import json
import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Optional

from swarm_harness import JOIN_OPTION

WORKER = Path(__file__).with_name("sim_peer.py")
REPO = Path(__file__).resolve().parents[2]
_ALL_GROUPS: set = set()  # process-group ids started by any swarm of this process (killed at exit)


def _kill_group(pgid: int) -> None:
    try:
        os.killpg(pgid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


@atexit.register
def _kill_everything() -> None:
    for pgid in list(_ALL_GROUPS):
        _kill_group(pgid)


def session_pids(sid: int) -> List[int]:
    """Processes of session ``sid`` still alive (zombies excluded): a peer, its DHT and averager processes, p2pd."""
    pids = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            fields = open(f"/proc/{entry}/stat").read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[3]) == sid and fields[0] != "Z":  # fields: state, ppid, pgrp, session, ...
            pids.append(int(entry))
    return pids


def memory_of(pids: List[int]) -> Dict[str, float]:
    """{"rss_gb": summed RSS, "pss_gb": summed proportional set size (shared pages split)} of ``pids``."""
    rss = pss = 0
    for pid in pids:
        try:
            for line in open(f"/proc/{pid}/smaps_rollup"):
                if line.startswith("Rss:"):
                    rss += int(line.split()[1])
                elif line.startswith("Pss:"):
                    pss += int(line.split()[1])
        except OSError:
            pass
    return {"rss_gb": rss / 2**20, "pss_gb": pss / 2**20}


@dataclass
class PeerSpec:
    """samples_per_second: the simulated accelerator's speed; client_mode: behind NAT (accepts no connection)."""

    samples_per_second: float
    client_mode: bool = False


@dataclass
class SimPeer:
    name: str
    spec: PeerSpec
    out_dir: Path
    process: subprocess.Popen
    started: float = field(default_factory=time.time)
    killed: Optional[float] = None
    memory: List[Dict[str, float]] = field(default_factory=list)

    def log(self) -> str:
        path = self.out_dir / "log.txt"
        return path.read_text(errors="replace") if path.exists() else ""

    def events(self) -> List[Dict[str, Any]]:
        return read_events(self.out_dir)

    def join_address(self) -> Optional[List[str]]:
        match = JOIN_OPTION.search(self.log())
        return json.loads(match.group(1)) if match else None

    def kill(self) -> None:
        """SIGKILL the peer's whole process group (a machine that dies takes all its processes)."""
        _kill_group(self.process.pid)
        try:
            self.process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            pass
        if self.killed is None:
            self.killed = time.time()


class ManyPeerSwarm:
    """Start, churn and stop a swarm of simulated peers.

    root: directory for the peers' configs, logs and events.
    specs: one PeerSpec per peer; specs[0] must be reachable (it starts the swarm).
    strategy: HivemindStrategy arguments shared by all peers (run_id, target_batch_size, ...); ``client_mode``
        comes from the spec.
    model: SimulatedAccelerator arguments shared by all peers; ``samples_per_second`` and ``seed`` are per peer.
    duration: seconds of training after :meth:`start` returns; every peer, replacements included, stops then.
    memory_interval: seconds between memory samples of each peer's processes.
    network: optional shaped links (``netns_harness.shaped_network`` with one profile per spec): peer ``i``, and any
        peer that replaces it, runs in namespace ``i`` and listens on its address. The DHT there drops the
        benchmarking range's addresses, so peers learn each other only from their initial peers: the reachable
        peers start one after the other, each given every reachable peer started before it, and the client-mode
        peers, which only dial out, are given all of them (netns_harness's module docstring says why).
    """

    def __init__(self, root: Path, specs: List[PeerSpec], strategy: Dict[str, Any], model: Dict[str, Any],
                 duration: float, memory_interval: float = 5.0, network: Optional[Any] = None):
        if specs[0].client_mode:
            raise ValueError("specs[0] starts the swarm: it must be reachable (client_mode False)")
        if network is not None and len(network.namespaces) != len(specs):
            raise ValueError(f"network has {len(network.namespaces)} namespaces for {len(specs)} peers: build it with "
                             f"one profile per spec")
        self.network = network
        self.root, self.specs, self.strategy, self.model = Path(root), specs, strategy, model
        self.duration, self.memory_interval = duration, memory_interval
        self.peers: List[SimPeer] = []  # the current peer of each slot
        self.retired: List[SimPeer] = []  # peers killed by churn
        self.late: List[SimPeer] = []  # replacements that were still joining when the swarm stopped
        self.stop_time = float("inf")
        self._started = 0
        self._sessions: set = set()
        self._closing = threading.Event()
        self._sampler = threading.Thread(target=self._sample_memory, daemon=True)

    # ------------------------------------------------------------------------------------------------ processes
    def _launch(self, slot: int, initial_peers: Optional[List[str]], join_later: bool) -> SimPeer:
        """Start a peer process in ``slot``: with ``initial_peers``, or (``join_later``) waiting for its initial
        peers file (:meth:`_initial_peers_file`)."""
        spec = self.specs[slot]
        name = f"peer{slot:02d}-{self._started}"
        self._started += 1
        out_dir = self.root / name
        out_dir.mkdir(parents=True)
        strategy = dict(self.strategy, client_mode=spec.client_mode, log_progress=False, verbose=True)
        if self.network is not None:
            strategy["host_maddrs"] = self.network.host_maddrs(slot)
        if initial_peers:
            strategy["initial_peers"] = initial_peers
        config = {"out_dir": str(out_dir), "strategy": strategy, "stop_time": self.stop_time,
                  "model": dict(self.model, samples_per_second=spec.samples_per_second, seed=1000 + self._started)}
        if join_later:
            config["initial_peers_file"] = str(self._initial_peers_file(slot))
        (out_dir / "config.json").write_text(json.dumps(config))
        env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(WORKER.parent), str(REPO)]), OMP_NUM_THREADS="1")
        env.pop("LIGHTNING_SWARM_INITIAL_PEERS", None)
        with open(out_dir / "log.txt", "w") as log:
            argv = [sys.executable, str(WORKER), str(out_dir / "config.json")]
            if self.network is not None:  # ip netns exec keeps the pid: the process group and signals are the peer's
                argv = self.network.command(slot, argv)
            process = subprocess.Popen(argv, stdout=log,
                                       stderr=subprocess.STDOUT, env=env, start_new_session=True)
        _ALL_GROUPS.add(process.pid)
        self._sessions.add(process.pid)
        return SimPeer(name, spec, out_dir, process)

    def start(self, timeout: float = 240) -> None:
        """Start every peer (all import at once; peers after the first wait for its address), and return once all
        of them took their first step: the timed ``duration`` starts then."""
        self.stop_time = time.time() + 10**6  # set for real below; peers read it from their config at start
        self.peers = [self._launch(0, None, False)]
        self.peers += [self._launch(slot, None, True) for slot in range(1, len(self.specs))]
        self._sampler.start()
        deadline = time.monotonic() + timeout
        if self.network is None:  # one address is enough on 127.0.0.1: the DHT tells the rest
            self._publish_initial_peers(None, self._address_of(0, deadline))
        else:
            reachable = [slot for slot, spec in enumerate(self.specs) if not spec.client_mode]
            known = self._address_of(0, deadline)
            for slot in reachable[1:]:
                self._publish_initial_peers(slot, known)
                known = known + self._address_of(slot, deadline)
            for slot, spec in enumerate(self.specs):
                if spec.client_mode:
                    self._publish_initial_peers(slot, known)
        while not all(any(e["kind"] == "start" for e in peer.events()) for peer in self.peers):
            self.check_alive()
            if time.monotonic() > deadline:
                waiting = [peer.name for peer in self.peers if not peer.events()]
                raise TimeoutError(f"peers {waiting} took no step in {timeout} s:\n{self.peers[-1].log()[-3000:]}")
            time.sleep(0.5)
        self.set_stop_time(time.time() + self.duration)

    def _initial_peers_file(self, slot: int) -> Path:
        return self.root / ("initial_peers.json" if self.network is None else f"initial_peers_{slot}.json")

    def _publish_initial_peers(self, slot: Optional[int], addresses: List[str]) -> None:
        target = self.root / "initial_peers.json" if slot is None else self._initial_peers_file(slot)
        temporary = target.with_suffix(".tmp")
        temporary.write_text(json.dumps(addresses))
        os.replace(temporary, target)

    def _address_of(self, slot: int, deadline: float) -> List[str]:
        """The addresses peer ``slot`` printed once its DHT started."""
        while True:
            self.check_alive()
            address = self.peers[slot].join_address()
            if address is not None:
                return address
            if time.monotonic() > deadline:
                raise TimeoutError(f"{self.peers[slot].name} printed no address:\n{self.peers[slot].log()[-3000:]}")
            time.sleep(0.2)

    def set_stop_time(self, stop_time: float) -> None:
        """Every peer stops at ``stop_time`` (the running ones read it from a file next to their config)."""
        self.stop_time = stop_time
        for peer in self.peers:
            (peer.out_dir / "stop_time").write_text(repr(stop_time))

    def reachable_addresses(self) -> List[str]:
        addresses: List[str] = []
        for peer in self.peers:
            if not peer.spec.client_mode and peer.process.poll() is None:
                addresses += peer.join_address() or []
        return addresses

    def replace(self, slot: int) -> SimPeer:
        """Churn: SIGKILL the peer in ``slot`` with all its processes, start a new peer of the same speed and mode
        that joins the reachable peers still alive."""
        old = self.peers[slot]
        old.kill()
        self.retired.append(old)
        new = self._launch(slot, self.reachable_addresses(), False)
        (new.out_dir / "stop_time").write_text(repr(self.stop_time))
        self.peers[slot] = new
        return new

    def check_alive(self) -> None:
        if time.time() > self.stop_time:  # see wait()
            return
        for peer in self.peers:
            code = peer.process.poll()
            if code not in (None, 0):
                raise RuntimeError(f"{peer.name} exited with {code}:\n{peer.log()[-4000:]}")

    def wait(self, grace: float = 90) -> None:
        """Wait for every peer to stop at the stop time (``grace`` seconds later at most: teardown, a last round)."""
        deadline = time.time() + max(0.0, self.stop_time - time.time()) + grace
        for peer in self.peers:
            try:
                peer.process.wait(timeout=max(1.0, deadline - time.time()))
            except subprocess.TimeoutExpired:
                raise TimeoutError(f"{peer.name} still running {grace} s after the stop time:\n"
                                   f"{peer.log()[-3000:]}") from None
        for peer in self.peers:
            # a replacement still joining when the others stopped finds nobody to join: it never trained
            if peer.process.returncode != 0 and not any(e["kind"] == "start" for e in peer.events()):
                self.late.append(peer)
            elif peer.process.returncode != 0:
                raise RuntimeError(f"{peer.name} exited with {peer.process.returncode}:\n{peer.log()[-4000:]}")

    def _sample_memory(self) -> None:
        while not self._closing.wait(self.memory_interval):
            for peer in list(self.peers):
                if peer.process.poll() is None:
                    peer.memory.append(dict(time=time.time(), **memory_of(session_pids(peer.process.pid))))

    # ------------------------------------------------------------------------------------------------- cleanup
    def leftovers(self) -> List[int]:
        """Processes of any peer this swarm started that are still alive."""
        return [pid for sid in self._sessions for pid in session_pids(sid)]

    def leftovers_of(self, peer: SimPeer, timeout: float = 5.0) -> List[int]:
        """Processes of ``peer`` still alive ``timeout`` seconds after it was killed (SIGKILL is asynchronous)."""
        deadline = time.monotonic() + timeout
        while session_pids(peer.process.pid) and time.monotonic() < deadline:
            time.sleep(0.1)
        return session_pids(peer.process.pid)

    def close(self) -> None:
        self._closing.set()
        for peer in self.peers + self.retired:
            peer.kill()
        for sid in self._sessions:  # a process that left its group (none should) still shares the session
            for pid in session_pids(sid):
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        deadline = time.monotonic() + 10
        while self.leftovers() and time.monotonic() < deadline:
            time.sleep(0.1)
        _ALL_GROUPS.difference_update(self._sessions)

    def __enter__(self) -> "ManyPeerSwarm":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


# ------------------------------------------------------------------------------------------------------- analysis
def read_events(out_dir: Path) -> List[Dict[str, Any]]:
    """A peer's events.jsonl (sim_peer.py) as a list ([] before it wrote any)."""
    path = Path(out_dir) / "events.jsonl"
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def epoch_events(peers: List[SimPeer]) -> List[Dict[str, Any]]:
    """Every peer's "epoch" events (how it reached each global epoch), see :func:`peer_epoch_events`."""
    return [e for peer in peers for e in peer_epoch_events(peer.name, peer.events())]


def peer_epoch_events(name: str, events: List[Dict[str, Any]]) -> List[Dict[str, Any]]:
    """One peer's "epoch" events, in order, with its name under "peer" and under "round_outcomes" the outcomes of
    the gradient round of the samples each carries (see :func:`entered`)."""
    own = [dict(e, peer=name) for e in events if e["kind"] == "epoch"]
    for event, after in zip(own, own[1:] + [None]):
        # with delay_grad_averaging the round of an event's samples starts at that event and ends in the background
        # during the next epoch: its outcome is logged with the peer's next event (None: the peer was killed or the
        # run ended first, the outcome never came)
        event["round_outcomes"] = (event["outcomes"] if not event.get("delayed")
                                   else after["outcomes"] if after is not None else None)
    return own


def entered(event: Dict[str, Any]) -> bool:
    """Whether the samples a peer accumulated before this epoch went into the swarm's global step: it stepped one
    epoch (not a catch-up that discards them) and the gradient round of those samples did not fail. With overlap
    (the event is "delayed") that round's outcome comes with the peer's next event (:func:`epoch_events`); a round
    whose outcome never came (the peer's last event) counts as entered."""
    if event["previous"] != event["epoch"] - 1 or "resync" in event["outcomes"]:
        return False
    outcomes = event.get("round_outcomes", event["outcomes"])
    return not any(o == "failed" for o in outcomes or ())


def global_batch_sizes(events: List[Dict[str, Any]], last_epoch: int) -> List[int]:
    """Samples that entered each global step 1..last_epoch (the sum over peers), for :func:`reference_losses`."""
    sizes = [0] * last_epoch
    for e in events:
        if entered(e) and 1 <= e["epoch"] <= last_epoch:
            sizes[e["epoch"] - 1] += e["samples"]
    return sizes


def global_stale_fractions(events: List[Dict[str, Any]], last_epoch: int) -> List[float]:
    """The share of each global step's entered samples (1..last_epoch) whose gradient a peer took before the
    previous step's delayed update landed (sim_peer's "stale" count), for :func:`reference_losses`."""
    stale, sizes = [0] * last_epoch, [0] * last_epoch
    for e in events:
        if entered(e) and 1 <= e["epoch"] <= last_epoch:
            stale[e["epoch"] - 1] += min(e.get("stale", 0), e["samples"])
            sizes[e["epoch"] - 1] += e["samples"]
    return [s / n if n else 0.0 for s, n in zip(stale, sizes)]
