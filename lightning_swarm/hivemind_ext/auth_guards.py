"""Authentication where hivemind 1.1.12 has no hook: averaging groups, state downloads, epoch claims.

hivemind's ``authorizer`` covers DHT RPCs only. Its averagers talk over their own p2p streams without any check,
and a peer trusts the epoch any progress record claims and the state-sharing priority any peer declares. In a run
with an authority (a :class:`~lightning_swarm.hivemind_ext.credentials.PeerCredentials`, e.g.
:class:`~lightning_swarm.auth.peer.SwarmAuth`):

- :class:`AuthenticatedAveraging` (mixin for hivemind averagers) adds a *join proof* to the data every group
  member sends (with SwarmAuth: the token, and a signature by the token's key over the averager prefix and the
  member's libp2p id, which libp2p authenticates). A leader refuses join requests without a valid proof, and
  every member checks all proofs of the assembled group before sending a byte of its tensors. One vote per
  person: a leader refuses a join request of a user who already holds a seat in its group (``DUPLICATE_PEER_ID``),
  and every member leaves a group where one user holds two seats (:func:`double_seats`); a superseded key of a
  user (an older token for another key) is refused like an invalid token.
- the same mixin downloads state only from plausible peers (:func:`plausible_sources`), or from the peer a
  moderator's revert order names (it orders the donors of
  :class:`~lightning_swarm.hivemind_ext.state_download.VerifiedStateDownload`, which must follow it in the bases).
- :class:`EpochGuard` (mixin for hivemind's ProgressTracker) ignores progress records that claim an epoch no other
  peer confirms (:func:`implausible_claims`), unless a moderator's revert order names it.

Private names used here are listed in :data:`lightning_swarm.hivemind_ext.private_api.PRIVATE_SYMBOLS`.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import random
from typing import AsyncIterator, Dict, Hashable, List, Optional, Sequence, Tuple

from hivemind.averaging.control import StepControl
from hivemind.averaging.group_info import GroupInfo
from hivemind.averaging.matchmaking import MatchmakingException
from hivemind.optim.progress_tracker import LocalTrainingProgress
from hivemind.p2p import P2PContext, PeerID
from hivemind.proto import averaging_pb2
from hivemind.utils import MPFuture

from lightning_swarm.hivemind_ext.credentials import CredentialsError, PeerCredentials, RevertOrder, Verdict
from lightning_swarm.logs import RateLimitedLog

logger = logging.getLogger(__name__)

PROOF_FIELD = "lightning_swarm_auth"


# ----------------------------------------------------------------------------------------------- pure rules


def implausible_claims(epochs: Dict[Hashable, int], own_epoch: int) -> List[Hashable]:
    """Peers whose claimed epoch is more than one past ours and not confirmed by any other peer (one at most one
    epoch below it): honest peers advance together, so a lone jump is a forged record or a fake revert."""
    return [key for key, epoch in epochs.items()
            if epoch > own_epoch + 1 and not any(other >= epoch - 1 for k, other in epochs.items() if k != key)]


def credible_newest_epoch(epochs: Dict[Hashable, int]) -> Optional[int]:
    """The newest epoch among peers' claims that another peer confirms; if none is confirmed (e.g. one trainer and
    one liar), the smallest claim: a forged claim inflates epochs, so the smallest is the one not to distrust."""
    if not epochs:
        return None
    unconfirmed = set(implausible_claims(epochs, own_epoch=-2))
    confirmed = [epoch for key, epoch in epochs.items() if key not in unconfirmed]
    return max(confirmed) if confirmed else min(epochs.values())


def double_seats(users: Sequence[str]) -> List[str]:
    """The users who hold more than one seat among ``users`` (the users of a group's members, in any order): one
    person with two seats of three outvotes CenteredClip and the alignment screen, which assume a minority."""
    return sorted(user for user, seats in collections.Counter(users).items() if seats > 1)


def plausible_sources(priorities: Dict[Hashable, float]) -> Dict[Hashable, float]:
    """The state sources worth downloading from: a priority (the peer's epoch) must be confirmed by another peer
    within one epoch, unless there is only one source."""
    if len(priorities) <= 1:
        return dict(priorities)
    return {key: value for key, value in priorities.items()
            if any(other >= value - 1 for k, other in priorities.items() if k != key)}


# ----------------------------------------------------------------------------------------------- averagers


class AuthenticatedAveraging:
    """Mixin for hivemind averager classes (before them in the bases): see the module docstring.

    Args:
        swarm_auth: this peer's credentials (a PeerCredentials); None (an open run) leaves the averager exactly as
            hivemind's.
        *args, **kwargs: as the averager class.
    """

    def __init__(self, *args, swarm_auth: Optional[PeerCredentials] = None, **kwargs):
        self.swarm_auth = swarm_auth
        self._auth_log = RateLimitedLog(logger)
        self._own_seat_user: Optional[str] = None  # the user of this peer's own token (set at each step)
        self._seat_users: Dict[PeerID, str] = {}  # a leader's followers -> their users
        super().__init__(*args, **kwargs)

    # -- what this peer sends: its join proof inside the gathered data
    async def _step(self, *, step: StepControl, future_for_init: MPFuture):
        if self.swarm_auth is not None:
            try:
                proof = await asyncio.get_running_loop().run_in_executor(
                    None, self.swarm_auth.join_proof, self.prefix, self.peer_id.to_bytes())
            except CredentialsError as e:
                self._auth_log(logging.ERROR, f"{e}; averaging without a token (peers will refuse this peer)")
                proof = None
            if proof is not None:
                self._own_seat_user = self.swarm_auth.check_join_proof(
                    proof, self.prefix, self.peer_id.to_bytes()).user or None
            bandwidth, mode, user_bytes = self.serializer.loads(step.data_for_gather)
            wrapped = self.serializer.dumps({PROOF_FIELD: proof, "gather": user_bytes})
            step._data_for_gather = self.serializer.dumps([bandwidth, mode, wrapped])
        return await super()._step(step=step, future_for_init=future_for_init)

    def _check_member(self, gathered: bytes, peer_id: PeerID) -> Tuple[Verdict, bytes]:
        """(the verdict on the member's proof, the member's own gathered bytes without the proof)."""
        try:
            bandwidth, mode, user_bytes = self.serializer.loads(gathered)
            wrapped = self.serializer.loads(user_bytes)
            proof, inner = wrapped[PROOF_FIELD], wrapped["gather"]
        except Exception:  # no proof inside: checked as None (refused)
            return self.swarm_auth.check_join_proof(None, self.prefix, peer_id.to_bytes()), gathered
        verdict = self.swarm_auth.check_join_proof(proof, self.prefix, peer_id.to_bytes())
        return verdict, self.serializer.dumps([bandwidth, mode, inner])

    # -- leaders: refuse followers without a proof
    async def rpc_join_group(
        self, request: averaging_pb2.JoinRequest, context: P2PContext
    ) -> AsyncIterator[averaging_pb2.MessageFromLeader]:
        if self.swarm_auth is not None:
            verdict, _ = self._check_member(request.gather, context.remote_id)
            if not verdict.ok:
                self._auth_log(logging.WARNING, f"[lightning_swarm] refused peer {context.remote_id} in an averaging "
                                                f"group: {verdict.reason}")
                yield averaging_pb2.MessageFromLeader(code=averaging_pb2.PROTOCOL_VIOLATION)
                return
            followers = self._matchmaking.current_followers
            self._seat_users = {peer: user for peer, user in self._seat_users.items()
                                if peer in followers and peer != context.remote_id}
            if verdict.user in {self._own_seat_user, *self._seat_users.values()}:
                self._auth_log(logging.WARNING, f"[lightning_swarm] refused peer {context.remote_id} in an averaging "
                                                f"group: user {verdict.user!r} already holds a seat in it (one vote "
                                                f"per person)")
                yield averaging_pb2.MessageFromLeader(code=averaging_pb2.DUPLICATE_PEER_ID)
                return
            self._seat_users[context.remote_id] = verdict.user
        async for message in super().rpc_join_group(request, context):
            yield message

    # -- every member: check the whole group before averaging with it
    async def _aggregate_with_group(self, group_info: GroupInfo, min_vector_size: int, **kwargs):
        if self.swarm_auth is not None:
            unwrapped, users = [], []
            for peer_id, gathered in zip(group_info.peer_ids, group_info.gathered):
                verdict, inner = self._check_member(gathered, peer_id)
                if not verdict.ok:
                    self._auth_log(logging.WARNING, f"[lightning_swarm] left an averaging group with peer {peer_id}: "
                                                    f"{verdict.reason}")
                    raise MatchmakingException(f"group member {peer_id} is not authenticated: {verdict.reason}")
                unwrapped.append(inner)
                users.append(verdict.user)
            doubles = double_seats(users)
            if doubles:
                self._auth_log(logging.WARNING, f"[lightning_swarm] left an averaging group where user(s) {doubles} "
                                                f"hold more than one seat (one vote per person)")
                raise MatchmakingException(f"user(s) {doubles} hold more than one seat in the group")
            group_info = GroupInfo(group_info.group_id, group_info.peer_ids, tuple(unwrapped))
        return await super()._aggregate_with_group(group_info, min_vector_size, **kwargs)

    # -- state downloads: plausible sources only, or the moderator's revert
    def _donors(self) -> List[PeerID]:
        # VerifiedStateDownload (state_download.py) downloads from these, in this order
        if self.swarm_auth is None:
            return super()._donors()
        return self._state_sources(self._donor_priorities())

    def _state_sources(self, peer_priority: Dict[PeerID, float]) -> List[PeerID]:
        """Plausible donors, highest priority first; only the revert's peer while a moderator's revert is newest."""
        peer_priority = {peer: value for peer, value in peer_priority.items() if peer != self.peer_id}
        kept = plausible_sources(peer_priority)
        for peer in set(peer_priority) - set(kept):
            self._auth_log(logging.WARNING, f"[lightning_swarm] ignored state source {peer}: it claims epoch "
                                            f"{peer_priority[peer]:g}, which no other peer confirms")
        order = self.swarm_auth.revert_order(self.dht)
        if order is not None:
            revert_peer = PeerID.from_base58(order.peer_id)
            if revert_peer in peer_priority and order.epoch >= max(kept.values(), default=-1) - 1:
                logger.warning(f"[lightning_swarm] loading the state a moderator reverted the run to "
                               f"({order.checkpoint}, epoch {order.epoch})")
                return [revert_peer]
        tie_breakers = {peer: random.random() for peer in kept}
        return sorted(kept, key=lambda peer: (kept[peer], tie_breakers[peer]), reverse=True)


# ----------------------------------------------------------------------------------------------- progress


class EpochGuard:
    """Mixin for hivemind ProgressTracker classes (before them in the bases): in a run with an authority, progress
    records claiming an epoch no other peer confirms are ignored and logged, unless a valid revert order names
    that peer and epoch.

    Args:
        swarm_auth: this peer's credentials (a PeerCredentials: it reads the revert orders); None disables the
            guard (open run).
    """

    def __init__(self, *args, swarm_auth: Optional[PeerCredentials] = None, **kwargs):
        self.swarm_auth = swarm_auth
        self._guard_log = RateLimitedLog(logger, period=300.0)
        super().__init__(*args, **kwargs)

    def _parse_swarm_progress_data(self, metadata):
        if self.swarm_auth is not None and isinstance(metadata, dict):
            metadata = self._drop_implausible(metadata)
        return super()._parse_swarm_progress_data(metadata)

    def _trusted_records(self, metadata) -> dict:
        metadata = super()._trusted_records(metadata)
        if self.swarm_auth is not None and metadata:
            metadata = self._drop_implausible(metadata)
        return metadata

    def _drop_implausible(self, metadata: dict) -> dict:
        claims: Dict[bytes, LocalTrainingProgress] = {}
        for key, entry in metadata.items():
            if key != self._local_public_key and entry is not None and entry.value is not None:
                try:
                    claims[key] = LocalTrainingProgress.parse_obj(entry.value)
                except Exception:
                    continue
        suspects = implausible_claims({key: claim.epoch for key, claim in claims.items()}, self.local_progress.epoch)
        if not suspects:
            return metadata
        order: Optional[RevertOrder] = self.swarm_auth.revert_order(self.dht)
        kept = dict(metadata)
        for key in suspects:
            claim = claims[key]
            if order is not None and claim.epoch == order.epoch and PeerID(claim.peer_id).to_base58() == order.peer_id:
                continue  # the moderator's revert
            self._guard_log(logging.WARNING, f"[lightning_swarm] ignored a progress record claiming epoch "
                                             f"{claim.epoch}: no other peer confirms it and no moderator's revert "
                                             f"order names it")
            del kept[key]
        return kept
