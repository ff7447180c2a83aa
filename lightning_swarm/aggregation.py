"""How one tensor part received from the peers of an averaging group becomes the group's result.

hivemind's all-reduce adds every sender's part, scaled by the weight the sender itself put in its message, and
divides by the sum of the weights: one sender with weight 1e9 decides the result, and one NaN (in a part or a
weight) makes it NaN for everyone. This module holds the arithmetic that replaces it (the all-reduce plumbing that
calls it is in :mod:`lightning_swarm.hivemind_ext.robust_allreduce`):

- :func:`screen_contributions` checks each sender's weight (finite, > 0, at most the bound the receiver knows
  for that sender, e.g. the samples it reported to the progress tracker) and part (finite), and says why each
  refused sender was refused;
- :func:`weighted_mean` is hivemind's mean over what passed;
- :func:`centered_clip` is CenteredClip (Karimireddy, He and Jaggi, "Learning from History for Byzantine Robust
  Optimization", ICML 2021; in a butterfly all-reduce as in Gorbunov et al., "Secure Distributed Training at
  Scale", ICML 2022): starting from the coordinate-wise median, repeat ``v += sum_i w_i * clip_tau(x_i - v) /
  sum_i w_i``, where ``clip_tau`` scales a difference down to L2 norm ``tau``. A minority of senders can move the
  result by at most about ``tau`` times their share of the weight, whatever they send. Weights are capped at the
  median weight first, so that no single sender holds the majority of the weight.
"""

from __future__ import annotations

import math
import threading
from dataclasses import dataclass
from typing import Dict, Hashable, List, Optional, Sequence, Tuple

import numpy as np
import torch

from lightning_swarm import reducer_checks as exact

AGGREGATION_CHOICES = ("mean", "centered_clip")
DEFAULT_CENTERED_CLIP_ITERS = 20
# CenteredClip stops early once an iteration moves the result by less than this fraction of its norm (far below
# the 8-bit codec's rounding of what is sent, ~1e-2 of a block's largest value)
CENTERED_CLIP_TOLERANCE = 1e-4
# aligned_centered_clip: a sender whose part goes along less than this fraction of the robust estimate loses weight
# (the value measured in docs/security.md; HivemindStrategy's option is off by default)
DEFAULT_MIN_ALIGNMENT = 0.5
# aligned_centered_clip with 2 senders whose parts agree in direction: each part is clipped to this many times the
# shorter one's norm (parts that disagree: to the shorter one's norm)
TWO_SENDER_AGREEING_CLIP = 2.0
# a record from past rounds (SenderTrust) that lets a sender be believed: alone in a part
# (small_rounds.LONE_SENDER_MIN_TRUST), or as the reference of a round of 2 (_two_sender_clip)
TRUSTED_RECORD = 0.5
# aligned_centered_clip: a sender more than this many times the vote's radius from the vote is left out of the vote
FAR_FROM_VOTE = 10.0
# SenderTrust: a judged round weighs this much relative to the next one (~5 rounds of memory)
TRUST_DECAY = 0.8


def all_finite(tensor: torch.Tensor) -> bool:
    """Whether every value of ``tensor`` is finite. Exact, and in the common case one summation: a NaN or Inf makes
    the sum non-finite; only then (or when finite values overflow the sum) is every value checked (an
    ``isfinite`` mask of a 2 MB part costs ~20 times the sum)."""
    if not tensor.is_floating_point():
        return True
    if bool(torch.isfinite(tensor.sum())):
        return True
    return bool(torch.isfinite(tensor).all())


@dataclass
class Refusal:
    """One sender's contribution to one part that was left out, and why (for the log).

    ``breaks_protocol``: no honest peer sends this (a NaN or Inf part or weight, a negative weight: an honest peer's
    local guard sends zeros with weight 0 instead), so the sender can be kept out of later groups at once."""

    sender: int
    reason: str
    breaks_protocol: bool = False


def screen_contributions(
    parts: Sequence[Optional[torch.Tensor]],
    weights: Sequence[float],
    max_weights: Optional[Sequence[float]] = None,
) -> tuple[List[int], List[float], List[Refusal]]:
    """Which senders' parts may enter the aggregate, with which weight.

    Args:
        parts: each sender's part (None: the sender sent nothing for it).
        weights: the weight each sender claimed in its message.
        max_weights: the largest weight the receiver accepts from each sender (None: no bound). A larger claim is
            lowered to the bound (an honest peer's claim may run slightly ahead of its last progress record).

    Returns (indices of the accepted senders, their weights, refusals). A weight of exactly 0 is hivemind's way of
    tagging along without contributing: left out, but not a refusal, unless its part holds NaN or Inf (an honest
    gradient averager's local guard sends zeros: a NaN sender whose own guard set its weight to 0 went on making
    every round it joined unverifiable, its claims on its own slice not finite).
    """
    accepted, accepted_weights, refusals = [], [], []
    for sender, (part, weight) in enumerate(zip(parts, weights)):
        if part is None:
            continue
        weight = float(weight)
        if weight == 0.0:
            if not all_finite(part):
                refusals.append(Refusal(sender, "its part holds NaN or Inf values", breaks_protocol=True))
            continue
        if not math.isfinite(weight) or weight < 0:
            refusals.append(Refusal(sender, f"weight {weight!r} is not a finite positive number",
                                    breaks_protocol=True))
            continue
        if max_weights is not None:
            bound = float(max_weights[sender])
            if not bound > 0:
                refusals.append(Refusal(sender, f"weight {weight:g} from a sender with no samples on record"))
                continue
            if weight > bound:
                refusals.append(Refusal(sender, f"weight {weight:g} lowered to {bound:g}, the samples on record"))
                weight = bound  # still accepted, with the bound as its weight
        if not all_finite(part):
            refusals.append(Refusal(sender, "its part holds NaN or Inf values", breaks_protocol=True))
            continue
        accepted.append(sender)
        accepted_weights.append(weight)
    return accepted, accepted_weights, refusals


def weighted_mean(parts: Sequence[torch.Tensor], weights: Sequence[float]) -> torch.Tensor:
    """sum_i w_i x_i / sum_i w_i (hivemind's aggregation), in float32."""
    total = float(sum(weights))
    result = torch.zeros_like(parts[0], dtype=torch.float32)
    for part, weight in zip(parts, weights):
        result.add_(part, alpha=weight / total)
    return result


def centered_clip(
    parts: Sequence[torch.Tensor],
    weights: Sequence[float],
    tau: Optional[float] = None,
    iters: int = DEFAULT_CENTERED_CLIP_ITERS,
    statement: Optional[list] = None,
    own: Optional[int] = None,
) -> torch.Tensor:
    """CenteredClip of ``parts`` (same shape) with ``weights``, see the module docstring (``statement``, ``own``:
    see :func:`aligned_centered_clip`).

    Args:
        parts: the senders' parts (finite).
        weights: their weights (finite, > 0); each is capped at the median weight.
        tau: clipping radius (L2 norm of a part's difference from the current estimate). None: at each iteration,
            the weighted median of the senders' distances to the estimate, so that the nearer half of the weight is
            not clipped; this follows the scale of whatever is averaged (gradients, parameters, optimizer state).
        iters: at most this many iterations (fewer once the estimate stops moving).
    """
    return aligned_centered_clip(parts, weights, tau, iters, min_alignment=None, statement=statement, own=own)[0]


def aligned_centered_clip(
    parts: Sequence[torch.Tensor],
    weights: Sequence[float],
    tau: Optional[float] = None,
    iters: int = DEFAULT_CENTERED_CLIP_ITERS,
    min_alignment: Optional[float] = DEFAULT_MIN_ALIGNMENT,
    prior: Optional[Sequence[float]] = None,
    statement: Optional[list] = None,
    own: Optional[int] = None,
) -> tuple[torch.Tensor, List[float], List[float]]:
    """CenteredClip (:func:`centered_clip`) in which each sender's weight is scaled by how far it supports the
    group's direction, and by ``prior`` (its record from past rounds, :class:`SenderTrust`).

    First the senders vote, one vote each: their CenteredClip ``u`` is the group's direction, decided by the majority
    of senders whatever their sample counts or history (a peer that had few samples this round does not hand the
    attacker half the weight). A sender's alignment is ``s_i = <x_i, u> / |u|^2``, the fraction of that step its own
    part goes along (an honest gradient: about 1; a negated one: about -1). A sender with ``s_i`` below
    ``min_alignment`` keeps ``max(s_i, 0) / min_alignment`` of its weight. Then CenteredClip runs with the senders'
    weights (capped at the median) times ``prior`` times those factors. So a sender kept at full weight goes along
    at least ``min_alignment`` of the step: it can lower the result's component along ``u`` by at most
    ``1 - min_alignment`` times its weight share, whatever it sends. The reference is the robust estimate itself, as
    FLTrust (Cao et al., NDSS 2021) scores each sender against a trusted gradient. A sender more than
    ``FAR_FROM_VOTE`` times the vote's radius away is left out of the vote, which is taken again at the same radius:
    clipped, it still bent the vote by about half the others' spread.

    Lowering an honest sender's weight (its part was noisy) raises everyone else's share, an attacker's too: so
    whenever weights were lowered or a sender is far from the vote, the second CenteredClip keeps the clipping radius
    of the vote (``tau`` if given), the scale of the honest distances, and a sender far away still moves the result
    by at most that radius; and a sender the vote clipped keeps at most the weight the unclipped ones kept together.
    With 2 senders alignment can't tell who lies (their alignments add up to 2): ``prior`` weighs them, and each
    part is clipped to the smaller norm of the two (:func:`_two_sender_clip`), so that a loud one can't decide.

    Args:
        parts, weights, tau, iters: as :func:`centered_clip`.
        min_alignment: in (0, 1], or None: no alignment screen (``prior`` still applies).
        prior: each sender's weight factor in [0, 1] from past rounds (None: 1 each). Counts only if some sender's is
            at least ``TRUSTED_RECORD`` (records all low can't tell who is honest). If the alignment factors would
            leave no weight at all, the senders weigh as in the vote.
        statement: if a list, the result is made an exact combination of the parts (one last CenteredClip step with
            the final clip scales as coefficients; the part ``own``, the reducer's, clipped against the result), and
            its :class:`~lightning_swarm.reducer_checks.Combination` is appended (see that module).
        own: the reducer's own part among ``parts`` (None: it sent none), with ``statement``.

    Returns (the result, each sender's alignment factor this round: 1.0 for a sender kept at full weight (with 2
    senders: their agreement, see :func:`_two_sender_clip`), each sender's clip scale in the vote:
    ``min(1, radius / |x_i - u|)``, 1.0 for a sender within the radius (with 2 senders: its scale in
    :func:`_two_sender_clip`); both 1.0 without the screen or with 1 sender).
    """
    if len(parts) == 1:
        if statement is not None:
            statement.append(exact.combination(np.ones(1), 0.0, np.zeros((1, 1)), [0], 1, own, 1.0, exact.MODE_CLIPPED))
        return parts[0].to(torch.float32).clone(), [1.0], [1.0]
    rows = [p.reshape(-1).to(torch.float32) for p in parts]
    n, size = len(rows), rows[0].numel()
    w = torch.tensor(weights, dtype=torch.float64)
    # no sender outweighs the median sender: CenteredClip resists a minority of the weight, and a fast (or lying)
    # peer must not buy a majority with its sample count
    w = torch.minimum(w, w.median())
    w = (w / w.sum()).numpy()
    if n == 2 and min_alignment is not None:
        return _two_sender_clip(rows, w, prior, parts[0].shape, statement, own)
    # The estimate stays its start plus a combination of the senders' differences from it, v = start + D a with
    # D = (x_1 - start, ..., x_n - start): each step adds sum_i c_i (x_i - v) = D (sum_i c_i (e_i - a)). So the
    # iterations run on the n coefficients a and the n x n Gram matrix of D, and the part is built once at the end:
    # 3 passes over the data (differences, Gram, result) instead of ~10 per iteration. Differences, not the parts
    # themselves, keep the distances exact where the parts nearly agree.
    # rows 0..n-1: the differences D; row n: the start (its products with D give the estimate's norm for free)
    basis = _scratch("basis", (n + 1) * size).view(n + 1, size)
    start, differences = basis[n], basis[:n]
    if n > 2:
        _coordinate_median(rows, out=start)
    else:
        torch.add(rows[0] * float(w[0]), rows[1], alpha=float(w[1]), out=start)
    for row, difference in zip(rows, differences):
        torch.sub(row, start, out=difference)
    products = _gram(basis)
    gram, start_products, start_norm2 = products[:n, :n], products[:n, n], products[n, n]
    # n numbers a step: numpy, whose calls on tiny arrays cost microseconds where torch's cost tens
    scaled = w
    # the records count only if a sender is trusted (as in _two_sender_clip): records all near 0 (honest peers'
    # noisy slices, a loud sender's ~0.01), renormalised, would hand the weight to the one a little less low
    if prior is not None and max(prior) >= TRUSTED_RECORD:
        scaled = w * np.asarray(prior, dtype=np.float64)
    factors, radius, scales = np.ones(n), tau, np.ones(n)
    if min_alignment is not None and n > 2:
        direction, vote_radius = _clip_coefficients(np.full(n, 1.0 / n), gram, start_products, start_norm2, tau, iters)
        # a sender far outside the others (x1e3, -1e3 x) still bends the vote towards it by about half the others'
        # spread (the radius is theirs), and where honest parts are mostly noise (near convergence, small parts) they
        # were then judged against its direction: the vote is taken again without it, at the same radius
        vote_weights = np.full(n, 1.0 / n)
        far = _distances(direction, gram) > FAR_FROM_VOTE * vote_radius
        if far.any() and (~far).sum() >= 2:
            vote_weights = np.where(far, 0.0, 1.0 / (~far).sum())
            direction, vote_radius = _clip_coefficients(vote_weights, gram, start_products, start_norm2, vote_radius,
                                                        iters)
        # <x_i, u> and |u|^2 from the Gram matrix: x_i = start + D e_i, u = start + D a
        along = start_norm2 + start_products @ direction + start_products + gram @ direction
        norm2 = start_norm2 + 2 * start_products @ direction + direction @ gram @ direction
        if norm2 > 0:
            factors = np.clip(along / norm2 / min_alignment, 0.0, 1.0)
            if (scaled * factors).sum() > 0:
                scaled = scaled * factors
            else:  # no sender goes along the vote (parts of noise): they weigh as in the vote (a far one clipped)
                scaled = vote_weights
        scales = np.minimum(1.0, vote_radius / np.maximum(_distances(direction, gram), 1e-30))
        # a sender the vote clipped holds no more weight than the unclipped ones have left together: where the
        # screen took an honest sender's weight (its part, mostly noise, disagreed with the vote), a loud attacker
        # whose part goes along the vote held most of what remained (0.71 of it, measured: test_byzantine_swarm's
        # scale case, whose round-0 step then ended at up to 3.5x the initial loss): CenteredClip follows a majority
        clipped = scales < 1.0
        if clipped.any() and not clipped.all():
            scaled = np.where(clipped, np.minimum(scaled, scaled[~clipped].sum()), scaled)
            if scaled.sum() <= 0:  # no unclipped sender kept any weight: they weigh as in the vote
                scaled = vote_weights
        # a sender far from the vote (x1e3) or weights lowered: the vote's radius, the honest distances' scale.
        # CenteredClip's own radius (the weighted median distance) grows as the estimate moves away from the honest
        # parts: with a light honest sender (32 samples against 320 and 352) a far sender held half the weight and
        # moved the result by 4x the honest spread (round 0 of test_byzantine_swarm's scale case: loss 6.9 from 1.62)
        if far.any() or not np.allclose(scaled / scaled.sum(), w):
            radius = vote_radius
    coefficients, _ = _clip_coefficients(scaled / scaled.sum(), gram, start_products, start_norm2, radius, iters)
    if statement is not None:  # the last step with its clip scales as the coefficients: an exact combination
        coefficients = exact.final_step(gram, coefficients, scaled / scaled.sum(), radius, own,
                                        float(w[own]) if own is not None else 0.0)
        statement.append(exact.combination(coefficients, 0.0, gram, list(range(n)), n, own,
                                           float(w[own]) if own is not None else 0.0, exact.MODE_CLIPPED))
    estimate = torch.empty(size, dtype=torch.float32)  # fresh: it is handed to the senders
    torch.matmul(torch.from_numpy(coefficients).to(torch.float32).unsqueeze(0), differences,
                 out=estimate.view(1, size))
    estimate += start
    return estimate.reshape(parts[0].shape), factors.tolist(), scales.tolist()


def _two_sender_clip(rows: Sequence[torch.Tensor], w: np.ndarray, prior: Optional[Sequence[float]],
                     shape: torch.Size, statement: Optional[list] = None, own: Optional[int] = None,
                     ) -> tuple[torch.Tensor, List[float], List[float]]:
    """Two senders (see :func:`aligned_centered_clip`): nothing in one round tells which of them lies, and their
    CenteredClip is their mean, which a loud sender (x1e3, or -1e3: gradient ascent) decides. So each part is clipped
    to the smaller L2 norm of the two (the reference: the smaller norm among the senders whose weight ``w`` times
    ``prior`` is at least half the larger's; ``prior`` counts only if one of the two is at least ``TRUSTED_RECORD``,
    else both weigh ``w``), or to ``TWO_SENDER_AGREEING_CLIP`` times it if the two parts agree in
    direction (inner product >= 0), then weighted by ``w`` times ``prior``. Whatever one of them sends, the result
    goes along the other's part (its component along it is at least 0) and is at most 1.5 times as long as it.
    Returns (result, the pair's agreement twice: the cosine of the angle between the two parts, at least 0; each
    sender's ratio ``min(1, reference norm / its norm)``). The agreement is what lets an honest sender's record
    recover in a swarm whose rounds have 2 senders (:func:`lightning_swarm.small_rounds.two_sender_records`)."""
    scaled = w
    # the records decide only if one of the two is trusted: records both near 0 (an honest peer's noisy slice can
    # record 0 in a round of 3, a loud one's records ~0.01) would otherwise hand the weight, and the reference norm,
    # to whichever is a little less low, a loud ascent included (its part then decided the round, reversed x1e3)
    if prior is not None and max(prior) >= TRUSTED_RECORD:
        scaled = w * np.asarray(prior, dtype=np.float64)
    norms = np.array([math.sqrt(max(float(torch.dot(row, row)), 0.0)) for row in rows])
    # the reference is a sender of (about) full weight: one its record almost silenced must not shrink the other
    reference = float(norms[scaled >= 0.5 * scaled.max()].min())
    ratios = np.minimum(1.0, reference / np.maximum(norms, 1e-30))
    # parts that agree in direction (inner product >= 0) can't turn each other back: up to TWO_SENDER_AGREEING_CLIP
    # times the reference only bounds how much longer the step gets (noisy honest parts differ in length)
    dot = float(torch.dot(rows[0], rows[1]))
    agree = dot >= 0.0
    scales = np.minimum(1.0, ratios * TWO_SENDER_AGREEING_CLIP) if agree else ratios
    agreement = min(1.0, max(0.0, dot / max(float(norms[0] * norms[1]), 1e-30)))
    coefficients = scaled * scales / scaled.sum()
    if statement is not None:  # v = b_0 x_0 + b_1 x_1 + (1 - b_0 - b_1) * 0: the virtual part is zeros
        gram = np.array([[norms[0] ** 2, dot], [dot, norms[1] ** 2]])
        zero = 1.0 - float(coefficients.sum())
        if own is not None:
            coefficients, zero = exact.clip_own_coefficient(gram, coefficients, zero, own, float(w[own]))
        statement.append(exact.combination(coefficients, max(zero, 0.0), gram, [0, 1], 2, own,
                                           float(w[own]) if own is not None else 0.0, exact.MODE_CLIPPED))
    estimate = torch.mul(rows[0], float(coefficients[0]))
    estimate.add_(rows[1], alpha=float(coefficients[1]))
    return estimate.reshape(shape), [agreement, agreement], ratios.tolist()


def _clip_coefficients(w: np.ndarray, gram: np.ndarray, start_products: np.ndarray, start_norm2: float,
                       tau: Optional[float], iters: int) -> tuple[np.ndarray, float]:
    """CenteredClip's iterations on the coefficients ``a`` of ``v = start + D a`` (see :func:`aligned_centered_clip`),
    from ``a = 0``, with normalised weights ``w`` and ``D``'s Gram matrix. Returns (``a``, the last radius)."""
    n = len(w)
    coefficients = np.zeros(n)
    senders = np.eye(n)  # x_i - start in the basis D
    radius = 0.0
    for _ in range(iters):
        diffs = senders - coefficients  # x_i - v, per sender
        norms = np.sqrt(np.maximum(np.einsum("ik,kl,il->i", diffs, gram, diffs), 0.0))
        radius = _weighted_median(norms, w) if tau is None else float(tau)
        scale = np.where(norms > radius, radius / np.maximum(norms, 1e-30), 1.0)
        step = (w * scale) @ diffs
        coefficients += step
        norm2 = start_norm2 + 2 * coefficients @ start_products + coefficients @ gram @ coefficients  # |v|^2
        if math.sqrt(max(step @ gram @ step, 0.0)) <= CENTERED_CLIP_TOLERANCE * math.sqrt(max(norm2, 0.0)):
            break
    return coefficients, radius


def _distances(coefficients: np.ndarray, gram: np.ndarray) -> np.ndarray:
    """Each sender's distance to ``v = start + D coefficients`` (``x_i = start + D e_i``), from ``D``'s Gram matrix."""
    differences = np.eye(len(coefficients)) - coefficients
    return np.sqrt(np.maximum(np.einsum("ik,kl,il->i", differences, gram, differences), 0.0))


def _gram(rows: torch.Tensor) -> np.ndarray:
    """rows @ rows.T as float64: float32 products over blocks of columns, the blocks summed in float64."""
    gram = np.zeros((rows.shape[0], rows.shape[0]))
    block = 1 << 17
    for first in range(0, rows.shape[1], block):
        chunk = rows[:, first:first + block]
        gram += (chunk @ chunk.T).double().numpy()
    return gram


_SCRATCH = threading.local()


def _scratch(name: str, numel: int) -> torch.Tensor:
    """A float32 buffer of ``numel`` values, kept per thread and name for the next call (contents undefined)."""
    buffers = _SCRATCH.__dict__.setdefault("buffers", {})
    buffer = buffers.get(name)
    if buffer is None or buffer.numel() < numel:
        buffer = buffers[name] = torch.empty(numel, dtype=torch.float32)
    return buffer[:numel]


def _coordinate_median(rows: Sequence[torch.Tensor], out: torch.Tensor) -> torch.Tensor:
    """Coordinate-wise median of the rows, into ``out`` (for 3 rows, with min/max: several times faster than
    torch.median)."""
    if len(rows) == 3:
        a, b, c = rows
        low, high = _scratch("median_low", out.numel()), _scratch("median_high", out.numel())
        torch.minimum(a, b, out=low)
        torch.maximum(a, b, out=high)
        torch.minimum(high, c, out=high)
        return torch.maximum(low, high, out=out)
    stacked = torch.stack(list(rows), out=_scratch("stacked", len(rows) * out.numel()).view(len(rows), -1))
    return out.copy_(stacked.median(dim=0).values)


def _weighted_median(values: np.ndarray, weights: np.ndarray) -> float:
    """The smallest value such that values at or below it carry at least half of the (normalised) weight."""
    order = np.argsort(values, kind="stable")
    index = min(int(np.searchsorted(np.cumsum(weights[order]), 0.5 - 1e-6)), len(values) - 1)
    return float(values[order[index]])


def aggregate_parts(
    parts: Sequence[torch.Tensor],
    weights: Sequence[float],
    aggregation: str = "mean",
    tau: Optional[float] = None,
    iters: int = DEFAULT_CENTERED_CLIP_ITERS,
    min_alignment: Optional[float] = None,
    trust: Optional[Sequence[float]] = None,
    statement: Optional[list] = None,
    own: Optional[int] = None,
) -> tuple[torch.Tensor, Optional[List[Tuple[float, float]]]]:
    """The group's result for one part: ``aggregation`` is "mean" or "centered_clip" (with ``tau``, ``iters``, and
    the alignment screen of :func:`aligned_centered_clip` if ``min_alignment`` is given: each sender's weight also
    scaled by its ``trust``). Returns (the result, each sender's (alignment factor, clip scale); None: not
    screened). ``statement``, ``own``: see :func:`aligned_centered_clip` (the mean's coefficients are its weights)."""
    if aggregation == "mean":
        result = weighted_mean(parts, weights)
        if statement is not None:
            distance = float(torch.dist(parts[own].to(torch.float32), result)) if own is not None else 0.0
            statement.append(exact.mean_combination(weights, own, distance))
        return result, None
    if aggregation == "centered_clip":
        if min_alignment is None:
            return centered_clip(parts, weights, tau=tau, iters=iters, statement=statement, own=own), None
        result, factors, scales = aligned_centered_clip(parts, weights, tau, iters, min_alignment, prior=trust,
                                                        statement=statement, own=own)
        return result, list(zip(factors, scales))
    raise ValueError(f"aggregation must be one of {AGGREGATION_CHOICES}, got {aggregation!r}")


class SenderTrust:
    """Each sender's record across rounds (kept by one reducer for the whole run): the mean of its records, its
    alignment factor times its clip scale in the vote (:func:`aligned_centered_clip`), over the rounds in which it
    could be judged (3 or more senders), each round weighing ``decay`` times the next one and counting as much as the
    sender's weight in it relative to the group's median weight (at most 1: a peer that had few samples sent a noisy
    part, which says little). A sender is trusted (1.0) until judged; one that went against the group's estimate,
    or sat far outside the honest distances (x1e3), keeps a low trust for the next rounds, in which its weight is
    scaled by it. That decides rounds of 2 senders, which neither alignment nor clipping can (the 2 alignments add
    up to 2, and CenteredClip of 2 equal weights is their mean).

    Args:
        decay: weight of a round relative to the next one, in [0, 1) (0: only the last judged round counts).
    """

    def __init__(self, decay: float = TRUST_DECAY):
        self.decay = decay
        self._sums: Dict[Hashable, List[float]] = {}  # sender -> [decayed sum of factors, decayed count]

    def trust(self, sender: Hashable) -> float:
        """The sender's trust in [0, 1] (1.0 for a sender never judged)."""
        total, count = self._sums.get(sender, (0.0, 0.0))
        return total / count if count > 0 else 1.0

    def record(self, sender: Hashable) -> Optional[float]:
        """The sender's trust, or None if it was never seen (judged, or updated with evidence 0: seen in a round
        that could not judge it)."""
        return self.trust(sender) if sender in self._sums else None

    def update(self, judged: Dict[Hashable, Tuple[float, float]]) -> None:
        """Add one round: each judged sender's (record in [0, 1], evidence in [0, 1]: its weight relative to the
        median sender's, at most 1; 0: seen, but not judged)."""
        for sender, (factor, evidence) in judged.items():
            if not evidence > 0:  # seen, not judged: nothing to remember (nor to forget) but the sender itself
                self._sums.setdefault(sender, [0.0, 0.0])
                continue
            total, count = self._sums.get(sender, (0.0, 0.0))
            self._sums[sender] = [self.decay * total + float(evidence) * float(factor),
                                  self.decay * count + float(evidence)]


def check_aggregation_options(aggregation: str, tau: Optional[float], iters: int,
                              min_alignment: Optional[float] = None) -> None:
    """Raise a clear ValueError for a bad aggregation name, tau, iteration count or minimum alignment."""
    if aggregation not in AGGREGATION_CHOICES:
        raise ValueError(f"aggregation must be one of {AGGREGATION_CHOICES}, got {aggregation!r}")
    if tau is not None and (isinstance(tau, bool) or not isinstance(tau, (int, float)) or not math.isfinite(tau)
                            or tau <= 0):
        raise ValueError(f"centered_clip_tau must be a finite number > 0 (or None: adaptive), got {tau!r}")
    if isinstance(iters, bool) or not isinstance(iters, int) or iters < 1:
        raise ValueError(f"centered_clip_iters must be an integer >= 1, got {iters!r}")
    if min_alignment is not None and (isinstance(min_alignment, bool) or not isinstance(min_alignment, (int, float))
                                      or not 0 < min_alignment <= 1):
        raise ValueError(
            f"centered_clip_min_alignment must be a number in (0, 1] (or None: off), got {min_alignment!r}")
