"""A SwarmDHT's request pipe: a request that arrives in parts is served, big requests from many threads too."""

from __future__ import annotations

import os
import struct
import threading
import time
from functools import partial
from multiprocessing.reduction import ForkingPickler

from hivemind.utils.mpfuture import MPFuture

from lightning_swarm.hivemind_ext.lifetime import SwarmDHT

LOCAL = ["/ip4/127.0.0.1/tcp/0"]


async def _length(dht, node, payload: bytes = b"") -> int:
    return len(payload)


def test_a_request_that_arrives_in_two_parts_is_served():
    """The DHT process wakes on a request's first bytes; hivemind 1.1.12 then reads the pipe non-blocking, raises
    BlockingIOError halfway, loses the request (its caller waits forever) and reads the rest as a new request."""
    dht = SwarmDHT(start=True, host_maddrs=LOCAL)
    try:
        future = MPFuture()
        request = bytes(ForkingPickler.dumps(("_run_coroutine", [], dict(coro=partial(_length, payload=b"x" * 100),
                                                                          future=future))))
        descriptor = dht._outer_pipe.fileno()
        os.write(descriptor, struct.pack("!i", len(request)) + request[:10])  # the length and a few bytes
        time.sleep(1.0)  # the DHT process has woken and started reading
        os.write(descriptor, request[10:])
        assert future.result(timeout=10) == 100
        assert dht.run_coroutine(_length) == 0 and dht.is_alive()  # and it goes on serving
    finally:
        dht.shutdown()


def test_big_requests_from_many_threads_are_all_served():
    """Requests over 16 KiB are two writes each: threads sending at once must not interleave them."""
    dht = SwarmDHT(start=True, host_maddrs=LOCAL)
    answers, errors = [], []

    def caller(index: int) -> None:
        try:
            for repeat in range(10):
                size = 40_000 + 1000 * index + repeat
                answers.append(dht.run_coroutine(partial(_length, payload=b"y" * size)) == size)
        except Exception as e:  # noqa: BLE001 (reported below)
            errors.append(repr(e))

    try:
        threads = [threading.Thread(target=caller, args=(index,)) for index in range(6)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=60)
        assert not errors and answers == [True] * 60
        assert dht.is_alive()
    finally:
        dht.shutdown()
