"""The state a newcomer downloads: a tensor is accepted only whole and with this peer's shape (hivemind's own
streaming format: serialize_torch_tensor + split_for_streaming, as a donor sends it)."""

from __future__ import annotations

import pytest
import torch
from hivemind.compression import serialize_torch_tensor
from hivemind.proto import runtime_pb2
from hivemind.utils.streaming import split_for_streaming

from lightning_swarm.hivemind_ext.state_download import StateDownloadError, _TensorAssembler


def _parts(tensor: torch.Tensor) -> list:
    return list(split_for_streaming(serialize_torch_tensor(tensor, runtime_pb2.CompressionType.NONE)))


def test_whole_tensors_are_assembled_in_order():
    first, second = torch.randn(300, 192), torch.randn(7)
    assembler = _TensorAssembler([first.shape, second.shape])
    for part in _parts(first) + _parts(second):
        assembler.add(part)
    received = assembler.close()
    assert len(_parts(first)) > 1  # really streamed in several parts
    assert torch.equal(received[0], first) and torch.equal(received[1], second)


@pytest.mark.parametrize("where", ["end", "next"])
def test_a_truncated_tensor_is_refused_not_reshaped(where):
    # issue 16: the stream ended (or the next tensor began) after ~75% of the text embedding
    embedding = torch.randn(400, 192)
    parts = _parts(embedding)
    kept = parts[: len(parts) * 3 // 4]
    assembler = _TensorAssembler([embedding.shape, torch.Size([5])])
    for part in kept:
        assembler.add(part)
    with pytest.raises(StateDownloadError, match=f"tensor 0 truncated: .* {len(kept)} of {len(parts)} parts"):
        if where == "end":
            assembler.close()
        else:
            for part in _parts(torch.randn(5)):
                assembler.add(part)
    assert assembler.tensors == []


def test_a_tensor_of_another_shape_is_refused_at_its_first_part():
    assembler = _TensorAssembler([torch.Size([10, 4])])
    with pytest.raises(StateDownloadError, match=r"shape \[4, 10\] where this peer's tensor has \[10, 4\]"):
        assembler.add(_parts(torch.randn(4, 10))[0])


def test_a_part_without_its_tensor_start_is_refused():
    parts = _parts(torch.randn(400, 192))
    with pytest.raises(StateDownloadError, match="before the tensor's first part"):
        _TensorAssembler([]).add(parts[1])


# ---------------------------------------------------------------- issue 24, finding 7: what a donor announces


class _PeakBuffer(_TensorAssembler):
    """The assembler, recording the most bytes it held for one tensor."""

    peak = 0

    def add(self, part) -> None:
        try:
            super().add(part)
        finally:
            self.peak = max(self.peak, len(self._buffer))


def test_a_16_byte_parameter_never_buffers_more_than_16_bytes():
    """The issue's attack: a donor streams 64 MiB for a parameter of 4 float32 values."""
    header = runtime_pb2.Tensor(compression=runtime_pb2.NONE, size=[4], dtype="float32", chunks=1024,
                                buffer=b"\x00" * 2**16)
    assembler = _PeakBuffer([torch.Size([4])])
    with pytest.raises(StateDownloadError, match="more than the 16 bytes"):
        assembler.add(header)
        for _ in range(1023):
            assembler.add(runtime_pb2.Tensor(buffer=b"\x00" * 2**16))
    assert assembler.peak <= 16 and assembler.bytes == 2**16  # refused at the first part


@pytest.mark.parametrize("header, reason", [
    (dict(size=[2**24], dtype="float32"), r"shape \[16777216\] where this peer's tensor has \[4\]"),
    (dict(size=[4], dtype="float64"), "dtype float64 does not fit"),
    (dict(size=[4], dtype="torch.nn.Module"), "dtype 'torch.nn.Module' is not one of"),
    (dict(size=[4], dtype="float32", compression=99), "unknown compression type 99"),
    (dict(size=[4], dtype="float32", chunks=0), "announced 0 parts"),
])
def test_a_header_that_does_not_fit_the_local_tensor_is_refused_before_buffering(header, reason):
    fields = dict(compression=runtime_pb2.NONE, chunks=1, buffer=b"\x00" * 16)
    fields.update(header)
    assembler = _PeakBuffer([torch.Size([4])], [torch.float32])
    with pytest.raises(StateDownloadError, match=reason):
        assembler.add(runtime_pb2.Tensor(**fields))
    assert assembler.peak == 0


def test_more_tensors_than_the_local_state_are_refused():
    assembler = _TensorAssembler([torch.Size([3])])
    for part in _parts(torch.randn(3)):
        assembler.add(part)
    with pytest.raises(StateDownloadError, match="this peer's state has 1 tensors"):
        assembler.add(_parts(torch.randn(3))[0])


def test_a_blockwise_tensor_whose_header_lies_is_refused_before_decoding():
    # finding 1's crash, as a state tensor: 0 absmax values and a 0-entry codebook before 4096 codes
    message = runtime_pb2.Tensor(compression=runtime_pb2.BLOCKWISE_8BIT, size=[4096], dtype="float32",
                                 buffer=b"\x00" * 16 + b"\x01" * 4096)
    assembler = _TensorAssembler([torch.Size([4096])])
    with pytest.raises(StateDownloadError, match="0 absmax values for 4096 values"):
        for part in split_for_streaming(message, chunk_size_bytes=1024):
            assembler.add(part)
        assembler.close()


@pytest.mark.parametrize("compression", ["NONE", "FLOAT16", "BLOCKWISE_8BIT", "UNIFORM_8BIT", "MEANSTD_16BIT"])
def test_honest_states_of_every_codec_still_arrive(compression):
    from lightning_swarm.compression import register_fixed_codecs

    register_fixed_codecs()
    tensors = [torch.randn(300, 192), torch.randn(7), torch.arange(5, dtype=torch.int64)]
    assembler = _TensorAssembler([t.shape for t in tensors], [t.dtype for t in tensors])
    for tensor in tensors:
        kind = compression if tensor.is_floating_point() else "NONE"
        for part in split_for_streaming(serialize_torch_tensor(tensor, getattr(runtime_pb2, kind))):
            assembler.add(part)
    received = assembler.close()
    for tensor, got in zip(tensors, received):
        assert got.shape == tensor.shape and got.dtype == tensor.dtype
        if compression == "NONE" or not tensor.is_floating_point():
            assert torch.equal(got, tensor)
        else:  # lossy codecs (hivemind's uniform 8-bit clips outliers): close on average
            assert float((got - tensor).abs().mean()) <= 0.05 * float(tensor.abs().mean())


def test_peers_kept_out_of_this_peers_groups_are_not_donors():
    """A peer whose reduced slice failed the check (kept out of this peer's groups) is not downloaded from: its own
    state is suspect (CI saw an honest peer take a lying reducer's poisoned state after it had caught it). The others
    keep their order; with every donor kept out there is nothing to download."""
    from types import SimpleNamespace

    from hivemind.p2p import PeerID

    from lightning_swarm.hivemind_ext.state_download import VerifiedStateDownload

    honest, liar, other = (PeerID(bytes([i]) * 34) for i in (1, 2, 3))
    averager = SimpleNamespace(_donors=lambda: [liar, honest, other], excluded_peers={liar: "its slice failed"})
    assert VerifiedStateDownload._donors_not_kept_out(averager) == [honest, other]
    averager.excluded_peers = {liar: "x", honest: "y", other: "z"}
    assert VerifiedStateDownload._donors_not_kept_out(averager) == []
    assert VerifiedStateDownload._donors_not_kept_out(SimpleNamespace(_donors=lambda: [honest])) == [honest]
