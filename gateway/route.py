"""The replicas one request runs on: a target, and a draft (None: no draft configured). Placed at
admission (GatewayState.place) and kept - the request's soft state lives there - until a replica
stops being usable: then the request moves (gateway/generation.py) and its soft state is rebuilt
on the new one through the links' rebuild paths. Each replica counts the requests placed on it
(Upstream.placed: the gateway's share of its load)."""
from __future__ import annotations

from dflash.v1 import target_pb2
from gateway.upstream import Upstream


class Route:
    def __init__(self, target: Upstream, draft: Upstream | None,
                 identity: target_pb2.TargetCapabilities | None = None) -> None:
        """identity: the target capabilities the request was admitted under (the role's
        identity then): it may only move to a target replica that agrees with them - a
        replica of another model would continue its output with other weights."""
        self.target, self.draft, self.identity = target, draft, identity
        target.placed += 1
        if draft is not None:
            draft.placed += 1
        self.closed = False

    def move_target(self, to: Upstream) -> Upstream:
        """Places the request on `to`; returns the replica it leaves."""
        old, self.target = self.target, to
        old.placed -= 1
        to.placed += 1
        return old

    def move_draft(self, to: Upstream) -> Upstream | None:
        old, self.draft = self.draft, to
        if old is not None:
            old.placed -= 1
        to.placed += 1
        return old

    def close(self) -> None:
        """The request ended (its Releases were sent)."""
        if not self.closed:
            self.closed = True
            self.target.placed -= 1
            if self.draft is not None:
                self.draft.placed -= 1

    def __repr__(self) -> str:
        return f"Route(target={self.target.address}, draft={self.draft.address if self.draft else '-'})"
