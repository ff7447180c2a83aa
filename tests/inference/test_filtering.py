import math

import pytest
import torch

from inference.filtering import sample_from_logits, top_k_filter, top_p_filter


def kept(logits):
    return [set(torch.nonzero(torch.isfinite(row)).flatten().tolist()) for row in logits]


def test_top_k_keeps_exactly_the_k_largest():
    logits = torch.tensor([[0.1, 3.0, -1.0, 2.0, 0.5], [5.0, 4.0, 3.0, 2.0, 1.0]])
    filtered = top_k_filter(logits, 2)
    assert kept(filtered) == [{1, 3}, {0, 1}]
    assert torch.equal(filtered[0, [1, 3]], logits[0, [1, 3]])  # kept values unchanged
    assert top_k_filter(logits, None) is logits and top_k_filter(logits, 5) is logits
    with pytest.raises(ValueError, match="top_k"):
        top_k_filter(logits, 0)


def test_top_p_keeps_the_smallest_nucleus():
    probs = torch.tensor([[0.5, 0.05, 0.3, 0.15], [0.9, 0.04, 0.035, 0.025]])
    logits = probs.log()
    # row 0 sorted: 0.5 (idx0), 0.3 (idx2), 0.15 (idx3), 0.05 (idx1); mass before idx3 is 0.8
    assert kept(top_p_filter(logits, 0.75)) == [{0, 2}, {0}]
    assert kept(top_p_filter(logits, 0.85)) == [{0, 2, 3}, {0}]
    assert kept(top_p_filter(logits, 0.96)) == [{0, 1, 2, 3}, {0, 1, 2}]
    assert kept(top_p_filter(logits, 0.01)) == [{0}, {0}]  # the most likely entry always stays


def test_top_p_respects_an_earlier_top_k():
    logits = torch.tensor([[2.0, 1.9, 1.8, 1.7, -5.0]])
    assert kept(top_p_filter(top_k_filter(logits, 3), 0.99)) == [{0, 1, 2}]


def test_sampling_draws_only_kept_entries_and_is_seeded():
    logits = torch.randn(64, 50)
    draws = sample_from_logits(logits, top_k=3, generator=torch.Generator().manual_seed(1))
    top3 = logits.topk(3).indices
    assert (draws[:, None] == top3).any(-1).all()
    again = sample_from_logits(logits, top_k=3, generator=torch.Generator().manual_seed(1))
    assert torch.equal(draws, again)
    assert torch.equal(sample_from_logits(logits, temperature=0), logits.argmax(-1))


def test_sampling_frequencies_follow_the_renormalised_nucleus():
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    logits = probs.log().expand(20000, -1)
    draws = sample_from_logits(logits, top_p=0.75, generator=torch.Generator().manual_seed(0))
    share_of_first = (draws == 0).float().mean().item()
    assert set(draws.unique().tolist()) == {0, 1}
    assert math.isclose(share_of_first, 0.5 / 0.8, abs_tol=0.02)
