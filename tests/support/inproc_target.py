"""The target's worker and engine run in the test process (no gRPC), for checks that need to
look inside: logits, KV cache contents, sampling draws."""
from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from pathlib import Path
from typing import Any

import torch

from runtime.attention.metadata import SeqSlice
from runtime.kv_cache import PageTable
from runtime.sampling import SamplingConfig
from services.target.config import TargetConfig
from services.target.engine import PrefillCall, TargetEngine
from services.target.hooks import NO_TARGET_HOOKS, TargetHooks
from services.target.worker import TargetWorker
from support.gateway_stack import wait_until


def loaded_worker(model_dir: str | Path, hooks: TargetHooks = NO_TARGET_HOOKS,
                  **config: Any) -> TargetWorker:
    """A worker past start-up stages 1-3 (weights, pools, backends). Small pages by default, so
    short sequences already span several pages."""
    config = {"page_size": 4, "kv_budget_bytes": 8 << 20, **config}
    worker = TargetWorker(TargetConfig(model_dir=str(model_dir), **config), hooks)
    worker.alloc_memory_pools()
    worker.init_attention_backends()
    return worker


def batch_logits(worker: TargetWorker, parts: list[tuple[PageTable, int, list[int]]]
                 ) -> list[torch.Tensor]:
    """One forward over several sequences: part = (table, start position, new tokens).
    Returns fp32 logits [len(tokens), V] per part."""
    slices, ids, positions = [], [], []
    for table, start, tokens in parts:
        worker.kv_cache.ensure(table, start + len(tokens))
        slices.append(SeqSlice(table, start, len(tokens)))
        ids.extend(tokens)
        positions.extend(range(start, start + len(tokens)))
    out = worker.forward(slices, torch.tensor(ids), torch.tensor(positions), ())
    logits = worker.logits(out.hidden)
    return list(logits.split([len(t) for _, _, t in parts]))


def chunked_logits(worker: TargetWorker, ids: list[int], chunks: list[int]) -> torch.Tensor:
    """Logits [len(ids), V] of one sequence fed in chunks through the paged cache (then freed)."""
    assert sum(chunks) == len(ids)
    table, out, pos = PageTable(), [], 0
    for n in chunks:
        out.append(batch_logits(worker, [(table, pos, ids[pos: pos + n])])[0])
        pos += n
    worker.kv_cache.release(table)
    return torch.cat(out)


def greedy_then_prefill(engine: TargetEngine, prompt: list[int], n: int, seqs: tuple[str, ...]
                        ) -> list[int]:
    """The prompt's first n greedy tokens, one Verify each (a sequence "ref"), then a fresh
    Prefill of the prompt for each of `seqs` (greedy, no features)."""
    g = [run(engine.prefill(PrefillCall("ref", prompt, SamplingConfig(), (), torch.float32)))
         .next_token]
    while len(g) < n:
        g += run(engine.verify("ref", [g[-1]])).committed
    for seq in seqs:
        run(engine.prefill(PrefillCall(seq, prompt, SamplingConfig(), (), torch.float32)))
    return g


def assert_same_continuation(worker: TargetWorker, a, b, n: int, last: int, expected: int
                             ) -> None:
    """Target sequences a and b (TargetSequence) both hold n committed positions with the same
    K/V (within fp32 rounding), no pages past them, and after the token `last` both predict the
    same logits, whose argmax is `expected`."""
    assert a.seq_len == b.seq_len == n
    cache = worker.kv_cache
    assert len(a.table.pages) == cache.pages_for(n)        # rejected pages went back
    sa, sb = cache.slots(a.table, 0, n), cache.slots(b.table, 0, n)
    assert (cache.k[:, sa] - cache.k[:, sb]).abs().max() <= 1e-5
    assert (cache.v[:, sa] - cache.v[:, sb]).abs().max() <= 1e-5
    la, lb = batch_logits(worker, [(a.table, n, [last]), (b.table, n, [last])])
    assert (la - lb).abs().max() <= 1e-5
    assert int(la.argmax()) == expected


def run(coro: Coroutine) -> Any:
    """Awaits one engine call from synchronous test code."""
    return asyncio.run(coro)


def started_engine(worker: TargetWorker) -> TargetEngine:
    engine = TargetEngine(worker)
    engine.start()
    return engine


async def in_one_batch(engine: TargetEngine, coros, return_exceptions: bool = False) -> list:
    """The engine works of `coros`, all in one batch: the engine thread is held while they are
    queued. Returns their results (or exceptions, with return_exceptions)."""
    import threading
    gate, running = threading.Event(), threading.Event()
    engine.loop.call(lambda: (running.set(), gate.wait(10)))
    await asyncio.to_thread(running.wait, 10)
    tasks = [asyncio.ensure_future(c) for c in coros]
    # every work queued behind the held call (not a fixed sleep: a loaded host may be slower)
    await asyncio.to_thread(wait_until, lambda: engine.loop.waiting == len(tasks), 10, 0.005,
                            f"{len(tasks)} works waiting")
    gate.set()
    return await asyncio.gather(*tasks, return_exceptions=return_exceptions)
