"""Each member checks every other member's reduced slice before applying it (issue 24, item 9).

The arithmetic is :mod:`lightning_swarm.reducer_checks`; this is the plumbing around hivemind's all-reduce:

- **the reducer** (:class:`~lightning_swarm.hivemind_ext.robust_allreduce.RobustTensorPartReducer` with statements
  on) makes each part's result an exact combination of the parts and attaches a 56-byte header to each sender's
  result message (``AveragingData.peer_id``, which hivemind leaves empty in results): that sender's coefficient and the reducer's own
  (its coefficient, the virtual part's mass, its weighted residual, its weight share, the senders it accepted);
- **each sender** keeps, per reducer and part, the header (:func:`lightning_swarm.reducer_checks.parse_header`), the
  codec's rounding bound of the result message (:func:`message_rounding`), the decoded result and its own part;
- **each reducer** keeps, per part of its slice, the parts it decoded, its result and its statement
  (``RobustTensorPartReducer.reduced``);
- **after the round**, before any result is applied, the members (the senders, and the reducers that send nothing)
  exchange three small messages each way per pair (``rpc_reducer_report``, :class:`ReportMailbox`): a commitment
  ``sha256(nonce)``, then the nonce, then each one's reports on every other reducer's slice and its claims on its own
  (:func:`lightning_swarm.reducer_checks.reducer_claims`), projected on random sign vectors seeded by
  ``sha256(group id, the members, their nonces)``: a seed that nobody, the reducer included, knew while the results
  were sent, nor could choose afterwards;
- **a member that failed during the round** (its results or parts did not come by ``next_chunk_timeout``: it died,
  most often) is named in the commitment of each member that saw it (a bit mask after the 32 bytes). Nobody waits
  for a named member; the check runs over the others (the survivors), its missing report stood in for by a massless
  one, so the slices it has no mass in are checked and applied (before, one death left every member of a group of 16
  its own values on 15/16 of the parameters). Once a member is named, the survivors' commitments are waited for at
  most ``FAILURE_GRACE`` timeouts more; a member still missing one then skips the check and says so with an empty
  nonce, which ends the others' check at once (nobody is blamed in a round that lost a member). The set of
  survivors is fixed before a member's own nonce is out, and each report carries the seed it was projected with: a
  member that ended up with another set has another seed, and its report is set aside, not held against it;
- **each sender checks** every other reducer's slice (:func:`lightning_swarm.reducer_checks.judge_slice`). A slice
  that fails is not applied (the local values stay, as when a reducer fails) and named in one log line. Where the
  reducer alone is to blame it is kept out of this peer's later groups (:meth:`ReportMailbox.exclude_peer`: a leader
  refuses its join requests, a member leaves a group that holds it); where a member's report contradicts the
  reducer's claim about it (a dispute: one of the two lies), both are kept out, each logged naming the other. A
  slice that can't be checked (a report or the claims missing or malformed) is not applied either, and nobody is
  blamed for it in that round; a member that withholds its messages (a commitment, a valid nonce, a well-formed
  report) in rounds it otherwise completed is kept out after a few such rounds
  (:class:`~lightning_swarm.reducer_checks.WithholdingRecord`).

Each message is a call that the callee answers with its own message of the same phase (once it has one, within the
timeout), so a pair with one reachable member exchanges both ways in one call: a client-mode member (it accepts no
connection) calls the others and nobody calls it. Two client-mode members can't reach each other: each deposits its
messages, signed with its identity key, with every reachable member (``rpc_reducer_relay``) and gets the other
client-mode members' back (:mod:`~lightning_swarm.hivemind_ext.relayed_messages`); a relay that answers after its
timeout without a slower member's record is asked again, until twice the timeout, and the whole exchange ends twice
the timeout after it began (``EXCHANGE_TIMEOUTS``: a relay that died costs no more). A relay can drop a message, not
alter it: one that serves an altered record is kept out, and a message only relays could bring counts against
nobody when it is missing.

Private hivemind names used here are listed in :mod:`lightning_swarm.hivemind_ext.private_api`.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import os
import tempfile
from typing import AsyncIterator, Callable, Dict, List, Optional, Sequence, Set, Tuple

import numpy as np
import torch
from hivemind.averaging.allreduce import AveragingMode
from hivemind.compression.serialization import deserialize_torch_tensor, serialize_torch_tensor
from hivemind.p2p import P2PContext, PeerID
from hivemind.proto import averaging_pb2, runtime_pb2

from lightning_swarm import reducer_checks as rc
from lightning_swarm.hivemind_ext import relayed_messages as relayed
from lightning_swarm.hivemind_ext.result_records import ResultRecords, StatedResults, rounding_info
from lightning_swarm.wire_checks import MalformedTensor, check_tensor_message, compression_name

__all__ = ["OtherSeed", "ReportMailbox", "ResultRecords", "SkippedCheck", "StatedResults", "failed_mask",
           "message_rounding", "parse_verification_message", "zero_slices"]

log = logging.getLogger(__name__)

PHASE_COMMIT, PHASE_NONCE, PHASE_REPORT = 1, 2, 3
NONCE_BYTES = 32
DEFAULT_VERIFICATION_TIMEOUT = 10.0  # seconds a member waits for the others' messages of one phase
MAX_MAILBOXES = 64  # rounds in flight whose messages a peer keeps
RELAY_MIN_WAIT = 0.5  # a relay that answers without some records sooner than this share of the timeout dropped them
# the whole exchange after a round (every phase, relays included) ends this many verification timeouts after it
# began: a relay that died after the all-reduce made a client-mode member wait twice the timeout for it in each
# phase and then the timeout again, past the optimizer's averaging_timeout, which threw the whole round away
# ("Averaging gradients failed with TimeoutError()": local gradients, the peers' parameters apart)
EXCHANGE_TIMEOUTS = 2.0
# once a member is known to have failed during the round, the others' commitments are waited for at most this share
# of the verification timeout more: a late survivor then makes the round skip the check, not wait for it
FAILURE_GRACE = 0.5


class MalformedMessage(ValueError):
    """A member's verification message that does not fit its phase's layout."""


def message_rounding(message: runtime_pb2.Tensor, decoded: torch.Tensor) -> float:
    """An upper bound of the L2 rounding error in a (checked) result message, from its header and decoded values
    (:func:`lightning_swarm.reducer_checks.rounding_bound`)."""
    name, info = rounding_info(message)
    return rc.rounding_bound(name, decoded, info)


class SkippedCheck(MalformedMessage):
    """A member's empty nonce: after a member failed during the round, a survivor's commitment did not come to it in
    time, so it skips the check (and so must everyone: the seed needs its nonce). Nobody is blamed."""


class OtherSeed(MalformedMessage):
    """A member's report projected with another seed than this peer's: it checks over another set of survivors (a
    commitment naming a failed member came to one and not the other), so its report can't be set beside this
    peer's. Nobody is blamed."""


def failed_mask(indices, group_size: int) -> bytes:
    """The members at ``indices`` (in the group's order) as a bit mask of ``ceil(group_size / 8)`` bytes."""
    mask = bytearray((group_size + 7) // 8)
    for index in indices:
        mask[index // 8] |= 1 << (index % 8)
    return bytes(mask)


def parse_verification_message(message: averaging_pb2.AveragingData, group_id: bytes, phase: int,
                               report_length: int, group_size: int = 0, seed: Optional[bytes] = None):
    """A member's message of ``phase``, checked: the group, the phase (``weight``), and

    - phase 1 (commitment): ``peer_id`` is 32 bytes of ``sha256(nonce)`` and a mask of the members its sender saw
      fail during the round (:func:`failed_mask` of ``group_size`` members, no bit beyond them); returns
      (commitment, frozenset of member indices);
    - phase 2 (nonce): 32 bytes in ``peer_id``; returns them;
    - phase 3 (report): the seed its sender projected with in ``peer_id`` (:class:`OtherSeed` if it is not
      ``seed``), a float64 vector of exactly ``report_length`` values (checked before decoding; its fields by
      :func:`lightning_swarm.reducer_checks.decode_report`); returns the vector."""
    if message.group_id != group_id:
        raise MalformedMessage("another group's message")
    if message.weight != float(phase):
        raise MalformedMessage(f"a message of phase {message.weight!r} where phase {phase} was expected")
    if phase == PHASE_COMMIT:
        mask_bytes = (group_size + 7) // 8
        if len(message.peer_id) != NONCE_BYTES + mask_bytes:
            raise MalformedMessage(f"{len(message.peer_id)} bytes of commitment, not {NONCE_BYTES} and a mask of "
                                   f"{mask_bytes}")
        mask = int.from_bytes(message.peer_id[NONCE_BYTES:], "little")
        if mask >> group_size:
            raise MalformedMessage(f"a mask of failed members beyond the group's {group_size}")
        return bytes(message.peer_id[:NONCE_BYTES]), frozenset(i for i in range(group_size) if mask >> i & 1)
    if phase == PHASE_NONCE:
        if len(message.peer_id) == 0:
            raise SkippedCheck("it skips the check: a member failed during the round and another was late")
        if len(message.peer_id) != NONCE_BYTES:
            raise MalformedMessage(f"{len(message.peer_id)} bytes of nonce, not {NONCE_BYTES}")
        return bytes(message.peer_id)
    if len(message.peer_id) != NONCE_BYTES:
        raise MalformedMessage(f"a report with {len(message.peer_id)} bytes of seed, not {NONCE_BYTES}")
    if not message.HasField("tensor_part"):
        raise MalformedMessage("a report without its values")
    try:
        check_tensor_message(message.tensor_part, (report_length,), torch.float64)
        if compression_name(message.tensor_part) != "NONE" or message.tensor_part.dtype != "float64":
            raise MalformedTensor("a report must be uncompressed float64")
        values = deserialize_torch_tensor(message.tensor_part)
    except MalformedTensor as e:
        raise MalformedMessage(f"report values: {e}") from None
    if seed is not None and bytes(message.peer_id) != seed:
        raise OtherSeed("a report projected with another seed (its sender checks over other survivors)")
    return values.numpy().astype(np.float64, copy=False)


def _left(timeout: float, until: Optional[float]) -> float:
    """``timeout``, or less if the event loop's time ``until`` comes sooner (at least 0.1 s: a call that is given
    no time at all can't even fail)."""
    if until is None:
        return timeout
    return max(0.1, min(timeout, until - asyncio.get_running_loop().time()))


class _Mailbox:
    """The verification messages of one round, by phase and sender (the first one of each is kept), this peer's
    own message of each phase once it is sent (the answer to a groupmate's message of that phase), and the members
    known to have failed during the round (not waited for)."""

    def __init__(self, members: Sequence[PeerID], group_id: bytes = b""):
        self.order, self.group_id = list(members), group_id
        self.members = set(members)
        self.messages: Dict[Tuple[int, PeerID], averaging_pb2.AveragingData] = {}
        self.own: Dict[int, averaging_pb2.AveragingData] = {}
        # for relaying (set once this peer's check starts): the client-mode members whose messages it relays, the
        # largest message each may send, and their signed records by phase and sender
        self.inner_caps: Optional[Dict[PeerID, int]] = None
        self.records: Dict[Tuple[int, PeerID], bytes] = {}
        self.failed: Set[PeerID] = set()  # seen failing by this peer or named so in a commitment it holds
        self.changed = asyncio.Event()

    def deposit(self, phase: int, sender: PeerID, record: bytes, inner: Optional[bytes] = None) -> None:
        """Keep a relayed member's signed record (``inner``: its message, checked, whose commitment may name failed
        members)."""
        self.records.setdefault((phase, sender), record)
        if phase == PHASE_COMMIT and inner is not None:
            try:
                self._note_failed(averaging_pb2.AveragingData.FromString(inner))
            except Exception:  # a signed message that does not parse: its check refuses it later
                pass
        self.changed.set()

    def _note_failed(self, message: averaging_pb2.AveragingData) -> None:
        """Add the members a commitment names as failed during the round (not waited for; a malformed one names
        nobody)."""
        try:
            _, indices = parse_verification_message(message, self.group_id, PHASE_COMMIT, 0, len(self.order))
        except MalformedMessage:
            return
        self.failed.update(self.order[index] for index in indices)

    async def relaying(self, timeout: float) -> Optional[Dict[PeerID, int]]:
        """The relayed members' size caps once this peer's check has set them (None after ``timeout`` seconds)."""
        await self._until(lambda: self.inner_caps is not None, timeout)
        return self.inner_caps

    def set_relaying(self, inner_caps: Dict[PeerID, int]) -> None:
        self.inner_caps = inner_caps
        self.changed.set()

    def add_failed(self, peers) -> None:
        peers = set(peers)
        if not peers <= self.failed:
            self.failed.update(peers)
            self.changed.set()

    def put(self, phase: int, sender: PeerID, message: averaging_pb2.AveragingData) -> None:
        if (phase, sender) not in self.messages and phase == PHASE_COMMIT:
            self._note_failed(message)
        self.messages.setdefault((phase, sender), message)
        self.changed.set()

    def post(self, phase: int, message: averaging_pb2.AveragingData) -> None:
        self.own[phase] = message
        self.changed.set()

    async def _until(self, ready: Callable[[], bool], timeout: float) -> None:
        """Return once ``ready()`` holds (checked after each message) or ``timeout`` seconds have passed."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while not ready():
            self.changed.clear()
            left = deadline - loop.time()
            if left <= 0:
                return
            try:
                await asyncio.wait_for(self.changed.wait(), left)
            except asyncio.TimeoutError:
                return

    def _not_awaited(self, phase: int, peer: PeerID) -> bool:
        """Whether a relayed member's record of ``phase`` is not to be waited for: it failed during the round, or
        (after the commitment phase) no commitment of it came here, so it is in nobody's check through this peer."""
        if peer in self.failed:
            return True
        return phase > PHASE_COMMIT and (PHASE_COMMIT, peer) not in self.records \
            and (PHASE_COMMIT, peer) not in self.messages

    async def records_from(self, phase: int, senders: Sequence[PeerID], timeout: float) -> List[bytes]:
        """The records of ``phase`` deposited by ``senders``, as soon as all are in except those not awaited (a
        member that died never deposits, which held a client-mode caller ``timeout`` in every round a groupmate
        died), or once ``timeout`` seconds have passed."""
        await self._until(lambda: all((phase, peer) in self.records or self._not_awaited(phase, peer)
                                      for peer in senders), timeout)
        return [self.records[(phase, peer)] for peer in senders if (phase, peer) in self.records]

    async def own_message(self, phase: int, timeout: float) -> Optional[averaging_pb2.AveragingData]:
        """This peer's message of ``phase``, once it is posted (None after ``timeout`` seconds)."""
        await self._until(lambda: phase in self.own, timeout)
        return self.own.get(phase)

    async def wait(self, phase: int, senders: Sequence[PeerID], timeout: float,
                   excused: Callable[[], Set[PeerID]] = set) -> Dict[PeerID, averaging_pb2.AveragingData]:
        """The messages of ``phase`` from ``senders`` that came within ``timeout`` seconds, as soon as all are in
        except those from the members ``excused()`` names (checked after each message: in the commitment phase, the
        members known to have failed during the round, which would cost ``timeout`` if waited for)."""
        def ready() -> bool:
            if phase == PHASE_NONCE and any(len(self.messages[(phase, peer)].peer_id) == 0 for peer in senders
                                            if (phase, peer) in self.messages):
                return True  # a member that skips the check after committing: nothing can be checked
            not_awaited = excused()
            return all((phase, peer) in self.messages or peer in not_awaited for peer in senders)

        await self._until(ready, timeout)
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
        self._excluded_here: Dict[PeerID, str] = {}  # this averager's process: peer -> why
        self._excluded_shared: Dict[PeerID, str] = {}
        self._exclusions_seen: Tuple[int, int] = (-1, -1)
        self._warned_client_groups = False
        self._withholding = rc.WithholdingRecord()
        self._sending: Set[asyncio.Task] = set()  # verification messages sent without waiting for them
        # the key of this peer's libp2p identity, to sign the messages reachable members relay to other client-mode
        # members (DER bytes: the averager's process loads it once)
        dht = kwargs.get("dht", args[1] if len(args) > 1 else None)
        self._identity_der = relayed.identity_key_der(dht) if dht is not None else None
        self._signing_key = None
        super().__init__(*args, **kwargs)

    def _exclusions_path(self) -> Optional[str]:
        """The file every averager of this peer (they share its peer id: the gradient and the state averager are
        separate processes) writes its exclusions to and reads the others' from."""
        peer_id = getattr(self, "peer_id", None)
        if peer_id is None:
            return None
        return os.path.join(tempfile.gettempdir(), "lightning_swarm_exclusions", peer_id.to_base58())

    @property
    def excluded_peers(self) -> Dict[PeerID, str]:
        """The peers kept out of this peer's groups, by any of its averagers (peer -> why)."""
        path = self._exclusions_path()
        try:
            stat = os.stat(path) if path is not None else None
        except OSError:
            stat = None
        if stat is not None and (stat.st_mtime_ns, stat.st_size) != self._exclusions_seen:
            self._exclusions_seen = (stat.st_mtime_ns, stat.st_size)
            shared = {}
            try:
                with open(path, encoding="utf-8", errors="replace") as lines:
                    for line in lines:
                        peer, _, reason = line.rstrip("\n").partition("\t")
                        try:
                            shared[PeerID.from_base58(peer)] = reason
                        except Exception:  # a line torn by a crash: the others still count
                            continue
            except OSError:
                pass
            self._excluded_shared = shared
        return {**self._excluded_shared, **self._excluded_here}

    async def rpc_reducer_report(self, request: averaging_pb2.AveragingData, context: P2PContext
                                 ) -> averaging_pb2.AveragingData:
        mailbox = self._mailboxes.get(request.group_id)
        if mailbox is None or context.remote_id not in mailbox.members or request.weight not in (1.0, 2.0, 3.0):
            return averaging_pb2.AveragingData(code=averaging_pb2.BAD_GROUP_ID)
        mailbox.put(int(request.weight), context.remote_id, request)
        # the answer is this peer's own message of that phase (a client-mode caller can't be called back)
        answer = await mailbox.own_message(int(request.weight), self.verification_timeout)
        return answer if answer is not None else averaging_pb2.AveragingData(code=averaging_pb2.NO_CODE)

    async def rpc_reducer_relay(self, request: averaging_pb2.AveragingData, context: P2PContext
                                ) -> averaging_pb2.AveragingData:
        """A client-mode member deposits its signed message of a phase (``peer_id``: the record) and gets the records
        of the group's other client-mode members for that phase, once all are in or within the timeout."""
        mailbox = self._mailboxes.get(request.group_id)
        if mailbox is None or context.remote_id not in mailbox.members or request.weight not in (1.0, 2.0, 3.0):
            return averaging_pb2.AveragingData(code=averaging_pb2.BAD_GROUP_ID)
        phase = int(request.weight)
        caps = await mailbox.relaying(self.verification_timeout)
        if caps is None or context.remote_id not in caps:
            return averaging_pb2.AveragingData(code=averaging_pb2.PROTOCOL_VIOLATION)
        try:
            signer, inner = relayed.open_record(bytes(request.peer_id), caps[context.remote_id])
            if signer != context.remote_id:
                raise relayed.MalformedRecord(f"signed by {signer}")
        except relayed.MalformedRecord as e:
            log.warning(f"[lightning_swarm] averaging: refused to relay a verification message of "
                        f"{context.remote_id}: {e}")
            return averaging_pb2.AveragingData(code=averaging_pb2.PROTOCOL_VIOLATION)
        mailbox.deposit(phase, context.remote_id, bytes(request.peer_id), inner)
        others = [peer for peer in caps if peer != context.remote_id]
        records = await mailbox.records_from(phase, others, self.verification_timeout)
        return averaging_pb2.AveragingData(group_id=request.group_id, weight=request.weight,
                                           peer_id=relayed.pack_records(records))

    async def rpc_join_group(self, request: averaging_pb2.JoinRequest, context: P2PContext
                             ) -> AsyncIterator[averaging_pb2.MessageFromLeader]:
        if context.remote_id in self.excluded_peers:
            yield averaging_pb2.MessageFromLeader(code=averaging_pb2.PROTOCOL_VIOLATION)
            return
        async for message in super().rpc_join_group(request, context):
            yield message

    def exclude_peer(self, peer: PeerID, reason: str) -> None:
        """Keep ``peer`` out of this peer's later groups, in all of its averagers (they read the exclusions from a
        file of their shared peer id), for the rest of the run and of any later run under the same identity."""
        if peer not in self.excluded_peers:
            self._excluded_here[peer] = reason
            log.warning(f"[lightning_swarm] averaging: peer {peer} is kept out of this peer's later groups: {reason}")
            path = self._exclusions_path()
            if path is not None:  # this peer's other averagers read it (one short line: an atomic append)
                try:
                    os.makedirs(os.path.dirname(path), mode=0o700, exist_ok=True)
                    descriptor = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
                    try:
                        line = " ".join(reason[:500].split())  # one line, no tabs
                        os.write(descriptor, f"{peer.to_base58()}\t{line}\n".encode())
                    finally:
                        os.close(descriptor)
                except OSError as e:
                    log.warning(f"[lightning_swarm] averaging: could not share the exclusion of {peer} with this "
                                f"peer's other averagers: {e!r}")

    def _withheld(self, peers: Sequence[PeerID], what: str) -> None:
        for peer in peers:
            if self._withholding.withheld(peer):
                self.exclude_peer(peer, f"it withheld its verification messages ({what}, the last time) in "
                                        f"{self._withholding[peer]:g} rounds net of those it was verified in")

    def open_mailbox(self, group_id: bytes, members: Sequence[PeerID]) -> None:
        while len(self._mailboxes) >= MAX_MAILBOXES:
            self._mailboxes.pop(next(iter(self._mailboxes)))
        self._mailboxes[group_id] = _Mailbox(members, group_id)

    def close_mailbox(self, group_id: bytes) -> None:
        self._mailboxes.pop(group_id, None)

    def close_mailbox_later(self, group_id: bytes) -> None:
        """Close the round's mailbox ``verification_timeout`` seconds from now: a member still in its exchange
        meanwhile (a slower one, or one this peer counted as failed) gets this peer's messages as answers. Closed at
        once, a member whose round ended early (it skipped the check) left a slower one waiting the whole timeout
        for its commitment (CI's test_leaver.py: 10 s, on a round the victim's death had already slowed)."""
        asyncio.get_running_loop().call_later(self.verification_timeout, self.close_mailbox, group_id)

    async def _send_all(self, peers: Sequence[PeerID], message: averaging_pb2.AveragingData, mailbox: _Mailbox,
                        until: Optional[float] = None) -> None:
        """Send ``message`` to each of ``peers``; each answers with its own message of the same phase (kept in
        ``mailbox``, as if it had called). ``until``: the event loop's time by which to give up (default: one
        verification timeout from now)."""
        async def send(peer):
            try:
                stub = type(self).get_stub(self._p2p, peer, namespace=self.prefix)
                answer = await asyncio.wait_for(stub.rpc_reducer_report(message),
                                                _left(self.verification_timeout, until))
                if answer.group_id == message.group_id and answer.weight == message.weight:
                    mailbox.put(int(message.weight), peer, answer)
            except Exception as e:  # its absence is what the others see
                log.debug(f"could not send a verification message to {peer}: {e!r}")
        await asyncio.gather(*(send(peer) for peer in peers))

    async def _relay_all(self, relays: Sequence[PeerID], message: averaging_pb2.AveragingData, mailbox: _Mailbox,
                         until: Optional[float] = None) -> None:
        """Deposit ``message``, signed, with each of ``relays`` (reachable members) and keep the other client-mode
        members' messages of the same phase that each relays (checked: signed by a client-mode member of the group
        other than this peer, within its size). A relay that serves an altered record is kept out: it checks each
        record before keeping it, so it altered it. ``until``: the event loop's time by which to give up (default:
        twice the verification timeout from now)."""
        if not relays:
            return
        if self._signing_key is None:
            self._signing_key = relayed.load_signing_key(self._identity_der)
        inner = message.SerializeToString()
        record = await asyncio.get_running_loop().run_in_executor(None, relayed.sign_record, self._signing_key, inner)
        caps = dict(mailbox.inner_caps)
        senders = [peer for peer in caps if peer != self.peer_id]
        limit = relayed.record_cap(max(caps.values()))
        phase = int(message.weight)

        async def relay(peer):
            # The relay answers once every other client-mode member's record is in, or after its own
            # verification_timeout: a member that deposits later (a slower peer: CI saw one report missing, the
            # round unchecked) reaches this peer only if it asks again, until its own deadline.
            loop = asyncio.get_running_loop()
            deadline = loop.time() + _left(2 * self.verification_timeout, until)
            request = averaging_pb2.AveragingData(group_id=message.group_id, weight=message.weight, peer_id=record)
            stub = type(self).get_stub(self._p2p, peer, namespace=self.prefix)
            while True:
                asked = loop.time()
                try:
                    answer = await asyncio.wait_for(stub.rpc_reducer_relay(request), max(deadline - asked, 0.1))
                except Exception as e:  # the others' messages may still come through another relay
                    log.debug(f"could not relay through {peer}: {e!r}")
                    return
                if answer.group_id != message.group_id or answer.weight != message.weight:
                    # it closed the round's mailbox (or never had it): asking again changes nothing
                    log.debug(f"relay {peer} has no mailbox for phase {phase} of this round: stopped asking it")
                    return
                try:
                    records = relayed.unpack_records(bytes(answer.peer_id), len(senders), limit)
                    for item in records:
                        signer, inner_bytes = relayed.open_record(item, max(caps.values()))
                        if signer not in senders:
                            raise relayed.MalformedRecord(f"signed by {signer}, not a client-mode member of the group")
                        if len(inner_bytes) > caps[signer]:
                            raise relayed.MalformedRecord(f"{len(inner_bytes)} bytes from {signer}")
                        mailbox.put(phase, signer, averaging_pb2.AveragingData.FromString(inner_bytes))
                except relayed.MalformedRecord as e:  # the relay checked each record before keeping it: its doing
                    self.exclude_peer(peer, f"it relayed a verification message it altered or forged ({e})")
                    return
                except Exception as e:  # a signed message protobuf can't parse: its signer's doing
                    log.warning(f"[lightning_swarm] averaging: refused a relayed verification message: {e!r}")
                missing = [str(sender) for sender in senders if (phase, sender) not in mailbox.messages]
                if not missing:
                    return
                if loop.time() - asked < RELAY_MIN_WAIT * self.verification_timeout:
                    # an honest relay holds the call until the records are in or its timeout (it does not wait for
                    # a member it knows failed during the round, or, after the commitment phase, one whose
                    # commitment never came to it)
                    log.debug(f"relay {peer} answered phase {phase} after {loop.time() - asked:.2f} s without "
                              f"{missing}: stopped asking it")
                    return
                if loop.time() >= deadline:
                    log.debug(f"relay {peer}: phase {phase} still without {missing} at this exchange's deadline")
                    return

        await asyncio.gather(*(relay(peer) for peer in relays))

    async def verify_results(self, runner, group_id: bytes) -> Set[int]:
        """Run the exchange of a finished round's results with the other members (the senders, and reducers that
        send nothing) and check each other reducer's slice. Returns the indices (in the group's order) of the
        reducers whose slices are not to be applied."""
        peers: List[PeerID] = list(runner.ordered_peer_ids)
        me = peers.index(runner.peer_id)
        senders: List[PeerID] = list(runner.sender_peer_ids)
        parts_by_reducer = list(runner.tensor_part_container.num_parts_by_peer)
        # every sender reports on the others' slices; every reducer (an aux one too) claims on its own
        members = [peer for index, peer in enumerate(peers) if peer in senders or parts_by_reducer[index]]
        others = [peer for peer in members if peer != runner.peer_id]
        reducers = [r for r, parts in enumerate(parts_by_reducer) if parts and r != me and runner.peer_id in senders]
        if runner.peer_id not in members or not others or not any(parts_by_reducer):
            return set()  # (a sender with no slice to check still reports: the others need its projections)
        modes = dict(zip(peers, runner.modes))
        callees = [peer for peer in others if modes[peer] != AveragingMode.CLIENT]
        clients = [peer for peer in members if modes[peer] == AveragingMode.CLIENT]
        mailbox = self._mailboxes[group_id]
        rows = rc.report_length(parts_by_reducer)
        lengths = {peer: rows + rc.claims_length(parts_by_reducer[peers.index(peer)], len(senders)) for peer in members}
        relaying = len(clients) > 1
        if relaying:
            # two client-mode members can't reach each other: reachable members relay their messages, signed
            # (:mod:`~lightning_swarm.hivemind_ext.relayed_messages`)
            mailbox.set_relaying({peer: _message_cap(lengths[peer]) for peer in clients})
            reachable = [peer for peer in members if modes[peer] != AveragingMode.CLIENT]
            if not reachable or (runner.peer_id in clients and self._identity_der is None):
                if not self._warned_client_groups:
                    self._warned_client_groups = True
                    log.warning("[lightning_swarm] averaging: reducer results are not checked in groups with 2 or "
                                "more client-mode members where " + ("no member is reachable" if not reachable else
                                "this peer has no RSA identity key to sign with (start its DHT with identity_path)"))
                return set()
        relays = callees if relaying and runner.peer_id in clients else []
        heard_directly = [peer for peer in others if not (relays and peer in clients)]
        size = len(peers)
        failed = _failed_members(runner, others)
        if failed:
            # a member that sent no part by next_chunk_timeout or reduced nothing (it died, most often) sends no
            # commitment either: name it in the commitment, and the survivors check the slices it has no mass in
            # (all of them were refused before: with one death in a group of 16, each member kept its own values on
            # 15/16 of the parameters)
            log.warning(f"[lightning_swarm] averaging: {failed} failed during the round: checking the slices they "
                        f"have no mass in")
        mailbox.add_failed(peer for peer in others if str(peer) in failed)

        def excused() -> Set[PeerID]:
            """The members this peer saw fail, or that a commitment it holds names so (not waited for)."""
            return mailbox.failed - {runner.peer_id}

        loop = asyncio.get_running_loop()
        timeout = self.verification_timeout
        nonce = os.urandom(NONCE_BYTES)
        exchange_end = loop.time() + EXCHANGE_TIMEOUTS * timeout

        def send(number: int, payload: averaging_pb2.AveragingData) -> None:
            payload.group_id, payload.weight = group_id, float(number)
            mailbox.post(number, payload)
            # sent in the background: a callee that died or is late answers at the timeout, and this peer waits
            # only for the members it expects
            for sending in (self._send_all(callees, payload, mailbox, until=exchange_end),
                            self._relay_all(relays, payload, mailbox, until=exchange_end)):
                task = asyncio.create_task(sending)
                self._sending.add(task)
                task.add_done_callback(self._sending.discard)

        other_seeds: Set[PeerID] = set()

        def parsed(number: int, received, seed: Optional[bytes] = None) -> Dict[PeerID, object]:
            out = {}
            for peer, message in received.items():
                try:
                    out[peer] = parse_verification_message(message, group_id, number, lengths[peer], size, seed)
                except SkippedCheck:
                    out[peer] = None
                except OtherSeed as e:
                    log.info(f"averaging: not set beside this peer's: the report of {peer}: {e}")
                    other_seeds.add(peer)
                except MalformedMessage as e:
                    log.warning(f"[lightning_swarm] averaging: refused a verification message of {peer}: {e}")
            return out

        def skip(why: str) -> Set[int]:
            """Skip the check after committing, telling the others (an empty nonce: they skip at once too)."""
            log.warning(f"[lightning_swarm] averaging: no verification this round ({why}): the other members' "
                        f"slices are not applied")
            send(PHASE_NONCE, averaging_pb2.AveragingData(peer_id=b""))
            return set(reducers)

        # phase 1: every member's commitment, up to the timeout; once a member is known to have failed (seen here, or
        # named in a commitment), the survivors' at most FAILURE_GRACE timeouts more
        send(PHASE_COMMIT, averaging_pb2.AveragingData(peer_id=hashlib.sha256(nonce).digest() + failed_mask(
            [index for index, peer in enumerate(peers) if peer in mailbox.failed], size)))
        end, grace_end = loop.time() + _left(timeout, exchange_end), None
        while True:
            named = excused()
            if named and grace_end is None:
                grace_end = loop.time() + FAILURE_GRACE * timeout
            limit = end if grace_end is None else min(end, grace_end)
            if all((PHASE_COMMIT, peer) in mailbox.messages or peer in named for peer in others) \
                    or loop.time() >= limit:
                break
            # (a member newly named as failed ends the wait: the limit is recomputed with the grace)
            await mailbox.wait(PHASE_COMMIT, others, limit - loop.time(),
                               lambda: set(others) if excused() - named else named)
        named = excused()
        commits = parsed(PHASE_COMMIT, {peer: mailbox.messages[(PHASE_COMMIT, peer)] for peer in others
                                        if peer not in named and (PHASE_COMMIT, peer) in mailbox.messages})
        # the members this check is over: all but those named as failed (fixed before any nonce of this peer's is
        # out, and the seed is drawn from their nonces, this peer's among them: nobody can pick the set knowing the
        # seed; a member that ends up with another set has another seed, and its report is set aside)
        survivors = [peer for peer in members if peer not in named]
        missing = [peer for peer in survivors if peer != runner.peer_id and peer not in commits]
        if missing and named:
            return skip(f"{sorted(map(str, named))} failed during the round and no commitment came from "
                        f"{sorted(map(str, missing))} in time")
        if missing:
            self._withheld([peer for peer in missing if peer in heard_directly], "no commitment")
            return skip(f"no commitment from {sorted(map(str, missing))}")
        expected = [peer for peer in survivors if peer != runner.peer_id]
        send(PHASE_NONCE, averaging_pb2.AveragingData(peer_id=nonce))
        received = await mailbox.wait(PHASE_NONCE, expected, _left(EXCHANGE_TIMEOUTS * timeout, exchange_end))
        nonces = parsed(PHASE_NONCE, received)
        skipped = [peer for peer, value in nonces.items() if value is None]
        if skipped:
            log.warning(f"[lightning_swarm] averaging: no verification this round ({sorted(map(str, skipped))} "
                        f"skipped the check): the other members' slices are not applied")
            return set(reducers)
        nonces = {peer: value for peer, value in nonces.items() if hashlib.sha256(value).digest() == commits[peer][0]}
        if len(nonces) < len(expected):
            # a member that committed must reveal: one that withholds its nonce could otherwise choose between two
            # seeds once it has seen the others'
            absent = [peer for peer in expected if peer not in nonces]
            log.warning(f"[lightning_swarm] averaging: no verification this round (no valid nonce from "
                        f"{sorted(map(str, absent))}): the other members' slices are not applied")
            if not named:
                self._withheld([peer for peer in absent if peer in heard_directly], "no valid nonce")
            return set(reducers)
        nonces[runner.peer_id] = nonce
        seed = hashlib.sha256(group_id + failed_mask([peers.index(peer) for peer in survivors], size)
                              + b"".join(nonces[peer] for peer in survivors)).digest()
        own_reports, own_claims = await loop.run_in_executor(None, _member_reports, runner, seed, reducers, senders)
        values = np.concatenate((rc.encode_report([own_reports.get(r) for r in range(len(peers))], parts_by_reducer),
                                 rc.encode_claims(own_claims, parts_by_reducer[me], len(senders))))
        send(PHASE_REPORT, averaging_pb2.AveragingData(peer_id=seed,
                                                       tensor_part=serialize_torch_tensor(torch.from_numpy(values))))
        received = await mailbox.wait(PHASE_REPORT, expected, _left(EXCHANGE_TIMEOUTS * timeout, exchange_end))
        reports = {peer: value for peer, value in parsed(PHASE_REPORT, received, seed).items() if value is not None}
        decoded: Dict[PeerID, List[Optional[rc.SliceReport]]] = {runner.peer_id: [own_reports.get(r) for r in
                                                                                 range(len(peers))]}
        claims: Dict[PeerID, Optional[rc.ReducerClaims]] = {}
        for peer, vector in reports.items():
            try:
                decoded[peer] = rc.decode_report(vector[:rows], parts_by_reducer)
                claims[peer] = rc.decode_claims(vector[rows:], parts_by_reducer[peers.index(peer)], len(senders))
            except rc.MalformedReport as e:
                decoded.pop(peer, None)
                log.warning(f"[lightning_swarm] averaging: refused the verification report of {peer}: {e}")
        # A massless sender's report (its share of the virtual part alone, from this peer's own parts) stands in for
        # a member's report where it has none (a NaN sender gets NaN results: its rows are empty) or where this
        # peer's reducer saw it break the protocol (its report is ignored: it is kept out, so framing a reducer
        # would cost it nothing); the slice then passes only if the reducer's claims give that member no mass
        # (judge_slice). A report required from every member left a NaN sender's first round unverified for all.
        breakers = {senders[s] for s in runner.tensor_part_reducer.protocol_breakers} - {runner.peer_id}
        needs_stand_ins = [r for r in reducers if any(
            peer in breakers or decoded.get(peer, [None] * len(peers))[r] is None
            for peer in senders if peer not in (peers[r], runner.peer_id))]
        massless = {} if not needs_stand_ins else await asyncio.get_running_loop().run_in_executor(
            None, _massless_reports, runner, seed, needs_stand_ins, senders)
        for peer in others:
            if peer in decoded:
                self._withholding.verified(peer)
        # (a message only a relay could bring is not held against its sender: the relay may have dropped it; nor a
        # report projected with another seed: its sender may have been shown another set of commitments)
        if not named:
            self._withheld([peer for peer in heard_directly if peer in expected and peer not in decoded
                            and peer not in other_seeds], "no well-formed report")
        refused = set()
        for r in reducers:
            reducer = peers[r]
            reporters = [peer for peer in senders if peer != reducer]
            headers = runner.tensor_part_container.result_headers(r)
            slice_reports = [decoded.get(peer, [None] * len(peers))[r] for peer in reporters]
            if headers is None:
                verdict = rc.Verdict("unverifiable: its results came without a well-formed header or did not all "
                                     "arrive")
            else:
                stand_ins = [massless.get(r) if peer in breakers or report is None else None
                             for peer, report in zip(reporters, slice_reports)]
                verdict = rc.judge_slice(headers, slice_reports, claims.get(reducer),
                                         [senders.index(peer) for peer in reporters], reporters.index(runner.peer_id),
                                         reducer_sends=reducer in senders, stand_ins=stand_ins)
            if verdict.reason is None:
                continue
            refused.add(r)
            log.warning(f"[lightning_swarm] averaging: refused the slice reduced by {reducer} ({parts_by_reducer[r]} "
                        f"parts): {verdict.reason}; kept the local values there")
            if verdict.blame == rc.BLAME_REDUCER:
                self.exclude_peer(reducer, f"its reduced slice failed the check ({verdict.reason})")
            elif verdict.blame == rc.BLAME_DISPUTE:
                for position in verdict.disputed:
                    member = reporters[position]
                    self.exclude_peer(reducer, f"dispute with {member} over its reduced slice ({verdict.reason})")
                    self.exclude_peer(member, f"dispute with reducer {reducer}: its report on that reducer's slice "
                                              f"contradicts the reducer's claims about it")
        return refused


def _member_reports(runner, seed: bytes, reducers: Sequence[int], senders: Sequence[PeerID]
                    ) -> Tuple[Dict[int, rc.SliceReport], Optional[rc.ReducerClaims]]:
    """This member's reports on the slices it can report on (complete, well-formed headers), and its claims on its
    own slice (None if it reduces nothing or a sender's part is missing): part index by part index, so that each
    index's sign vectors are generated once for all of them (:class:`lightning_swarm.reducer_checks.SignSource`)."""
    peers = list(runner.ordered_peer_ids)
    received = {r: runner.tensor_part_container.received_parts(r) for r in reducers}
    received = {r: parts for r, parts in received.items() if parts is not None}
    members = {r: len([peer for peer in senders if peer != peers[r]]) for r in received}
    me = peers.index(runner.peer_id)
    reducer = runner.tensor_part_reducer
    own_parts = runner.tensor_part_container.num_parts_by_peer[me]
    claimed = None
    if own_parts and all(p in reducer.reduced for p in range(own_parts)):
        claimed = [reducer.reduced[p] for p in range(own_parts)]
    own_members = len([peer for peer in senders if peer != runner.peer_id])
    signs = rc.SignSource()
    reports: Dict[int, List[rc.SliceReport]] = {r: [] for r in received}
    claims: List[Optional[rc.ReducerClaims]] = []
    depth = max([len(parts) for parts in received.values()] + [len(claimed) if claimed else 0])
    for index in range(depth):
        for r, parts in received.items():
            if index < len(parts):
                reports[r].append(rc.member_report(seed, r, parts[index:index + 1], members[r], first=index,
                                                   signs=signs))
        if claimed and index < len(claimed):
            claims.append(rc.reducer_claims(seed, me, claimed[index:index + 1], own_members, reducer.own_sender,
                                            first=index, signs=signs))
    merged = {r: rc.merge_reports(reports[r], [part.header for part in received[r]]) for r in received}
    return merged, (rc.merge_claims(claims, claimed) if claimed else None)


def _massless_reports(runner, seed: bytes, reducers: Sequence[int], senders: Sequence[PeerID]
                      ) -> Dict[int, rc.SliceReport]:
    """A massless sender's report on each of ``reducers``' slices
    (:func:`lightning_swarm.reducer_checks.massless_report`), from this member's own parts; slices it can't report on
    are left out. Part index by part index, as :func:`_member_reports`: each index's sign vectors are generated once
    for all the slices."""
    peers = list(runner.ordered_peer_ids)
    received = {r: runner.tensor_part_container.received_parts(r) for r in reducers}
    received = {r: parts for r, parts in received.items() if parts is not None}
    members = {r: len([peer for peer in senders if peer != peers[r]]) for r in received}
    signs = rc.SignSource()
    reports: Dict[int, List[rc.SliceReport]] = {r: [] for r in received}
    for index in range(max((len(parts) for parts in received.values()), default=0)):
        for r, parts in received.items():
            if index < len(parts):
                reports[r].append(rc.massless_report(seed, r, parts[index:index + 1], members[r], first=index,
                                                     signs=signs))
    return {r: rc.merge_reports(reports[r], [part.header for part in received[r]]) for r in received}


def _message_cap(report_values: int) -> int:
    """The largest serialized verification message of a member whose report has ``report_values`` values."""
    return 8 * report_values + 1024


def _failed_members(runner, others: Sequence[PeerID]) -> List[str]:
    """The members this peer's all-reduce saw fail: reducers whose results did not come by ``next_chunk_timeout``
    (most often dead), and senders that sent this peer's reducer none of their parts (dead, or left the group at
    its all-reduce: a peer that keeps a groupmate out of its groups does, and where it reduced nothing, its
    groupmates used to wait for its verification messages until the round's timeout cancelled the whole round).
    Senders banned for a late part are not among them: they are alive, their parts have no mass in the slice that
    banned them, and the check runs as usual."""
    peers = list(runner.ordered_peer_ids)
    failed = {peers[index] for index in runner.tensor_part_container.failed_reducers}
    reducer = runner.tensor_part_reducer
    if reducer.num_parts > 0:
        failed.update(peer for peer, received in zip(runner.sender_peer_ids, reducer.num_parts_received)
                      if received == 0)
    return sorted(str(peer) for peer in others if peer in failed)


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

