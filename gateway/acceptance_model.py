"""How many tokens a step of a given shape commits, for one request
(gateway/speculation_policy.py; docs/adaptive-speculation.md).

Acceptance is counted by depth, per shape: "chain" (position j of a chain of drafts), or a tree
of N nodes (depth d of its accepted path). A step that proposed drafts to depth n and had a
accepted says: depths 1..a were accepted, and depth a + 1 was tried and refused (when a < n).
From the counts, the conditional acceptance at depth d, p(d) = P(accept d | accepted d - 1),
and the expected committed tokens of a step reaching depth n:

    E(n) = 1 + sum_{j=1..n} prod_{m=1..j} p(m)          (the bonus, plus the accepted prefix)

A request's own counts are blended with the service's (every request's, slowly forgotten),
which start from an optimistic prior so that every shape is tried before it is judged:

    p(d) = (accepted_req(d) + W * p_service(d)) / (tried_req(d) + W)
"""
from __future__ import annotations

from dataclasses import dataclass, field

CHAIN = "chain"                         # the key of chains; a tree's key is its node count
PRIOR_P = 0.8                           # the service's acceptance before any observation ...
PRIOR_WEIGHT = 2.0                      # ... worth this many observations at every depth
REQUEST_WEIGHT = 8.0                    # W: the service's weight in a request's estimate
SERVICE_DECAY = 0.998                   # the service forgets: about the last 500 steps count


@dataclass
class DepthCounts:
    """Per depth 1..: steps that tried it and steps that accepted it (floats: decayed)."""
    tried: list[float] = field(default_factory=list)
    accepted: list[float] = field(default_factory=list)
    depth: int = 0                      # the deepest proposal seen (a tree's depth; 0 = none)

    def observe(self, depth: int, accepted: int, decay: float = 1.0) -> None:
        """A step whose drafts reached `depth` and had `accepted` accepted (accepted <= depth)."""
        if decay != 1.0:
            self.tried = [t * decay for t in self.tried]
            self.accepted = [a * decay for a in self.accepted]
        while len(self.tried) < depth:
            self.tried.append(0.0)
            self.accepted.append(0.0)
        for d in range(min(accepted + 1, depth)):
            self.tried[d] += 1.0
            if d < accepted:
                self.accepted[d] += 1.0
        self.depth = max(self.depth, depth)

    def counts(self, d: int) -> tuple[float, float]:
        """(accepted, tried) at depth d (1-based)."""
        return (self.accepted[d - 1], self.tried[d - 1]) if d <= len(self.tried) else (0.0, 0.0)


class ServiceAcceptance:
    """Every request's acceptance by shape and depth (the prior of each request's model)."""

    def __init__(self) -> None:
        self.by_shape: dict[str | int, DepthCounts] = {}

    def observe(self, shape: str | int, depth: int, accepted: int) -> None:
        self.by_shape.setdefault(shape, DepthCounts()).observe(depth, accepted, SERVICE_DECAY)

    def depth(self, shape: str | int) -> int:
        counts = self.by_shape.get(shape)
        return counts.depth if counts is not None else 0


class AcceptanceModel:
    """One request's acceptance, blended with the service's."""

    def __init__(self, service: ServiceAcceptance) -> None:
        self.service = service
        self.own: dict[str | int, DepthCounts] = {}

    def observe(self, shape: str | int, depth: int, accepted: int) -> None:
        """A step of this shape: its drafts reached `depth`, `accepted` of them accepted (also
        counted for the service)."""
        if depth <= 0:
            return
        accepted = min(accepted, depth)
        self.own.setdefault(shape, DepthCounts()).observe(depth, accepted)
        self.service.observe(shape, depth, accepted)

    def p(self, shape: str | int, d: int) -> float:
        return _request_p(self.own.get(shape), self.service.by_shape.get(shape), d)

    def expected(self, shape: str | int, depth: int) -> float:
        """E(depth): expected committed tokens of a step whose drafts reach `depth`."""
        return self.expected_by_depth(shape, depth)[depth]

    def expected_by_depth(self, shape: str | int, depth: int) -> list[float]:
        """[E(0), E(1), .., E(depth)] in one pass (the gateway asks for every running request's
        chain and trees at every step: the counts are looked up once per shape)."""
        own, service = self.own.get(shape), self.service.by_shape.get(shape)
        out, reach = [1.0], 1.0
        for d in range(1, depth + 1):
            reach *= _request_p(own, service, d)
            out.append(out[-1] + reach)
        return out

    def tree_depth(self, nodes: int, default: int) -> int:
        """How deep a tree of `nodes` nodes goes (its deepest seen, else `default`)."""
        own = self.own.get(nodes)
        return (own.depth if own is not None and own.depth else None) or \
            self.service.depth(nodes) or default


def _service_p(counts: DepthCounts | None, d: int) -> float:
    acc, tried = counts.counts(d) if counts is not None else (0.0, 0.0)
    return (acc + PRIOR_WEIGHT * PRIOR_P) / (tried + PRIOR_WEIGHT)


def _request_p(own: DepthCounts | None, service: DepthCounts | None, d: int) -> float:
    acc, tried = own.counts(d) if own is not None else (0.0, 0.0)
    return (acc + REQUEST_WEIGHT * _service_p(service, d)) / (tried + REQUEST_WEIGHT)
