"""CenteredClip's alignment screen and the senders' alignment history (lightning_swarm.aggregation), and the reducer
that applies them (hivemind's asyncio code path, as in test_robust_aggregation.py)."""

from __future__ import annotations

import pytest
import torch

from lightning_swarm.aggregation import (
    SenderTrust,
    aligned_centered_clip,
    centered_clip,
    check_aggregation_options,
    weighted_mean,
)
from test_robust_aggregation import run_reducer


def noisy_gradients(num: int, noise: float, size: int = 2000, seed: int = 0) -> tuple:
    """``num`` honest gradients: one true gradient plus independent noise of ``noise`` times its norm."""
    generator = torch.Generator().manual_seed(seed)
    true = torch.randn(size, generator=generator)
    return true, [true + noise * true.norm() / size ** 0.5 * torch.randn(size, generator=generator)
                  for _ in range(num)]


def along(result: torch.Tensor, direction: torch.Tensor) -> float:
    """The fraction of ``direction`` that ``result`` goes along."""
    return float(result @ direction / (direction @ direction))


@pytest.mark.parametrize("weights", [[1.0, 1.0, 1.0], [16.0, 176.0, 192.0], [176.0, 16.0, 192.0]])
def test_a_negated_sender_loses_its_weight_also_when_an_honest_peer_had_few_samples(weights):
    # noise as large as the gradient: plain CenteredClip keeps only part of the honest step
    _, (first, second, third) = noisy_gradients(3, noise=1.0)
    honest_mean = weighted_mean([first, second], weights[:2])
    plain = centered_clip([first, second, -third], weights)
    result, factors, _ = aligned_centered_clip([first, second, -third], weights, min_alignment=0.5)
    assert factors[2] == 0.0 and factors[:2] == [1.0, 1.0]
    assert along(plain, honest_mean) < 0.9  # what the screen is for
    assert abs(along(result, honest_mean) - 1.0) < 0.1


def test_honest_senders_keep_their_weights_and_the_result_is_plain_centered_clip():
    for seed in range(5):
        _, gradients = noisy_gradients(5, noise=1.0, seed=seed)
        weights = [float(w) for w in range(10, 15)]
        result, factors, _ = aligned_centered_clip(gradients, weights, min_alignment=0.5)
        assert factors == [1.0] * 5
        assert torch.allclose(result, centered_clip(gradients, weights), atol=1e-6)


@pytest.mark.parametrize("scale", [-2.0, -0.5, 0.0, 0.25, 0.5, 0.75])
def test_a_sender_going_partly_along_lowers_the_step_by_at_most_its_share_times_one_minus_the_screen(scale):
    # the attacker's best evasion: a part that goes along just enough of the step to keep (some of) its weight
    true, (first, second) = noisy_gradients(2, noise=0.2)
    min_alignment = 0.5
    result, _, _ = aligned_centered_clip([first, second, scale * true], [1.0, 1.0, 1.0],
                                         min_alignment=min_alignment)
    honest_mean = (first + second) / 2
    assert along(result, honest_mean) >= 1.0 - (1.0 / 3.0) * (1.0 - min_alignment) - 0.02


def test_with_two_senders_the_history_decides_and_neither_part_counts_longer_than_the_other():
    _, (honest, other) = noisy_gradients(2, noise=0.5)
    result, factors, scales = aligned_centered_clip([honest, -other], [1.0, 1.0], min_alignment=0.5)
    assert factors == [0.0, 0.0]  # their alignments add up to 2: no screen; opposed parts: no agreement
    norms = [honest.norm(), other.norm()]
    assert scales == pytest.approx([float(min(norms) / n) for n in norms])
    result, _, _ = aligned_centered_clip([honest, -other], [1.0, 1.0], min_alignment=0.5, prior=[1.0, 0.0])
    assert torch.allclose(result, honest, atol=1e-5)
    # a prior that leaves no weight is ignored
    result, _, _ = aligned_centered_clip([honest, -other], [1.0, 1.0], min_alignment=0.5, prior=[0.0, 0.0])
    assert torch.allclose(result, (scales[0] * honest - scales[1] * other) / 2, atol=1e-6)


@pytest.mark.parametrize("scale", [1e3, -1e3, -1.0, 0.0])
def test_a_loud_or_negated_second_sender_never_turns_the_step_back(scale):
    # issue 24, finding 0: of 2 senders, a loud gradient ascent (-1e3 x) decided their mean
    _, (honest, attacker) = noisy_gradients(2, noise=0.5)
    result, _, scales = aligned_centered_clip([honest, scale * attacker], [16.0, 16.0], min_alignment=0.5)
    assert float(result @ honest) >= -1e-6 * float(honest @ honest)  # never against the honest part
    # nor much longer than it: parts that agree in direction are clipped to twice the shorter one's norm
    assert float(result.norm()) <= float(honest.norm()) * (1.5 + 1e-6)
    if abs(scale) == 1e3:
        assert scales[0] == 1.0 and scales[1] < 2e-3
        assert along(result, honest) > (0.45 if scale > 0 else -0.05)


def test_reducer_refuses_a_lone_sender_without_a_record_and_records_a_loud_one(caplog):
    _, (honest, other) = noisy_gradients(2, noise=0.5, size=500)
    # a lone sender never seen: refused (every sender keeps its own part: the weight-0 one its zeros, the lone one
    # its own part); one with a good record: believed
    own = [-1e3 * honest, 0.5 * other]
    for record, believed in [(None, False), (0.2, False), (0.9, True)]:
        results = run_reducer([[own[0]], [own[1]]], [16.0, 0.0], caplog,
                              aggregation="centered_clip", min_alignment=0.5, trust=[record, None])
        for sender in range(2):
            assert torch.equal(results[sender][0], own[0] if believed else own[sender]), record
    assert "the only sender of a part, not seen before in this run or with a record below 0.5" in caplog.text
    # of 2 senders, one 1e3 times as long as the other is recorded as an outlier
    reported = []
    run_reducer([[honest], [-1e3 * other]], [16.0, 16.0], caplog, aggregation="centered_clip", min_alignment=0.5,
                trust=[None, None], on_alignment=reported.append)
    (record,) = reported
    assert record[0] == (1.0, 0.0) and record[1][0] < 0.02  # the other: seen (evidence 0), not judged
    assert "peer1: its part is more than 10 times as long as the other sender's" in caplog.text


def test_sender_trust_remembers_recent_rounds_more():
    trust = SenderTrust(decay=0.5)
    assert trust.trust("a") == 1.0  # never judged
    trust.update({"a": (0.0, 1.0), "b": (1.0, 1.0)})
    assert trust.trust("a") == 0.0 and trust.trust("b") == 1.0
    trust.update({"a": (1.0, 1.0)})
    assert trust.trust("a") == pytest.approx(1.0 / 1.5)  # (0.5 * 0 + 1) / (0.5 + 1)
    for _ in range(20):
        trust.update({"a": (1.0, 1.0)})
    assert trust.trust("a") > 0.99
    # a round in which a sender had a tenth of the median weight counts a tenth of a round
    trust.update({"b": (0.0, 0.1)})
    assert trust.trust("b") == pytest.approx((0.5 * 1.0 + 0.0) / (0.5 * 1.0 + 0.1))


def test_min_alignment_option_is_checked():
    check_aggregation_options("centered_clip", None, 10, 0.5)
    check_aggregation_options("centered_clip", None, 10, None)
    for bad in [0.0, 1.5, -0.1, float("nan"), True, "0.5"]:
        with pytest.raises(ValueError, match="min_alignment"):
            check_aggregation_options("centered_clip", None, 10, bad)


def test_reducer_lowers_a_negated_sender_names_it_and_reports_its_alignment(caplog):
    # 2 parts; sender 2 sends its gradients negated, with weight 1e9 lowered to its record
    parts = [noisy_gradients(3, noise=1.0, size=500, seed=s)[1] for s in range(2)]
    parts_by_sender = [[parts[0][i], parts[1][i]] for i in range(3)]
    parts_by_sender[2] = [-p for p in parts_by_sender[2]]
    reported = []
    results = run_reducer(parts_by_sender, [50.0, 100.0, 1e9], caplog, aggregation="centered_clip",
                          max_weights=[100.0] * 3, min_alignment=0.5, trust=[1.0, 0.6, 0.4],
                          on_alignment=reported.append)
    for part_index in range(2):
        honest_mean = (parts_by_sender[0][part_index] + parts_by_sender[1][part_index]) / 2
        assert abs(along(results[0][part_index], honest_mean) - 1.0) < 0.1
    (record,) = reported  # (alignment factor x clip scale, evidence: weight / median, at most 1) per sender
    assert record[2] == (0.0, 1.0) and record[0][1] == 0.5 and record[1][1] == 1.0
    assert min(record[0][0], record[1][0]) > 0.3
    assert "peer2" in caplog.text and "goes along less than 0.5" in caplog.text and "(2 of 2 parts)" in caplog.text
    assert "x0.40 from its record in past rounds" in caplog.text
    assert "peer0" not in caplog.text and "peer1" not in caplog.text


def test_lowering_an_honest_sender_does_not_hand_a_far_attacker_the_result():
    # the honest peer with few samples goes against the step this round and loses its weight; the x1e3 attacker
    # goes along (it keeps its weight) and now holds half of it: the vote's radius still bounds it
    true, (first, attacker) = noisy_gradients(2, noise=0.5)
    generator = torch.Generator().manual_seed(1)
    misaligned = -0.5 * true + 0.5 * true.norm() / true.numel() ** 0.5 * torch.randn(true.numel(), generator=generator)
    parts, weights = [first, misaligned, 1e3 * attacker], [176.0, 16.0, 176.0]
    result, factors, scales = aligned_centered_clip(parts, weights, min_alignment=0.5)
    # (the far attacker is left out of the vote, which is then the two others': the misaligned one goes along ~0 of it)
    assert factors[0] == factors[2] == 1.0 and factors[1] < 1e-2
    assert (result - first).norm() <= (first - misaligned).norm()  # the honest spread, not 1e3
    assert scales[2] < 1e-2 and min(scales[:2]) > 0.3  # the far attacker's record is low even though it goes along


def test_a_far_sender_remembered_from_3_sender_rounds_loses_the_2_sender_round():
    # a round of 3 (x1e3 attacker clipped, recorded), then a round where only it and one honest peer send
    trust = SenderTrust()
    _, (first, second, third) = noisy_gradients(3, noise=0.5)
    _, factors, scales = aligned_centered_clip([first, second, 1e3 * third], [1.0] * 3, min_alignment=0.5)
    trust.update({sender: (f * c, 1.0) for sender, (f, c) in enumerate(zip(factors, scales))})
    assert trust.trust(2) < 1e-2 and min(trust.trust(0), trust.trust(1)) > 0.3
    _, (honest, attacker) = noisy_gradients(2, noise=0.5, seed=1)
    plain, _, _ = aligned_centered_clip([honest, 1e3 * attacker], [1.0, 1.0], min_alignment=0.5)
    remembered, _, _ = aligned_centered_clip([honest, 1e3 * attacker], [1.0, 1.0], min_alignment=0.5,
                                             prior=[trust.trust(0), trust.trust(2)])
    assert (plain - honest).norm() < honest.norm()  # 2 senders: clipped to the honest part's norm (not the mean)
    assert (remembered - honest).norm() < 0.1 * honest.norm()


def test_the_public_swarm_recipe_ships_with_centered_clip_and_the_alignment_screen():
    # issue 24, finding 9: with "mean", one x1e3 peer made a swarm diverge (docs/security.md)
    import yaml
    from pathlib import Path

    config = yaml.safe_load((Path(__file__).resolve().parents[2] / "configs" / "dalle_1b.yaml").read_text())
    options = config["trainer"]["strategy"]["init_args"]
    assert options["aggregation"] == "centered_clip" and options["centered_clip_min_alignment"] == 0.5
    check_aggregation_options(options["aggregation"], options.get("centered_clip_tau"),
                              options.get("centered_clip_iters", 20), options["centered_clip_min_alignment"])


def test_a_sender_seen_in_a_round_of_2_is_known_and_keeps_its_record():
    trust = SenderTrust()
    assert trust.record("a") is None  # never seen: a lone part from it is refused
    trust.update({"a": (1.0, 0.0)})  # seen in a round of 2, not judged
    assert trust.record("a") == 1.0
    trust.update({"b": (0.0, 1.0)})  # judged: an outlier
    for _ in range(5000):  # seen again and again: neither forgotten nor forgiven
        trust.update({"b": (1.0, 0.0)})
    assert trust.record("b") == 0.0


def test_an_honest_record_lowered_once_recovers_in_rounds_of_2_senders_that_agree_and_a_liars_does_not(caplog):
    # issue 24: a 3-peer swarm whose liar is kept out has rounds of 2 senders; an honest sender outvoted once in a
    # round of 3 (a slice mostly noise) kept weight x0.00 for the rest of the run (test_byzantine_swarm's lying case)
    trust = SenderTrust()
    trust.update({"honest": (0.0, 1.0), "negated": (0.0, 1.0)})
    weights = {"honest": [], "negated": []}
    for seed in range(8):
        true, (mine, theirs) = noisy_gradients(2, noise=0.5, size=500, seed=seed)
        for name, part in [("honest", theirs), ("negated", -theirs)]:
            reported = []
            run_reducer([[mine], [part]], [16.0, 16.0], caplog, aggregation="centered_clip", min_alignment=0.5,
                        trust=[trust.record("me"), trust.record(name)], on_alignment=reported.append)
            (records,) = reported
            trust.update({"me": records[0], name: records[1]})
            weights[name].append(trust.trust(name))
    # agreeing parts: both recorded as going along, with the cosine of their angle (~0.8) as evidence
    assert weights["honest"][0] > 0.4 and weights["honest"][-1] > 0.95
    assert max(weights["negated"]) == 0.0  # opposed parts say nothing: the liar's record stays where it was


def test_a_loud_ascent_sender_does_not_bend_the_vote_where_honest_parts_are_mostly_noise():
    # near convergence: two honest parts whose mean (the true gradient) is 10 times shorter than their noise, and a
    # sender of -1e3 times the first. Clipped, it still bent the vote by about half the honest spread: the first honest
    # part then went against the vote and lost its weight, the ascent went along it and kept its own, and the result
    # went uphill (x -0.99 of the true gradient). Left out of the vote, it loses its weight and the result is the honest
    # mean.
    generator = torch.Generator().manual_seed(0)
    true = torch.randn(1000, generator=generator)
    true *= 0.1 / true.norm()
    noise = torch.randn(1000, generator=generator)
    noise -= (noise @ true) / (true @ true) * true
    noise *= 1.0 / noise.norm()
    first, second = true + noise, true - noise
    result, factors, scales = aligned_centered_clip([first, second, -1e3 * first], [1.0] * 3, min_alignment=0.5)
    assert factors == [1.0, 1.0, 0.0] and scales[:2] == [1.0, 1.0] and scales[2] < 1e-2
    assert (result - true).norm() < 1e-3 * true.norm()


@pytest.mark.parametrize("num_honest", [1, 2])
def test_records_all_low_do_not_hand_the_round_to_a_loud_sender(num_honest):
    # an honest peer's noisy slice can record ~0 in a round of 3, and a loud sender's record is ~0.01: renormalised,
    # those records gave the loud sender all the weight (and, of 2 senders, made its norm the reference): its -1e3 x
    # part decided the round. Records that trust nobody now leave the round to this round's own rules.
    generator = torch.Generator().manual_seed(2)
    honest = [torch.randn(1000, generator=generator)]
    honest += [honest[0] + 0.5 * torch.randn(1000, generator=generator)] * (num_honest - 1)
    attacker = -1e3 * torch.randn(1000, generator=generator)
    result, _, _ = aligned_centered_clip(honest + [attacker], [1.0] * (num_honest + 1), min_alignment=0.5,
                                         prior=[0.0] * num_honest + [0.01])
    honest_mean = sum(honest) / num_honest
    assert along(result, honest_mean) >= 0.0  # never uphill
    assert result.norm() <= 1.5 * max(part.norm() for part in honest)  # nor anywhere near the loud part's length


@pytest.mark.parametrize("multiplier", [1e3, -1e3, 10.0])
def test_a_loud_sender_moves_the_result_by_about_the_honest_spread_whatever_the_weights(multiplier):
    # small parts mostly of noise (a slice of a few values, as in a small model's round 0) and uneven sample counts:
    # the screen could take an honest part's weight and leave the loud sender most of the rest, and CenteredClip's
    # own radius grew as its estimate left the honest parts; the result went up to 12x the honest spread away
    # (issue 24: round 0 of the Byzantine scale case)
    generator = torch.Generator().manual_seed(0)
    worst = 0.0
    for _ in range(1000):
        size = int(torch.randint(1, 10, (), generator=generator))
        true = torch.randn(size, generator=generator)
        noise = 2 * float(torch.rand((), generator=generator))
        first, second, third = (true + noise * torch.randn(size, generator=generator) for _ in range(3))
        weights = [float(w) for w in torch.randint(16, 400, (3,), generator=generator)]
        result, _, _ = aligned_centered_clip([first, second, multiplier * third], weights, min_alignment=0.5)
        spread = float((first - second).norm())
        worst = max(worst, float((result - (first + second) / 2).norm()) / max(spread, 1e-9))
    assert worst < 5.0, worst  # about the vote's radius (the honest spread): CenteredClip's bound for one loud sender
