"""The verify cost curve measured at warm-up, for the gateway's `--speculation auto`
(gateway/speculation_policy.py): how long a verify forward takes by the batch's total tokens.

Each size runs through the engine as the service will run it (the scheduler, the batch plan,
the forward, acceptance, the commit): one sequence verifies a block of T tokens up to the
largest chain block (chain_block: the largest captured graph's on a GPU), and T / that block
sequences verify full blocks together above it. Two passes,
up the sizes and (after the trees) back down, and a point is the faster of its two forwards
(the second pass as far as the budget allows; on a GPU the up pass runs each size once
untimed first, as a shape's first run compiles kernels or replays a graph the first time):
start-up is when
the other processes of a stack load too, and contention that slows one pass rarely slows the
same size in the other. Times come from the forward's own timing (the engine reports it with
every verify: VerifyResult.batch_tokens / batch_seconds), so verifies the loop happened to
split into two batches still give true points. Sizes stop at the budget (the calibration is
part of start-up: readiness waits for it) and at what the engine can hold. A CPU's GEMM path
changes with the row count (runtime/layers/gemm_calibration.py), hence the small sizes one by
one.

Trees get their own points (`TREE_SIZES` drafts, one sequence, the faster of two): their
attention runs under an ancestor mask and, on CUDA, only some tree sizes have graphs.

A calibration that fails (a kernel error, pools too small) is logged and leaves the curve
empty; the service still starts, and the gateway falls back to fixed speculation."""
from __future__ import annotations

import asyncio
import logging
import time

import torch

from runtime.draft_tree import DraftTree
from runtime.sampling import SamplingConfig
from services.common import metrics
from services.target.calls import PrefillCall
from services.target.cost_curves import CostCurves, CostPoint
from services.target.engine import TargetEngine
from services.target.worker import TargetWorker

log = logging.getLogger("dflash.target.cost")

SIZES = (1, 2, 3, 4, 5, 6, 8, 12, 16, 24, 32, 64, 128, 256, 512)   # the gateway interpolates
                                                  # (and extrapolates linearly past the last one)
REPEATS = 2                             # forwards per size: one per pass
PROMPT = 4                              # tokens of each calibration sequence's context
TREE_SIZES = (7, 15, 63)                # the tree sizes the gateway's auto considers
UP_SHARE, TREE_SHARE = 0.5, 0.8         # of the budget: chains up until half is spent, trees
                                        # until 80 %, then chains down with the rest
PREFIX = "__cost__"
ROOM = 256                              # most positions a calibration sequence holds


def plan(worker: TargetWorker) -> list[tuple[int, int]]:
    """(sequences, block) per size: one sequence up to the largest block serving runs as one
    sequence's chain (chain_block), then full blocks of several; within the token budget, the
    KV pool and the context."""
    max_b = chain_block(worker)
    pages = worker.kv_cache.usable_pages * worker.config.page_size
    out = []
    for t in SIZES:
        seqs, block = (1, t) if t <= max_b else (-(-t // max_b), max_b)
        fits_pages = seqs * (ROOM + worker.config.page_size) <= pages
        if (seqs * block > worker.config.token_budget or not fits_pages
                or PROMPT + REPEATS * block > min(ROOM, worker.facts.max_context)):
            break
        if (seqs, block) not in out:             # 24 and 32 tokens: both two blocks of 16
            out.append((seqs, block))
    return out


async def calibrate(engine: TargetEngine, worker: TargetWorker, budget_s: float) -> CostCurves:
    """The curves; empty when off (budget 0) or when it failed (logged)."""
    if budget_s <= 0:
        return CostCurves()
    t0 = time.monotonic()
    points: dict[int, float] = {}
    tree_points: dict[int, float] = {}
    lengths: dict[str, int] = {}
    try:
        if worker.hooks.fail_cost_calibration:
            raise RuntimeError("verify forward failed (test hook fail_cost_calibration)")
        done: list[tuple[int, int]] = []
        for seqs, block in plan(worker):                            # up
            if time.monotonic() - t0 + REPEATS * _estimate(points, seqs * block) > \
                    UP_SHARE * budget_s:
                break
            await _measure(engine, worker, seqs, block, points, lengths, first=True)
            done.append((seqs, block))
        for n in (n for n in TREE_SIZES if n <= worker.max_tree_nodes):      # trees
            if time.monotonic() - t0 + REPEATS * _estimate(points, n + 1) > \
                    TREE_SHARE * budget_s:
                break
            await _measure_tree(engine, worker, n, tree_points, lengths)
        for seqs, block in reversed(done):                          # and chains down
            if time.monotonic() - t0 + _estimate(points, seqs * block) > budget_s:
                break
            await _measure(engine, worker, seqs, block, points, lengths)
    except Exception as e:  # noqa: BLE001 - a kernel error must not keep the service from starting
        log.warning("verify cost calibration failed (%s: %s); the gateway's --speculation auto "
                    "falls back to fixed speculation", type(e).__name__, e)
        return CostCurves()
    finally:
        await asyncio.gather(*(engine.release(f"{PREFIX}{i}") for i in range(_most(worker))))
    curves = CostCurves(*(tuple(CostPoint(t, s) for t, s in sorted(p.items()))
                          for p in (points, tree_points)))
    _export(curves.chains)
    log.info("verify cost calibrated", extra={
        "seconds": round(time.monotonic() - t0, 2),
        "chains_ms": " ".join(f"{p.tokens}:{p.seconds * 1e3:.2f}" for p in curves.chains),
        "trees_ms": " ".join(f"{p.tokens}:{p.seconds * 1e3:.2f}" for p in curves.trees)})
    return curves


async def _measure(engine: TargetEngine, worker: TargetWorker, seqs: int, block: int,
                   points: dict[int, float], lengths: dict[str, int], first: bool = False
                   ) -> None:
    """A verify of `seqs` sequences x `block` tokens, submitted together. first (the up pass)
    on a GPU: one untimed verify before it - a shape's first run there (a kernel's compilation,
    a graph's first replay) is not what it costs."""
    ids = [f"{PREFIX}{i}" for i in range(seqs)]
    if first and worker.device.type == "cuda":
        await _verify(engine, worker, ids, block, None, {}, lengths)
    await _verify(engine, worker, ids, block, None, points, lengths)


async def _measure_tree(engine: TargetEngine, worker: TargetWorker, n: int,
                        points: dict[int, float], lengths: dict[str, int]) -> None:
    """REPEATS tree verifies of n drafts (a binary heap: node r's parent is (r - 1) // 2) on
    the first calibration sequence."""
    bos = worker.facts.bos_token_id
    tree = DraftTree([bos] * n, [(r - 1) // 2 for r in range(1, n + 1)])
    for _ in range(REPEATS):
        await _verify(engine, worker, [f"{PREFIX}0"], n + 1, tree, points, lengths)


async def _verify(engine: TargetEngine, worker: TargetWorker, ids: list[str], block: int,
                  tree: DraftTree | None, points: dict[int, float], lengths: dict[str, int]
                  ) -> None:
    """One verify of `block` tokens (a chain, or `tree`'s anchor + nodes) per sequence of ids,
    submitted together; each forward's time kept in points[batch tokens] when it is the
    fastest so far. lengths: the calibration sequences' committed lengths; a new one, or one
    without room for the block, is prefilled first (a Prefill replaces the one of its id)."""
    bos = worker.facts.bos_token_id
    room = min(worker.facts.max_context, ROOM)
    fresh = [i for i in ids if lengths.get(i, room) + block > room]
    await asyncio.gather(*(engine.prefill(PrefillCall(i, [bos] * PROMPT, SamplingConfig(), (),
                                                      torch.bfloat16)) for i in fresh))
    lengths.update({i: PROMPT for i in fresh})
    results = await asyncio.gather(*(engine.verify(i, [bos] * block, tree) for i in ids))
    for i, r in zip(ids, results):
        lengths[i] = r.seq_len
        if r.batch_tokens:
            points[r.batch_tokens] = min(points.get(r.batch_tokens, float("inf")),
                                         r.batch_seconds)


def chain_block(worker: TargetWorker) -> int:
    """The longest chain block a sequence verifies as serving runs it: with captured graphs,
    their largest chain size (a DFlash chain is at most the draft's block; the target pads
    shorter ones to a captured size, and a batch of several sequences runs as one graph), else
    --max-block-size. Calibrating 24 or 32 tokens as one sequence's block on a GPU timed an
    eager forward (11.8 ms for SmolLM2 on an H100, against 1.4 ms for the 16 of a graph) that
    serving never runs for a chain, and priced every batch of two drafting requests by it:
    auto stopped drafting at 2 requests and more."""
    blocks = [b for b in worker.padded_blocks if b > 1]     # graphs of chains, not decode's
    return min(max(blocks, default=worker.config.max_block_size), worker.config.max_block_size)


def _estimate(points: dict[int, float], tokens: int) -> float:
    """What one forward of `tokens` will take: as measured, else the largest measured point's
    time, growing with the tokens past 16 (a forward of a few rows costs about one of one row;
    0 before the first)."""
    if tokens in points or not points:
        return points.get(tokens, 0.0)
    last = max(points)
    return points[last] * max(1.0, tokens / max(last, 16))


def _most(worker: TargetWorker) -> int:
    return max((s for s, _ in plan(worker)), default=1)


def _export(curve: tuple[CostPoint, ...]) -> None:
    lb = metrics.labels()
    for p in curve:
        metrics.VERIFY_COST.labels(lb.model_name, lb.service, str(p.tokens)).set(p.seconds)
