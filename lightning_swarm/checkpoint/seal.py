"""A checkpoint's seal: the sha256 of its meta.json and, in a run with an authority, the authority's signature.

meta.json records the sha256 of every other file (:mod:`.integrity`) but cannot hold its own, so ``seal.json``
holds it::

    {"format": "lightning-swarm-seal/v1", "meta.json": {"sha256": "...", "bytes": 1234},
     "signature": {"public_key": "ssh-rsa AAAA...", "value": "<base64>"}}       # only when signed

Reading checks meta.json against the seal before parsing it, so a corrupt or edited meta.json (the file that names
the model class) is refused like any other file. That alone is no defence against someone who rewrites both
files; the signature is: the monitor of a run with an authority holds the authority's private key (the key that
signs moderator reverts, :mod:`lightning_swarm.auth.revert`) and signs ``lightning-swarm-checkpoint/v1 |
sha256(meta.json)``. Since meta.json holds the sha256 of every other file and the run id, the signature covers the
whole checkpoint. A reader that is given the run's authority public key refuses checkpoints that are unsigned or
signed by another key.
"""

from __future__ import annotations

import hashlib
import json
import os
from typing import TYPE_CHECKING, Any, Dict, Optional, Union

from lightning_swarm.checkpoint.integrity import CheckpointIntegrityError

if TYPE_CHECKING:
    from hivemind.utils.crypto import RSAPrivateKey, RSAPublicKey

SEAL_FILE = "seal.json"
SEAL_FORMAT = "lightning-swarm-seal/v1"
SIGNED_PREFIX = b"lightning-swarm-checkpoint/v1"
MAX_META_BYTES = 4 << 20  # meta.json: run figures and the model's init args; far below this
MAX_SEAL_BYTES = 64 << 10  # a hash, a public key and a signature
MAX_PUBLIC_KEY_FILE_BYTES = 64 << 10


def signed_bytes(meta_sha256: str) -> bytes:
    """What the authority signs: the format tag and the sha256 of meta.json."""
    return b"\n".join([SIGNED_PREFIX, meta_sha256.encode()])


def read_bounded(path: str, limit: int, source: str) -> bytes:
    """The bytes of a local file no larger than ``limit`` (checked before reading)."""
    size = os.path.getsize(path)
    if size > limit:
        raise CheckpointIntegrityError(f"Checkpoint {source}: {os.path.basename(path)} has {size} bytes, more than "
                                       f"the {limit} such a file may have; refusing to read it")
    with open(path, "rb") as f:
        return f.read(limit + 1)


def parse_json(data: bytes, name: str, source: str) -> Any:
    try:
        return json.loads(data)
    except (ValueError, RecursionError) as e:  # RecursionError: nesting deeper than the parser's stack
        raise CheckpointIntegrityError(f"Checkpoint {source}: {name} is not valid JSON ({type(e).__name__}); "
                                       f"refusing to load it") from None


def written_before_seals(meta_bytes: bytes) -> bool:
    """True if meta.json says it was written before seals existed (format version 1 or 2)."""
    try:
        version = json.loads(meta_bytes).get("format_version")
    except (ValueError, AttributeError, RecursionError):
        return False
    return isinstance(version, int) and version < 3


def write_seal(directory: str, meta_file: str, signer: Optional["RSAPrivateKey"] = None) -> None:
    """Write ``seal.json`` into ``directory`` for its ``meta_file``, signed with ``signer`` if given."""
    with open(os.path.join(directory, meta_file), "rb") as f:
        meta_bytes = f.read()
    digest = hashlib.sha256(meta_bytes).hexdigest()
    seal: Dict[str, Any] = {"format": SEAL_FORMAT, meta_file: {"sha256": digest, "bytes": len(meta_bytes)}}
    if signer is not None:
        seal["signature"] = {"public_key": signer.get_public_key().to_bytes().decode(),
                             "value": signer.sign(signed_bytes(digest)).decode()}
    path = os.path.join(directory, SEAL_FILE)
    with open(path, "w") as f:
        json.dump(seal, f, indent=1)
        f.flush()
        os.fsync(f.fileno())


def load_authority_public_key(key: Union[str, "RSAPublicKey"]) -> "RSAPublicKey":
    """The run's authority public key from ``ssh-rsa AAAA...`` text or a local file the user names that holds it
    (the option a user types; never a path from a checkpoint or a peer)."""
    from hivemind.utils.crypto import RSAPublicKey

    if isinstance(key, RSAPublicKey):
        return key
    text = str(key).strip()
    if not text.startswith("ssh-rsa ") and os.path.isfile(text):
        if os.path.getsize(text) > MAX_PUBLIC_KEY_FILE_BYTES:
            raise ValueError(f"authority public key: {text} is larger than a public key file")
        with open(text) as f:
            text = f.read().strip()
    try:
        return RSAPublicKey.from_bytes(" ".join(text.split()[:2]).encode())
    except Exception:
        raise ValueError("authority public key: expected an OpenSSH RSA public key ('ssh-rsa AAAA...') or the path "
                         "of a file holding one (the run's auth.authority_key)") from None


def read_sealed_meta(directory: str, meta_file: str, source: str,
                     authority_public_key: Optional[Union[str, "RSAPublicKey"]] = None,
                     legacy_format: Any = None) -> bytes:
    """The bytes of ``meta_file`` once they match ``seal.json`` (and its signature, if a key is given).

    Args:
        directory: local directory holding the checkpoint's files.
        meta_file: meta.json's name.
        source: where the checkpoint came from, for error messages.
        authority_public_key: the run's authority public key (text, file or key); given, the seal must carry that
            key's valid signature.
        legacy_format: called with meta.json's bytes when there is no seal: returns True if meta.json says it was
            written before seals existed (then it loads with a warning, unless a key is given).
    Raises CheckpointIntegrityError when meta.json does not match its seal, the seal is missing from a checkpoint
    that should have one, or the signature is missing, malformed or made by another key.
    """
    meta_bytes = read_bounded(os.path.join(directory, meta_file), MAX_META_BYTES, source)
    seal_path = os.path.join(directory, SEAL_FILE)
    if not os.path.isfile(seal_path):
        if authority_public_key is not None:
            raise CheckpointIntegrityError(f"Checkpoint {source}: no {SEAL_FILE}, so no authority signature; an "
                                           f"authority key was given, so only signed checkpoints load")
        if legacy_format is not None and legacy_format(meta_bytes):
            return meta_bytes
        raise CheckpointIntegrityError(f"Checkpoint {source}: {SEAL_FILE} (the sha256 of {meta_file}) is missing; "
                                       f"refusing to load it")
    seal = parse_json(read_bounded(seal_path, MAX_SEAL_BYTES, source), SEAL_FILE, source)
    record = seal.get(meta_file) if isinstance(seal, dict) else None
    if not isinstance(record, dict) or not isinstance(record.get("sha256"), str):
        raise CheckpointIntegrityError(f"Checkpoint {source}: {SEAL_FILE} records no sha256 of {meta_file}")
    if len(meta_bytes) != record.get("bytes"):
        raise CheckpointIntegrityError(f"Checkpoint {source}: {meta_file} has {len(meta_bytes)} bytes, {SEAL_FILE} "
                                       f"records {record.get('bytes')!r}: it was edited or truncated; refusing it")
    digest = hashlib.sha256(meta_bytes).hexdigest()
    if digest != record["sha256"]:
        raise CheckpointIntegrityError(f"Checkpoint {source}: {meta_file} has sha256 {digest}, {SEAL_FILE} records "
                                       f"{record['sha256'][:64]!r}: it was edited or is corrupt; refusing it")
    if authority_public_key is not None:
        key = load_authority_public_key(authority_public_key)
        signature = seal.get("signature")
        value = signature.get("value") if isinstance(signature, dict) else None
        if not isinstance(value, str):
            raise CheckpointIntegrityError(f"Checkpoint {source} is not signed; the run's authority key was given, "
                                           f"so only checkpoints its monitor signed load")
        try:
            valid = key.verify(signed_bytes(digest), value.encode())
        except Exception:
            valid = False
        if not valid:
            raise CheckpointIntegrityError(f"Checkpoint {source}: its signature is not the given authority key's "
                                           f"(signed by another key, or altered); refusing to load it")
    return meta_bytes
