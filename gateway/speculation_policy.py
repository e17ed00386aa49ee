"""`--speculation auto`: every step, each request's chain length or tree size (0 drafts = verify
the anchor alone) chosen from measured cost and acceptance (docs/adaptive-speculation.md).

The whole batch's throughput is what counts. With the other running requests' last choices
(their verify tokens T_rest and expected committed tokens E_rest), a request picks the shape s
that maximises

    (E(s) + E_rest) / (overhead + propose * [s drafts] + verify(T_rest + 1 + drafts(s)))

from the cost model (gateway/cost_model.py) and its acceptance model
(gateway/acceptance_model.py). Cheap verifies and high acceptance make longer blocks and bigger
trees win; an expensive verify, low acceptance or a loaded batch make shorter ones win, down to
no drafting. The choice only changes what is verified, never what is committed: the output is
the target's whatever it picks. `choose` is the pure decision; `SpeculationPolicy` is the
gateway-wide state around it (the cost model, the service's acceptance, the running choices)."""
from __future__ import annotations

import logging
import time
from collections.abc import Iterable
from dataclasses import dataclass

from gateway.acceptance_model import CHAIN, AcceptanceModel, ServiceAcceptance
from gateway.cost_model import CostModel
from services.common import metrics

log = logging.getLogger("dflash.gateway.speculation")

TREE_SIZES = (7, 15, 63)                # the tree sizes auto considers (within the pair's max)


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


@dataclass(frozen=True)
class Load:
    """The rest of the batch: the other running requests' last choices."""
    tokens: int = 0
    expected: float = 0.0


def choose(options: Iterable[Option], cost: CostModel, load: Load = Load()) -> Option:
    """The option with the most committed tokens per second for the whole batch (ties: the
    fewer drafts). options must include NO_DRAFTING."""
    def rate(o: Option) -> float:
        seconds = cost.step_s(load.tokens + o.shape.tokens, o.shape.drafts > 0, o.shape.tree)
        return (o.expected + load.expected) / seconds if seconds > 0 else o.expected
    return max(sorted(options, key=lambda o: o.shape.tokens), key=rate)


@dataclass(frozen=True)
class Limits:
    """What one step of one request may use."""
    max_chain: int                      # drafts in a chain (block - 1), within the pair, the
                                        # tokens still allowed and the context's room
    max_tree: int                       # nodes in a tree (0: no trees)
    tree_depth: int                     # how deep a tree can go (the block's drafts)


class SpeculationPolicy:
    def __init__(self, curve: Iterable[tuple[int, float]] = (),
                 tree_curve: Iterable[tuple[int, float]] = ()) -> None:
        self.cost = CostModel(curve, tree_curve)
        self.service = ServiceAcceptance()
        self._running: dict[str, Option] = {}
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
        """This step's shape for `request` (its choice stays in the batch load until the next).
        running: requests in the loop now, this one included; those that have not chosen yet
        (just admitted) count as verifying their anchor alone."""
        chain = acceptance.expected_by_depth(CHAIN, limits.max_chain)
        options = [Option(Shape(k), chain[k]) for k in range(limits.max_chain + 1)]
        for n in TREE_SIZES:
            if n <= limits.max_tree:
                depth = acceptance.tree_depth(n, limits.tree_depth)
                options.append(Option(Shape(n, True), acceptance.expected(n, depth)))
        others = [o for r, o in self._running.items() if r != request]
        new = max(0, running - 1 - len(others))
        load = Load(new + sum(o.shape.tokens for o in others),
                    new + sum(o.expected for o in others))
        best = choose(options, self.cost, load)
        self._running[request] = best
        if log.isEnabledFor(logging.DEBUG):
            log.debug("speculation chosen", extra={
                "seq": request, "shape": best.shape, "expected": round(best.expected, 2),
                "load_tokens": load.tokens, "load_expected": round(load.expected, 2),
                "options": " ".join(f"{o.shape.drafts}{'t' if o.shape.tree else ''}:"
                                    f"{o.expected:.2f}/{self.cost.step_s(load.tokens + o.shape.tokens, o.shape.drafts > 0, o.shape.tree) * 1e3:.0f}ms"
                                    for o in options)})
        return best.shape

    def observe(self, acceptance: AcceptanceModel, shape: Shape, depth: int, accepted: int
                ) -> None:
        """A step of `shape` verified drafts reaching `depth` (fewer than asked when the draft
        or a grammar cut them) with `accepted` accepted."""
        acceptance.observe(shape.key, depth, accepted)

    def export(self, model: str) -> None:
        """The cost model's gauges, at most once a second (a step is milliseconds on a GPU)."""
        now = time.monotonic()
        if now - self._exported >= 1.0:
            self._exported = now
            self.cost.export(model)

    def forget(self, request: str) -> None:
        self._running.pop(request, None)

    @staticmethod
    def record(model: str, shape: Shape) -> None:
        if model:
            metrics.SPEC_CHOSEN.labels(model, "tree" if shape.tree else "chain").observe(
                shape.tokens)
