"""A malicious swarm peer for the Byzantine tests and benchmark: a HivemindStrategy whose gradient averager lies.

Named in a peer's YAML as ``trainer.strategy.class_path: byzantine.ByzantineStrategy`` with ``attack``:

- ``scale``: sends its gradients multiplied by 1e3 (with its true weight);
- ``nan``: sends NaN gradients;
- ``weight``: claims weight 1e9 (a billion samples) and sends its gradients negated (gradient ascent), so that an
  average it decided would undo training.

It bypasses the local guard that keeps an honest peer from sending non-finite gradients (it corrupts the
gradients after the guard ran); everything else (its reducer part, its state) runs the honest code.
"""

from __future__ import annotations

import torch

from lightning_swarm.strategy import HivemindStrategy

ATTACKS = ("scale", "nan", "weight")


class ByzantineGradientAverager(HivemindStrategy.grad_averager_class):
    """A gradient averager that corrupts what it sends, see the module docstring (``attack``)."""

    def __init__(self, *args, attack: str, **kwargs):
        if attack not in ATTACKS:
            raise ValueError(f"attack must be one of {ATTACKS}, got {attack!r}")
        self.attack = attack
        super().__init__(*args, **kwargs)

    @torch.no_grad()
    def load_accumulators_into_averager_(self):
        super().load_accumulators_into_averager_()
        with self.get_tensors() as averaged_grads:
            for grad in averaged_grads:
                if self.attack == "scale":
                    grad.mul_(1e3)
                elif self.attack == "nan":
                    grad.fill_(float("nan"))
                else:
                    grad.neg_()

    def step(self, weight=None, **kwargs):
        if self.attack == "weight":
            weight = 1e9
        return super().step(weight=weight, **kwargs)


class ByzantineStrategy(HivemindStrategy):
    """HivemindStrategy of a malicious peer.

    Args:
        attack: one of ``ATTACKS`` (see the module docstring).
        **kwargs: as HivemindStrategy.
    """

    def __init__(self, attack: str, **kwargs):
        if attack not in ATTACKS:
            raise ValueError(f"attack must be one of {ATTACKS}, got {attack!r}")
        super().__init__(**kwargs)
        self.attack = attack

    @property
    def grad_averager_class(self):
        attack = self.attack
        return lambda *args, **kwargs: ByzantineGradientAverager(*args, attack=attack, **kwargs)
