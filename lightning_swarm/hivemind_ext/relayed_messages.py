"""Verification messages between two client-mode members, relayed by a reachable member that can't alter them.

A client-mode member (a peer behind NAT) accepts no connection, so two of them can't exchange the verification
messages of :mod:`~lightning_swarm.hivemind_ext.result_verification` directly. Each deposits its messages, signed,
with every reachable member of the group and fetches the others' from them. A message is signed with the key of the
sender's libp2p identity: its peer id is the hash of that public key, so a receiver checks that the signer is the
member the message is from, and a relay can drop a message but not alter or forge one. A relay checks each record
before it keeps it, so a record that fails the check at a receiver was altered by the relay that served it.

Record layout (all sizes checked against the buffer and a cap before anything is read or allocated)::

    version (1 byte) | inner length (u32) | inner | public key length (u16) | public key (DER) | signature length (u16) | signature

``inner`` is the serialized ``AveragingData`` the sender also sends directly to reachable members; the signature
(RSA PKCS#1 v1.5, SHA-256) covers :data:`SIGNING_DOMAIN` + ``inner``. A bundle of records (a relay's answer) is
``count (u16)`` then each record as ``length (u32) | record``.
"""

from __future__ import annotations

import hashlib
import logging
import os
import struct
from typing import List, Optional, Tuple

from cryptography.exceptions import InvalidSignature, UnsupportedAlgorithm
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import padding, rsa
from hivemind.p2p import PeerID
from hivemind.proto import crypto_pb2

__all__ = ["MalformedRecord", "SIGNING_DOMAIN", "identity_key_der", "load_signing_key", "open_record", "pack_records", "peer_id_of", "record_cap",
           "sign_record", "unpack_records", "write_identity"]

log = logging.getLogger(__name__)

VERSION = 1
SIGNING_DOMAIN = b"lightning_swarm/relayed-verification-message/v1\x00"
MAX_PUBLIC_KEY_BYTES = 1024  # an RSA-4096 key in DER is 550 bytes
MAX_SIGNATURE_BYTES = 512  # RSA-4096
MAX_KEY_BITS = 4096  # a larger key would make every check slow
_HEADER = struct.Struct(">BI")
_SHORT = struct.Struct(">H")
_LONG = struct.Struct(">I")


class MalformedRecord(ValueError):
    """A relayed record that does not fit its layout, or whose signature or signer does not check out."""


def peer_id_of(public_key_der: bytes) -> PeerID:
    """The libp2p peer id of an RSA public key (DER, SubjectPublicKeyInfo): the sha2-256 multihash of the key's
    protobuf (libp2p's peer-id spec, as :meth:`hivemind.p2p.PeerID.from_identity` computes it from the private key)."""
    encoded = crypto_pb2.PublicKey(key_type=crypto_pb2.RSA, data=public_key_der).SerializeToString()
    return PeerID(bytes([0x12, 0x20]) + hashlib.sha256(encoded).digest())


def write_identity(path: str) -> bytes:
    """Write a new libp2p identity (an RSA key, as hivemind's ``P2P.generate_identity``) to ``path``, readable by
    this user only; return the private key's DER bytes."""
    key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    der = key.private_bytes(serialization.Encoding.DER, serialization.PrivateFormat.TraditionalOpenSSL,
                            serialization.NoEncryption())
    descriptor = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o400)
    with os.fdopen(descriptor, "wb") as file:
        file.write(crypto_pb2.PrivateKey(key_type=crypto_pb2.RSA, data=der).SerializeToString())
    return der


def identity_key_der(dht) -> Optional[bytes]:
    """The DER bytes of the RSA private key behind ``dht``'s peer id: the key the strategy generated for it
    (``dht.identity_key_der``), else the one in the identity file it was started with; None if neither (hivemind's
    daemon then made a key nobody else can read) or the key is not RSA."""
    der = getattr(dht, "identity_key_der", None)
    if der is not None:
        return der
    path = getattr(dht, "kwargs", {}).get("identity_path")
    if not path:
        return None
    try:
        with open(path, "rb") as file:
            key = crypto_pb2.PrivateKey.FromString(file.read())
    except (OSError, ValueError) as e:
        log.warning(f"could not read the identity {path!r} to sign relayed verification messages: {e!r}")
        return None
    if key.key_type != crypto_pb2.RSA:
        log.warning(f"the identity {path!r} is not an RSA key: this peer can't sign relayed verification messages")
        return None
    return key.data


def load_signing_key(private_key_der: bytes) -> rsa.RSAPrivateKey:
    """The identity key (DER, as :func:`identity_key_der` returns it), loaded once per process: loading checks the
    key (tens of milliseconds), signing then takes about one."""
    key = serialization.load_der_private_key(private_key_der, password=None)
    if not isinstance(key, rsa.RSAPrivateKey):
        raise ValueError("the identity key is not an RSA key")
    return key


def sign_record(key: rsa.RSAPrivateKey, inner: bytes) -> bytes:
    """A record of ``inner`` signed with the identity key (:func:`load_signing_key`)."""
    public = key.public_key().public_bytes(serialization.Encoding.DER,
                                           serialization.PublicFormat.SubjectPublicKeyInfo)
    signature = key.sign(SIGNING_DOMAIN + inner, padding.PKCS1v15(), hashes.SHA256())
    return (_HEADER.pack(VERSION, len(inner)) + inner + _SHORT.pack(len(public)) + public
            + _SHORT.pack(len(signature)) + signature)


def _take(data: bytes, offset: int, size: int, what: str) -> Tuple[bytes, int]:
    if size > len(data) - offset:
        raise MalformedRecord(f"{what}: {size} bytes announced, {len(data) - offset} left")
    return data[offset:offset + size], offset + size


def open_record(record: bytes, max_inner_bytes: int) -> Tuple[PeerID, bytes]:
    """Check a record's layout (sizes against the buffer and the caps), its signature and key; return the signer's
    peer id and the inner message bytes. Raises MalformedRecord."""
    if len(record) < _HEADER.size:
        raise MalformedRecord(f"{len(record)} bytes, shorter than the header")
    version, inner_length = _HEADER.unpack_from(record)
    if version != VERSION:
        raise MalformedRecord(f"version {version}, not {VERSION}")
    if inner_length > max_inner_bytes:
        raise MalformedRecord(f"a message of {inner_length} bytes, more than the {max_inner_bytes} expected")
    inner, offset = _take(record, _HEADER.size, inner_length, "message")
    (key_length,), offset = _SHORT.unpack(_take(record, offset, _SHORT.size, "key length")[0]), offset + _SHORT.size
    if key_length > MAX_PUBLIC_KEY_BYTES:
        raise MalformedRecord(f"a public key of {key_length} bytes")
    public_der, offset = _take(record, offset, key_length, "public key")
    (sig_length,), offset = _SHORT.unpack(_take(record, offset, _SHORT.size, "signature length")[0]), offset + _SHORT.size
    if sig_length > MAX_SIGNATURE_BYTES:
        raise MalformedRecord(f"a signature of {sig_length} bytes")
    signature, offset = _take(record, offset, sig_length, "signature")
    if offset != len(record):
        raise MalformedRecord(f"{len(record) - offset} bytes after the signature")
    try:
        public = serialization.load_der_public_key(public_der)
    except (ValueError, TypeError, UnsupportedAlgorithm) as e:  # (an unknown algorithm's identifier)
        raise MalformedRecord(f"not a public key: {type(e).__name__}") from None
    if not isinstance(public, rsa.RSAPublicKey) or public.key_size > MAX_KEY_BITS:
        raise MalformedRecord("not an RSA key of at most 4096 bits")
    try:
        public.verify(signature, SIGNING_DOMAIN + inner, padding.PKCS1v15(), hashes.SHA256())
    except (InvalidSignature, ValueError):
        raise MalformedRecord("the signature does not match the message") from None
    return peer_id_of(public_der), inner


def pack_records(records: List[bytes]) -> bytes:
    """A relay's answer: the records it holds, counted and length-prefixed."""
    return _SHORT.pack(len(records)) + b"".join(_LONG.pack(len(record)) + record for record in records)


def unpack_records(data: bytes, max_count: int, max_record_bytes: int) -> List[bytes]:
    """The records of a relay's answer (at most ``max_count``, each at most ``max_record_bytes``; sizes checked
    against the buffer before anything is read). Raises MalformedRecord."""
    if len(data) < _SHORT.size:
        raise MalformedRecord("no record count")
    (count,) = _SHORT.unpack_from(data)
    if count > max_count:
        raise MalformedRecord(f"{count} records, more than the {max_count} members that could send one")
    offset, records = _SHORT.size, []
    for _ in range(count):
        (length,), offset = _LONG.unpack(_take(data, offset, _LONG.size, "record length")[0]), offset + _LONG.size
        if length > max_record_bytes:
            raise MalformedRecord(f"a record of {length} bytes, more than the {max_record_bytes} expected")
        record, offset = _take(data, offset, length, "record")
        records.append(record)
    if offset != len(data):
        raise MalformedRecord(f"{len(data) - offset} bytes after the last record")
    return records


def record_cap(inner_cap: int) -> int:
    """The largest record holding a message of at most ``inner_cap`` bytes."""
    return _HEADER.size + inner_cap + 2 * _SHORT.size + MAX_PUBLIC_KEY_BYTES + MAX_SIGNATURE_BYTES
