"""The arithmetic of the lying-reducer check (lightning_swarm/reducer_checks.py), on a whole group simulated in one
process with the reducer's real aggregation (``screen_and_aggregate``) and the members' real reports: honest results
always pass (mean, CenteredClip stopped early or not, with the alignment screen and its 2-sender clip, a refused lone
sender, no accepted sender, 8-bit and float16 rounding of the results), and a lie of any direction beyond one clipped
sender's reach is refused."""

from __future__ import annotations

import math
import struct

import numpy as np
import pytest
import torch

from lightning_swarm import reducer_checks as rc
from lightning_swarm.compression import Blockwise8BitQuantization, register_fixed_codecs
from lightning_swarm.hivemind_ext.robust_allreduce import screen_and_aggregate
from hivemind.compression import CompressionInfo
from hivemind.compression.serialization import deserialize_torch_tensor
from lightning_swarm.wire_checks import compression_name

from lightning_swarm.hivemind_ext.result_verification import message_rounding

SEED = b"round-seed"
register_fixed_codecs()


def honest_group(n: int, size: int, seed: int, spread: float = 0.3):
    generator = torch.Generator().manual_seed(seed)
    base = torch.randn(size, generator=generator)
    return [base + spread * torch.randn(size, generator=generator) for _ in range(n)]


def codec_roundtrip(tensor: torch.Tensor, codec: str):
    """(decoded tensor, rounding bound) of ``tensor`` sent with ``codec`` ("none", "fp16", "8bit")."""
    if codec == "none":
        return tensor.clone(), rc.rounding_bound("NONE", tensor)
    if codec == "fp16":
        decoded = tensor.half().float()
        return decoded, rc.rounding_bound("FLOAT16", decoded)
    message = Blockwise8BitQuantization().compress(tensor, CompressionInfo.from_tensor(tensor))
    decoded = deserialize_torch_tensor(message)
    assert compression_name(message) == "BLOCKWISE_8BIT"
    return decoded, message_rounding(message, decoded)


def run_group(parts, weights, reducer: int, aggregation="centered_clip", min_alignment=None, trust=None,
              iters=20, lie=None, codec="none", liar_sends_to=None):
    """One slice (one part) reduced by ``reducer`` and checked by every other member: the verdict of each checker.
    ``lie``: a vector added to the result the reducer sends (to every member, or to ``liar_sends_to`` only)."""
    n = len(parts)
    sent = [codec_roundtrip(p, codec) for p in parts]  # what each sender's part looks like at the reducer
    statement = []
    result, _, _ = screen_and_aggregate([s[0] for s in sent], weights, None, aggregation, None, iters, min_alignment,
                                        trust, statement=statement, own=reducer)
    combination = statement[0]
    members = [j for j in range(n) if j != reducer]
    reports = []
    for j in members:
        v = sent[j][0] if result is None else result
        if lie is not None and (liar_sends_to is None or j in liar_sends_to):
            v = v + lie
        delta, delta_q = codec_roundtrip(v - sent[j][0], codec)
        header = rc.parse_header(rc.encode_header(combination, j))
        received = rc.ReceivedPart(parts[j], delta, header, delta_q, sent[j][1])
        reports.append((header, rc.member_report(SEED, reducer, [received], len(members))))
    return [rc.check_slice([header], [r for _, r in reports], reducer_sends=True) for header, _ in reports], combination


CASES = [
    dict(aggregation="mean"),
    dict(aggregation="centered_clip"),
    dict(aggregation="centered_clip", iters=1),  # stopped early: one iteration
    dict(aggregation="centered_clip", iters=2),
    dict(aggregation="centered_clip", min_alignment=0.5),
    dict(aggregation="centered_clip", min_alignment=0.5, trust=[1.0, 0.2, 0.3, 1.0]),
]


@pytest.mark.parametrize("codec", ["none", "fp16", "8bit"])
@pytest.mark.parametrize("case", range(len(CASES)))
@pytest.mark.parametrize("n", [2, 3, 4])
def test_honest_results_always_pass(case, n, codec):
    options = dict(CASES[case])
    if options.get("trust"):
        options["trust"] = options["trust"][:n]
    for seed in range(3):
        parts = honest_group(n, 5000, seed)
        if seed == 1:
            parts[0] = parts[0] * 50  # the reducer's own part far away: it clips itself
        if seed == 2:
            parts[-1] = -parts[-1] * 3  # another sender far away
        weights = [1.0, 2.0, 1.0, 3.0][:n]
        for reducer in range(n):
            verdicts, _ = run_group(parts, weights, reducer, codec=codec, **options)
            assert verdicts == [None] * (n - 1), (seed, reducer, verdicts)


def test_lone_refused_and_keep_parts_pass_honestly_and_a_changed_one_is_refused():
    parts = honest_group(3, 2000, 0)
    # a lone sender never seen, with the screen: zeros for everyone (the virtual part holds all the mass)
    verdicts, combination = run_group(parts, [1.0, 0.0, 0.0], 0, min_alignment=0.5, trust=[None, None, None])
    assert combination.zero == 1.0 and verdicts == [None, None]
    verdicts, _ = run_group(parts, [1.0, 0.0, 0.0], 0, min_alignment=0.5, trust=[None, None, None],
                            lie=torch.full((2000,), 0.01))
    assert all(v is not None for v in verdicts)
    # no sender with a positive weight: each keeps its own part, and a change is refused
    verdicts, combination = run_group(parts, [0.0, 0.0, 0.0], 1)
    assert combination.mode == rc.MODE_KEEP and verdicts == [None, None]
    verdicts, _ = run_group(parts, [0.0, 0.0, 0.0], 1, lie=torch.full((2000,), 1e-3))
    assert all("no sender was accepted" in v for v in verdicts)


def reach(parts, weights, reducer, **options):
    """One clipped sender's reach in this slice: the reducer's weight share times the farthest other sender."""
    _, combination = run_group(parts, weights, reducer, **options)
    result = sum(c * p for c, p in zip(combination.coefficients, parts))
    others = [float((p - result).norm()) for j, p in enumerate(parts) if j != reducer and combination.coefficients[j]]
    return combination.share * max(others)


@pytest.mark.parametrize("options", [dict(aggregation="centered_clip"), dict(aggregation="centered_clip", iters=1),
                                     dict(aggregation="centered_clip", min_alignment=0.5)])
@pytest.mark.parametrize("n", [2, 3, 4])
def test_a_lie_of_any_direction_beyond_one_clipped_senders_reach_is_refused(options, n):
    parts = honest_group(n, 5000, 7)
    weights = [1.0] * n
    limit = reach(parts, weights, 0, **options)
    generator = torch.Generator().manual_seed(3)
    refused = 0
    for trial in range(20):
        direction = torch.randn(5000, generator=generator)
        if trial % 4 == 1:  # a subtle one, in a few coordinates
            direction = torch.zeros(5000)
            direction[torch.randint(5000, (3,), generator=generator)] = 1.0
        elif trial % 4 == 2:  # along the result itself (a scaled step)
            direction = sum(parts) / n
        elif trial % 4 == 3:  # orthogonal to every part
            for p in parts:
                direction = direction - (direction @ p) / (p @ p) * p
        lie = direction / direction.norm() * limit * 30
        verdicts, _ = run_group(parts, weights, 0, lie=lie, **options)
        refused += all(v is not None for v in verdicts)
        # a lie told to one member only is refused by every member (the sum of their residuals is off)
        verdicts, _ = run_group(parts, weights, 0, lie=lie, liar_sends_to=[1], **options)
        refused += all(v is not None for v in verdicts)
    # 30 times the reach: P(pass) <= P(chi2_4 < 56 / 900) ~ 5e-4 per try (and 0 here with these seeds)
    assert refused == 40


def test_a_lie_beyond_one_clipped_senders_reach_is_refused_under_the_mean_only_as_an_inconsistency():
    """With the mean nothing bounds a sender's reach: a lie is refused only where it does not fit the reducer's own
    stated residual (here: an honest header with a lying result)."""
    parts = honest_group(3, 3000, 2)
    lie = torch.randn(3000, generator=torch.Generator().manual_seed(0)) * 10
    verdicts, _ = run_group(parts, [1.0, 1.0, 1.0], 0, aggregation="mean", lie=lie)
    assert all(v is not None and "projects to" in v for v in verdicts)


def test_headers_and_reports_are_checked():
    combination = rc.Combination((0.5, 0.25), 0.0, 0.25, 0.1, 0.5, 3, rc.MODE_CLIPPED)
    header = rc.parse_header(rc.encode_header(combination, 1))
    assert header.coefficient == 0.25 and header.accepted == 3
    for bad in (b"", b"x" * 55, struct.pack("<7d", float("nan"), 0, 0, 0, 0, 1, 1),
                struct.pack("<7d", 2.0, 0, 0, 0, 0, 1, 1), struct.pack("<7d", 0.5, 0, 0, -1, 0, 1, 1),
                struct.pack("<7d", 0.5, 0, 0, 0, 0, 1.5, 1), struct.pack("<7d", 0.5, 0, 0, 0, 0, 1, 7)):
        with pytest.raises(rc.MalformedReport):
            rc.parse_header(bad)
    parts = [2, 0, 3]
    report = rc.SliceReport(True, np.ones(rc.PROJECTIONS), 0.5, 12345.0, np.full(2, 0.3), np.ones(2))
    values = rc.encode_report([report, None, None], parts)
    assert len(values) == rc.report_length(parts)
    decoded = rc.decode_report(values, parts)
    assert decoded[1] is None and decoded[2] is None and decoded[0].digest == 12345.0
    for mutate in (lambda v: v[:-1], lambda v: np.append(v, 0.0), lambda v: np.where(np.arange(len(v)) == 1, np.nan, v),
                   lambda v: np.where(np.arange(len(v)) == 0, 0.5, v),
                   lambda v: np.where(np.arange(len(v)) == 3 + rc.PROJECTIONS, -1.0, v)):
        with pytest.raises(rc.MalformedReport):
            rc.decode_report(mutate(values.copy()), parts)


def test_the_chernoff_limit_bounds_honest_projections():
    limit = rc.chernoff_limit(4, 1e-9)
    assert (limit / 4) ** 2 * math.exp((4 - limit) / 2) == pytest.approx(1e-9, rel=1e-3)
    # random sign projections of a fixed vector: the statistic's tail is below the Gaussian chi-square's bound
    vector = torch.randn(10000)
    statistics = [float(np.sum(rc.project([(vector, 1.0)], seed) ** 2)) / float(vector @ vector) for seed in range(300)]
    assert max(statistics) < limit and abs(np.mean(statistics) - 4) < 0.6


def test_the_reducers_own_part_is_clipped_exactly_against_the_result():
    parts = honest_group(3, 4000, 5)
    parts[1] = parts[1] + 40.0  # the reducer, far away
    for iters in (1, 20):
        statement = []
        result, _, _ = screen_and_aggregate(parts, [1.0, 1.0, 1.0], None, "centered_clip", None, iters,
                                            statement=statement, own=1)
        combination = statement[0]
        rebuilt = sum(c * p for c, p in zip(combination.coefficients, parts))
        assert torch.allclose(result, rebuilt, atol=1e-4)
        distances = [float((p - result).norm()) for p in parts]
        assert combination.residual == pytest.approx(combination.own * distances[1], rel=1e-4)
        assert combination.residual <= combination.share * max(distances[0], distances[2]) * (1 + 1e-6)
