"""A 3-peer swarm with one malicious peer (tests/lightning_swarm/byzantine.py), real peers as separate processes
on 127.0.0.1, with the README's settings for a swarm open to strangers (CenteredClip and its alignment screen, 0.5):
the two honest peers' parameters stay finite and their validation loss after STOP_AT_EPOCH global epochs ends at most
10% above that of the same swarm, with the same settings, in which the third peer is honest. The problem is least
squares with a known noise floor, which the clean swarm reaches within those epochs, so that the reference does not
move with the peers' race (byzantine.py says why). The weight attacker's claim of 1e9 is lowered to its record and its
negated gradients lose their weight, and the loud ascent attacker's gradients (x -1e3) theirs, all logged. A lying
reducer (+100 on every value of the slice it reduces, in gradient and state rounds) has its slice refused and is kept
out of both honest peers' later groups, each naming it."""

from __future__ import annotations

import pytest
import torch

from byzantine import attacker_peer_id, noise_floor, run_swarm, validation_loss
from lightning_swarm.aggregation import DEFAULT_MIN_ALIGNMENT

pytestmark = pytest.mark.slow

RUN_TIMEOUT = 200.0  # a run takes 40-110 s (loaded); its peers stop at 150 s of training (byzantine.run_swarm)


# The clean swarm ends at most this much above the noise floor (the loss of the data's true weights): it reached the
# optimum, so its loss is no longer a point on the way that the race moves (measured: docs/security.md, Figures).
MAX_CLEAN_OVER_FLOOR = 1.05


@pytest.fixture(scope="module")
def honest_swarm_loss(tmp_path_factory):
    # the clean swarm runs the same open-swarm settings as the attacked ones, so the bound is on what the attacker
    # costs; what the screen costs an honest swarm is measured apart (docs/security.md, bench_alignment_screen.py)
    params, _ = run_swarm(tmp_path_factory.mktemp("honest"), attack=None, timeout=RUN_TIMEOUT,
                          min_alignment=DEFAULT_MIN_ALIGNMENT)
    losses = [validation_loss(p) for p in params]
    floor, initial = noise_floor(), validation_loss()
    print(f"clean swarm: validation loss {losses}, x{max(losses) / floor:.4f} the noise floor {floor}")
    assert max(losses) <= MAX_CLEAN_OVER_FLOOR * floor, f"the clean swarm did not reach the noise floor {floor}: " \
        f"{losses} (initial {initial})"
    return sum(losses) / len(losses)


# Issue 24, item 10: every attacker within 10% of the clean swarm. Over the clean swarm's own run-to-run spread and
# each attack's several runs (docs/security.md, Figures) the ratios stay well inside it. Without the defences the same
# attacks are not near it: without the alignment screen the ascent attacker made the swarm diverge, and a swarm that
# stops training ends at the initial loss, x6.8 the floor.
MAX_LOSS_RATIO = 1.10


@pytest.mark.timeout(2 * RUN_TIMEOUT + 60)
# Every attacker meets the README's open-swarm settings (issue 24, item 10).
@pytest.mark.parametrize("attack,logged", [
    ("scale", []), ("nan", ["NaN or Inf"]), ("weight", ["lowered to", "goes along less than"]),
    ("ascent", ["goes along less than"])], ids=["scale", "nan", "weight", "ascent"])
def test_honest_peers_withstand_a_byzantine_peer(tmp_path, honest_swarm_loss, attack, logged):
    params, logs = run_swarm(tmp_path, attack, timeout=RUN_TIMEOUT, min_alignment=DEFAULT_MIN_ALIGNMENT)
    assert_within_bound(attack, params, honest_swarm_loss)
    for text in logged:  # the honest peers named what they refused from the attacker
        assert any(text in log for log in logs), (attack, text)


@pytest.mark.timeout(2 * RUN_TIMEOUT + 60)
def test_honest_peers_withstand_a_lying_reducer(tmp_path, honest_swarm_loss):
    """Issue 24: the third peer sends honest gradients and states, but reduces its slice dishonestly (+100 on every
    value, honest header: byzantine.py's ``liar``). Each honest peer refuses its slice, names it and keeps it out of
    its later groups; the honest loss ends within MAX_LOSS_RATIO of the clean swarm.

    "Honest parameters within the range of the honest inputs at every coordinate" is asserted for one round in
    test_lying_reducer.py, where the inputs are known; a training swarm's rounds mix in local steps between them, so
    here the lie's absence shows in the loss instead: +100 on one slice (~3 of the model's 9 values) of the gradients,
    applied once at epoch e, moves those weights by 100 * 0.5 / (1 + e), and each later epoch e' keeps e' / (1 + e')
    of that: 50 / STOP_AT_EPOCH is left whatever e (~8, a loss ~200: hundreds of times the bound); applied to the
    parameters it leaves more."""
    params, logs = run_swarm(tmp_path, "liar", timeout=RUN_TIMEOUT, min_alignment=DEFAULT_MIN_ALIGNMENT)
    assert_within_bound("liar", params, honest_swarm_loss)
    liar = attacker_peer_id(tmp_path)
    for log in logs:  # each honest peer refused the liar's slice itself and keeps it out
        assert f"refused the slice reduced by {liar}" in log, log[-3000:]
        assert f"peer {liar} is kept out of this peer's later groups" in log, log[-3000:]


def assert_within_bound(attack: str, params, honest_swarm_loss: float) -> None:
    """The honest peers' ``params`` are finite and their validation loss at most MAX_LOSS_RATIO times the clean
    swarm's ``honest_swarm_loss`` (``attack`` names the case in messages)."""
    for peer_params in params:
        for name, tensor in peer_params.items():
            assert torch.isfinite(tensor).all(), f"{attack}: {name} is not finite"
    losses = [validation_loss(p) for p in params]
    print(f"{attack}: honest peers' validation loss {losses}, without the attacker {honest_swarm_loss}; ratios "
          f"{[round(loss / honest_swarm_loss, 4) for loss in losses]}")
    for loss in losses:
        assert loss <= MAX_LOSS_RATIO * honest_swarm_loss, (attack, losses, honest_swarm_loss)
