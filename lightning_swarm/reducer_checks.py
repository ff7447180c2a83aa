"""The arithmetic of checking a reducer's result (issue 24, item 9): no hivemind here.

In a butterfly all-reduce each member reduces one slice for the whole group, and a reducer that returns a wrong but
finite slice was believed. Now a reducer's result for each part is an exact combination of the parts it received
and of one "virtual" part (``start``: zeros for the 2-sender clip and a refused lone sender; it gets no mass in
CenteredClip and the mean):

    v = sum_j b_j x_j + c0 * start,   b_j >= 0,   sum_j b_j + c0 = 1,

so ``sum_j b_j (x_j - v) + c0 (start - v) = 0``. The reducer tells each sender its own ``b_j``, and everyone the
same header: its own coefficient ``b_R``, ``c0``, its own weighted residual ``sigma_R = b_R |x_R - v|``, its weight
share ``a_R`` and how many senders it accepted (:class:`ResultHeader`). After the round every member projects its
own residual ``b_j (x_j - v)`` (minus its received delta, times ``b_j``) on a few random sign vectors drawn from a
seed nobody knew while the results were sent (:func:`project_residuals`); the reducer's own residual is then minus
the sum of the others', and it must look like a vector of norm at most ``sigma_R`` plus the codec's rounding
(:func:`chernoff_limit`: a bound for sub-Gaussian projections that an honest result exceeds with probability below
``FALSE_ALARM``). With CenteredClip (``mode`` CLIPPED) the reducer also clips its own part against the result:
``sigma_R <= a_R * max_j |x_j - v|`` over the other senders with mass, exact by construction
(:func:`clip_own_coefficient`), and ``a_R`` is at most ``1 / (floor(n / 2) + 1)`` of ``n`` accepted senders (the
median cap). So a reducer can move its slice no further than one clipped sender of its weight, whatever it sends.
"""

from __future__ import annotations

import hashlib
import math
import struct
from dataclasses import dataclass
from typing import List, Optional, Sequence, Tuple

import numpy as np
import torch

# random sign vectors per part: each costs ~1.3 ns per value on one core (generation and product)
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


def chernoff_limit(projections: int = PROJECTIONS, false_alarm: float = FALSE_ALARM) -> float:
    """``U`` such that ``P(sum_k t_k^2 > U B^2) <= false_alarm`` for ``projections`` independent projections
    ``t_k = <r, z_k>`` of a fixed vector ``|r| <= B`` on random sign vectors: each is sub-Gaussian with variance proxy
    ``B^2``, so ``E exp(l t_k^2) <= (1 - 2 l B^2)^(-1/2)`` and Chernoff gives ``(U/K)^(K/2) exp((K - U)/2)``."""
    k = projections
    low, high = float(k), 10.0 * k + 200.0
    for _ in range(200):
        mid = (low + high) / 2
        if (k / 2) * math.log(mid / k) + (k - mid) / 2 > math.log(false_alarm):
            low = mid
        else:
            high = mid
    return high


CHERNOFF_LIMIT = chernoff_limit()


def _distances(gram: np.ndarray, b: np.ndarray) -> np.ndarray:
    """|x_j - v| for v = start + D b and x_j = start + D e_j, from D's Gram matrix."""
    diffs = np.eye(len(b)) - b
    return np.sqrt(np.maximum(np.einsum("ik,kl,il->i", diffs, gram, diffs), 0.0))


def _reach_ok(gram: np.ndarray, b: np.ndarray, own: int, share: float) -> bool:
    distances = _distances(gram, b)
    others = [j for j in range(len(b)) if j != own and b[j] > 0]
    radius = max((float(distances[j]) for j in others), default=0.0)
    return b[own] * distances[own] <= share * radius


def clip_own_coefficient(gram: np.ndarray, b: np.ndarray, zero: float, own: int, share: float,
                         ) -> Tuple[np.ndarray, float]:
    """The reducer's own part clipped against the result, exactly: the largest scale ``t`` in [0, 1] of its own
    coefficient (the others' and the virtual part's renormalised) such that ``b_R |x_R - v| <= share * max_j
    |x_j - v|`` over the other senders with mass. Distances from ``gram`` (``x_j = start + D e_j``, ``v = start +
    D b``). Returns (b, c0) after the clip (unchanged if it already holds)."""
    b = np.asarray(b, dtype=np.float64)

    def scaled(t: float) -> Tuple[np.ndarray, float]:
        total = 1.0 - b[own] + t * b[own]
        out = b / total
        out[own] = t * b[own] / total
        return out, zero / total

    if b[own] <= 0 or _reach_ok(gram, b, own, share):
        return b, zero
    low, high = 0.0, 1.0  # the reach holds at t = 0 (no own mass), not at t = 1
    for _ in range(60):
        mid = (low + high) / 2
        if _reach_ok(gram, scaled(mid)[0], own, share):
            low = mid
        else:
            high = mid
    return scaled(low)


def combination(b: np.ndarray, zero: float, gram: np.ndarray, senders: Sequence[int], num_senders: int,
                own: Optional[int], share: float, mode: int) -> Combination:
    """A :class:`Combination` from coefficients ``b`` over the accepted senders ``senders`` (indices among all
    ``num_senders``), the reducer's position ``own`` among them (None: it sent nothing accepted), and the Gram matrix
    of the basis (for the reducer's residual)."""
    coefficients = [0.0] * num_senders
    for sender, value in zip(senders, b):
        coefficients[sender] = float(value)
    own_b = residual = 0.0
    if own is not None:
        own_b = float(b[own])
        residual = own_b * float(_distances(gram, b)[own])
    return Combination(tuple(coefficients), float(zero), own_b, residual, float(share), len(senders), mode)


def keep_combination(num_senders: int) -> Combination:
    """No sender was accepted: every sender gets its own part back (a zero delta)."""
    return Combination((0.0,) * num_senders, 0.0, 0.0, 0.0, 0.0, 0, MODE_KEEP)


def rounding_bound(compression: str, values: torch.Tensor, header: Optional[Tuple[np.ndarray, np.ndarray]] = None,
                   ) -> float:
    """An upper bound of the L2 norm of the rounding error a codec made on ``values`` (the decoded tensor).

    Args:
        compression: the message's compression type name.
        values: the decoded values.
        header: (absmax per block, codebook) of a BLOCKWISE_8BIT message, or (None, codebook) of a codebook one.
    """
    flat = values.reshape(-1).float()
    n = flat.numel()
    if n == 0:
        return 0.0
    norm = float(flat.norm())
    if norm == 0.0:
        return 0.0  # exact zeros (an honest "no change") decode from zeros
    if compression == "NONE":
        return norm * 2.0 ** -23 if values.dtype == torch.float32 else norm * 2.0 ** -7
    if compression == "FLOAT16":
        return norm * 2.0 ** -10 + math.sqrt(n) * 2.0 ** -24
    if compression == "MEANSTD_16BIT":
        return norm * 2.0 ** -9 + math.sqrt(n) * 2.0 ** -24
    if header is not None:
        absmax, code = header
        levels = np.concatenate(([-1.0], np.sort(code.astype(np.float64)), [1.0]))
        gap = float(np.max(np.diff(levels))) if len(levels) > 1 else 2.0  # nearest or not: within one gap
        if absmax is not None:
            sizes = np.full(len(absmax), 4096.0)
            sizes[-1] = n - 4096 * (len(absmax) - 1)
            return float(math.sqrt(float(np.sum(sizes * (absmax.astype(np.float64) * gap) ** 2))))
        span = float(np.ptp(code)) if len(code) else 0.0
        return math.sqrt(n) * max(gap, span)
    return 2.0 * norm + 1.0  # unknown codec: nothing known about its rounding


def part_seed(seed: bytes, reducer: int, part: int) -> int:
    """The generator seed of one part's random vectors."""
    return int.from_bytes(hashlib.sha256(seed + struct.pack("<qq", reducer, part)).digest()[:8], "little") >> 1


def project(vectors: Sequence[Tuple[torch.Tensor, float]], seed: int, projections: int = PROJECTIONS) -> np.ndarray:
    """``sum_v scale_v <v, z_k>`` for ``projections`` random sign vectors ``z_k`` (seeded), in float64; the
    vectors (flat, same length) share the z's."""
    generator = torch.Generator().manual_seed(seed)
    flats = [(vector.reshape(-1).to(torch.float32), scale) for vector, scale in vectors if scale != 0.0]
    out = np.zeros(projections)
    size = vectors[0][0].numel() if vectors else 0
    for first in range(0, size, _CHUNK):
        width = min(_CHUNK, size - first)
        bits = torch.randint(-2 ** 62, 2 ** 62, ((projections * width + 7) // 8,), dtype=torch.int64,
                             generator=generator).view(torch.int8)[:projections * width].view(projections, width)
        if not flats:
            continue
        signs = (bits >> 7).mul_(2).add_(1).to(torch.float32)  # -1 or +1, each with probability 1/2
        chunk = flats[0][0][first:first + width] * flats[0][1]
        for flat, scale in flats[1:]:
            chunk = chunk.add(flat[first:first + width], alpha=scale)
        out += (signs @ chunk).double().numpy()
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


def check_slice(headers: Sequence[ResultHeader], reports: Sequence[Optional[SliceReport]], reducer_sends: bool,
                limit: float = CHERNOFF_LIMIT) -> Optional[str]:
    """A checker's verdict on one reducer's slice: None if it passes, else the reason.

    Args:
        headers: the headers the checker received with each part of that slice.
        reports: every other sender's report on the slice (the checker's own among them), in any order; None where
            a sender reported nothing for it (then the slice can't be checked: a reason is returned).
        reducer_sends: whether the reducer is itself a sender (else its own coefficient must be 0).
        limit: :func:`chernoff_limit`.
    """
    if any(report is None for report in reports):
        return "unverifiable: a member has no complete report on this slice"
    digest = header_digest(headers)
    if any(report.digest != digest for report in reports):
        return "its members received different headers"
    residual2 = 0.0
    slack = sum(report.error for report in reports)  # the members' rounding: also the scale of the reducer's own
    for index, header in enumerate(headers):
        coefficients = [float(report.coefficients[index]) for report in reports]
        distances = [float(report.distances[index]) for report in reports]
        if not reducer_sends and header.own > 0:
            return f"part {index}: a coefficient of its own though it sent no part"
        if header.mode == MODE_KEEP:
            if any(c > 0 for c in coefficients) or header.own > 0 or header.zero > 0:
                return f"part {index}: coefficients where no sender was accepted"
            if any(d > 0 for d in distances):
                return f"part {index}: a changed part where no sender was accepted"
            continue
        total = sum(coefficients) + header.own + header.zero
        if abs(total - 1.0) > SUM_SLACK * (len(coefficients) + 2):
            return f"part {index}: coefficients that sum to {total:.9g}, not 1"
        positive = sum(c > 0 for c in coefficients) + (header.own > 0)
        if header.accepted < positive:
            return f"part {index}: {positive} senders with mass but {header.accepted} accepted"
        if header.mode == MODE_CLIPPED:
            if header.share > 1.0 / (header.accepted // 2 + 1) + SUM_SLACK:
                return f"part {index}: a weight share {header.share:.4g} above the median cap"
            radius = max((d for c, d in zip(coefficients, distances) if c > 0), default=0.0)
            if header.residual > header.share * radius * (1 + CLIP_SLACK) + slack:
                return (f"part {index}: its own residual {header.residual:.4g} beyond one clipped sender's reach "
                        f"{header.share * radius:.4g}")
        residual2 += header.residual ** 2
    implied = -np.sum([report.projections for report in reports], axis=0)
    bound = math.sqrt(residual2) + sum(report.error for report in reports)
    statistic = float(np.sum(implied ** 2))
    if statistic > limit * bound ** 2:
        return (f"its own residual projects to {math.sqrt(statistic / len(implied)):.4g} per vector where at most "
                f"{bound:.4g} fits its header")
    return None


def _weighted_median(values: np.ndarray, weights: np.ndarray) -> float:
    order = np.argsort(values, kind="stable")
    index = min(int(np.searchsorted(np.cumsum(weights[order]), 0.5 - 1e-6)), len(values) - 1)
    return float(values[order[index]])


def final_step(gram: np.ndarray, a: np.ndarray, weights: np.ndarray, radius: Optional[float], own: Optional[int],
               share: float) -> np.ndarray:
    """CenteredClip's last step made exact: from the iterate ``v_t = start + D a``, the coefficients ``b_i =
    w_i min(1, tau / |x_i - v_t|)`` normalised (``tau``: ``radius``, or the weighted median of the distances when
    None), so that the result ``start + D b`` is the combination ``sum_i b_i x_i``; then the reducer's own part
    (``own``) is clipped against that result (:func:`clip_own_coefficient`). Returns ``b``."""
    distances = _distances(gram, a)
    tau = _weighted_median(distances, weights) if radius is None else float(radius)
    scale = np.where(distances > tau, tau / np.maximum(distances, 1e-300), 1.0)
    b = weights * scale
    b = b / b.sum()
    if own is not None:
        b, _ = clip_own_coefficient(gram, b, 0.0, own, share)
    return b


def mean_combination(weights: Sequence[float], own: Optional[int], own_distance: float) -> Combination:
    """The weighted mean's statement (coefficients over the accepted senders; remap with :func:`remapped`)."""
    b = np.asarray(weights, dtype=np.float64) / float(sum(weights))
    own_b = float(b[own]) if own is not None else 0.0
    return Combination(tuple(float(x) for x in b), 0.0, own_b, own_b * own_distance, own_b, len(b), MODE_MEAN)


def remapped(statement: Combination, accepted: Sequence[int], num_senders: int) -> Combination:
    """A statement over the accepted senders with its coefficients moved to their sender indices."""
    coefficients = [0.0] * num_senders
    for sender, value in zip(accepted, statement.coefficients):
        coefficients[sender] = value
    return Combination(tuple(coefficients), statement.zero, statement.own, statement.residual, statement.share,
                       statement.accepted, statement.mode)


def zeros_combination(num_senders: int, accepted: int) -> Combination:
    """A part refused for everyone (zeros): all the mass on the virtual part (zeros)."""
    return Combination((0.0,) * num_senders, 1.0, 0.0, 0.0, 0.0, accepted, MODE_CLIPPED)


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
