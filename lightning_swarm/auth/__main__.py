"""``python -m lightning_swarm.auth``: keys, offline tokens and the authority service of a run.

Examples::

    # moderators, once: the run's authority key (peers get authority.pem.pub as auth.authority_key)
    python -m lightning_swarm.auth keygen authority.pem
    # a user, once: a key whose .pub goes into the allowlist (or the key an offline token is issued for)
    python -m lightning_swarm.auth keygen alice.pem
    # small private run: moderators issue a token offline (the peer runs with auth.token + auth.key)
    python -m lightning_swarm.auth issue --authority-key authority.pem --run-id my-run --username alice \\
        --public-key alice.pem.pub --lifetime 7d --out alice.token
    # open run with an allowlist: the authority service (peers run with auth.server/username/key)
    python -m lightning_swarm.auth serve --authority-key authority.pem --run-id my-run --allowlist allowlist.txt \\
        --host 0.0.0.0 --port 8777 --token-lifetime 1h
"""

from __future__ import annotations

import argparse
import logging
import re
import sys
from typing import List, Optional

from lightning_swarm.cli_flags import KebabCaseArgumentParser

DURATION = re.compile(r"(\d+(?:\.\d+)?)([smhd]?)")
UNIT_SECONDS = {"": 1, "s": 1, "m": 60, "h": 3600, "d": 86400}


def parse_duration(text: str) -> float:
    """``90``, ``90s``, ``15m``, ``1h``, ``7d`` -> seconds."""
    match = DURATION.fullmatch(text.strip())
    if not match or float(match.group(1)) <= 0:
        raise argparse.ArgumentTypeError(f"expected a positive duration like 90s, 15m, 1h or 7d, got {text!r}")
    return float(match.group(1)) * UNIT_SECONDS[match.group(2)]


def make_parser() -> argparse.ArgumentParser:
    # kebab-case options; the snake_case spellings of the first release still work, with a warning
    parser = KebabCaseArgumentParser(prog="python -m lightning_swarm.auth", description=__doc__.split("\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    keygen = commands.add_parser("keygen", help="write a new RSA key (PEM) and its public key (PATH.pub)")
    keygen.add_argument("path")
    issue = commands.add_parser("issue", help="issue a token offline (small private runs)")
    issue.add_argument("--authority-key", required=True, help="the run's authority private key (PEM)")
    issue.add_argument("--run-id", required=True)
    issue.add_argument("--username", required=True)
    issue.add_argument("--public-key", required=True, help="the peer's public key (ssh-rsa ... or its .pub file)")
    issue.add_argument("--lifetime", type=parse_duration, default=parse_duration("7d"),
                       help="how long the token is valid (a ban takes effect when it expires)")
    issue.add_argument("--out", required=True, help="token file to write")
    serve = commands.add_parser("serve", help="run the authority service")
    serve.add_argument("--authority-key", required=True, help="the run's authority private key (PEM)")
    serve.add_argument("--run-id", required=True)
    serve.add_argument("--allowlist", default=None, help="file of 'username ssh-rsa AAAA...' lines")
    serve.add_argument("--hf-organization", default=None, help="also admit members of this Hugging Face organisation")
    serve.add_argument("--hf-endpoint", default=None,
                       help="the Hugging Face Hub that checks members' tokens (default: huggingface.co or $HF_ENDPOINT)")
    serve.add_argument("--token-lifetime", type=parse_duration, default=parse_duration("1h"),
                       help="token lifetime: the longest a ban takes to reach every peer")
    serve.add_argument("--host", default="127.0.0.1")
    serve.add_argument("--port", type=int, default=8777)
    return parser


def main(argv: Optional[List[str]] = None) -> None:
    args = make_parser().parse_args(argv)
    from lightning_swarm.auth import tokens

    if args.command == "keygen":
        public_path = tokens.save_key(tokens.generate_key(), args.path)
        print(f"wrote {args.path} (private, keep it secret) and {public_path} (public)")
    elif args.command == "issue":
        token = tokens.issue_token(tokens.load_private_key(args.authority_key), args.run_id, args.username,
                                   tokens.read_public_key(args.public_key), args.lifetime)
        with open(args.out, "w") as f:
            f.write(tokens.token_to_json(token) + "\n")
        print(f"wrote {args.out}: {args.username!r} may join run {args.run_id!r} until {token.expiration_time}")
    else:
        from lightning_swarm.auth.service import Authority, AuthorityServer

        logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
        authority = Authority(tokens.load_private_key(args.authority_key), args.run_id, args.allowlist,
                              args.token_lifetime, args.hf_organization, args.hf_endpoint)
        print(f"[lightning_swarm.auth] authority of run {args.run_id!r} at http://{args.host}:{args.port}", flush=True)
        AuthorityServer(authority, args.host, args.port).serve_forever()


if __name__ == "__main__":
    sys.exit(main())
