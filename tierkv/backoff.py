"""Retry back-off: after a failure, wait before trying again, twice as long each time up to
a ceiling; a success resets it. The one implementation (the remote tier's reconnects, the
vLLM connector's store access, the daemon client's wait for staging slots).

Not thread-safe on its own: callers hold their own lock around it (they change other state
in the same step).
"""
from __future__ import annotations

import time
from typing import Callable


class Backoff:
    def __init__(self, initial_s: float, max_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        if not 0 < initial_s <= max_s:
            raise ValueError(f"back-off needs 0 < initial_s <= max_s, got {initial_s} and {max_s}")
        self.initial_s = initial_s
        self.max_s = max_s
        self.clock = clock
        self.delay_s = initial_s  # the wait after the next failure
        self.retry_at = float("-inf")

    def ready(self) -> bool:
        """Whether a try is due (no failure yet, or the wait after the last one is over)."""
        return self.clock() >= self.retry_at

    def failed(self) -> float:
        """Record a failure: no try before ``delay_s`` from now, and the next wait doubles.
        Returns this wait."""
        wait = self.delay_s
        self.retry_at = self.clock() + wait
        self.delay_s = min(wait * 2, self.max_s)
        return wait

    def attempt(self) -> None:
        """A try is starting: hold off others for the current wait (one try at a time),
        without doubling it."""
        self.retry_at = self.clock() + self.delay_s

    def succeeded(self) -> None:
        self.delay_s = self.initial_s
        self.retry_at = float("-inf")

    def check_integrity(self) -> None:
        assert self.initial_s <= self.delay_s <= self.max_s, "back-off outside its bounds"
