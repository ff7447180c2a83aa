"""A peer killed by SIGKILL leaves no process behind: its DHT process, averagers and p2p daemon die with it."""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

from hivemind.utils import get_dht_time
from hivemind.utils.mpfuture import MPFuture
import pytest

from lightning_swarm.hivemind_ext.lifetime import DHTProcessDied, SwarmDHT
from swarm_harness import Peer, wait_until

LOCAL = ["/ip4/127.0.0.1/tcp/0"]
REPO = Path(__file__).resolve().parents[2]


def session_processes(session: int) -> dict:
    """{pid: program name} of the live processes of ``session`` (zombies, already dead, left out)."""
    found = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                stat = f.read()
        except OSError:  # exited meanwhile
            continue
        name, fields = stat[stat.index("(") + 1:stat.rindex(")")], stat[stat.rindex(")") + 2:].split()
        if int(fields[3]) == session and fields[0] != "Z":  # fields: state ppid pgrp session ...
            found[int(entry)] = name
    return found


def assert_session_ends(session: int, timeout: float) -> float:
    """Wait until no process of ``session`` is alive; returns the seconds it took (fails after ``timeout``)."""
    start = time.monotonic()
    while time.monotonic() - start < timeout:
        if not session_processes(session):
            return time.monotonic() - start
        time.sleep(0.1)
    left = session_processes(session)
    for pid in left:  # clean up before failing
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            pass
    raise AssertionError(f"processes left {timeout} s after their trainer was killed: {left}")


def test_dht_process_and_p2pd_die_with_their_creator(tmp_path):
    """A process that started a SwarmDHT (a DHT process and its p2pd) is SIGKILLed alone: both follow it."""
    script = textwrap.dedent("""
        import sys, time
        from lightning_swarm.hivemind_ext.lifetime import SwarmDHT
        dht = SwarmDHT(start=True, host_maddrs=["/ip4/127.0.0.1/tcp/0"])
        print("READY", flush=True)
        time.sleep(600)
    """)
    process = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True,
                               start_new_session=True, env=dict(os.environ, PYTHONPATH=str(REPO)))
    try:
        assert process.stdout.readline().strip() == "READY"
        names = sorted(session_processes(process.pid).values())
        assert "p2pd" in names and len(names) >= 3, names  # the creator, the DHT process, p2pd
        os.kill(process.pid, signal.SIGKILL)  # the creator only: its children are left to themselves
        process.wait(timeout=10)
        assert assert_session_ends(process.pid, timeout=10) < 10
    finally:
        if session_processes(process.pid):
            os.killpg(process.pid, signal.SIGKILL)
        process.wait()


async def _never_answers(dht, node):
    await asyncio.sleep(3600)


async def _holds_the_result_lock(dht, node):
    # what a DHT process does while it sends a result: hold the lock of hivemind's MPFuture that every process forked
    # from the test's shares (killed then, it stays held: ~1 kill in 3 without this, docs/notes/ci-failures.md)
    MPFuture._update_lock.acquire()
    await asyncio.sleep(3600)


def test_calls_to_a_dht_whose_process_died_fail_instead_of_waiting_forever(caplog):
    """hivemind's DHT calls wait for the DHT process's answer with no timeout: a DHT process that dies (here: killed)
    left its trainer waiting forever. A SwarmDHT fails the call waiting on it and every later one, naming the exit
    code, and logs it once; a DHT that was shut down logs nothing."""
    dht = SwarmDHT(start=True, host_maddrs=LOCAL)
    try:
        assert dht.store("key", 1, get_dht_time() + 60) and dht.get("key").value == 1
        waiting = dht.run_coroutine(_never_answers, return_future=True)
        dht.run_coroutine(_holds_the_result_lock, return_future=True)
        time.sleep(0.5)
        with caplog.at_level(logging.ERROR, logger="lightning_swarm.hivemind_ext.lifetime"):
            os.kill(dht.pid, signal.SIGKILL)
            with pytest.raises(DHTProcessDied, match=f"pid {dht.pid}.* exit code -9"):
                waiting.result(timeout=10)
            for call in (lambda: dht.get("key"), lambda: dht.store("key", 2, get_dht_time() + 60),
                         lambda: dht.get_visible_maddrs()):
                with pytest.raises(DHTProcessDied):
                    call()
        assert [record.levelno for record in caplog.records] == [logging.ERROR]
    finally:
        dht.shutdown()
    # a DHT started after the death (a notebook cell run again) starts: its first result is not stuck behind the
    # lock the dead process held
    healthy = SwarmDHT(start=False, host_maddrs=LOCAL)
    healthy.run_in_background(await_ready=True, timeout=30)
    with caplog.at_level(logging.ERROR, logger="lightning_swarm.hivemind_ext.lifetime"):
        caplog.clear()
        healthy.shutdown()
        healthy.join(10)
        time.sleep(0.5)  # the watchdog has seen the end
    assert not caplog.records


@pytest.mark.slow
def test_sigkilled_trainer_leaves_nothing_behind(tmp_path, peers):
    """A training peer of the real strategy (LightningCLI, DHT process, two averagers, p2pd) loses its main process
    to SIGKILL, as to the OOM killer: within a few seconds no process of its tree is left."""
    strategy = dict(run_id="lifetime", target_batch_size=16, host_maddrs=LOCAL, matchmaking_time=1.5,
                    averaging_timeout=10.0)
    peer = Peer(tmp_path, "doomed", strategy, model={"step_delay": 0.05}, data={"batch_size": 4},
                recorder={"stop_at_epoch": 1000, "max_seconds": 300})
    peers.append(peer)
    wait_until(lambda: peer.max_epoch() >= 0, 120, [peer], "the peer to start training")
    before = sorted(session_processes(peer.process.pid).values())
    assert names_ok(before), before
    os.kill(peer.process.pid, signal.SIGKILL)  # the trainer only, not its process group
    peer.process.wait(timeout=10)
    seconds = assert_session_ends(peer.process.pid, timeout=15)
    print(f"{len(before)} processes ({', '.join(before)}) gone {seconds:.1f} s after the trainer's SIGKILL")


def names_ok(names) -> bool:
    """The trainer, its DHT process and two averagers (python), and p2pd."""
    return names.count("p2pd") == 1 and len(names) >= 5


@pytest.mark.slow
def test_peer_stuck_in_state_download_retries_stops_at_max_time_and_on_sigterm(tmp_path, peers):
    """Two newcomers join a peer whose state they can never load (their models are smaller, and of two sizes: every
    download is refused for its shapes, and hivemind retries forever). One stops by itself at its Trainer's max_time, the other on
    SIGTERM (its main process only), each within seconds, leaving no process behind."""
    strategy = dict(run_id="stuck", target_batch_size=16, host_maddrs=LOCAL, matchmaking_time=1.5,
                    averaging_timeout=10.0, load_state_timeout=5.0)
    donor = Peer(tmp_path, "donor", strategy, model={"step_delay": 0.05}, data={"batch_size": 4},
                 recorder={"stop_at_epoch": 1000, "max_seconds": 240})
    peers.append(donor)
    # two sizes: a newcomer offers its own state too, and must not be able to load the other's
    timed = Peer(tmp_path, "timed", strategy, model={"hidden": 16}, data={"batch_size": 4}, join_later=True,
                 trainer={"max_time": "00:00:00:20"}, recorder={"stop_at_epoch": 1000, "max_seconds": 240})
    termed = Peer(tmp_path, "termed", strategy, model={"hidden": 24}, data={"batch_size": 4}, join_later=True,
                  recorder={"stop_at_epoch": 1000, "max_seconds": 240})
    peers += [timed, termed]
    join = donor.join_peers()
    # the newcomers join once the donor offers its state: one that found no donor would train alone, on a model
    # of its own, and become the run's most advanced peer
    wait_until(lambda: donor.max_epoch() >= 2, 120, [donor], "the donor to pass two global steps")
    timed.join(join)
    termed.join(join)
    refused = "State download from"
    wait_until(lambda: refused in timed.log() and refused in termed.log(), 120, [donor, timed, termed],
               "both newcomers to fail a state download")
    start = time.monotonic()
    os.kill(termed.process.pid, signal.SIGTERM)
    termed.process.wait(timeout=30)
    sigterm_seconds = time.monotonic() - start
    timed.process.wait(timeout=60)  # max_time: 20 s from the start of training, whatever the retries
    for peer in (timed, termed):
        assert "state download abandoned" in peer.log(), peer.log()[-3000:]
        assert peer.max_epoch() <= 0, peer.events()  # no global step from its own, stale parameters
        assert_session_ends(peer.process.pid, timeout=15)
    assert timed.process.returncode == 0, timed.log()[-3000:]
    assert sigterm_seconds < 30  # teardown (averagers, DHT) included; without the fix it never stops
    print(f"stopped {sigterm_seconds:.1f} s after SIGTERM")
