"""A Propose's draft forward time by the forward's rows (every proposing sequence's appended
context plus its block): a robust line (Theil-Sen) through serving's last PROPOSE_WINDOW
Proposes, seeded by the draft's warm-up curve (DraftCapabilities.propose_cost).

The warm-up runs while the other services start (on a 2-core CPU the target calibrates at the
same moment), so its level can be far off - on the EPYC 30 ms where serving's Proposes take 11 -
while its shape (what a row costs) holds. The seeds therefore follow serving's level: each
serving point's ratio to the seeds' own line is kept, and the seeds enter the fit scaled by the
median ratio, until serving's points fill the window. Priced at the warm-up's level, auto did
not draft at one request where drafting won by 12-30 %, and so never timed a Propose to learn
better (exploration is rare by design)."""
from __future__ import annotations

import statistics
from collections import deque
from collections.abc import Iterable

PROPOSE_WINDOW = 25                     # serving's Proposes the line is fitted through
SCALE_TRUST = 3                         # serving's Proposes before a dearer level than the
                                        # prior's is believed (see seed_scale)


class ProposeLine:
    def __init__(self) -> None:
        self.window: deque[tuple[int, float]] = deque(maxlen=PROPOSE_WINDOW)   # serving's
        self.seeds: list[tuple[int, float]] = []            # the draft's warm-up points
        self._seed_line = (0.0, 0.0)
        self._ratios: deque[float] = deque(maxlen=PROPOSE_WINDOW)  # serving / the seeds' line
        self._borrowed = 1.0                                # a sibling's scale (borrow_scale)
        self.line = (0.0, 0.0)                              # (intercept s, s per row)

    @property
    def known(self) -> bool:
        return bool(self.window or self.seeds)

    @property
    def seed_scale(self) -> float:
        """What serving's Proposes take against the warm-up's: the median of its own ratios, or
        before serving timed one of its kind the prior - a sibling's (borrow_scale), else 1.0.
        Below SCALE_TRUST ratios, a level dearer than the prior's is not believed yet: a dear
        price stops drafting, and so the timing that would correct it (a cheap one corrects
        itself: drafting goes on and is timed). On an H200 one request's first tree Propose
        alone ran 8.6x its warm-up point (a first run) and priced every drafting shape at
        10-12 ms a step against 3 without drafts for 20 s, until exploration timed one (1.0x)."""
        if not self._ratios:
            return self._borrowed
        measured = statistics.median(self._ratios)
        return measured if len(self._ratios) >= SCALE_TRUST else min(measured, self._borrowed)

    def borrow_scale(self, sibling: ProposeLine) -> None:
        """A line whose seeds serving has not timed yet takes the level of a sibling seeded by
        the same warm-up in the same regime (alone, or busy) that serving has timed: the
        warm-up's error is its moment's (the target calibrating on the same cores), not the
        shape's. On the EPYC serving's tree Proposes alone took 0.36x the warm-up's; chains
        alone, never timed, stayed at the warm-up's level, priced 2.8x too dear - so auto never
        ran one to learn better, where chains of 2 won by 13 %."""
        if not self._ratios and sibling._ratios and self.seeds:
            self._borrowed = sibling.seed_scale
            self._fit()

    def seed(self, points: Iterable[tuple[int, float]]) -> None:
        """The warm-up's points: only into a line that has none (a draft restart's capabilities
        refetched must not undo what serving taught it)."""
        points = list(points)
        if points and not self.known:
            self.seeds, self._seed_line = points, robust_line(points)
            self._fit()

    def observe(self, rows: int, seconds: float) -> None:
        if self.seeds:
            base, per_row = self._seed_line
            predicted = base + per_row * rows
            if predicted > 0:
                self._ratios.append(seconds / predicted)
        self.window.append((rows, seconds))
        self._fit()

    def _fit(self) -> None:
        points = list(self.window)
        if self.seeds and len(points) < PROPOSE_WINDOW:
            scale = self.seed_scale
            points += [(rows, seconds * scale) for rows, seconds in self.seeds]
        self.line = robust_line(points) if points else (0.0, 0.0)


def robust_line(points: Iterable[tuple[float, float]]) -> tuple[float, float]:
    """(intercept, slope) of a Theil-Sen line through (x, y) points: the median of the
    pairwise slopes (not below 0), and the median intercept under it; with one x value, its
    median y and slope 0. Outliers (a first run, a busy moment) move neither."""
    points = list(points)
    slopes = [(y2 - y1) / (x2 - x1) for i, (x1, y1) in enumerate(points)
              for x2, y2 in points[i + 1:] if x2 != x1]
    slope = max(0.0, statistics.median(slopes)) if slopes else 0.0
    return max(0.0, statistics.median(y - slope * x for x, y in points)), slope
