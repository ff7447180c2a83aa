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

Who is to blame (:func:`judge_slice`): the reducer also sends its *claims* (:func:`reducer_claims`): each other
sender's projections as it computed them from the part it decoded. The slice's arithmetic is checked on the claims
and the headers alone (an honest reducer passes whatever the members report: the reducer alone is blamed when it
fails), and each member's report against the reducer's claim about it: a contradiction is a *dispute* between the
two (both are blamed), except for the checker's own report, whose truth the checker knows (a false claim about it
blames the reducer alone). So a member that reports falsely to frame an honest reducer burns its own seat with every
honest checker. The layouts and the reports are :mod:`lightning_swarm.reducer_reports` (re-exported here).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional, Sequence, Tuple

import numpy as np
import torch

from lightning_swarm.reducer_reports import (  # noqa: F401 (re-exported: the layouts and the reports)
    CLIP_SLACK, FALSE_ALARM, HEADER_BYTES, HEADER_FIELDS, MAX_SENDERS, MODE_CLIPPED, MODE_KEEP, MODE_MEAN,
    PROJECTION_ROUNDING, PROJECTIONS, RESULT_ROUNDING, SUM_SLACK, Combination, MalformedReport, ReceivedPart,
    ReducedPart, ReducerClaims, ResultHeader, SliceReport, claims_length, decode_claims, decode_report, encode_claims,
    encode_header, encode_report, header_digest, massless_report, member_report, merge_claims, merge_reports,
    parse_header, part_seed, project, project_many, reducer_claims, report_length, SignSource)


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
    if norm == 0.0 and compression in ("NONE", "BLOCKWISE_8BIT"):
        # only there do zeros decode from exact zeros alone (a block's absmax maps to a level of magnitude ~1); a
        # float16 zero was any value within 2**-25: the formulas below hold for a zero norm too
        return 0.0
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


# who a failed check blames (Verdict.blame)
BLAME_NONE, BLAME_REDUCER, BLAME_DISPUTE = "none", "reducer", "dispute"
# relative slack of a claimed distance over a member's upper bound of it (float32 norms of the same vector)
DISTANCE_SLACK = 1e-5


@dataclass(frozen=True)
class Verdict:
    """A checker's verdict on one reducer's slice: ``reason`` (None: it passes), ``blame`` (BLAME_NONE: it passes or
    can't be checked; BLAME_REDUCER: the reducer alone; BLAME_DISPUTE: the reducer and each member at ``disputed``,
    positions in the reports, contradict each other and the checker can't tell which one lies)."""

    reason: Optional[str]
    blame: str = BLAME_NONE
    disputed: Tuple[int, ...] = ()


def _contradiction(report: SliceReport, claims: ReducerClaims, sender: int, modes: Sequence[int],
                   limit: float) -> Optional[str]:
    """How a member's report and the reducer's claims about that member contradict each other (None: they agree
    within both error bounds)."""
    if np.any(np.abs(report.coefficients - claims.coefficients[sender]) > SUM_SLACK * 1e-3):
        return "a coefficient other than the one in its header"
    if np.any(claims.distances[sender] > report.distances * (1 + DISTANCE_SLACK)):
        return "a distance to the result beyond the one it got"
    if any(mode == MODE_KEEP and distance > 0 for mode, distance in zip(modes, report.distances)):
        return "a changed part where no sender was accepted"
    reason = _apart("a residual", report.projections - claims.projections[sender],
                    report.error + float(claims.errors[sender]), limit)
    if reason is not None:
        return reason
    # the result itself: a member with no mass in a part (b_j = 0) has no residual there to tell a lie told to it
    projections = len(report.projections)
    return _apart("a result", report.result_projections(projections) - claims.result_projections(projections),
                  report.result_error + claims.result_error, limit)


def _apart(what: str, difference: np.ndarray, bound: float, limit: float) -> Optional[str]:
    """How two projections of the same vector differ beyond ``bound`` by :func:`chernoff_limit` (None: they agree)."""
    statistic = float(np.sum(difference ** 2))
    if statistic > limit * bound ** 2:
        return (f"{what} that projects {math.sqrt(statistic / len(difference)):.4g} per vector away from the "
                f"reducer's claim where at most {bound:.4g} fits")
    return None


def _inconsistency(headers: Sequence[ResultHeader], claims: ReducerClaims, senders: Sequence[int],
                   reducer_sends: bool, limit: float) -> Optional[str]:
    """How the reducer's claims on the other senders ``senders`` contradict its own header (None: they fit)."""
    residual2 = 0.0
    slack = float(sum(claims.errors[s] for s in senders))
    for index, header in enumerate(headers):
        coefficients = [float(claims.coefficients[s, index]) for s in senders]
        distances = [float(claims.distances[s, index]) for s in senders]
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
    implied = -np.sum([claims.projections[s] for s in senders], axis=0)
    bound = math.sqrt(residual2) + slack
    statistic = float(np.sum(implied ** 2))
    if statistic > limit * bound ** 2:
        return (f"its own residual projects to {math.sqrt(statistic / len(implied)):.4g} per vector where at most "
                f"{bound:.4g} fits its header")
    return None


def _massless_row(stand_in: SliceReport, claims: ReducerClaims, sender: int, limit: float) -> Optional[str]:
    """How the reducer's claims about a member give it more than a massless sender's row (``stand_in``:
    :func:`massless_report`): a coefficient above 0, or residual projections other than its share of the virtual
    part (None: they don't). Distances are not compared: a sender without mass reaches nothing."""
    if np.any(claims.coefficients[sender] > 0):
        return "the reducer's claims give it mass"
    return _apart("a residual", stand_in.projections - claims.projections[sender],
                  stand_in.error + float(claims.errors[sender]), limit)


def judge_slice(headers: Sequence[ResultHeader], reports: Sequence[Optional[SliceReport]],
                claims: Optional[ReducerClaims], senders: Sequence[int], me: int, reducer_sends: bool,
                limit: float = CHERNOFF_LIMIT, stand_ins: Optional[Sequence[Optional[SliceReport]]] = None) -> Verdict:
    """A checker's verdict on one reducer's slice, and whom it blames.

    The checks of the slice's arithmetic use only what the reducer said (its headers to the checker, its claims):
    an honest reducer always passes them, whatever the members report. The members' reports are checked against
    the claims: a member that contradicts them is in a dispute with the reducer (one of the two lies; the checker
    can't tell which), except the checker itself, which knows its own part: a false claim about it blames the
    reducer alone. In order: (1) no claims or a missing report: unverifiable, nobody blamed; (2) the claims about
    the checker contradict its own report, or the claimed digest is not that of the headers it got: the reducer
    alone; (3) the claims contradict the header (coefficients that don't sum to 1, a reach beyond one clipped
    sender's, the claimed residuals not summing to minus the reducer's own within ``sigma_R`` and the rounding):
    the reducer alone; (4) another member's report contradicts the claims about it (projections beyond both error
    bounds by :func:`chernoff_limit`, a coefficient, a claimed distance beyond the one it got, a change where no
    sender was accepted, another header digest than the checker's): a dispute with each such member.

    Args:
        headers: the headers the checker received with each part of that slice.
        reports: every other sender's report on the slice (the checker's own among them); None where a sender
            reported nothing for it.
        claims: the reducer's claims on its slice (None: it sent none).
        senders: the sender index of each report's author (its row in the claims).
        me: the position of the checker's own report in ``reports``.
        reducer_sends: whether the reducer is itself a sender (else its own coefficient must be 0).
        limit: :func:`chernoff_limit`.
        stand_ins: per position, None or a massless sender's report (:func:`massless_report`), used instead of that
            member's report (ignored): for a member with no report on the slice (a NaN sender gets NaN results, so
            its rows are empty), or whose part the checker's own reducer refused for breaking the protocol (kept
            out already, it would lose nothing by framing a reducer: never a dispute). The slice passes only if the
            reducer's claims give that member no mass (else unverifiable, nobody blamed: a sender may send other
            reducers finite parts). Nothing hides in such a row: the result is then a combination of the reported
            parts alone, which a reducer may always make by refusing a sender. A report required from every member
            left a NaN sender's first round unverified for all (docs/security.md).
    """
    if claims is None:
        return Verdict("unverifiable: the reducer sent no claims on its slice")
    standing_in = {position for position, stand_in in enumerate(stand_ins or ()) if stand_in is not None
                   and position != me}
    for position in sorted(standing_in):
        reason = _massless_row(stand_ins[position], claims, senders[position], limit)
        if reason is not None:
            return Verdict(f"unverifiable: a member without a report it can be held to is not massless in the "
                           f"reducer's claims ({reason})")
    if any(report is None for position, report in enumerate(reports) if position not in standing_in):
        return Verdict("unverifiable: a member has no complete report on this slice")
    digest = header_digest(headers)
    modes = [header.mode for header in headers]
    if claims.digest != digest:
        return Verdict("its claims name other headers than the ones it sent this member", BLAME_REDUCER)
    reason = _contradiction(reports[me], claims, senders[me], modes, limit)
    if reason is not None:
        return Verdict(f"its claims about this member are false ({reason})", BLAME_REDUCER)
    reason = _inconsistency(headers, claims, senders, reducer_sends, limit)
    if reason is not None:
        return Verdict(reason, BLAME_REDUCER)
    disputed, reasons = [], []
    for position, (report, sender) in enumerate(zip(reports, senders)):
        if position == me or position in standing_in:
            continue
        reason = ("other headers than this member's" if report.digest != digest
                  else _contradiction(report, claims, sender, modes, limit))
        if reason is not None:
            disputed.append(position)
            reasons.append(reason)
    if disputed:
        return Verdict(f"a member's report contradicts the reducer's claims about it ({reasons[0]})", BLAME_DISPUTE,
                       tuple(disputed))
    return Verdict(None)


# a member that withholds its verification messages makes the round's slices unverifiable (refused, nobody blamed):
# kept out once it did so in this many rounds, net of a quarter strike forgiven per round it was verified in
WITHHOLDING_STRIKES = 3
FORGIVEN_PER_VERIFIED_ROUND = 0.25


class WithholdingRecord:
    """Strikes of the members that withheld their verification messages (a commitment, a valid nonce, a well-formed
    report) in rounds they otherwise completed (they sent their parts and reduced their slices: not a member that
    died during the round), by member. A member that does so in ``strikes`` rounds, net of ``forgiven`` strike per
    round it was verified in, is to be kept out: withholding used to cost nobody a seat, and a member could make a
    reducer's slice unverifiable round after round. An honest member that misses the exchange now and then (a slow
    or flaky link: fewer than one round in five by default) never gets there; one that died is counted once.

    Args:
        strikes: the strikes at which a member is to be kept out.
        forgiven: strikes taken off per round in which the member was verified (its report came).
    """

    def __init__(self, strikes: int = WITHHOLDING_STRIKES, forgiven: float = FORGIVEN_PER_VERIFIED_ROUND):
        if strikes < 1 or forgiven < 0:
            raise ValueError(f"strikes must be >= 1 and forgiven >= 0, got {strikes!r}, {forgiven!r}")
        self.strikes, self.forgiven = strikes, forgiven
        self._strikes = {}

    def withheld(self, member) -> bool:
        """Count a round in which ``member`` withheld its messages; returns whether it is now to be kept out."""
        self._strikes[member] = self._strikes.get(member, 0.0) + 1.0
        return self._strikes[member] >= self.strikes

    def verified(self, member) -> None:
        """Count a round in which ``member``'s report came."""
        if member in self._strikes:
            self._strikes[member] = max(0.0, self._strikes[member] - self.forgiven)

    def __getitem__(self, member) -> float:
        return self._strikes.get(member, 0.0)
