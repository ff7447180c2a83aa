"""Every part and every reducer result an all-reduce receives is checked against this peer's own part before decoding.

In hivemind 1.1.12 an ``AllReduceRunner`` decodes whatever a groupmate streams: a sender's part of 1001 values where
the reducer's own part has 1000 went into the aggregation, which raised for every sender of that slice (issue 24,
finding 2), and a reducer's result of another size went into the output tensor. Here each received message is
checked (:func:`lightning_swarm.wire_checks.check_tensor_message`: the local part's shape, a dtype that fits it, a
buffer of exactly the length its header gives) before hivemind decodes it:

- a sender's part that fails is refused for that sender alone: the sender is left out of the rest of the round, as
  hivemind leaves out a sender that fails (its earlier, well-formed parts count; the other senders' results are those
  of the senders that remain), and it is named in one log line;
- a reducer's result that fails is not applied: that reducer's slice keeps this peer's local values, as hivemind does
  when a reducer fails, and the reducer is named in one log line.

The stream of a reducer's results is closed by the sender once every result is in, and the reducer keeps it open
until then (:mod:`~lightning_swarm.hivemind_ext.stream_ends`): closed by the reducer first, p2pd dropped results
still in flight.

:class:`CheckedPartStreams` is a mixin for hivemind's ``AllReduceRunner`` (put it first in the bases). It overrides
``AllReduceRunner._accumulate_parts_streaming`` (where a sender's parts are decoded) and ``rpc_aggregate_part`` (the
reducer's end of a sender's stream), and wraps the stub that ``AllReduceRunner._get_peer_stub`` returns (the stream
of a reducer's results): these names are listed in :data:`lightning_swarm.hivemind_ext.private_api.PRIVATE_SYMBOLS`.
"""

from __future__ import annotations

import logging
from typing import AsyncIterator, Callable, List, Sequence, Tuple

import torch
from hivemind.p2p import P2PContext, PeerID
from hivemind.proto import averaging_pb2

from lightning_swarm.hivemind_ext.stream_ends import held_open
from lightning_swarm.wire_checks import MalformedTensor, check_tensor_message

log = logging.getLogger(__name__)

Expected = Sequence[Tuple[torch.Size, torch.dtype]]


class PartRefused(Exception):
    """A groupmate's message was malformed: its stream is ended (the reason is in the message)."""


async def checked_part_messages(stream: AsyncIterator[averaging_pb2.AveragingData], expected: Expected,
                                checked_codes: Sequence[int], on_refused: Callable[[str], None],
                                close_after_last: bool = False) -> AsyncIterator[averaging_pb2.AveragingData]:
    """Pass on a groupmate's messages; each one with a code in ``checked_codes`` must carry a tensor part that fits
    the next of ``expected`` (this peer's own parts: shape, dtype). Messages with other codes pass unchanged (hivemind
    handles them: a reducer's error code ends its stream).

    Args:
        stream: the groupmate's messages.
        expected: (shape, dtype) of each part this peer expects from it, in order.
        checked_codes: the message codes that carry a part (a sender's first part says PART_FOR_AVERAGING, the next
            ones NO_CODE; a reducer's results AVERAGED_PART).
        on_refused: called once with the reason when a message is refused.
        close_after_last: end the stream (and close it) once every part in ``expected`` has come (a reducer's
            results: the reducer keeps its end open until this one closes, :mod:`.stream_ends`).

    Raises:
        PartRefused: at the first malformed message (or one part too many); nothing of it is decoded.
    """
    index = 0
    async for message in stream:
        if message.code in checked_codes:
            try:
                if index >= len(expected):
                    raise MalformedTensor(f"more than the {len(expected)} parts expected")
                shape, dtype = expected[index]
                check_tensor_message(message.tensor_part, shape, dtype)
            except MalformedTensor as e:
                reason = f"part {index}: {e}"
                on_refused(reason)
                if hasattr(stream, "aclose"):  # ends the stream now: hivemind's wrappers of it signal its end
                    await stream.aclose()
                raise PartRefused(reason) from None
            index += 1
        yield message
        if close_after_last and index == len(expected):
            # every result is in: this end closes the stream (the reducer waits for it: :mod:`.stream_ends`)
            if hasattr(stream, "aclose"):
                await stream.aclose()
            return


class _CheckedResultsStub:
    """A reducer's stub whose ``rpc_aggregate_part`` stream of results is checked by :func:`checked_part_messages`."""

    def __init__(self, stub, expected: Expected, on_refused: Callable[[str], None]):
        self._stub, self._expected, self._on_refused = stub, expected, on_refused

    async def rpc_aggregate_part(self, requests, *args, **kwargs):
        results = await self._stub.rpc_aggregate_part(requests, *args, **kwargs)
        return checked_part_messages(results, self._expected, (averaging_pb2.AVERAGED_PART,), self._on_refused,
                                     close_after_last=True)


class CheckedPartStreams:
    """Mixin for hivemind's ``AllReduceRunner`` (first in the bases): see the module docstring."""

    async def _accumulate_parts_streaming(self, stream: AsyncIterator[averaging_pb2.AveragingData], sender_index: int):
        sender = self.sender_peer_ids[sender_index]
        expected = [(part.shape, part.dtype) for part in self.parts_for_local_averaging]
        checked = checked_part_messages(
            stream, expected, (averaging_pb2.PART_FOR_AVERAGING, averaging_pb2.NO_CODE),
            lambda reason: log.warning(f"[lightning_swarm] averaging: refused sender {sender} for the rest of the "
                                       f"round: malformed {reason}"))
        async for message in super()._accumulate_parts_streaming(checked, sender_index):
            yield message

    async def rpc_aggregate_part(self, stream: AsyncIterator[averaging_pb2.AveragingData], context: P2PContext
                                 ) -> AsyncIterator[averaging_pb2.AveragingData]:
        # kept open after the last result until the sender closes its end (it does once every result is in)
        async for message in held_open(super().rpc_aggregate_part(stream, context)):
            yield message

    def _get_peer_stub(self, peer: PeerID):
        stub = super()._get_peer_stub(peer)
        peer_index = self.ordered_peer_ids.index(peer)
        # what this peer sends that reducer, hence the shape and dtype of each result it must get back
        expected: List[Tuple[torch.Size, torch.dtype]] = [
            (part.shape, part.dtype) for part, _ in self.tensor_part_container._input_parts_by_peer[peer_index]]
        return _CheckedResultsStub(stub, expected, lambda reason: log.warning(
            f"[lightning_swarm] averaging: refused the results of reducer {peer}: malformed {reason}; kept the local "
            "values of its slice"))
