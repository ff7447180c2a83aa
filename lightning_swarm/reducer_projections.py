"""Random sign projections of the lying-reducer check (issue 24, item 9; used by
:mod:`lightning_swarm.reducer_reports`): each part index of a round has its own sign vectors, drawn from the round's
seed (:func:`part_seed`) and shared by every slice's part of that index, so that a member generates them once per part
index for its reports on every other reducer's slice and its claims on its own (:class:`SignSource`). One slice's
check sees its own parts' vectors only, so sharing them between slices changes no slice's pass probability.
"""

from __future__ import annotations

import hashlib
import struct
from typing import List, Optional, Sequence, Tuple

import numpy as np
import torch

# random sign vectors per part (their generation: one random byte per value for 8 of them, see sign_vectors)
PROJECTIONS = 4
CHUNK = 1 << 16  # values per generated block of sign vectors (the last block of a part is cut to its length)
_SHIFTS = torch.tensor([[7 - k] for k in range(8)], dtype=torch.int8)


def part_seed(seed: bytes, part: int) -> int:
    """The generator seed of the random vectors of part index ``part`` (in every reducer's slice)."""
    return int.from_bytes(hashlib.sha256(seed + struct.pack("<q", part)).digest()[:8], "little") >> 1


def sign_vectors(generator: torch.Generator, width: int, projections: int = PROJECTIONS) -> torch.Tensor:
    """The next ``width`` values of ``projections`` random sign vectors, a float32 (projections, width) of -1 and +1:
    one random byte per value serves 8 vectors (bit k of the byte: vector k mod 8; a byte per 8 vectors). The bytes
    are those of uniform 64-bit words (``randint`` over all but one of the 2**64 values: every bit fair and
    independent of the others up to 2**-64), so the signs are independent and fair, as with one byte per sign."""
    bytes_per_value = (projections + 7) // 8
    words = torch.randint(-2 ** 63, 2 ** 63 - 1, ((bytes_per_value * width + 7) // 8,), dtype=torch.int64,
                          generator=generator)
    data = words.view(torch.int8)[:bytes_per_value * width].view(width, bytes_per_value)
    signs = torch.empty(projections, width, dtype=torch.int8)
    for group in range(bytes_per_value):
        rows = min(8, projections - 8 * group)
        # bit k to the sign bit, then -1 (bit set) or 0, then -1 or +1
        torch.bitwise_left_shift(data[:, group][None, :], _SHIFTS[:rows], out=signs[8 * group:8 * group + rows])
    signs >>= 7
    signs |= 1
    return signs.to(torch.float32)


class SignSource:
    """The sign vectors of one part seed at a time, generated in blocks of ``CHUNK`` values as far as asked and kept
    until another seed is asked for (one part's worth: 16 bytes per value with 4 projections)."""

    def __init__(self):
        self._key: Optional[Tuple[int, int]] = None
        self._generator: Optional[torch.Generator] = None
        self._blocks: List[torch.Tensor] = []

    def block(self, seed: int, projections: int, index: int) -> torch.Tensor:
        """Block ``index`` (values ``index * CHUNK`` on) of the sign vectors of ``seed``: (projections, CHUNK)."""
        if self._key != (seed, projections):
            self._key, self._blocks = (seed, projections), []
            self._generator = torch.Generator().manual_seed(seed)
        while len(self._blocks) <= index:
            self._blocks.append(sign_vectors(self._generator, CHUNK, projections))
        return self._blocks[index]


def project_vectors(vectors: Sequence[torch.Tensor], seed: int, projections: int = PROJECTIONS,
                    signs: Optional[SignSource] = None) -> np.ndarray:
    """``<v, z_k>`` of each vector (flat; of any lengths: a shorter one meets the first values of the z's) on
    ``projections`` random sign vectors ``z_k`` of ``seed`` (from ``signs``, or generated here), each block's float32
    products summed in float64: an array (vectors, projections)."""
    flats = [vector.reshape(-1).to(torch.float32) for vector in vectors]
    out = np.zeros((len(flats), projections))
    source = signs if signs is not None else SignSource()
    size = max((flat.numel() for flat in flats), default=0)
    for index, first in enumerate(range(0, size, CHUNK)):
        block = source.block(seed, projections, index)
        for row, flat in enumerate(flats):
            if flat.numel() > first:
                chunk = flat[first:first + CHUNK]
                out[row] += (block[:, :chunk.numel()] @ chunk).double().numpy()
    return out


def project(vectors: Sequence[Tuple[torch.Tensor, float]], seed: int, projections: int = PROJECTIONS,
            signs: Optional[SignSource] = None) -> np.ndarray:
    """``sum_v scale_v <v, z_k>`` for ``projections`` random sign vectors ``z_k`` (seeded), in float64; the
    vectors (flat, same length) share the z's."""
    return project_many([vectors], seed, projections, signs)[0]


def project_many(sets: Sequence[Sequence[Tuple[torch.Tensor, float]]], seed: int, projections: int = PROJECTIONS,
                 signs: Optional[SignSource] = None) -> np.ndarray:
    """:func:`project` of several sets of (vector, scale) (all of one length) on the same sign vectors, generated
    once: an array (sets, projections). The projection is linear: each distinct vector (the same tensor object in
    several sets counts once) is projected once (:func:`project_vectors`) and the sets' sums are taken in float64."""
    vectors: List[torch.Tensor] = []
    index = {}
    for terms in sets:
        for vector, scale in terms:
            if scale != 0.0 and id(vector) not in index:
                index[id(vector)] = len(vectors)
                vectors.append(vector)
    base = project_vectors(vectors, seed, projections, signs)
    out = np.zeros((len(sets), projections))
    for row, terms in enumerate(sets):
        for vector, scale in terms:
            if scale != 0.0:
                out[row] += scale * base[index[id(vector)]]
    return out
