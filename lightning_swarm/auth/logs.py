"""Log lines about refused peers without flooding the log: a refused peer retries many times a second."""

from __future__ import annotations

import logging
import time
from typing import Dict, Optional

logger = logging.getLogger("lightning_swarm.auth")


class RateLimitedLog:
    """Log each distinct message at most once per ``period`` seconds.

    Args:
        period: seconds before the same message is logged again.
        target: the logger to write to (default: ``lightning_swarm.auth``).
    """

    def __init__(self, period: float = 60.0, target: Optional[logging.Logger] = None):
        self.period, self.target = period, target or logger
        self._last: Dict[str, float] = {}

    def __call__(self, level: int, message: str) -> None:
        now = time.monotonic()
        if now - self._last.get(message, -float("inf")) >= self.period:
            self._last[message] = now
            self.target.log(level, message)
