"""The authority as an attacker meets it (issue 24, findings 4-6): a real authority server on 127.0.0.1 that opens
no path a request names, answers fixed messages only, caps request bodies, refuses replayed proofs (allowlist and
Hugging Face, the latter checked by a Hub on 127.0.0.1 that huggingface_hub's own client asks), keeps one live key
per user; and the client that refuses plain http:// off this machine."""

import json
import logging
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from lightning_swarm.auth.peer import SwarmAuth, check_authority_url, parse_authority_answer
from lightning_swarm.auth.service import FIXED_MESSAGES, MAX_REQUEST_BYTES, Authority, AuthorityServer, Refusal
from lightning_swarm.auth.tokens import AuthError, generate_key, load_private_key, parse_public_key, save_key

@pytest.fixture(scope="module")
def keys(tmp_path_factory):
    root = tmp_path_factory.mktemp("keys")
    paths = {"root": root}
    for name in ("authority", "alice", "bob"):
        paths[name] = str(root / f"{name}.pem")
        save_key(generate_key(), paths[name])
    (root / "allowlist.txt").write_text("".join(f"{user} {Path(paths[user] + '.pub').read_text().strip()}\n"
                                                for user in ("alice", "bob")))
    return paths


@pytest.fixture
def server(keys):
    server = AuthorityServer(Authority(load_private_key(keys["authority"]), "run", str(keys["root"] / "allowlist.txt"),
                                       token_lifetime=600)).start()
    yield server
    server.stop()


def _post(url, body: bytes):
    request = urllib.request.Request(url + "/token", data=body, headers={"Content-Type": "application/json"},
                                     method="POST")
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            return response.status, response.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


def _user(keys, server, name, user_key=None, own_key=None):
    auth = SwarmAuth("run", keys["authority"] + ".pub", server=server.url, username=name,
                     key=user_key or keys[name])
    if own_key is not None:  # a second seat of one user in this one test process: its own key
        auth.private_key = own_key
    return auth


def test_a_path_as_public_key_is_neither_opened_nor_echoed(keys, server):
    answers = set()
    for path in (keys["authority"], "/proc/self/environ", str(keys["root"] / "no-such-file")):
        request = _user(keys, server, "alice").token_request()
        request["public_key"] = path
        status, body = _post(server.url, json.dumps(request).encode())
        assert status == 400, body
        assert b"BEGIN" not in body and path.encode() not in body and b"PRIVATE" not in body
        answers.add(body)
    assert len(answers) == 1  # an existing path is answered exactly like a missing one
    assert json.loads(answers.pop())["error"] == Refusal.BAD_PUBLIC_KEY[1]


def test_answers_never_quote_the_request_and_bodies_are_capped(keys, server):
    marker = "MARKER<script>" * 3
    request = _user(keys, server, "alice").token_request()
    for field, value in [("run_id", marker), ("username", marker), ("signature", marker), ("time", marker)]:
        status, body = _post(server.url, json.dumps(dict(request, **{field: value})).encode())
        assert status in (400, 403) and b"MARKER" not in body, (field, body)
        assert json.loads(body)["error"] in FIXED_MESSAGES
    status, body = _post(server.url, b"[" * 4000 + b"]" * 4000)  # nesting past the JSON parser's recursion limit
    assert (status, json.loads(body)["error"]) == (400, Refusal.NOT_JSON[1])
    status, body = _post(server.url, b" " * (MAX_REQUEST_BYTES + 1))
    assert status == 413 and json.loads(body)["error"] == Refusal.TOO_LARGE[1]
    status, body = _post(server.url, json.dumps(request).encode())
    assert status == 200  # the well-formed request still gets its token


def test_a_replayed_allowlist_request_is_refused_and_a_swapped_key_does_not_verify(keys, server):
    victim = _user(keys, server, "alice").token_request()
    assert _post(server.url, json.dumps(victim).encode())[0] == 200
    status, body = _post(server.url, json.dumps(victim).encode())
    assert (status, json.loads(body)["error"]) == (403, Refusal.REPLAY[1])
    attacker_key = generate_key().get_public_key().to_bytes().decode()
    status, body = _post(server.url, json.dumps(dict(victim, public_key=attacker_key)).encode())
    assert (status, json.loads(body)["error"]) == (403, Refusal.BAD_SIGNATURE[1])
    stale = dict(_user(keys, server, "alice").token_request(), time=time.time() - 120)
    assert json.loads(_post(server.url, json.dumps(stale).encode())[1])["error"] == Refusal.CLOCK[1]


class FakeHub:
    """A Hugging Face Hub on 127.0.0.1 that knows one member token: huggingface_hub's own client asks it."""

    def __init__(self, tokens):
        from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self):
                token = self.headers.get("authorization", "").removeprefix("Bearer ")
                if self.path != "/api/whoami-v2" or token not in tokens:
                    self.send_response(401), self.end_headers()
                    return
                body = json.dumps({"name": tokens[token], "orgs": [{"name": "the-org"}]}).encode()
                self.send_response(200), self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body))), self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args):
                pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()


def test_a_hugging_face_proof_is_bound_to_the_requesters_key_and_time(keys):
    hub = FakeHub({"hf_alice_secret": "alice"})
    server = AuthorityServer(Authority(load_private_key(keys["authority"]), "run", hf_organization="the-org",
                                       hf_endpoint=hub.url, token_lifetime=600)).start()
    try:
        alice = SwarmAuth("run", keys["authority"] + ".pub", server=server.url, hf_token="hf_alice_secret")
        assert alice.token().username == "alice"
        captured = alice.token_request()
        assert _post(server.url, json.dumps(captured).encode())[0] == 200
        # an eavesdropper replays what it saw, as it is and with its own key: both refused
        status, body = _post(server.url, json.dumps(captured).encode())
        assert (status, json.loads(body)["error"]) == (403, Refusal.REPLAY[1])
        attacker_key = generate_key().get_public_key().to_bytes().decode()
        status, body = _post(server.url, json.dumps(dict(captured, public_key=attacker_key)).encode())
        assert (status, json.loads(body)["error"]) == (403, Refusal.BAD_HF_SIGNATURE[1])
        stranger = SwarmAuth("run", keys["authority"] + ".pub", server=server.url, hf_token="hf_not_a_member")
        with pytest.raises(AuthError, match="is not a member's of this run's organisation"):
            stranger.token()
    finally:
        server.stop()
        hub.httpd.shutdown()


def test_the_client_refuses_plain_http_off_this_machine_unless_told(keys, caplog):
    public = keys["authority"] + ".pub"
    with pytest.raises(ValueError, match=r"plain http:// off this machine.*auth.allow_http: true"):
        SwarmAuth("run", public, server="http://auth.example.org:8777", username="alice", key=keys["alice"])
    with pytest.raises(ValueError, match="expected an https://"):
        check_authority_url("ftp://auth.example.org", allow_http=True)
    for url in ("https://auth.example.org", "http://127.0.0.1:8777", "http://localhost:1", "http://[::1]:8777"):
        check_authority_url(url, allow_http=False)
    with caplog.at_level(logging.WARNING):
        SwarmAuth("run", public, server="http://auth.example.org:8777", username="alice", key=keys["alice"],
                  allow_http="true")
    assert "over plain http:// at http://auth.example.org:8777 (auth.allow_http)" in caplog.text


def test_the_clients_answer_parser_cuts_what_it_shows():
    with pytest.raises(AuthError, match=r"^x{200}$"):
        parse_authority_answer(403, json.dumps({"error": "x" * 10000}).encode())
    with pytest.raises(AuthError, match="longer than"):
        parse_authority_answer(200, b"{" * 20000)
    with pytest.raises(AuthError, match="^a b$"):
        parse_authority_answer(403, json.dumps({"error": "a\x1bb"}).encode())
    with pytest.raises(AuthError, match="not a token"):
        parse_authority_answer(200, b'{"username": 1}')


def test_one_live_key_per_user_a_new_key_supersedes_the_old(keys, server):
    first, second = generate_key(), generate_key()
    seat_1 = _user(keys, server, "alice", own_key=first)
    seat_2 = _user(keys, server, "alice", own_key=second)
    bob = _user(keys, server, "bob")
    old = seat_1.token()
    assert bob.check(old).ok and bob.check(old).user == "alice"
    new = seat_2.token()
    assert new.expiration_time > old.expiration_time  # what peers order the two by
    # a peer that has seen the newer key refuses the older one, for joining as for anything else
    assert bob.check(new).ok
    assert "superseded" in bob.check(old).reason
    proof = seat_1.join_proof("run_grad_averager", b"peer-1")
    assert "superseded" in bob.check_join_proof(proof, "run_grad_averager", b"peer-1").reason
    assert bob.check_join_proof(seat_2.join_proof("run_grad_averager", b"peer-2"), "run_grad_averager",
                                b"peer-2").ok
    # the authority renews the new key, and no longer the old one
    seat_1._token = seat_2._token = None
    with pytest.raises(AuthError, match="refused a token for user 'alice': this key was superseded"):
        seat_1.token()
    renewed = seat_2.token()
    assert renewed.public_key == new.public_key and bob.check(renewed).ok and bob.check(new).ok


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_one_user_with_two_keys_never_holds_two_seats_in_a_group(keys, tmp_path):
    """Real peers on 127.0.0.1 and a real authority: bob and carol, and alice twice (two processes, two keys, both
    tokens from the authority). No group of bob's or carol's ever seats alice twice; her newer key takes part."""
    from test_auth import _kill, _spawn, _wait_line

    run = "seatrun"
    server = AuthorityServer(Authority(load_private_key(keys["authority"]), run, str(keys["root"] / "allowlist.txt"),
                                       token_lifetime=600)).start()
    carol_key = str(tmp_path / "carol.pem")
    save_key(generate_key(), carol_key)
    with open(keys["root"] / "allowlist.txt") as f:
        allowlist = f.read()
    (tmp_path / "allowlist.txt").write_text(allowlist + f"carol {Path(carol_key + '.pub').read_text().strip()}\n")
    server.authority.allowlist_path = str(tmp_path / "allowlist.txt")
    user_keys = {"bob": keys["bob"], "carol": carol_key, "alice1": keys["alice"], "alice2": keys["alice"]}
    processes = {}
    try:
        common = ["--run", run, "--authority", keys["authority"] + ".pub", "--server", server.url, "--seconds", "200",
                  "--stop-file", str(tmp_path / "stop")]

        def start(name, *extra):
            processes[name] = _spawn(["honest", "--name", name, "--username", name.rstrip("12"), "--key",
                                      user_keys[name], "--out", str(tmp_path / f"{name}.json"), *common, *extra],
                                     tmp_path / f"{name}.log")
            return _wait_line(tmp_path / f"{name}.log", "PEER", processes[name], 90).split()

        _, address, _ = start("bob")
        start("carol", "--initial-peer", address)
        start("alice1", "--initial-peer", address)
        start("alice2", "--initial-peer", address)  # her second key: supersedes the first
        deadline = time.monotonic() + 150
        while time.monotonic() < deadline:  # until an honest peer averaged with alice's newer seat
            if any("'alice2'" in line for name in ("bob", "carol") for line in
                   (tmp_path / f"{name}.log").read_text(errors="replace").splitlines() if line.startswith("GROUP")):
                break
            time.sleep(0.5)
        (tmp_path / "stop").write_text("")
        for name in ("bob", "carol"):
            assert processes[name].wait(timeout=90) == 0, (tmp_path / f"{name}.log").read_text()[-3000:]
    finally:
        for process in processes.values():
            _kill(process)
        server.stop()
    groups = [group for name in ("bob", "carol") for group in json.loads((tmp_path / f"{name}.json").read_text())["groups"]]
    assert groups and not [group for group in groups if "alice1" in group and "alice2" in group], groups
    assert any("alice2" in group for group in groups), groups
    logs = (tmp_path / "bob.log").read_text() + (tmp_path / "carol.log").read_text()
    assert "the token of 'alice' is superseded" in logs  # her first key, refused once her newer one was seen


def test_double_seats_names_users_seated_twice():
    from lightning_swarm.hivemind_ext.auth_guards import double_seats

    assert double_seats(["alice", "bob", "alice"]) == ["alice"]
    assert double_seats(["alice", "bob", "carol"]) == []
