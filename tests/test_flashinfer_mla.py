"""FlashInfer's MLA wrapper as our flashinfer backend's latent path, against the torch backend
(GPU with flashinfer-python only; skipped elsewhere): it reads our latent pages in place."""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("flashinfer")
if not torch.cuda.is_available():
    pytest.skip("FlashInfer needs CUDA", allow_module_level=True)

from support.mla_worker import mla_worker_logits, verify_rounds

from runtime.attention.flashinfer_backend import FlashInferAttentionBackend
from runtime.attention.metadata import AttentionMetadata, SeqSlice
from runtime.attention.torch_backend import TorchAttentionBackend
from runtime.kv_cache import PagedKVCache, PageTable


@pytest.mark.parametrize("nh,lat,rope", [(16, 512, 64), (128, 512, 64)])
def test_flashinfer_mla_matches_torch(nh, lat, rope):
    g = torch.Generator().manual_seed(0)
    specs = [(13, 4), (0, 7), (21, 1), (5, 16), (300, 9)]
    page = 16
    pages = sum(-(-(p + q) // page) for p, q in specs) + 2
    cache = PagedKVCache(2, 1, lat + rope, page, pages, torch.bfloat16, "cuda",
                         latent_value_dim=lat)
    n = cache.k.shape[1]
    key = torch.randn(n, 1, lat + rope, generator=g).cuda()
    cache.write(1, torch.arange(n, device="cuda"), key[..., :lat], key[..., lat:])
    tables = []
    for p, q in specs:
        t = PageTable()
        cache.ensure(t, p + q)
        tables.append(t)
    meta = AttentionMetadata.build([SeqSlice(t, p, q) for t, (p, q) in zip(tables, specs)],
                                   cache, device="cuda")
    q = torch.randn(meta.num_tokens, nh, lat + rope, generator=g).to(torch.bfloat16).cuda()
    k = torch.randn(meta.num_tokens, 1, lat + rope, generator=g).to(torch.bfloat16).cuda()
    outs = []
    for cls in (TorchAttentionBackend, FlashInferAttentionBackend):
        backend = cls(cache, nh, 1, lat + rope, 0.07)
        backend.prepare(meta)
        outs.append(backend.forward(1, q, k[..., :lat], k[..., lat:]).float().cpu())
    assert outs[1].shape == (meta.num_tokens, nh, lat)
    assert (outs[0] - outs[1]).abs().max().item() < 3e-2


def test_flashinfer_mla_in_the_target_worker(tmp_path):
    """A tiny DeepSeek-V3 through the worker with each backend; a verified tree runs on the
    triton fallback over the same pages."""
    from dflash.prepare.tiny_mla import make_tiny_mla
    path = make_tiny_mla(tmp_path / "mla", 3, kv_lora_rank=512, qk_rope_head_dim=64)
    logits = []
    for name in ("torch", "flashinfer"):
        out, w = mla_worker_logits(path, "cuda", attention_backend=name, dtype="bfloat16",
                                   page_size=16)
        logits.append(out)
        assert w._tree_backend.name == ("triton" if name == "flashinfer" else "torch")
    assert (logits[0] - logits[1]).abs().max().item() < 5e-2


def test_flashinfer_mla_replayed_from_cuda_graphs_matches_its_eager_forward(tmp_path):
    """The flashinfer MLA path under CUDA graphs (FlashInfer's cuda-graph mode, planned on the
    host before each replay): one sequence's chunk, verify block and decode step replay to the
    eager forward's bits (the same plan); a batch of three padded to a bucket of four (another
    plan: its work is split over the SMs differently) within bf16 tolerance, over several
    replays of different shapes in turn."""
    from dflash.prepare.tiny_mla import make_tiny_mla
    path = make_tiny_mla(tmp_path / "mla", 3, kv_lora_rank=512, qk_rope_head_dim=64)
    config = {"attention_backend": "flashinfer", "dtype": "bfloat16", "page_size": 16}
    eager, we = mla_worker_logits(path, "cuda", cuda_graphs=False, **config)
    graphs, wg = mla_worker_logits(path, "cuda", **config)
    assert not we._graphs and {q for q, _ in wg._graphs} == {1, 16}
    assert torch.equal(eager, graphs)
    eager, replayed_e = verify_rounds(we)
    graphs, replayed_g = verify_rounds(wg)
    assert replayed_e == [False] * 3 and replayed_g == [True] * 3
    assert (eager - graphs).abs().max().item() < 5e-2
