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
