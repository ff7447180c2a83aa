"""What a member keeps of a round's results for the check of the reducers, and the reducer's header on each result
(see :mod:`lightning_swarm.hivemind_ext.result_verification`). Private hivemind names used here are listed in
:mod:`lightning_swarm.hivemind_ext.private_api` (as ``result_verification``)."""

from __future__ import annotations

from typing import Dict, List, Optional, Set, Tuple

import numpy as np
import torch
from hivemind.p2p import PeerID
from hivemind.proto import averaging_pb2, runtime_pb2

from lightning_swarm import reducer_checks as rc
from lightning_swarm.wire_checks import BLOCKWISE_BLOCKSIZE, compression_name


def rounding_info(message: runtime_pb2.Tensor) -> Tuple[str, Optional[tuple]]:
    """What :func:`lightning_swarm.reducer_checks.rounding_bound` needs of a (checked) result message besides its
    values: its compression name and, for 8-bit ones, (absmax per block or None, codebook), copied."""
    name = compression_name(message)
    buffer = message.buffer
    if name == "BLOCKWISE_8BIT":
        blocks = int(np.frombuffer(buffer, count=1, dtype=np.int64)[0])
        absmax = np.frombuffer(buffer, offset=16, count=blocks, dtype=np.float32).copy()
        return name, (absmax, np.frombuffer(buffer, offset=16 + 4 * blocks, count=256, dtype=np.float32).copy())
    if name in ("UNIFORM_8BIT", "QUANTILE_8BIT"):
        size = int(np.frombuffer(buffer, count=1, dtype=np.int64)[0])
        return name, (None, np.frombuffer(buffer, offset=8, count=size, dtype=np.float32).copy())
    return name, None


def local_rounding(name: str, local: torch.Tensor) -> float:
    """A bound of the codec's rounding of this member's own part as it sent it (the same compression type as the
    result it got back; for 8-bit blocks, each block's absmax with the coarser of the candidate codebooks)."""
    if name == "BLOCKWISE_8BIT":
        flat = local.reshape(-1).float()
        blocks = -(-flat.numel() // BLOCKWISE_BLOCKSIZE)
        padded = torch.zeros(blocks * BLOCKWISE_BLOCKSIZE)
        padded[:flat.numel()] = flat.abs()
        absmax = padded.view(blocks, BLOCKWISE_BLOCKSIZE).amax(dim=1).numpy()
        return rc.rounding_bound(name, local, (absmax, _coarse_code()))
    return rc.rounding_bound(name, local)


def _coarse_code() -> np.ndarray:
    from lightning_swarm.wire_checks import dynamic_code, uniform_code

    codes = [dynamic_code().numpy(), uniform_code().numpy()]
    gaps = [np.max(np.diff(np.concatenate(([-1.0], np.sort(c), [1.0])))) for c in codes]
    return codes[int(np.argmax(gaps))]


class ResultRecords:
    """Mixin for hivemind's ``TensorPartContainer`` (first in the bases): with ``keep_results``, keeps what
    :func:`_member_reports` needs of each reducer's results (this peer's part, the decoded delta, the header and the
    rounding information of each message), and each reducer's slice size (for :func:`zero_slices`).

    Args:
        keep_results: keep them (verification on).
        own_index: this peer's index in the group (its own results are not kept).
    """

    def __init__(self, *args, keep_results: bool = False, own_index: int = -1, **kwargs):
        super().__init__(*args, **kwargs)
        self.keep_results, self.own_index = keep_results, own_index
        self.slice_sizes = [sum(int(part.numel()) for part, _ in parts) for parts in self._input_parts_by_peer]
        self._kept: Dict[Tuple[int, int], Tuple[torch.Tensor, torch.Tensor]] = {}
        self._messages: Dict[Tuple[int, int], Tuple[Optional[rc.ResultHeader], str, Optional[tuple]]] = {}
        self._incomplete: Set[int] = set()
        self.failed_reducers: Set[int] = set()  # reducers whose results did not come (hivemind gave up on them)

    def record_result_message(self, peer_index: int, part_index: int, message: averaging_pb2.AveragingData) -> None:
        """Called with each (checked) result message of a reducer, before it is decoded."""
        if not self.keep_results:
            return
        try:
            header = rc.parse_header(message.peer_id)
        except rc.MalformedReport:
            header = None
        name, info = rounding_info(message.tensor_part)
        self._messages[(peer_index, part_index)] = (header, name, info)

    def keep_result(self, peer_index: int, part_index: int, part: torch.Tensor, refused: bool) -> None:
        if not self.keep_results or peer_index == self.own_index:
            return
        if refused:
            self._incomplete.add(peer_index)
            return
        self._kept[(peer_index, part_index)] = (self._input_parts_by_peer[peer_index][part_index][0], part)

    def mark_failed(self, peer_index: int) -> None:
        self._incomplete.add(peer_index)
        self.failed_reducers.add(peer_index)

    def result_headers(self, peer_index: int) -> Optional[List[rc.ResultHeader]]:
        """The headers of every part of that reducer's slice (None if one is missing or malformed)."""
        if peer_index in self._incomplete:
            return None
        headers = [self._messages.get((peer_index, p), (None,))[0] for p in range(self.num_parts_by_peer[peer_index])]
        return None if any(h is None for h in headers) else headers

    def received_parts(self, peer_index: int) -> Optional[List[rc.ReceivedPart]]:
        """Every part of that reducer's slice as :class:`~lightning_swarm.reducer_checks.ReceivedPart` (None if
        one is missing, refused, or came without a well-formed header)."""
        headers = self.result_headers(peer_index)
        if headers is None:
            return None
        parts = []
        for p, header in enumerate(headers):
            if (peer_index, p) not in self._kept:
                return None
            local, delta = self._kept[(peer_index, p)]
            _, name, info = self._messages[(peer_index, p)]
            parts.append(rc.ReceivedPart(local, delta, header, rc.rounding_bound(name, delta, info),
                                         local_rounding(name, local)))
        return parts

    def release_results(self) -> None:
        self._kept.clear()
        self._messages.clear()


class _RecordingStub:
    """A reducer's stub whose result messages are shown to ``record`` (part index, message) as they pass."""

    def __init__(self, stub, record):
        self._stub, self._record = stub, record

    async def rpc_aggregate_part(self, requests, *args, **kwargs):
        results = await self._stub.rpc_aggregate_part(requests, *args, **kwargs)

        async def recorded():
            index = 0
            async for message in results:
                if message.code == averaging_pb2.AVERAGED_PART:
                    self._record(index, message)
                    index += 1
                yield message
        return recorded()


class StatedResults:
    """Mixin for hivemind's ``AllReduceRunner`` (before :class:`~lightning_swarm.hivemind_ext.part_checks.
    CheckedPartStreams` in the bases): as a reducer, attaches each part's header to the result it sends each sender
    (the reducer's ``statements``); as a sender, shows every result message to the container
    (:meth:`ResultRecords.record_result_message`)."""

    async def _accumulate_parts_streaming(self, stream, sender_index: int):
        index = 0
        statements = getattr(self.tensor_part_reducer, "statements", None)
        async for message in super()._accumulate_parts_streaming(stream, sender_index):
            if message.code == averaging_pb2.AVERAGED_PART and statements is not None:
                statement = statements.get(index)
                if statement is not None:
                    message.peer_id = rc.encode_header(statement, sender_index)
                index += 1
            yield message

    def _get_peer_stub(self, peer: PeerID):
        stub = super()._get_peer_stub(peer)
        container = self.tensor_part_container
        if not getattr(container, "keep_results", False):
            return stub
        peer_index = self.ordered_peer_ids.index(peer)
        return _RecordingStub(stub, lambda index, message: container.record_result_message(peer_index, index, message))
