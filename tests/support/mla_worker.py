"""A tiny DeepSeek target worker run through a prompt chunk, a verify block and a decode step
(the MLA backend tests: tests/test_triton_attention.py, tests/test_flashinfer_mla.py), and any
target worker through rounds of batched verifies (the CUDA graph tests of the flashinfer
backend)."""
from __future__ import annotations

import torch

from runtime.attention.metadata import SeqSlice
from runtime.kv_cache import PageTable


def mla_worker_logits(path, device: str, **config) -> tuple[torch.Tensor, object]:
    """The worker for the checkpoint at `path` started through every stage (graphs captured
    where they can be) -> (fp32 logits of a prompt chunk of 24, a verify block of 16 and a
    decode step, on the CPU; the worker). config: TargetConfig fields (page_size default 4)."""
    from services.target.config import TargetConfig
    from services.target.worker import TargetWorker
    config.setdefault("page_size", 4)
    w = TargetWorker(TargetConfig(str(path), kv_budget_bytes=4 << 20, device=device, **config))
    w.alloc_memory_pools()
    w.init_attention_backends()
    w.capture_cuda_graphs()
    t = PageTable()
    w.kv_cache.ensure(t, 41)
    ids = torch.arange(3, 44)
    outs = [w.forward([SeqSlice(t, lo, n)], ids[lo:lo + n], torch.arange(lo, lo + n), ())
            for lo, n in [(0, 24), (24, 16), (40, 1)]]
    return torch.cat([w.logits(o.hidden) for o in outs]).float().cpu(), w


def verify_rounds(w) -> tuple[torch.Tensor, list[bool]]:
    """Three sequences prefilled eagerly (20, 45, 70 tokens), then verify blocks of 16 for all
    three (a bucket of 4: one dummy), a decode step for all three and a verify block of 16 for
    the first alone -> (their logits in order, fp32 on the CPU; whether each round matched a
    captured graph)."""
    lens, tables, logits, replayed = [20, 45, 70], [], [], []
    for n in lens:
        t = PageTable()
        w.kv_cache.ensure(t, n + 33)
        w.forward([SeqSlice(t, 0, n)], torch.arange(3, 3 + n), torch.arange(n), ())
        tables.append(t)
    for q, rows in [(16, [0, 1, 2]), (1, [0, 1, 2]), (16, [0])]:
        slices = [SeqSlice(tables[i], lens[i], q) for i in rows]
        ids = torch.cat([torch.arange(5 + i, 5 + i + q) for i in rows])
        pos = torch.cat([torch.arange(lens[i], lens[i] + q) for i in rows])
        replayed.append(w._graph_for(slices, (), w._graphs) is not None)
        logits.append(w.logits(w.forward(slices, ids, pos, ()).hidden).float().cpu())
        for i in rows:
            lens[i] += q
    return torch.cat(logits), replayed
