"""Replace the decoders hivemind uses for incoming tensors of a compression type.

hivemind's proto has a closed enum of compression types, and ``deserialize_torch_tensor`` looks the decoder up by
the message's type name in the module-level ``_BASE_COMPRESSION_TYPES`` on every call: the registry is
process-wide, so a replacement affects every averager of the process (and of the processes it forks afterwards).
"""

from __future__ import annotations

from typing import Dict, Mapping

from hivemind.compression import CompressionBase
from hivemind.compression import serialization as hivemind_serialization
from hivemind.proto import runtime_pb2


def register_decoders(codecs: Mapping[str, CompressionBase]) -> Dict[str, CompressionBase]:
    """Make hivemind decode messages of each compression type (e.g. ``"BLOCKWISE_8BIT"``) with the given codec.

    Call it before the averagers start (they are forked processes that keep the registry they were started with).

    Args:
        codecs: compression type name -> codec; each codec's ``compression_type`` must be that type, so that it
            reads hivemind's messages of that type.

    Returns:
        the codecs that were registered before, by type name (to restore them).
    """
    registry = hivemind_serialization._BASE_COMPRESSION_TYPES
    for name, codec in codecs.items():
        if name not in registry:
            raise ValueError(f"{name!r} is not a hivemind compression type: one of {sorted(registry)}")
        if runtime_pb2.CompressionType.Name(codec.compression_type) != name:
            written = runtime_pb2.CompressionType.Name(codec.compression_type)
            raise ValueError(f"{type(codec).__name__} reads and writes {written} messages, not {name}")
    previous = {name: registry[name] for name in codecs}
    registry.update(codecs)
    return previous


def registered_decoder(name: str) -> CompressionBase:
    """The codec hivemind currently decodes messages of compression type ``name`` with."""
    return hivemind_serialization._BASE_COMPRESSION_TYPES[name]
