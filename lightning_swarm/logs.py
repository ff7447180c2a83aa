"""Log lines about refused peers without flooding the log: a refused peer retries many times a second."""

from __future__ import annotations

import logging
import time
from typing import Dict


class RateLimitedLog:
    """Log each distinct message at most once per ``period`` seconds.

    Args:
        target: the logger to write to.
        period: seconds before the same message is logged again.
    """

    def __init__(self, target: logging.Logger, period: float = 60.0):
        self.target, self.period = target, period
        self._last: Dict[str, float] = {}

    def __call__(self, level: int, message: str) -> None:
        now = time.monotonic()
        if now - self._last.get(message, -float("inf")) >= self.period:
            self._last[message] = now
            self.target.log(level, message)
