"""What the members and the reducer of a slice say about it (issue 24, item 9; the checks are
:mod:`lightning_swarm.reducer_checks`): the reducer's 56-byte header on each result (:class:`ResultHeader`), a
member's report on each other reducer's slice (:func:`member_report`: its own weighted residual ``b_j (x_j - v)``
projected on random sign vectors) and a reducer's claims on its own slice (:func:`reducer_claims`: the same
projections of every other sender's residual, as the reducer computed them from the parts it decoded), with their
layouts, checked and bounded before anything is decoded (:func:`parse_header`, :func:`decode_report`,
:func:`decode_claims`). A member's report vector is its rows on every reducer (:func:`report_length`) followed by
its claims block on its own slice (:func:`claims_length`; empty where it reduces nothing).
"""

from __future__ import annotations

import hashlib
import math
import struct
from dataclasses import dataclass
from typing import List, Optional, Sequence, Tuple

import numpy as np
import torch

# random sign vectors per part (their generation: one random byte per value for 8 of them, see sign_vectors)
PROJECTIONS = 4
# an honest result is refused with probability at most this (per reducer and round)
FALSE_ALARM = 1e-9
# how the result of a part was made: the weighted mean (nothing bounds a sender's reach), a clipped aggregation
# (CenteredClip, the 2-sender clip, a refused lone sender), or no accepted sender (each keeps its own part)
MODE_MEAN, MODE_CLIPPED, MODE_KEEP = 0, 1, 2
HEADER_FIELDS = 7  # b_j, b_R, c0, sigma_R, a_R, accepted senders, mode (float64 each)
HEADER_BYTES = 8 * HEADER_FIELDS
MAX_SENDERS = 4096
# relative slack of float32 arithmetic: the result's rounding (|v| 2^-24) and the projections' sums
RESULT_ROUNDING = 1e-6
PROJECTION_ROUNDING = 1e-4
# slack of a coefficient sum and of the own clip (float64 arithmetic on the reducer, float32 norms on the members)
SUM_SLACK = 1e-6
CLIP_SLACK = 1e-3
_CHUNK = 1 << 16


class MalformedReport(ValueError):
    """A reducer's header or a member's report that does not fit its layout."""


@dataclass(frozen=True)
class Combination:
    """A reducer's statement about one part: ``coefficients`` (b_j by sender index, 0 for senders not accepted),
    ``zero`` (c0, the virtual part's mass), ``own`` (b_R, this reducer's; 0 if it sent nothing), ``residual``
    (sigma_R = b_R |x_R - v|), ``share`` (a_R, its weight share before clipping), ``accepted`` (senders accepted),
    ``mode`` (MODE_*)."""

    coefficients: Tuple[float, ...]
    zero: float
    own: float
    residual: float
    share: float
    accepted: int
    mode: int


@dataclass(frozen=True)
class ResultHeader:
    """What one sender learns with a result part: its own coefficient and the reducer's header (see module)."""

    coefficient: float
    own: float
    zero: float
    residual: float
    share: float
    accepted: int
    mode: int

    def digest_fields(self) -> Tuple[float, ...]:
        """The fields every sender of the part must have received alike."""
        return self.own, self.zero, self.residual, self.share, float(self.accepted), float(self.mode)


def encode_header(combination: Combination, sender: int) -> bytes:
    """The header a reducer attaches to sender ``sender``'s result part."""
    return struct.pack("<7d", combination.coefficients[sender], combination.own, combination.zero,
                       combination.residual, combination.share, float(combination.accepted), float(combination.mode))


def parse_header(data: bytes) -> ResultHeader:
    """A reducer's header, checked: exactly ``HEADER_BYTES``, finite, coefficients in [0, 1], a count and a mode."""
    if not isinstance(data, (bytes, bytearray)) or len(data) != HEADER_BYTES:
        raise MalformedReport(f"a result header of {len(data) if isinstance(data, (bytes, bytearray)) else '?'} bytes, "
                              f"not {HEADER_BYTES}")
    values = struct.unpack("<7d", bytes(data))
    if not all(math.isfinite(v) for v in values):
        raise MalformedReport("a result header with a non-finite field")
    coefficient, own, zero, residual, share, accepted, mode = values
    if not all(0.0 <= v <= 1.0 + SUM_SLACK for v in (coefficient, own, zero, share)) or residual < 0:
        raise MalformedReport("a result header with a coefficient outside [0, 1] or a negative residual")
    if accepted != int(accepted) or not 0 <= accepted <= MAX_SENDERS or mode not in (MODE_MEAN, MODE_CLIPPED, MODE_KEEP):
        raise MalformedReport("a result header with a bad sender count or mode")
    return ResultHeader(coefficient, own, zero, residual, share, int(accepted), int(mode))


def part_seed(seed: bytes, reducer: int, part: int) -> int:
    """The generator seed of one part's random vectors."""
    return int.from_bytes(hashlib.sha256(seed + struct.pack("<qq", reducer, part)).digest()[:8], "little") >> 1


def sign_vectors(generator: torch.Generator, width: int, projections: int = PROJECTIONS) -> torch.Tensor:
    """The next ``width`` values of ``projections`` random sign vectors, a float32 (projections, width) of -1 and +1:
    one random byte per value serves 8 vectors (bit k of the byte: vector k mod 8; a byte per 8 vectors). The bytes
    are those of uniform 64-bit words (``randint`` over all but one of the 2**64 values: every bit fair and
    independent of the others up to 2**-64), so the signs are independent and fair, as with one byte per sign."""
    bytes_per_value = (projections + 7) // 8
    words = torch.randint(-2 ** 63, 2 ** 63 - 1, ((bytes_per_value * width + 7) // 8,), dtype=torch.int64,
                          generator=generator)
    data = words.view(torch.int8)[:bytes_per_value * width].view(bytes_per_value, width)
    signs = torch.empty(projections, width, dtype=torch.int8)
    for group in range(bytes_per_value):
        rows = min(8, projections - 8 * group)
        # bit k to the sign bit, then -1 (bit set) or 0, then -1 or +1
        torch.bitwise_left_shift(data[group][None, :], _SHIFTS[:rows], out=signs[8 * group:8 * group + rows])
    signs >>= 7
    signs |= 1
    return signs.to(torch.float32)


_SHIFTS = torch.tensor([[7 - k] for k in range(8)], dtype=torch.int8)


def project_vectors(vectors: Sequence[torch.Tensor], seed: int, projections: int = PROJECTIONS) -> np.ndarray:
    """``<v, z_k>`` of each vector (flat, all of one length) on ``projections`` random sign vectors ``z_k``
    (:func:`sign_vectors`, seeded), each chunk's float32 products summed in float64: an array (vectors,
    projections)."""
    flats = [vector.reshape(-1).to(torch.float32) for vector in vectors]
    out = np.zeros((len(flats), projections))
    if not flats:
        return out
    generator = torch.Generator().manual_seed(seed)
    size = flats[0].numel()
    for first in range(0, size, _CHUNK):
        width = min(_CHUNK, size - first)
        signs = sign_vectors(generator, width, projections)
        for row, flat in enumerate(flats):
            out[row] += (signs @ flat[first:first + width]).double().numpy()
    return out


def project(vectors: Sequence[Tuple[torch.Tensor, float]], seed: int, projections: int = PROJECTIONS) -> np.ndarray:
    """``sum_v scale_v <v, z_k>`` for ``projections`` random sign vectors ``z_k`` (seeded), in float64; the
    vectors (flat, same length) share the z's."""
    return project_many([vectors], seed, projections)[0]


def project_many(sets: Sequence[Sequence[Tuple[torch.Tensor, float]]], seed: int, projections: int = PROJECTIONS,
                 ) -> np.ndarray:
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
    base = project_vectors(vectors, seed, projections)
    out = np.zeros((len(sets), projections))
    for row, terms in enumerate(sets):
        for vector, scale in terms:
            if scale != 0.0:
                out[row] += scale * base[index[id(vector)]]
    return out


@dataclass
class SliceReport:
    """One member's report on one reducer's slice (see :func:`report_layout`)."""

    complete: bool  # got every part's result with a well-formed header
    projections: np.ndarray  # sum over parts of its residual's projections (and its share of the virtual part's)
    error: float  # L2 bound of its projections' error (rounding of the codec and of float32)
    digest: float  # digest of the headers it received
    coefficients: np.ndarray  # b_j per part
    distances: np.ndarray  # upper bound of |x_j - v| per part

def report_length(parts_by_reducer: Sequence[int], projections: int = PROJECTIONS) -> int:
    """Values in a member's report: per reducer, a status, the projections, the error, a digest, then two values
    per part (coefficient, distance)."""
    return sum(3 + projections + 2 * parts for parts in parts_by_reducer)


def encode_report(reports: Sequence[Optional[SliceReport]], parts_by_reducer: Sequence[int],
                  projections: int = PROJECTIONS) -> np.ndarray:
    """A member's reports (None: no report, e.g. on its own slice) as one float64 vector."""
    rows = []
    for report, parts in zip(reports, parts_by_reducer):
        if report is None or not report.complete:
            rows.append(np.zeros(3 + projections + 2 * parts))
            continue
        rows.append(np.concatenate(([1.0], report.projections, [report.error, report.digest],
                                    report.coefficients, report.distances)))
    return np.concatenate(rows) if rows else np.zeros(0)


def decode_report(values: np.ndarray, parts_by_reducer: Sequence[int], projections: int = PROJECTIONS,
                  ) -> List[Optional[SliceReport]]:
    """A member's report vector, checked: the length :func:`report_length` gives, finite values, status 0 or 1,
    error and distances >= 0, coefficients in [0, 1], digests integers below 2**53. Raises MalformedReport."""
    values = np.asarray(values, dtype=np.float64).reshape(-1)
    if len(values) != report_length(parts_by_reducer, projections):
        raise MalformedReport(f"a report of {len(values)} values, not {report_length(parts_by_reducer, projections)}")
    if not np.all(np.isfinite(values)):
        raise MalformedReport("a report with non-finite values")
    reports: List[Optional[SliceReport]] = []
    offset = 0
    for parts in parts_by_reducer:
        row = values[offset:offset + 3 + projections + 2 * parts]
        offset += len(row)
        if row[0] == 0.0:
            reports.append(None)
            continue
        error, digest = row[1 + projections], row[2 + projections]
        coefficients, distances = row[3 + projections:3 + projections + parts], row[3 + projections + parts:]
        if (row[0] != 1.0 or error < 0 or not 0 <= digest < 2 ** 53 or digest != int(digest)
                or np.any(coefficients < 0) or np.any(coefficients > 1 + SUM_SLACK) or np.any(distances < 0)):
            raise MalformedReport("a report with a field out of range")
        reports.append(SliceReport(True, row[1:1 + projections].copy(), float(error), float(digest),
                                   coefficients.copy(), distances.copy()))
    return reports


def header_digest(headers: Sequence[ResultHeader]) -> float:
    """A digest of a slice's headers (their common fields) as an integer below 2**53 (exact in float64)."""
    data = b"".join(struct.pack("<6d", *header.digest_fields()) for header in headers)
    return float(int.from_bytes(hashlib.sha256(data).digest()[:6], "little"))


@dataclass
class ReceivedPart:
    """What a member holds of one part of a reducer's slice: ``local`` (its own part, as it was before the round),
    ``delta`` (the result minus its part, as received), ``header``, ``delta_rounding`` and ``local_rounding`` (L2
    bounds of the codec's rounding of the delta and of its own part as sent, :func:`rounding_bound`)."""

    local: torch.Tensor
    delta: torch.Tensor
    header: ResultHeader
    delta_rounding: float
    local_rounding: float


def member_report(seed: bytes, reducer: int, parts: Sequence[ReceivedPart], members: int,
                  projections: int = PROJECTIONS) -> SliceReport:
    """A member's report on one reducer's slice: its residual ``b_j (x_j - v) = -b_j delta`` plus its share
    ``1 / members`` of the virtual part's ``c0 (0 - v)`` (``v = local + delta``), projected on the part's random
    vectors (:func:`part_seed`), summed over the parts; the error bound of those projections (the codecs' rounding,
    the float32 result's, the sums'), the headers' digest, and per part its coefficient and an upper bound of its
    distance to the result.

    Args:
        seed: the round's seed (see :mod:`lightning_swarm.hivemind_ext.result_verification`).
        reducer: the reducer's index in the group.
        parts: each part of the slice, in order.
        members: the senders other than the reducer (each takes ``1 / members`` of the virtual part).
    """
    total = np.zeros(projections)
    error2 = 0.0
    coefficients, distances = np.zeros(len(parts)), np.zeros(len(parts))
    for index, part in enumerate(parts):
        b, share_zero = part.header.coefficient, part.header.zero / max(members, 1)
        vectors = [(part.delta, -b)]
        if share_zero > 0:
            vectors += [(part.local, -share_zero), (part.delta, -share_zero)]
        total += project(vectors, part_seed(seed, reducer, index), projections)
        delta_norm = float(part.delta.float().norm())
        local_norm = float(part.local.float().norm())
        error = (b * part.delta_rounding + share_zero * (part.delta_rounding + part.local_rounding)
                 + RESULT_ROUNDING * (local_norm + delta_norm)
                 + PROJECTION_ROUNDING * (b * delta_norm + share_zero * (local_norm + delta_norm)))
        error2 += error ** 2
        coefficients[index] = b
        distances[index] = delta_norm + part.delta_rounding
    return SliceReport(True, total, math.sqrt(error2), header_digest([part.header for part in parts]),
                       coefficients, distances)


@dataclass
class ReducerClaims:
    """A reducer's claims on its own slice: ``digest`` (:func:`header_digest` of the headers it sent), and per sender
    index (a row of zeros for its own, if it sends): ``projections`` (senders, projections) of that sender's
    residual as :func:`member_report` projects it, computed from the part the reducer decoded and its result;
    ``errors`` (senders,) L2 bounds of their float32 rounding; ``coefficients`` and ``distances`` (senders, parts):
    b_j and |x_j - v| per part."""

    digest: float
    projections: np.ndarray
    errors: np.ndarray
    coefficients: np.ndarray
    distances: np.ndarray


@dataclass
class ReducedPart:
    """What a reducer holds of one part of its slice: ``received`` (each sender's decoded part by sender index, None
    where none came; its own as it entered the aggregation), ``result`` (v; None: no sender was accepted, each got
    its own part back) and ``combination`` (its statement)."""

    received: Sequence[Optional[torch.Tensor]]
    result: Optional[torch.Tensor]
    combination: Combination


def claims_length(parts: int, senders: int, projections: int = PROJECTIONS) -> int:
    """Values in a claims block on a slice of ``parts`` parts in a group of ``senders`` senders: a status, a digest,
    then per sender its projections, its error, and two values per part (coefficient, distance); none if
    ``parts`` is 0 (nothing reduced)."""
    return 0 if parts == 0 else 2 + senders * (projections + 1 + 2 * parts)


def encode_claims(claims: Optional[ReducerClaims], parts: int, senders: int, projections: int = PROJECTIONS,
                  ) -> np.ndarray:
    """A claims block (None: no claims, e.g. a sender's part is missing) as a float64 vector."""
    if parts == 0 or claims is None:
        return np.zeros(claims_length(parts, senders, projections))
    rows = np.concatenate([claims.projections, claims.errors[:, None], claims.coefficients, claims.distances], axis=1)
    return np.concatenate(([1.0, claims.digest], rows.reshape(-1)))


def decode_claims(values: np.ndarray, parts: int, senders: int, projections: int = PROJECTIONS,
                  ) -> Optional[ReducerClaims]:
    """A claims block, checked: the length :func:`claims_length` gives, finite values, status 0 (None is returned)
    or 1, a digest integer below 2**53, errors and distances >= 0, coefficients in [0, 1]. Raises MalformedReport."""
    values = np.asarray(values, dtype=np.float64).reshape(-1)
    if len(values) != claims_length(parts, senders, projections):
        raise MalformedReport(f"claims of {len(values)} values, not {claims_length(parts, senders, projections)}")
    if not np.all(np.isfinite(values)):
        raise MalformedReport("claims with non-finite values")
    if parts == 0 or values[0] == 0.0:
        return None
    rows = values[2:].reshape(senders, projections + 1 + 2 * parts)
    errors = rows[:, projections]
    coefficients, distances = rows[:, projections + 1:projections + 1 + parts], rows[:, projections + 1 + parts:]
    digest = values[1]
    if (values[0] != 1.0 or not 0 <= digest < 2 ** 53 or digest != int(digest) or np.any(errors < 0)
            or np.any(coefficients < 0) or np.any(coefficients > 1 + SUM_SLACK) or np.any(distances < 0)):
        raise MalformedReport("claims with a field out of range")
    return ReducerClaims(float(digest), rows[:, :projections].copy(), errors.copy(), coefficients.copy(),
                         distances.copy())


def reducer_claims(seed: bytes, reducer: int, parts: Sequence[ReducedPart], members: int, own: Optional[int],
                   projections: int = PROJECTIONS) -> Optional[ReducerClaims]:
    """A reducer's claims on its own slice: for each other sender j, the projections of ``b_j (x_j - v)`` plus
    ``1 / members`` of ``c0 (0 - v)`` (as :func:`member_report`, on the same vectors), summed over the parts, with
    ``x_j`` the part it decoded, and their float32 rounding bound; each part's b_j and |x_j - v|; the digest of the
    headers it sent. The sign vectors are generated once per part for all senders. None if a sender's part is
    missing (that sender has no complete report either).

    Args:
        seed: the round's seed; reducer: this reducer's index in the group.
        parts: each part of the slice, in order (:class:`ReducedPart`).
        members: the senders other than the reducer (each takes ``1 / members`` of the virtual part).
        own: the reducer's own sender index (None: it sends nothing); its row stays zeros.
    """
    if not parts:
        return None
    senders = len(parts[0].received)
    others = [s for s in range(senders) if s != own]
    out = np.zeros((senders, projections))
    error2 = np.zeros(senders)
    coefficients, distances = np.zeros((senders, len(parts))), np.zeros((senders, len(parts)))
    headers = []
    for index, part in enumerate(parts):
        statement = part.combination
        headers.append(ResultHeader(0.0, statement.own, statement.zero, statement.residual, statement.share,
                                    statement.accepted, statement.mode))
        if any(part.received[s] is None for s in others):
            return None
        for s in others:
            coefficients[s, index] = statement.coefficients[s]
        if part.result is None:
            continue  # each sender got its own part back: no residual, no distance
        share_zero = statement.zero / max(members, 1)
        result = part.result.reshape(-1).float()
        result_norm = float(result.norm())
        sets = []
        for s in others:
            b = statement.coefficients[s]
            received = part.received[s].reshape(-1).float()
            difference = received - result  # minus the delta this sender got (before the codec's rounding)
            distance = float(difference.norm())
            distances[s, index] = distance
            sets.append([(difference, b), (result, -share_zero)])
            error = (RESULT_ROUNDING * (float(received.norm()) + result_norm)
                     + PROJECTION_ROUNDING * (b * distance + share_zero * result_norm))
            error2[s] += error ** 2
        out[others] += project_many(sets, part_seed(seed, reducer, index), projections)
    return ReducerClaims(header_digest(headers), out, np.sqrt(error2), coefficients, distances)
