"""A token bucket: what a flood of unauthenticated requests may cost a server per second."""

from __future__ import annotations

import time
from collections.abc import Callable


class TokenBucket:
    """Up to ``rate`` takes a second, in bursts of at most ``rate``: each :meth:`take` costs a token, and
    tokens come back at ``rate`` a second. Not thread-safe: one thread takes."""

    def __init__(self, rate: float, *, clock: Callable[[], float] = time.monotonic) -> None:
        if isinstance(rate, bool) or not isinstance(rate, (int, float)) or not rate >= 1:
            raise ValueError(f"rate = {rate!r}; expected a number of tokens a second >= 1")
        self.rate = float(rate)
        self.tokens = float(rate)
        self._clock = clock
        self.at = clock()

    def take(self) -> bool:
        """Whether a token was there (and is now spent)."""
        now = self._clock()
        self.tokens = min(self.rate, self.tokens + (now - self.at) * self.rate)
        self.at = now
        if self.tokens < 1:
            return False
        self.tokens -= 1
        return True


__all__ = ["TokenBucket"]
