"""The Propose cost curve measured at warm-up, for the gateway's `--speculation auto`
(gateway/cost_model.py): how long the draft's engine takes for one sequence's Propose by the
rows of its forward (the context rows it appends plus its block), a chain of the drafter's
block and (when it drafts trees) a tree of 15.

Without it the gateway priced drafting from the Proposes it happened to time first: the
prompt's (every row of it), the backlog of a stretch without drafting, trees under the
optimistic prior - tens of ms on the 2-core CPU where a steady Propose appending the few rows a
step commits costs half of that - and an auto that rarely drafts never times the steady state.
These points are its prior until serving has timed Proposes of its own.

One calibration sequence holds a short context; each size appends its rows and proposes, in
two passes (the faster of the two is the point), then the sequence is released. On a GPU the
first pass also runs each shape's first time (graph replays, kernel compiles). A calibration
that fails is logged and leaves the curves empty; the service starts anyway."""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import torch

from services.draft.drafter import Drafter
from services.draft.engine import DraftEngine, ProposeCall

log = logging.getLogger("dflash.draft.cost")

APPENDED = (1, 2, 4, 8, 16)            # context rows a Propose appends (a step commits 1..B)
TREE_NODES = 15
CONTEXT = 16                           # the calibration sequence's first context
PASSES = 2
SEQ = "__propose_cost__"


@dataclass(frozen=True)
class ProposeCurves:
    """(forward rows: appended + block, seconds) ascending; () = not measured."""
    chains: tuple[tuple[int, float], ...] = ()
    trees: tuple[tuple[int, float], ...] = ()


async def calibrate(engine: DraftEngine, drafter: Drafter) -> ProposeCurves:
    try:
        curves = await _measure(engine, drafter)
    except Exception:                   # start-up goes on without a curve
        log.exception("propose cost calibration failed; the gateway will time Proposes itself")
        return ProposeCurves()
    finally:
        await engine.release(SEQ)
    log.info("propose cost curve", extra={
        "chains_ms": " ".join(f"{a}:{s * 1e3:.2f}" for a, s in curves.chains),
        "trees_ms": " ".join(f"{a}:{s * 1e3:.2f}" for a, s in curves.trees)})
    return curves


async def _measure(engine: DraftEngine, drafter: Drafter) -> ProposeCurves:
    f = drafter.facts
    block = max(2, min(f.block_size, f.max_block_size))
    trees = min(TREE_NODES, f.max_tree_nodes)
    shapes = [(a, 0) for a in APPENDED] + ([(a, trees) for a in APPENDED[:3]] if trees else [])
    best: dict[tuple[int, int], float] = {}
    context = 0
    context = await _propose(engine, f, context, CONTEXT, block, 0)      # untimed: the prompt
    for _ in range(PASSES):
        for appended, nodes in shapes:
            t0 = time.perf_counter()
            context = await _propose(engine, f, context, appended, block, nodes)
            seconds = time.perf_counter() - t0
            key = (appended, nodes)
            best[key] = min(best.get(key, seconds), seconds)
    return ProposeCurves(
        chains=tuple((a + block, best[(a, 0)]) for a in APPENDED),
        trees=tuple((a + block, best[(a, n)]) for a, n in best if n))


async def _propose(engine: DraftEngine, facts, context: int, rows: int, block: int,
                   nodes: int) -> int:
    """Appends `rows` context rows (zero features, token 0) and proposes; the new length."""
    features = (torch.zeros(rows, facts.feature_width, dtype=getattr(torch, facts.feature_dtype))
                if facts.needs_features else None)
    await engine.propose(ProposeCall(SEQ, context, rows, features, [0] * rows, 0, block, nodes))
    return context + rows
