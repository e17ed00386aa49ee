"""`--speculation auto`: how long a request's steps really take against the cost model's price,
by kind of step (no drafts, a chain, a tree) and load (docs/adaptive-speculation.md).

The cost model prices one lockstep batch: every running request proposes together, then one
verify forward holds them all. Served, the requests' loops drift apart and the target runs
several smaller batches per round, so a request's step also waits for the others' forwards,
and how much depends on the kind of step: an H200 log of SmolLM2 at 4 and 8 requests showed
steps without drafts and trees of 63 taking 2-3x their price (3 ms priced against ~6-7 ms a
step measured; 12 against 31-40 ms), chains about their price - so auto ran the wrong kind. Each
request's step period (its Propose, grammar and Verify round trips: t0 to the Verify's answer)
is compared with the price of the batch decision it ran under, and the ratio (the median of the
last PERIOD_WINDOW, per kind and power-of-two band of running requests: a kernel's first run or
a stall is outvoted by the next two) multiplies that kind's price at that load. A kind not yet
measured at a load takes the mean of the kinds that are (the level every kind shares, e.g. a
slower host), so a correction of one kind alone does not by itself make the others look
cheap."""
from __future__ import annotations

import math
import statistics
from collections import deque

PERIOD_WINDOW = 9                   # the last periods' ratios whose median is used
PERIOD_TRUST = 3                    # periods before a kind's own correction is used
MAX_LOG_RATIO = math.log(8.0)       # one period counts at most 8x either way
KINDS = ("none", "chain", "tree")


def kind_of(drafts: int, tree: bool) -> str:
    return "tree" if tree else "chain" if drafts else "none"


def band(requests: int) -> int:
    """Loads that share a correction: 1, 2-3, 4-7, 8-15, 16-31, 32-63, 64+."""
    return min(max(requests, 1), 64).bit_length()


class StepPeriods:
    def __init__(self) -> None:
        # (kind, band) -> the last log(measured / priced) ratios
        self._ratios: dict[tuple[str, int], deque[float]] = {}
        self._median: dict[tuple[str, int], float] = {}        # ... their median, once trusted

    def observe(self, kind: str, requests: int, measured_s: float, priced_s: float) -> None:
        """A step of `kind` at `requests` running took measured_s; the model priced priced_s."""
        if measured_s <= 0 or priced_s <= 0:
            return
        r = max(-MAX_LOG_RATIO, min(MAX_LOG_RATIO, math.log(measured_s / priced_s)))
        key = (kind, band(requests))
        ratios = self._ratios.setdefault(key, deque(maxlen=PERIOD_WINDOW))
        ratios.append(r)
        if len(ratios) >= PERIOD_TRUST:
            self._median[key] = statistics.median(ratios)

    def measured(self, kind: str, requests: int) -> bool:
        """Whether this kind's own correction is used at this load."""
        return (kind, band(requests)) in self._median

    def factor(self, kind: str, requests: int) -> float:
        """What a price of this kind at this load is multiplied by (1: nothing measured)."""
        b = band(requests)
        if (own := self._median.get((kind, b))) is not None:
            return math.exp(own)
        level = [v for (_, kb), v in self._median.items() if kb == b]
        return math.exp(sum(level) / len(level)) if level else 1.0

    def factors(self, requests: int) -> dict[str, float]:
        """Every kind's factor at this load (for the decision's log line)."""
        return {k: round(self.factor(k, requests), 2) for k in KINDS}
