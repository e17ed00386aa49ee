"""A tiny DeepSeek target worker run through a prompt chunk, a verify block and a decode step
(the MLA backend tests: tests/test_triton_attention.py, tests/test_flashinfer_mla.py)."""
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
