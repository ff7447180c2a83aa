"""Signed records of verification messages relayed between client-mode members
(lightning_swarm/hivemind_ext/relayed_messages.py): the signer is the peer id the key hashes to, as libp2p derives it
for a real peer; a relay can't alter a record; sizes are checked before anything is read. The fuzzer is
decoder_fuzz.py's ``relayed_records`` target; the relaying itself runs in test_lying_reducer.py's client-mode groups."""

from __future__ import annotations

import os
import struct

import pytest
from hivemind.p2p import PeerID

from lightning_swarm.hivemind_ext import relayed_messages as rm


def test_the_signer_is_the_peer_id_libp2p_derives_from_the_identity(tmp_path):
    path = str(tmp_path / "identity.key")
    der = rm.write_identity(path)
    assert os.stat(path).st_mode & 0o777 == 0o400
    with open(path, "rb") as file:
        expected = PeerID.from_identity(file.read())
    signer, inner = rm.open_record(rm.sign_record(rm.load_signing_key(der), b"message"), 100)
    assert signer == expected and inner == b"message"


@pytest.mark.timeout(120)
def test_a_peer_started_without_an_identity_holds_the_key_of_its_peer_id(tmp_path, monkeypatch):
    """start_peer_dht makes the identity itself (p2pd's own key would be out of reach), hands its key to the
    averagers and leaves no key file behind; a peer given an identity file signs with that file's key."""
    import tempfile

    from lightning_swarm.dht import start_peer_dht

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    options = dict(initial_peers=[], host_maddrs=["/ip4/127.0.0.1/tcp/0"], announce_maddrs=None, client_mode=False,
                   use_relay=False, use_auto_relay=False, swarm_auth=None)
    dht = start_peer_dht("relay-test", identity_path=None, **options)
    try:
        der = rm.identity_key_der(dht)
        signer, _ = rm.open_record(rm.sign_record(rm.load_signing_key(der), b"x"), 10)
        assert signer == dht.peer_id
        assert not [name for name in os.listdir(tmp_path) if name.startswith("lightning_swarm_identity_")]
    finally:
        dht.shutdown()
    path = str(tmp_path / "mine.key")
    rm.write_identity(path)
    dht = start_peer_dht("relay-test", identity_path=path, **options)
    try:
        signer, _ = rm.open_record(rm.sign_record(rm.load_signing_key(rm.identity_key_der(dht)), b"x"), 10)
        assert signer == dht.peer_id
    finally:
        dht.shutdown()


def test_an_altered_record_is_refused(tmp_path):
    key = rm.load_signing_key(rm.write_identity(str(tmp_path / "a.key")))
    other = rm.load_signing_key(rm.write_identity(str(tmp_path / "b.key")))
    record = rm.sign_record(key, b"a report of some bytes")
    for position in (5, 10, len(record) - 1):  # in the message, in the key, in the signature
        altered = bytearray(record)
        altered[position] ^= 1
        with pytest.raises(rm.MalformedRecord):
            rm.open_record(bytes(altered), 100)
    # the message and signature of one member under another member's key
    inner_end = 5 + len(b"a report of some bytes")
    forged = rm.sign_record(other, b"a report of some bytes")
    key_and_rest = forged[inner_end:]
    key_length = struct.unpack_from(">H", key_and_rest)[0]
    with pytest.raises(rm.MalformedRecord, match="signature"):
        rm.open_record(record[:inner_end] + key_and_rest[:2 + key_length] + record[inner_end + 2 + key_length:], 100)


def test_sizes_are_checked_before_anything_is_read():
    with pytest.raises(rm.MalformedRecord, match="more than the 100 expected"):
        rm.open_record(struct.pack(">BI", 1, 2 ** 31) + b"x" * 10, 100)
    with pytest.raises(rm.MalformedRecord, match="announced"):
        rm.open_record(struct.pack(">BI", 1, 50) + b"x" * 10, 100)
    with pytest.raises(rm.MalformedRecord, match="more than the 2 members"):
        rm.unpack_records(struct.pack(">H", 3), 2, 1000)
    with pytest.raises(rm.MalformedRecord, match="more than the 1000 expected"):
        rm.unpack_records(struct.pack(">HI", 1, 2 ** 32 - 1), 2, 1000)
    with pytest.raises(rm.MalformedRecord, match="after the last record"):
        rm.unpack_records(rm.pack_records([b"ab"]) + b"!", 2, 1000)
    assert rm.unpack_records(rm.pack_records([b"ab", b""]), 2, 1000) == [b"ab", b""]
