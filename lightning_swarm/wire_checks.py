"""What a received tensor message must be before a byte of it is decoded.

Every tensor a peer receives (a gradient or state part, a reducer's result, a state-download tensor) is a hivemind
``runtime_pb2.Tensor``: a compression type, a dtype name, a shape and a buffer, all chosen by the sender. A decoder
that trusts them reads out of bounds (bitsandbytes' CPU dequantize kernel crashed the process on a message that
announced 0 absmax values, issue 24), allocates what the sender announced, or names a torch attribute from the dtype
string. So, before decoding:

- :func:`message_layout` checks the message alone: the dtype is one of :data:`WIRE_DTYPES`, the shape has at most
  :data:`MAX_DIMS` dimensions, and the buffer has exactly the length its compression type's layout gives for that
  shape and dtype (with the counts in its header in range: e.g. a ``BLOCKWISE_8BIT`` message has one absmax per 4096
  values and a 256-entry codebook). Every codec this package registers calls it first
  (:func:`lightning_swarm.compression.register_fixed_codecs`).
- :func:`check_tensor_message` also checks the message against the local tensor it fills: the same shape and a
  dtype no wider (see :func:`dtype_fits`), so that what decoding allocates is never larger than that tensor (a
  16-bit local tensor may receive float32: hivemind's reducers return float32 results).

Both raise :class:`MalformedTensor` (a ValueError) with the reason; nothing is allocated before they pass, beyond
reading the header.
"""

from __future__ import annotations

from typing import Dict, Optional, Sequence, Tuple

import numpy as np
import torch
from hivemind.proto import runtime_pb2

# the dtype names a message may carry (hivemind writes str(tensor.dtype) without "torch.")
WIRE_DTYPES: Dict[str, torch.dtype] = {
    name: getattr(torch, name)
    for name in ("float16", "bfloat16", "float32", "float64", "uint8", "int8", "int16", "int32", "int64", "bool")
}
FLOAT_DTYPES = frozenset(("float16", "bfloat16", "float32", "float64"))
# numpy decodes these (hivemind's FLOAT16 and MEANSTD_16BIT codecs convert through numpy, which has no bfloat16)
NUMPY_FLOAT_DTYPES = frozenset(("float16", "float32", "float64"))
MAX_DIMS = 16  # more than any parameter or part has (parts are 1-D)
BLOCKWISE_BLOCKSIZE = 4096  # hivemind's BLOCKWISE_8BIT block size
CODEBOOK_SIZE = 256  # 8-bit codes index 256 levels
_INT64 = 8
_FLOAT32 = 4


class MalformedTensor(ValueError):
    """A received tensor message that does not match its own header or the local tensor it should fill."""


def compression_name(message: runtime_pb2.Tensor) -> str:
    """The message's compression type name (``"NONE"``, ``"BLOCKWISE_8BIT"``, ...); MalformedTensor if unknown."""
    try:
        return runtime_pb2.CompressionType.Name(message.compression)
    except ValueError:
        raise MalformedTensor(f"unknown compression type {message.compression}") from None


def message_dtype(message: runtime_pb2.Tensor) -> torch.dtype:
    """The torch dtype the message names, if it is one of :data:`WIRE_DTYPES`."""
    dtype = WIRE_DTYPES.get(message.dtype)
    if dtype is None:
        raise MalformedTensor(f"dtype {message.dtype[:32]!r} is not one of {sorted(WIRE_DTYPES)}")
    return dtype


def message_shape(message: runtime_pb2.Tensor) -> Tuple[int, ...]:
    """The shape the message announces (at most :data:`MAX_DIMS` dimensions)."""
    if len(message.size) > MAX_DIMS:
        raise MalformedTensor(f"{len(message.size)} dimensions, at most {MAX_DIMS} accepted")
    return tuple(int(dim) for dim in message.size)


def _numel(shape: Sequence[int]) -> int:
    numel = 1
    for dim in shape:
        numel *= dim  # Python ints: no overflow
    return numel


def _header_int64(buffer: bytes, offset: int) -> int:
    if len(buffer) < offset + _INT64:
        raise MalformedTensor(f"{len(buffer)} bytes: too short for its header")
    return int(np.frombuffer(buffer, dtype=np.int64, count=1, offset=offset)[0])


def _expect_length(buffer: bytes, expected: int, what: str) -> None:
    if len(buffer) != expected:
        raise MalformedTensor(f"{len(buffer)} bytes where {what} take {expected}")


def _layout_none(message, shape, numel, dtype_name) -> None:
    itemsize = WIRE_DTYPES[dtype_name].itemsize
    if dtype_name == "bfloat16" and numel > 0 and len(message.buffer) == 4 * numel:
        return  # hivemind's legacy bfloat16 layout: sent as float32
    _expect_length(message.buffer, numel * itemsize, f"{numel} {dtype_name} values")


def _layout_float16(message, shape, numel, dtype_name) -> None:
    if dtype_name not in NUMPY_FLOAT_DTYPES:
        raise MalformedTensor(f"FLOAT16 messages restore {sorted(NUMPY_FLOAT_DTYPES)}, not {dtype_name}")
    _expect_length(message.buffer, 2 * numel, f"{numel} float16 values")


def _layout_meanstd16(message, shape, numel, dtype_name) -> None:
    if dtype_name not in NUMPY_FLOAT_DTYPES:
        raise MalformedTensor(f"MEANSTD_16BIT messages restore {sorted(NUMPY_FLOAT_DTYPES)}, not {dtype_name}")
    if not shape or numel == 0:
        raise MalformedTensor("a MEANSTD_16BIT message needs at least one dimension and one value")
    stats = numel // shape[-1]  # one mean and one std per row of the last dimension
    _expect_length(message.buffer, 2 * numel + 2 * _FLOAT32 * stats, f"{numel} float16 values and {stats} mean/std pairs")


def _layout_codebook8(message, shape, numel, dtype_name) -> None:
    if dtype_name not in FLOAT_DTYPES:
        raise MalformedTensor(f"8-bit messages restore float dtypes, not {dtype_name}")
    code_size = _header_int64(message.buffer, 0)
    if not 1 <= code_size <= CODEBOOK_SIZE:
        raise MalformedTensor(f"a codebook of {code_size} entries (1 to {CODEBOOK_SIZE} accepted)")
    _expect_length(message.buffer, _INT64 + _FLOAT32 * code_size + numel,
                   f"a {code_size}-entry codebook and {numel} codes")
    if code_size < CODEBOOK_SIZE and numel:
        codes = np.frombuffer(message.buffer, dtype=np.uint8, offset=_INT64 + _FLOAT32 * code_size)
        if int(codes.max()) >= code_size:
            raise MalformedTensor(f"a code indexes past the {code_size}-entry codebook")


def _layout_blockwise8(message, shape, numel, dtype_name) -> None:
    if dtype_name not in FLOAT_DTYPES:
        raise MalformedTensor(f"8-bit messages restore float dtypes, not {dtype_name}")
    absmax_size, code_size = _header_int64(message.buffer, 0), _header_int64(message.buffer, _INT64)
    blocks = -(-numel // BLOCKWISE_BLOCKSIZE)
    if absmax_size != blocks:
        raise MalformedTensor(f"{absmax_size} absmax values for {numel} values ({blocks} blocks of "
                              f"{BLOCKWISE_BLOCKSIZE})")
    if code_size != CODEBOOK_SIZE:
        raise MalformedTensor(f"a codebook of {code_size} entries, not {CODEBOOK_SIZE}")
    _expect_length(message.buffer, 2 * _INT64 + _FLOAT32 * (blocks + CODEBOOK_SIZE) + numel,
                   f"{blocks} absmax values, a {CODEBOOK_SIZE}-entry codebook and {numel} codes")


_LAYOUTS = {
    "NONE": _layout_none,
    "FLOAT16": _layout_float16,
    "MEANSTD_16BIT": _layout_meanstd16,
    "UNIFORM_8BIT": _layout_codebook8,
    "QUANTILE_8BIT": _layout_codebook8,
    "BLOCKWISE_8BIT": _layout_blockwise8,
}


def message_layout(message: runtime_pb2.Tensor) -> Tuple[Tuple[int, ...], torch.dtype]:
    """Check a whole (not streamed) tensor message against its own header; returns (shape, dtype).

    Raises:
        MalformedTensor: unknown compression type or dtype, too many dimensions, a header count out of range, a
            buffer of another length than the layout gives, ``requires_grad`` on a non-float dtype.
    """
    name = compression_name(message)
    dtype, shape = message_dtype(message), message_shape(message)
    if message.requires_grad and not dtype.is_floating_point:
        raise MalformedTensor(f"requires_grad on a {message.dtype} tensor")
    if name not in _LAYOUTS:
        raise MalformedTensor(f"compression type {name} is not decoded here")
    _LAYOUTS[name](message, shape, _numel(shape), message.dtype)
    return shape, dtype


def dtype_fits(wire: torch.dtype, local: torch.dtype) -> bool:
    """Whether a received tensor of dtype ``wire`` may fill a local tensor of dtype ``local``: the same dtype, or both
    floating point with ``wire`` no wider than ``local`` (float32 is accepted for 16-bit local tensors: hivemind's
    reducers compute and return float32)."""
    if wire == local:
        return True
    return (wire.is_floating_point and local.is_floating_point
            and wire.itemsize <= max(local.itemsize, torch.float32.itemsize))


def check_tensor_header(message: runtime_pb2.Tensor, expected_shape: Optional[Sequence[int]] = None,
                        expected_dtype: Optional[torch.dtype] = None) -> Tuple[Tuple[int, ...], torch.dtype]:
    """Check what a message's header announces (compression type, dtype, shape, ``requires_grad``) against the
    local tensor it fills, without reading its buffer (a streamed tensor's first part carries the header).

    Args:
        message: the received message or the first part of a streamed one.
        expected_shape: the local tensor's shape (None: any shape).
        expected_dtype: the local tensor's dtype (None: any of :data:`WIRE_DTYPES`), see :func:`dtype_fits`.

    Returns:
        the message's (shape, dtype).

    Raises:
        MalformedTensor: with the reason.
    """
    name = compression_name(message)
    if name not in _LAYOUTS:
        raise MalformedTensor(f"compression type {name} is not decoded here")
    shape, dtype = message_shape(message), message_dtype(message)
    if expected_shape is not None and shape != tuple(expected_shape):
        raise MalformedTensor(f"shape {list(shape)} where this peer's tensor has {list(expected_shape)}")
    if expected_dtype is not None and not dtype_fits(dtype, expected_dtype):
        raise MalformedTensor(f"dtype {message.dtype} does not fit this peer's {expected_dtype}")
    if message.requires_grad and not dtype.is_floating_point:
        raise MalformedTensor(f"requires_grad on a {message.dtype} tensor")
    return shape, dtype


def check_tensor_message(message: runtime_pb2.Tensor, expected_shape: Optional[Sequence[int]] = None,
                         expected_dtype: Optional[torch.dtype] = None) -> Tuple[Tuple[int, ...], torch.dtype]:
    """Check a whole tensor message against the local tensor it fills (:func:`check_tensor_header`) and against its
    own header (:func:`message_layout`); same arguments and result as :func:`check_tensor_header`."""
    check_tensor_header(message, expected_shape, expected_dtype)
    return message_layout(message)


def max_buffer_length(compression: str, shape: Sequence[int], dtype_name: str) -> int:
    """The longest buffer a well-formed message of this compression type, shape and dtype has (a state download
    stops buffering a tensor's parts past it). MalformedTensor for an unknown compression type or dtype."""
    if compression not in _LAYOUTS:
        raise MalformedTensor(f"compression type {compression} is not decoded here")
    if dtype_name not in WIRE_DTYPES:
        raise MalformedTensor(f"dtype {dtype_name[:32]!r} is not one of {sorted(WIRE_DTYPES)}")
    numel = _numel(shape)
    if compression == "NONE":
        return numel * (4 if dtype_name == "bfloat16" else WIRE_DTYPES[dtype_name].itemsize)
    if compression == "FLOAT16":
        return 2 * numel
    if compression == "MEANSTD_16BIT":
        return 2 * numel + 2 * _FLOAT32 * (numel // shape[-1] if shape and numel else 0)
    if compression == "BLOCKWISE_8BIT":
        return 2 * _INT64 + _FLOAT32 * (-(-numel // BLOCKWISE_BLOCKSIZE) + CODEBOOK_SIZE) + numel
    return _INT64 + _FLOAT32 * CODEBOOK_SIZE + numel  # UNIFORM_8BIT, QUANTILE_8BIT


def uniform_code() -> torch.Tensor:
    """256 sorted levels ``k / 127`` for k in [-127, 128]: uniform on [-1, 1] with an exact zero (the top one
    is never used, as values are scaled into [-1, 1])."""
    return torch.arange(-127, 129, dtype=torch.float32) / 127


def dynamic_code() -> torch.Tensor:
    """bitsandbytes' signed dynamic-exponent map: fine steps near zero, coarse near +-1 (heavy tails)."""
    from bitsandbytes.functional import create_dynamic_map

    return create_dynamic_map(signed=True).float()
