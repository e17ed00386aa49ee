"""The verify cost curves the target measures at warm-up (services/target/cost_calibration.py)
and reports in its capabilities for the gateway's `--speculation auto`."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class CostPoint:
    tokens: int                         # a verify batch's total tokens (all its sequences)
    seconds: float                      # its forward, to the decisions' read-back


@dataclass(frozen=True)
class CostCurves:
    chains: tuple[CostPoint, ...] = ()  # ascending in tokens; () = not measured
    trees: tuple[CostPoint, ...] = ()   # tree verifies (ancestor mask, their own graphs)
