"""Jittered exponential waits inside a deadline, for retries that a wait can cure (an upstream's
pools full, RESOURCE_EXHAUSTED)."""
from __future__ import annotations

import asyncio
import random
import time


class Backoff:
    """`await wait()` sleeps initial_s, 2*initial_s, ... (at most max_s, each jittered down to
    half, never past the deadline) and returns False, without sleeping, once the deadline has
    passed."""

    def __init__(self, initial_s: float, max_s: float, deadline_s: float) -> None:
        self.initial_s, self.max_s = initial_s, max_s
        self.deadline = time.monotonic() + deadline_s
        self.next_s = initial_s
        self.waits = 0

    @property
    def left_s(self) -> float:
        return max(0.0, self.deadline - time.monotonic())

    async def wait(self) -> bool:
        left = self.left_s
        if left <= 0:
            return False
        await asyncio.sleep(min(left, self.next_s * random.uniform(0.5, 1.0)))
        self.next_s = min(self.next_s * 2, self.max_s)
        self.waits += 1
        return True

    def reset(self) -> None:
        self.next_s = self.initial_s
