"""The run's authority: a small HTTP service that gives allowlisted users signed, expiring access tokens.

Moderators run it next to the monitor (``python -m lightning_swarm.auth serve ...``). A peer asks for a token for
its own (per-process) public key and proves who it is in one of two ways:

- allowlist: it signs ``request_bytes(run_id, username, public_key, time)`` with the user's private key, whose
  public key is listed for that user in the allowlist file;
- Hugging Face organisation (as in the seed run): it sends a Hugging Face token of a member of the organisation.

``POST /token`` with JSON ``{run_id, username, public_key, time, signature}`` (or ``{run_id, public_key,
hf_token}``) answers 200 with the token's JSON, or 403/400 with ``{"error": "..."}`` saying why.
"""

from __future__ import annotations

import asyncio
import json
import logging
import threading
from typing import Optional

from aiohttp import web
from hivemind.utils.crypto import RSAPrivateKey
from hivemind.utils.timed_storage import get_dht_time

from lightning_swarm.auth.allowlist import hugging_face_member, read_allowlist
from lightning_swarm.auth.tokens import issue_token, parse_public_key, token_to_json

logger = logging.getLogger(__name__)

# a request signed longer ago (or further ahead) than this is refused: it could be a replay
MAX_REQUEST_AGE = 60.0


def request_bytes(run_id: str, username: str, public_key: str, time: float) -> bytes:
    """What a peer signs with its user key to ask for a token."""
    return "\n".join(["lightning-swarm-token-request/v1", run_id, username, public_key, repr(float(time))]).encode()


class Authority:
    """Decides token requests for one run.

    Args:
        authority_key: the run's authority private key (peers are configured with its public key).
        run_id: the run the tokens are for.
        allowlist_path: allowlist file (see :mod:`lightning_swarm.auth.allowlist`); re-read at every request.
        token_lifetime: seconds a token stays valid; also the longest a ban takes to reach every peer.
        hf_organization: also admit members of this Hugging Face organisation (their Hub token as proof).
    """

    def __init__(self, authority_key: RSAPrivateKey, run_id: str, allowlist_path: Optional[str] = None,
                 token_lifetime: float = 3600.0, hf_organization: Optional[str] = None):
        if allowlist_path is None and hf_organization is None:
            raise ValueError("the authority needs an allowlist file, a Hugging Face organisation, or both")
        if token_lifetime <= 0:
            raise ValueError(f"token_lifetime must be positive, got {token_lifetime}")
        self.authority_key, self.run_id = authority_key, run_id
        self.allowlist_path, self.hf_organization = allowlist_path, hf_organization
        self.token_lifetime = token_lifetime

    def decide(self, request: dict) -> tuple:
        """(HTTP status, JSON body) for one token request."""
        if not isinstance(request, dict):
            return 400, {"error": "expected a JSON object"}
        if request.get("run_id") != self.run_id:
            return 403, {"error": f"this authority issues tokens for run {self.run_id!r}, not {request.get('run_id')!r}"}
        try:
            public_key = parse_public_key(str(request.get("public_key", "")))
        except ValueError as e:
            return 400, {"error": f"public_key: {e}"}
        if "hf_token" in request and self.hf_organization:
            username = hugging_face_member(str(request["hf_token"]), self.hf_organization)
            if username is None:
                return 403, {"error": f"not a member of the Hugging Face organisation {self.hf_organization!r}"}
        else:
            username = str(request.get("username", ""))
            refusal = self._check_allowlist(username, request)
            if refusal:
                logger.warning(f"refused a token to {username!r}: {refusal}")
                return 403, {"error": refusal}
        token = issue_token(self.authority_key, self.run_id, username, public_key, self.token_lifetime)
        logger.info(f"issued a token to {username!r} until {token.expiration_time}")
        return 200, json.loads(token_to_json(token))

    def _check_allowlist(self, username: str, request: dict) -> Optional[str]:
        if self.allowlist_path is None:
            return "this authority admits Hugging Face organisation members only (send hf_token)"
        allowed = read_allowlist(self.allowlist_path).get(username)
        if not allowed:
            return f"user {username!r} is not on the allowlist of run {self.run_id!r} (never added, or removed)"
        try:
            time = float(request.get("time"))
        except (TypeError, ValueError):
            return "the request has no time"
        if abs(time - get_dht_time()) > MAX_REQUEST_AGE:
            return f"the request's time is more than {MAX_REQUEST_AGE:.0f} s off (check this machine's clock)"
        signed = request_bytes(self.run_id, username, str(request.get("public_key", "")), time)
        signature = str(request.get("signature", "")).encode()
        if not any(key.verify(signed, signature) for key in allowed):
            return f"the request is not signed by a key the allowlist lists for {username!r}"
        return None


def make_app(authority: Authority) -> web.Application:
    async def token_handler(http_request: web.Request) -> web.Response:
        try:
            body = await http_request.json()
        except (json.JSONDecodeError, UnicodeDecodeError):
            return web.json_response({"error": "expected a JSON body"}, status=400)
        status, answer = authority.decide(body)
        return web.json_response(answer, status=status)

    app = web.Application(client_max_size=64 * 1024)
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
