"""The run's authority: a small HTTP service that gives allowlisted users signed, expiring access tokens.

Moderators run it next to the monitor (``python -m lightning_swarm.auth serve ...``). A peer asks for a token for
its own (per-process) public key and proves who it is in one of two ways:

- allowlist: it signs ``request_bytes(run_id, username, public_key, time)`` with the user's private key, whose
  public key is listed for that user in the allowlist file;
- Hugging Face organisation (as in the seed run): it sends a Hugging Face token of a member of the organisation,
  and signs ``hf_request_bytes(run_id, public_key, time, hf_token)`` with the key it asks a token for.

``POST /token`` with JSON ``{run_id, username, public_key, time, signature}`` (or ``{run_id, public_key, time,
signature, hf_token}``) answers 200 with the token's JSON, or 400/403/413 with ``{"error": "..."}``.

Every byte of a request is a stranger's: the body is at most :data:`MAX_REQUEST_BYTES`, each field's type and size
is checked before use, the public key is parsed inline (no file is ever opened because a request named it), and
every refusal is one of the fixed messages of :class:`Refusal`: no answer quotes the request or a file.

A proof is bound to the key the token is for (the allowlist signature covers it; a Hugging Face request is signed
by that key) and to a time within :data:`MAX_REQUEST_AGE` of the authority's clock; a request already answered is
refused when replayed. One live key per user: a token for a new key of a user supersedes the previous key (its
tokens expire later than any of the old key's), and the authority issues no more tokens for a key it superseded.
"""

from __future__ import annotations

import asyncio
import collections
import hashlib
import json
import logging
import math
import threading
from dataclasses import dataclass, field
from typing import Deque, Dict, Optional, Tuple

from aiohttp import web
from hivemind.utils.crypto import RSAPrivateKey, RSAPublicKey
from hivemind.utils.timed_storage import get_dht_time

from lightning_swarm.auth.allowlist import hugging_face_member, read_allowlist
from lightning_swarm.auth.tokens import (
    MAX_PUBLIC_KEY_CHARS,
    USERNAME_PATTERN,
    format_time,
    issue_token,
    parse_public_key,
    token_to_json,
)

logger = logging.getLogger(__name__)

# a request signed longer ago (or further ahead) than this is refused: it could be a replay
MAX_REQUEST_AGE = 60.0
# a token request is under 2 kB (an RSA-2048 public key, a signature, a name and a time)
MAX_REQUEST_BYTES = 8 * 1024
MAX_SIGNATURE_CHARS = 2048
MAX_RUN_ID_CHARS = 256
MAX_HF_TOKEN_CHARS = 256
# keys of a user the authority remembers as superseded (a user who cycles through more gets the oldest back)
RETIRED_KEYS_PER_USER = 64


class Refusal(Exception):
    """A refused token request: an HTTP status and one of the fixed messages below (never any input)."""

    TOO_LARGE = (413, f"the request is larger than {MAX_REQUEST_BYTES} bytes")
    NOT_JSON = (400, "expected a JSON object")
    BAD_FIELD = (400, "a field is missing, of the wrong type or too long (run_id, public_key, time, signature, "
                      "and username or hf_token)")
    BAD_PUBLIC_KEY = (400, "public_key is not an OpenSSH RSA public key ('ssh-rsa AAAA...')")
    WRONG_RUN = (403, "this authority issues tokens for another run")
    HF_ONLY = (403, "this authority admits Hugging Face organisation members only (send hf_token)")
    ALLOWLIST_ONLY = (403, "this authority admits allowlisted users only (send username)")
    NOT_LISTED = (403, "this user is not on the allowlist of this run (never added, or removed)")
    CLOCK = (403, f"the request's time is more than {MAX_REQUEST_AGE:.0f} s off (check this machine's clock)")
    BAD_SIGNATURE = (403, "the request is not signed by a key the allowlist lists for this user")
    BAD_HF_SIGNATURE = (403, "the request is not signed by the key it asks a token for")
    NOT_MEMBER = (403, "the Hugging Face token is not a member's of this run's organisation")
    REPLAY = (403, "this request was already answered (a replay)")
    INTERNAL = (500, "the authority cannot decide now (its log says why)")
    SUPERSEDED = (403, "this key was superseded by a newer key of the same user: one key per user takes part; "
                       "the user's newest peer holds the seat")

    def __init__(self, kind: Tuple[int, str]):
        self.status, self.message = kind
        super().__init__(self.message)


# every message an answer of the authority may carry
FIXED_MESSAGES = frozenset(value[1] for name, value in vars(Refusal).items() if name.isupper())


def request_bytes(run_id: str, username: str, public_key: str, time: float) -> bytes:
    """What a peer signs with its user key to ask for a token."""
    return "\n".join(["lightning-swarm-token-request/v1", run_id, username, public_key, repr(float(time))]).encode()


def hf_request_bytes(run_id: str, public_key: str, time: float, hf_token: str) -> bytes:
    """What a peer signs with the key it asks a token for, beside a Hugging Face token (binds the proof to that key
    and time: a replay with another key does not verify)."""
    digest = hashlib.sha256(hf_token.encode()).hexdigest()
    return "\n".join(["lightning-swarm-token-request-hf/v1", run_id, public_key, repr(float(time)), digest]).encode()


@dataclass(frozen=True)
class TokenRequest:
    """A token request whose fields have the right types and sizes (nothing else is known about it yet)."""

    run_id: str
    public_key: str
    time: float
    signature: str
    username: Optional[str] = None
    hf_token: Optional[str] = None


def _string(data: dict, name: str, longest: int, required: bool = True) -> Optional[str]:
    value = data.get(name)
    if value is None and not required:
        return None
    if not isinstance(value, str) or not value or len(value) > longest:
        raise Refusal(Refusal.BAD_FIELD)
    return value


def parse_token_request(body: bytes) -> TokenRequest:
    """The fields of one ``POST /token`` body, checked for type and size; :class:`Refusal` otherwise."""
    if len(body) > MAX_REQUEST_BYTES:
        raise Refusal(Refusal.TOO_LARGE)
    try:
        data = json.loads(body.decode("utf-8"))
    except (ValueError, RecursionError):  # UnicodeDecodeError and JSONDecodeError are ValueErrors
        raise Refusal(Refusal.NOT_JSON) from None
    if not isinstance(data, dict):
        raise Refusal(Refusal.NOT_JSON)
    time = data.get("time")
    if isinstance(time, bool) or not isinstance(time, (int, float)) or not math.isfinite(time):
        raise Refusal(Refusal.BAD_FIELD)
    username = _string(data, "username", 64, required=False)
    hf_token = _string(data, "hf_token", MAX_HF_TOKEN_CHARS, required=False)
    if (username is None) == (hf_token is None) or (username is not None and not USERNAME_PATTERN.fullmatch(username)):
        raise Refusal(Refusal.BAD_FIELD)
    return TokenRequest(run_id=_string(data, "run_id", MAX_RUN_ID_CHARS),
                        public_key=_string(data, "public_key", MAX_PUBLIC_KEY_CHARS), time=float(time),
                        signature=_string(data, "signature", MAX_SIGNATURE_CHARS), username=username,
                        hf_token=hf_token)


@dataclass
class _Seat:
    """What the authority remembers of one user: the live key, its latest expiration, the keys it replaced."""

    key: bytes
    expiration: float
    retired: Deque[bytes] = field(default_factory=lambda: collections.deque(maxlen=RETIRED_KEYS_PER_USER))


class Authority:
    """Decides token requests for one run.

    Args:
        authority_key: the run's authority private key (peers are configured with its public key).
        run_id: the run the tokens are for.
        allowlist_path: allowlist file (see :mod:`lightning_swarm.auth.allowlist`); re-read at every request.
        token_lifetime: seconds a token stays valid; also the longest a ban takes to reach every peer.
        hf_organization: also admit members of this Hugging Face organisation (their Hub token as proof).
        hf_endpoint: the Hugging Face Hub to ask who a Hub token belongs to (default: huggingface.co, or
            ``$HF_ENDPOINT``).

    What it remembers (one live key per user, answered requests) is kept in memory: a restarted authority forgets
    which keys it superseded.
    """

    def __init__(self, authority_key: RSAPrivateKey, run_id: str, allowlist_path: Optional[str] = None,
                 token_lifetime: float = 3600.0, hf_organization: Optional[str] = None,
                 hf_endpoint: Optional[str] = None):
        if allowlist_path is None and hf_organization is None:
            raise ValueError("the authority needs an allowlist file, a Hugging Face organisation, or both")
        if token_lifetime <= 0:
            raise ValueError(f"token_lifetime must be positive, got {token_lifetime}")
        self.authority_key, self.run_id = authority_key, run_id
        self.allowlist_path, self.hf_organization, self.hf_endpoint = allowlist_path, hf_organization, hf_endpoint
        self.token_lifetime = token_lifetime
        self._seats: Dict[str, _Seat] = {}
        self._answered: Dict[bytes, float] = {}  # digest of an answered request's signature -> its time
        self._lock = threading.Lock()

    def answer(self, body: bytes) -> Tuple[int, dict]:
        """(HTTP status, JSON body) for one ``POST /token`` body."""
        try:
            token = self.decide(parse_token_request(body))
        except Refusal as refusal:
            return refusal.status, {"error": refusal.message}
        except Exception as e:  # e.g. a malformed allowlist line: the moderators' problem, told in their log only
            logger.error(f"cannot decide a token request: {e!r}")
            return Refusal.INTERNAL[0], {"error": Refusal.INTERNAL[1]}
        return 200, json.loads(token_to_json(token))

    def decide(self, request: TokenRequest):
        """The token for a well-formed request, or :class:`Refusal` (logged, with the user name if it is valid)."""
        who = request.username if request.username is not None else "a Hugging Face user"
        try:
            if request.run_id != self.run_id:
                raise Refusal(Refusal.WRONG_RUN)
            try:
                public_key = parse_public_key(request.public_key)
            except ValueError:
                raise Refusal(Refusal.BAD_PUBLIC_KEY) from None
            if abs(request.time - get_dht_time()) > MAX_REQUEST_AGE:
                raise Refusal(Refusal.CLOCK)
            if request.hf_token is not None:
                username = self._check_hugging_face(request, public_key)
                who = repr(username)
            else:
                self._check_allowlist(request)
                username = request.username
            return self._issue(username, public_key, request)
        except Refusal as refusal:
            logger.warning(f"refused a token to {who}: {refusal.message}")
            raise

    def _check_allowlist(self, request: TokenRequest) -> None:
        if self.allowlist_path is None:
            raise Refusal(Refusal.HF_ONLY)
        allowed = read_allowlist(self.allowlist_path).get(request.username)
        if not allowed:
            raise Refusal(Refusal.NOT_LISTED)
        signed = request_bytes(self.run_id, request.username, request.public_key, request.time)
        if not any(key.verify(signed, request.signature.encode()) for key in allowed):
            raise Refusal(Refusal.BAD_SIGNATURE)

    def _check_hugging_face(self, request: TokenRequest, public_key: RSAPublicKey) -> str:
        if not self.hf_organization:
            raise Refusal(Refusal.ALLOWLIST_ONLY)
        signed = hf_request_bytes(self.run_id, request.public_key, request.time, request.hf_token)
        if not public_key.verify(signed, request.signature.encode()):
            raise Refusal(Refusal.BAD_HF_SIGNATURE)
        self._refuse_replay(request)  # before asking the Hub: a replay costs the Hub nothing
        username = hugging_face_member(request.hf_token, self.hf_organization, self.hf_endpoint)
        if username is None or not USERNAME_PATTERN.fullmatch(username):
            raise Refusal(Refusal.NOT_MEMBER)
        return username

    def _refuse_replay(self, request: TokenRequest) -> None:
        digest = hashlib.sha256(request.signature.encode()).digest()
        now = get_dht_time()
        with self._lock:
            if digest in self._answered:
                raise Refusal(Refusal.REPLAY)
            for old, time in list(self._answered.items()):  # a request this old is refused for its time anyway
                if abs(now - time) > 2 * MAX_REQUEST_AGE:
                    del self._answered[old]
            self._answered[digest] = request.time

    def _issue(self, username: str, public_key: RSAPublicKey, request: TokenRequest):
        if request.hf_token is None:
            self._refuse_replay(request)
        key = public_key.to_bytes()
        now = get_dht_time()
        with self._lock:
            seat = self._seats.get(username)
            expiration = now + self.token_lifetime
            if seat is not None and seat.key != key:
                if key in seat.retired:
                    raise Refusal(Refusal.SUPERSEDED)
                seat.retired.append(seat.key)
                # a new key's tokens expire after all of the old key's (whole seconds: the format's resolution)
                expiration = max(expiration, math.floor(seat.expiration) + 1.0)
                seat.key = key
                logger.warning(f"user {username!r} takes part with a new key: the previous one is superseded")
            elif seat is None:
                seat = self._seats[username] = _Seat(key, expiration)
            seat.expiration = max(seat.expiration, expiration)
        token = issue_token(self.authority_key, self.run_id, username, public_key, expiration - now, now=now)
        logger.info(f"issued a token to {username!r} until {format_time(expiration)}")
        return token


def make_app(authority: Authority) -> web.Application:
    async def token_handler(http_request: web.Request) -> web.Response:
        try:
            body = await http_request.read()  # aiohttp stops reading past client_max_size
        except web.HTTPRequestEntityTooLarge:
            body = None
        if body is None or len(body) > MAX_REQUEST_BYTES:
            status, answer = Refusal.TOO_LARGE[0], {"error": Refusal.TOO_LARGE[1]}
        else:  # in a thread: checking a Hugging Face token waits for the Hub
            status, answer = await asyncio.get_running_loop().run_in_executor(None, authority.answer, body)
        return web.json_response(answer, status=status)

    app = web.Application(client_max_size=MAX_REQUEST_BYTES)
    app.router.add_post("/token", token_handler)
    return app


class AuthorityServer:
    """Runs the authority's HTTP service in a background thread (``start``/``stop``), or in the foreground
    (``serve_forever``). ``port=0`` picks a free port; :attr:`url` is where peers ask for tokens."""

    def __init__(self, authority: Authority, host: str = "127.0.0.1", port: int = 0):
        self.authority, self.host, self.port = authority, host, port
        self._loop: Optional[asyncio.AbstractEventLoop] = None
        self._runner: Optional[web.AppRunner] = None
        self._thread: Optional[threading.Thread] = None

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    async def _start(self) -> None:
        self._runner = web.AppRunner(make_app(self.authority), access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, self.host, self.port)
        await site.start()
        self.port = self._runner.addresses[0][1]

    def start(self) -> "AuthorityServer":
        started = threading.Event()

        def run() -> None:
            self._loop = asyncio.new_event_loop()
            self._loop.run_until_complete(self._start())
            started.set()
            self._loop.run_forever()

        self._thread = threading.Thread(target=run, name="authority", daemon=True)
        self._thread.start()
        if not started.wait(30):
            raise RuntimeError("the authority service did not start")
        return self

    def stop(self) -> None:
        if self._loop is None:
            return
        asyncio.run_coroutine_threadsafe(self._runner.cleanup(), self._loop).result(10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)
        self._loop = None

    def serve_forever(self) -> None:
        web.run_app(make_app(self.authority), host=self.host, port=self.port, access_log=None)
