"""Who may download this peer's state, and how many at once: the serving side of a newcomer's state download.

hivemind 1.1.12's ``DecentralizedAverager.rpc_download_state`` streams the whole state (the model, the optimizer
statistics) to anyone who reaches the peer, as often and as many times at once as they like: its request,
``DownloadRequest``, has no field, so the donor cannot tell who asks. :class:`GuardedStateServing`:

- in a run with an authority, serves token holders only: the request carries the requester's proof, its token and
  a signature by the token's key over the averager prefix + :data:`PROOF_SUFFIX` and the requester's libp2p id
  (which libp2p authenticates), as :meth:`~lightning_swarm.hivemind_ext.credentials.PeerCredentials.join_proof`
  makes it. The proof travels in field 4 of the request, i.e. the donor reads the request as hivemind's
  ``JoinRequest`` and the proof from its ``gather``: hivemind's empty ``DownloadRequest`` reads as a request without
  a proof, and a plain hivemind donor ignores the field;
- in every run, serves at most ``max_state_downloads`` downloads at once, and one per requester (a user in a run
  with an authority, a peer id otherwise); a requester that takes no part for ``state_download_stall_timeout``
  seconds loses its place (its stream ends when it reads again).

A served stream stays open after its last part until the requester closes it, at most
:data:`~lightning_swarm.hivemind_ext.stream_ends.STREAM_LINGER_SECONDS` (otherwise its last parts can be lost at
the close: :mod:`~lightning_swarm.hivemind_ext.stream_ends`). A refused request gets an empty stream, as hivemind
answers when state sharing is off; the requester moves on to its next donor. Each refusal is logged once a minute
with the requester's id.

Private names used here are listed in :data:`lightning_swarm.hivemind_ext.private_api.PRIVATE_SYMBOLS`.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass
from typing import AsyncIterator, Dict, Optional, Union

from hivemind.p2p import P2PContext
from hivemind.proto import averaging_pb2

from lightning_swarm.hivemind_ext.credentials import CredentialsError, PeerCredentials
from lightning_swarm.hivemind_ext.stream_ends import held_open
from lightning_swarm.logs import RateLimitedLog

logger = logging.getLogger(__name__)

PROOF_SUFFIX = ".state_download"  # a download proof is not a join proof, and the reverse
DEFAULT_MAX_STATE_DOWNLOADS = 2
DEFAULT_STALL_TIMEOUT = 60.0
MAX_PROOF_BYTES = 16 * 1024  # a proof is a token (~1.2 kB) and a signature (~350 bytes)


def check_max_state_downloads(value: int) -> int:
    """Return ``value`` (downloads a donor serves at once, >= 1), or raise a ValueError naming the option."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"max_state_downloads must be a positive number of downloads at once, got {value!r}")
    return value


def download_request(swarm_auth: Optional[PeerCredentials], prefix: str, peer_id: bytes, serializer):
    """The request a peer sends a donor for its state: hivemind's empty ``DownloadRequest`` in an open run; with an
    authority, a ``JoinRequest`` whose ``gather`` holds this peer's proof (``serializer``: the averager's)."""
    if swarm_auth is None:
        return averaging_pb2.DownloadRequest()
    proof = swarm_auth.join_proof(prefix + PROOF_SUFFIX, peer_id)
    return averaging_pb2.JoinRequest(gather=serializer.dumps(proof))


@dataclass
class _Download:
    """One download being served: when it last made progress (the requester took a part)."""

    last_progress: float


class GuardedStateServing:
    """Mixin for hivemind averager classes (before them in the bases): see the module docstring.

    Args:
        max_state_downloads: downloads of this peer's state served at once (default 2).
        state_download_stall_timeout: seconds a download may go without the requester taking a part before its
            place is given to others.
        *args, **kwargs: as the averager class. The run's credentials are read from ``self.swarm_auth`` (set by
            :class:`~lightning_swarm.hivemind_ext.auth_guards.AuthenticatedAveraging`, before this in the bases);
            None or absent: an open run.
    """

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        # hivemind caches a servicer class's RPC handlers, with their request types, in class attributes that a
        # subclass inherits: each class with this mixin collects its own (rpc_download_state reads a JoinRequest)
        cls._rpc_handlers = None
        cls._stub_type = None

    def __init__(self, *args, max_state_downloads: int = DEFAULT_MAX_STATE_DOWNLOADS,
                 state_download_stall_timeout: float = DEFAULT_STALL_TIMEOUT, **kwargs):
        self.max_state_downloads = check_max_state_downloads(max_state_downloads)
        if not state_download_stall_timeout > 0:
            raise ValueError(f"state_download_stall_timeout must be a positive number of seconds, "
                             f"got {state_download_stall_timeout!r}")
        self.state_download_stall_timeout = state_download_stall_timeout
        self._downloads_served: Dict[str, _Download] = {}  # requester -> its download (averager process only)
        self._serving_log = RateLimitedLog(logger)
        super().__init__(*args, **kwargs)

    # -- the requester's side: what it sends (VerifiedStateDownload calls this)
    async def _state_download_request(self) -> Union[averaging_pb2.DownloadRequest, averaging_pb2.JoinRequest]:
        swarm_auth = getattr(self, "swarm_auth", None)
        try:
            return await asyncio.get_running_loop().run_in_executor(
                None, download_request, swarm_auth, self.prefix, self.peer_id.to_bytes(), self.serializer)
        except CredentialsError as e:
            self._serving_log(logging.ERROR, f"{e}; asking for the state without a token (donors will refuse)")
            return averaging_pb2.DownloadRequest()

    # -- the donor's side
    def _state_requester(self, request: averaging_pb2.JoinRequest, context: P2PContext) -> Optional[str]:
        """Who asks (``user 'alice'`` with an authority, else ``peer <id>``), or None if refused (logged)."""
        swarm_auth: Optional[PeerCredentials] = getattr(self, "swarm_auth", None)
        if swarm_auth is None:
            return f"peer {context.remote_id}"
        proof = None
        if 0 < len(request.gather) <= MAX_PROOF_BYTES:
            try:
                proof = self.serializer.loads(request.gather)
            except Exception:  # any bytes a stranger sent: checked as no proof
                proof = None
        verdict = swarm_auth.check_join_proof(proof, self.prefix + PROOF_SUFFIX, context.remote_id.to_bytes())
        if not verdict.ok:
            self._serving_log(logging.WARNING, f"[lightning_swarm] refused a state download by peer "
                                               f"{context.remote_id}: {verdict.reason}")
            return None
        return f"user {verdict.user!r}"

    def _take_place(self, requester: str, context: P2PContext) -> Optional[_Download]:
        now = time.monotonic()
        for other, download in list(self._downloads_served.items()):
            if now - download.last_progress > self.state_download_stall_timeout:
                del self._downloads_served[other]  # a stalled requester's place goes to others
        if requester in self._downloads_served:
            self._serving_log(logging.WARNING, f"[lightning_swarm] refused a state download by {requester} (peer "
                                               f"{context.remote_id}): it is downloading this peer's state already "
                                               f"(one download at a time per requester)")
            return None
        if len(self._downloads_served) >= self.max_state_downloads:
            self._serving_log(logging.WARNING, f"[lightning_swarm] refused a state download by {requester} (peer "
                                               f"{context.remote_id}): this peer serves {len(self._downloads_served)} "
                                               f"already (max_state_downloads={self.max_state_downloads})")
            return None
        download = self._downloads_served[requester] = _Download(now)
        logger.info(f"[lightning_swarm] serving this peer's state to {requester} (peer {context.remote_id}; "
                    f"{len(self._downloads_served)} of max_state_downloads={self.max_state_downloads} at once)")
        return download

    async def rpc_download_state(
        self, request: averaging_pb2.JoinRequest, context: P2PContext
    ) -> AsyncIterator[averaging_pb2.DownloadData]:
        requester = self._state_requester(request, context)
        download = None if requester is None else self._take_place(requester, context)
        if download is None:
            return  # an empty stream: the requester tries its next donor

        def log_end(closed_by_requester: bool, seconds: float) -> None:
            logger.debug(f"[lightning_swarm] state stream to {requester}: "
                         + (f"closed by the requester {seconds:.2f} s after its last part" if closed_by_requester
                            else f"the requester did not close it within {seconds:.1f} s of its last part"))

        # the stream stays open after its last part until the requester closes it (stream_ends): a place is freed first
        async for message in held_open(self._served_state(request, context, requester, download), on_end=log_end):
            yield message

    async def _served_state(self, request: averaging_pb2.JoinRequest, context: P2PContext, requester: str,
                            download: _Download) -> AsyncIterator[averaging_pb2.DownloadData]:
        try:
            async for message in super().rpc_download_state(request, context):
                yield message
                if self._downloads_served.get(requester) is not download:
                    return  # stalled past the timeout: its place was given away
                download.last_progress = time.monotonic()
        finally:
            if self._downloads_served.get(requester) is download:
                del self._downloads_served[requester]
