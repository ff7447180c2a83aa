"""hivemind's authorization hooks, filled in: every DHT request and response carries a valid token, and a record
may only be stored by the peer that owns (signed) it.

:class:`SwarmAuthorizer` is a ``hivemind.utils.auth.TokenAuthorizerBase``: a DHT created with
``authorizer=SwarmAuthorizer(auth)`` signs its requests and responses with this peer's token and key, and drops
requests and responses whose token is missing, expired, for another run or not signed by the run's authority.

hivemind checks the token of the peer that *sends* a store, not of the key that *signed* the record: an insider
could store records signed by keys it minted itself (one per fake peer in the progress and metrics tables).
:class:`OwnerIsRequesterValidator` refuses, on the receiving node, a record whose ``[owner:...]`` key is not
the key of the token the store arrived with.
"""

from __future__ import annotations

import asyncio
import contextvars
import logging
import re
from typing import Optional

from hivemind.dht.validation import DHTRecord, RecordValidatorBase
from hivemind.proto.auth_pb2 import AccessToken
from hivemind.utils.auth import AuthorizedRequestBase, AuthorizedResponseBase, TokenAuthorizerBase

from lightning_swarm.auth.peer import SwarmAuth
from lightning_swarm.auth.tokens import AuthError
from lightning_swarm.logs import RateLimitedLog

logger = logging.getLogger(__name__)

# the public key of the token the DHT request being served came with (None outside a served request)
_requester_key: contextvars.ContextVar[Optional[bytes]] = contextvars.ContextVar("swarm_requester_key", default=None)

_OWNER_MARKER = re.compile(rb"\[owner:(.+?)\]")  # as hivemind.dht.crypto.RSASignatureValidator writes it


def _who(token: AccessToken) -> str:
    return f"user {token.username!r}" if token.username else "a peer without a token"


class SwarmAuthorizer(TokenAuthorizerBase):
    """Signs this peer's DHT requests/responses with its token and refuses those of peers without a valid one.

    Args:
        auth: this peer's credentials and the run's authority key.
    """

    def __init__(self, auth: SwarmAuth):
        super().__init__(local_private_key=auth.private_key)
        self.auth = auth
        self._log = RateLimitedLog(logger)

    async def get_token(self) -> AccessToken:
        try:
            return await asyncio.get_running_loop().run_in_executor(None, self.auth.token)
        except AuthError as e:  # e.g. banned: every later request of this peer fails; say why, once a minute
            self._log(logging.ERROR, f"{e}; this peer can no longer talk to the swarm")
            raise

    def is_token_valid(self, access_token: AccessToken) -> bool:
        return self.auth.check(access_token).ok

    def does_token_need_refreshing(self, access_token: AccessToken) -> bool:
        return self.auth._needs_refresh(access_token)

    async def validate_request(self, request: AuthorizedRequestBase) -> bool:
        token = AccessToken()
        token.CopyFrom(request.auth.client_access_token)
        verdict = self.auth.check(token)
        valid = verdict.ok and await super().validate_request(request)
        if valid:
            _requester_key.set(bytes(token.public_key))
        else:
            reason = verdict.reason if not verdict.ok else "bad request signature, replay or clock off by over 1 min"
            self._log(logging.WARNING, f"[lightning_swarm] refused a DHT request from {_who(token)}: {reason}")
        return valid

    async def validate_response(self, response: AuthorizedResponseBase, request: AuthorizedRequestBase) -> bool:
        valid = await super().validate_response(response, request)
        if not valid:
            token = response.auth.service_access_token
            self._log(logging.WARNING, f"[lightning_swarm] ignored a DHT response from {_who(token)}: "
                                       f"{self.auth.check(token).reason or 'bad signature'}")
        return valid


class OwnerIsRequesterValidator(RecordValidatorBase):
    """Refuses a record stored by a peer whose token key is not the record's ``[owner:...]`` key.

    Records without an owner (e.g. averager declarations) pass; so do records this node stores itself or reads
    in a response (the responder's token was checked, and it checked the record's owner when it was stored).
    """

    def __init__(self):
        self._log = RateLimitedLog(logger)

    def validate(self, record: DHTRecord) -> bool:
        requester = _requester_key.get()
        if requester is None:
            return True
        owners = _OWNER_MARKER.findall(record.key) + _OWNER_MARKER.findall(record.subkey)
        if all(owner == requester for owner in owners):
            return True
        self._log(logging.WARNING, "[lightning_swarm] refused a DHT record signed by another key than the token "
                                   "of the peer that stored it")
        return False

    def merge_with(self, other: RecordValidatorBase) -> bool:
        return isinstance(other, OwnerIsRequesterValidator)
