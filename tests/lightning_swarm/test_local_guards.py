"""A peer's own guards against non-finite values (issue 18, "local guards"), with real peers as separate processes
on 127.0.0.1: a peer whose gradients turn NaN never sends them, and a newcomer never loads a downloaded state that
holds NaN. (A NaN sent on purpose by a malicious peer is test_byzantine_swarm.py's business.)"""

from __future__ import annotations

import pytest
import torch

from round_log import complete_steps, round_lines
from swarm_harness import Peer

pytestmark = pytest.mark.slow

LOCAL = ["/ip4/127.0.0.1/tcp/0"]
DROPPED_OWN_GRADIENT = "this peer's accumulated gradient holds NaN or Inf values: dropped"
# what a receiver logs when a sender's part or a reducer's result is non-finite: it never has to, if no peer sends NaN
RECEIVED_NON_FINITE = ("its part holds NaN or Inf values", "non-finite result part")
REFUSED_STATE = "refused the downloaded state"


def strategy_args(run_id: str, **overrides):
    # verbose: hivemind logs each gradient round's outcome (round_log.complete_steps reads it)
    args = dict(run_id=run_id, target_batch_size=32, host_maddrs=LOCAL, matchmaking_time=1.5, averaging_timeout=15.0,
                load_state_timeout=20.0, metrics_interval=1.0, compression="none", verbose=True,
                tracker_opts={"max_refresh_period": 1.0, "min_refresh_period": 0.2, "default_refresh_period": 0.5})
    args.update(overrides)
    return args


def all_finite(params) -> bool:
    return all(bool(torch.isfinite(tensor).all()) for tensor in params.values())


@pytest.mark.timeout(240)
def test_a_peer_whose_gradients_turn_nan_sends_none_of_them(tmp_path, peers):
    """The second peer's loss is NaN at one batch, so its accumulated gradient for that epoch is NaN: it logs that it
    dropped it and takes part with weight 0. Nobody receives a NaN (no receiver logs a refusal), both peers keep
    finite parameters at every global epoch, they trained, and they hold equal parameters after every global step
    whose gradient round both completed (the second applied the first's average)."""
    recorder = {"stop_at_epoch": 3, "max_seconds": 90, "barrier_dir": str(tmp_path / "barrier"), "barrier_count": 2}
    first = Peer(tmp_path, "first", strategy_args("nangrad"), model={"step_delay": 0.02}, data={"batch_size": 4},
                 recorder=recorder)
    peers.append(first)
    second = Peer(tmp_path, "second", strategy_args("nangrad"), model={"step_delay": 0.02, "nan_at_batches": [4]},
                  data={"batch_size": 4, "offset": 50_000}, recorder=recorder, join_later=True)
    peers.append(second)
    second.join(first.join_peers(timeout=150))
    for peer in (first, second):
        peer.wait(timeout=150)

    assert DROPPED_OWN_GRADIENT in second.log(), second.log()[-3000:]
    for peer in (first, second):
        for text in RECEIVED_NON_FINITE:
            assert text not in peer.log(), (peer.name, text)
        assert peer.max_epoch() >= 3, peer.events()
        for epoch in range(peer.max_epoch() + 1):
            assert all_finite(peer.params(epoch)), (peer.name, epoch)
    # A round can come back partial on a loaded machine (a sender or reducer late by next_chunk_timeout, see
    # round_log.py): each peer then keeps values of its own where it lost the other's, and for the weight-0 peer those
    # are zeros. So equality is asserted after every step both peers completed, up to the first one either did not.
    complete = complete_steps(first.log()) & complete_steps(second.log())
    rounds = f"first:\n{round_lines(first.log())}\nsecond:\n{round_lines(second.log())}"
    for epoch in range(1, min(first.max_epoch(), second.max_epoch()) + 1):
        if epoch - 1 not in complete:
            break
        for name, tensor in first.params(epoch).items():
            assert torch.allclose(tensor, second.params(epoch)[name], atol=1e-6), (epoch, name, rounds)
    assert not torch.allclose(first.params(0)["net.0.weight"], first.params(3)["net.0.weight"])  # it trained


@pytest.mark.timeout(240)
def test_a_newcomer_refuses_a_downloaded_state_holding_nan(tmp_path, peers):
    """The only peer of a run holds a NaN in its parameters; a newcomer joins, downloads its state, refuses it with
    a log line, and trains on from its own finite initialisation."""
    donor = Peer(tmp_path, "donor", strategy_args("nanstate"), model={"nan_parameters": True}, data={"batch_size": 4},
                 recorder={"stop_at_epoch": 1000, "max_seconds": 150})
    peers.append(donor)
    newcomer = Peer(tmp_path, "newcomer", strategy_args("nanstate", initial_peers=donor.join_peers(timeout=150)), model={},
                    data={"batch_size": 4, "offset": 50_000}, recorder={"stop_at_epoch": 1000, "max_seconds": 8})
    peers.append(newcomer)
    newcomer.wait(timeout=180)

    assert not all_finite(donor.params(0))  # the donor really offered a NaN
    assert REFUSED_STATE in newcomer.log(), newcomer.log()[-3000:]
    # a refused state is not downloaded again at every step: pauses of 1, 2, 4, 8... s between attempts allow at
    # most 1 + log2(t + 1) refusals in t seconds (t < 127 s here); without them, one per local step
    assert newcomer.log().count(REFUSED_STATE) <= 8, newcomer.log().count(REFUSED_STATE)
    recorded = sorted(newcomer.out_dir.glob("params_*.safetensors"))
    assert recorded, newcomer.log()[-3000:]
    for path in recorded:
        assert all_finite(newcomer.params(int(path.stem.split("_")[1]))), path.name
