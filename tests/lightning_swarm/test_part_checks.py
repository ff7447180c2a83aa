"""Issue 24, finding 2: a wrong-shaped part (or reducer result) is refused for its sender alone.

A real ``RobustAllReduceRunner`` on a real p2p daemon (127.0.0.1) receives its groupmates' parts through hivemind's
``rpc_aggregate_part`` handler, as the averager's p2p server calls it, in one event loop; the malicious reducer of the
last test is a second real p2p daemon serving a handler that answers with results of the wrong size.
"""

from __future__ import annotations

import asyncio
import logging

import pytest
import torch
from hivemind.averaging import DecentralizedAverager
from hivemind.averaging.partition import TensorPartContainer
from hivemind.compression import deserialize_torch_tensor, serialize_torch_tensor
from hivemind.p2p import P2P, P2PContext, PeerID
from hivemind.proto import averaging_pb2, runtime_pb2
from hivemind.utils.asyncio import as_aiter

from lightning_swarm.aggregation import weighted_mean
from lightning_swarm.hivemind_ext.robust_allreduce import RobustAllReduceRunner, screen_and_aggregate

PART_VALUES = 1000
PART_BYTES = 4 * PART_VALUES  # float32 parts of 1000 values
GROUP = b"group-of-test"
PREFIX = "part_checks_test"


def _tensor(seed: int) -> torch.Tensor:
    return torch.randn(3 * PART_VALUES, generator=torch.Generator().manual_seed(seed))


def _messages(tensor: torch.Tensor, fractions, reducer_index: int, bad_part=None, bad_message=None) -> list:
    """The AveragingData a sender streams to one reducer (hivemind's format); part ``bad_part`` replaced."""
    async def parts():
        container = TensorPartContainer([tensor], fractions, part_size_bytes=PART_BYTES)
        return [part async for part in container.iterate_input_parts_for(reducer_index)]

    serialized = asyncio.run(parts())
    messages = []
    for index, part in enumerate(serialized):
        if index == bad_part:
            part = bad_message
        code = averaging_pb2.PART_FOR_AVERAGING if index == 0 else averaging_pb2.NO_CODE
        messages.append(averaging_pb2.AveragingData(code=code, group_id=GROUP if index == 0 else b"",
                                                    tensor_part=part, weight=1.0))
    return messages


def _reduce_as_only_reducer(mine, senders: dict, aggregation: str):
    """This peer reduces everything (the other senders are clients); returns (its delta, each sender's replies)."""

    async def main():
        p2p = await P2P.create(host_maddrs=["/ip4/127.0.0.1/tcp/0"])
        try:
            peers = [p2p.peer_id, *senders]
            runner = RobustAllReduceRunner(
                p2p=p2p, servicer_type=DecentralizedAverager, prefix=PREFIX, tensors=[mine.clone()], group_id=GROUP,
                ordered_peer_ids=peers, peer_fractions=(1.0,) + (0.0,) * len(senders), part_size_bytes=PART_BYTES,
                aggregation=aggregation)

            async def send(peer, messages):
                context = P2PContext(handle_name="rpc_aggregate_part", local_id=p2p.peer_id, remote_id=peer)
                return [reply async for reply in runner.rpc_aggregate_part(as_aiter(*messages), context)]

            tasks = [asyncio.create_task(send(peer, messages)) for peer, messages in senders.items()]
            deltas = [delta async for delta in runner]
            return deltas[0], await asyncio.wait_for(asyncio.gather(*tasks), 30)
        finally:
            await p2p.shutdown()

    return asyncio.run(main())


@pytest.mark.timeout(120)
@pytest.mark.parametrize("aggregation", ["mean", "centered_clip"])
def test_a_part_of_1001_values_is_refused_for_its_sender_alone(aggregation, caplog):
    mine, honest_tensor, bad_tensor = _tensor(0), _tensor(1), _tensor(2)
    honest, bad = PeerID(b"\x00\x06honest"), PeerID(b"\x00\x03bad")
    # the attack: part 1 of the bad sender has 1001 values where 1000 are expected
    wrong = serialize_torch_tensor(torch.randn(PART_VALUES + 1), runtime_pb2.CompressionType.NONE)
    senders = {honest: _messages(honest_tensor, (1.0, 0.0, 0.0), 0),
               bad: _messages(bad_tensor, (1.0, 0.0, 0.0), 0, bad_part=1, bad_message=wrong)}
    with caplog.at_level(logging.WARNING):
        delta, (honest_replies, bad_replies) = _reduce_as_only_reducer(mine, senders, aggregation)

    result = mine + delta
    for index in range(3):
        part = slice(index * PART_VALUES, (index + 1) * PART_VALUES)
        inputs = [mine[part], honest_tensor[part]] + ([bad_tensor[part]] if index == 0 else [])
        if aggregation == "mean":
            expected = weighted_mean(inputs, [1.0] * len(inputs))
        else:  # what CenteredClip gives on the same inputs without the bad sender's refused parts
            expected, _, _ = screen_and_aggregate(inputs, [1.0] * len(inputs), None, "centered_clip", None, 20)
        torch.testing.assert_close(result[part], expected, rtol=0, atol=1e-5)
    # the honest sender got every averaged part back, the same result as this peer; the bad one an error
    assert [reply.code for reply in honest_replies] == [averaging_pb2.AVERAGED_PART] * 3
    honest_result = honest_tensor + torch.cat([deserialize_torch_tensor(r.tensor_part) for r in honest_replies])
    torch.testing.assert_close(honest_result, result, rtol=0, atol=1e-5)
    assert bad_replies[-1].code == averaging_pb2.INTERNAL_ERROR
    refusals = [r.getMessage() for r in caplog.records if "refused sender" in r.getMessage()]
    assert len(refusals) == 1 and str(bad) in refusals[0] and "part 1" in refusals[0] and "[1001]" in refusals[0]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("bad_message", ["blockwise_0_absmax", "float64_dtype", "undecodable"])
def test_malformed_first_parts_are_refused_before_decoding(bad_message, caplog):
    mine, honest_tensor, bad_tensor = _tensor(0), _tensor(1), _tensor(2)
    honest, bad = PeerID(b"\x00\x06honest"), PeerID(b"\x00\x03bad")
    if bad_message == "blockwise_0_absmax":  # finding 1's crash: 0 absmax values, a 0-entry codebook, codes
        buffer = b"\x00" * 16 + b"\x01" * PART_VALUES
        wrong = runtime_pb2.Tensor(compression=runtime_pb2.BLOCKWISE_8BIT, buffer=buffer, size=[PART_VALUES],
                                   dtype="float32")
    elif bad_message == "float64_dtype":  # twice the memory of the local float32 part
        wrong = serialize_torch_tensor(torch.randn(PART_VALUES, dtype=torch.float64))
    else:
        wrong = runtime_pb2.Tensor(compression=runtime_pb2.NONE, buffer=b"\x07" * 17, size=[PART_VALUES],
                                   dtype="float32")
    senders = {honest: _messages(honest_tensor, (1.0, 0.0, 0.0), 0),
               bad: _messages(bad_tensor, (1.0, 0.0, 0.0), 0, bad_part=0, bad_message=wrong)}
    with caplog.at_level(logging.WARNING):
        delta, _ = _reduce_as_only_reducer(mine, senders, "mean")
    torch.testing.assert_close(mine + delta, (mine + honest_tensor) / 2, rtol=0, atol=1e-5)
    assert str(bad) in caplog.text and "part 0" in caplog.text


@pytest.mark.timeout(120)
def test_a_reducer_result_of_the_wrong_size_is_not_applied(caplog):
    """A groupmate reduces half of the tensor and answers with results of 1001 values: that half keeps this peer's
    values, the half this peer reduces is averaged with the groupmate's (well-formed) parts as usual."""
    mine, theirs = _tensor(0), _tensor(1)
    fractions = (2.0, 1.0)  # this peer reduces the first 2000 values, the liar the last 1000
    liar_parts = _messages(theirs, fractions, 0)  # the liar's parts for this peer's slice, well-formed

    async def main():
        liar = await P2P.create(host_maddrs=["/ip4/127.0.0.1/tcp/0"])
        me = await P2P.create(host_maddrs=["/ip4/127.0.0.1/tcp/0"], initial_peers=await liar.get_visible_maddrs())
        try:
            async def lying_reducer(requests, context):
                async for request in requests:  # reads this peer's parts, answers each with 1001 values
                    yield averaging_pb2.AveragingData(code=averaging_pb2.AVERAGED_PART, tensor_part=serialize_torch_tensor(
                        torch.zeros(PART_VALUES + 1)))

            handle = DecentralizedAverager._get_handle_name(PREFIX, "rpc_aggregate_part")
            await liar.add_protobuf_handler(handle, lying_reducer, averaging_pb2.AveragingData, stream_input=True,
                                            stream_output=True)
            runner = RobustAllReduceRunner(
                p2p=me, servicer_type=DecentralizedAverager, prefix=PREFIX, tensors=[mine.clone()], group_id=GROUP,
                ordered_peer_ids=[me.peer_id, liar.peer_id], peer_fractions=fractions, part_size_bytes=PART_BYTES)
            context = P2PContext(handle_name="rpc_aggregate_part", local_id=me.peer_id, remote_id=liar.peer_id)
            sent = asyncio.create_task(asyncio.wait_for(
                _drain(runner.rpc_aggregate_part(as_aiter(*liar_parts), context)), 30))
            deltas = [delta async for delta in runner]
            await sent
            return deltas[0]
        finally:
            await me.shutdown()
            await liar.shutdown()

    with caplog.at_level(logging.WARNING):
        delta = asyncio.run(main())
    result = mine + delta
    torch.testing.assert_close(result[:2 * PART_VALUES], (mine[:2 * PART_VALUES] + theirs[:2 * PART_VALUES]) / 2,
                               rtol=0, atol=1e-5)
    assert torch.equal(result[2 * PART_VALUES:], mine[2 * PART_VALUES:])  # the liar's slice: local values kept
    assert "refused the results of reducer" in caplog.text and "[1001]" in caplog.text


async def _drain(replies) -> list:
    return [reply async for reply in replies]


@pytest.mark.timeout(120)
def test_a_client_mode_senders_stream_is_closed_by_the_sender_once_its_results_are_in():
    """A reducer's results to a client-mode sender come in one burst at the end; closed by the reducer first, p2pd
    dropped the last of them in flight on a loaded machine (2 of 114 fresh 3-peer rounds). Two real runners on
    two real p2p daemons: the sender gets every result, closes the stream itself, and the reducer's end of it was
    still open then (its handler ended by the sender's close, not by its own return nor at its linger bound)."""
    from lightning_swarm.hivemind_ext.stream_ends import STREAM_LINGER_SECONDS

    mine, theirs = _tensor(0), _tensor(1)
    fractions = (1.0, 0.0)  # this peer reduces everything; the other one is a client-mode sender

    async def main():
        reducer_p2p = await P2P.create(host_maddrs=["/ip4/127.0.0.1/tcp/0"])
        sender_p2p = await P2P.create(host_maddrs=["/ip4/127.0.0.1/tcp/0"],
                                      initial_peers=await reducer_p2p.get_visible_maddrs())
        try:
            peers = [reducer_p2p.peer_id, sender_p2p.peer_id]
            runners = [RobustAllReduceRunner(
                p2p=p2p, servicer_type=DecentralizedAverager, prefix=PREFIX, tensors=[tensor.clone()],
                group_id=GROUP, ordered_peer_ids=peers, peer_fractions=fractions, part_size_bytes=PART_BYTES)
                for p2p, tensor in ((reducer_p2p, mine), (sender_p2p, theirs))]
            handler_end = {}

            async def reducer_handler(requests, context):  # as the averager's p2p server routes it
                loop = asyncio.get_running_loop()
                try:
                    async for reply in runners[0].rpc_aggregate_part(requests, context):
                        handler_end["last_result"] = loop.time()
                        yield reply
                    handler_end["how"] = "returned"
                except asyncio.CancelledError:  # hivemind's p2p layer ends a handler whose caller closed
                    handler_end["how"] = "closed by the sender"
                    raise
                finally:
                    handler_end["at"] = loop.time()

            handle = DecentralizedAverager._get_handle_name(PREFIX, "rpc_aggregate_part")
            await reducer_p2p.add_protobuf_handler(handle, reducer_handler, averaging_pb2.AveragingData,
                                                   stream_input=True, stream_output=True)
            deltas = await asyncio.wait_for(asyncio.gather(*(_drain(runner) for runner in runners)), 30)
            for _ in range(100):  # the sender's close reaches the reducer's handler through both daemons
                if "at" in handler_end:
                    break
                await asyncio.sleep(0.05)
            return [d[0] for d in deltas], handler_end
        finally:
            await sender_p2p.shutdown()
            await reducer_p2p.shutdown()

    (reducer_delta, sender_delta), handler_end = asyncio.run(main())
    average = (mine + theirs) / 2
    torch.testing.assert_close(mine + reducer_delta, average, rtol=0, atol=1e-5)
    torch.testing.assert_close(theirs + sender_delta, average, rtol=0, atol=1e-5)  # every result came
    assert handler_end.get("how") == "closed by the sender", handler_end
    assert handler_end["at"] - handler_end["last_result"] < STREAM_LINGER_SECONDS / 2, handler_end
