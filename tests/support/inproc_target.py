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
from services.target.config import TargetConfig
from services.target.engine import TargetEngine
from services.target.worker import TargetWorker


def loaded_worker(model_dir: str | Path, **config: Any) -> TargetWorker:
    """A worker past start-up stages 1-3 (weights, pools, backends). Small pages by default, so
    short sequences already span several pages."""
    config = {"page_size": 4, "kv_budget_bytes": 8 << 20, **config}
    worker = TargetWorker(TargetConfig(model_dir=str(model_dir), **config))
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


def run(coro: Coroutine) -> Any:
    """Awaits one engine call from synchronous test code."""
    return asyncio.run(coro)


def started_engine(worker: TargetWorker) -> TargetEngine:
    engine = TargetEngine(worker)
    engine.start()
    return engine
