"""What `--speculation auto`'s exploration may cost: at most EXPLORE_SHARE of serving time.

Exploration runs the runner-up shape once in a while so that a size the cost model prices too
dear gets timed (gateway/speculation_policy.py). On a loaded CPU the runner-up is a batch that
drafts - every running request's Propose, with the context it appends, and a verify of several
times the rows - and one such step in 32 cost auto about 5 % against not drafting at 8 requests.
The budget measures what explorations actually cost: the wall time between batch decisions is
the batch step's, an exploring step's excess over the typical one (the median of recent steps
that did not explore) is charged, and the next exploration waits until the charges are within
EXPLORE_SHARE of the serving time seen. A gap far longer than a typical step is idle time (no
request ran), counted nowhere."""
from __future__ import annotations

import statistics
import time
from collections import deque
from collections.abc import Callable

EXPLORE_SHARE = 0.02                    # explorations' excess: at most 2 % of serving time
IDLE_STEPS = 10.0                       # a gap of more than this many typical steps is idle
RECENT = 16                             # steps the typical one is the median of


class ExplorationBudget:
    def __init__(self, share: float = EXPLORE_SHARE,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.share, self.clock = share, clock
        self.elapsed = 0.0              # serving time seen between decisions
        self.spent = 0.0                # exploring steps' excess over a typical step
        self._last: float | None = None
        self._explored = False          # the step after the last decision explored
        self._recent: deque[float] = deque(maxlen=RECENT)

    def tick(self) -> None:
        """At every batch decision, before choosing: accounts the step since the last one."""
        now = self.clock()
        if self._last is not None:
            self._account(now - self._last)
        self._last = now

    def _account(self, step: float) -> None:
        typical = statistics.median(self._recent) if self._recent else 0.0
        if typical and step > IDLE_STEPS * typical and not self._explored:
            return                      # idle between requests, not a step
        self.elapsed += step
        if self._explored:              # (an exploration then idle: charged as a long step)
            long = step if not typical else min(step, IDLE_STEPS * typical)
            self.spent += max(0.0, long - typical)
        else:
            self._recent.append(step)

    def allows(self) -> bool:
        """Whether an exploration now stays within the share."""
        return self.spent <= self.share * self.elapsed

    def mark(self, explored: bool) -> None:
        """What the decision just made was: an exploration or not."""
        self._explored = explored
