"""Who may download a peer's state (issue 24, finding 11): with an authority, token holders only; at most
``max_state_downloads`` at once per donor and one per requester. A real donor process on 127.0.0.1 (an averager
with the guards, whose host process holds each request while a file exists, so downloads stay open), asked over a
real libp2p connection with hivemind's own request and with this package's."""

import asyncio
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from lightning_swarm.hivemind_ext.state_serving import check_max_state_downloads, download_request

WORKER = Path(__file__).with_name("state_serving_worker.py")
REPO = Path(__file__).resolve().parents[2]
PREFIX = "serving_test"
HANDLE = f"{PREFIX}::DecentralizedAverager.rpc_download_state"


def test_max_state_downloads_is_checked():
    assert check_max_state_downloads(3) == 3
    for bad in (0, -1, 1.5, True, None):
        with pytest.raises(ValueError, match="max_state_downloads must be a positive number"):
            check_max_state_downloads(bad)


def _authority(tmp_path: Path, users) -> dict:
    """An authority's key and, for each user, a key and a token of run "servingrun": {user: SwarmAuth}."""
    from lightning_swarm.auth.peer import SwarmAuth
    from lightning_swarm.auth.tokens import generate_key, issue_token, read_public_key, save_key, token_to_json

    authority_key = generate_key()
    save_key(authority_key, str(tmp_path / "authority.pem"))
    auths = {}
    for user in users:
        save_key(generate_key(), str(tmp_path / f"{user}.pem"))
        token = issue_token(authority_key, "servingrun", user, read_public_key(str(tmp_path / f"{user}.pem.pub")), 600)
        (tmp_path / f"{user}.token").write_text(token_to_json(token))
        auths[user] = SwarmAuth("servingrun", str(tmp_path / "authority.pem.pub"),
                                token=str(tmp_path / f"{user}.token"), key=str(tmp_path / f"{user}.pem"))
    return auths


def _start_donor(tmp_path: Path, hold: Path, log: Path, *extra: str) -> subprocess.Popen:
    env = dict(os.environ, PYTHONPATH=str(REPO))
    return subprocess.Popen(
        [sys.executable, str(WORKER), "--run", "servingrun", "--authority", str(tmp_path / "authority.pem.pub"),
         "--token", str(tmp_path / "donor.token"), "--key", str(tmp_path / "donor.pem"), "--hold", str(hold),
         "--max-state-downloads", "2", *extra], stdout=open(log, "w"), stderr=subprocess.STDOUT, env=env,
        start_new_session=True)


async def _connect_to_donor(log: Path, donor: subprocess.Popen):
    """Once the donor printed its address: its PeerID and a new p2p daemon of this process connected to it."""
    from hivemind.p2p import P2P, PeerID

    await _wait_log(log, "DONOR ", 1, donor)
    _, address, peer_id = next(line for line in log.read_text().splitlines() if line.startswith("DONOR ")).split()
    return PeerID.from_base58(peer_id), await P2P.create(initial_peers=[address], host_maddrs=["/ip4/127.0.0.1/tcp/0"])


def _run_then_kill(scenario, donor: subprocess.Popen, timeout: float) -> None:
    try:
        asyncio.run(asyncio.wait_for(scenario, timeout))
    finally:
        os.killpg(donor.pid, signal.SIGKILL)
        donor.wait(timeout=30)


async def _wait_log(path: Path, text: str, count: int, process, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        complete = path.read_text(errors="replace").rpartition("\n")[0]  # complete lines only
        if complete.count(text) >= count:
            return
        assert process.poll() is None, path.read_text(errors="replace")[-3000:]
        await asyncio.sleep(0.1)  # the event loop sends the requests meanwhile
    raise TimeoutError(f"no {count} x {text!r} in the donor's log:\n{path.read_text(errors='replace')[-3000:]}")


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_state_is_served_to_token_holders_one_download_each_and_a_bounded_number_at_once(tmp_path):
    from hivemind.proto import averaging_pb2
    from hivemind.utils.serializer import MSGPackSerializer

    auths = _authority(tmp_path, ("donor", "alice", "bob", "carol"))
    hold, log = tmp_path / "hold", tmp_path / "donor.log"
    hold.write_text("")
    donor = _start_donor(tmp_path, hold, log)

    async def scenario():
        donor_id, p2p = await _connect_to_donor(log, donor)
        try:
            own_id = p2p.peer_id.to_bytes()

            def request_of(user, peer_id=own_id):
                return download_request(auths[user], PREFIX, peer_id, MSGPackSerializer)

            async def open_download(request):
                return await p2p.iterate_protobuf_handler(donor_id, HANDLE, request, averaging_pb2.DownloadData)

            async def first(stream, timeout=60.0):
                try:
                    return await asyncio.wait_for(stream.__anext__(), timeout)
                except StopAsyncIteration:
                    return None  # an empty stream: refused

            # no token (hivemind's own request), and a proof made for another peer id: refused
            assert await first(await open_download(averaging_pb2.DownloadRequest())) is None
            assert await first(await open_download(request_of("alice", peer_id=b"another-peer"))) is None
            # a join proof is no download proof
            join_proof = auths["alice"].join_proof(PREFIX, own_id)
            assert await first(await open_download(averaging_pb2.JoinRequest(
                gather=MSGPackSerializer.dumps(join_proof)))) is None
            # alice's download stays open (the donor holds it); her second at once is refused
            alice_1 = await open_download(request_of("alice"))
            await _wait_log(log, "serving this peer's state to user 'alice'", 1, donor)
            assert await first(await open_download(request_of("alice"))) is None
            # bob takes the second place; carol finds the donor full
            bob = await open_download(request_of("bob"))
            await _wait_log(log, "serving this peer's state to user 'bob'", 1, donor)
            assert await first(await open_download(request_of("carol"))) is None
            hold.unlink()  # the donor sends: both open downloads get the whole state
            for stream in (alice_1, bob):
                messages = [message async for message in stream]
                assert messages and messages[0].metadata, "no state served"
            # places freed: carol is served now
            carol = await open_download(request_of("carol"))
            assert [message async for message in carol]
        finally:
            await p2p.shutdown()

    _run_then_kill(scenario(), donor, 200)
    text = log.read_text()
    # no token; wrong peer id (the join proof's refusal reads the same: logged once a minute)
    assert text.count("refused a state download by peer") == 2
    assert "no access token" in text and "not signed for this peer id" in text
    assert "it is downloading this peer's state already (one download at a time per requester)" in text
    assert "refused a state download by user 'carol'" in text and "max_state_downloads=2" in text


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_a_download_closes_its_stream_once_the_last_part_is_in_and_the_donor_holds_it_open_till_then(tmp_path):
    """The donor's stream stays open after its last part (its end could cut the last parts off: stream_ends), and
    VerifiedStateDownload closes it as soon as the last announced part is in, so the hold ends at once; a requester
    that reads until the end (hivemind's) still gets everything, after the hold."""
    import types

    import torch
    from hivemind.averaging import DecentralizedAverager
    from hivemind.proto import averaging_pb2
    from hivemind.utils.serializer import MSGPackSerializer

    from lightning_swarm.hivemind_ext.state_download import VerifiedStateDownload
    from lightning_swarm.hivemind_ext.stream_ends import STREAM_LINGER_SECONDS

    auths = _authority(tmp_path, ("donor", "alice", "bob"))
    log = tmp_path / "donor.log"
    donor = _start_donor(tmp_path, tmp_path / "no-hold", log, "--debug-serving")

    async def scenario():
        donor_id, p2p = await _connect_to_donor(log, donor)
        try:
            own_id = p2p.peer_id.to_bytes()

            async def alices_request():
                return download_request(auths["alice"], PREFIX, own_id, MSGPackSerializer)

            # the requester's side of a SwarmStateAverager's download, on its own p2p daemon
            requester = types.SimpleNamespace(
                get_stub=DecentralizedAverager.get_stub, _p2p=p2p, prefix=PREFIX, serializer=MSGPackSerializer,
                _expected_state=lambda: ([torch.Size([1000])], [torch.float32]),
                _state_download_request=alices_request)
            metadata, tensors = await VerifiedStateDownload._download_from(requester, donor_id, 30.0)
            assert metadata and torch.equal(tensors[0], torch.arange(1000, dtype=torch.float32))
            await _wait_log(log, "state stream to user 'alice': closed by the requester", 1, donor)
            # bob reads until the end of the stream, as hivemind's download does: it ends after the hold
            stream = await p2p.iterate_protobuf_handler(
                donor_id, HANDLE, download_request(auths["bob"], PREFIX, own_id, MSGPackSerializer),
                averaging_pb2.DownloadData)
            messages = [message async for message in stream]
            assert messages and messages[0].metadata
            await _wait_log(log, "state stream to user 'bob': the requester did not close it", 1, donor)
        finally:
            await p2p.shutdown()

    _run_then_kill(scenario(), donor, 120)
    closed = next(line for line in log.read_text().splitlines() if "closed by the requester" in line)
    seconds = float(closed.split("closed by the requester ")[1].split(" s ")[0])
    assert seconds < STREAM_LINGER_SECONDS / 2, closed
