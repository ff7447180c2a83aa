"""Each member checks every other member's reduced slice before applying it (issue 24, item 9).

The arithmetic is :mod:`lightning_swarm.reducer_checks`; this is the plumbing around hivemind's all-reduce:

- **the reducer** (:class:`~lightning_swarm.hivemind_ext.robust_allreduce.RobustTensorPartReducer` with statements
  on) makes each part's result an exact combination of the parts and attaches a 56-byte header to each sender's
  result message (``AveragingData.peer_id``, which hivemind leaves empty in results): that sender's coefficient and the reducer's own
  (its coefficient, the virtual part's mass, its weighted residual, its weight share, the senders it accepted);
- **each sender** keeps, per reducer and part, the header (:func:`lightning_swarm.reducer_checks.parse_header`), the
  codec's rounding bound of the result message (:func:`message_rounding`), the decoded result and its own part;
- **after the round**, before any result is applied, the senders exchange three small messages each way per pair
  (``rpc_reducer_report``, :class:`ReportMailbox`): a commitment ``sha256(nonce)``, then the nonce, then each one's
  reports on every other reducer's slice, projected on random sign vectors seeded by ``sha256(group id, all nonces)``:
  a seed that nobody, the reducer included, knew while the results were sent, nor could choose afterwards;
- **each sender checks** every other reducer's slice (:func:`lightning_swarm.reducer_checks.check_slice`). A slice
  that fails is not applied (the local values stay, as when a reducer fails), the reducer is named in one log line
  and kept out of this peer's later groups (:meth:`ReportMailbox.exclude_peer`: a leader refuses its join requests,
  a member leaves a group that holds it). A slice that can't be checked (a member's report missing or malformed)
  is not applied either, and nobody is excluded for it.

Private hivemind names used here are listed in :mod:`lightning_swarm.hivemind_ext.private_api`.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import os
from typing import AsyncIterator, Dict, List, Optional, Sequence, Set, Tuple

import numpy as np
import torch
from hivemind.compression.serialization import deserialize_torch_tensor, serialize_torch_tensor
from hivemind.p2p import P2PContext, PeerID
from hivemind.proto import averaging_pb2, runtime_pb2

from lightning_swarm import reducer_checks as rc
from lightning_swarm.wire_checks import BLOCKWISE_BLOCKSIZE, MalformedTensor, check_tensor_message, compression_name

log = logging.getLogger(__name__)

PHASE_COMMIT, PHASE_NONCE, PHASE_REPORT = 1, 2, 3
NONCE_BYTES = 32
DEFAULT_VERIFICATION_TIMEOUT = 30.0  # seconds a member waits for the others' messages of one phase
MAX_MAILBOXES = 64  # rounds in flight whose messages a peer keeps


class MalformedMessage(ValueError):
    """A member's verification message that does not fit its phase's layout."""


def message_rounding(message: runtime_pb2.Tensor, decoded: torch.Tensor) -> float:
    """An upper bound of the L2 rounding error in a (checked) result message, from its header and decoded values
    (:func:`lightning_swarm.reducer_checks.rounding_bound`)."""
    name, info = rounding_info(message)
    return rc.rounding_bound(name, decoded, info)


def parse_verification_message(message: averaging_pb2.AveragingData, group_id: bytes, phase: int,
                               report_length: int) -> bytes | np.ndarray:
    """A member's message of ``phase``, checked: the group, the phase (``weight``), 32 bytes in ``peer_id`` (phases 1
    and 2), a float64 vector of exactly ``report_length`` values (phase 3, checked before decoding; its fields by
    :func:`lightning_swarm.reducer_checks.decode_report`). Returns those bytes, or the report vector."""
    if message.group_id != group_id:
        raise MalformedMessage("another group's message")
    if message.weight != float(phase):
        raise MalformedMessage(f"a message of phase {message.weight!r} where phase {phase} was expected")
    if phase in (PHASE_COMMIT, PHASE_NONCE):
        if len(message.peer_id) != NONCE_BYTES:
            raise MalformedMessage(f"{len(message.peer_id)} bytes of commitment or nonce, not {NONCE_BYTES}")
        return bytes(message.peer_id)
    if not message.HasField("tensor_part"):
        raise MalformedMessage("a report without its values")
    try:
        check_tensor_message(message.tensor_part, (report_length,), torch.float64)
        if compression_name(message.tensor_part) != "NONE" or message.tensor_part.dtype != "float64":
            raise MalformedTensor("a report must be uncompressed float64")
        values = deserialize_torch_tensor(message.tensor_part)
    except MalformedTensor as e:
        raise MalformedMessage(f"report values: {e}") from None
    return values.numpy().astype(np.float64, copy=False)


class _Mailbox:
    """The verification messages of one round, by phase and sender (the first one of each is kept)."""

    def __init__(self, members: Sequence[PeerID]):
        self.members = set(members)
        self.messages: Dict[Tuple[int, PeerID], averaging_pb2.AveragingData] = {}
        self.changed = asyncio.Event()

    def put(self, phase: int, sender: PeerID, message: averaging_pb2.AveragingData) -> None:
        self.messages.setdefault((phase, sender), message)
        self.changed.set()

    async def wait(self, phase: int, senders: Sequence[PeerID], timeout: float) -> Dict[PeerID, averaging_pb2.AveragingData]:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while not all((phase, peer) in self.messages for peer in senders):
            self.changed.clear()
            left = deadline - loop.time()
            if left <= 0:
                break
            try:
                await asyncio.wait_for(self.changed.wait(), left)
            except asyncio.TimeoutError:
                break
        return {peer: self.messages[(phase, peer)] for peer in senders if (phase, peer) in self.messages}


class ReportMailbox:
    """Mixin for hivemind averagers (with :class:`~lightning_swarm.hivemind_ext.robust_allreduce.RobustAveraging`):
    the ``rpc_reducer_report`` handler, the rounds' mailboxes and the peers this one keeps out of its groups.

    Args:
        verification_timeout: seconds a member waits for the others' messages of one phase.
    """

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        # hivemind caches a servicer class's RPC handlers in class attributes a subclass inherits: collect ours
        cls._rpc_handlers = None
        cls._stub_type = None

    def __init__(self, *args, verification_timeout: float = DEFAULT_VERIFICATION_TIMEOUT, **kwargs):
        if not verification_timeout > 0:
            raise ValueError(f"verification_timeout must be a positive number of seconds, got {verification_timeout!r}")
        self.verification_timeout = verification_timeout
        self._mailboxes: Dict[bytes, _Mailbox] = {}
        self.excluded_peers: Dict[PeerID, str] = {}  # averager process: peer -> why
        super().__init__(*args, **kwargs)

    async def rpc_reducer_report(self, request: averaging_pb2.AveragingData, context: P2PContext
                                 ) -> averaging_pb2.AveragingData:
        mailbox = self._mailboxes.get(request.group_id)
        if mailbox is None or context.remote_id not in mailbox.members or request.weight not in (1.0, 2.0, 3.0):
            return averaging_pb2.AveragingData(code=averaging_pb2.BAD_GROUP_ID)
        mailbox.put(int(request.weight), context.remote_id, request)
        return averaging_pb2.AveragingData(code=averaging_pb2.NO_CODE)

    async def rpc_join_group(self, request: averaging_pb2.JoinRequest, context: P2PContext
                             ) -> AsyncIterator[averaging_pb2.MessageFromLeader]:
        if context.remote_id in self.excluded_peers:
            yield averaging_pb2.MessageFromLeader(code=averaging_pb2.PROTOCOL_VIOLATION)
            return
        async for message in super().rpc_join_group(request, context):
            yield message

    def exclude_peer(self, peer: PeerID, reason: str) -> None:
        """Keep ``peer`` out of this peer's later groups (for the rest of the run)."""
        if peer not in self.excluded_peers:
            self.excluded_peers[peer] = reason
            log.warning(f"[lightning_swarm] averaging: peer {peer} is kept out of this peer's later groups: {reason}")

    def open_mailbox(self, group_id: bytes, members: Sequence[PeerID]) -> None:
        while len(self._mailboxes) >= MAX_MAILBOXES:
            self._mailboxes.pop(next(iter(self._mailboxes)))
        self._mailboxes[group_id] = _Mailbox(members)

    def close_mailbox(self, group_id: bytes) -> None:
        self._mailboxes.pop(group_id, None)

    async def _send_all(self, peers: Sequence[PeerID], message: averaging_pb2.AveragingData) -> None:
        async def send(peer):
            try:
                stub = type(self).get_stub(self._p2p, peer, namespace=self.prefix)
                await asyncio.wait_for(stub.rpc_reducer_report(message), self.verification_timeout)
            except Exception as e:  # its absence is what the others see
                log.debug(f"could not send a verification message to {peer}: {e!r}")
        await asyncio.gather(*(send(peer) for peer in peers))

    async def verify_results(self, runner, group_id: bytes) -> Set[int]:
        """Run the exchange of a finished round's results with the other senders and check each reducer's slice.
        Returns the indices (in the group's order) of the reducers whose slices are not to be applied."""
        peers: List[PeerID] = list(runner.ordered_peer_ids)
        me = peers.index(runner.peer_id)
        senders: List[PeerID] = list(runner.sender_peer_ids)
        others = [peer for peer in senders if peer != runner.peer_id]
        parts_by_reducer = list(runner.tensor_part_container.num_parts_by_peer)
        reducers = [r for r, parts in enumerate(parts_by_reducer) if parts and r != me]
        if runner.peer_id not in senders or not others or not any(parts_by_reducer):
            return set()  # (a sender with no slice to check still reports: the others need its projections)
        mailbox = self._mailboxes[group_id]
        timeout = self.verification_timeout
        nonce = os.urandom(NONCE_BYTES)
        length = rc.report_length(parts_by_reducer)

        async def phase(number: int, payload: averaging_pb2.AveragingData) -> Dict[PeerID, object]:
            payload.group_id, payload.weight = group_id, float(number)
            await self._send_all(others, payload)
            received = await mailbox.wait(number, others, timeout)
            parsed = {}
            for peer, message in received.items():
                try:
                    parsed[peer] = parse_verification_message(message, group_id, number, length)
                except MalformedMessage as e:
                    log.warning(f"[lightning_swarm] averaging: refused a verification message of {peer}: {e}")
            return parsed

        commits = await phase(PHASE_COMMIT, averaging_pb2.AveragingData(peer_id=hashlib.sha256(nonce).digest()))
        nonces = await phase(PHASE_NONCE, averaging_pb2.AveragingData(peer_id=nonce))
        nonces = {peer: value for peer, value in nonces.items()
                  if peer in commits and hashlib.sha256(value).digest() == commits[peer]}
        if len(nonces) < len(others):
            missing = sorted(str(peer) for peer in others if peer not in nonces)
            log.warning(f"[lightning_swarm] averaging: no verification this round (no valid nonce from {missing}): "
                        f"the other members' slices are not applied")
            return set(reducers)
        nonces[runner.peer_id] = nonce
        seed = hashlib.sha256(group_id + b"".join(nonces[peer] for peer in senders)).digest()
        own_reports = await asyncio.get_running_loop().run_in_executor(
            None, _member_reports, runner, seed, [r for r, parts in enumerate(parts_by_reducer) if parts and r != me],
            senders)
        values = rc.encode_report([own_reports.get(r) for r in range(len(peers))], parts_by_reducer)
        reports = await phase(PHASE_REPORT, averaging_pb2.AveragingData(
            tensor_part=serialize_torch_tensor(torch.from_numpy(values))))
        decoded: Dict[PeerID, List[Optional[rc.SliceReport]]] = {runner.peer_id: [own_reports.get(r) for r in
                                                                                 range(len(peers))]}
        for peer, vector in reports.items():
            try:
                decoded[peer] = rc.decode_report(vector, parts_by_reducer)
            except rc.MalformedReport as e:
                log.warning(f"[lightning_swarm] averaging: refused the verification report of {peer}: {e}")
        refused = set()
        for r in reducers:
            reducer = peers[r]
            reporters = [peer for peer in senders if peer != reducer]
            headers = runner.tensor_part_container.result_headers(r)
            slice_reports = [decoded.get(peer, [None] * len(peers))[r] for peer in reporters]
            if headers is None:
                reason = "unverifiable: its results came without a well-formed header or did not all arrive"
            else:
                reason = rc.check_slice(headers, slice_reports, reducer_sends=reducer in senders)
            if reason is None:
                continue
            refused.add(r)
            log.warning(f"[lightning_swarm] averaging: refused the slice reduced by {reducer} ({parts_by_reducer[r]} "
                        f"parts): {reason}; kept the local values there")
            if not reason.startswith("unverifiable"):
                self.exclude_peer(reducer, f"its reduced slice failed the check ({reason})")
        return refused


def _member_reports(runner, seed: bytes, reducers: Sequence[int], senders: Sequence[PeerID]
                    ) -> Dict[int, rc.SliceReport]:
    """This member's reports on the slices it can report on (complete, well-formed headers)."""
    reports = {}
    peers = list(runner.ordered_peer_ids)
    for r in reducers:
        received = runner.tensor_part_container.received_parts(r)
        if received is None:
            continue
        members = len([peer for peer in senders if peer != peers[r]])
        reports[r] = rc.member_report(seed, r, received, members)
    return reports


def zero_slices(updates: Sequence[torch.Tensor], container, refused: Set[int]) -> None:
    """Set the refused reducers' slices of the updates (deltas, in hivemind's output order: the concatenation of the
    flattened tensors is the reducers' slices one after the other) to zero."""
    if not refused:
        return
    flat_offsets, offset = [], 0
    for size in container.slice_sizes:
        flat_offsets.append((offset, offset + size))
        offset += size
    position = 0
    for update in updates:
        flat = update.view(-1)
        start, end = position, position + flat.numel()
        for r in refused:
            low, high = max(start, flat_offsets[r][0]), min(end, flat_offsets[r][1])
            if low < high:
                flat[low - start:high - start].zero_()
        position = end


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
    from lightning_swarm.compression import dynamic_code, uniform_code

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
