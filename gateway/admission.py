"""Bounded admission: at most max_running requests generate at once and at most max_waiting more
wait for a slot (FIFO); past that a request is refused at once with RESOURCE_EXHAUSTED (gRPC) /
429 with Retry-After (HTTP), before any work is done for it.

A Ticket is taken synchronously when a request arrives (so a burst cannot overshoot the bound),
then waits for a running slot; closing it (idempotent) gives back whatever it holds."""
from __future__ import annotations

import asyncio
import math
from collections.abc import Callable

from services.common.errors import ResourceExhausted


class Overloaded(ResourceExhausted):
    """The admission queue is full; `retry_after_s` is the hint sent to the client."""

    def __init__(self, message: str, retry_after_s: float) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s

    @property
    def retry_after(self) -> str:
        return str(max(1, math.ceil(self.retry_after_s)))


class Admission:
    def __init__(self, max_running: int, max_waiting: int, retry_after_s: float,
                 publish: Callable[[int, int], None] = lambda running, waiting: None) -> None:
        self.max_running, self.max_waiting = max_running, max_waiting
        self.retry_after_s = retry_after_s
        self.publish = publish               # (running, waiting) -> gauges
        self.running = 0
        self.waiting = 0
        self.refused = 0
        self._slots = asyncio.Semaphore(max_running)

    @property
    def active(self) -> int:
        return self.running + self.waiting

    def reserve(self) -> Ticket:
        """A place in the queue now, or Overloaded."""
        if self.active >= self.max_running + self.max_waiting:
            self.refused += 1
            raise Overloaded(
                f"the server is at capacity: {self.running} requests generating (at most "
                f"{self.max_running}) and {self.waiting} waiting (at most {self.max_waiting}); "
                f"retry after {self.retry_after_s:g} s", self.retry_after_s)
        self.waiting += 1
        self._changed()
        return Ticket(self)

    def _changed(self) -> None:
        self.publish(self.running, self.waiting)


class Ticket:
    """waiting -> running (run()) -> closed (close())."""

    def __init__(self, admission: Admission) -> None:
        self.admission = admission
        self.state = "waiting"

    async def run(self) -> None:
        """Waits for a running slot (cancellable; the ticket then stays waiting until closed)."""
        a = self.admission
        await a._slots.acquire()
        if self.state != "waiting":          # closed while it waited
            a._slots.release()
            return
        self.state = "running"
        a.waiting -= 1
        a.running += 1
        a._changed()

    def close(self) -> None:
        a = self.admission
        if self.state == "waiting":
            a.waiting -= 1
        elif self.state == "running":
            a.running -= 1
            a._slots.release()
        else:
            return
        self.state = "closed"
        a._changed()
