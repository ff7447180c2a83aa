"""The arithmetic of the lying-reducer check (lightning_swarm/reducer_checks.py), on a whole group simulated in one
process with the reducer's real aggregation (``screen_and_aggregate``) and the members' real reports: honest results
always pass (mean, CenteredClip stopped early or not, with the alignment screen and its 2-sender clip, a refused lone
sender, no accepted sender, 8-bit and float16 rounding of the results), and a lie of any direction beyond one clipped
sender's reach is refused."""

from __future__ import annotations

import dataclasses
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
from lightning_swarm.hivemind_ext.lifetime import SwarmDHT

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
              iters=20, lie=None, codec="none", liar_sends_to=None, claims="sent", frame=None):
    """One slice (one part) reduced by ``reducer`` and checked by every other member: each checker's
    :class:`~lightning_swarm.reducer_checks.Verdict`, and the reducer's statement.

    Args:
        lie: a vector added to the result the reducer sends (to every member, or to ``liar_sends_to`` only).
        claims: how the reducer makes its claims: "sent" (honestly, from the result it sent each member), "true"
            (from the honest result, whatever it sent), or ("fit", j): from what it sent, except that its claim about
            member j is moved so that the claims sum to minus its own stated residual (a lie about j that makes
            the sum fit).
        frame: {member: function(report) -> report}: that member's false report (the same to every checker).
    """
    n = len(parts)
    sent = [codec_roundtrip(p, codec) for p in parts]  # what each sender's part looks like at the reducer
    statement = []
    received = [s[0] for s in sent]
    result, _, _ = screen_and_aggregate(received, weights, None, aggregation, None, iters, min_alignment,
                                        trust, statement=statement, own=reducer)
    combination = statement[0]
    members = [j for j in range(n) if j != reducer]
    results = {}
    for j in members:
        v = received[j] if result is None else result
        if lie is not None and (liar_sends_to is None or j in liar_sends_to):
            v = v + lie
        results[j] = v
    # the reducer's claims, each member's row from the result it says it sent that member
    rows = {}
    for j in members:
        claimed = None if result is None else result  # "true": the honest result (None: each kept its own part)
        if claims != "true" and (result is not None or results[j] is not received[j]):
            claimed = results[j]
        rows[j] = rc.reducer_claims(SEED, reducer, [rc.ReducedPart(received, claimed, combination)], len(members),
                                    reducer)
    stated = rows[members[0]]
    projections = np.array([rows[j].projections[j] if j in rows else np.zeros(rc.PROJECTIONS) for j in range(n)])
    projections[reducer] = 0.0
    distances = np.array([rows[j].distances[j] if j in rows else np.zeros(1) for j in range(n)])
    errors = np.array([rows[j].errors[j] if j in rows else 0.0 for j in range(n)])
    if isinstance(claims, tuple):  # ("fit", j): move the claim about j so that the claims sum to -b_R (x_R - v)
        target = rc.project([(received[reducer] - result, combination.own)], rc.part_seed(SEED, 0))
        projections[claims[1]] -= target + projections.sum(axis=0)
    claimed = rc.ReducerClaims(stated.digest, projections, errors, stated.coefficients, distances, stated.result,
                               stated.result_error)
    reports = []
    for j in members:
        delta, delta_q = codec_roundtrip(results[j] - sent[j][0], codec)
        header = rc.parse_header(rc.encode_header(combination, j))
        part = rc.ReceivedPart(parts[j], delta, header, delta_q, sent[j][1])
        report = rc.member_report(SEED, reducer, [part], len(members))
        if frame and j in frame:
            report = frame[j](report)
        reports.append((header, report))
    verdicts = []
    for position, j in enumerate(members):
        header, own_report = reports[position]
        if frame and j in frame:  # a framer checks with its true report (its verdict is not asserted)
            delta, delta_q = codec_roundtrip(results[j] - sent[j][0], codec)
            own_report = rc.member_report(SEED, reducer, [rc.ReceivedPart(parts[j], delta, header, delta_q,
                                                                          sent[j][1])], len(members))
        seen = [own_report if k == position else r for k, (_, r) in enumerate(reports)]
        verdicts.append(rc.judge_slice([header], seen, claimed, members, position, reducer_sends=True))
    return verdicts, combination


def hide_lie_in_row(claims, row: int, own_part, lied, combination):
    """``claims`` (computed from the lying result ``lied``) with sender ``row``'s projections moved so that the
    claims sum to minus the reducer's own stated residual: a lie hidden in that row."""
    target = rc.project([(own_part - lied, combination.own)], rc.part_seed(SEED, 0))
    projections = claims.projections.copy()
    projections[row] -= target + projections.sum(axis=0)
    return dataclasses.replace(claims, projections=projections)


def reasons(verdicts):
    return [v.reason for v in verdicts]


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
            assert all(v == rc.Verdict(None) for v in verdicts), (seed, reducer, verdicts)


def test_lone_refused_and_keep_parts_pass_honestly_and_a_changed_one_is_refused():
    parts = honest_group(3, 2000, 0)
    # a lone sender never seen, with the screen: refused, each sender keeps its own part, and a change is refused
    verdicts, combination = run_group(parts, [1.0, 0.0, 0.0], 0, min_alignment=0.5, trust=[None, None, None])
    assert combination.mode == rc.MODE_KEEP and reasons(verdicts) == [None, None]
    verdicts, _ = run_group(parts, [1.0, 0.0, 0.0], 0, min_alignment=0.5, trust=[None, None, None],
                            lie=torch.full((2000,), 0.01))
    assert all("no sender was accepted" in v.reason and v.blame == rc.BLAME_REDUCER for v in verdicts)
    # no sender with a positive weight: each keeps its own part, and a change is refused
    verdicts, combination = run_group(parts, [0.0, 0.0, 0.0], 1)
    assert combination.mode == rc.MODE_KEEP and reasons(verdicts) == [None, None]
    verdicts, _ = run_group(parts, [0.0, 0.0, 0.0], 1, lie=torch.full((2000,), 1e-3))
    assert all("no sender was accepted" in v.reason and v.blame == rc.BLAME_REDUCER for v in verdicts)
    # claims that say it sent nothing changed: each member sees a false claim about itself
    verdicts, _ = run_group(parts, [0.0, 0.0, 0.0], 1, lie=torch.full((2000,), 1e-3), claims="true")
    assert all("no sender was accepted" in v.reason and v.blame == rc.BLAME_REDUCER for v in verdicts)


@pytest.mark.parametrize("n", [2, 4])
@pytest.mark.parametrize("aggregation", ["mean", "centered_clip"])
def test_a_float16_delta_that_decodes_to_zeros_passes_honestly(aggregation, n):
    """A state round of n peers whose float16 parameters agree except where the reducer's differ by one subnormal
    step (2**-24): each member's delta, 1/n of that step, decodes to float16 zeros. That zero is not a zero
    distance (a value within 2**-25 rounds to it): an honest reducer's claims were refused by every member as "a
    distance to the result beyond the one it got" (the overlapped 4-peer run of issue 25, on the one slice that held
    float16 tensors). A change sent where no sender was accepted is still refused."""
    generator = torch.Generator().manual_seed(0)
    members = ((torch.rand(4096, generator=generator) - 0.5) / 32).half().float()  # as float16 sends them
    members[:8] = torch.arange(1, 9) * 2.0 ** -24  # a few float16 subnormals
    reducer = members.clone()
    reducer[:8] += 2.0 ** -24
    parts = [reducer] + [members.clone() for _ in range(n - 1)]
    delta = (parts[0] - parts[1]) / n
    assert delta.norm() > 0 and delta.half().float().norm() == 0  # the case: a true change, decoded as zeros
    verdicts, combination = run_group(parts, [1.0] * n, 0, aggregation=aggregation, codec="fp16")
    assert reasons(verdicts) == [None] * (n - 1)
    kept, combination = run_group(parts, [0.0] * n, 0, codec="fp16")
    assert combination.mode == rc.MODE_KEEP and reasons(kept) == [None] * (n - 1)
    changed, _ = run_group(parts, [0.0] * n, 0, codec="fp16", lie=torch.full((4096,), 1e-3))
    assert all("no sender was accepted" in v.reason and v.blame == rc.BLAME_REDUCER for v in changed)


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
    # member 1 sees a lie told to it alone scaled by its coefficient b_1 (its residual is b_1 (x_1 - v)): a lie
    # 1 / b_1 times larger moves the claims' sum as far as a lie told to everyone
    _, combination = run_group(parts, weights, 0, **options)
    one_member = 1.0 / combination.coefficients[1]
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
        refused += all(v.reason is not None and v.blame == rc.BLAME_REDUCER for v in verdicts)
        # a lie told to one member only is refused by every member (the sum of the claims is off)
        verdicts, _ = run_group(parts, weights, 0, lie=lie * one_member, liar_sends_to=[1], **options)
        refused += all(v.reason is not None and v.blame == rc.BLAME_REDUCER for v in verdicts)
    # 30 times the reach (as member 1 sees the one-member lie too): P(pass) <= P(chi2_4 < 56 / 900) ~ 5e-4 per try
    # (and 0 here with these seeds)
    assert refused == 40


def test_a_lie_beyond_one_clipped_senders_reach_is_refused_under_the_mean_only_as_an_inconsistency():
    """With the mean nothing bounds a sender's reach: a lie is refused only where it does not fit the reducer's own
    stated residual (here: an honest header with a lying result)."""
    parts = honest_group(3, 3000, 2)
    lie = torch.randn(3000, generator=torch.Generator().manual_seed(0)) * 10
    verdicts, _ = run_group(parts, [1.0, 1.0, 1.0], 0, aggregation="mean", lie=lie)
    assert all(v.reason is not None and "projects to" in v.reason and v.blame == rc.BLAME_REDUCER for v in verdicts)


def framing(kind: str, size: float, seed: int):
    """A framer's report: its true one with ``kind`` changed by ``size``."""
    generator = np.random.default_rng(seed)

    def change(report):
        projections, error, digest = report.projections.copy(), report.error, report.digest
        coefficients, distances = report.coefficients.copy(), report.distances.copy()
        result = report.result_projections().copy()
        if kind == "projections":  # a random direction, ``size`` times its bound and its own norm
            direction = generator.standard_normal(len(projections))
            projections += direction / np.linalg.norm(direction) * size * (error + np.linalg.norm(projections))
        elif kind == "digest":
            digest = float((int(digest) + 1) % 2 ** 53)
        elif kind == "coefficient":
            coefficients = np.minimum(coefficients + size, 1.0)
        elif kind == "distance":
            distances = distances * size
        elif kind == "error":
            error = error * size
        elif kind == "result":  # the result it got, moved ``size`` times its bound and its own norm
            direction = generator.standard_normal(len(result))
            result += direction / np.linalg.norm(direction) * size * (report.result_error + np.linalg.norm(result))
        return rc.SliceReport(True, projections, error, digest, coefficients, distances, result, report.result_error)
    return change


FRAMES = [("projections", 0.3), ("projections", 3.0), ("projections", 30.0), ("projections", 1e6), ("digest", 1),
          ("coefficient", 0.01), ("distance", 0.5), ("error", 1e-3), ("error", 1e9), ("result", 1.0)]


@pytest.mark.parametrize("codec", ["none", "fp16", "8bit"])
@pytest.mark.parametrize("aggregation", ["mean", "centered_clip"])
@pytest.mark.parametrize("n", [3, 4])
def test_a_framing_member_is_in_a_dispute_never_the_reducer_alone(n, aggregation, codec):
    refused = 0
    for seed in range(2):
        parts = honest_group(n, 5000, seed)
        for framer in range(1, n):
            for kind, size in FRAMES:
                verdicts, _ = run_group(parts, [1.0, 2.0, 1.0, 3.0][:n], 0, aggregation=aggregation, codec=codec,
                                        frame={framer: framing(kind, size, seed)})
                honest = [v for position, v in enumerate(verdicts) if position != framer - 1]
                for v in honest:
                    assert v.blame != rc.BLAME_REDUCER, (kind, size, v)
                    assert v.reason is None or (v.blame == rc.BLAME_DISPUTE and v.disputed == (framer - 1,)), v
                if kind in ("digest", "coefficient", "distance", "result") or (kind == "projections" and size >= 30):
                    assert all(v.reason is not None for v in honest), (kind, size, honest)
                    refused += 1
                if kind == "error" and size > 1:  # a bound of its own too large changes nothing
                    assert all(v.reason is None for v in honest)
    assert refused == 2 * (n - 1) * 6


@pytest.mark.parametrize("n", [3, 4])
@pytest.mark.parametrize("codec", ["none", "8bit"])
def test_a_reducer_that_lies_about_a_member_is_blamed_by_it_and_disputed_by_the_others(n, codec):
    parts = honest_group(n, 5000, 11)
    weights = [1.0] * n
    lie = torch.randn(5000, generator=torch.Generator().manual_seed(1)) * reach(parts, weights, 0) * 30 / 70
    for victim in range(1, n):
        # a lie to everyone, with its claim about the victim moved so that the claims sum to its stated residual
        verdicts, _ = run_group(parts, weights, 0, lie=lie, codec=codec, claims=("fit", victim))
        assert verdicts[victim - 1].blame == rc.BLAME_REDUCER, verdicts[victim - 1]
        for position, v in enumerate(verdicts):
            if position != victim - 1:
                assert v.blame == rc.BLAME_REDUCER or (v.blame == rc.BLAME_DISPUTE and v.disputed == (victim - 1,)), v
        # a lie to the victim alone, with claims from the honest result: the sum fits
        verdicts, _ = run_group(parts, weights, 0, lie=lie, codec=codec, liar_sends_to=[victim], claims="true")
        assert verdicts[victim - 1].blame == rc.BLAME_REDUCER, verdicts[victim - 1]
        assert all(v.blame == rc.BLAME_DISPUTE and v.disputed == (victim - 1,)
                   for position, v in enumerate(verdicts) if position != victim - 1), verdicts


@pytest.mark.parametrize("n", [3, 4])
@pytest.mark.parametrize("aggregation", ["mean", "centered_clip"])
@pytest.mark.parametrize("codec", ["none", "fp16", "8bit"])
def test_a_lie_to_a_member_with_no_mass_is_refused(n, aggregation, codec):
    """A sender of weight 0 (a peer without samples tags along in gradient rounds) has no residual in the part
    (b_j = 0): a result told to it alone used to pass every check. Its report now carries the projections of the
    result it got, which must agree with the reducer's claimed ones: it blames the reducer, the others see a dispute
    with it. An honest group with a weight-0 member passes."""
    parts = honest_group(n, 5000, 5)
    weights = [1.0, 2.0, 0.0, 3.0][:n]
    verdicts, combination = run_group(parts, weights, 0, aggregation=aggregation, codec=codec)
    assert combination.coefficients[2] == 0.0 and all(v.reason is None for v in verdicts), verdicts
    scale = float(torch.stack(parts).mean(dim=0).norm())
    # of the result's norm: the bound of an 8-bit part's and result's rounding lets lies up to ~0.1 of it pass
    for size in ((0.5, 5.0) if codec == "8bit" else (0.02, 5.0)):
        lie = torch.randn(5000, generator=torch.Generator().manual_seed(3))
        lie = lie / lie.norm() * scale * size
        verdicts, _ = run_group(parts, weights, 0, aggregation=aggregation, codec=codec, lie=lie, liar_sends_to=[2],
                                claims="true")
        victim = verdicts[1]  # member 2, second of members 1..n-1
        assert victim.blame == rc.BLAME_REDUCER and "a result that projects" in victim.reason, victim
        for position, v in enumerate(verdicts):
            if position != 1:
                assert v.blame == rc.BLAME_DISPUTE and v.disputed == (1,), v


def test_a_member_that_inflates_its_error_bound_does_not_hide_a_lying_reducer():
    parts = honest_group(3, 5000, 4)
    lie = torch.randn(5000, generator=torch.Generator().manual_seed(2)) * reach(parts, [1.0] * 3, 0) * 30 / 70
    verdicts, _ = run_group(parts, [1.0] * 3, 0, lie=lie, frame={2: framing("error", 1e12, 0)})
    assert verdicts[0].blame == rc.BLAME_REDUCER, verdicts[0]


@pytest.mark.parametrize("options", [dict(aggregation="mean"), dict(aggregation="centered_clip", iters=3),
                                     dict(aggregation="centered_clip", min_alignment=0.5)])
def test_honest_groups_blame_nobody_over_many_seeds(options):
    for seed in range(40):
        n = 2 + seed % 3
        codec = ("none", "fp16", "8bit")[seed % 3 if seed % 2 else (seed // 2) % 3]
        parts = honest_group(n, 3000, 100 + seed, spread=(0.01, 0.3, 3.0)[seed % 3])
        weights = list(np.random.default_rng(seed).uniform(0.2, 3.0, n))
        verdicts, _ = run_group(parts, weights, seed % n, codec=codec, **options)
        assert all(v == rc.Verdict(None) for v in verdicts), (seed, verdicts)


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
                   lambda v: np.where(np.arange(len(v)) == 3 + rc.PROJECTIONS, -1.0, v),
                   lambda v: np.where(np.arange(len(v)) == rc.report_length(parts[:1]) - 1, -1.0, v)):  # result error
        with pytest.raises(rc.MalformedReport):
            rc.decode_report(mutate(values.copy()), parts)
    assert np.array_equal(decoded[0].result, np.zeros(rc.PROJECTIONS)) and decoded[0].result_error == 0.0
    report.result, report.result_error = np.arange(rc.PROJECTIONS, dtype=float), 0.25
    decoded = rc.decode_report(rc.encode_report([report, None, None], parts), parts)[0]
    assert np.array_equal(decoded.result, report.result) and decoded.result_error == 0.25
    claims = rc.ReducerClaims(777.0, np.ones((3, rc.PROJECTIONS)), np.full(3, 0.1), np.full((3, 2), 0.25),
                              np.ones((3, 2)), np.full(rc.PROJECTIONS, 2.0), 0.5)
    block = rc.encode_claims(claims, 2, 3)
    assert len(block) == rc.claims_length(2, 3) == 3 + rc.PROJECTIONS + 3 * (rc.PROJECTIONS + 5)
    assert rc.claims_length(0, 3) == 0
    back = rc.decode_claims(block, 2, 3)
    assert back.digest == 777.0 and np.array_equal(back.coefficients, claims.coefficients)
    assert np.array_equal(back.projections, claims.projections) and np.array_equal(back.distances, claims.distances)
    assert np.array_equal(back.result, claims.result) and back.result_error == 0.5
    assert rc.decode_claims(np.zeros(len(block)), 2, 3) is None
    row = 3 + rc.PROJECTIONS  # where the first sender's row begins
    for mutate in (lambda v: v[:-1], lambda v: np.where(np.arange(len(v)) == 1, 0.5, v),
                   lambda v: np.where(np.arange(len(v)) == 2, np.inf, v),
                   lambda v: np.where(np.arange(len(v)) == 0, 2.0, v),
                   lambda v: np.where(np.arange(len(v)) == 2 + rc.PROJECTIONS, -1.0, v),  # the result's error
                   lambda v: np.where(np.arange(len(v)) == row + rc.PROJECTIONS, -1.0, v),  # a sender's error
                   lambda v: np.where(np.arange(len(v)) == row + rc.PROJECTIONS + 1, 1.5, v)):  # a coefficient
        with pytest.raises(rc.MalformedReport):
            rc.decode_claims(mutate(block.copy()), 2, 3)


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


def test_a_peer_kept_out_by_one_averager_is_kept_out_by_the_others_of_the_same_peer():
    """The gradient and the state averager of one trainer are separate processes sharing its peer id: a reducer
    refused in a gradient round must not seat itself in the next state round (found by the Byzantine swarm's lying
    reducer: its lie then landed through a state round of 2)."""
    import hivemind
    from hivemind.averaging import DecentralizedAverager
    from hivemind.p2p import PeerID

    from lightning_swarm.hivemind_ext.robust_allreduce import RobustAveraging

    class Averager(RobustAveraging, DecentralizedAverager):
        pass

    dht = SwarmDHT(start=True, host_maddrs=["/ip4/127.0.0.1/tcp/0"])
    other = SwarmDHT(start=True, host_maddrs=["/ip4/127.0.0.1/tcp/0"])
    try:
        averagers = [Averager([torch.zeros(3)], dht=dht, prefix=prefix, start=False, target_group_size=2)
                     for prefix in ("grad", "state")]
        stranger = Averager([torch.zeros(3)], dht=other, prefix="grad", start=False, target_group_size=2)
        liar = PeerID.from_base58(str(other.peer_id))
        assert liar not in averagers[1].excluded_peers
        averagers[0].exclude_peer(liar, "its reduced slice failed the check (a test)")
        assert liar in averagers[0].excluded_peers
        assert "a test" in averagers[1].excluded_peers[liar]  # the other averager of the same peer
        assert liar not in stranger.excluded_peers  # another peer's averagers decide for themselves
    finally:
        dht.shutdown()
        other.shutdown()


def test_reports_and_claims_part_by_part_with_shared_signs_equal_the_whole_slices():
    """The members compute their reports on every slice and their claims part index by part index, each index's sign
    vectors generated once (SignSource): the same numbers as each slice's report and claims on their own."""
    generator = torch.Generator().manual_seed(8)
    combination = rc.Combination((0.3, 0.3, 0.4), 0.0, 0.4, 0.1, 0.4, 3, rc.MODE_CLIPPED)
    header = rc.parse_header(rc.encode_header(combination, 1))
    sizes = {0: [70_000, 70_000, 1_000], 2: [70_000, 5_000]}  # two slices, parts of unequal lengths
    received = {r: [rc.ReceivedPart(torch.randn(n, generator=generator), torch.randn(n, generator=generator), header,
                                    0.01, 0.02) for n in lengths] for r, lengths in sizes.items()}
    reduced = [rc.ReducedPart([torch.randn(n, generator=generator) for _ in range(3)], torch.randn(n, generator=generator),
                              combination) for n in (70_000, 300)]
    signs = rc.SignSource()
    per_part = {r: [] for r in received}
    claims = []
    for index in range(3):
        for r, parts in received.items():
            if index < len(parts):
                per_part[r].append(rc.member_report(SEED, r, parts[index:index + 1], 2, first=index, signs=signs))
        if index < len(reduced):
            claims.append(rc.reducer_claims(SEED, 1, reduced[index:index + 1], 2, 1, first=index, signs=signs))
    for r, parts in received.items():
        whole, merged = rc.member_report(SEED, r, parts, 2), rc.merge_reports(per_part[r], [p.header for p in parts])
        assert np.allclose(whole.projections, merged.projections, rtol=1e-12, atol=0)
        assert whole.error == pytest.approx(merged.error, rel=1e-12) and whole.digest == merged.digest
        assert np.array_equal(whole.coefficients, merged.coefficients)
        assert np.array_equal(whole.distances, merged.distances)
    whole, merged = rc.reducer_claims(SEED, 1, reduced, 2, 1), rc.merge_claims(claims, reduced)
    assert np.allclose(whole.projections, merged.projections, rtol=1e-12, atol=0) and whole.digest == merged.digest
    assert np.allclose(whole.errors, merged.errors, rtol=1e-12) and np.array_equal(whole.distances, merged.distances)
    # a slice's parts of one index meet the same sign vectors as another slice's: here two equal deltas
    assert np.allclose(per_part[0][0].projections / -0.3,
                       rc.project([(received[0][0].delta, 1.0)], rc.part_seed(SEED, 0)), rtol=1e-12, atol=0)


@pytest.mark.parametrize("projections", [4, 8, 12])
def test_sign_vectors_are_fair_independent_signs(projections):
    signs = rc.SignSource().block(5, projections, 0)
    assert signs.shape == (projections, 1 << 16) and set(signs.unique().tolist()) == {-1.0, 1.0}
    # each vector's mean and each pair's correlation within 5 standard deviations (1/256) of 0
    assert float(signs.mean(dim=1).abs().max()) < 5 / 256
    correlations = (signs @ signs.T) / signs.shape[1] - torch.eye(projections)
    assert float(correlations.abs().max()) < 5 / 256


def test_withholding_strikes_keep_out_a_member_that_withholds_often_and_forgive_one_that_rarely_does():
    record = rc.WithholdingRecord(strikes=3, forgiven=0.25)
    assert not record.withheld("w") and not record.withheld("w") and record.withheld("w")  # kept out at the 3rd
    flaky = [record.withheld("f") for _ in range(1)]
    for round_number in range(200):  # misses one round in five, verified in the other four
        for _ in range(4):
            record.verified("f")
        flaky.append(record.withheld("f"))
    assert not any(flaky) and record["f"] <= 1.0
    kept_out = []
    for _ in range(20):  # withholds one round in four: 1 strike up, 3/4 down per four rounds, kept out in the end
        kept_out.append(record.withheld("q"))
        for _ in range(3):
            record.verified("q")
    assert kept_out.index(True) == 8  # 1 + 8 * 0.25 = 3 strikes
    with pytest.raises(ValueError):
        rc.WithholdingRecord(strikes=0)


@pytest.mark.parametrize("aggregation", ["mean", "centered_clip"])
def test_claims_stay_finite_and_consistent_beside_a_refused_nan_part(aggregation):
    """A NaN sender's refused part left the honest reducer's claims non-finite: every member refused its report, and
    the whole round (the honest slices too) went unverified (docs/notes/ci-failures.md, 2026-11-28)."""
    received = honest_group(3, 64, seed=5)
    received.append(torch.full((64,), float("nan")))
    statement = []
    result, refusals, _ = screen_and_aggregate(received, [1.0, 1.0, 1.0, 1.0], None, aggregation, None, 20, None,
                                               None, statement=statement, own=0)
    assert [refusal.sender for refusal in refusals] == [3] and result is not None
    combination = statement[0]
    assert combination.coefficients[3] == 0
    claims = rc.reducer_claims(SEED, 0, [rc.ReducedPart(received, result, combination)], 3, 0)
    from lightning_swarm.reducer_reports import decode_claims, encode_claims
    decoded = decode_claims(encode_claims(claims, 1, 4), 1, 4)  # raised "claims with non-finite values" before
    assert decoded is not None and decoded.distances[3, 0] == 0.0 and decoded.coefficients[3, 0] == 0.0
    header = rc.parse_header(rc.encode_header(combination, 1))
    assert rc._inconsistency([header], decoded, [1, 2, 3], True, rc.CHERNOFF_LIMIT) is None


@pytest.mark.parametrize("codec", ["none", "8bit"])
@pytest.mark.parametrize("aggregation", ["mean", "centered_clip"])
def test_a_massless_stand_in_verifies_a_slice_beside_a_nan_member_and_hides_no_lie(aggregation, codec):
    """A NaN sender's own report is refused, and a report required from every member left its first round unverified
    for everyone (each member kept its local gradient outside its own slice: docs/security.md). A checker whose own
    reducer refused that sender's part uses a massless sender's report instead of its: the honest slice passes,
    whatever that sender reports (no dispute to frame with), and a reducer that hides a lie in that sender's row, or
    gives it mass, does not pass."""
    size, reducer, nan_member, members = 256, 0, 3, [1, 2, 3]
    parts = honest_group(3, size, seed=11) + [torch.full((size,), float("nan"))]
    sent = [codec_roundtrip(p, codec) for p in parts[:3]] + [(parts[3], 0.0)]
    received = [decoded for decoded, _ in sent]
    statement = []
    result, refusals, _ = screen_and_aggregate(received, [1.0] * 4, None, aggregation, None, 20, None, None,
                                               statement=statement, own=reducer)
    assert [refusal.sender for refusal in refusals] == [nan_member] and refusals[0].breaks_protocol
    combination = statement[0]

    def received_part(j, v):
        delta, delta_q = codec_roundtrip(v - sent[j][0], codec)
        return rc.ReceivedPart(parts[j], delta, rc.parse_header(rc.encode_header(combination, j)), delta_q, sent[j][1])

    def verdicts(v, claims, nan_report=None, stand_in=True):
        """Each honest member's verdict, given the result v the reducer sent everyone."""
        honest_reports = {j: rc.member_report(SEED, reducer, [received_part(j, v)], 3) for j in (1, 2)}
        out = []
        for position, j in enumerate((1, 2)):
            stand_ins = [None, None, rc.massless_report(SEED, reducer, [received_part(j, v)], 3)] if stand_in else None
            out.append(rc.judge_slice([received_part(j, v).header], [honest_reports[1], honest_reports[2], nan_report],
                                      claims, members, position, reducer_sends=True, stand_ins=stand_ins))
        return out

    def claims_on(v):
        return rc.reducer_claims(SEED, reducer, [rc.ReducedPart(received, v, combination)], 3, reducer)

    honest = claims_on(result)
    assert [v.reason for v in verdicts(result, honest, stand_in=False)] == [
        "unverifiable: a member has no complete report on this slice"] * 2  # as before
    assert [v.reason for v in verdicts(result, honest)] == [None, None]
    # the NaN sender's report, finite and false (it is kept out already: framing would cost it nothing), is ignored
    frame = rc.member_report(SEED, reducer, [received_part(1, result)], 3)
    frame = rc.SliceReport(True, frame.projections + 50.0, frame.error, frame.digest, frame.coefficients,
                           frame.distances, frame.result, frame.result_error)
    assert [v.reason for v in verdicts(result, honest, nan_report=frame)] == [None, None]

    lie = 5.0 * float(result.norm()) / math.sqrt(size) * torch.randn(size, generator=torch.Generator().manual_seed(3))
    lied = result + lie
    # a lie hidden in the NaN sender's row: claims computed from the result sent, that row moved so that the claims sum
    # to minus the reducer's own stated residual
    claims = claims_on(lied)
    fitted = hide_lie_in_row(claims, nan_member, received[reducer], lied, combination)
    for verdict in verdicts(lied, fitted):
        assert verdict.reason is not None and verdict.reason.startswith("unverifiable: a member without a report")
    # the lie with that row left massless: the claims don't add up to the reducer's header
    for verdict in verdicts(lied, claims):
        assert verdict.reason is not None and verdict.blame == rc.BLAME_REDUCER
    # mass given to the NaN sender in the claims
    coefficients = honest.coefficients.copy()
    coefficients[nan_member] = 0.1
    massive = rc.ReducerClaims(honest.digest, honest.projections, honest.errors, coefficients, honest.distances,
                               honest.result, honest.result_error)
    for verdict in verdicts(result, massive):
        assert verdict.reason == ("unverifiable: a member without a report it can be held to is not massless in the "
                                  "reducer's claims (the reducer's claims give it mass)")


@pytest.mark.parametrize("aggregation", ["mean", "centered_clip"])
def test_a_sender_whose_part_never_came_has_a_massless_row_and_the_slice_is_checked_without_its_report(aggregation):
    """A sender whose part did not reach this reducer in time (banned for a late part: it then gets no result for it
    and has no report on the slice) made the reducer's claims None, so the slice was unverifiable for everyone. Now
    its row is massless, a massless stand-in replaces its report, and the honest slice passes; a lie hidden in that
    row does not, and claims that give such a sender mass are not made."""
    size, reducer, missing, members = 128, 0, 3, [1, 2, 3]
    received = honest_group(3, size, seed=13) + [None]
    statement = []
    result, _, _ = screen_and_aggregate(received, [1.0, 1.0, 1.0, 0.0], None, aggregation, None, 20, None, None,
                                        statement=statement, own=reducer)
    combination = statement[0]
    assert combination.coefficients[missing] == 0

    def received_part(j, v):
        return rc.ReceivedPart(received[j], v - received[j], rc.parse_header(rc.encode_header(combination, j)),
                               0.0, 0.0)

    def verdicts(v, claims):
        reports = [rc.member_report(SEED, reducer, [received_part(j, v)], 3) for j in (1, 2)] + [None]
        return [rc.judge_slice([received_part(j, v).header], reports, claims, members, position, reducer_sends=True,
                               stand_ins=[None, None, rc.massless_report(SEED, reducer, [received_part(j, v)], 3)])
                for position, j in enumerate((1, 2))]

    claims = rc.reducer_claims(SEED, reducer, [rc.ReducedPart(received, result, combination)], 3, reducer)
    assert claims is not None and claims.coefficients[missing, 0] == 0 and claims.distances[missing, 0] == 0
    assert [v.reason for v in verdicts(result, claims)] == [None, None]
    # a lie hidden in the missing sender's row: the claims then give it a residual no massless sender has
    lied = result + 0.5 * torch.randn(size, generator=torch.Generator().manual_seed(4))
    fitted = hide_lie_in_row(rc.reducer_claims(SEED, reducer, [rc.ReducedPart(received, lied, combination)], 3,
                                               reducer), missing, received[reducer], lied, combination)
    for verdict in verdicts(lied, fitted):
        assert verdict.reason is not None and verdict.reason.startswith("unverifiable: a member without a report")
    # no honest combination gives a sender that sent nothing mass: no claims then
    massive = dataclasses.replace(combination, coefficients=(*combination.coefficients[:3], 0.1))
    assert rc.reducer_claims(SEED, reducer, [rc.ReducedPart(received, result, massive)], 3, reducer) is None


def test_verification_messages_carry_the_failed_members_the_skip_and_the_seed():
    """A commitment names the members its sender saw fail (a mask after the 32 bytes, no bit beyond the group); an
    empty nonce is a member that skips the check (nobody blamed); a report carries the seed it was projected with,
    and one projected with another is set apart from a malformed one (OtherSeed, a MalformedMessage)."""
    from hivemind.compression.serialization import serialize_torch_tensor
    from hivemind.proto import averaging_pb2

    from lightning_swarm.hivemind_ext import result_verification as rv

    group, seed = b"g" * 32, b"s" * 32
    commitment = averaging_pb2.AveragingData(group_id=group, weight=1.0, peer_id=b"c" * 32 + rv.failed_mask([1, 9], 10))
    assert rv.parse_verification_message(commitment, group, 1, 0, 10) == (b"c" * 32, frozenset({1, 9}))
    for peer_id in (b"c" * 32, b"c" * 32 + bytes([0, 4]), b""):  # no mask, a bit beyond 10 members, empty
        with pytest.raises(rv.MalformedMessage):
            rv.parse_verification_message(averaging_pb2.AveragingData(group_id=group, weight=1.0, peer_id=peer_id),
                                          group, 1, 0, 10)
    with pytest.raises(rv.SkippedCheck):
        rv.parse_verification_message(averaging_pb2.AveragingData(group_id=group, weight=2.0), group, 2, 0, 10)
    values = serialize_torch_tensor(torch.zeros(4, dtype=torch.float64))
    report = averaging_pb2.AveragingData(group_id=group, weight=3.0, peer_id=seed, tensor_part=values)
    assert rv.parse_verification_message(report, group, 3, 4, 10, seed).shape == (4,)
    with pytest.raises(rv.OtherSeed):
        rv.parse_verification_message(report, group, 3, 4, 10, b"t" * 32)
