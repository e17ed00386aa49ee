"""`--speculation auto`: every step, the chain length or tree size (0 drafts = verify the anchor
alone) of the running batch, chosen from measured cost and acceptance
(docs/adaptive-speculation.md).

One shape for the whole batch, as TensorRT-LLM's batch-size -> draft-length table does (here
measured, not written by hand): on a GPU a batch of mixed shapes loses the CUDA graph of each
(chains of several lengths pad to the longest; trees and chains run as two forwards), and on a
CPU every request's drafts compete for the same cores. For each candidate shape s, every running
request r contributes its expected committed tokens E_r(s) (its own acceptance model, s clamped
to what r may run: its room, its remaining tokens) and its verify tokens T_r(s); the batch's
shape maximises

    sum_r E_r(s) / (overhead + propose(E(s) / requests) * [s drafts] + verify(rows of the T_r(s)))

(rows: the tokens, each chain padded to the target's captured block on a GPU)

from the cost model (gateway/cost_model.py) and the acceptance models
(gateway/acceptance_model.py). Cheap verifies and high acceptance make longer blocks and bigger
trees win; an expensive verify, low acceptance or a loaded batch make shorter ones win, down to
no drafting. The choice only changes what is verified, never what is committed: the output is
the target's whatever it picks. `choose` is the pure decision; `SpeculationPolicy` is the
gateway-wide state around it (the cost model, the service's acceptance, the running requests'
models), deciding once per batch step and answering each request with the batch's shape."""
from __future__ import annotations

import logging
import time
from collections.abc import Iterable
from dataclasses import dataclass

from gateway.acceptance_model import CHAIN, AcceptanceModel, ServiceAcceptance
from gateway.cost_model import CostModel
from gateway.exploration import ExplorationBudget
from gateway.step_period import StepPeriods, kind_of
from runtime.draft_tree import DraftTree
from services.common import metrics

log = logging.getLogger("dflash.gateway.speculation")

TREE_SIZES = (7, 15, 63)                # the tree sizes auto considers (within the pair's max)
EXPLORE_EVERY = 32                      # every this many batch decisions, the runner-up runs once
                                        # (within gateway/exploration.py's budget)
EXPLORE_RUNS = 3                        # ... unless serving has timed its verify rows this often
DRAFT_MARGIN = 0.1                      # drafting must promise 10 % more committed tokens/s
CATCH_UP_STEPS = 8                      # a draft context's catch-up is priced over this many steps


@dataclass(frozen=True)
class Shape:
    drafts: int                         # chain: drafts after the anchor; tree: its nodes
    tree: bool = False

    @property
    def tokens(self) -> int:
        """The verify's block: anchor + drafts."""
        return 1 + self.drafts

    @property
    def key(self) -> str | int:
        """Its acceptance model's key."""
        return self.drafts if self.tree else CHAIN


NO_DRAFTING = Shape(0)


@dataclass(frozen=True)
class Option:
    shape: Shape
    expected: float                     # expected committed tokens of a step of this shape
    batch_tokens: int = 0               # its verify tokens (0: shape.tokens; a batch: the sum)
    requests: int = 1                   # the requests it is for (a batch's: all)
    batch_propose_rows: float = 0.0     # its draft forward's rows (0: one request's)

    @property
    def tokens(self) -> int:
        return self.batch_tokens or self.shape.tokens

    @property
    def propose_rows(self) -> float:
        """In steady state each Propose appends what the last step committed - about what a
        step of this shape commits - and runs its block (a chain's: its tokens)."""
        return self.batch_propose_rows or self.expected + self.shape.tokens


def choose(options: Iterable[Option], cost: CostModel) -> Option:
    """The option with the most committed tokens per second (ties: the fewer tokens). An option
    is one request's shape, or a batch's (expected and tokens summed over its requests).
    options must include NO_DRAFTING."""
    return rank(options, cost)[0]


def rank(options: Iterable[Option], cost: CostModel,
         periods: StepPeriods | None = None) -> list[Option]:
    """The options by committed tokens per second, best first (ties: the fewer tokens). A
    drafting option must promise DRAFT_MARGIN more than not drafting: its prediction is the
    less certain (acceptance and Propose cost are estimates), and a mispredicted draft costs
    more than its own step - at 2+ requests its Propose holds its verify out of the others'
    batch, so the target runs one more forward. periods: serving's measured step periods
    against the model's prices, by kind and load (gateway/step_period.py)."""
    def rate(o: Option) -> float:
        seconds = step_s(o, cost)
        if periods is not None:
            seconds *= periods.factor(kind_of(o.shape.drafts, o.shape.tree), o.requests)
        r = o.expected / seconds if seconds > 0 else o.expected
        return r / (1.0 + DRAFT_MARGIN) if o.shape.drafts else r
    return sorted(sorted(options, key=lambda o: o.tokens), key=rate, reverse=True)


def _runner_up(ranked: list[Option]) -> Option:
    """The best option of other verify rows than the best (the best when there is none)."""
    return next((o for o in ranked[1:] if o.tokens != ranked[0].tokens), ranked[0])


def step_s(o: Option, cost: CostModel) -> float:
    """An option's step: the Proposes of its requests run as one draft forward."""
    return cost.step_s(o.tokens, o.shape.drafts > 0, o.shape.tree, o.propose_rows,
                       busy=o.requests > 1, unit=o.shape.tokens if o.shape.tree else 0)


@dataclass(frozen=True)
class Limits:
    """What one step of one request may use."""
    max_chain: int                      # drafts in a chain (block - 1), within the pair, the
                                        # tokens still allowed and the context's room
    max_tree: int                       # nodes in a tree (0: no trees)
    tree_depth: int                     # how deep a tree can go (the block's drafts)
    backlog: int | None = None          # positions its next Propose appends to the draft's
                                        # context (None: unknown - as in steady state)
    remaining: int = 0                  # tokens it may still produce (0: unknown)


@dataclass
class _Running:
    """A running request as the batch decision sees it (refreshed at each of its decides)."""
    limits: Limits
    chain: list[float]                  # E(k) for chains of k = 0..limits.max_chain drafts
    trees: dict[int, float]             # E of each tree size it may run


def appended_rows(limits: Limits, expected: float) -> float:
    """The context rows one request's Propose is priced with: in steady state it appends what
    the last step committed (about `expected`); after steps that did not draft it appends the
    backlog they left, a catch-up that later drafting steps profit from too, so its excess is
    spread over the steps the request has left (at most CATCH_UP_STEPS)."""
    if limits.backlog is None or limits.backlog <= expected:
        return expected
    steps = max(1.0, min(CATCH_UP_STEPS, limits.remaining / max(expected, 1.0)
                         if limits.remaining else CATCH_UP_STEPS))
    return expected + (limits.backlog - expected) / steps


def _view(acceptance: AcceptanceModel, limits: Limits) -> _Running:
    """What the batch decision needs of one request now."""
    return _Running(limits, acceptance.expected_by_depth(CHAIN, limits.max_chain),
                    {n: acceptance.expected(n, acceptance.tree_depth(n, limits.tree_depth))
                     for n in TREE_SIZES if n <= limits.max_tree})


def fit(shape: Shape, limits: Limits) -> Shape:
    """The batch's shape as one request may run it: a chain no longer than its room, a tree it
    has no room for -> its longest chain."""
    if shape.tree:
        return shape if shape.drafts <= limits.max_tree else Shape(limits.max_chain)
    return Shape(min(shape.drafts, limits.max_chain))


class SpeculationPolicy:
    def __init__(self, curve: Iterable[tuple[int, float]] = (),
                 tree_curve: Iterable[tuple[int, float]] = (),
                 padded_blocks: Iterable[int] = ()) -> None:
        self.cost = CostModel(curve, tree_curve, padded_blocks)
        self.service = ServiceAcceptance()
        self._running: dict[str, _Running] = {}
        self._batch = NO_DRAFTING       # the batch's shape, decided ...
        self._batch_size = 0            # ... for this many running requests ...
        self._since = 0                 # ... this many decides ago
        self._decisions = 0             # batch decisions so far (exploration's clock) ...
        self.budget = ExplorationBudget()   # ... and what exploring may cost
        self.periods = StepPeriods()        # measured step periods against the prices
        self._priced = ("none", 0, 0.0)     # the last decision's kind, requests, model price ...
        self._ran_under: dict[str, tuple[str, int, float]] = {}   # ... each request's last one
        self._exported = float("-inf")

    @property
    def usable(self) -> bool:
        """False without a cost curve (the target did not calibrate): fixed speculation."""
        return self.cost.known

    def model(self) -> AcceptanceModel:
        """A new request's acceptance model."""
        return AcceptanceModel(self.service)

    def decide(self, request: str, acceptance: AcceptanceModel, limits: Limits,
               running: int = 1) -> Shape:
        """This step's shape for `request`: the batch's, fitted to its limits. The batch's shape
        is decided again once per batch step (after as many decides as requests run) and when
        the number running changes. running: requests in the loop now, this one included; those
        that have not decided yet (just admitted) count with the service's acceptance."""
        self._running[request] = _view(acceptance, limits)
        size = max(running, len(self._running))
        self._since += 1
        if size != self._batch_size or self._since >= size:
            models = list(self._running.values())
            if size > len(models):                   # the undecided: the service's prior
                models += [_view(self.model(), limits)] * (size - len(models))
            self._batch = self._decide_batch(models)
            self._batch_size, self._since = size, 0
        self._ran_under[request] = self._priced
        return fit(self._batch, limits)

    def _decide_batch(self, models: list[_Running]) -> Shape:
        """The shape with the most committed tokens per second for the whole batch."""
        longest = max(m.limits.max_chain for m in models)
        shapes = [Shape(k) for k in range(longest + 1)]
        shapes += [Shape(n, True) for n in TREE_SIZES if any(n in m.trees for m in models)
                   and not self.cost.tree_dominated(n)]        # eager beside a bigger graph
        options = [self._batch_option(s, models) for s in shapes]
        ranked = rank(options, self.cost, self.periods)
        best = ranked[0]
        self._decisions += 1
        self.budget.tick()
        due = self._decisions % EXPLORE_EVERY == 0 or self._unpriced(ranked)
        if due and self.budget.allows():
            best = self._explore(ranked)
        self.budget.mark(best is not ranked[0])
        self._priced = (kind_of(best.shape.drafts, best.shape.tree), len(models),
                        step_s(best, self.cost))
        if log.isEnabledFor(logging.DEBUG):
            log.debug("speculation chosen", extra={
                "shape": best.shape, "requests": len(models), "expected": round(best.expected, 2),
                "explore": best is not ranked[0], "period_factors": self.periods.factors(
                    len(models)),
                "options": " ".join(
                    f"{o.shape.drafts}{'t' if o.shape.tree else ''}:{o.expected:.2f}/"
                    f"{step_s(o, self.cost) * 1e3:.0f}ms"
                    for o in options)})
        return best.shape

    def _unpriced(self, ranked: list[Option]) -> bool:
        """The runner-up drafts at a Propose price that is still the draft's warm-up curve in
        this regime (alone or busy; serving timed none): explored at once, not EXPLORE_EVERY
        decisions later - at one request a price 3x too dear kept auto from drafting for the
        first ~32 steps, most of a short request."""
        runner_up = _runner_up(ranked)
        return bool(runner_up.shape.drafts) and self.cost.propose_untimed(
            runner_up.shape.tree, runner_up.requests > 1)

    def _explore(self, ranked: list[Option]) -> Option:
        """Exploration: a size the model prices too dear (a warm-up point taken while the shape
        ran for the first time, a Propose line taught while other requests shared the cores)
        would never run, so never be corrected. Once in a while the best option of other verify
        rows runs instead, until serving has timed its rows and its kind of Propose (alone or
        busy) EXPLORE_RUNS times each, and its kind's step period at this load
        (gateway/step_period.py): then its price is serving's own, and exploring it again
        would only cost (on a CPU where not drafting wins, one step in 32 drafting kept auto
        3 % below it)."""
        best, runner_up = ranked[0], _runner_up(ranked)
        shape = runner_up.shape
        if (self.cost.verify_runs(runner_up.tokens, shape.tree) >= EXPLORE_RUNS
                and (not shape.drafts or self.cost.propose_runs(
                    shape.tree, runner_up.requests > 1) >= EXPLORE_RUNS)
                and self.periods.measured(kind_of(shape.drafts, shape.tree),
                                          runner_up.requests)):
            return best
        return runner_up

    def _batch_option(self, shape: Shape, models: list[_Running]) -> Option:
        """The batch's committed tokens and verify rows when every request runs `shape` (chains
        padded as the target pads them)."""
        expected, tokens, blocks, appended = 0, [], 0, 0    # one pass: every option, every step
        for m in models:
            own = fit(shape, m.limits)
            e = m.trees[own.drafts] if own.tree else m.chain[own.drafts]
            expected += e
            tokens.append(own.tokens)
            # a tree's Propose runs the whole block (its depth + 1), a chain's its own tokens,
            # after the context it appends
            blocks += m.limits.tree_depth + 1 if own.tree else own.tokens
            appended += appended_rows(m.limits, e)
        rows = sum(tokens) if shape.tree else self.cost.chain_rows(tokens)
        return Option(shape, expected, rows, len(models), appended + blocks)

    def observe_period(self, request: str, shape: Shape, period_s: float) -> None:
        """A request's step of `shape` took period_s (its Propose, grammar and Verify round
        trips): against the price of the batch decision it ran under (at many requests the
        next decision is taken while its step runs), when it ran that decision's kind (a
        request whose room cut a tree to a chain ran another step)."""
        kind, requests, priced = self._ran_under.get(request, ("", 0, 0.0))
        if kind == kind_of(shape.drafts, shape.tree):
            self.periods.observe(kind, requests, period_s, priced)

    def observe(self, acceptance: AcceptanceModel, shape: Shape, depth: int, accepted: int
                ) -> None:
        """A step of `shape` verified drafts reaching `depth` (fewer than asked when the draft
        or a grammar cut them) with `accepted` accepted."""
        acceptance.observe(shape.key, depth, accepted)

    def observe_chain_in_tree(self, acceptance: AcceptanceModel, tree: DraftTree,
                              committed: list[int]) -> None:
        """A greedy tree step also says how its first path - the chain the drafter would have
        proposed - fared: accepted as far as it agrees with the target's greedy tokens (the
        committed ones; the tree's walk takes the first child that matches, so it leaves the
        chain exactly where the chain fails). Chains that auto seldom runs then learn from the
        trees it does run, instead of staying at the prior."""
        chain = tree.first_path()
        agree = next((i for i, (d, t) in enumerate(zip(chain, committed)) if d != t),
                     min(len(chain), len(committed)))
        if chain:
            acceptance.observe(CHAIN, len(chain), agree)

    def export(self, model: str) -> None:
        """The cost model's gauges, at most once a second (a step is milliseconds on a GPU)."""
        now = time.monotonic()
        if now - self._exported >= 1.0:
            self._exported = now
            self.cost.export(model)

    def forget(self, request: str) -> None:
        self._running.pop(request, None)
        self._ran_under.pop(request, None)

    @staticmethod
    def record(model: str, shape: Shape) -> None:
        if model:
            metrics.SPEC_CHOSEN.labels(model, "tree" if shape.tree else "chain").observe(
                shape.tokens)
