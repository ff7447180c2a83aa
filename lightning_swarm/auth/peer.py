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
- ``allow_http``: ``true`` to ask an authority at a plain ``http://`` address off this machine (refused otherwise:
  a Hugging Face token sent in clear can be used by whoever sees it). ``https://`` and loopback addresses need no
  such option.

One live key per user: a peer refuses another peer's token once it has seen a newer token of the same user for
another key (:class:`~lightning_swarm.auth.tokens.NewestTokens`); the authority stops renewing a superseded key.
"""

from __future__ import annotations

import ipaddress
import json
import logging
import os
import threading
import urllib.error
import urllib.parse
import urllib.request
from typing import Dict, Optional, Union

from hivemind.proto.auth_pb2 import AccessToken
from hivemind.utils.crypto import RSAPrivateKey, RSAPublicKey
from hivemind.utils.timed_storage import get_dht_time

from lightning_swarm.auth.revert import RevertOrder, fetch_revert_order
from lightning_swarm.auth.service import hf_request_bytes, request_bytes
from lightning_swarm.auth.tokens import (
    AuthError,
    NewestTokens,
    TokenCheck,
    check_token,
    expiration_timestamp,
    issue_token,
    load_private_key,
    public_key_text,
    read_public_key,
    token_from_json,
    token_to_json,
)
from lightning_swarm.hivemind_ext.keys import use_as_process_key

logger = logging.getLogger(__name__)

AUTH_FIELDS = ("authority_key", "token", "key", "server", "username", "hf_token", "allow_http")
ENV_PREFIX = "LIGHTNING_SWARM_AUTH_"
# the authority's answer is a token (~1.2 kB) or a one-line error: more is not an answer of the authority
MAX_ANSWER_BYTES = 16 * 1024
MAX_JOIN_SIGNATURE_BYTES = 1024  # base64 of an RSA signature: 344 bytes for RSA-2048, 684 for RSA-4096


def _flag(value) -> bool:
    """``allow_http`` as given (a bool, or text from YAML or the environment)."""
    if isinstance(value, bool):
        return value
    text = str(value).strip().lower()
    if text in ("1", "true", "yes", "on"):
        return True
    if text in ("", "0", "false", "no", "off", "none"):
        return False
    raise ValueError(f"auth.allow_http: expected true or false, got {value!r}")


def check_authority_url(server: str, allow_http: bool) -> None:
    """Refuse an authority address a token request should not go to: ``https://`` always passes, ``http://`` only
    to a loopback address or with ``allow_http`` (logged); anything else is an error naming the fix."""
    parts = urllib.parse.urlsplit(server)
    host = parts.hostname or ""
    if parts.scheme == "https" and host:
        return
    if parts.scheme != "http" or not host:
        raise ValueError(f"auth.server: expected an https:// (or http:// on this machine) address, got {server!r}")
    try:
        loopback = host == "localhost" or ipaddress.ip_address(host).is_loopback
    except ValueError:
        loopback = False
    if loopback:
        return
    if not allow_http:
        raise ValueError(f"auth.server {server!r} is plain http:// off this machine: anyone on the way sees the "
                         f"requests (a Hugging Face token in them can be used by whoever sees it). Put the authority "
                         f"behind TLS (https://), or set auth.allow_http: true to accept the risk")
    logger.warning(f"[lightning_swarm] asking the authority over plain http:// at {server} (auth.allow_http): "
                   f"anyone on the way sees the requests and answers")


def parse_authority_answer(status: int, body: bytes) -> AccessToken:
    """The token in the authority's answer (HTTP ``status``, ``body``), or AuthError saying why not.

    The body is a stranger's bytes: at most :data:`MAX_ANSWER_BYTES`, and an error message from it is cut to one
    printable line of at most 200 characters before it is shown."""
    if not isinstance(body, (bytes, bytearray)) or len(body) > MAX_ANSWER_BYTES:
        raise AuthError(f"the authority's answer is longer than {MAX_ANSWER_BYTES} bytes")
    if status == 200:
        try:
            return token_from_json(bytes(body).decode("utf-8"))
        except (UnicodeDecodeError, ValueError) as e:
            raise AuthError(f"the authority's answer is not a token ({e})") from None
    reason = ""
    try:
        answer = json.loads(bytes(body).decode("utf-8"))
        if isinstance(answer, dict) and isinstance(answer.get("error"), str):
            reason = "".join(c if c.isprintable() else " " for c in answer["error"][:200])
    except (ValueError, RecursionError):
        pass
    raise AuthError(reason or f"HTTP {status}")


def resolve_auth_settings(auth: Optional[Dict[str, str]]) -> Dict[str, str]:
    """The auth fields given, completed from the environment; ``{}`` when the run has no authority (open run)."""
    auth = dict(auth or {})
    unknown = set(auth) - set(AUTH_FIELDS)
    if unknown:
        raise ValueError(f"auth: unknown field(s) {sorted(unknown)}; the fields are {list(AUTH_FIELDS)}")
    settings = {name: auth.get(name) or os.environ.get(ENV_PREFIX + name.upper()) for name in AUTH_FIELDS}
    settings = {name: str(value) for name, value in settings.items() if value not in (None, "", False)}
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
        allow_http: accept an ``http://`` authority off this machine (see the module docstring).
        refresh_margin: ask for a new token when the current one has less than this fraction of its lifetime left.
        timeout: seconds to wait for the authority service.
    """

    def __init__(self, run_id: str, authority_key: str, token: Optional[str] = None, key: Optional[str] = None,
                 server: Optional[str] = None, username: Optional[str] = None, hf_token: Optional[str] = None,
                 allow_http: Union[bool, str] = False, refresh_margin: float = 0.5, timeout: float = 30.0):
        self.run_id = run_id
        self.authority_public_key: RSAPublicKey = read_public_key(authority_key)
        self.token_path, self.server, self.username, self.hf_token = token, server, username, hf_token
        self.refresh_margin, self.timeout = refresh_margin, timeout
        if token and server:
            raise ValueError("auth: give either token (issued offline) or server (ask the authority), not both")
        if token and not key:
            raise ValueError("auth: a token file needs the private key it was issued for (auth.key)")
        if server and not hf_token and not (username and key):
            raise ValueError("auth: asking the authority needs username and key (allowlist) or hf_token")
        if server:
            check_authority_url(server, _flag(allow_http))
        self.user_key = load_private_key(key) if key else None
        # a token from a file names the user's key: sign with it; tokens from the service are for a key of our own
        self.private_key = self.user_key if token else RSAPrivateKey.process_wide()
        self._token: Optional[AccessToken] = None
        self._issued_at = 0.0
        self._lock = threading.Lock()
        self.issuer: Optional[RSAPrivateKey] = None  # set by for_moderator
        self.issuer_lifetime = 3600.0
        self.newest_tokens = NewestTokens()  # the newest token seen of each user: older keys are refused

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

    def token_request(self) -> dict:
        """The JSON body this peer sends the authority to ask for a token (signed now)."""
        public_key = public_key_text(self.public_key)
        time = get_dht_time()
        request = dict(run_id=self.run_id, public_key=public_key, time=time)
        if self.hf_token:  # signed by the key the token is for: a replay with another key does not verify
            request.update(hf_token=self.hf_token, signature=self.private_key.sign(
                hf_request_bytes(self.run_id, public_key, time, self.hf_token)).decode())
        else:
            request.update(username=self.username, signature=self.user_key.sign(
                request_bytes(self.run_id, self.username, public_key, time)).decode())
        return request

    def _ask_authority(self) -> AccessToken:
        http_request = urllib.request.Request(
            self.server.rstrip("/") + "/token", data=json.dumps(self.token_request()).encode(),
            headers={"Content-Type": "application/json"}, method="POST")
        who = f" for user {self.username!r}" if self.username else ""
        try:
            with urllib.request.urlopen(http_request, timeout=self.timeout) as response:
                status, body = response.status, response.read(MAX_ANSWER_BYTES + 1)
        except urllib.error.HTTPError as e:
            status, body = e.code, e.read(MAX_ANSWER_BYTES + 1)
        except (OSError, ValueError) as e:
            raise AuthError(f"[lightning_swarm] cannot reach the authority of run {self.run_id!r} at "
                            f"{self.server}: {e}") from None
        try:
            return parse_authority_answer(status, body)
        except AuthError as e:
            raise AuthError(f"[lightning_swarm] the authority of run {self.run_id!r} refused a token{who}: "
                            f"{e}") from None

    # ------------------------------------------------------------------------------------------- others

    def check(self, token: Optional[AccessToken]):
        """Is another peer's token good for this run now, and its user's newest key this peer has seen? (a
        :class:`~lightning_swarm.auth.tokens.TokenCheck`, with the token's user when it is good)"""
        verdict = check_token(token, self.authority_public_key, self.run_id)
        if verdict.ok and not self.newest_tokens.admit(token):
            return TokenCheck(False, f"the token of {token.username!r} is superseded: that user has taken part "
                                     f"with a newer key since (one key per user)")
        return verdict

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
        signature = proof.get("signature")
        if not isinstance(signature, bytes) or len(signature) > MAX_JOIN_SIGNATURE_BYTES:
            return TokenCheck(False, "a malformed join proof")
        try:
            token = token_from_json(proof.get("token"))
        except ValueError:
            return TokenCheck(False, "a malformed join proof")
        verdict = self.check(token)
        if not verdict.ok:
            return verdict
        if not RSAPublicKey.from_bytes(token.public_key).verify(_join_bytes(prefix, peer_id), signature):
            return TokenCheck(False, f"a join proof of {token.username!r} not signed for this peer id")
        return TokenCheck(True, user=token.username)

    def revert_order(self, dht) -> Optional[RevertOrder]:
        """The run's newest valid revert order in ``dht`` (a hivemind.DHT), or None."""
        return fetch_revert_order(dht, self.run_id, self.authority_public_key)
