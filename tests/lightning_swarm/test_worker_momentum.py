"""Worker momentum in the swarm's real gradient averager (SwarmGradientAverager on a real DHT, no round): what a peer
puts into the averager for each accumulation, the NaN guard, and the option's validation."""

from __future__ import annotations

import pytest
import torch

from lightning_swarm import HivemindStrategy
from lightning_swarm.hivemind_ext.lifetime import SwarmDHT
from lightning_swarm.hivemind_ext.optimizer import SwarmGradientAverager

BETA = 0.5


@pytest.fixture
def averager():
    dht = SwarmDHT(start=True, host_maddrs=["/ip4/127.0.0.1/tcp/0"])
    parameter = torch.nn.Parameter(torch.zeros(3))
    averager = SwarmGradientAverager([parameter], dht=dht, prefix="wm_grad_averager", start=False,
                                     worker_momentum=BETA)
    yield averager, parameter
    dht.shutdown()


def _send(averager, parameter, batches):
    """Accumulate one epoch of local steps (gradient, batch size), load it as hivemind does before a round, and
    return what the averager would send and with which weight; then reset as hivemind does after the epoch."""
    for gradient, batch_size in batches:
        parameter.grad = torch.tensor(gradient, dtype=torch.float32)
        averager.accumulate_grads_(batch_size)
    averager.load_accumulators_into_averager_()
    with averager.get_tensors() as (sent,):
        first = sent.clone()
    weight = averager.local_samples_accumulated
    averager.load_accumulators_into_averager_()  # a peer alone: hivemind loads the same accumulators again
    with averager.get_tensors() as (sent,):
        assert torch.equal(sent, first), "a second load of the same accumulators moved the momentum"
    averager.reset_accumulated_grads_()
    return first, weight


def test_a_peer_sends_its_sample_weighted_momentum_and_a_nan_gradient_leaves_it_alone(averager):
    averager, parameter = averager
    g1 = torch.tensor([1.0, -2.0, 4.0])
    g2 = torch.tensor([3.0, 0.0, -4.0])
    sent, weight = _send(averager, parameter, [(g1.tolist(), 4), (g1.tolist(), 12)])  # 2 local steps, 16 samples
    assert weight == 16
    assert torch.allclose(sent, g1)  # the first message is the first gradient (bias-corrected), not (1 - beta) * g1

    # each epoch's gradient enters with its samples: S = beta * S + n * g, N = beta * N + n, the peer sends S / N
    sent, weight = _send(averager, parameter, [(g2.tolist(), 8)])
    s2, n2 = BETA * 16 * g1 + 8 * g2, BETA * 16 + 8
    assert weight == 8 and torch.allclose(sent, s2 / n2)

    sent, weight = _send(averager, parameter, [([float("nan"), 0.0, 0.0], 8)])
    assert weight == 0 and torch.equal(sent, torch.zeros(3))  # dropped: zeros with weight 0, as without momentum

    g3 = torch.tensor([0.0, 1.0, 0.0])
    sent, weight = _send(averager, parameter, [(g3.tolist(), 8)])
    s3, n3 = BETA * s2 + 8 * g3, BETA * n2 + 8  # the NaN epoch did not enter the momentum
    assert weight == 8 and torch.allclose(sent, s3 / n3)
    assert averager.worker_momentum.updates == 3

    # with equal epochs it is the paper's momentum m = beta * m + (1 - beta) * g, bias-corrected: m / (1 - beta**t)
    averager.load_state_from_peers()  # a peer that downloads the swarm's state starts its momentum anew
    m = torch.zeros(3)
    for t, gradient in enumerate([g2, g3, g1], start=1):
        sent, _ = _send(averager, parameter, [(gradient.tolist(), 8)])
        m = BETA * m + (1 - BETA) * gradient
        assert torch.allclose(sent, m / (1 - BETA ** t))


@pytest.mark.parametrize("beta", [1.0, -0.1, "0.9", True, float("nan")])
def test_worker_momentum_outside_0_1_is_a_clear_error(beta):
    with pytest.raises(ValueError, match=r"worker_momentum must be a number in \[0, 1\)"):
        HivemindStrategy(run_id="run", target_batch_size=8, worker_momentum=beta)
