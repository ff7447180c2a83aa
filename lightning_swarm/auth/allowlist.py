"""Who may join a run: an allowlist file of user names and public keys, or members of a Hugging Face organisation.

Allowlist file format, one user key per line (a user may have several lines), ``#`` starts a comment::

    alice ssh-rsa AAAAB3NzaC1yc2E... alice@laptop
    bob   ssh-rsa AAAAB3NzaC1yc2E...

The authority service re-reads the file on every request: removing a line bans that key at once (no new tokens);
tokens already issued stay valid until they expire, at most one token lifetime.
"""

from __future__ import annotations

import logging
from typing import Dict, List, Optional

from hivemind.utils.crypto import RSAPublicKey

from lightning_swarm.auth.tokens import USERNAME_PATTERN, parse_public_key

logger = logging.getLogger(__name__)


def read_allowlist(path: str) -> Dict[str, List[RSAPublicKey]]:
    """``{username: [public keys]}`` from the allowlist file at ``path``; a malformed line is an error naming it."""
    users: Dict[str, List[RSAPublicKey]] = {}
    with open(path) as f:
        for number, line in enumerate(f, start=1):
            line = line.split("#", 1)[0].strip()
            if not line:
                continue
            fields = line.split()
            if len(fields) < 3 or not USERNAME_PATTERN.fullmatch(fields[0]):
                raise ValueError(f"{path}:{number}: expected 'username ssh-rsa AAAA...', got {line[:60]!r}")
            try:
                key = parse_public_key(" ".join(fields[1:3]))
            except ValueError as e:
                raise ValueError(f"{path}:{number}: {e}") from None
            users.setdefault(fields[0], []).append(key)
    return users


def hugging_face_member(hf_token: str, organization: str, endpoint: Optional[str] = None) -> Optional[str]:
    """The Hugging Face user name behind ``hf_token`` if that user belongs to ``organization``, else None.

    Needs the Hugging Face Hub (``endpoint``, default huggingface.co or ``$HF_ENDPOINT``); the seed run admitted
    its volunteers this way. The Hub's answer is checked for types before use.
    """
    from huggingface_hub import HfApi

    if not isinstance(hf_token, str) or not hf_token:  # whoami(None) would use this machine's own Hub login
        return None
    try:
        info = HfApi(endpoint=endpoint).whoami(token=hf_token)
    except Exception as e:
        logger.info(f"Hugging Face refused a token: {type(e).__name__}")
        return None
    if not isinstance(info, dict) or not isinstance(info.get("name"), str) or not isinstance(info.get("orgs"), list):
        return None
    organizations = {org.get("name") for org in info["orgs"] if isinstance(org, dict)}
    return info["name"] if organization in organizations else None
