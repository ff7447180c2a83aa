"""RSA keys in hivemind's own classes: load a private key from a file, and make it this process's key.

hivemind 1.1.12's ``RSAPrivateKey`` can only generate a fresh key (no loader), and every signed DHT record and
authorized request of a process uses ``RSAPrivateKey.process_wide()``. An access token names one public key, so
a peer whose token was issued offline must sign with that key: :func:`use_as_process_key` installs it.
Private names used here are listed in :data:`lightning_swarm.hivemind_ext.private_api.PRIVATE_SYMBOLS`.
"""

from __future__ import annotations

from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import rsa
from hivemind.utils.crypto import RSAPrivateKey



def private_key_from_pem(pem: bytes) -> RSAPrivateKey:
    """A hivemind RSAPrivateKey holding the RSA key in ``pem`` (PKCS#8 or traditional OpenSSL, unencrypted)."""
    key = serialization.load_pem_private_key(pem, password=None)
    if not isinstance(key, rsa.RSAPrivateKey):
        raise ValueError(f"expected an RSA private key, got {type(key).__name__}")
    wrapped = RSAPrivateKey.__new__(RSAPrivateKey)
    wrapped._private_key = key
    return wrapped


def private_key_to_pem(key: RSAPrivateKey) -> bytes:
    return key._private_key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )


def use_as_process_key(key: RSAPrivateKey) -> None:
    """Make ``key`` the key this process signs DHT records and requests with (before any DHT is created).

    Raises if the process already uses another key (it has signed with it, so peers know it under that key).
    """
    with RSAPrivateKey._process_wide_key_lock:
        current = RSAPrivateKey._process_wide_key
        if current is not None and current.get_public_key().to_bytes() != key.get_public_key().to_bytes():
            raise RuntimeError(
                "this process already signs with another key than the one the access token was issued for; "
                "start the peer in a new process"
            )
        RSAPrivateKey._process_wide_key = key
