"""Fuzzers of every parser of received bytes on the averaging path (issue 24, item 2).

Targets: one per registered codec (``NONE``, ``FLOAT16``, ``MEANSTD_16BIT``, ``UNIFORM_8BIT``, ``QUANTILE_8BIT``,
``BLOCKWISE_8BIT``: hivemind's ``deserialize_torch_tensor`` with :func:`lightning_swarm.compression.register_fixed_codecs`
installed), ``reducer_parts`` (a sender's part or a reducer's result: :func:`checked_part_messages`, then hivemind's
decoding, as the all-reduce runs them), ``state_download`` (the assembly of a streamed state) and
``progress_records`` (DHT progress records) and ``reducer_reports`` (a reducer's result header and the members'
verification messages, issue 24 item 9).

Each target mutates honest messages (truncated, extended, header counts 0 / -1 / huge, shape and dtype changed,
compression type swapped, bytes flipped, random buffers, several at once) and checks each outcome against an oracle
written from the wire format's spec (:func:`spec_well_formed`): a message that is not well-formed (or does not fit
the local tensor) must be refused, a well-formed one must decode to the shape and dtype it announced, and nothing
decoded may take more memory than its buffer (codecs) or the local tensor it fills.

Run in a child process (a SIGSEGV in a native kernel is then a signal death of the child, not of the test run):
``python decoder_fuzz.py --seed 0 --count 2000 TARGET...`` prints one JSON line per target (``START <target>`` before
each, so a death names its target). :func:`run_fuzzers` starts that child and parses its output.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import random
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable, Dict, List, Optional, Tuple

CODEC_TARGETS = ("NONE", "FLOAT16", "MEANSTD_16BIT", "UNIFORM_8BIT", "QUANTILE_8BIT", "BLOCKWISE_8BIT")
TARGETS = CODEC_TARGETS + ("reducer_parts", "state_download", "progress_records", "reducer_reports", "relayed_records")
REPO = Path(__file__).resolve().parents[2]

_FLOATS = ("float16", "bfloat16", "float32", "float64")
_NUMPY_FLOATS = ("float16", "float32", "float64")
_DTYPE_BYTES = dict(float16=2, bfloat16=2, float32=4, float64=8, uint8=1, int8=1, int16=2, int32=4, int64=8, bool=1)
_ODD_DTYPES = ("complex64", "object", "O", "torch.float32", "", "float32 ", "a" * 300, "__class__", "load", "V8",
               "float128", "<f4", "S4", "U1", "datetime64")


# ------------------------------------------------------------------------------------------------ the spec (oracle)


def _numel(size) -> int:
    return math.prod(int(d) for d in size)


def _int64(buffer: bytes, offset: int) -> Optional[int]:
    if len(buffer) < offset + 8:
        return None
    return int.from_bytes(buffer[offset:offset + 8], "little", signed=True)


def spec_well_formed(message) -> bool:
    """Whether a whole tensor message is well-formed by hivemind's wire format (written independently of the
    checks under test, from the layouts: see lightning_swarm/wire_checks.py's docstring)."""
    from hivemind.proto import runtime_pb2

    names = dict(runtime_pb2.CompressionType.items())
    kind = next((name for name, value in names.items() if value == message.compression), None)
    dtype, size, buffer = message.dtype, list(message.size), message.buffer
    if kind is None or dtype not in _DTYPE_BYTES or len(size) > 16:
        return False
    if message.requires_grad and dtype not in _FLOATS:
        return False
    n = _numel(size)
    if kind == "NONE":
        return len(buffer) == n * _DTYPE_BYTES[dtype] or (dtype == "bfloat16" and n > 0 and len(buffer) == 4 * n)
    if kind == "FLOAT16":
        return dtype in _NUMPY_FLOATS and len(buffer) == 2 * n
    if kind == "MEANSTD_16BIT":
        return dtype in _NUMPY_FLOATS and size and n > 0 and len(buffer) == 2 * n + 8 * (n // size[-1])
    if dtype not in _FLOATS:
        return False
    if kind in ("UNIFORM_8BIT", "QUANTILE_8BIT"):
        codes = _int64(buffer, 0)
        if codes is None or not 1 <= codes <= 256 or len(buffer) != 8 + 4 * codes + n:
            return False
        return n == 0 or max(buffer[8 + 4 * codes:]) < codes
    absmax, codes = _int64(buffer, 0), _int64(buffer, 8)  # BLOCKWISE_8BIT
    return absmax == -(-n // 4096) and codes == 256 and len(buffer) == 16 + 4 * (absmax + 256) + n


def spec_fits(message, shape, dtype_name: str) -> bool:
    """Whether a well-formed message may fill a local tensor of this shape and dtype (same shape; same dtype, or
    both floating point and the message's no wider than max(local, float32))."""
    if tuple(message.size) != tuple(shape):
        return False
    if message.dtype == dtype_name:
        return True
    return (message.dtype in _FLOATS and dtype_name in _FLOATS
            and _DTYPE_BYTES[message.dtype] <= max(_DTYPE_BYTES[dtype_name], 4))


# ------------------------------------------------------------------------------------------------ mutations


def _mutate_tensor(message, rng: random.Random):
    """A mutated copy of a tensor message (one to three mutations) and what was done."""
    from hivemind.proto import runtime_pb2

    mutated = runtime_pb2.Tensor()
    mutated.CopyFrom(message)
    done = []
    for _ in range(rng.choice((1, 1, 1, 2, 3))):
        kind = rng.randrange(10)
        buffer = bytearray(mutated.buffer)
        if kind == 0 and buffer:
            cut = rng.randrange(len(buffer))
            mutated.buffer = bytes(buffer[:cut])
            done.append(f"truncate to {cut}")
        elif kind == 1:
            extra = rng.choice((1, 2, 4, 7, 64, 4096, 2**20 if rng.random() < 0.02 else 8))
            mutated.buffer = bytes(buffer) + bytes(rng.getrandbits(8) for _ in range(min(extra, 64))) * (
                max(1, extra // 64))
            done.append(f"extend by ~{extra}")
        elif kind == 2:
            offset = rng.choice((0, 8))
            value = rng.choice((0, -1, 1, 2, 255, 256, 257, 2**31, 2**62, -2**63, 2**63 - 1, rng.getrandbits(63)))
            if len(buffer) >= offset + 8:
                buffer[offset:offset + 8] = value.to_bytes(8, "little", signed=True)
                mutated.buffer = bytes(buffer)
                done.append(f"int64 at {offset} = {value}")
        elif kind == 3:
            size = list(mutated.size)
            choice = rng.randrange(6)
            if choice == 0:
                size = []
            elif choice == 1 and size:
                size[rng.randrange(len(size))] = rng.choice((0, 1, 2**32 - 1, 2**31, size[0] + 1, max(0, size[0] - 1)))
            elif choice == 2:
                size = size + [1]
            elif choice == 3:
                size = size[:-1]
            elif choice == 4:
                size = [rng.randrange(2**32) for _ in range(rng.randrange(1, 4))]
            else:
                size = [1] * rng.choice((17, 40))
            size = [dim % 2**32 for dim in size]  # the field holds uint32
            del mutated.size[:]
            mutated.size.extend(size)
            done.append(f"size {size[:6]}")
        elif kind == 4:
            mutated.dtype = rng.choice(tuple(_DTYPE_BYTES) + _ODD_DTYPES)
            done.append(f"dtype {mutated.dtype[:20]!r}")
        elif kind == 5:
            mutated.compression = rng.choice(list(dict(runtime_pb2.CompressionType.items()).values()) + [6, 99])
            done.append(f"compression {mutated.compression}")
        elif kind == 6 and buffer:
            for _ in range(rng.choice((1, 3, 16))):
                buffer[rng.randrange(len(buffer))] = rng.getrandbits(8)
            mutated.buffer = bytes(buffer)
            done.append("bytes flipped")
        elif kind == 7:
            length = rng.randrange(0, 2 * len(buffer) + 32)
            mutated.buffer = rng.getrandbits(8 * length).to_bytes(length, "little") if length else b""
            done.append(f"random {length} bytes")
        elif kind == 8:
            mutated.requires_grad = not mutated.requires_grad
            done.append("requires_grad toggled")
        else:
            header_end = min(len(buffer), 16)
            if header_end:
                buffer[rng.randrange(header_end)] = rng.getrandbits(8)
                mutated.buffer = bytes(buffer)
                done.append("header byte flipped")
    return mutated, "; ".join(done) or "unchanged"


def _honest_tensor_messages(kind: str) -> list:
    import torch
    from hivemind.compression import serialize_torch_tensor
    from hivemind.proto import runtime_pb2

    generator = torch.Generator().manual_seed(0)
    samples = {
        "NONE": [torch.randn(1000, generator=generator), torch.randn(3, 5, generator=generator),
                 torch.randn(7, generator=generator).bfloat16(), torch.arange(5), torch.tensor([True, False, True]),
                 torch.arange(10, dtype=torch.uint8), torch.randn(8, generator=generator).half(), torch.empty(0)],
        "FLOAT16": [torch.randn(1000, generator=generator), torch.randn(9, generator=generator).double(),
                    torch.randn(2, 3, generator=generator)],
        "MEANSTD_16BIT": [torch.randn(4, 50, generator=generator), torch.randn(100, generator=generator)],
        "UNIFORM_8BIT": [torch.randn(3000, generator=generator), torch.randn(17, generator=generator)],
        "QUANTILE_8BIT": [torch.randn(3000, generator=generator)],
        "BLOCKWISE_8BIT": [torch.randn(5000, generator=generator), torch.randn(4096, generator=generator),
                           torch.randn(3, 700, generator=generator).bfloat16()],
    }[kind]
    return [serialize_torch_tensor(tensor, getattr(runtime_pb2, kind)) for tensor in samples]


# ------------------------------------------------------------------------------------------------ targets


class Outcome:
    """Counts of one target's run; ``violations`` describes the first few messages the oracle disagrees with."""

    def __init__(self, target: str):
        self.target, self.messages, self.refused, self.decoded, self.errors = target, 0, 0, 0, 0
        self.violations: List[str] = []
        self.slowest = 0.0

    def violation(self, text: str) -> None:
        if len(self.violations) < 10:
            self.violations.append(text)

    def as_dict(self) -> dict:
        return dict(target=self.target, messages=self.messages, refused=self.refused, decoded=self.decoded,
                    other_errors=self.errors, violations=self.violations, slowest_seconds=round(self.slowest, 4))


def fuzz_codec(kind: str, rng: random.Random, count: int) -> Outcome:
    """Mutated messages of one compression type through hivemind's decoder registry."""
    from hivemind.compression import deserialize_torch_tensor
    from hivemind.proto import runtime_pb2

    from lightning_swarm.compression import register_fixed_codecs
    from lightning_swarm.wire_checks import MalformedTensor

    register_fixed_codecs()
    outcome, corpus = Outcome(kind), _honest_tensor_messages(kind)
    for index in range(count):
        base = corpus[index % len(corpus)]
        message, what = (base, "honest") if index < len(corpus) else _mutate_tensor(base, rng)
        expected = spec_well_formed(message)
        start = time.perf_counter()
        try:
            tensor = deserialize_torch_tensor(message)
        except MalformedTensor:
            tensor = None
            outcome.refused += 1
        except Exception as e:
            tensor = None
            if isinstance(e, ValueError) and message.compression not in runtime_pb2.CompressionType.values():
                outcome.refused += 1  # an unknown type: hivemind's registry has no decoder for it ("no name defined")
            else:  # refused, but not by the checks: a path they miss
                outcome.errors += 1
                outcome.violation(f"{what}: {type(e).__name__}: {str(e)[:120]}")
        outcome.slowest = max(outcome.slowest, time.perf_counter() - start)
        outcome.messages += 1
        if tensor is not None:
            outcome.decoded += 1
            if not expected:
                outcome.violation(f"{what}: a malformed message decoded to {list(tensor.shape)} {tensor.dtype}")
            elif list(tensor.shape) != list(message.size) or str(tensor.dtype) != f"torch.{message.dtype}":
                outcome.violation(f"{what}: decoded {list(tensor.shape)} {tensor.dtype}, announced "
                                  f"{list(message.size)} {message.dtype}")
            elif tensor.numel() > max(len(message.buffer), 0):
                outcome.violation(f"{what}: {tensor.numel()} values from {len(message.buffer)} bytes")
        elif expected and outcome.errors == 0:
            outcome.violation(f"{what}: a well-formed message was refused")
    return outcome


def fuzz_reducer_parts(rng: random.Random, count: int) -> Outcome:
    """Mutated parts (a sender's) and results (a reducer's) through the all-reduce's check, then hivemind's
    decoding, against a local float32 part of 1000 values."""
    import torch
    from hivemind.compression import deserialize_torch_tensor
    from hivemind.proto import averaging_pb2
    from hivemind.utils.asyncio import as_aiter

    from lightning_swarm.compression import register_fixed_codecs
    from lightning_swarm.hivemind_ext.part_checks import PartRefused, checked_part_messages

    register_fixed_codecs()
    local = [(torch.Size([1000]), torch.float32)]
    corpus = [m for kind in ("NONE", "FLOAT16", "BLOCKWISE_8BIT", "UNIFORM_8BIT") for m in _honest_tensor_messages(kind)
              if list(m.size) == [1000] or kind in ("BLOCKWISE_8BIT", "UNIFORM_8BIT")]
    outcome = Outcome("reducer_parts")

    async def one(message, code) -> Optional[torch.Tensor]:
        stream = as_aiter(averaging_pb2.AveragingData(code=code, tensor_part=message, weight=1.0))
        received = [m async for m in checked_part_messages(stream, local, (code,), lambda reason: None)]
        return deserialize_torch_tensor(received[0].tensor_part)

    async def run():
        for index in range(count):
            base = corpus[index % len(corpus)]
            message, what = _mutate_tensor(base, rng) if index >= len(corpus) else (base, "honest")
            expected = spec_well_formed(message) and spec_fits(message, [1000], "float32")
            code = rng.choice((averaging_pb2.PART_FOR_AVERAGING, averaging_pb2.NO_CODE, averaging_pb2.AVERAGED_PART))
            start = time.perf_counter()
            try:
                tensor = await one(message, code)
            except PartRefused:
                tensor = None
                outcome.refused += 1
            except Exception as e:
                tensor = None
                outcome.errors += 1
                outcome.violation(f"{what}: {type(e).__name__}: {str(e)[:120]}")
            outcome.slowest = max(outcome.slowest, time.perf_counter() - start)
            outcome.messages += 1
            if tensor is not None:
                outcome.decoded += 1
                if not expected or tensor.shape != torch.Size([1000]) or tensor.element_size() > 4:
                    outcome.violation(f"{what}: accepted as {list(tensor.shape)} {tensor.dtype}")
            elif expected:
                outcome.violation(f"{what}: a part that fits was refused")

    asyncio.run(run())
    return outcome


def fuzz_state_download(rng: random.Random, count: int) -> Outcome:
    """Mutated state streams (parts dropped, repeated, added; headers and buffers mutated) through the assembly."""
    import torch
    from hivemind.compression import serialize_torch_tensor
    from hivemind.proto import runtime_pb2
    from hivemind.utils.streaming import combine_from_streaming, split_for_streaming

    from lightning_swarm.compression import register_fixed_codecs
    from lightning_swarm.hivemind_ext.state_download import StateDownloadError, _TensorAssembler
    from lightning_swarm.wire_checks import max_buffer_length

    register_fixed_codecs()
    generator = torch.Generator().manual_seed(1)
    state = [torch.randn(300, generator=generator), torch.randn(4, 5, generator=generator), torch.arange(3)]
    shapes, dtypes = [t.shape for t in state], [t.dtype for t in state]
    outcome = Outcome("state_download")
    kinds = ("NONE", "FLOAT16", "BLOCKWISE_8BIT")
    honest = {kind: [serialize_torch_tensor(t, getattr(runtime_pb2, kind if t.is_floating_point() else "NONE"))
                     for t in state] for kind in kinds}
    budget = max(max_buffer_length(k, s, "float64") for k in CODEC_TARGETS for s in shapes)

    for index in range(count):
        kind = kinds[index % len(kinds)]
        messages = list(honest[kind])
        what = "honest"
        if index >= len(kinds):
            choice = rng.randrange(5)
            target = rng.randrange(len(messages))
            if choice == 0:  # one whole tensor mutated (header and/or buffer), re-streamed
                messages[target], what = _mutate_tensor(messages[target], rng)
            elif choice == 1:
                messages.append(messages[rng.randrange(len(messages))])
                what = "an extra tensor"
            elif choice == 2:
                del messages[target]
                what = f"tensor {target} left out"
        streams = [list(split_for_streaming(m, chunk_size_bytes=max(rng.choice((64, 256, 4096)), len(m.buffer) // 64)))
                   for m in messages]
        parts = [part for stream in streams for part in stream]
        if index >= len(kinds) and what == "honest" and parts:
            where = rng.randrange(len(parts))
            if rng.random() < 0.5:
                del parts[where]
                what = f"part {where} dropped"
            else:
                parts.insert(where, parts[where])
                what = f"part {where} repeated"
        # the oracle: as many tensors as the local state, each whole, well-formed and fitting its local tensor
        expected = not what.startswith("part ") and len(streams) == len(state)
        if expected:
            expected = all(stream and stream[0].chunks == len(stream) and spec_well_formed(whole)
                           and spec_fits(whole, shape, str(dtype).replace("torch.", ""))
                           for stream, whole, shape, dtype in zip(streams, map(combine_from_streaming, streams),
                                                                  shapes, dtypes))
        assembler = _TensorAssembler(shapes, dtypes)
        peak = 0
        start = time.perf_counter()
        try:
            for part in parts:
                assembler.add(part)
                peak = max(peak, len(assembler._buffer))
            received = assembler.close()
            if len(received) != len(state):
                raise StateDownloadError("fewer tensors")  # what _download_from checks after close()
        except StateDownloadError:
            received = None
            outcome.refused += 1
        except Exception as e:
            received = None
            outcome.errors += 1
            outcome.violation(f"{what}: {type(e).__name__}: {str(e)[:120]}")
        outcome.slowest = max(outcome.slowest, time.perf_counter() - start)
        outcome.messages += 1
        if peak > budget:
            outcome.violation(f"{what}: buffered {peak} bytes, the local state takes at most {budget}")
        if received is not None:
            outcome.decoded += 1
            if not expected or any(r.shape != s or r.element_size() > max(d.itemsize, 4)
                                   for r, s, d in zip(received, shapes, dtypes)):
                outcome.violation(f"{what}: accepted {[list(r.shape) for r in received]}")
        elif expected:
            outcome.violation(f"{what}: a well-formed state was refused")
    return outcome


def fuzz_progress_records(rng: random.Random, count: int) -> Outcome:
    """Mutated progress records through the check every reader of the progress key applies."""
    from hivemind.optim.progress_tracker import LocalTrainingProgress
    from hivemind.utils import get_dht_time

    from lightning_swarm.hivemind_ext.progress_records import check_progress_record

    outcome = Outcome("progress_records")
    odd = (None, True, False, -1, 0, 1, 2**53, 2**64, -2**63, 1.5, -0.0, float("nan"), float("inf"), -float("inf"),
           1e308, "3", b"\x00" * 200, [1], {"a": 1}, "", 10**30)
    for index in range(count):
        now = get_dht_time()
        value = dict(peer_id=b"\x00\x02ab", epoch=rng.randrange(1000), samples_accumulated=rng.randrange(10**6),
                     samples_per_second=rng.random() * 1000, time=now - rng.random() * 1000,
                     client_mode=rng.random() < 0.5)
        done = []
        if index >= 10:
            for _ in range(rng.choice((1, 2))):
                key = rng.choice(tuple(value) + ("extra",))
                if rng.random() < 0.1:
                    value.pop(key, None)
                    done.append(f"{key} removed")
                else:
                    value[key] = rng.choice(odd)
                    done.append(f"{key}={value[key]!r:.30}")
            if rng.random() < 0.05:
                value = rng.choice(odd)
                done = [f"record {value!r:.30}"]
        what = "; ".join(done) or "honest"
        expected = _spec_progress(value, now)
        start = time.perf_counter()
        try:
            record = check_progress_record(value, now)
        except ValueError:
            record = None
            outcome.refused += 1
        except Exception as e:
            record = None
            outcome.errors += 1
            outcome.violation(f"{what}: {type(e).__name__}: {str(e)[:120]}")
        outcome.slowest = max(outcome.slowest, time.perf_counter() - start)
        outcome.messages += 1
        if record is not None:
            outcome.decoded += 1
            if not expected or not isinstance(record, LocalTrainingProgress):
                outcome.violation(f"{what}: accepted")
        elif expected:
            outcome.violation(f"{what}: a well-formed record was refused")
    return outcome


def _spec_progress(value, now: float) -> bool:
    if not isinstance(value, dict):
        return False
    try:
        peer_id, epoch, samples = value["peer_id"], value["epoch"], value["samples_accumulated"]
        rate, when, client = value["samples_per_second"], value["time"], value["client_mode"]
    except KeyError:
        return False
    counts_ok = all(type(x) is int and 0 <= x < 2**53 for x in (epoch, samples))
    rate_ok = type(rate) is float and math.isfinite(rate) and 0 <= rate <= 1e7
    time_ok = type(when) is float and math.isfinite(when) and 0 <= when <= now + 60
    return (type(peer_id) is bytes and len(peer_id) <= 128 and counts_ok and rate_ok and time_ok
            and type(client) is bool)


_REPORT_PARTS = (2, 0, 3)  # parts reduced by each member of the fuzzed group (the fuzzed report's author: the first)
_REPORT_ROWS = sum(7 + 2 * parts for parts in _REPORT_PARTS)
_CLAIMS = 2 + 3 * (4 + 1 + 2 * 2)  # its claims block on its own slice (2 parts, 3 senders)


def _spec_header(data) -> bool:
    import struct

    if not isinstance(data, bytes) or len(data) != 56:
        return False
    values = struct.unpack("<7d", data)
    if not all(math.isfinite(v) for v in values):
        return False
    b, own, zero, residual, share, accepted, mode = values
    return (all(0 <= v <= 1 + 1e-6 for v in (b, own, zero, share)) and residual >= 0 and accepted == int(accepted)
            and 0 <= accepted <= 4096 and mode in (0, 1, 2))


def _spec_report(values) -> bool:
    import numpy as np

    values = np.asarray(values, dtype=np.float64)
    if len(values) != _REPORT_ROWS + _CLAIMS or not np.all(np.isfinite(values)):
        return False
    claims, values = values[_REPORT_ROWS:], values[:_REPORT_ROWS]
    if claims[0] != 0:
        rows = claims[2:].reshape(3, 9)
        if (claims[0] != 1 or not (0 <= claims[1] < 2 ** 53 and claims[1] == int(claims[1]))
                or np.any(rows[:, 4] < 0) or np.any(rows[:, 5:7] < 0) or np.any(rows[:, 5:7] > 1 + 1e-6) or np.any(rows[:, 7:] < 0)):
            return False
    offset = 0
    for parts in _REPORT_PARTS:
        row = values[offset:offset + 7 + 2 * parts]
        offset += len(row)
        if row[0] == 0:
            continue
        if row[0] != 1 or row[5] < 0 or not (0 <= row[6] < 2 ** 53 and row[6] == int(row[6])):
            return False
        if np.any(row[7:7 + parts] < 0) or np.any(row[7:7 + parts] > 1 + 1e-6) or np.any(row[7 + parts:] < 0):
            return False
    return True


def fuzz_reducer_reports(rng: random.Random, count: int) -> Outcome:
    """Mutated result headers (``reducer_checks.parse_header``) and verification messages of each phase
    (``result_verification.parse_verification_message``, then ``reducer_checks.decode_report`` and
    ``decode_claims`` for reports: the rows on every reducer, then the author's claims on its own slice)."""
    import struct

    import numpy as np
    import torch
    from hivemind.compression.serialization import serialize_torch_tensor
    from hivemind.proto import averaging_pb2, runtime_pb2

    from lightning_swarm import reducer_checks as rc
    from lightning_swarm.hivemind_ext import result_verification as rv

    outcome = Outcome("reducer_reports")
    group, seed = b"g" * 32, b"s" * 32
    length = rc.report_length(_REPORT_PARTS) + rc.claims_length(_REPORT_PARTS[0], 3)
    odd = (0.0, -1.0, 1.0, 2.0, 0.5, 1e308, -1e308, float("nan"), float("inf"), 2.0 ** 53, 1.5, 7.0)
    for index in range(count):
        kind = rng.choice(("header", "phase", "report"))
        done = []
        start = time.perf_counter()
        expected, accepted = False, False
        try:
            if kind == "header":
                values = [rng.random(), rng.random(), 0.0, rng.random(), 0.5, 3.0, float(rng.choice((0, 1, 2)))]
                if index >= 10:
                    for _ in range(rng.choice((1, 2))):
                        position = rng.randrange(7)
                        values[position] = rng.choice(odd)
                        done.append(f"field {position}={values[position]!r}")
                data = struct.pack("<7d", *values)
                if rng.random() < 0.15:
                    data = data[:rng.randrange(len(data))] if rng.random() < 0.5 else data + b"\x00" * rng.randrange(1, 9)
                    done.append(f"{len(data)} bytes")
                expected = _spec_header(data)
                try:
                    rc.parse_header(data)
                    accepted = True
                except rc.MalformedReport:
                    pass
            else:
                phase = 3 if kind == "report" else rng.choice((1, 2))
                message = averaging_pb2.AveragingData(group_id=group, weight=float(phase))
                values = None
                if phase == 3:
                    report = rc.SliceReport(True, np.array([rng.gauss(0, 1) for _ in range(4)]), rng.random(),
                                            float(rng.randrange(2 ** 48)), np.array([rng.random() for _ in range(2)]),
                                            np.array([rng.random() for _ in range(2)]),
                                            np.array([rng.gauss(0, 1) for _ in range(4)]), rng.random())
                    claims = rc.ReducerClaims(
                        float(rng.randrange(2 ** 48)), np.array([[rng.gauss(0, 1) for _ in range(4)] for _ in range(3)]),
                        np.array([rng.random() for _ in range(3)]),
                        np.array([[rng.random() for _ in range(2)] for _ in range(3)]),
                        np.array([[rng.random() for _ in range(2)] for _ in range(3)]),
                        np.array([rng.gauss(0, 1) for _ in range(4)]), rng.random())
                    values = np.concatenate((rc.encode_report([report, None, None], _REPORT_PARTS),
                                             rc.encode_claims(claims if rng.random() < 0.8 else None, 2, 3)))
                    if index >= 10 and rng.random() < 0.6:
                        position = rng.randrange(len(values))
                        values[position] = rng.choice(odd)
                        done.append(f"value {position}={values[position]!r}")
                    if rng.random() < 0.15:
                        values = values[:-1] if rng.random() < 0.5 else np.append(values, 0.0)
                        done.append(f"{len(values)} values")
                    tensor = torch.from_numpy(values)
                    if rng.random() < 0.1:
                        tensor = tensor.float()
                        done.append("float32")
                    message.tensor_part.CopyFrom(serialize_torch_tensor(tensor))
                    if rng.random() < 0.1:
                        message.tensor_part.buffer = message.tensor_part.buffer[:-8]
                        done.append("buffer cut")
                    if rng.random() < 0.05:
                        message.ClearField("tensor_part")
                        done.append("no tensor")
                    message.peer_id = seed
                    if index >= 10 and rng.random() < 0.1:
                        message.peer_id = rng.choice((b"", b"t" * 32, seed[:31], seed + b"\x00"))
                        done.append(f"seed of {len(message.peer_id)} bytes")
                else:
                    # a commitment names the members its sender saw fail: a mask of the group's 3 members
                    message.peer_id = os.urandom(32) + (bytes([rng.randrange(8)]) if phase == 1 else b"")
                    if index >= 10 and rng.random() < 0.3:
                        message.peer_id = os.urandom(rng.choice((0, 31, 32, 33, 34, 1000)))
                        done.append(f"{len(message.peer_id)} bytes")
                if index >= 10 and rng.random() < 0.1:
                    message.weight = rng.choice((0.0, 4.0, float("nan"), 3.0 if phase != 3 else 1.0))
                    done.append(f"phase {message.weight}")
                if index >= 10 and rng.random() < 0.05:
                    message.group_id = b"h" * 32
                    done.append("other group")
                phase_ok = message.weight == float(phase) and message.group_id == group
                if phase == 3:
                    tensor_ok = (message.HasField("tensor_part") and message.tensor_part.dtype == "float64"
                                 and len(message.tensor_part.buffer) == 8 * length
                                 and list(message.tensor_part.size) == [length])
                    expected = phase_ok and tensor_ok and message.peer_id == seed and _spec_report(values)
                elif phase == 1:  # 32 bytes of commitment and one byte of mask, no bit beyond the 3 members
                    expected = phase_ok and len(message.peer_id) == 33 and message.peer_id[32] < 8
                else:
                    expected = phase_ok and len(message.peer_id) == 32
                try:
                    parsed = rv.parse_verification_message(message, group, phase, length, 3, seed)
                    if phase == 3:
                        rc.decode_report(parsed[:_REPORT_ROWS], _REPORT_PARTS)
                        rc.decode_claims(parsed[_REPORT_ROWS:], _REPORT_PARTS[0], 3)
                    accepted = True
                except (rv.MalformedMessage, rc.MalformedReport):
                    pass
        except Exception as e:
            outcome.errors += 1
            outcome.violation(f"{kind} {'; '.join(done)}: {type(e).__name__}: {str(e)[:120]}")
            accepted = None
        outcome.slowest = max(outcome.slowest, time.perf_counter() - start)
        outcome.messages += 1
        if accepted:
            outcome.decoded += 1
            if not expected:
                outcome.violation(f"{kind} {'; '.join(done)}: accepted")
        elif accepted is False:
            outcome.refused += 1
            if expected:
                outcome.violation(f"{kind} {'; '.join(done) or 'honest'}: a well-formed message was refused")
    return outcome


def _spec_bundle(data: bytes, honest: Dict[bytes, Tuple[object, bytes]], max_count: int) -> Optional[list]:
    """The (signer, inner) pairs a relay's answer must decode to, or None if it must be refused: an exact layout of
    at most ``max_count`` records, each one of the honest records byte for byte (any other byte changes a signed
    field, the key or the signature)."""
    import struct

    if len(data) < 2:
        return None
    (count,) = struct.unpack_from(">H", data)
    if count > max_count:
        return None
    offset, out = 2, []
    for _ in range(count):
        if len(data) - offset < 4:
            return None
        (length,) = struct.unpack_from(">I", data, offset)
        offset += 4
        if length > len(data) - offset:
            return None
        record = data[offset:offset + length]
        offset += length
        if record not in honest:
            return None
        out.append(honest[record])
    return out if offset == len(data) else None


def fuzz_relayed_records(rng: random.Random, count: int) -> Outcome:
    """Mutated relay answers (``relayed_messages.unpack_records``, then ``open_record`` on each record, as a
    client-mode member reads them): bytes flipped, cut or added, each length field set to 0, all ones or a huge
    value, records dropped or repeated, keys swapped, a record signed with a non-RSA key."""
    import struct

    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec

    from lightning_swarm.hivemind_ext import relayed_messages as rm

    outcome = Outcome("relayed_records")
    keys = [rm.load_signing_key(_der_key(seed)) for seed in range(3)]
    inner_cap = 200
    honest: Dict[bytes, Tuple[object, bytes]] = {}
    records = []
    for index, key in enumerate(keys):
        inner = bytes(rng.randrange(256) for _ in range(rng.choice((0, 40, inner_cap))))
        record = rm.sign_record(key, inner)
        public = key.public_key().public_bytes(serialization.Encoding.DER,
                                               serialization.PublicFormat.SubjectPublicKeyInfo)
        honest[record] = (rm.peer_id_of(public), inner)
        records.append(record)
    # a record of the right layout signed with an EC key (not RSA: refused)
    ec_key = ec.generate_private_key(ec.SECP256R1())
    ec_public = ec_key.public_key().public_bytes(serialization.Encoding.DER,
                                                 serialization.PublicFormat.SubjectPublicKeyInfo)
    ec_signature = ec_key.sign(rm.SIGNING_DOMAIN + b"x", ec.ECDSA(hashes.SHA256()))
    ec_record = (struct.pack(">BI", 1, 1) + b"x" + struct.pack(">H", len(ec_public)) + ec_public
                 + struct.pack(">H", len(ec_signature)) + ec_signature)
    max_count, max_record = 3, rm.record_cap(inner_cap)
    for index in range(count):
        chosen = [rng.choice(records) for _ in range(rng.choice((0, 1, 2, 3)))]
        done = []
        if index >= 10:
            kind = rng.choice(("flip", "cut", "extend", "count", "record_length", "inner_length", "key_length",
                               "signature_length", "many", "swap_key", "ec"))
            done.append(kind)
            if kind == "many":
                chosen = [rng.choice(records) for _ in range(rng.choice((4, 50)))]
            elif kind == "ec":
                chosen = chosen + [ec_record]
            elif kind in ("inner_length", "key_length", "signature_length", "swap_key") and chosen:
                position = rng.randrange(len(chosen))
                record = bytearray(chosen[position])
                inner_length = struct.unpack_from(">I", record, 1)[0]
                key_at = 5 + inner_length
                key_length = struct.unpack_from(">H", record, key_at)[0]
                signature_at = key_at + 2 + key_length
                value = rng.choice((0, 1, -1, 2 ** 15, 2 ** 31 - 1))
                if kind == "inner_length":
                    struct.pack_into(">I", record, 1, value % 2 ** 32)
                elif kind == "key_length":
                    struct.pack_into(">H", record, key_at, value % 2 ** 16)
                elif kind == "signature_length":
                    struct.pack_into(">H", record, signature_at, value % 2 ** 16)
                else:  # another member's valid key in place of the signer's
                    other = records[(records.index(chosen[position]) + 1) % len(records)]
                    other_inner = struct.unpack_from(">I", other, 1)[0]
                    other_key = other[5 + other_inner: 5 + other_inner + 2 + struct.unpack_from(">H", other, 5 + other_inner)[0]]
                    record = record[:key_at] + bytearray(other_key) + record[signature_at:]
                chosen[position] = bytes(record)
        data = bytearray(rm.pack_records(chosen))
        if index >= 10:
            if done[0] == "flip" and data:
                position = rng.randrange(len(data))
                data[position] ^= 1 << rng.randrange(8)
            elif done[0] == "cut" and data:
                data = data[:rng.randrange(len(data))]
            elif done[0] == "extend":
                data += bytes(rng.randrange(256) for _ in range(rng.choice((1, 4, 100))))
            elif done[0] == "count":
                struct.pack_into(">H", data, 0, rng.choice((0, 1, 3, 4, 0xFFFF)))
            elif done[0] == "record_length" and len(data) >= 6:
                struct.pack_into(">I", data, 2, rng.choice((0, 1, 0xFFFFFFFF, 2 ** 31, max_record + 1)))
        data = bytes(data)
        expected = _spec_bundle(data, honest, max_count)
        start = time.perf_counter()
        try:
            got = [rm.open_record(record, inner_cap) for record in rm.unpack_records(data, max_count, max_record)]
        except rm.MalformedRecord:
            got = None
        except Exception as e:
            got = None
            outcome.errors += 1
            outcome.violation(f"{'; '.join(done) or 'honest'}: {type(e).__name__}: {str(e)[:120]}")
        outcome.slowest = max(outcome.slowest, time.perf_counter() - start)
        outcome.messages += 1
        if got is not None:
            outcome.decoded += 1
            if expected is None:
                outcome.violation(f"{'; '.join(done)}: a malformed answer was accepted")
            elif got != expected:
                outcome.violation(f"{'; '.join(done)}: decoded other records than it holds")
        else:
            outcome.refused += 1
            if expected is not None:
                outcome.violation(f"{'; '.join(done) or 'honest'}: a well-formed answer was refused")
    return outcome


def _der_key(seed: int) -> bytes:
    """An RSA identity key (DER), made once per seed and process."""
    if seed not in _KEYS:
        from cryptography.hazmat.primitives import serialization
        from cryptography.hazmat.primitives.asymmetric import rsa

        key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
        _KEYS[seed] = key.private_bytes(serialization.Encoding.DER, serialization.PrivateFormat.TraditionalOpenSSL,
                                        serialization.NoEncryption())
    return _KEYS[seed]


_KEYS: Dict[int, bytes] = {}


FUZZERS: Dict[str, Callable[[random.Random, int], Outcome]] = {
    **{kind: (lambda kind: lambda rng, count: fuzz_codec(kind, rng, count))(kind) for kind in CODEC_TARGETS},
    "reducer_parts": fuzz_reducer_parts,
    "state_download": fuzz_state_download,
    "progress_records": fuzz_progress_records,
    "reducer_reports": fuzz_reducer_reports,
    "relayed_records": fuzz_relayed_records,
}


# ------------------------------------------------------------------------------------------------ the child process


def run_fuzzers(targets, seed: int, count: int, timeout: float) -> Tuple[Dict[str, dict], int, str]:
    """Run the targets in one child process; returns (outcome by target, the child's return code: negative is a
    signal death, stderr's tail). A target missing from the outcomes was running when the child died."""
    env = dict(os.environ, PYTHONPATH=f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    process = subprocess.run([sys.executable, __file__, "--seed", str(seed), "--count", str(count), *targets],
                             capture_output=True, text=True, timeout=timeout, env=env)
    outcomes, started = {}, None
    for line in process.stdout.splitlines():
        if line.startswith("START "):
            started = line.split()[1]
        elif line.startswith("{"):
            outcome = json.loads(line)
            outcomes[outcome["target"]] = outcome
    tail = process.stderr[-3000:] + (f"\n(the child was running {started})" if started not in outcomes else "")
    return outcomes, process.returncode, tail


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("targets", nargs="*", default=list(TARGETS), help=f"of {', '.join(TARGETS)} (default: all)")
    parser.add_argument("--seed", type=int, default=0, help="the mutations' random seed")
    parser.add_argument("--count", type=int, default=1000, help="messages per target")
    args = parser.parse_args(argv)
    for target in args.targets:
        print(f"START {target}", flush=True)
        start = time.perf_counter()
        outcome = FUZZERS[target](random.Random(f"{args.seed}-{target}"), args.count).as_dict()
        outcome["seconds"] = round(time.perf_counter() - start, 2)
        print(json.dumps(outcome), flush=True)


if __name__ == "__main__":
    main()
