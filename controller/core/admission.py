"""Admission of registrations: a token bucket that tells the refused when to come back.

``max_per_s`` registrations are admitted per second, in bursts of up to that
many (at least one). A registration past the budget is refused with the time it should
retry after; each refused caller gets its own slot (one per ``1/max_per_s``
seconds after the last slot handed out), so a storm of agents connecting at
once comes back spread out instead of all together.
"""

from __future__ import annotations

from collections.abc import Callable


class Admission:
    def __init__(self, max_per_s: float, clock: Callable[[], float]) -> None:
        if max_per_s <= 0:
            raise ValueError(f"max_per_s must be > 0, got {max_per_s}")
        self.max_per_s = max_per_s
        self.burst = max(1.0, max_per_s)   # at least one registration at a time, whatever the rate
        self._clock = clock
        self._tokens = self.burst
        self._updated = clock()
        self._next_slot = 0.0
        self.refused = 0

    def admit(self) -> float:
        """0.0 when admitted now; otherwise the seconds after which to retry."""
        now = self._clock()
        self._tokens = min(self.burst, self._tokens + (now - self._updated) * self.max_per_s)
        self._updated = now
        if self._tokens >= 1.0:
            self._tokens -= 1.0
            return 0.0
        self.refused += 1
        slot = max(now + (1.0 - self._tokens) / self.max_per_s, self._next_slot + 1.0 / self.max_per_s)
        self._next_slot = slot
        return slot - now
