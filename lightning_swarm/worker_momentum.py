"""Worker momentum: each peer sends an average of its recent gradients instead of its latest one.

Karimireddy, He and Jaggi ("Learning from History for Byzantine Robust Optimization", ICML 2021) show that no
aggregator that looks at one round alone can tell a Byzantine sender from honest noise better than the honest
senders' spread. If each worker sends its momentum ``m_t = beta * m_{t-1} + (1 - beta) * g_t`` instead of its gradient
``g_t``, the honest messages' noise shrinks by about ``sqrt((1 - beta) / (1 + beta))`` (0.23 for beta = 0.9), and so
does what a robust aggregator such as CenteredClip lets an attacker move.

The momentum starts at zero and what is sent is bias-corrected as in Adam: ``m_t / (1 - beta**t)``. A peer's first
message is then its first gradient (not a tenth of it, which CenteredClip would see as an outlier pulling the
average towards zero), and each later one is a weighted mean of its gradients so far, at the scale of one gradient.
"""

from __future__ import annotations

import math
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
        self.buffers: Optional[List[torch.Tensor]] = None
        self.updates = 0  # t: how many gradients the buffers hold

    @torch.no_grad()
    def update_(self, gradients: Sequence[torch.Tensor]) -> None:
        """Add this round's (finite) ``gradients`` to the momentum and replace them, in place, by what the peer
        sends: the bias-corrected momentum. An average of finite values is finite and no larger than they are."""
        if self.buffers is None:
            self.buffers = [torch.zeros_like(gradient) for gradient in gradients]
        if len(self.buffers) != len(gradients):
            raise ValueError(f"{len(gradients)} gradient tensors, the momentum has {len(self.buffers)}")
        for buffer, gradient in zip(self.buffers, gradients):
            buffer.mul_(self.beta).add_(gradient, alpha=1.0 - self.beta)
        self.updates += 1
        self.write_(gradients)

    @torch.no_grad()
    def write_(self, gradients: Sequence[torch.Tensor]) -> None:
        """Overwrite ``gradients`` with the bias-corrected momentum, without a new update (all zeros if none yet)."""
        if self.buffers is None:
            for gradient in gradients:
                gradient.zero_()
            return
        scale = 1.0 / (1.0 - math.pow(self.beta, self.updates))
        for buffer, gradient in zip(self.buffers, gradients):
            gradient.copy_(buffer).mul_(scale)

    def reset(self) -> None:
        """Forget the gradients so far (the next update starts again from zero)."""
        self.buffers, self.updates = None, 0
