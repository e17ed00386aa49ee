"""FlashInfer's paged prefill wrapper as a dense target's flashinfer backend, eager and replayed
from CUDA graphs, against the torch backend (GPU with flashinfer-python only; skipped elsewhere)."""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("flashinfer")
if not torch.cuda.is_available():
    pytest.skip("FlashInfer needs CUDA", allow_module_level=True)

from support.mla_worker import verify_rounds
from support.tiny_models import make_tiny

from services.target.config import TargetConfig
from services.target.worker import TargetWorker


def _worker(path, **config) -> TargetWorker:
    w = TargetWorker(TargetConfig(str(path), device="cuda", dtype="bfloat16", page_size=16,
                                  kv_budget_bytes=16 << 20, **config))
    w.alloc_memory_pools()
    w.init_attention_backends()
    w.capture_cuda_graphs()
    return w


def test_a_dense_target_on_flashinfer_replays_its_verifies_from_cuda_graphs(tmp_path):
    """Verify blocks of 16 and decode steps of three sequences (a bucket of four) and of one:
    on the flashinfer backend eagerly and from graphs (its prefill wrappers in FlashInfer's
    cuda-graph mode, planned before each replay), both within bf16 tolerance of the torch
    backend."""
    path = make_tiny(tmp_path / "qwen3", "qwen3", head_dim=64, hidden_size=256,
                     num_attention_heads=4, num_key_value_heads=2)
    runs = {(name, graphs): verify_rounds(_worker(path, attention_backend=name,
                                                  cuda_graphs=graphs))
            for name, graphs in [("torch", False), ("flashinfer", False), ("flashinfer", True)]}
    assert runs[("flashinfer", False)][1] == [False] * 3
    assert runs[("flashinfer", True)][1] == [True] * 3
    reference = runs[("torch", False)][0]
    for key in [("flashinfer", False), ("flashinfer", True)]:
        assert (runs[key][0] - reference).abs().max().item() < 5e-2, key
