"""A group member's malformed gathered data: replaced by a client's, so that the others' round goes on.

The "round" here is what hivemind 1.1.12's ``DecentralizedAverager._aggregate_with_group`` does with the blobs before
the all-reduce (decode each, load-balance by bandwidth), with hivemind's own serializer and ``load_balance_peers``."""

from __future__ import annotations

import asyncio
import logging

import pytest
from hivemind.averaging.allreduce import AveragingMode
from hivemind.averaging.group_info import GroupInfo
from hivemind.averaging.load_balancing import load_balance_peers
from hivemind.p2p import PeerID
from hivemind.utils.serializer import MSGPackSerializer

from lightning_swarm.hivemind_ext.gathered_checks import CheckedGatheredData, gathered_problem

S = MSGPackSerializer
HONEST = S.dumps([1e8, AveragingMode.NODE.value, S.dumps(7)])


class HivemindGroupDecoding:
    """hivemind's first lines of ``_aggregate_with_group``: what a malformed blob breaks."""

    serializer = S

    async def _aggregate_with_group(self, group_info: GroupInfo, min_vector_size: int, **kwargs):
        bandwidths, mode_ids, user_bytes = zip(*map(self.serializer.loads, group_info.gathered))
        user_gathered = dict(zip(group_info.peer_ids, map(self.serializer.loads, user_bytes)))
        modes = tuple(map(AveragingMode, mode_ids))
        download = [b if m != AveragingMode.CLIENT else 0.0 for b, m in zip(bandwidths, modes)]
        return load_balance_peers(1000, download, 0), user_gathered


class Checked(CheckedGatheredData, HivemindGroupDecoding):
    pass


MALFORMED = {
    "not msgpack": b"\xc1\xc1\xc1",
    "a NaN bandwidth": S.dumps([float("nan"), 0, S.dumps(None)]),
    "a negative bandwidth": S.dumps([-5.0, 0, S.dumps(None)]),
    "an unknown mode": S.dumps([1e8, 9, S.dumps(None)]),
    "two fields": S.dumps([1e8, 0]),
    "user data not bytes": S.dumps([1e8, 0, 5]),
    "user data not msgpack": S.dumps([1e8, 0, b"\xc1"]),
    "a huge blob": b"\x00" * (2**20 + 1),
}


@pytest.mark.parametrize("case", sorted(MALFORMED))
def test_a_malformed_member_is_averaged_with_as_a_client_and_named(case, caplog):
    peers = [PeerID(b"\x00\x01a"), PeerID(b"\x00\x01b"), PeerID(b"\x00\x03bad")]
    group = GroupInfo(b"g", tuple(peers), (HONEST, HONEST, MALFORMED[case]))
    with pytest.raises(Exception):  # hivemind alone: the whole group's round fails
        asyncio.run(HivemindGroupDecoding()._aggregate_with_group(group, 0))
    with caplog.at_level(logging.WARNING):
        fractions, gathered = asyncio.run(Checked()._aggregate_with_group(group, 0))
    assert list(fractions) == [500, 500, 0] and gathered == {peers[0]: 7, peers[1]: 7, peers[2]: None}
    assert str(peers[2]) in caplog.text and "client without data" in caplog.text


def test_honest_blobs_pass_unchanged():
    assert gathered_problem(HONEST, S) is None
    assert gathered_problem(S.dumps([None, AveragingMode.CLIENT.value, S.dumps(None)]), S) is None
    group = GroupInfo(b"g", (PeerID(b"\x00\x01a"), PeerID(b"\x00\x01b")), (HONEST, HONEST))
    fractions, _ = asyncio.run(Checked()._aggregate_with_group(group, 0))
    assert list(fractions) == [500, 500]
