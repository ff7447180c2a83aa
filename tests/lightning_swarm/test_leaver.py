"""A peer that dies mid-round (SIGKILL of its whole process group) costs its group at most one next_chunk_timeout,
never a global step: the survivors' round completes with the parts they have, their epoch advances on averaged
gradients, and their next rounds run without the dead peer."""

from __future__ import annotations

import pytest

from netns_harness import network_harness_available

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(bool(network_harness_available()), reason=network_harness_available() or "ok")]


def test_peer_killed_mid_round_costs_its_group_at_most_one_next_chunk_timeout(tmp_path):
    from leaver_scenario import AVERAGING_TIMEOUT, NEXT_CHUNK_TIMEOUT, run_leaver_scenario, summarize

    result = run_leaver_scenario(tmp_path, rounds_before=2, rounds_after=1)  # fewer rounds: the suite's time
    summary = summarize(result)
    print(result["kill_after_s"], summary)
    # each survivor finished rounds after the kill (run_leaver_scenario waits for them): the first is the one the
    # death hit (under way at the kill, or the next one when the survivors had averaged without the late victim)
    assert all(survivor["killed_round_s"] is not None for survivor in summary.values()), summary
    for name, survivor in summary.items():
        assert survivor["normal_max_s"] is not None, (name, summary)
        # the round ended without waiting averaging_timeout: hivemind completed it with the parts it had (the dead
        # peer's slice keeps each survivor's own values), and the reducer check, which can't run without the dead
        # member's report, did not wait for it (its other slices are not applied: docs/security.md)
        assert survivor["killed_round_outcome"].startswith("Averaged gradients with"), (name, summary)
        assert survivor["killed_round_s"] <= survivor["normal_max_s"] + NEXT_CHUNK_TIMEOUT, (name, summary)
        assert survivor["killed_round_s"] < AVERAGING_TIMEOUT, (name, summary)
        after = [(epoch, outcome) for epoch, outcome in survivor["after"] if outcome]
        assert after and after[-1][1] == "Averaged gradients with 2 peers", (name, summary)
        # a round after the kill fails only when the other survivor never began a round of that epoch (it was a step
        # behind and downloaded the swarm's state instead: in the CI run a was at epoch 7 and b at 6 when the victim
        # died; a's round for 8 found no group while b loaded state to epoch 9). With both survivors in the epoch's
        # round, a failure would be the dead peer's cost (its DHT records inviting it into a group it never joins).
        other_epochs = {other: {epoch for epoch, _ in rest["after"]} | {rest["killed_round_epoch"]}
                        for other, rest in summary.items() if other != name}
        for epoch, outcome in after:
            if outcome != "Averaged gradients with 2 peers":
                assert all(epoch not in epochs for epochs in other_epochs.values()), (name, epoch, summary)
