"""What a speculative step costs, as the gateway's `--speculation auto` sees it
(gateway/speculation_policy.py; docs/adaptive-speculation.md).

    step = overhead + (propose(rows of the draft forward) if it drafts) + verify(rows of the whole batch)

- verify(T): the target's forward time for a batch of T rows (its tokens; on a GPU a batch of
  chains is padded to a captured block, TargetCapabilities.verify_padded_blocks, so chains of
  2 and 16 tokens cost the same), one curve for chains and one for trees (their own kernels,
  and CUDA graphs of some tree sizes only: another size runs eagerly). It starts from the
  curves the target measured at warm-up (TargetCapabilities.verify_cost, verify_cost_tree) and
  follows every Verify's own report of the forward it ran in (VerifyResponse.batch_tokens /
  batch_seconds): each point is a moving average (a warm-up point more than 5x off serving's
  first run of it is replaced). Chains are read through the points' non-decreasing fit (pool
  adjacent violators: a bigger batch never costs less), interpolated linearly and extrapolated
  past the last point; trees as measured, and past their last point at chain rates.
- propose(rows): a Propose round trip as the gateway waits for it, by the rows of the draft's
  forward it ran in (every proposing sequence's appended context rows plus its block: the draft
  batches the Proposes that arrive together, and on a CPU a batch of eight costs several times
  one): a robust line (Theil-Sen) through the last few forwards the draft reported
  (ProposeResponse.batch_rows / batch_seconds), starting from the draft's warm-up curve
  (DraftCapabilities.propose_cost: one sequence's forward by its rows), plus the round trip's
  own overhead (the wire, the queue). A step that drafts every time appends what the last one
  committed; one after a stretch without drafting appends the whole backlog, and the first one
  the prompt: pricing every Propose at what one of those cost had kept a CPU that rarely
  drafts from ever trying the steady state (chains of 2 beat not drafting at one request on
  the EPYC, which auto never found). Tree Proposes have their own line (they rank each
  position's likeliest tokens: dearer than a chain's).
- overhead: the rest of a step that does not depend on its size - a Verify's round trip minus
  its wait in the target's queue and its forward (the wire, gRPC, scheduling).
"""
from __future__ import annotations

import bisect
import logging
import statistics
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass

from gateway.propose_line import PROPOSE_WINDOW, ProposeLine
from services.common import metrics

log = logging.getLogger("dflash.gateway.cost")

ALPHA = 0.1                             # weight of a new observation in each moving average
MAX_WEIGHT = 50.0                       # a point's weight in the fit stops growing here
UNOBSERVED_WEIGHT = 0.1                 # warm-up points' weight once one proved wrong
PLAUSIBLE = (0.2, 5.0)                  # serving / warm-up time ratios a curve's scale explains
OVERHEAD_PRIOR = 3                      # pseudo-points of the Verify overhead in the Propose one
DOMINATED = 2.0                         # a tree size dearer than this x a bigger one's: eager


@dataclass
class _Point:
    seconds: float                      # serving's moving average (the warm-up's until observed)
    weight: float                       # observations behind it (capped): the fit's weight
    observed: bool = False              # False: only the warm-up's measurement
    runs: int = 0                       # serving's forwards averaged in
    warm: float = 0.0                   # the warm-up's time (0: a size it did not measure)


class VerifyCurve:
    """Verify forward time by batch tokens, for one kind of verify (chains or trees).
    monotone: read through a non-decreasing fit (chains: a bigger batch never costs less);
    False: the points as they are (trees: a size with a CUDA graph can cost less than a
    smaller one without)."""

    def __init__(self, curve: Iterable[tuple[int, float]] = (), monotone: bool = True) -> None:
        self._points: dict[int, _Point] = {t: _Point(s, 2.0, warm=s) for t, s in curve if t > 0}
        self._fit: list[tuple[int, float]] | None = None
        self.monotone = monotone

    @property
    def last(self) -> int:
        """The largest size with a point (0: none)."""
        return max(self._points, default=0)

    @property
    def known(self) -> bool:
        return bool(self._points)

    def seconds(self, tokens: int) -> float:
        """Forward time of a verify batch of `tokens` tokens (0 when unknown)."""
        fit = self._fitted()
        if not fit:
            return 0.0
        i = bisect.bisect_left(fit, (tokens, float("-inf")))   # the first point >= tokens
        if i < len(fit) and fit[i][0] == tokens:
            return fit[i][1]
        if i == 0:
            return fit[0][1]
        if i == len(fit):
            return _extrapolate(fit, tokens)
        (t0, s0), (t1, s1) = fit[i - 1], fit[i]
        return max(0.0, s0 + (s1 - s0) * (tokens - t0) / (t1 - t0))

    def dominated(self, tokens: int) -> bool:
        """The point at `tokens` costs over DOMINATED times a bigger size's: that size has a
        CUDA graph and this one runs eagerly (on an H200 a tree of 7 took 22.8 ms, one of 15
        1.6): never worth running."""
        values = self._values()
        return tokens in values and any(t > tokens and s * DOMINATED < values[tokens]
                                        for t, s in values.items())

    def runs(self, tokens: int) -> int:
        """How many of serving's forwards of exactly `tokens` rows this curve has seen."""
        p = self._points.get(tokens)
        return p.runs if p is not None else 0

    def per_token_s(self) -> float:
        """What one more token costs on average over the measured range (the fit's slope
        from its first point to its last; 0 with fewer than two points)."""
        fit = self._fitted()
        if len(fit) < 2:
            return 0.0
        (t0, s0), (t1, s1) = fit[0], fit[-1]
        return (s1 - s0) / (t1 - t0)

    def observe(self, tokens: int, seconds: float) -> None:
        """A forward of `tokens` rows took `seconds`: averaged into its point (the warm-up
        points serving never ran follow the observed ones' scale: _scale). Except when
        serving's first run of a warm-up point is implausibly far from it (PLAUSIBLE): the
        warm-up timed that shape's first run (a kernel's compilation on a GPU). Then serving's
        time replaces it, and every warm-up point left loses its weight in the fit
        (UNOBSERVED_WEIGHT: one dear point must not pull corrected neighbours up with it)."""
        p = self._points.get(tokens)
        ratio = seconds / max(p.seconds if p is not None else self.seconds(tokens), 1e-9)
        if p is not None and not p.observed and not PLAUSIBLE[0] < ratio < PLAUSIBLE[1]:
            self._points[tokens] = _Point(seconds, 1.0, True, 1)
            for q in self._points.values():
                if not q.observed:
                    q.weight = UNOBSERVED_WEIGHT
        elif p is None:
            self._points[tokens] = _Point(seconds, 1.0, True, 1)
        else:
            p.seconds += ALPHA * (seconds - p.seconds)
            p.weight = min(MAX_WEIGHT, p.weight + 1.0)
            p.observed = True
            p.runs += 1
        self._fit = None

    def _scale(self) -> float:
        """What the warm-up's points that serving never ran are multiplied by: the median of
        serving's time over the warm-up's at the sizes both measured (within PLAUSIBLE) - the
        calibration's shape at the observations' level: a calibration slowed by a busy
        start-up, or a host that got busier, must not keep sizes nobody tries looking dear or
        cheap. Taken afresh from the points, never compounded: nudging them by every
        observation's ratio to the fit drifted without bound where the fit pooled observed
        sizes (an H100 run priced chains at 16-32 requests, where only steps without drafts
        ran, at 1-400 s a step)."""
        ratios = [r for p in self._points.values() if p.observed and p.warm > 0
                  and PLAUSIBLE[0] < (r := p.seconds / p.warm) < PLAUSIBLE[1]]
        return statistics.median(ratios) if ratios else 1.0

    def _values(self) -> dict[int, float]:
        """Each point's time as the curve reads it: serving's, or the warm-up's at _scale."""
        scale = self._scale()
        return {t: p.seconds if p.observed else p.seconds * scale
                for t, p in self._points.items()}

    def _fitted(self) -> list[tuple[int, float]]:
        if self._fit is None:
            values = self._values()
            points = sorted((t, values[t], p.weight) for t, p in self._points.items())
            self._fit = (monotone_fit(points) if self.monotone
                         else [(t, s) for t, s, _ in points])
        return self._fit


class CostModel:
    def __init__(self, curve: Iterable[tuple[int, float]] = (),
                 tree_curve: Iterable[tuple[int, float]] = (),
                 padded_blocks: Iterable[int] = ()) -> None:
        """curve: (tokens, seconds) of chain verifies measured by the target at warm-up; empty =
        unknown (then `known` is False and the gateway does not choose sizes by cost).
        tree_curve: the same for tree verifies (their own kernels and CUDA graphs: a tree of a
        size without a graph runs eagerly); empty = as chains. padded_blocks: the chain blocks
        the target pads a batch to (TargetCapabilities.verify_padded_blocks): the curves are by
        the forward's rows, padding included."""
        self.chains, self.trees = VerifyCurve(curve), VerifyCurve(tree_curve, monotone=False)
        self.padded_blocks = tuple(sorted(padded_blocks))
        self.chain_proposes, self.tree_proposes = ProposeLine(), ProposeLine()   # alone ...
        self.busy_proposes = {False: ProposeLine(), True: ProposeLine()}   # ... and while other
                                        # requests run (by tree): on a CPU their verifies share
                                        # the draft's cores (the EPYC: 37 ms against 11 alone)
        self.propose_s = 0.0            # a chain Propose's forward of no rows (0: none timed) ...
        self.propose_per_row_s = 0.0    # ... and each row of it
        self.tree_propose = (0.0, 0.0)  # the same for trees (intercept, per row)
        # a Propose's round trip beyond its forward: serving's last few (a median, see
        # propose_overhead_s)
        self._propose_overheads: deque[float] = deque(maxlen=PROPOSE_WINDOW)
        self._propose_overhead: float | None = None     # their median, until either changes
        self._overhead_s = 0.0

    @property
    def known(self) -> bool:
        return self.chains.known

    @property
    def overhead_s(self) -> float:
        """A Verify's round trip beyond its queue and forward: a moving average."""
        return self._overhead_s

    @overhead_s.setter
    def overhead_s(self, value: float) -> None:
        self._overhead_s, self._propose_overhead = value, None   # it stands in for Proposes

    @property
    def propose_overhead_s(self) -> float:
        """A Propose's round trip beyond its forward: the median of serving's last few, where
        the Verify's overhead (the same wire and event loops) stands in for those not timed yet
        (up to OVERHEAD_PRIOR of them). Taken whole, the first Propose of a process - 78 ms past
        its 19 ms forward on the EPYC (first use of the stream and the plane) - priced every
        drafting shape 2-4x too dear, and auto stopped drafting for good: a Propose never ran
        again to correct it."""
        if self._propose_overhead is None:      # read for every option of every step
            seen = list(self._propose_overheads)
            prior = [self.overhead_s] * max(0, OVERHEAD_PRIOR - len(seen))
            self._propose_overhead = statistics.median(seen + prior) if seen or prior else 0.0
        return self._propose_overhead

    # -- reading -------------------------------------------------------------------------------
    def verify_s(self, tokens: int, tree: bool = False, unit: int = 0) -> float:
        """Forward time of a verify batch of `tokens` tokens (0 when unknown). Trees: the tree
        curve holds one tree per size (its own kernels and graph: a tree's cost is its size's,
        not its rows'), so a batch of trees of `unit` rows each is that size's point plus what
        the further rows cost chains (and past the curve's last size, the last one's). Priced
        by its rows instead, two trees of 7 (16 rows, eager) read the graph-captured tree of
        15's 1.6 ms, and auto ran them at 22.8 ms a step."""
        if not (tree and self.trees.known):
            return self.chains.seconds(tokens)
        anchor = min(unit or tokens, tokens, self.trees.last)
        return self.trees.seconds(anchor) + max(0.0, self.chains.seconds(tokens)
                                                - self.chains.seconds(anchor))

    def tree_dominated(self, nodes: int) -> bool:
        """A tree of `nodes` drafts costs far more than a bigger one (VerifyCurve.dominated)."""
        return self.trees.dominated(nodes + 1)

    def verify_runs(self, tokens: int, tree: bool = False) -> int:
        """How many verifies of `tokens` rows serving has timed (of trees, when trees have
        their own curve)."""
        return (self.trees if tree and self.trees.known else self.chains).runs(tokens)

    def chain_rows(self, tokens: Iterable[int]) -> int:
        """The rows of a batch of chain verifies of these tokens each: every one padded to the
        smallest padded block that holds the longest (the target's CUDA graphs), or as they are
        when none does (an eager forward)."""
        tokens = list(tokens)
        longest = max(tokens, default=0)
        pad = min((b for b in self.padded_blocks if b >= longest), default=0)
        return pad * len(tokens) if pad else sum(tokens)

    def propose_cost(self, rows: float, tree: bool = False, busy: bool = False) -> float:
        """A Propose whose draft forward runs `rows` rows (every proposing sequence's appended
        context rows plus its block; a tree: its own line once one was timed), round trip.
        busy: while other requests run - their line once serving timed one, else alone's."""
        if busy and (busy_line := self._line(tree, busy=True)).window:
            base, per_row = busy_line.line
        elif tree and self.tree_proposes.known:
            base, per_row = self.tree_propose
        else:
            base, per_row = self.propose_s, self.propose_per_row_s
        return self.propose_overhead_s + base + per_row * rows

    def propose_runs(self, tree: bool = False, busy: bool = False) -> int:
        """How many of serving's Proposes price this kind (alone or busy) now."""
        return len(self._line(tree, busy).window)

    def propose_untimed(self, tree: bool = False, busy: bool = False) -> bool:
        """This kind's price is still the draft's warm-up curve alone (serving timed none)."""
        line = self._line(tree, busy)
        return bool(line.seeds) and not line.window

    def _line(self, tree: bool, busy: bool, pricing: bool = True) -> ProposeLine:
        """The line a Propose of this kind is observed into (pricing False) or priced from
        (trees: the chains' until a tree was timed or seeded)."""
        tree = tree and (self.tree_proposes.known or not pricing)
        return (self.busy_proposes[tree] if busy
                else self.tree_proposes if tree else self.chain_proposes)

    def step_s(self, batch_tokens: int, drafts: bool, tree: bool = False,
               propose_rows: float = 0.0, busy: bool = False, unit: int = 0) -> float:
        """One step of a batch: its verify of batch_tokens (trees of `unit` rows each), plus a
        Propose if it drafts (a draft forward of `propose_rows`: in steady state, what a step
        commits plus the blocks; busy: a batch of several requests), plus the overhead."""
        return (self.overhead_s
                + (self.propose_cost(propose_rows, tree, busy) if drafts else 0.0)
                + self.verify_s(batch_tokens, tree, unit))

    # -- learning ------------------------------------------------------------------------------
    def observe_verify(self, batch_tokens: int, batch_seconds: float, wall_s: float,
                       queue_s: float = 0.0, tree: bool = False, unit: int = 0) -> None:
        """A Verify (of a tree or a chain) answered after wall_s; it waited queue_s in the
        target's engine (for the batches before it: the others' load, which the batch model
        counts already), and its forward ran batch_tokens in batch_seconds (0 / 0: a target
        that does not report it). A tree of `unit` rows teaches the tree curve only when it
        ran alone (its points are one tree each; a batch's rows would land on another size's)."""
        if batch_tokens > 0 and batch_seconds > 0:
            trees = tree and self.trees.known
            if not (trees and unit and batch_tokens != unit):
                (self.trees if trees else self.chains).observe(batch_tokens, batch_seconds)
            self.overhead_s = _average(self.overhead_s,
                                       max(0.0, wall_s - queue_s - batch_seconds))

    def seed_proposes(self, chains: Iterable[tuple[int, float]],
                      trees: Iterable[tuple[int, float]] = ()) -> None:
        """The draft's warm-up points (DraftCapabilities.propose_cost: engine time by forward
        rows): the lines' prior, at serving's level once serving has timed Proposes of its own
        (gateway/propose_line.py). Only into a line that has none."""
        chains, trees = list(chains), list(trees)
        self.chain_proposes.seed(chains)
        self.tree_proposes.seed(trees)
        self.busy_proposes[False].seed(chains)
        self.busy_proposes[True].seed(trees)
        self._lines()

    def observe_propose(self, wall_s: float, rows: int = 0, tree: bool = False,
                        forward_s: float = 0.0, busy: bool = False, queue_s: float = 0.0) -> None:
        """A Propose round trip of wall_s whose draft forward ran `rows` rows in forward_s
        (0: a draft that does not say; then the round trip is the point) after waiting queue_s
        in the draft's engine; busy: while other requests ran. Its overhead (the wire and the
        event loops) is what is left of the round trip: a wait behind other Proposes' forwards
        is their cost, which the rows of a batch already price - counted in the overhead as
        well, 32 requests' first Proposes (each behind the others, 20 ms round trips around
        2-9 ms forwards on an H200) priced every later drafting step at three times a step
        without drafts, and auto never drafted at 16 and 32 requests.
        A robust line through the last few, not a moving average: one slow
        Propose (a kernel's first run) must not make drafting look dear, as then no Propose is
        timed again to correct it. Alone and busy have lines of their own: on a 2-core CPU a
        Propose beside another request's verify took 3x one alone, and a line taught at two
        requests kept auto from drafting at one, where it won."""
        if forward_s > 0:
            self._propose_overheads.append(max(0.0, wall_s - queue_s - forward_s))
            self._propose_overhead = None
        line = self._line(tree, busy, pricing=False)
        line.observe(rows, forward_s if forward_s > 0 else wall_s)
        for a, b in ((self.chain_proposes, self.tree_proposes),
                     (self.busy_proposes[False], self.busy_proposes[True])):
            a.borrow_scale(b)
            b.borrow_scale(a)
        self._lines()
        if log.isEnabledFor(logging.DEBUG):
            log.debug("propose timed", extra={
                "rows": rows, "forward_ms": round(forward_s * 1e3, 2),
                "wall_ms": round(wall_s * 1e3, 2), "queue_ms": round(queue_s * 1e3, 2),
                "tree": tree, "busy": busy,
                "overhead_ms": round(self.propose_overhead_s * 1e3, 2),
                "line_ms": [round(x * 1e3, 3) for x in line.line],
                "seed_scale": round(line.seed_scale, 3)})

    def _lines(self) -> None:
        self.propose_s, self.propose_per_row_s = self.chain_proposes.line
        self.tree_propose = self.tree_proposes.line

    def export(self, model: str) -> None:
        """dflash_spec_cost_seconds: the model's parts now."""
        if not model:
            return
        values = {"verify_1": self.verify_s(1), "verify_per_token": self.chains.per_token_s(),
                  "propose": self.propose_s, "propose_per_row": self.propose_per_row_s,
                  "propose_overhead": self.propose_overhead_s, "overhead": self.overhead_s}
        for component, v in values.items():
            metrics.SPEC_COST.labels(model, component).set(v)


def monotone_fit(points: list[tuple[int, float, float]]) -> list[tuple[int, float]]:
    """The weighted least-squares non-decreasing fit of (x, y, weight) sorted by x (pool
    adjacent violators); one (x, fitted y) per input point."""
    blocks: list[list[float]] = []      # [sum of w*y, sum of w, count]
    for _, y, w in points:
        blocks.append([w * y, w, 1])
        while len(blocks) > 1 and blocks[-2][0] / blocks[-2][1] > blocks[-1][0] / blocks[-1][1]:
            wy, ww, n = blocks.pop()
            blocks[-1][0] += wy
            blocks[-1][1] += ww
            blocks[-1][2] += n
    ys = [b[0] / b[1] for b in blocks for _ in range(int(b[2]))]
    return [(x, y) for (x, _, _), y in zip(points, ys)]


def _extrapolate(fit: list[tuple[int, float]], tokens: int) -> float:
    """Past the last point: at the steeper of the last segment's slope and the whole curve's
    (a flat last segment, noise pooled by the fit, must not make big batches free)."""
    (t_last, s_last), (t_first, s_first) = fit[-1], fit[0]
    if len(fit) == 1:
        return s_last * tokens / t_last
    t_prev, s_prev = fit[-2]
    slope = max((s_last - s_prev) / (t_last - t_prev), (s_last - s_first) / (t_last - t_first))
    return s_last + slope * (tokens - t_last)


def _average(old: float, new: float) -> float:
    return new if old == 0.0 else old + ALPHA * (new - old)
