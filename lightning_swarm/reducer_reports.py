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
from dataclasses import dataclass, replace
from typing import List, Optional, Sequence, Tuple

import numpy as np
import torch

from lightning_swarm.reducer_projections import (  # noqa: F401 (re-exported)
    PROJECTIONS, SignSource, part_seed, project, project_many, project_vectors, sign_vectors)

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


@dataclass
class SliceReport:
    """One member's report on one reducer's slice (see :func:`report_layout`)."""

    complete: bool  # got every part's result with a well-formed header
    projections: np.ndarray  # sum over parts of its residual's projections (and its share of the virtual part's)
    error: float  # L2 bound of its projections' error (rounding of the codec and of float32)
    digest: float  # digest of the headers it received
    coefficients: np.ndarray  # b_j per part
    distances: np.ndarray  # upper bound of |x_j - v| per part
    result: Optional[np.ndarray] = None  # sum over parts of the projections of the result v it got (None: zeros)
    result_error: float = 0.0  # L2 bound of their error (the codec's rounding of its part and of the delta)

    def result_projections(self, projections: int = PROJECTIONS) -> np.ndarray:
        return np.zeros(projections) if self.result is None else self.result

def report_length(parts_by_reducer: Sequence[int], projections: int = PROJECTIONS) -> int:
    """Values in a member's report: per reducer, a status, the projections, the error, a digest, then two values
    per part (coefficient, distance), then the result's projections and their error."""
    return sum(_row_length(parts, projections) for parts in parts_by_reducer)


def _row_length(parts: int, projections: int) -> int:
    return 3 + projections + 2 * parts + projections + 1


def encode_report(reports: Sequence[Optional[SliceReport]], parts_by_reducer: Sequence[int],
                  projections: int = PROJECTIONS) -> np.ndarray:
    """A member's reports (None: no report, e.g. on its own slice) as one float64 vector."""
    rows = []
    for report, parts in zip(reports, parts_by_reducer):
        if report is None or not report.complete:
            rows.append(np.zeros(_row_length(parts, projections)))
            continue
        rows.append(np.concatenate(([1.0], report.projections, [report.error, report.digest],
                                    report.coefficients, report.distances,
                                    report.result_projections(projections), [report.result_error])))
    return np.concatenate(rows) if rows else np.zeros(0)


def decode_report(values: np.ndarray, parts_by_reducer: Sequence[int], projections: int = PROJECTIONS,
                  ) -> List[Optional[SliceReport]]:
    """A member's report vector, checked: the length :func:`report_length` gives, finite values, status 0 or 1,
    errors and distances >= 0, coefficients in [0, 1], digests integers below 2**53. Raises MalformedReport."""
    values = np.asarray(values, dtype=np.float64).reshape(-1)
    if len(values) != report_length(parts_by_reducer, projections):
        raise MalformedReport(f"a report of {len(values)} values, not {report_length(parts_by_reducer, projections)}")
    if not np.all(np.isfinite(values)):
        raise MalformedReport("a report with non-finite values")
    reports: List[Optional[SliceReport]] = []
    offset = 0
    for parts in parts_by_reducer:
        row = values[offset:offset + _row_length(parts, projections)]
        offset += len(row)
        if row[0] == 0.0:
            reports.append(None)
            continue
        error, digest = row[1 + projections], row[2 + projections]
        coefficients = row[3 + projections:3 + projections + parts]
        distances = row[3 + projections + parts:3 + projections + 2 * parts]
        result, result_error = row[3 + projections + 2 * parts:-1], row[-1]
        if (row[0] != 1.0 or error < 0 or result_error < 0 or not 0 <= digest < 2 ** 53 or digest != int(digest)
                or np.any(coefficients < 0) or np.any(coefficients > 1 + SUM_SLACK) or np.any(distances < 0)):
            raise MalformedReport("a report with a field out of range")
        reports.append(SliceReport(True, row[1:1 + projections].copy(), float(error), float(digest),
                                   coefficients.copy(), distances.copy(), result.copy(), float(result_error)))
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
                  projections: int = PROJECTIONS, first: int = 0, signs: Optional[SignSource] = None) -> SliceReport:
    """A member's report on one reducer's slice: its residual ``b_j (x_j - v) = -b_j delta`` plus its share
    ``1 / members`` of the virtual part's ``c0 (0 - v)`` (``v = local + delta``), projected on the part's random
    vectors (:func:`part_seed`), summed over the parts; the error bound of those projections (the codecs' rounding,
    the float32 result's, the sums'), the headers' digest, and per part its coefficient and an upper bound of its
    distance to the result; and the projections of the result ``v`` it got, summed over the parts where the senders
    get one result (not MODE_KEEP), which every member and the reducer's claims must agree on: a member with no mass
    in a part (``b_j = 0``) has no residual there, and a result told to it alone was unseen.

    Args:
        seed: the round's seed (see :mod:`lightning_swarm.hivemind_ext.result_verification`).
        reducer: the reducer's index in the group.
        parts: each part of the slice, in order.
        members: the senders other than the reducer (each takes ``1 / members`` of the virtual part).
        first: the part index of ``parts[0]`` in the slice (a report on some parts: :func:`merge_reports`).
        signs: where the sign vectors come from (shared with other slices' parts of the same index).
    """
    total, result = np.zeros(projections), np.zeros(projections)
    error2 = result_error2 = 0.0
    coefficients, distances = np.zeros(len(parts)), np.zeros(len(parts))
    for index, part in enumerate(parts):
        b, share_zero = part.header.coefficient, part.header.zero / max(members, 1)
        vectors = [(part.delta, -b)]
        if share_zero > 0:
            vectors += [(part.local, -share_zero), (part.delta, -share_zero)]
        one_result = part.header.mode != MODE_KEEP
        sets = [vectors] + ([[(part.local, 1.0), (part.delta, 1.0)]] if one_result else [])
        projected = project_many(sets, part_seed(seed, first + index), projections, signs)
        total += projected[0]
        delta_norm = float(part.delta.float().norm())
        local_norm = float(part.local.float().norm())
        error = (b * part.delta_rounding + share_zero * (part.delta_rounding + part.local_rounding)
                 + RESULT_ROUNDING * (local_norm + delta_norm)
                 + PROJECTION_ROUNDING * (b * delta_norm + share_zero * (local_norm + delta_norm)))
        error2 += error ** 2
        if one_result:  # v = local + delta; the reducer's delta was v minus the part it decoded (local_rounding off)
            result += projected[1]
            result_error2 += (part.delta_rounding + part.local_rounding
                              + (RESULT_ROUNDING + PROJECTION_ROUNDING) * (local_norm + delta_norm)) ** 2
        coefficients[index] = b
        # an honest "no change" (MODE_KEEP) is exact zeros, which every codec decodes to zeros: a decoded zero there
        # is no change (elsewhere a float16 zero may be a true value within 2**-25, which delta_rounding bounds)
        keep = part.header.mode == MODE_KEEP and delta_norm == 0.0
        distances[index] = 0.0 if keep else delta_norm + part.delta_rounding
    return SliceReport(True, total, math.sqrt(error2), header_digest([part.header for part in parts]),
                       coefficients, distances, result, math.sqrt(result_error2))


def massless_report(seed: bytes, reducer: int, parts: Sequence[ReceivedPart], members: int,
                    projections: int = PROJECTIONS, first: int = 0, signs: Optional[SignSource] = None) -> SliceReport:
    """The report a sender with no mass in any part of the slice (``b_j = 0``: its parts refused) makes on it, from
    a checker's own ``parts``: its share of the virtual part alone, ``v`` as this checker got it. It stands in for
    the report of a member that has none, or whose report the checker does not hold it to (see
    :func:`lightning_swarm.reducer_checks.judge_slice`'s ``stand_ins``). Arguments as :func:`member_report`."""
    massless = [replace(part, header=replace(part.header, coefficient=0.0)) for part in parts]
    return member_report(seed, reducer, massless, members, projections, first, signs)


@dataclass
class ReducerClaims:
    """A reducer's claims on its own slice: ``digest`` (:func:`header_digest` of the headers it sent), and per sender
    index (a row of zeros for its own, if it sends): ``projections`` (senders, projections) of that sender's
    residual as :func:`member_report` projects it, computed from the part the reducer decoded and its result;
    ``errors`` (senders,) L2 bounds of their float32 rounding; ``coefficients`` and ``distances`` (senders, parts):
    b_j and |x_j - v| per part; ``result`` (projections,) and ``result_error``: the projections of its results
    ``v``, summed over the parts with one result for all senders (not MODE_KEEP), and their rounding bound."""

    digest: float
    projections: np.ndarray
    errors: np.ndarray
    coefficients: np.ndarray
    distances: np.ndarray
    result: Optional[np.ndarray] = None  # None: zeros
    result_error: float = 0.0

    def result_projections(self, projections: int = PROJECTIONS) -> np.ndarray:
        return np.zeros(projections) if self.result is None else self.result


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
    the result's projections and their error, then per sender its projections, its error, and two values per part
    (coefficient, distance); none if ``parts`` is 0 (nothing reduced)."""
    return 0 if parts == 0 else 3 + projections + senders * (projections + 1 + 2 * parts)


def encode_claims(claims: Optional[ReducerClaims], parts: int, senders: int, projections: int = PROJECTIONS,
                  ) -> np.ndarray:
    """A claims block (None: no claims, e.g. a sender's part is missing) as a float64 vector."""
    if parts == 0 or claims is None:
        return np.zeros(claims_length(parts, senders, projections))
    rows = np.concatenate([claims.projections, claims.errors[:, None], claims.coefficients, claims.distances], axis=1)
    return np.concatenate(([1.0, claims.digest], claims.result_projections(projections), [claims.result_error],
                           rows.reshape(-1)))


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
    result, result_error = values[2:2 + projections], values[2 + projections]
    rows = values[3 + projections:].reshape(senders, projections + 1 + 2 * parts)
    errors = rows[:, projections]
    coefficients, distances = rows[:, projections + 1:projections + 1 + parts], rows[:, projections + 1 + parts:]
    digest = values[1]
    if (values[0] != 1.0 or not 0 <= digest < 2 ** 53 or digest != int(digest) or np.any(errors < 0)
            or result_error < 0 or np.any(coefficients < 0) or np.any(coefficients > 1 + SUM_SLACK)
            or np.any(distances < 0)):
        raise MalformedReport("claims with a field out of range")
    return ReducerClaims(float(digest), rows[:, :projections].copy(), errors.copy(), coefficients.copy(),
                         distances.copy(), result.copy(), float(result_error))


def reducer_claims(seed: bytes, reducer: int, parts: Sequence[ReducedPart], members: int, own: Optional[int],
                   projections: int = PROJECTIONS, first: int = 0, signs: Optional[SignSource] = None,
                   ) -> Optional[ReducerClaims]:
    """A reducer's claims on its own slice: for each other sender j, the projections of ``b_j (x_j - v)`` plus
    ``1 / members`` of ``c0 (0 - v)`` (as :func:`member_report`, on the same vectors), summed over the parts, with
    ``x_j`` the part it decoded, and their float32 rounding bound; each part's b_j and |x_j - v|; the digest of the
    headers it sent; the projections of its results (as :func:`member_report`'s). The sign vectors are generated
    once per part for all senders. A sender whose part did not come in time (banned for a late part, or dead) has a
    massless row (coefficient 0, its share of the virtual part alone), as one refused for NaN: it gets no result for
    that part, so its report is missing, and a massless stand-in takes its place
    (:func:`lightning_swarm.reducer_checks.judge_slice`). None if such a sender is given mass (no honest combination
    does that).

    Args:
        seed: the round's seed; reducer: this reducer's index in the group.
        parts: each part of the slice, in order (:class:`ReducedPart`).
        members: the senders other than the reducer (each takes ``1 / members`` of the virtual part).
        own: the reducer's own sender index (None: it sends nothing); its row stays zeros.
        first, signs: as :func:`member_report`.
    """
    if not parts:
        return None
    senders = len(parts[0].received)
    others = [s for s in range(senders) if s != own]
    out, result_projections = np.zeros((senders, projections)), np.zeros(projections)
    error2, result_error2 = np.zeros(senders), 0.0
    coefficients, distances = np.zeros((senders, len(parts))), np.zeros((senders, len(parts)))
    for index, part in enumerate(parts):
        statement = part.combination
        if any(part.received[s] is None and statement.coefficients[s] != 0 for s in others):
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
            received = None if part.received[s] is None else part.received[s].reshape(-1).float()
            if received is None or (b == 0 and not bool(torch.isfinite(received).all())):
                # a part that never came, or was refused for NaN/Inf (coefficient 0): its row stays zeros, so that
                # the claims stay finite and the honest members can still check this slice (its sender's own report
                # is missing or refused anyway)
                sets.append([(result, -share_zero)])
                error2[s] += ((RESULT_ROUNDING + PROJECTION_ROUNDING * share_zero) * result_norm) ** 2
                continue
            difference = received - result  # minus the delta this sender got (before the codec's rounding)
            distance = float(difference.norm())
            distances[s, index] = distance
            sets.append([(difference, b), (result, -share_zero)])
            error = (RESULT_ROUNDING * (float(received.norm()) + result_norm)
                     + PROJECTION_ROUNDING * (b * distance + share_zero * result_norm))
            error2[s] += error ** 2
        projected = project_many(sets + [[(result, 1.0)]], part_seed(seed, first + index), projections, signs)
        out[others] += projected[:-1]
        result_projections += projected[-1]
        result_error2 += ((RESULT_ROUNDING + PROJECTION_ROUNDING) * result_norm) ** 2
    return ReducerClaims(header_digest(claimed_headers(parts)), out, np.sqrt(error2), coefficients, distances,
                         result_projections, math.sqrt(result_error2))


def claimed_headers(parts: Sequence[ReducedPart]) -> List[ResultHeader]:
    """The common fields of the headers a reducer sent with its parts (the sender's own coefficient as 0)."""
    return [ResultHeader(0.0, part.combination.own, part.combination.zero, part.combination.residual,
                         part.combination.share, part.combination.accepted, part.combination.mode) for part in parts]


def merge_reports(reports: Sequence[SliceReport], headers: Sequence[ResultHeader]) -> SliceReport:
    """One report on a slice from reports on its parts one by one (in order; ``headers``: all its parts')."""
    return SliceReport(True, np.sum([r.projections for r in reports], axis=0),
                       math.sqrt(sum(r.error ** 2 for r in reports)), header_digest(headers),
                       np.concatenate([r.coefficients for r in reports]), np.concatenate([r.distances for r in reports]),
                       np.sum([r.result_projections(len(r.projections)) for r in reports], axis=0),
                       math.sqrt(sum(r.result_error ** 2 for r in reports)))


def merge_claims(claims: Sequence[Optional[ReducerClaims]], parts: Sequence[ReducedPart]) -> Optional[ReducerClaims]:
    """One claims block on a slice from claims on its parts one by one (in order); None if one of them is None."""
    if not claims or any(c is None for c in claims):
        return None
    return ReducerClaims(header_digest(claimed_headers(parts)), np.sum([c.projections for c in claims], axis=0),
                         np.sqrt(np.sum([c.errors ** 2 for c in claims], axis=0)),
                         np.concatenate([c.coefficients for c in claims], axis=1),
                         np.concatenate([c.distances for c in claims], axis=1),
                         np.sum([c.result_projections(c.projections.shape[1]) for c in claims], axis=0),
                         math.sqrt(sum(c.result_error ** 2 for c in claims)))
