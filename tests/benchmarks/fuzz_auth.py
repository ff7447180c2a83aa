"""Fuzz the parsers of the authority's bytes: token requests (the authority's side), the authority's answers,
join proofs and the proofs in state-download requests (a peer's side). Mutated inputs (truncated, extended, bytes
flipped, fields set to 0, -1, huge, of another type, nested, removed) go through the real parsers; any exception
other than the documented refusal, any answer that is not one of the fixed messages, or a case taking more than
``--max-case-seconds`` of CPU fails the run.

    python tests/benchmarks/fuzz_auth.py --cases 20000 --seed 1   # a longer run than the suite's

Prints ``FUZZ OK requests=N answers=N proofs=N downloads=N slowest=S`` (S: CPU seconds of the slowest input) on
success (exit 0), the failing case otherwise (exit 1).
tests/lightning_swarm/test_auth_fuzz.py runs it in a child process, fixed seed, bounded.
"""

import argparse
import atexit
import json
import logging
import random
import shutil
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

HOSTILE_VALUES = [0, -1, 2**64, -(2**63), 1e308, float("nan"), "", "x" * 20000, [], {}, None, True, "/etc/passwd",
                  "ssh-rsa AAAA", "../../authority.pem", [[[[[]]]]], {"a": {"b": {}}}, "\x00\x1b[31m", 3.5]


def mutate_bytes(data: bytes, rng: random.Random) -> bytes:
    kind = rng.randrange(6)
    if not data or kind == 0:
        return data[: rng.randrange(len(data) + 1)]  # truncated
    if kind == 1:
        return data + bytes(rng.randrange(256) for _ in range(rng.randrange(1, 64)))  # extended
    if kind == 2:
        out = bytearray(data)
        for _ in range(rng.randrange(1, 8)):
            out[rng.randrange(len(out))] = rng.randrange(256)  # bytes flipped
        return bytes(out)
    if kind == 3:
        at = rng.randrange(len(data))
        return data[:at] + data[at:][: rng.randrange(64)] * rng.randrange(2, 200) + data[at:]  # a slice repeated
    if kind == 4:
        return b"[" * rng.randrange(1, 5000) + data  # nesting
    return bytes(rng.randrange(256) for _ in range(rng.randrange(0, 512)))  # noise


def mutate_json(obj: dict, rng: random.Random):
    obj = dict(obj)
    for _ in range(rng.randrange(1, 4)):
        choice = rng.randrange(4)
        if choice == 0 and obj:
            obj.pop(rng.choice(sorted(obj)))
        elif choice == 1 and obj:
            obj[rng.choice(sorted(obj))] = rng.choice(HOSTILE_VALUES)
        elif choice == 2:
            obj[rng.choice(["extra", "public_key", "time", "hf_token", "username"])] = rng.choice(HOSTILE_VALUES)
        else:
            return [obj] if rng.random() < 0.5 else rng.choice(HOSTILE_VALUES)
    return obj


def mutated(valid: dict, rng: random.Random) -> bytes:
    if rng.random() < 0.5:
        return mutate_bytes(json.dumps(valid).encode(), rng)
    return json.dumps(mutate_json(valid, rng)).encode()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--cases", type=int, default=2000, help="mutated inputs per parser")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--max-case-seconds", type=float, default=1.0, help="CPU seconds one input may take")
    args = parser.parse_args()
    logging.disable(logging.WARNING)  # every refusal is logged once: thousands of lines here

    from lightning_swarm.auth.peer import SwarmAuth, parse_authority_answer
    from lightning_swarm.auth.service import FIXED_MESSAGES, Authority
    from lightning_swarm.auth.tokens import (
        AuthError,
        generate_key,
        issue_token,
        load_private_key,
        save_key,
        token_from_json,
        token_to_json,
    )

    rng = random.Random(args.seed)
    root = Path(tempfile.mkdtemp(prefix="fuzz_auth_"))
    atexit.register(shutil.rmtree, root, ignore_errors=True)  # its keys: nothing left in /tmp after the run
    for name in ("authority", "alice"):
        save_key(generate_key(), str(root / f"{name}.pem"))
    (root / "allowlist.txt").write_text(f"alice {(root / 'alice.pem.pub').read_text().strip()}\n")
    authority = Authority(load_private_key(str(root / "authority.pem")), "run", str(root / "allowlist.txt"),
                          token_lifetime=600)
    alice = SwarmAuth("run", str(root / "authority.pem.pub"), server="http://127.0.0.1:1", username="alice",
                      key=str(root / "alice.pem"))
    slowest = 0.0

    def timed(case, function, *inputs):
        nonlocal slowest
        start = time.process_time()  # CPU time: a loaded machine's pauses are not the parser's
        result = function(*inputs)
        elapsed = time.process_time() - start
        slowest = max(slowest, elapsed)
        if elapsed > args.max_case_seconds:
            raise AssertionError(f"{case}: {elapsed:.2f} s for input {inputs!r:.300}")
        return result

    # the authority's request parser and decision
    valid_requests = [alice.token_request(), dict(alice.token_request(), hf_token="hf_x", username=None)]
    for case in range(args.cases):
        body = mutated(rng.choice(valid_requests), rng)
        status, answer = timed(f"request {case}", authority.answer, body)
        if status == 200:
            assert set(answer) == {"username", "public_key", "expiration_time", "signature"}, (case, body)
        else:
            assert status in (400, 403, 413) and set(answer) == {"error"} and answer["error"] in FIXED_MESSAGES, \
                (case, status, answer, body[:300])

    # the client's parser of the authority's answers
    token_body = token_to_json(issue_token(authority.authority_key, "run", "alice", alice.public_key, 60))
    valid_answers = [json.loads(token_body), {"error": "this user is not on the allowlist of this run"}]
    for case in range(args.cases):
        status = rng.choice([200, 200, 400, 403, 413, 500, 0, -1, 999])
        body = mutated(rng.choice(valid_answers), rng)
        try:
            token = timed(f"answer {case}", parse_authority_answer, status, body)
            assert status == 200 and token.username is not None, (case, status, body[:300])
        except AuthError as e:
            message = str(e)
            assert len(message) <= 300 and message.isprintable(), (case, message[:400])

    # a peer's check of the join proofs other peers send (any msgpack-decodable value)
    honest = dict(token=token_body, signature=alice.private_key.sign(b"x"))
    for case in range(args.cases):
        candidate = dict(honest)
        if rng.random() < 0.5:
            candidate["token"] = mutate_bytes(token_body.encode(), rng).decode("utf-8", "replace")
        else:
            candidate = mutate_json(candidate, rng)
        if isinstance(candidate, dict) and "signature" in candidate and rng.random() < 0.5:
            candidate["signature"] = mutate_bytes(honest["signature"], rng)
        verdict = timed(f"proof {case}", alice.check_join_proof, candidate, "run_grad_averager", b"peer")
        assert not verdict.ok, (case, candidate)  # the signature is never over this prefix and peer id
        try:
            token_from_json(candidate.get("token") if isinstance(candidate, dict) else candidate)
        except ValueError:
            pass
    # the bytes of a state-download request's proof, as a donor decodes them (state_serving._state_requester)
    from hivemind.utils.serializer import MSGPackSerializer

    from lightning_swarm.hivemind_ext.state_serving import MAX_PROOF_BYTES

    alice._token = issue_token(authority.authority_key, "run", "alice", alice.public_key, 600)
    alice._issued_at = time.time()  # a fresh token: no renewal from the (absent) authority service
    packed = MSGPackSerializer.dumps(alice.join_proof("run_state_averager.state_download", b"peer"))

    def decode_and_check(data: bytes):
        proof = None
        if 0 < len(data) <= MAX_PROOF_BYTES:
            try:
                proof = MSGPackSerializer.loads(data)
            except Exception:  # as the donor does: undecodable bytes are no proof
                proof = None
        return alice.check_join_proof(proof, "run_state_averager.state_download", b"peer")

    assert decode_and_check(packed).ok  # the unmutated request is admitted: the mutations below are what is refused
    for case in range(args.cases):
        data = mutate_bytes(packed, rng)
        verdict = timed(f"download request {case}", decode_and_check, data)
        assert isinstance(verdict.ok, bool) and (verdict.ok or verdict.reason), (case, data[:300])
    print(f"FUZZ OK requests={args.cases} answers={args.cases} proofs={args.cases} downloads={args.cases} "
          f"slowest={slowest:.3f}s CPU", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
