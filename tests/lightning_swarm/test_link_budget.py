"""The averaging timeouts derived from a round's bytes and the link rate (lightning_swarm/link_budget.py)."""

from __future__ import annotations

import math

import pytest
import torch
from hivemind.compression import CompressionInfo

from lightning_swarm import HivemindStrategy
from lightning_swarm.compression import resolve_compression
from lightning_swarm.link_budget import (
    averaging_timeout_for_link,
    encoded_bytes,
    fit_averaging_timeout,
    round_bytes_each_way,
    slowest_link_mbit,
)


@pytest.mark.parametrize("codec", ["none", "fp16", "adaptive"])
def test_encoded_bytes_match_what_the_codec_sends(codec):
    # one tensor above the 8-bit threshold, one below it (fp16 in the adaptive codec), one int tensor (as is)
    tensors = [torch.randn(300_000), torch.randn(1000)] + ([torch.arange(100)] if codec == "adaptive" else [])
    compression = resolve_compression(codec)
    sent = sum(compression.compress(t, CompressionInfo.from_tensor(t)).ByteSize() for t in tensors)
    assert encoded_bytes(tensors, compression) == pytest.approx(sent, rel=0.03)


def test_round_bytes_follow_the_group_size():
    assert round_bytes_each_way(100, group_size=2) == 100
    assert round_bytes_each_way(100, group_size=4) == 150
    assert round_bytes_each_way(100) == 200  # group size unknown: the bound of any group


def test_an_uncompressed_round_at_10_mbit_gets_the_time_its_bytes_need():
    """25M fp32 parameters uncompressed between 2 peers: 100 MB each way, 80 s at 10 Mbit/s (the bench's round that
    did not complete): the tiny recipe's 30 s timeout cannot hold it, the derived one can, with margin."""
    params = [torch.zeros(2_500_000) for _ in range(10)]
    timeout, allreduce, message, warn = fit_averaging_timeout(
        params, resolve_compression("none"), averaging_timeout=30.0, allreduce_timeout=None, matchmaking_time=2.0,
        link_mbit=10, group_size=2)
    assert timeout == pytest.approx(2.0 + 2 * 80.0) and allreduce is None and warn
    assert "raised from 30 to 162 s" in message
    # the same timeouts, given without link_mbit, name the slowest link they suit: 200 MB*8 / 28 s = 57 Mbit/s
    timeout, _, message, warn = fit_averaging_timeout(
        params, resolve_compression("none"), averaging_timeout=30.0, allreduce_timeout=None, matchmaking_time=2.0,
        link_mbit=None, group_size=2)
    assert timeout == 30.0 and warn and "suits links of 57.1 Mbit/s and faster" in message
    # a timeout long enough already is kept, also a longer allreduce_timeout, and nothing to warn about
    assert fit_averaging_timeout(params, resolve_compression("adaptive"), 300.0, 400.0, 2.0, 10, 2)[::3] == (300.0,
                                                                                                            False)
    assert fit_averaging_timeout(params, resolve_compression("adaptive"), 300.0, 400.0, 2.0, 10, 2)[1] == 400.0


def test_the_two_directions_agree():
    needed = averaging_timeout_for_link(10_000_000, 8.0, matchmaking_time=5.0)
    assert slowest_link_mbit(10_000_000, needed, matchmaking_time=5.0) == pytest.approx(8.0)
    assert slowest_link_mbit(10_000_000, 5.0, matchmaking_time=5.0) == math.inf
    with pytest.raises(ValueError, match="link_mbit"):
        averaging_timeout_for_link(1, 0, 1.0)


def test_the_strategy_raises_its_timeouts_for_a_slow_link():
    """The swarm optimizer a strategy builds (real hivemind.Optimizer and DHT on 127.0.0.1) averages with the
    derived timeouts: 10M fp32 parameters uncompressed, group size unknown, 80 MB each way at 10 Mbit/s."""
    model = torch.nn.Linear(1000, 10_000)
    strategy = HivemindStrategy(run_id="link_budget", target_batch_size=8, host_maddrs=["/ip4/127.0.0.1/tcp/0"],
                                compression="none", matchmaking_time=2.0, averaging_timeout=30.0, link_mbit=10,
                                publish_metrics=False, log_progress=False)
    swarm_optimizer = strategy.make_swarm_optimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    try:
        needed = 2.0 + 2 * 2 * (10_010_000 * 4) * 8 / 10e6
        assert swarm_optimizer.averaging_timeout == pytest.approx(needed, rel=1e-3)
        assert swarm_optimizer.allreduce_timeout == pytest.approx(needed, rel=1e-3)
    finally:
        swarm_optimizer.shutdown()
        strategy.dht.shutdown()
    with pytest.raises(ValueError, match="link_mbit"):
        HivemindStrategy(run_id="run", target_batch_size=8, link_mbit=-1)
