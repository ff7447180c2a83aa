"""A peer's background processes die with it.

A trainer runs hivemind's DHT in a child process (which starts the p2p daemon, p2pd) and each averager in another.
When the trainer ends normally it shuts them down; when it is killed (SIGKILL, the OOM killer, a preempted notebook)
nothing does, and they live on with parent 1, still reachable, while the swarm counts on them (a survivor waits on
their rounds and state downloads). :class:`DiesWithParent` gives such a child a watchdog thread that notices its
parent is gone (its parent pid changed: it was re-parented) and then kills every process it started (p2pd) and
itself, within about ``parent_poll_interval`` seconds.

A thread rather than ``prctl(PR_SET_PDEATHSIG)``: that signal fires when the parent *thread* that started the child
ends (not the process), it is Linux-only, and the DHT process must outlive its p2pd's kill; the thread works with
any multiprocessing start method (it starts in ``run``, in the child). Public hivemind API only (``run`` of its
``multiprocessing.Process`` subclasses).
"""

from __future__ import annotations

import logging
import multiprocessing.connection
import os
import signal
import subprocess
import sys
import threading
import time
import weakref
from concurrent.futures import InvalidStateError
from typing import Dict, List, Optional

import hivemind
from hivemind.utils.mpfuture import MPFuture, SharedBytes

from lightning_swarm.hivemind_ext.dht_pipe import SerializedRequests, WholeRequests

DEFAULT_PARENT_POLL_INTERVAL = 0.5  # seconds: an orphan lives at most about this long (a few getppid() calls a second)


def _children_by_parent() -> Dict[int, List[int]]:
    """Every process's children, from /proc (Linux) or ``ps`` (macOS)."""
    children: Dict[int, List[int]] = {}
    if os.path.isdir("/proc"):
        for entry in os.listdir("/proc"):
            if entry.isdigit():
                try:
                    with open(f"/proc/{entry}/stat") as f:
                        parent = int(f.read().rsplit(")", 1)[1].split()[1])
                except (OSError, ValueError, IndexError):  # exited meanwhile
                    continue
                children.setdefault(parent, []).append(int(entry))
        return children
    try:
        output = subprocess.run(["ps", "-A", "-o", "pid=,ppid="], capture_output=True, text=True, timeout=10).stdout
    except (OSError, subprocess.SubprocessError):
        return children
    for line in output.splitlines():
        fields = line.split()
        if len(fields) == 2 and all(field.isdigit() for field in fields):
            children.setdefault(int(fields[1]), []).append(int(fields[0]))
    return children


def descendants(pid: int) -> List[int]:
    """Processes started by ``pid``, and by them, and so on (children before grandchildren)."""
    children, found, queue = _children_by_parent(), [], [pid]
    while queue:
        for child in children.get(queue.pop(0), []):
            found.append(child)
            queue.append(child)
    return found


def _kill_tree_and_self(parent_pid: int, name: str) -> None:
    print(f"[lightning_swarm] {name} (pid {os.getpid()}): the trainer (pid {parent_pid}) is gone, stopping "
          "with it", file=sys.stderr, flush=True)
    for pid in descendants(os.getpid()):
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:  # exited meanwhile
            pass
    os.kill(os.getpid(), signal.SIGKILL)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # alive, another user's (the pid was reused)
        return True
    return True


def watch_parent(parent_pid: int, interval: float, name: str, creator_pid: Optional[int] = None) -> threading.Thread:
    """Start a daemon thread that, once this process's parent is no longer ``parent_pid`` (or at once if
    ``creator_pid``, the process that asked for this one, is already gone), SIGKILLs every process this one started
    and then this one. Returns the thread."""

    def watch() -> None:
        if creator_pid is None or _alive(creator_pid):
            while os.getppid() == parent_pid:
                time.sleep(interval)
        _kill_tree_and_self(creator_pid or parent_pid, name)

    thread = threading.Thread(target=watch, name="lightning_swarm.parent_watchdog", daemon=True)
    thread.start()
    return thread


class DiesWithParent:
    """Mixin for a hivemind class that runs as a child process (``hivemind.DHT``, the averagers): the child stops,
    with every process it started (p2pd), within about ``parent_poll_interval`` seconds of the death of the process
    that created the object (see the module docstring)."""

    parent_poll_interval: float = DEFAULT_PARENT_POLL_INTERVAL

    def __init__(self, *args, **kwargs):
        self._creator_pid = os.getpid()  # before hivemind's __init__, which may start the process
        super().__init__(*args, **kwargs)

    def run(self):
        if os.getpid() != self._creator_pid:  # in the child (run() called directly would watch our own parent)
            # the parent is the creator (fork, spawn) or a forkserver, which ends when the creator does
            watch_parent(os.getppid(), self.parent_poll_interval, type(self).__name__, creator_pid=self._creator_pid)
        return super().run()


def replace_result_locks() -> None:
    """New locks for hivemind's MPFuture, for the processes started from now on.

    MPFuture sends every result under one multiprocessing lock shared by all the processes forked from the one that
    imported hivemind; a child killed while holding it (measured for a DHT process: ~1 kill in 3) leaves it held
    forever, and every later hivemind child of this process (a restarted DHT, a notebook cell run again) hangs on its
    first result. Unlike hivemind's ``MPFuture.reset_backend``, this process's futures under way are not dropped
    (children started before keep the old lock: if it is held, their results stay stuck)."""
    MPFuture._update_lock = multiprocessing.Lock()
    MPFuture._initialization_lock = multiprocessing.Lock()
    SharedBytes._lock = multiprocessing.Lock()


def result_locks() -> Dict[str, object]:
    """hivemind's locks that :func:`replace_result_locks` replaces, by name (the tests check they are free)."""
    return {"MPFuture._update_lock": MPFuture._update_lock,
            "MPFuture._initialization_lock": MPFuture._initialization_lock, "SharedBytes._lock": SharedBytes._lock}


class DHTProcessDied(RuntimeError):
    """This peer's DHT process ended while the peer still used it: it can no longer reach the swarm."""


class SwarmDHT(DiesWithParent, hivemind.DHT):
    """hivemind.DHT (same arguments) whose process and p2p daemon die with the process that created it, and whose
    callers learn when that process dies first.

    hivemind's calls (``get``, ``store``, ``run_coroutine``, ``add_validators``) wait for the DHT process's answer
    with no timeout, so a DHT process that died (an exception in it, the OOM killer) left its trainer waiting forever.
    Here a watchdog thread in the creating process waits for the DHT process to end; if it ends before ``shutdown``,
    it logs the exit code once and fails every call waiting on it, and every later call, with :class:`DHTProcessDied`.
    Its requests are read whole, and sent one thread at a time (``dht_pipe``: a request read halfway killed hivemind's
    DHT process).
    """

    def run(self):
        self._inner_pipe = WholeRequests(self._inner_pipe)  # in the DHT process (see dht_pipe)
        return super().run()

    def run_in_background(self, await_ready: bool = True, timeout: Optional[float] = None) -> None:
        self._outer_pipe = SerializedRequests(self._outer_pipe)  # (see dht_pipe)
        self._waiting = weakref.WeakSet()  # futures of calls not answered yet (only in the creating process)
        self._shutting_down = False
        self._died: Optional[DHTProcessDied] = None
        super().run_in_background(await_ready=await_ready, timeout=timeout)
        threading.Thread(target=self._watch_process, name="lightning_swarm.dht_watchdog", daemon=True).start()

    def run_coroutine(self, coro, return_future: bool = False):
        return self._watched(super().run_coroutine, return_future, coro)

    def get(self, key, latest: bool = False, return_future: bool = False, **kwargs):
        return self._watched(super().get, return_future, key, latest=latest, **kwargs)

    def store(self, key, value, expiration_time, subkey=None, return_future: bool = False, **kwargs):
        return self._watched(super().store, return_future, key, value, expiration_time, subkey=subkey, **kwargs)

    def _watched(self, call, return_future: bool, *args, **kwargs):
        """hivemind's ``call(*args, return_future=True, **kwargs)``, failed with DHTProcessDied if the process dies."""
        if os.getpid() != self._creator_pid or not hasattr(self, "_waiting"):  # a forked child, or not started here
            return call(*args, return_future=return_future, **kwargs)
        if self._died is not None:
            raise self._died
        future = call(*args, return_future=True, **kwargs)
        self._waiting.add(future)
        if self._died is not None:  # died while the request was sent: the watchdog may have missed this future
            self._fail(future)
        return future if return_future else future.result()

    def shutdown(self) -> None:
        self._shutting_down = True
        super().shutdown()

    def _watch_process(self) -> None:
        multiprocessing.connection.wait([self.sentinel])
        if self._shutting_down:
            return
        self.join(timeout=5.0)  # reaps the process, so that exitcode is known
        replace_result_locks()
        self._died = DHTProcessDied(
            f"[lightning_swarm] this peer's DHT process (pid {self.pid}) ended with exit code {self.exitcode}: the "
            f"peer can no longer reach the swarm. Its output above says why; restart the peer to rejoin.")
        logging.getLogger(__name__).error(str(self._died))
        while True:
            try:
                waiting = list(self._waiting)
                break
            except RuntimeError:  # a call added a future meanwhile
                continue
        for future in waiting:
            self._fail(future)

    def _fail(self, future) -> None:
        if not future.done():
            try:
                future.set_exception(self._died)
            except InvalidStateError:  # answered meanwhile
                pass
