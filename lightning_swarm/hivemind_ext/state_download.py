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

:class:`VerifiedStateDownload` replaces that download: a part may take the ``timeout`` the host passes
(hivemind.Optimizer: ``load_state_timeout``; a stall, not a total), every tensor must arrive with the number of
parts its first part announced, the tensors must be as many as this peer's state has, with its shapes and dtypes
(checked on each tensor's first part, before its bytes are kept: the download never buffers more than this peer's
own state takes on the wire), progress (MB, MB/s) is logged every few seconds, the stream is closed once the last
announced part is in (the donor holds it open until then: :mod:`~lightning_swarm.hivemind_ext.stream_ends`), failed
donors are retried with a backoff, and if all attempts fail the host gets an exception, so hivemind.Optimizer logs
it and starts over. Nothing partial is ever deserialised or loaded.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import math
import random
import time
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch
from hivemind.averaging.averager import DecentralizedAverager
from hivemind.compression import deserialize_torch_tensor
from hivemind.p2p import PeerID
from hivemind.proto import averaging_pb2, runtime_pb2
from hivemind.utils import MPFuture, get_logger, nested_flatten
from hivemind.utils.timed_storage import ValueWithExpiration

from lightning_swarm.wire_checks import (
    MalformedTensor,
    check_tensor_header,
    check_tensor_message,
    compression_name,
    max_buffer_length,
)

# the download runs in hivemind's averager process: log under hivemind's logger, where its handler (HIVEMIND_LOGLEVEL)
# shows the messages next to hivemind's own
logger = get_logger("hivemind.averaging.verified_state_download")

DEFAULT_CHUNK_TIMEOUT = 30.0  # seconds without a single part from the donor: a stall, not a slow link
DEFAULT_ATTEMPTS = 3  # rounds over all donors per call; hivemind.Optimizer calls again after an exception
PROGRESS_LOG_INTERVAL = 5.0
# the donor's metadata (epoch, group bits, the optimizer's non-tensor state): kilobytes for honest states
MAX_METADATA_BYTES = 16 * 2**20
STOP_POLL_INTERVAL = 0.5  # seconds between two looks at the host's stop condition while it waits for a download


class StateDownloadError(RuntimeError):
    """No donor sent a complete, well-formed state."""


class StateDownloadStopped(KeyboardInterrupt):
    """The host stopped waiting for a state download (its trainer got SIGTERM or reached ``max_time``).

    A KeyboardInterrupt because hivemind.Optimizer.load_state_from_peers retries on every other exception, forever;
    :class:`~lightning_swarm.hivemind_ext.optimizer.SwarmOptimizer` catches it and returns."""


class _TensorAssembler:
    """Collects the parts of streamed tensors, each checked against the local tensor it will fill as it arrives.

    A tensor's first part carries its header (compression type, dtype, shape, number of parts): it must have the local
    tensor's shape and a dtype that fits it (:func:`lightning_swarm.wire_checks.dtype_fits`), and the parts' bytes may
    add up to no more than a well-formed message of that header takes
    (:func:`~lightning_swarm.wire_checks.max_buffer_length`); a tensor past the local state's count is refused. So the
    download never buffers more than this peer's own state takes on the wire. A tensor is complete only with every
    part its first one announced; then its whole message is checked
    (:func:`~lightning_swarm.wire_checks.check_tensor_message`) before it is decoded.

    Args:
        expected_shapes: the local state's tensors' shapes, in the order the donor sends them.
        expected_dtypes: their dtypes (None: any dtype of :data:`~lightning_swarm.wire_checks.WIRE_DTYPES`).
    """

    def __init__(self, expected_shapes: Sequence[torch.Size], expected_dtypes: Optional[Sequence[torch.dtype]] = None):
        self.expected_shapes = [torch.Size(shape) for shape in expected_shapes]
        self.expected_dtypes = list(expected_dtypes) if expected_dtypes is not None else [None] * len(expected_shapes)
        if len(self.expected_dtypes) != len(self.expected_shapes):
            raise ValueError("give one expected dtype per expected shape")
        self.tensors: List[torch.Tensor] = []
        self.bytes = 0
        self._header: Optional[runtime_pb2.Tensor] = None  # the current tensor's first part, without its buffer
        self._buffer = bytearray()
        self._parts = 0
        self._max_bytes = 0

    def add(self, part: runtime_pb2.Tensor) -> None:
        self.bytes += len(part.buffer)
        index = len(self.tensors)
        if part.dtype:  # the first part of a new tensor
            if self._header is not None:
                self._finish(stream_ended=False)
                index = len(self.tensors)
            self._start(part, index)
        elif self._header is None:
            raise StateDownloadError(f"tensor {index}: a part came before the tensor's first part")
        elif not part.buffer:  # hivemind never streams one: parts would be bounded by nothing but their count
            raise StateDownloadError(f"tensor {index}: an empty part")
        else:
            self._parts += 1
        if self._parts > self._header.chunks:
            raise StateDownloadError(f"tensor {index}: more parts than the {self._header.chunks} announced")
        if len(self._buffer) + len(part.buffer) > self._max_bytes:
            raise StateDownloadError(f"tensor {index}: more than the {self._max_bytes} bytes a "
                                     f"{compression_name(self._header)} tensor of this peer's shape takes")
        self._buffer += part.buffer

    def _start(self, part: runtime_pb2.Tensor, index: int) -> None:
        if index >= len(self.expected_shapes):
            raise StateDownloadError(f"tensor {index}: this peer's state has {len(self.expected_shapes)} tensors")
        if part.chunks < 1:
            raise StateDownloadError(f"tensor {index}: announced {part.chunks} parts")
        header = runtime_pb2.Tensor()
        header.CopyFrom(part)
        header.buffer = b""
        try:  # the header against the local tensor, before a byte of it is kept
            check_tensor_header(header, self.expected_shapes[index], self.expected_dtypes[index])
            self._max_bytes = max_buffer_length(compression_name(header), self.expected_shapes[index], header.dtype)
        except MalformedTensor as e:
            raise StateDownloadError(f"tensor {index}: {e}") from None
        self._header, self._buffer, self._parts = header, bytearray(), 1

    @property
    def last_part_in(self) -> bool:
        """Whether every part of the local state's last tensor came (the donor has nothing more to send)."""
        return (self._header is not None and self._parts == self._header.chunks
                and len(self.tensors) == len(self.expected_shapes) - 1)

    def close(self) -> List[torch.Tensor]:
        if self._header is not None:
            self._finish(stream_ended=True)
        return self.tensors

    def _finish(self, stream_ended: bool) -> None:
        announced, received = self._header.chunks, self._parts
        index = len(self.tensors)
        if received != announced:
            where = "the stream ended" if stream_ended else "the next tensor began"
            raise StateDownloadError(f"tensor {index} truncated: {where} after {received} of {announced} parts")
        message = self._header
        message.buffer, message.chunks = bytes(self._buffer), 0
        self._header, self._buffer = None, bytearray()
        try:
            check_tensor_message(message, self.expected_shapes[index], self.expected_dtypes[index])
            tensor = deserialize_torch_tensor(message)
        except MalformedTensor as e:
            raise StateDownloadError(f"tensor {index}: {e}") from None
        self.tensors.append(tensor)


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
        # in the host process: returns why to stop waiting for a download (None: go on); set by the host's owner
        self.stop_waiting: Optional[Callable[[], Optional[str]]] = None
        super().__init__(*args, **kwargs)  # may start the averager's process: set everything it reads before

    def load_state_from_peers(self, wait: bool = True, timeout: Optional[float] = None):
        """Download the state; `timeout` bounds each donor's silence (a stall), not the whole download, which may
        take long over a slow link. Raises StateDownloadError if donors exist but none sent a whole state, and
        StateDownloadStopped as soon as ``stop_waiting()`` gives a reason (checked every STOP_POLL_INTERVAL s)."""
        self._check_stop()
        future = MPFuture()
        self._outer_pipe.send(("_load_state_from_peers", [], dict(timeout=timeout, future=future)))
        if not wait:
            return future
        while True:
            try:
                return future.result(timeout=STOP_POLL_INTERVAL)
            except concurrent.futures.TimeoutError:
                self._check_stop()  # the averager's process finishes that attempt alone; nothing of it is loaded

    def _check_stop(self) -> None:
        reason = self.stop_waiting() if self.stop_waiting is not None else None
        if reason:
            raise StateDownloadStopped(f"state download abandoned: {reason}")

    def _expected_state(self) -> Tuple[List[torch.Size], List[torch.dtype]]:
        """Shapes and dtypes of the tensors a donor sends, from this peer's own state: a TrainingStateAverager's
        optimized parameters, extra tensors and optimizer statistics (hivemind's ``get_current_state``), else all
        averaged tensors."""
        optimizer = getattr(self, "optimizer", None)
        if optimizer is not None and getattr(self, "main_parameters", None) is not None:
            parameters = [param for group in optimizer.param_groups for param in group["params"]]
            statistics = [item for item in nested_flatten(optimizer.state_dict()) if isinstance(item, torch.Tensor)]
            tensors = [*parameters, *getattr(self, "extra_tensors", ()), *statistics]
        else:
            tensors = list(self._averaged_tensors)
        return [tensor.shape for tensor in tensors], [tensor.dtype for tensor in tensors]

    def _donor_priorities(self) -> Dict[PeerID, float]:
        """The state-sharing priority (usually the epoch) every peer that offers its state declared."""
        key = f"{self._matchmaking.group_key_manager.prefix}.all_averagers"
        found = self.dht.get(key, latest=True)
        priorities = found.value if found is not None and isinstance(found.value, dict) else {}
        donors = {}
        for peer_id, info in priorities.items():  # anyone may store here: keep the well-formed declarations only
            if not (isinstance(peer_id, bytes) and isinstance(info, ValueWithExpiration)
                    and isinstance(info.value, (float, int)) and math.isfinite(info.value)):
                continue  # an infinite priority would always come first
            try:
                donors[PeerID(peer_id)] = float(info.value)
            except Exception:
                continue
        return donors

    def _donors(self) -> List[PeerID]:
        ranked = {peer: (priority, random.random()) for peer, priority in self._donor_priorities().items()}
        return [peer for peer in sorted(ranked, key=ranked.get, reverse=True) if peer != self.peer_id]

    def _donors_not_kept_out(self) -> List[PeerID]:
        """:meth:`_donors` but the peers this peer keeps out of its groups (``excluded_peers`` of
        :class:`~lightning_swarm.hivemind_ext.result_verification.ReportMailbox`: their reduced slices failed the
        check, so their own state is suspect; CI saw an honest peer download a lying reducer's poisoned state after
        it had caught it)."""
        kept_out = getattr(self, "excluded_peers", {})
        donors = self._donors()
        skipped = [peer for peer in donors if peer in kept_out]
        if skipped:
            logger.info(f"Not downloading state from {len(skipped)} peer(s) kept out of this peer's groups: "
                        f"{[str(peer) for peer in skipped]}")
        return [peer for peer in donors if peer not in kept_out]

    async def _state_download_request(self):
        """What the request for a donor's state carries (state_serving.GuardedStateServing adds this peer's proof)."""
        return averaging_pb2.DownloadRequest()

    async def _download_from(self, peer: PeerID, chunk_timeout: float) -> Tuple[Any, List[torch.Tensor]]:
        stub = self.get_stub(self._p2p, peer, namespace=self.prefix)
        assembler = _TensorAssembler(*self._expected_state())
        metadata = None
        start = last_log = time.monotonic()
        stream = await asyncio.wait_for(stub.rpc_download_state(await self._state_download_request()), chunk_timeout)
        iterator = stream.__aiter__()
        try:
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
                    if metadata is not None or len(message.metadata) > MAX_METADATA_BYTES:
                        raise StateDownloadError(f"metadata of {len(message.metadata)} bytes (at most "
                                                 f"{MAX_METADATA_BYTES}, once)")
                    metadata = self.serializer.loads(message.metadata)
                assembler.add(message.tensor_part)
                if metadata is not None and assembler.last_part_in:
                    break  # all there: close the stream, which ends the donor's hold (stream_ends)
                now = time.monotonic()
                if now - last_log >= PROGRESS_LOG_INTERVAL:
                    last_log = now
                    logger.info(f"Downloading state from {peer}: {assembler.bytes / 1e6:.1f} MB, "
                                f"{len(assembler.tensors)} tensors done, "
                                f"{assembler.bytes / 1e6 / (now - start):.2f} MB/s")
        finally:
            await iterator.aclose()
        tensors = assembler.close()
        if not metadata:
            raise StateDownloadError("the donor sent no metadata (it refused to share its state)")
        expected = len(assembler.expected_shapes)
        if len(tensors) != expected:  # more are refused as they arrive
            raise StateDownloadError(f"received {len(tensors)} tensors, this peer's state has {expected}")
        elapsed = time.monotonic() - start
        logger.info(f"Downloaded state from {peer}: {assembler.bytes / 1e6:.1f} MB, {len(tensors)} tensors in "
                    f"{elapsed:.1f} s ({assembler.bytes / 1e6 / max(elapsed, 1e-9):.2f} MB/s)")
        return metadata, tensors

    async def _load_state_from_peers(self, future: MPFuture, timeout: Optional[float] = None):
        chunk_timeout = timeout if timeout is not None else DEFAULT_CHUNK_TIMEOUT
        errors = []
        try:
            for attempt in range(self.state_download_attempts):
                donors = self._donors_not_kept_out()
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
