"""A simulated accelerator for many-peer runs: a LightningModule whose step takes a configured time without holding a
core (it sleeps), with real, cheap gradients of a least-squares problem whose optimum is known.

The problem (a noisy quadratic, i.e. least squares with a diagonal design): P parameters w (split into
``num_tensors`` tensors, so the wire carries several realistic tensors), a curvature h_j per coordinate (log-uniform
in [h_min, h_max]) and an optimum w*. A sample is a noisy observation b = w* + sigma / sqrt(h) * xi (xi ~ N(0, 1) per
coordinate) with the loss 0.5 sum_j h_j (w_j - b_j)^2. A batch of B samples only enters through its mean, which is
drawn directly (w* + sigma / sqrt(h B) xi): one P-sized draw per step whatever B is. The batch's gradient is
h (w - b_mean), computed by autograd; the expected (population) excess loss is known in closed form,

    L(w) = 0.5 sum_j h_j (w_j - w*_j)^2 / P        (0 at the optimum),

and so is what SGD does on it. :func:`reference_losses` runs one process on the same problem with the same batch sizes
per step: the swarm's global steps (a sample-weighted mean of the peers' accumulated gradients, then SGD) should
follow it, whatever the peers' speeds, as long as no sample is lost and no gradient is stale. With P coordinates the
loss's sampling spread is ~sqrt(2 / P) of its noise part (0.14% at 1M): far below the 1% tolerance.
"""

from __future__ import annotations

import math
import time
from typing import Any, Iterator, List, Optional, Sequence

import lightning.pytorch as pl
import torch
from torch.utils.data import DataLoader, IterableDataset


def problem_tensors(num_params: int, num_tensors: int, h_min: float, h_max: float, problem_seed: int):
    """(curvatures h, optimum w*), each a list of ``num_tensors`` flat tensors summing to ``num_params`` values:
    the same for every peer (and for the reference) with the same ``problem_seed``."""
    sizes = [num_params // num_tensors + (1 if i < num_params % num_tensors else 0) for i in range(num_tensors)]
    generator = torch.Generator().manual_seed(problem_seed)
    log_h = torch.empty(num_params).uniform_(math.log(h_min), math.log(h_max), generator=generator)
    optimum = torch.randn(num_params, generator=generator)
    return list(log_h.exp().split(sizes)), list(optimum.split(sizes))


class SimulatedAccelerator(pl.LightningModule):
    """A peer with a simulated accelerator of ``samples_per_second``, training the noisy quadratic above with SGD.

    num_params: P, the number of parameters (1-25M: what the averaging rounds carry).
    num_tensors: how many parameter tensors P is split into.
    samples_per_second: the simulated accelerator's speed; a step of B samples lasts B / samples_per_second seconds
        (slept, not computed: compute speed is simulated, the swarm's work is real).
    step_seconds: the simulated time of one local step; the batch is round(samples_per_second * step_seconds) samples
        (a faster accelerator takes larger batches in the same time). Few steps per second keep Lightning's loop cheap.
    noise: sigma, the per-sample noise of an observation (its gradient noise).
    lr: SGD's learning rate (h_max * lr <= 1 keeps every coordinate's step contracting).
    h_min, h_max: the range of the curvatures.
    problem_seed: the problem (h, w*); every peer must use the same.
    seed: this peer's noise draws.
    """

    def __init__(self, num_params: int = 1_000_000, num_tensors: int = 4, samples_per_second: float = 100.0,
                 step_seconds: float = 0.5, noise: float = 4.0, lr: float = 1.0, h_min: float = 0.1,
                 h_max: float = 0.5, problem_seed: int = 1234, seed: int = 0):
        super().__init__()
        if num_params < num_tensors or samples_per_second <= 0 or step_seconds <= 0:
            raise ValueError("num_params >= num_tensors, samples_per_second > 0 and step_seconds > 0 are required")
        self.num_params, self.samples_per_second, self.noise, self.lr = num_params, samples_per_second, noise, lr
        self.batch = max(1, round(samples_per_second * step_seconds))
        self.step_seconds = self.batch / samples_per_second
        curvatures, self.optimum = problem_tensors(num_params, num_tensors, h_min, h_max, problem_seed)
        self.curvatures = curvatures
        self.inverse_sqrt_h = [c.rsqrt() for c in curvatures]
        # every peer starts at 0 (newcomers download the swarm's state anyway)
        self.weights = torch.nn.ParameterList([torch.nn.Parameter(torch.zeros_like(c)) for c in curvatures])
        self.noise_generator = torch.Generator().manual_seed(seed)
        self.step_started = time.perf_counter()

    def excess_loss(self) -> float:
        """L(w): the population loss above the optimum (0.5 sum h (w - w*)^2 / P)."""
        with torch.no_grad():
            return excess_loss([w.detach() for w in self.weights], self.curvatures, self.optimum)

    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        self.step_started = time.perf_counter()

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        loss = torch.zeros(())
        scale = self.noise / math.sqrt(self.batch)
        for w, h, w_opt, inv_sqrt_h in zip(self.weights, self.curvatures, self.optimum, self.inverse_sqrt_h):
            noise = torch.randn(w.shape, generator=self.noise_generator)
            target = w_opt + scale * inv_sqrt_h * noise  # the mean of the batch's observations
            loss = loss + 0.5 * (h * (w - target).square()).sum()
        # the simulated accelerator is busy until the step's simulated time is over (a sleep holds no core)
        remaining = self.step_seconds - (time.perf_counter() - self.step_started)
        if remaining > 0:
            time.sleep(remaining)
        return loss

    def swarm_batch_size(self, batch: Any) -> int:
        return self.batch

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=self.lr)


def excess_loss(weights: Sequence[torch.Tensor], curvatures: Sequence[torch.Tensor],
                optimum: Sequence[torch.Tensor]) -> float:
    total = sum(float((h * (w - w_opt).square()).sum()) for w, h, w_opt in zip(weights, curvatures, optimum))
    return 0.5 * total / sum(w.numel() for w in weights)


def reference_losses(batch_sizes: Sequence[int], num_params: int = 1_000_000, num_tensors: int = 4,
                     noise: float = 4.0, lr: float = 1.0, h_min: float = 0.1, h_max: float = 0.5,
                     problem_seed: int = 1234, seed: int = 99,
                     stale_fractions: Optional[Sequence[float]] = None) -> List[float]:
    """One process on the same problem: SGD steps with global batches of ``batch_sizes[k]`` samples (each the
    mean of that many fresh observations), from w = 0. Returns L(w) before the first step and after every step.

    ``stale_fractions[k]`` (default all 0): the share of step k's samples whose gradient was taken at the parameters
    before step k - 1 (w_(k-1) instead of w_k), as with hivemind's ``delay_optimizer_step``, where a global step's
    update lands some local steps into the next epoch: step k then moves by h (f w_(k-1) + (1 - f) w_k - b_mean)."""
    if stale_fractions is not None and len(stale_fractions) != len(batch_sizes):
        raise ValueError(f"{len(stale_fractions)} stale fractions for {len(batch_sizes)} steps")
    curvatures, optimum = problem_tensors(num_params, num_tensors, h_min, h_max, problem_seed)
    generator = torch.Generator().manual_seed(seed)
    weights = [torch.zeros_like(h) for h in curvatures]
    previous = [w.clone() for w in weights]  # w_(k-1): before the step before
    losses = [excess_loss(weights, curvatures, optimum)]
    for k, batch_size in enumerate(batch_sizes):
        if batch_size <= 0:
            raise ValueError(f"a global step of {batch_size} samples")
        stale = 0.0 if stale_fractions is None else float(stale_fractions[k])
        if not 0.0 <= stale <= 1.0:
            raise ValueError(f"step {k}: a stale fraction of {stale}")
        before = [w.clone() for w in weights]
        for w, w_prev, h, w_opt in zip(weights, previous, curvatures, optimum):
            target = w_opt + noise / math.sqrt(batch_size) * h.rsqrt() * torch.randn(w.shape, generator=generator)
            at = w if stale == 0.0 else stale * w_prev + (1.0 - stale) * w
            w.sub_(lr * h * (at - target))
        previous = before
        losses.append(excess_loss(weights, curvatures, optimum))
    return losses


class EndlessBatches(IterableDataset):
    """Batch numbers 0, 1, 2, ... (the module draws its batch itself): a data loader that costs nothing."""

    def __iter__(self) -> Iterator[torch.Tensor]:
        index = 0
        while True:
            yield torch.tensor(index)
            index += 1


def endless_loader() -> DataLoader:
    return DataLoader(EndlessBatches(), batch_size=None)
