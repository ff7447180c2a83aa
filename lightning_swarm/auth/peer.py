"""A peer's side of authentication: where its token comes from, checked once at start with one clear line.

Configured by ``HivemindStrategy(auth={...})`` (or the monitor's options); each field falls back to an environment
variable ``LIGHTNING_SWARM_AUTH_<FIELD>`` (e.g. ``LIGHTNING_SWARM_AUTH_TOKEN``):

- ``authority_key``: the run's authority public key (``ssh-rsa AAAA...`` or a file holding it). Setting it turns
  authentication on; without it the run is open (the default, e.g. the embedded tiny run).
- ``token`` + ``key``: a token file issued offline (``python -m lightning_swarm.auth issue``) and the private key
  it was issued for; the peer signs everything with that key.
- ``server`` + ``username`` + ``key``: ask the authority service for tokens (renewed before they expire); ``key``
  is the user's private key listed in the allowlist; the peer signs with a fresh key of its own.
- ``server`` + ``hf_token``: the same, proving membership of the run's Hugging Face organisation instead.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import urllib.error
import urllib.request
from typing import Dict, Optional

from hivemind.proto.auth_pb2 import AccessToken
from hivemind.utils.crypto import RSAPrivateKey, RSAPublicKey
from hivemind.utils.timed_storage import get_dht_time

from lightning_swarm.auth.revert import RevertOrder, fetch_revert_order
from lightning_swarm.auth.service import request_bytes
from lightning_swarm.auth.tokens import (
    AuthError,
    TokenCheck,
    check_token,
    expiration_timestamp,
    issue_token,
    load_private_key,
    parse_public_key,
    public_key_text,
    token_from_json,
    token_to_json,
)
from lightning_swarm.hivemind_ext.keys import use_as_process_key

logger = logging.getLogger(__name__)

AUTH_FIELDS = ("authority_key", "token", "key", "server", "username", "hf_token")
ENV_PREFIX = "LIGHTNING_SWARM_AUTH_"


def resolve_auth_settings(auth: Optional[Dict[str, str]]) -> Dict[str, str]:
    """The auth fields given, completed from the environment; ``{}`` when the run has no authority (open run)."""
    auth = dict(auth or {})
    unknown = set(auth) - set(AUTH_FIELDS)
    if unknown:
        raise ValueError(f"auth: unknown field(s) {sorted(unknown)}; the fields are {list(AUTH_FIELDS)}")
    settings = {name: auth.get(name) or os.environ.get(ENV_PREFIX + name.upper()) for name in AUTH_FIELDS}
    settings = {name: str(value) for name, value in settings.items() if value}
    if not settings.get("authority_key"):
        if settings:
            raise ValueError(f"auth: {sorted(settings)} given without authority_key (the run's authority public "
                             f"key, or ${ENV_PREFIX}AUTHORITY_KEY)")
        return {}
    return settings


def _join_bytes(prefix: str, peer_id: bytes) -> bytes:
    return b"\n".join([b"lightning-swarm-join/v1", prefix.encode(), peer_id])


class SwarmAuth:
    """This peer's credentials in a run with an authority, and the checks every peer makes of the others (the
    :class:`~lightning_swarm.hivemind_ext.credentials.PeerCredentials` the averagers' guards call).

    Args:
        run_id: the run.
        authority_key: the authority's public key (text or file).
        token / key / server / username / hf_token: where this peer's token comes from (module docstring).
        refresh_margin: ask for a new token when the current one has less than this fraction of its lifetime left.
        timeout: seconds to wait for the authority service.
    """

    def __init__(self, run_id: str, authority_key: str, token: Optional[str] = None, key: Optional[str] = None,
                 server: Optional[str] = None, username: Optional[str] = None, hf_token: Optional[str] = None,
                 refresh_margin: float = 0.5, timeout: float = 30.0):
        self.run_id = run_id
        self.authority_public_key: RSAPublicKey = parse_public_key(authority_key)
        self.token_path, self.server, self.username, self.hf_token = token, server, username, hf_token
        self.refresh_margin, self.timeout = refresh_margin, timeout
        if token and server:
            raise ValueError("auth: give either token (issued offline) or server (ask the authority), not both")
        if token and not key:
            raise ValueError("auth: a token file needs the private key it was issued for (auth.key)")
        if server and not hf_token and not (username and key):
            raise ValueError("auth: asking the authority needs username and key (allowlist) or hf_token")
        self.user_key = load_private_key(key) if key else None
        # a token from a file names the user's key: sign with it; tokens from the service are for a key of our own
        self.private_key = self.user_key if token else RSAPrivateKey.process_wide()
        self._token: Optional[AccessToken] = None
        self._issued_at = 0.0
        self._lock = threading.Lock()
        self.issuer: Optional[RSAPrivateKey] = None  # set by for_moderator
        self.issuer_lifetime = 3600.0

    @classmethod
    def for_moderator(cls, run_id: str, authority_key_path: str, lifetime: float = 3600.0) -> "SwarmAuth":
        """Credentials of a moderators' peer (the monitor) that holds the authority's private key: it issues its
        own tokens and can sign revert orders (:attr:`issuer`)."""
        issuer = load_private_key(authority_key_path)
        auth = cls(run_id, public_key_text(issuer.get_public_key()))
        auth.issuer, auth.issuer_lifetime = issuer, lifetime
        return auth

    @classmethod
    def from_settings(cls, run_id: str, auth: Optional[Dict[str, str]]) -> Optional["SwarmAuth"]:
        """A SwarmAuth from ``HivemindStrategy(auth=...)`` plus the environment, or None for an open run."""
        settings = resolve_auth_settings(auth)
        return cls(run_id, **settings) if settings else None

    @property
    def public_key(self) -> RSAPublicKey:
        return self.private_key.get_public_key()

    def install(self) -> None:
        """Sign this process's DHT records and requests with the key the token is for (before the DHT starts)."""
        use_as_process_key(self.private_key)

    # ------------------------------------------------------------------------------------------- own token

    def token(self) -> AccessToken:
        """A valid token for this peer, renewed from the authority when due; AuthError (one clear line) if none."""
        with self._lock:
            if self._token is None or self._needs_refresh(self._token):
                self._token = self._fetch()
                self._issued_at = get_dht_time()
            return self._token

    def _needs_refresh(self, token: AccessToken) -> bool:
        expires = expiration_timestamp(token)
        if self.token_path:  # a file: re-read it shortly before it expires (a moderator may have renewed it)
            return expires - get_dht_time() < 60.0
        return get_dht_time() > self._issued_at + self.refresh_margin * (expires - self._issued_at)

    def _fetch(self) -> AccessToken:
        if self.issuer is not None:
            return issue_token(self.issuer, self.run_id, "moderator", self.public_key, self.issuer_lifetime)
        if not self.token_path and not self.server:
            raise AuthError(f"[lightning_swarm] run {self.run_id!r} requires an access token and none is configured: "
                            f"set auth.token + auth.key (issued by a moderator) or auth.server + auth.username + "
                            f"auth.key (or ${ENV_PREFIX}TOKEN ...)")
        token = self._read_token_file() if self.token_path else self._ask_authority()
        verdict = check_token(token, self.authority_public_key, self.run_id)
        if not verdict.ok:
            raise AuthError(f"[lightning_swarm] cannot join run {self.run_id!r}: {verdict.reason}; "
                            f"ask a moderator of the run for a new token")
        if token.public_key != self.public_key.to_bytes():
            raise AuthError(f"[lightning_swarm] cannot join run {self.run_id!r}: the token of {token.username!r} is "
                            f"for another key than auth.key")
        return token

    def _read_token_file(self) -> AccessToken:
        try:
            with open(self.token_path) as f:
                return token_from_json(f.read())
        except (OSError, ValueError) as e:
            raise AuthError(f"[lightning_swarm] cannot join run {self.run_id!r}: cannot read the access token "
                            f"{self.token_path}: {e}") from None

    def _ask_authority(self) -> AccessToken:
        public_key = public_key_text(self.public_key)
        request = dict(run_id=self.run_id, public_key=public_key)
        if self.hf_token:
            request["hf_token"] = self.hf_token
        else:
            time = get_dht_time()
            request.update(username=self.username, time=time, signature=self.user_key.sign(
                request_bytes(self.run_id, self.username, public_key, time)).decode())
        http_request = urllib.request.Request(
            self.server.rstrip("/") + "/token", data=json.dumps(request).encode(),
            headers={"Content-Type": "application/json"}, method="POST")
        try:
            with urllib.request.urlopen(http_request, timeout=self.timeout) as response:
                return token_from_json(response.read().decode())
        except urllib.error.HTTPError as e:
            try:
                reason = json.loads(e.read().decode()).get("error", "")
            except Exception:
                reason = ""
            raise AuthError(f"[lightning_swarm] the authority of run {self.run_id!r} refused a token: "
                            f"{reason or e}") from None
        except (OSError, ValueError) as e:
            raise AuthError(f"[lightning_swarm] cannot reach the authority of run {self.run_id!r} at "
                            f"{self.server}: {e}") from None

    # ------------------------------------------------------------------------------------------- others

    def check(self, token: Optional[AccessToken]):
        """Is another peer's token good for this run now? (a :class:`~lightning_swarm.auth.tokens.TokenCheck`)"""
        return check_token(token, self.authority_public_key, self.run_id)

    def token_for_records(self) -> str:
        """This peer's token as JSON, for its metrics records (the monitor names the user by it), or "" if it has
        none now (the DHT's authorizer already says why, once a minute)."""
        try:
            return token_to_json(self.token())
        except AuthError:
            return ""

    # ------------------------------------------------------------------------------------------- averaging

    def join_proof(self, prefix: str, peer_id: bytes) -> dict:
        """This peer's proof for the members of an averaging group of ``prefix``: its token, and a signature by the
        token's key over ``prefix`` and this peer's libp2p id ``peer_id``; AuthError if it has no valid token."""
        token = self.token()
        return dict(token=token_to_json(token), signature=self.private_key.sign(_join_bytes(prefix, peer_id)))

    def check_join_proof(self, proof, prefix: str, peer_id: bytes) -> TokenCheck:
        """Does ``proof`` (anything a peer sent; None if it sent none) admit peer ``peer_id`` to a group of
        ``prefix``: a valid token, signed over the prefix and that peer id by the token's key?"""
        if not isinstance(proof, dict):
            return TokenCheck(False, "no access token")
        try:
            token = token_from_json(proof["token"])
            signature = proof["signature"]
        except (KeyError, TypeError, ValueError):
            return TokenCheck(False, "a malformed join proof")
        verdict = self.check(token)
        if not verdict.ok:
            return verdict
        if not RSAPublicKey.from_bytes(token.public_key).verify(_join_bytes(prefix, peer_id), signature):
            return TokenCheck(False, f"a join proof of {token.username!r} not signed for this peer id")
        return TokenCheck(True, token.username)

    def revert_order(self, dht) -> Optional[RevertOrder]:
        """The run's newest valid revert order in ``dht`` (a hivemind.DHT), or None."""
        return fetch_revert_order(dht, self.run_id, self.authority_public_key)
