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
from dataclasses import dataclass
from typing import Optional

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


def parse_public_key(text: str) -> RSAPublicKey:
    """An OpenSSH ``ssh-rsa AAAA...`` public key given inline or as the path of a file that holds one."""
    text = text.strip()
    if not text.startswith("ssh-rsa ") and os.path.isfile(text):
        with open(text) as f:
            text = f.read().strip()
    try:
        return RSAPublicKey.from_bytes(" ".join(text.split()[:2]).encode())
    except Exception as e:
        raise ValueError(f"not an OpenSSH RSA public key ('ssh-rsa AAAA...') or a file holding one: {text[:40]!r} ({e})")


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
    return parsed.timestamp()


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
    """Why a token is or is not good: ``ok`` and, if not, a ``reason`` a person can act on."""

    ok: bool
    reason: str = ""


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
    return TokenCheck(True)


def token_to_json(token: AccessToken) -> str:
    return json.dumps(dict(username=token.username, public_key=token.public_key.decode(),
                           expiration_time=token.expiration_time, signature=token.signature.decode()))


def token_from_json(text: str) -> AccessToken:
    try:
        data = json.loads(text)
        return AccessToken(username=str(data["username"]), public_key=str(data["public_key"]).encode(),
                           expiration_time=str(data["expiration_time"]), signature=str(data["signature"]).encode())
    except (ValueError, KeyError, TypeError) as e:
        raise ValueError(f"not an access token (JSON with username, public_key, expiration_time, signature): {e}")
