"""A downloaded training state with NaN or Inf values is refused before it is loaded.

hivemind's ``TrainingStateAverager.load_state_from_peers`` takes the (metadata, tensors) that
``DecentralizedAverager.load_state_from_peers`` downloaded and copies them into the parameters and optimizer
state. :class:`FiniteStateDownload` sits between the two in the class hierarchy (list it after
``TrainingStateAverager`` among the bases): a download holding a non-finite tensor is logged with the peer it came
from and reported as "nothing downloaded", so the peer keeps its own state (hivemind.Optimizer then tries again).
"""

from __future__ import annotations

import logging
from typing import Any, Optional, Sequence, Tuple

import torch
from hivemind.averaging import DecentralizedAverager

from lightning_swarm.aggregation import all_finite

log = logging.getLogger(__name__)


def first_non_finite(tensors: Sequence[torch.Tensor]) -> Optional[int]:
    """Index of the first floating point tensor holding NaN or Inf, or None."""
    for index, tensor in enumerate(tensors):
        if isinstance(tensor, torch.Tensor) and not all_finite(tensor):
            return index
    return None


class FiniteStateDownload(DecentralizedAverager):
    """DecentralizedAverager whose ``load_state_from_peers`` refuses a state with non-finite tensors."""

    def load_state_from_peers(self, wait: bool = True, timeout: Optional[float] = None
                              ) -> Optional[Tuple[Any, Sequence[torch.Tensor]]]:
        loaded = super().load_state_from_peers(wait=wait, timeout=timeout)
        if not wait or loaded is None:
            return loaded
        metadata, tensors = loaded
        bad = first_non_finite(tensors)
        if bad is not None:
            log.warning(f"[lightning_swarm] refused the downloaded state: tensor {bad} of {len(tensors)} holds NaN or "
                        "Inf values; keeping this peer's own state")
            return None
        return loaded
