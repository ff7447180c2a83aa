"""Wire codecs for collaborative training: 8-bit for large tensors, 16-bit for small ones.

The default scheme (:func:`default_compression`) is the one the "Training Transformers Together" run used
for gradients and for averaged parameters/optimizer state: tensors with at least ``2**16`` elements go over
the wire as 8-bit codes, smaller ones as float16, and non-float tensors (step counters, 8-bit optimizer
state) as they are.

Why a codec of our own: hivemind 1.1.12's 8-bit codecs (``Uniform8BitQuantization``,
``BlockwiseQuantization``) compress fine but crash in ``extract`` under numpy >= 2.4 (``int()`` of a
one-element array is a TypeError there), so a swarm using them dies on the first received tensor.

:class:`Blockwise8BitQuantization` fixes that and quantizes better:

* Wire format: exactly hivemind's ``BLOCKWISE_8BIT`` message (``int64 n_absmax, int64 n_code,
  float32 absmax[n_absmax], float32 code[n_code], uint8 codes[numel]``, blocks of 4096 values). The
  codebook travels in every message, so a vanilla hivemind peer (with numpy < 2.4) decodes our messages
  correctly and we decode theirs.
* Codebook: per tensor part we try two 256-entry codebooks on a sample of blocks and keep the one with the
  lower squared error: a uniform grid with an exact zero (best for bell-shaped values, exact on sparse
  gradients such as embedding rows of unused tokens) and bitsandbytes' dynamic-exponent map (best for
  heavy tails). Blocks are scaled by their absolute maximum, so outliers are never clipped.
* Size: 1 byte per value + 4 bytes per 4096 values + 1040 bytes per message (codebook and header), i.e.
  at most 1.017 bytes per value for tensors of 2**16 values and more.

Routing: hivemind looks the decoder of every incoming tensor up by its compression type in a process-wide
registry (see :mod:`lightning_swarm.hivemind_ext.codecs`). :func:`register_fixed_codecs` puts our codec there for
``BLOCKWISE_8BIT`` (same wire format, working ``extract``) and numpy-2.4-safe subclasses of hivemind's codecs for
``UNIFORM_8BIT``/``QUANTILE_8BIT``, so the process decodes every 8-bit message; every decoder there, hivemind's
16-bit and uncompressed ones included, checks the message's header against its buffer before it reads or allocates
(:mod:`lightning_swarm.wire_checks`: a stranger chooses those bytes). Importing this module changes nothing; the registration happens when a :class:`SwarmCompression` is built (``default_compression()``), and
HivemindStrategy and the monitor call it before their averagers start, whatever codec they send with.
"""

from __future__ import annotations

from typing import Union

import numpy as np
import torch
from hivemind.compression import (
    CompressionBase,
    CompressionInfo,
    Float16Compression,
    NoCompression,
    Quantile8BitQuantization,
    ScaledFloat16Compression,
    SizeAdaptiveCompression,
    Uniform8BitQuantization,
)
from hivemind.compression.adaptive import AdaptiveCompressionBase
from hivemind.proto import runtime_pb2

from lightning_swarm.aggregation import all_finite
from lightning_swarm.hivemind_ext.codecs import register_decoders
from lightning_swarm.wire_checks import MalformedTensor, dynamic_code, message_layout, uniform_code

# hivemind's BLOCKWISE_8BIT decoder hard-codes this block size; keeping it makes messages interoperable
BLOCKSIZE = 4096
# float tensors with at least this many elements are sent as 8-bit codes by default
DEFAULT_THRESHOLD = 2**16
# number of blocks on which candidate codebooks are compared (a strided sample keeps the choice cheap: hivemind's
# all-reduce compresses parts of 2**17 values, 32 blocks, and a trial on 16 of them cost 60% of compress())
_CODEBOOK_TRIAL_BLOCKS = 4


def _read_int64(buffer: bytes, offset: int) -> int:
    # np.frombuffer(...)[0] rather than int(array): int() of a 1-element array is a TypeError in numpy >= 2.4
    return int(np.frombuffer(buffer, count=1, offset=offset, dtype=np.int64)[0])


_UNIFORM_CODE = uniform_code()


def quantize_uniform_blockwise(flat: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Blockwise absmax quantization of a flat float32 tensor to the indices of :func:`uniform_code`.

    The same codes bitsandbytes' ``quantize_blockwise(flat, code=uniform_code(), blocksize=BLOCKSIZE)`` gives
    (the nearest level; exact ties may round the other way), computed arithmetically as
    ``round(x / absmax * 127) + 127`` instead of by searching the codebook for every value: 5-6x faster on one CPU
    thread, and averaging rounds compress every gradient and parameter.

    Returns (uint8 codes [numel], float32 absmax [number of blocks]). An all-zero block gets absmax 0 and the code
    of level 0 (127).
    """
    numel = flat.numel()
    num_full = numel // BLOCKSIZE
    codes = torch.empty(numel, dtype=torch.uint8)
    absmaxes = []
    # full blocks as a view (no copy), then the partial last block
    for start, blocks in ((0, flat[: num_full * BLOCKSIZE].view(num_full, BLOCKSIZE)),
                          (num_full * BLOCKSIZE, flat[num_full * BLOCKSIZE :].view(1, -1))):
        if blocks.numel() == 0:
            continue
        absmax = blocks.abs().amax(dim=1)
        scale = torch.where(absmax > 0, 127 / absmax, torch.zeros_like(absmax))
        codes[start : start + blocks.numel()] = blocks.mul(scale[:, None]).round_().add_(127).view(-1)
        absmaxes.append(absmax)
    return codes, torch.cat(absmaxes)


def dequantize_uniform_blockwise(codes: torch.Tensor, absmax: torch.Tensor) -> torch.Tensor:
    """The values of :func:`quantize_uniform_blockwise`'s codes: ``(code - 127) / 127 * absmax`` of their block."""
    values = (codes.to(torch.float32) - 127) / 127
    num_full = codes.numel() // BLOCKSIZE
    values[: num_full * BLOCKSIZE].view(num_full, BLOCKSIZE).mul_(absmax[:num_full, None])
    if codes.numel() > num_full * BLOCKSIZE:
        values[num_full * BLOCKSIZE:].mul_(absmax[num_full])
    return values


class Blockwise8BitQuantization(CompressionBase):
    """Blockwise absmax 8-bit quantization in hivemind's ``BLOCKWISE_8BIT`` wire format, numpy-2.4 safe.

    Each block of 4096 values is scaled by its absolute maximum into [-1, 1] and each value is replaced by the
    index of the nearest of 256 codebook levels (bitsandbytes' native CPU kernels). A NaN or Inf value is sent
    as 0, so that it does not spread to the other values of its block. The codebook is chosen per
    message among :func:`uniform_code` and :func:`dynamic_code` by trial on a sample of blocks.

    Args:
        codebooks: candidate codebooks (each 256 sorted float32 levels within [-1, 1]); ``None`` means
            ``(uniform_code(), dynamic_code())``. Pass a single codebook to disable the trial.
    """

    compression_type = runtime_pb2.CompressionType.BLOCKWISE_8BIT

    def __init__(self, codebooks: tuple[torch.Tensor, ...] | None = None):
        self.codebooks = tuple(codebooks) if codebooks is not None else (_UNIFORM_CODE, dynamic_code())
        for code in self.codebooks:
            if code.numel() != 256 or not bool((code.diff() >= 0).all()):
                raise ValueError("each codebook must hold 256 levels sorted in ascending order")

    def choose_codebook(self, flat: torch.Tensor) -> torch.Tensor:
        """Return the candidate codebook with the lowest squared error on a strided sample of blocks."""
        from bitsandbytes.functional import dequantize_blockwise, quantize_blockwise

        if len(self.codebooks) == 1:
            return self.codebooks[0]
        num_blocks = flat.numel() // BLOCKSIZE
        if num_blocks > _CODEBOOK_TRIAL_BLOCKS:
            stride = num_blocks // _CODEBOOK_TRIAL_BLOCKS
            sample = flat[: num_blocks * BLOCKSIZE].view(num_blocks, BLOCKSIZE)[::stride][:_CODEBOOK_TRIAL_BLOCKS]
            sample = sample.reshape(-1)
        else:
            sample = flat
        errors = []
        for code in self.codebooks:
            if torch.equal(code, _UNIFORM_CODE):  # the arithmetic path: the codes compress() would send
                codes, absmax = quantize_uniform_blockwise(sample)
                restored = dequantize_uniform_blockwise(codes, absmax)
            else:
                quantized, state = quantize_blockwise(sample, code=code, blocksize=BLOCKSIZE)
                restored = dequantize_blockwise(quantized, state)
            errors.append(float((restored - sample).square().sum()))
        return self.codebooks[int(np.argmin(errors))]

    def compress(self, tensor: torch.Tensor, info: CompressionInfo, allow_inplace: bool = False) -> runtime_pb2.Tensor:
        from bitsandbytes.functional import quantize_blockwise

        if not torch.is_floating_point(tensor):
            raise ValueError(f"{self.__class__.__name__} compresses floating point tensors, got {tensor.dtype}")
        requires_grad = tensor.requires_grad
        dtype_name = str(tensor.dtype).replace("torch.", "")
        flat = tensor.detach().reshape(-1).to(torch.float32).contiguous()
        if not all_finite(flat):
            # a NaN/Inf would become its block's absmax and turn all 4096 values of the block into NaN: send it as 0
            flat = torch.nan_to_num(flat, nan=0.0, posinf=0.0, neginf=0.0)
        code = self.choose_codebook(flat)
        if torch.equal(code, _UNIFORM_CODE):
            quantized, absmax = quantize_uniform_blockwise(flat)
        else:
            quantized, state = quantize_blockwise(flat, code=code, blocksize=BLOCKSIZE)
            absmax = state.absmax
        absmax = absmax.numpy().astype(np.float32, copy=False)
        buffer = b"".join(
            (
                np.int64(len(absmax)).tobytes(),
                np.int64(len(code)).tobytes(),
                absmax.tobytes(),
                code.numpy().astype(np.float32, copy=False).tobytes(),
                quantized.numpy().tobytes(),
            )
        )
        return runtime_pb2.Tensor(
            compression=self.compression_type,
            buffer=buffer,
            size=tensor.shape,
            dtype=dtype_name,
            requires_grad=requires_grad,
        )

    def extract(self, serialized_tensor: runtime_pb2.Tensor) -> torch.Tensor:
        from bitsandbytes.functional import dequantize_blockwise

        # bitsandbytes' kernel trusts the sizes it is given: check the header against the buffer first
        shape, dtype = message_layout(serialized_tensor)
        buffer = serialized_tensor.buffer
        absmax_size, code_size = _read_int64(buffer, 0), _read_int64(buffer, 8)
        if absmax_size == 0:  # an empty tensor: nothing for the kernel to do
            return torch.empty(shape, dtype=dtype).requires_grad_(serialized_tensor.requires_grad)
        absmax = np.frombuffer(buffer, offset=16, count=absmax_size, dtype=np.float32)
        code = np.frombuffer(buffer, offset=16 + absmax.nbytes, count=code_size, dtype=np.float32)
        quantized = np.frombuffer(buffer, offset=16 + absmax.nbytes + code.nbytes, dtype=np.uint8)
        restored = dequantize_blockwise(
            torch.as_tensor(quantized),
            absmax=torch.as_tensor(absmax),
            code=torch.as_tensor(code),
            blocksize=BLOCKSIZE,
        )
        return _as_announced(restored.reshape(shape).to(dtype), shape, dtype, serialized_tensor.requires_grad)

    def estimate_compression_ratio(self, info: CompressionInfo) -> float:
        return 8 / torch.finfo(info.descriptor.dtype).bits


def _as_announced(tensor: torch.Tensor, shape: tuple, dtype: torch.dtype, requires_grad: bool) -> torch.Tensor:
    """The decoded tensor, if it has the shape and dtype its (checked) header announced."""
    if tuple(tensor.shape) != tuple(shape) or tensor.dtype != dtype:
        raise MalformedTensor(f"decoded {list(tensor.shape)} {tensor.dtype}, announced {list(shape)} {dtype}")
    return tensor.requires_grad_(requires_grad)


def _extract_codebook_message(serialized_tensor: runtime_pb2.Tensor) -> torch.Tensor:
    """numpy-2.4-safe, checked decoder of hivemind's ``Quantization`` layout (int64 n_code, float32 code, uint8 idx)."""
    shape, dtype = message_layout(serialized_tensor)  # codebook size in range, every index within it
    buffer = serialized_tensor.buffer
    code_size = _read_int64(buffer, 0)
    codebook = np.frombuffer(buffer, offset=8, count=code_size, dtype=np.float32)
    quantized = np.frombuffer(buffer, offset=8 + codebook.nbytes, dtype=np.uint8)
    quantized = torch.as_tensor(quantized, dtype=torch.int64).reshape(shape)
    codebook = torch.as_tensor(codebook).to(dtype=dtype)
    return _as_announced(codebook[quantized], shape, dtype, serialized_tensor.requires_grad)


class CheckedNoCompression(NoCompression):
    """hivemind's ``NoCompression`` (same messages) whose decoder checks dtype and length first."""

    def extract(self, serialized_tensor: runtime_pb2.Tensor) -> torch.Tensor:
        shape, dtype = message_layout(serialized_tensor)
        return _as_announced(super().extract(serialized_tensor), shape, dtype, serialized_tensor.requires_grad)


class CheckedFloat16Compression(Float16Compression):
    """hivemind's ``Float16Compression`` (same messages) whose decoder checks dtype and length first."""

    def extract(self, serialized_tensor: runtime_pb2.Tensor) -> torch.Tensor:
        shape, dtype = message_layout(serialized_tensor)
        return _as_announced(super().extract(serialized_tensor), shape, dtype, serialized_tensor.requires_grad)


class CheckedScaledFloat16Compression(ScaledFloat16Compression):
    """hivemind's ``ScaledFloat16Compression`` (same messages) whose decoder checks dtype and length first."""

    def extract(self, serialized_tensor: runtime_pb2.Tensor) -> torch.Tensor:
        shape, dtype = message_layout(serialized_tensor)
        return _as_announced(super().extract(serialized_tensor), shape, dtype, serialized_tensor.requires_grad)


class Uniform8BitQuantizationFixed(Uniform8BitQuantization):
    """hivemind's ``Uniform8BitQuantization`` (same messages) with a decoder that works under numpy >= 2.4."""

    def extract(self, serialized_tensor: runtime_pb2.Tensor) -> torch.Tensor:
        return _extract_codebook_message(serialized_tensor)


class Quantile8BitQuantizationFixed(Quantile8BitQuantization):
    """hivemind's ``Quantile8BitQuantization`` (same messages) with a decoder that works under numpy >= 2.4."""

    def extract(self, serialized_tensor: runtime_pb2.Tensor) -> torch.Tensor:
        return _extract_codebook_message(serialized_tensor)


class SwarmCompression(AdaptiveCompressionBase):
    """Size-adaptive compression that is safe for every dtype found in a training state.

    Float tensors go through hivemind's ``SizeAdaptiveCompression(threshold, less=Float16Compression(),
    greater_equal=Blockwise8BitQuantization())``. Non-float tensors (step counters, uint8 optimizer state)
    are sent as they are, and so are small bfloat16 tensors, which hivemind's float16 codec rejects.

    Args:
        threshold: float tensors with this many elements or more are quantized to 8 bits.
    """

    def __init__(self, threshold: int = DEFAULT_THRESHOLD):
        if threshold < 1:
            raise ValueError(f"threshold must be a positive number of elements, got {threshold}")
        self.threshold = threshold
        register_fixed_codecs()  # peers that send 8-bit messages receive them too
        self.size_adaptive = SizeAdaptiveCompression(
            threshold, less=Float16Compression(), greater_equal=Blockwise8BitQuantization()
        )
        self.passthrough = NoCompression()

    def choose_compression(self, info: CompressionInfo) -> CompressionBase:
        dtype, numel = info.descriptor.dtype, info.descriptor.numel()
        if not dtype.is_floating_point or (dtype == torch.bfloat16 and numel < self.threshold):
            return self.passthrough
        return self.size_adaptive.choose_compression(info)


def default_compression(threshold: int = DEFAULT_THRESHOLD) -> CompressionBase:
    """The seed run's scheme: 8-bit codes for float tensors with at least ``threshold`` elements, float16 for
    smaller float tensors, other dtypes as they are. Use it for gradients and averaged state. For a newcomer's
    one-time state download, ``default_compression(threshold=2**62)`` (float16 for every float tensor) or
    hivemind's ``NoCompression()`` avoid handing it 8-bit-rounded parameters.

    Args:
        threshold: tensors with this many elements or more are quantized to 8 bits.
    """
    return SwarmCompression(threshold)


def register_fixed_codecs() -> None:
    """Make hivemind decode every message with checked codecs (numpy-2.4-safe for 8-bit ones; each checks the
    header against the buffer before decoding, :func:`lightning_swarm.wire_checks.message_layout`), in this process
    and the averager processes it starts afterwards. Idempotent. See the module docstring for why."""
    global _FIXED_CODECS_REGISTERED
    if _FIXED_CODECS_REGISTERED:
        return
    register_decoders({
        "BLOCKWISE_8BIT": Blockwise8BitQuantization(),
        "UNIFORM_8BIT": Uniform8BitQuantizationFixed(),
        "QUANTILE_8BIT": Quantile8BitQuantizationFixed(),
        "NONE": CheckedNoCompression(),
        "FLOAT16": CheckedFloat16Compression(),
        "MEANSTD_16BIT": CheckedScaledFloat16Compression(),
    })
    _FIXED_CODECS_REGISTERED = True


_FIXED_CODECS_REGISTERED = False


COMPRESSION_CHOICES = ("adaptive", "fp16", "none")


def resolve_compression(compression: Union[str, CompressionBase]) -> CompressionBase:
    """'adaptive' (8-bit for large tensors, fp16 otherwise), 'fp16', 'none', or a hivemind CompressionBase."""
    if isinstance(compression, CompressionBase):
        return compression
    if compression == "none":
        return NoCompression()
    if compression == "fp16":
        return Float16Compression()
    if compression == "adaptive":
        return default_compression()
    raise ValueError(f"compression must be one of {COMPRESSION_CHOICES} or a hivemind CompressionBase, got {compression!r}")
