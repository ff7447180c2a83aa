"""A newcomer's state download that completes over slow links, or fails cleanly and is retried.

hivemind 1.1.12's ``DecentralizedAverager._load_state_from_peers`` streams the state in 64 KiB parts and
- waits at most ``request_timeout`` (here 1 s: ``min(3, matchmaking_time / 2)``) for each part, or
  ``next_chunk_timeout`` (hivemind.Optimizer's default: ``matchmaking_time``), a few seconds that a loaded donor
  compressing its next tensor can exceed;
- ends a tensor at the end of the stream whether or not all its parts came: its p2p client reads a connection closed
  mid-stream (``asyncio.IncompleteReadError``) as a normal end, and the sending side stops silently when a send
  fails. A truncated tensor then fails in ``reshape`` ("shape '[49424, 192]' is invalid for input of size
  7077888", issue 16) or, if its length happens to fit, is loaded;
- returns None when every donor failed, which ``TrainingStateAverager`` takes as "nothing to load": the newcomer
  trains on from its own initialisation, and hivemind.Optimizer's retry loop never runs;
- is waited for by the host process at most ``load_state_timeout`` in total, however fast data still arrives.

:class:`VerifiedStateDownload` replaces that download: a part may take the ``timeout`` the host passes (hivemind.Optimizer:
``load_state_timeout``; a stall, not a total), every tensor must arrive with the number of parts its first part announced, the parameters must have this
peer's shapes, progress (MB, MB/s) is logged every few seconds, failed donors are retried with a backoff, and if all
attempts fail the host gets an exception, so hivemind.Optimizer logs it and starts over. Nothing partial is ever
deserialised or loaded.
"""

from __future__ import annotations

import asyncio
import random
import time
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch
from hivemind.averaging.averager import DecentralizedAverager
from hivemind.compression import deserialize_torch_tensor
from hivemind.p2p import PeerID
from hivemind.proto import averaging_pb2
from hivemind.utils import MPFuture, get_logger
from hivemind.utils.streaming import combine_from_streaming
from hivemind.utils.timed_storage import ValueWithExpiration

# the download runs in hivemind's averager process: log under hivemind's logger, where its handler (HIVEMIND_LOGLEVEL)
# shows the messages next to hivemind's own
logger = get_logger("hivemind.averaging.verified_state_download")

DEFAULT_CHUNK_TIMEOUT = 30.0  # seconds without a single part from the donor: a stall, not a slow link
DEFAULT_ATTEMPTS = 3  # rounds over all donors per call; hivemind.Optimizer calls again after an exception
PROGRESS_LOG_INTERVAL = 5.0


class StateDownloadError(RuntimeError):
    """No donor sent a complete, well-formed state."""


class _TensorAssembler:
    """Collects the parts of streamed tensors; a tensor is complete only with every part its first one announced."""

    def __init__(self, expected_shapes: Sequence[torch.Size]):
        self.expected_shapes = list(expected_shapes)
        self.tensors: List[torch.Tensor] = []
        self.parts: list = []
        self.bytes = 0

    def add(self, part) -> None:
        self.bytes += len(part.buffer)
        if part.dtype:  # the first part of a new tensor
            if self.parts:
                self._finish(stream_ended=False)
            if part.chunks < 1:
                raise StateDownloadError(f"tensor {len(self.tensors)}: announced {part.chunks} parts")
        elif not self.parts:
            raise StateDownloadError(f"tensor {len(self.tensors)}: a part came before the tensor's first part")
        self.parts.append(part)
        if len(self.parts) > self.parts[0].chunks:
            raise StateDownloadError(f"tensor {len(self.tensors)}: more parts than the {self.parts[0].chunks} announced")

    def close(self) -> List[torch.Tensor]:
        if self.parts:
            self._finish(stream_ended=True)
        return self.tensors

    def _finish(self, stream_ended: bool) -> None:
        announced, received = self.parts[0].chunks, len(self.parts)
        index = len(self.tensors)
        if received != announced:
            where = "the stream ended" if stream_ended else "the next tensor began"
            raise StateDownloadError(f"tensor {index} truncated: {where} after {received} of {announced} parts")
        tensor = deserialize_torch_tensor(combine_from_streaming(self.parts))
        if index < len(self.expected_shapes) and tensor.shape != self.expected_shapes[index]:
            raise StateDownloadError(
                f"tensor {index} has shape {list(tensor.shape)}, this peer's has {list(self.expected_shapes[index])}"
            )
        self.tensors.append(tensor)
        self.parts = []


class VerifiedStateDownload(DecentralizedAverager):
    """Mixin for hivemind averagers: a verified, retried, logged state download (see the module docstring).

    Put it after the hivemind averager class in the bases (``class A(TrainingStateAverager, VerifiedStateDownload)``):
    it then sits between TrainingStateAverager and DecentralizedAverager, where the download happens.

    Args:
        state_download_attempts: rounds over all donors before the host gets a StateDownloadError.
        *args, **kwargs: as the averager class this is mixed into.
    """

    def __init__(self, *args, state_download_attempts: int = DEFAULT_ATTEMPTS, **kwargs):
        if state_download_attempts < 1:
            raise ValueError(f"state_download_attempts must be >= 1, got {state_download_attempts!r}")
        self.state_download_attempts = state_download_attempts
        super().__init__(*args, **kwargs)  # may start the averager's process: set everything it reads before

    def load_state_from_peers(self, wait: bool = True, timeout: Optional[float] = None):
        """Download the state; `timeout` bounds each donor's silence (a stall), not the whole download, which may
        take long over a slow link. Raises StateDownloadError if donors exist but none sent a whole state."""
        future = MPFuture()
        self._outer_pipe.send(("_load_state_from_peers", [], dict(timeout=timeout, future=future)))
        return future.result() if wait else future

    def _expected_state_shapes(self) -> List[torch.Size]:
        """Shapes the state's first tensors must have: parameters and extras of a TrainingStateAverager (its state
        continues with optimizer statistics), else all averaged tensors."""
        main_parameters = getattr(self, "main_parameters", None)
        if main_parameters is not None:
            return [tensor.shape for tensor in (*main_parameters, *getattr(self, "extra_tensors", ()))]
        return [tensor.shape for tensor in self._averaged_tensors]

    def _donor_priorities(self) -> Dict[PeerID, float]:
        """The state-sharing priority (usually the epoch) every peer that offers its state declared."""
        key = f"{self._matchmaking.group_key_manager.prefix}.all_averagers"
        found = self.dht.get(key, latest=True)
        priorities = found.value if found is not None and isinstance(found.value, dict) else {}
        return {
            PeerID(peer_id): float(info.value)
            for peer_id, info in priorities.items()
            if isinstance(info, ValueWithExpiration) and isinstance(info.value, (float, int))
        }

    def _donors(self) -> List[PeerID]:
        ranked = {peer: (priority, random.random()) for peer, priority in self._donor_priorities().items()}
        return [peer for peer in sorted(ranked, key=ranked.get, reverse=True) if peer != self.peer_id]

    async def _state_download_request(self):
        """What the request for a donor's state carries (state_serving.GuardedStateServing adds this peer's proof)."""
        return averaging_pb2.DownloadRequest()

    async def _download_from(self, peer: PeerID, chunk_timeout: float) -> Tuple[Any, List[torch.Tensor]]:
        stub = self.get_stub(self._p2p, peer, namespace=self.prefix)
        assembler = _TensorAssembler(self._expected_state_shapes())
        metadata = None
        start = last_log = time.monotonic()
        stream = await asyncio.wait_for(stub.rpc_download_state(await self._state_download_request()), chunk_timeout)
        iterator = stream.__aiter__()
        while True:
            try:
                message = await asyncio.wait_for(iterator.__anext__(), chunk_timeout)
            except StopAsyncIteration:
                break
            except asyncio.TimeoutError:
                raise StateDownloadError(
                    f"no data for {chunk_timeout:.0f} s after {assembler.bytes / 1e6:.1f} MB "
                    f"({len(assembler.tensors)} tensors)"
                ) from None
            if message.metadata:
                metadata = self.serializer.loads(message.metadata)
            assembler.add(message.tensor_part)
            now = time.monotonic()
            if now - last_log >= PROGRESS_LOG_INTERVAL:
                last_log = now
                logger.info(f"Downloading state from {peer}: {assembler.bytes / 1e6:.1f} MB, "
                            f"{len(assembler.tensors)} tensors done, {assembler.bytes / 1e6 / (now - start):.2f} MB/s")
        tensors = assembler.close()
        if not metadata:
            raise StateDownloadError("the donor sent no metadata (it refused to share its state)")
        expected = len(assembler.expected_shapes)
        if len(tensors) < expected:
            raise StateDownloadError(f"received {len(tensors)} tensors, this peer's state has at least {expected}")
        elapsed = time.monotonic() - start
        logger.info(f"Downloaded state from {peer}: {assembler.bytes / 1e6:.1f} MB, {len(tensors)} tensors in "
                    f"{elapsed:.1f} s ({assembler.bytes / 1e6 / max(elapsed, 1e-9):.2f} MB/s)")
        return metadata, tensors

    async def _load_state_from_peers(self, future: MPFuture, timeout: Optional[float] = None):
        chunk_timeout = timeout if timeout is not None else DEFAULT_CHUNK_TIMEOUT
        errors = []
        try:
            for attempt in range(self.state_download_attempts):
                donors = self._donors()
                if not donors:
                    logger.info("No peer offers its state for download")
                    future.set_result(None)  # as hivemind: nothing to load, train from this peer's state
                    return
                for peer in donors:
                    logger.info(f"Downloading state from {peer} (attempt {attempt + 1})")
                    try:
                        future.set_result(await self._download_from(peer, chunk_timeout))
                        return
                    except Exception as e:  # a donor's failure must not end the download: try the next one
                        errors.append(f"{peer}: {e!r}")
                        logger.warning(f"State download from {peer} failed, nothing was loaded: {e!r}")
                if attempt + 1 < self.state_download_attempts:
                    await asyncio.sleep(min(30.0, 2.0 * 2**attempt) * (0.5 + random.random()))
            future.set_exception(StateDownloadError(
                f"no peer sent a whole state in {self.state_download_attempts} rounds: " + "; ".join(errors[-3:])
            ))
        finally:
            if not future.done():
                future.set_exception(StateDownloadError("state download was interrupted"))


class NoStateDownload(DecentralizedAverager):
    """Mixin for a GradientAverager: a newcomer does not download the others' gradient buffers.

    hivemind.Optimizer.load_state_from_peers also calls the gradient averager's, which streams the donor's whole
    gradient accumulators (as large as the parameters) and then drops them: the optimizer resets the accumulators
    right after. Skipping it halves what a newcomer downloads. This peer still serves its own to peers that ask.
    """

    def load_state_from_peers(self, wait: bool = True, timeout: Optional[float] = None):
        return None
