"""The answering side of a stream keeps it open until the asking side closes it, so its last messages arrive.

hivemind 1.1.12's p2p layer closes a stream handler's socket as soon as the handler returns, while the caller may
still be reading; p2pd (go-libp2p-daemon's ``doStreamPipe``) then closes the libp2p stream, and resets it when its
other copy fails, and what the caller's daemon had not yet handed to the caller is lost. On a loaded machine that
cut off the last messages of a stream in 1-2 of 114 fresh 3-peer rounds (three swarms at once on 2 cores), each:

- a leader's BEGIN_ALLREDUCE (the last message of ``rpc_join_group``): the follower read the end of the stream, gave
  up on that leader and looked for another while the leader counted it in; the leader's reducer then waited
  ``next_chunk_timeout`` for its parts (without one, for ever: CI's hung test_lying_reducer run);
- a reducer's results to a client-mode sender (the last 1-8 of 8, all sent in one burst at the end): the sender
  counted the reducer failed and the round went unchecked for the whole group.

The asking side closes the stream once it has what it waits for: hivemind's follower right after BEGIN_ALLREDUCE
(``Matchmaking._request_join_group`` closes its stream in ``finally``), this project's senders once every result is
in (:mod:`~lightning_swarm.hivemind_ext.part_checks`), a newcomer once the last part its donor announced is in
(:mod:`~lightning_swarm.hivemind_ext.state_download`; the donor's stream ended the same way: "tensor 0 truncated: the
stream ended after 432 of 580 parts"). :func:`held_open` keeps the answering side's handler alive
after its last message until then: the p2p layer ends it as soon as the caller closes, at most
:data:`STREAM_LINGER_SECONDS` later (what a caller that reads until the end waits more).
"""

from __future__ import annotations

import asyncio
import time
from typing import AsyncIterator, Callable, Optional, TypeVar

# seconds a handler stays open after its last message, waiting for the caller to close the stream
STREAM_LINGER_SECONDS = 2.0

Message = TypeVar("Message")


async def held_open(messages: AsyncIterator[Message],
                    on_end: Optional[Callable[[bool, float], None]] = None) -> AsyncIterator[Message]:
    """Pass on a stream handler's ``messages``; after the last one, stay open until the caller closes the stream (the
    p2p layer then cancels this generator) or :data:`STREAM_LINGER_SECONDS` pass. Nothing is held after a handler
    that sent nothing (the caller gets its end at once).

    Args:
        messages: what the handler sends.
        on_end: called once the hold ends, with whether the caller closed the stream (False: the hold ran out) and the
            seconds since the last message.
    """
    sent = False
    async for message in messages:
        sent = True
        yield message
    if not sent:
        return
    last_sent = time.monotonic()
    try:
        await asyncio.sleep(STREAM_LINGER_SECONDS)
    except asyncio.CancelledError:
        if on_end is not None:
            on_end(True, time.monotonic() - last_sent)
        raise
    if on_end is not None:
        on_end(False, time.monotonic() - last_sent)
