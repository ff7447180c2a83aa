"""Overlapping averaging rounds: a groupmate's part that arrives before this peer registered the group waits for it.

A groupmate that began its all-reduce sends us its part. If we have not registered that group yet (our leader's
"begin" message reached us a few milliseconds after the groupmate's part, or our own trigger comes later: a
delayed state round is triggered only once the gradient round and the optimizer step are done), hivemind 1.1.12's
``rpc_aggregate_part`` waits for the averager's ``_pending_groups_registered`` event. That event serves one round
at a time: with ``delay_grad_averaging`` / ``delay_state_averaging`` an averager runs several rounds at once (the
next epoch's round is pre-scheduled while the current one runs), another round has set the event already, and the
part is refused at once with ``BAD_GROUP_ID``. The sender then drops us from its round, and our reducer waits
``next_chunk_timeout`` for a part that never comes: both end with a partial average, we a few seconds late
(docs/notes/swarm-at-scale-measurements.md has the logs).

:class:`PatientGroupRegistration` lets such a part wait until its group is registered, at most the round's sender
timeout (a sender later than that is dropped from the round anyway). Parts for a round this averager already
finished (or left) are refused at once, also while its next round looks for a group (where hivemind's handler waits).
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from typing import AsyncIterator

from hivemind.averaging.group_info import GroupInfo
from hivemind.p2p import P2PContext
from hivemind.proto import averaging_pb2
from hivemind.utils.asyncio import achain, as_aiter

log = logging.getLogger(__name__)

# how often a waiting part checks whether its group got registered
REGISTRATION_POLL_SECONDS = 0.02
# group ids of this averager's finished rounds remembered, to refuse late parts for them at once
FINISHED_GROUPS_KEPT = 64


class PatientGroupRegistration:
    """Mixin for hivemind averager classes: a groupmate's part for a group this averager has not registered yet
    waits for it (at most the sender timeout: ``sender_timeout``, by default ``next_chunk_timeout``) instead of
    being refused, see the module docstring.

    ``wait_for_registration`` (class attribute, default True): False restores hivemind's handling, for benchmarks
    that compare the two; set it before the averager's process starts.
    """

    wait_for_registration = True

    def _finished_group_ids(self) -> deque:
        if "_finished_groups" not in self.__dict__:  # created in the averager's process, where rounds run
            self.__dict__["_finished_groups"] = deque(maxlen=FINISHED_GROUPS_KEPT)
        return self.__dict__["_finished_groups"]

    async def _aggregate_with_group(self, group_info: GroupInfo, min_vector_size: int, **kwargs):
        try:
            return await super()._aggregate_with_group(group_info, min_vector_size, **kwargs)
        finally:
            self._finished_group_ids().append(group_info.group_id)

    def _registration_timeout(self) -> float:
        # a sender later than this is dropped from the round by its groupmates anyway; hivemind sets it to
        # next_chunk_timeout unless given, and without either there is no sender timeout: wait a matchmaking time
        sender_timeout = self.allreduce_kwargs.get("sender_timeout")
        return sender_timeout if sender_timeout is not None else self.matchmaking_kwargs["min_matchmaking_time"]

    async def rpc_aggregate_part(
        self, stream: AsyncIterator[averaging_pb2.AveragingData], context: P2PContext
    ) -> AsyncIterator[averaging_pb2.AveragingData]:
        request = await anext(stream)
        group_id = request.group_id
        if self.wait_for_registration and not self._group_known(group_id):
            loop = asyncio.get_running_loop()
            deadline = loop.time() + self._registration_timeout()
            while not self._group_known(group_id) and loop.time() < deadline:
                await asyncio.sleep(REGISTRATION_POLL_SECONDS)
            if group_id not in self._running_groups:
                log.debug(f"{self.prefix}: a part from {context.remote_id} for a group that is not running is refused")
        if group_id not in self._running_groups and group_id in self._finished_group_ids():
            # refused now: hivemind's handler would wait for this averager's next group to be registered (its
            # matchmaking clears the event it waits on), and the sender waited next_chunk_timeout for this peer's
            # results: 10 s of a 1.3 s epoch where this peer had left the round (test_byzantine_swarm.py's nan case)
            yield averaging_pb2.AveragingData(code=averaging_pb2.BAD_GROUP_ID)
            return
        # hivemind's handler, given the part it would have read itself
        async for message in super().rpc_aggregate_part(achain(as_aiter(request), stream), context):
            yield message

    def _group_known(self, group_id: bytes) -> bool:
        """Whether the group's round is running or already finished here."""
        return group_id in self._running_groups or group_id in self._finished_group_ids()
