"""A newcomer trains with the swarm after one state download, however short the swarm's global steps
(lightning_swarm.hivemind_ext.catch_up): peer A never waits for it (no barrier), B's download over a 10 Mbit/s link
spans several of A's global steps."""

from __future__ import annotations

import pytest

from lightning_swarm import HivemindStrategy
from lightning_swarm.hivemind_ext.catch_up import DEFAULT_MAX_STALE_EPOCHS, check_max_stale_epochs
from netns_harness import network_harness_available


@pytest.mark.parametrize("value", [-1, 1.5, True, "4", None])
def test_max_stale_epochs_must_be_a_number_of_epochs(value):
    with pytest.raises(ValueError, match="max_stale_epochs"):
        check_max_stale_epochs(value)
    with pytest.raises(ValueError, match="max_stale_epochs"):
        HivemindStrategy(run_id="x", target_batch_size=8, max_stale_epochs=value)


def test_max_stale_epochs_accepts_zero_and_the_default():
    assert check_max_stale_epochs(0) == 0
    assert check_max_stale_epochs(DEFAULT_MAX_STALE_EPOCHS) == DEFAULT_MAX_STALE_EPOCHS


@pytest.mark.slow
@pytest.mark.skipif(bool(network_harness_available()), reason=network_harness_available() or "ok")
def test_newcomer_trains_after_one_download_while_the_swarm_steps_faster_than_it_downloads(tmp_path):
    """B downloads once, although the swarm made several global steps meanwhile, then averages gradients with A at
    its first global step (both see 2 peers) and its state is merged into A's at the next state round."""
    from newcomer_scenario import run_newcomer_scenario

    result = run_newcomer_scenario(tmp_path, max_stale_epochs=DEFAULT_MAX_STALE_EPOCHS, rounds=3, window=150)
    log = result.pop("log_b")
    print(result)
    assert result["downloads"] == 1, (result, log[-4000:])
    assert result["caught_up"], log[-4000:]
    swarm_epoch, state_epoch, behind = result["caught_up"][0]
    assert behind >= 2, result  # the download spanned several global steps: hivemind alone would download again
    assert result["rounds_b"] >= 3, (result, log[-4000:])
    assert result["peers_a"] == 2 and result["peers_b"] == 2, result
    assert "merged into its group's by a state averaging round" in log, log[-4000:]
