"""A downloaded training state with NaN or Inf values is refused before it is loaded.

hivemind's ``TrainingStateAverager.load_state_from_peers`` takes the (metadata, tensors) that
``DecentralizedAverager.load_state_from_peers`` downloaded and copies them into the parameters and optimizer
state. :class:`FiniteStateDownload` sits between the two in the class hierarchy (list it after
``TrainingStateAverager`` among the bases): a download holding a non-finite tensor is logged with the peer it came
from and reported as "nothing downloaded", so the peer keeps its own state (hivemind.Optimizer then tries again).
"""

from __future__ import annotations

import logging
import time
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
    """DecentralizedAverager whose ``load_state_from_peers`` refuses a state with non-finite tensors, and pauses
    downloads for a while after a refusal (``REFUSAL_BACKOFF``)."""

    REFUSAL_BACKOFF = (1.0, 60.0)  # seconds without downloads after the first refused state, and at most
    _refusal_backoff = 0.0  # the current pause (0: the last download was good, or none was refused yet)
    _no_download_until = 0.0  # time.monotonic() before which downloads are skipped

    def load_state_from_peers(self, wait: bool = True, timeout: Optional[float] = None
                              ) -> Optional[Tuple[Any, Sequence[torch.Tensor]]]:
        if wait and time.monotonic() < self._no_download_until:
            return None  # the swarm offered a non-finite state moments ago: nothing to download yet
        loaded = super().load_state_from_peers(wait=wait, timeout=timeout)
        if not wait or loaded is None:
            return loaded
        metadata, tensors = loaded
        bad = first_non_finite(tensors)
        if bad is not None:
            first, longest = self.REFUSAL_BACKOFF
            self._refusal_backoff = min(longest, 2 * self._refusal_backoff) if self._refusal_backoff else first
            self._no_download_until = time.monotonic() + self._refusal_backoff
            log.warning(f"[lightning_swarm] refused the downloaded state: tensor {bad} of {len(tensors)} holds NaN or "
                        f"Inf values; keeping this peer's own state, next download in {self._refusal_backoff:.0f} s")
            return None
        self._refusal_backoff = 0.0
        return loaded
