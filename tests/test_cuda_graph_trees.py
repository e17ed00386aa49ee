"""CUDA only (skipped elsewhere): a tree verify replayed from a captured tree graph gives the
logits of the same tree run eagerly, batched with a chain and padded to a bucket."""
from __future__ import annotations

import pytest
import torch

from runtime.attention.metadata import SeqSlice
from runtime.draft_tree import DraftTree
from runtime.kv_cache import PageTable
from services.target.config import TargetConfig
from services.target.worker import TargetWorker

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def _worker(model_dir, graphs: bool) -> TargetWorker:
    w = TargetWorker(TargetConfig(str(model_dir), device="cuda", attention_backend="triton",
                                  kv_budget_bytes=8 << 20, page_size=4, cuda_graphs=graphs,
                                  graph_block_sizes=(1,), graph_tree_sizes=(8,)))
    w.alloc_memory_pools()
    w.init_attention_backends()
    w.capture_cuda_graphs()
    return w


def test_tree_graph_equals_eager(tiny_llama_dir):
    tree = DraftTree([5, 6, 7, 8, 9, 10, 11], [0, 0, 1, 1, 3, 2, 6])
    chain = DraftTree.chain([12, 13, 14, 15, 16, 17, 18])
    logits = []
    for graphs in (True, False):
        w = _worker(tiny_llama_dir, graphs)
        tables = [PageTable(), PageTable(), PageTable()]
        prompts = [list(range(3, 20)), list(range(30, 41)), list(range(50, 55))]
        for t, p in zip(tables, prompts):
            w.kv_cache.ensure(t, len(p) + 8)
            w.forward([SeqSlice(t, 0, len(p))], torch.tensor(p), torch.arange(len(p)), ())
        slices, ids, pos = [], [], []
        for t, p, d in zip(tables, prompts, (tree, chain, tree)):
            mask = d.ancestor_mask() if d is tree else None
            slices.append(SeqSlice(t, len(p), 8, mask))
            ids += [p[-1]] + d.tokens
            pos += [len(p) + x for x in d.depths]
        if graphs:
            assert w._graph_for(slices, (), w._tree_graphs) is not None
        out = w.forward(slices, torch.tensor(ids), torch.tensor(pos), ())
        logits.append(w.logits(out.hidden).float().cpu())
    assert (logits[0] - logits[1]).abs().max().item() < 1e-3
