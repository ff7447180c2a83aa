"""Gradient averaging weighted by the samples each local step really processed.

hivemind's ``GradientAverager`` adds each step's gradient scaled by ``batch_size / first_batch_size`` and then
divides the sum by the *number of steps*. That is the mean gradient only if every step had the same batch size;
with a short last batch (or a step that contributes no samples) it is biased. Dividing by
``samples / first_batch_size`` instead gives the exact per-sample mean, so in the all-reduce (weighted by
samples) every sample of every peer counts the same.

It also never sends (nor applies alone) a non-finite gradient: if the accumulated gradient holds a NaN or Inf
(a diverged loss, a bad batch), the peer sends zeros with weight 0 for this epoch, i.e. it tags along and takes the
others' average, and says so in the log.

With ``worker_momentum=beta`` (> 0) the peer sends its momentum of these sample-mean gradients, each epoch's weighted
by its samples and bias-corrected (:mod:`lightning_swarm.worker_momentum`), instead of the latest one: the round's
average, which the optimizer steps on, is then an average of momenta. Only a finite gradient enters the momentum
(a dropped one leaves it as it was), and the momentum moves once per accumulation, however often hivemind reloads the
accumulators into the averager. A peer's
momentum starts at zero when it starts and after it downloads the swarm's state (a newcomer, or a peer that fell
behind: gradients of parameters it no longer has); it is not saved in checkpoints, so a resumed peer starts it anew.
"""

from __future__ import annotations

import logging

import torch
from hivemind.optim.grad_averager import GradientAverager

from lightning_swarm.aggregation import all_finite
from lightning_swarm.worker_momentum import WorkerMomentum, check_worker_momentum

log = logging.getLogger(__name__)


class SampleWeightedGradientAverager(GradientAverager):
    """A GradientAverager whose accumulated gradient is the mean over samples, not over local steps.

    Args:
        worker_momentum: send the momentum of the gradients with this coefficient (0: the gradient itself).
        *args, **kwargs: as hivemind's GradientAverager.
    """

    # the local guard (_drop_non_finite_gradients) sends zeros with weight 0 for a non-finite gradient: a NaN or Inf
    # in a peer's part is no accident, and its sender is kept out at once (RobustAveraging)
    honest_parts_are_finite = True

    def __init__(self, *args, worker_momentum: float = 0.0, **kwargs):
        beta = check_worker_momentum(worker_momentum)
        # used in the training process only (the averager's own process never loads accumulators)
        self.worker_momentum = WorkerMomentum(beta) if beta > 0 else None
        self._momentum_took_accumulators = False  # this accumulation already moved the momentum
        super().__init__(*args, **kwargs)

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
        if self._drop_non_finite_gradients() and self.worker_momentum is not None and self.local_samples_accumulated:
            with self.get_tensors() as averaged_grads:
                if self._momentum_took_accumulators:  # hivemind reloads the same accumulators (peer alone)
                    self.worker_momentum.write_(averaged_grads)
                else:
                    self.worker_momentum.update_(averaged_grads, self.local_samples_accumulated)
                    self._momentum_took_accumulators = True

    @torch.no_grad()
    def reset_accumulated_grads_(self):
        super().reset_accumulated_grads_()
        self._momentum_took_accumulators = False

    def load_state_from_peers(self, *args, **kwargs):
        if self.worker_momentum is not None:  # this peer's parameters are about to be replaced
            self.worker_momentum.reset()
        return super().load_state_from_peers(*args, **kwargs)

    @torch.no_grad()
    def _drop_non_finite_gradients(self) -> bool:
        """Whether the accumulated gradient is finite; if not, zeros with weight 0 are sent instead."""
        with self.get_tensors() as averaged_grads:
            if all(all_finite(grad) for grad in averaged_grads):
                return True
            for grad in averaged_grads:
                grad.zero_()
        log.warning(f"[lightning_swarm] this peer's accumulated gradient holds NaN or Inf values: dropped "
                    f"({self.local_samples_accumulated} samples); it takes part in this round with weight 0")
        self.local_samples_accumulated = 0  # GradientAverager.step sends this as the round's weight
        return False
