"""A group member's gathered data (its bandwidth, averaging mode and user data), checked before hivemind reads it.

Every member of an averaging group sends the others a small msgpack blob when the group forms. hivemind 1.1.12's
``DecentralizedAverager._aggregate_with_group`` decodes all of them at once and computes the group's load balance
from the bandwidths: one member whose blob does not decode, names an unknown mode or declares a NaN or negative
bandwidth makes that raise, and the round fails for the whole group. :class:`CheckedGatheredData` (a mixin for
hivemind averagers, after :class:`~lightning_swarm.hivemind_ext.auth_guards.AuthenticatedAveraging` in the bases,
which unwraps the join proofs first) replaces a malformed member's blob by that of a client without data (bandwidth
0: it reduces nothing, and its parts are still averaged if they are well-formed, see :mod:`.part_checks`). Every
honest member sees the same blobs, so all of them compute the same load balance. The member is named in the log.
"""

from __future__ import annotations

import logging
import math
from typing import Any, Optional

from hivemind.averaging.allreduce import AveragingMode
from hivemind.averaging.group_info import GroupInfo

from lightning_swarm.logs import RateLimitedLog

logger = logging.getLogger(__name__)

MAX_GATHERED_BYTES = 2**20  # hivemind's own blob is a few dozen bytes (a join proof adds a token and a signature)
MAX_BANDWIDTH = 1e15  # values/s; hivemind's default declaration is 1e8 or none
_MODES = frozenset(mode.value for mode in AveragingMode)


def gathered_problem(blob: Any, serializer) -> Optional[str]:
    """Why a member's gathered blob would break hivemind's decoding of the group (None if it would not).

    Args:
        blob: the member's bytes from ``GroupInfo.gathered``.
        serializer: the averager's serializer (hivemind's MSGPackSerializer).
    """
    if not isinstance(blob, bytes) or len(blob) > MAX_GATHERED_BYTES:
        return f"gathered data of {len(blob) if isinstance(blob, bytes) else type(blob).__name__} bytes"
    try:
        fields = serializer.loads(blob)
    except Exception:
        return "gathered data that does not decode"
    if not isinstance(fields, (list, tuple)) or len(fields) != 3:
        return "gathered data that is not (bandwidth, mode, data)"
    bandwidth, mode, user_bytes = fields
    if bandwidth is not None and (isinstance(bandwidth, bool) or not isinstance(bandwidth, (int, float))
                                  or not math.isfinite(bandwidth) or not 0 <= bandwidth <= MAX_BANDWIDTH):
        return f"a bandwidth of {bandwidth!r:.40}"
    if isinstance(mode, bool) or mode not in _MODES:
        return f"an averaging mode of {mode!r:.40}"
    if not isinstance(user_bytes, bytes):
        return "user data that is not bytes"
    try:
        serializer.loads(user_bytes)
    except Exception:
        return "user data that does not decode"
    return None


class CheckedGatheredData:
    """Mixin for hivemind averager classes: see the module docstring."""

    async def _aggregate_with_group(self, group_info: GroupInfo, min_vector_size: int, **kwargs):
        checked = []
        for peer_id, blob in zip(group_info.peer_ids, group_info.gathered):
            problem = gathered_problem(blob, self.serializer)
            if problem is not None:
                self._gathered_log(logging.WARNING, f"[lightning_swarm] averaging: group member {peer_id} sent "
                                                    f"{problem}: averaged with it as a client without data")
                blob = self.serializer.dumps([0.0, AveragingMode.CLIENT.value, self.serializer.dumps(None)])
            checked.append(blob)
        if tuple(checked) != tuple(group_info.gathered):
            group_info = GroupInfo(group_info.group_id, group_info.peer_ids, tuple(checked))
        return await super()._aggregate_with_group(group_info, min_vector_size, **kwargs)

    @property
    def _gathered_log(self) -> RateLimitedLog:
        if "_gathered_rate_limited_log" not in self.__dict__:  # made in the averager's process, where rounds run
            self.__dict__["_gathered_rate_limited_log"] = RateLimitedLog(logger, period=300.0)
        return self.__dict__["_gathered_rate_limited_log"]
