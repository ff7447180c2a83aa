"""Requests to a DHT process read whole: a request that arrives in two parts no longer kills the DHT process.

A ``hivemind.DHT`` serves its creator's calls (``get``, ``store``, ``run_coroutine``) from a pipe: the caller sends
a pickled request with ``Connection.send`` (a 4-byte length, then the bytes: two writes when the request is over
16 KiB, or when the pipe is full), and the DHT process, woken by its event loop as soon as bytes arrive, reads it
with ``Connection.recv``. hivemind 1.1.12 watches the pipe with uvloop's ``add_reader``, which leaves it
non-blocking, so a request whose second part is not there yet raises ``BlockingIOError`` halfway (logged: "[Errno
11] Resource temporarily unavailable"); hivemind logs it and goes on, but the pipe is now read from the middle of a
request, and a later ``recv`` unpickles garbage (``EOFError: Ran out of input``, ``UnpicklingError``), which hivemind
does not catch: the DHT process exits with code 1, and every call of its trainer waits forever (a known hivemind
failure, e.g. gensyn-ai/rl-swarm issues 77 and 102; hivemind PR 660 would only catch the first error). In this
project's CI a test's DHT process died so (exit code 1) and the next call waited 600 s.

:class:`WholeRequests` wraps the DHT process's end of the pipe: ``recv`` reads in blocking mode (the event loop
woke it because bytes arrived: the rest of the request is being written), so a request is read whole or not at all.
:class:`SerializedRequests` wraps the creator's end: threads of one process send one request at a time (a request
is two writes when over 16 KiB: two threads' writes could otherwise interleave). Writers in other processes (forked
averagers) are not serialized with them; their requests are small. Left open: a writer killed halfway through a
request (SIGKILL of one averager process alone, not of its trainer) leaves the DHT process waiting for the rest.
"""

from __future__ import annotations

import os
import threading
from multiprocessing.connection import Connection
from typing import Any


class WholeRequests:
    """The DHT process's end of hivemind's request pipe (``DHT._inner_pipe``), read a whole request at a time.

    Args:
        connection: the ``multiprocessing.connection.Connection`` hivemind made.
    """

    def __init__(self, connection: Connection):
        self.connection = connection

    def recv(self) -> Any:
        descriptor = self.connection.fileno()
        was_blocking = os.get_blocking(descriptor)
        os.set_blocking(descriptor, True)  # wait for the rest of a request whose first bytes woke the loop
        try:
            return self.connection.recv()
        finally:
            os.set_blocking(descriptor, was_blocking)

    def __getattr__(self, name: str) -> Any:  # fileno() and poll(), as hivemind's loop uses them; close()
        return getattr(self.connection, name)


class SerializedRequests:
    """The creator's end of hivemind's request pipe (``DHT._outer_pipe``): one thread's request at a time.

    Args:
        connection: the ``multiprocessing.connection.Connection`` hivemind made.
    """

    def __init__(self, connection: Connection):
        self.connection = connection
        self._lock, self._lock_pid = threading.Lock(), os.getpid()

    def send(self, request: Any) -> None:
        if self._lock_pid != os.getpid():  # a forked child: the lock may have been copied held
            self._lock, self._lock_pid = threading.Lock(), os.getpid()
        with self._lock:
            self.connection.send(request)

    def __getattr__(self, name: str) -> Any:  # close(), fileno(), ...
        return getattr(self.connection, name)
