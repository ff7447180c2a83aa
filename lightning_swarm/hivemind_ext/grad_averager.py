"""Gradient averaging weighted by the samples each local step really processed.

hivemind's ``GradientAverager`` adds each step's gradient scaled by ``batch_size / first_batch_size`` and then
divides the sum by the *number of steps*. That is the mean gradient only if every step had the same batch size;
with a short last batch (or a step that contributes no samples) it is biased. Dividing by
``samples / first_batch_size`` instead gives the exact per-sample mean, so in the all-reduce (weighted by
samples) every sample of every peer counts the same.

It also never sends (nor applies alone) a non-finite gradient: if the accumulated gradient holds a NaN or Inf
(a diverged loss, a bad batch), the peer sends zeros with weight 0 for this epoch, i.e. it tags along and takes the
others' average, and says so in the log.
"""

from __future__ import annotations

import logging

import torch
from hivemind.optim.grad_averager import GradientAverager

from lightning_swarm.aggregation import all_finite

log = logging.getLogger(__name__)


class SampleWeightedGradientAverager(GradientAverager):
    """A GradientAverager whose accumulated gradient is the mean over samples, not over local steps."""

    @torch.no_grad()
    def accumulate_grads_(self, batch_size: int):
        if batch_size == 0:
            return  # a step without samples contributes nothing (and must not become the scaling anchor)
        super().accumulate_grads_(batch_size)

    @torch.no_grad()
    def load_accumulators_into_averager_(self):
        if self.reuse_grad_buffers or not self.local_samples_accumulated or not self._anchor_batch_size:
            # with reuse_grad_buffers, .grad holds an unweighted sum of per-step gradients: hivemind's mean is right
            super().load_accumulators_into_averager_()
        else:
            grad_scale = self._anchor_batch_size / self.local_samples_accumulated
            with self.get_tensors() as averaged_grads:
                for grad_acc, averaged_grad in zip(self._grad_accumulators(), averaged_grads):
                    averaged_grad.copy_(grad_acc, non_blocking=True).mul_(grad_scale)
        self._drop_non_finite_gradients()

    @torch.no_grad()
    def _drop_non_finite_gradients(self) -> None:
        with self.get_tensors() as averaged_grads:
            if all(all_finite(grad) for grad in averaged_grads):
                return
            for grad in averaged_grads:
                grad.zero_()
        log.warning(f"[lightning_swarm] this peer's accumulated gradient holds NaN or Inf values: dropped "
                    f"({self.local_samples_accumulated} samples); it takes part in this round with weight 0")
        self.local_samples_accumulated = 0  # GradientAverager.step sends this as the round's weight
