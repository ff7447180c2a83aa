"""Access tokens: "user U may take part in run R with public key K until time T", signed by the run's authority.

A token is hivemind's ``AccessToken`` protobuf (username, public_key, expiration_time, signature), so hivemind's
``TokenAuthorizerBase`` can carry it in every DHT request and response. The authority signs
``lightning-swarm-token/v1 | run_id | username | public_key | expiration_time``: a token is good for one run only.
On disk (a token issued offline) it is a small JSON file, see :func:`token_to_json`.
"""

from __future__ import annotations

import datetime
import json
import os
import re
import threading
from dataclasses import dataclass
from typing import Dict, Optional, Tuple

from hivemind.proto.auth_pb2 import AccessToken
from hivemind.utils.crypto import RSAPrivateKey, RSAPublicKey
from hivemind.utils.timed_storage import get_dht_time

from lightning_swarm.hivemind_ext.credentials import CredentialsError
from lightning_swarm.hivemind_ext.keys import private_key_from_pem, private_key_to_pem

USERNAME_PATTERN = re.compile(r"[A-Za-z0-9_.@+\-]{1,64}")


class AuthError(CredentialsError):
    """This peer cannot take part in the run: no, expired or refused token (the message says which)."""


# ------------------------------------------------------------------------------------------------- keys


def generate_key() -> RSAPrivateKey:
    return RSAPrivateKey()


def save_key(key: RSAPrivateKey, path: str) -> str:
    """Write the private key to ``path`` (PEM, mode 600) and its public key to ``path + '.pub'``; returns the latter."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(private_key_to_pem(key))
    public_path = path + ".pub"
    with open(public_path, "wb") as f:
        f.write(key.get_public_key().to_bytes() + b"\n")
    return public_path


def load_private_key(path: str) -> RSAPrivateKey:
    with open(path, "rb") as f:
        pem = f.read()
    try:
        return private_key_from_pem(pem)
    except ValueError as e:
        raise ValueError(f"{path}: not an unencrypted RSA private key in PEM format ({e})") from None


# an OpenSSH RSA public key of up to 8192 bits is about 1.4 kB; anything longer is not one
MAX_PUBLIC_KEY_CHARS = 2048
PUBLIC_KEY_ERROR = "not an OpenSSH RSA public key ('ssh-rsa AAAA...')"


def parse_public_key(text: str) -> RSAPublicKey:
    """An OpenSSH ``ssh-rsa AAAA...`` public key given inline (a comment after it is ignored).

    Never opens a file: this parses what strangers send (token requests, allowlist lines). The error says what was
    expected, never what was given. Local configuration that may name a file goes through :func:`read_public_key`.
    """
    if not isinstance(text, str) or len(text) > MAX_PUBLIC_KEY_CHARS:
        raise ValueError(PUBLIC_KEY_ERROR)
    fields = text.split()
    if len(fields) < 2 or fields[0] != "ssh-rsa":
        raise ValueError(PUBLIC_KEY_ERROR)
    try:
        return RSAPublicKey.from_bytes(" ".join(fields[:2]).encode())
    except Exception:
        raise ValueError(PUBLIC_KEY_ERROR) from None


def read_public_key(text_or_path: str) -> RSAPublicKey:
    """A public key from this machine's own configuration: ``ssh-rsa AAAA...`` inline, or the path of a file that
    holds one (e.g. ``authority.pem.pub``). Only for options and command lines the user wrote, never for received
    data (:func:`parse_public_key`)."""
    text = text_or_path.strip()
    if text.startswith("ssh-rsa "):
        return parse_public_key(text)
    try:
        with open(text) as f:
            content = f.read(MAX_PUBLIC_KEY_CHARS + 1)
    except OSError as e:
        raise ValueError(f"{text}: cannot read this public key file ({e.strerror})") from None
    try:
        return parse_public_key(content)
    except ValueError:
        raise ValueError(f"{text}: {PUBLIC_KEY_ERROR}") from None


def public_key_text(key: RSAPublicKey) -> str:
    return key.to_bytes().decode()


# ------------------------------------------------------------------------------------------------- tokens


def _signed_bytes(run_id: str, username: str, public_key: bytes, expiration_time: str) -> bytes:
    return b"\n".join([b"lightning-swarm-token/v1", run_id.encode(), username.encode(), public_key,
                       expiration_time.encode()])


def format_time(timestamp: float) -> str:
    return datetime.datetime.fromtimestamp(timestamp, datetime.timezone.utc).isoformat(timespec="seconds")


def expiration_timestamp(token: AccessToken) -> float:
    """The token's expiration as a unix time (``-inf`` if it does not parse)."""
    try:
        parsed = datetime.datetime.fromisoformat(token.expiration_time)
    except (TypeError, ValueError):
        return -float("inf")
    if parsed.tzinfo is None:
        return -float("inf")  # we only write UTC times with an offset: anything else is not ours
    try:
        return parsed.timestamp()
    except (OverflowError, ValueError):
        return -float("inf")


def issue_token(authority_key: RSAPrivateKey, run_id: str, username: str, public_key: RSAPublicKey,
                lifetime: float, now: Optional[float] = None) -> AccessToken:
    """A token for ``username`` holding ``public_key`` in ``run_id``, valid for ``lifetime`` seconds from now."""
    if not USERNAME_PATTERN.fullmatch(username or ""):
        raise ValueError(f"user names are 1-64 letters, digits or _.@+-, got {username!r}")
    if lifetime <= 0:
        raise ValueError(f"token lifetime must be positive, got {lifetime}")
    expiration = format_time((get_dht_time() if now is None else now) + lifetime)
    key_bytes = public_key.to_bytes()
    signature = authority_key.sign(_signed_bytes(run_id, username, key_bytes, expiration))
    return AccessToken(username=username, public_key=key_bytes, expiration_time=expiration, signature=signature)


@dataclass(frozen=True)
class TokenCheck:
    """Why a token is or is not good: ``ok`` and, if not, a ``reason`` a person can act on; ``user``: whose token
    it is (set when ``ok``)."""

    ok: bool
    reason: str = ""
    user: str = ""


def check_token(token: Optional[AccessToken], authority_public_key: RSAPublicKey, run_id: str,
                now: Optional[float] = None) -> TokenCheck:
    """Is ``token`` signed by the run's authority for ``run_id`` and unexpired at ``now``?"""
    if token is None or not token.signature:
        return TokenCheck(False, "no access token")
    signed = _signed_bytes(run_id, token.username, token.public_key, token.expiration_time)
    if not authority_public_key.verify(signed, token.signature):
        return TokenCheck(False, f"the token of {token.username!r} is not signed by the authority of run {run_id!r}")
    now = get_dht_time() if now is None else now
    if expiration_timestamp(token) <= now:
        return TokenCheck(False, f"the token of {token.username!r} expired at {token.expiration_time}")
    return TokenCheck(True, user=token.username)


class NewestTokens:
    """One live key per user, as peers see it: the newest token seen of each user (its expiration, then its key, as
    the tiebreak), and whether a token was superseded by a newer one of the same user *for another key*.

    The authority issues a user's token for a new key only after that user's previous tokens (it expires later than
    all of them), and no more tokens for the replaced key; so once a peer has seen the newer token, the older key
    is refused. Renewals for the same key supersede nothing. Thread-safe; memory: one entry per user seen.
    """

    def __init__(self):
        self._newest: Dict[str, Tuple[float, bytes]] = {}
        self._lock = threading.Lock()

    def admit(self, token: AccessToken) -> bool:
        """Record ``token`` (already checked valid) and say whether it is its user's newest key: False if a token of
        the same user for another key and expiring later was seen."""
        mine = (expiration_timestamp(token), bytes(token.public_key))
        with self._lock:
            newest = self._newest.get(token.username)
            if newest is not None and newest[1] != mine[1] and newest > mine:
                return False
            if newest is None or mine > newest:
                self._newest[token.username] = mine
            return True


def token_to_json(token: AccessToken) -> str:
    return json.dumps(dict(username=token.username, public_key=token.public_key.decode(),
                           expiration_time=token.expiration_time, signature=token.signature.decode()))


# a token is ~1.2 kB of JSON (an RSA-2048 public key and signature): 16 kB is far beyond any token
MAX_TOKEN_JSON_CHARS = 16 * 1024
_TOKEN_FIELDS = dict(username=64, public_key=MAX_PUBLIC_KEY_CHARS, expiration_time=64, signature=2048)


def token_from_json(text: str) -> AccessToken:
    """The token in ``text`` (JSON with the four string fields of :func:`token_to_json`); ValueError otherwise.

    ``text`` may come from a stranger (a join proof, an authority's answer): sizes and types are checked before use,
    and the error never quotes the input."""
    if not isinstance(text, str) or len(text) > MAX_TOKEN_JSON_CHARS:
        raise ValueError("not an access token: not a string of at most 16 kB")
    try:
        data = json.loads(text)
    except (ValueError, RecursionError):
        raise ValueError("not an access token: not JSON") from None
    if not isinstance(data, dict):
        raise ValueError("not an access token: not a JSON object")
    fields = {}
    for name, longest in _TOKEN_FIELDS.items():
        value = data.get(name)
        if not isinstance(value, str) or len(value) > longest:
            raise ValueError(f"not an access token: {name} missing, not a string or longer than {longest}")
        fields[name] = value
    return AccessToken(username=fields["username"], public_key=fields["public_key"].encode(),
                       expiration_time=fields["expiration_time"], signature=fields["signature"].encode())
