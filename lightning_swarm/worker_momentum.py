"""Worker momentum: each peer sends an average of its recent gradients instead of its latest one.

Karimireddy, He and Jaggi ("Learning from History for Byzantine Robust Optimization", ICML 2021) show that no
aggregator that looks at one round alone can tell a Byzantine sender from honest noise better than the honest
senders' spread. If each worker sends its momentum ``m_t = beta * m_{t-1} + (1 - beta) * g_t`` instead of its gradient
``g_t``, the honest messages' noise shrinks by about ``sqrt((1 - beta) / (1 + beta))`` (0.23 for beta = 0.9), and so
does what a robust aggregator such as CenteredClip lets an attacker move.

A swarm peer's epochs hold very different numbers of its samples (32 in one, 300 in the next: peers race to the
target batch size), so each epoch's gradient enters the momentum weighted by its samples ``n_t`` as well:
``S_t = beta * S_{t-1} + n_t * g_t``, ``N_t = beta * N_{t-1} + n_t``, and the peer sends ``S_t / N_t``. Every sample's
gradient then counts ``beta**age`` (age in epochs). With equal epochs this is exactly the momentum above,
bias-corrected as in Adam (``m_t / (1 - beta**t)``); an equal weight per epoch would instead keep a 32-sample
gradient's noise in the momentum at the weight of a full epoch for ~1 / (1 - beta) epochs. Starting from zero, a peer's
first message is its first gradient (not ``(1 - beta)`` of it, which CenteredClip would see as an outlier pulling the
average towards zero), and each later one is a weighted mean of its gradients so far, at the scale of one gradient.
"""

from __future__ import annotations

from typing import List, Optional, Sequence

import torch


def check_worker_momentum(beta: object) -> float:
    """``beta`` as a float, or ValueError if it is not a number in [0, 1)."""
    if isinstance(beta, bool) or not isinstance(beta, (int, float)) or not (0.0 <= beta < 1.0):
        raise ValueError(f"worker_momentum must be a number in [0, 1) (0 = off, e.g. 0.9), got {beta!r}")
    return float(beta)


class WorkerMomentum:
    """The momentum buffers of one peer's gradients (created at the first update, on the gradients' device).

    Args:
        beta: the momentum coefficient, in (0, 1).
    """

    def __init__(self, beta: float):
        self.beta = check_worker_momentum(beta)
        if self.beta == 0.0:
            raise ValueError("WorkerMomentum needs beta > 0 (0 means no worker momentum)")
        # S / N itself (what the peer sends), in float32 whatever the gradients' dtype: a weighted mean of the
        # gradients, never larger than they are (S alone grows with the samples)
        self.buffers: Optional[List[torch.Tensor]] = None
        self.samples = 0.0  # N: the decayed number of samples in it
        self.updates = 0  # t: how many epochs' gradients it holds

    @torch.no_grad()
    def update_(self, gradients: Sequence[torch.Tensor], samples: float) -> None:
        """Add this epoch's (finite) mean ``gradients`` over ``samples`` (> 0) samples to the momentum and replace
        them, in place, by what the peer sends: ``S / N``."""
        if not samples > 0:
            raise ValueError(f"a gradient enters the momentum with samples > 0, got {samples!r}")
        if self.buffers is None:
            self.buffers = [torch.zeros_like(gradient, dtype=torch.float32) for gradient in gradients]
        if len(self.buffers) != len(gradients):
            raise ValueError(f"{len(gradients)} gradient tensors, the momentum has {len(self.buffers)}")
        self.samples = self.beta * self.samples + float(samples)
        share = float(samples) / self.samples  # S/N moves towards g by this epoch's share of the decayed samples
        for buffer, gradient in zip(self.buffers, gradients):
            buffer.mul_(1.0 - share).add_(gradient.to(torch.float32), alpha=share)
        self.updates += 1
        self.write_(gradients)

    @torch.no_grad()
    def write_(self, gradients: Sequence[torch.Tensor]) -> None:
        """Overwrite ``gradients`` with what the peer sends, ``S / N``, without a new update (zeros if none yet)."""
        if self.buffers is None:
            for gradient in gradients:
                gradient.zero_()
            return
        for buffer, gradient in zip(self.buffers, gradients):
            gradient.copy_(buffer)

    def reset(self) -> None:
        """Forget the gradients so far (the next update starts again from zero)."""
        self.buffers, self.samples, self.updates = None, 0.0, 0
