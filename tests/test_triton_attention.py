"""The Triton paged-attention kernel against the torch (SDPA) reference backend. On the CPU it
runs through Triton's interpreter (TRITON_INTERPRET=1, set in conftest); on a GPU, natively."""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from support.mla_worker import mla_worker_logits

from runtime.attention.metadata import AttentionMetadata, SeqSlice
from runtime.attention.torch_backend import TorchAttentionBackend
from runtime.attention.triton_backend import TritonAttentionBackend
from runtime.kv_cache import PagedKVCache, PageTable

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _batch(cache: PagedKVCache, specs, trees=None, causal: bool = True) -> AttentionMetadata:
    """specs: [(prefix_len, q_len)] per sequence, each given fresh pages; trees: per sequence
    a tree mask or None. The forward's metadata."""
    trees = trees or [None] * len(specs)
    tables = []
    for p, q in specs:
        t = PageTable()
        cache.ensure(t, p + q)
        tables.append(t)
    return AttentionMetadata.build(
        [SeqSlice(t, p, q, tree) for t, (p, q), tree in zip(tables, specs, trees)], cache,
        causal=causal, device=DEVICE)


def _torch_and_triton(cache: PagedKVCache, meta: AttentionMetadata, nh: int, nkv: int, hd: int,
                      scale: float, layer: int, q, k, v) -> list[torch.Tensor]:
    """The same forward of both backends over one cache (fp32 on the host)."""
    outs = []
    for cls in (TorchAttentionBackend, TritonAttentionBackend):
        backend = cls(cache, nh, nkv, hd, scale)
        backend.prepare(meta)
        outs.append(backend.forward(layer, q, k, v).float().cpu())
    return outs


def _run_both(specs, nh, nkv, hd, page, causal, window, dtype=torch.float32, seed=0, trees=None):
    """specs: [(prefix_len, q_len)] per sequence; trees: per sequence a tree mask or None.
    Returns (torch_out, triton_out, cache_equal)."""
    g = torch.Generator().manual_seed(seed)
    pages = sum(-(-(p + q) // page) for p, q in specs) + 2
    outs, caches = [], []
    for cls in (TorchAttentionBackend, TritonAttentionBackend):
        cache = PagedKVCache(1, nkv, hd, page, pages, dtype, DEVICE)
        cache.k.copy_(torch.randn(cache.k.shape, generator=g).to(dtype))
        cache.v.copy_(torch.randn(cache.v.shape, generator=g).to(dtype))
        meta = _batch(cache, specs, trees, causal)
        n = meta.num_tokens
        q = torch.randn(n, nh, hd, generator=g).to(dtype).to(DEVICE)
        k = torch.randn(n, nkv, hd, generator=g).to(dtype).to(DEVICE)
        v = torch.randn(n, nkv, hd, generator=g).to(dtype).to(DEVICE)
        backend = cls(cache, nh, nkv, hd, hd ** -0.5)
        backend.prepare(meta)
        outs.append(backend.forward(0, q, k, v, window=window).float().cpu())
        caches.append(cache)
        g = torch.Generator().manual_seed(seed)          # same inputs for the second backend
    return outs[0], outs[1], torch.equal(caches[0].k, caches[1].k)


@pytest.mark.parametrize("causal,window", [(True, None), (False, None), (True, 5)])
@pytest.mark.parametrize("nh,nkv", [(4, 4), (4, 2), (8, 2)])
def test_mixed_batch_matches_torch(causal, window, nh, nkv):
    # verify blocks, a decode step, a prefill chunk after a prefix, a fresh prompt
    specs = [(13, 4), (0, 7), (21, 1), (5, 16), (40, 9)]
    ref, tri, same_cache = _run_both(specs, nh, nkv, 32, 8, causal, window)
    assert same_cache
    assert (ref - tri).abs().max().item() < 1e-4


def random_tree_mask(n: int, seed: int) -> torch.Tensor:
    """The ancestor mask of a random tree of n - 1 drafts under an anchor."""
    import random

    from runtime.draft_tree import DraftTree
    rng = random.Random(seed)
    return DraftTree([0] * (n - 1), [rng.randrange(i + 1) for i in range(n - 1)]).ancestor_mask()


@pytest.mark.parametrize("nh,nkv", [(4, 4), (8, 2)])
def test_tree_masks_match_torch(nh, nkv):
    """Sequences verifying trees of drafts (one wider than 32 nodes: two mask words) batched with
    a chain, a decode step and a prefill chunk."""
    specs = [(13, 8), (0, 7), (21, 1), (5, 40), (9, 16)]
    trees = [random_tree_mask(8, 1), None, None, random_tree_mask(40, 2), random_tree_mask(16, 3)]
    ref, tri, same_cache = _run_both(specs, nh, nkv, 32, 8, True, None, trees=trees)
    assert same_cache
    assert (ref - tri).abs().max().item() < 1e-4
    chain, _, _ = _run_both(specs, nh, nkv, 32, 8, True, None)
    assert (chain - ref).abs().max().item() > 1e-3           # the masks did change the result


def test_pages_cross_blocks_and_long_prefix():
    ref, tri, _ = _run_both([(70, 16), (3, 16)], 4, 2, 64, 4, True, None, seed=3)
    assert (ref - tri).abs().max().item() < 1e-4


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_close_to_reference(dtype):
    if DEVICE == "cpu" and dtype == torch.bfloat16:
        pytest.skip("Triton's interpreter has no bfloat16 arithmetic (numpy); checked on the GPU")
    ref, tri, _ = _run_both([(30, 8), (0, 12)], 4, 2, 32, 8, True, None, dtype=dtype)
    assert (ref - tri).abs().max().item() < 3e-2


def test_triton_backend_in_the_target_worker_matches_torch(tiny_llama_dir):
    """Whole model, prefill + verify, through the worker with each backend: same logits."""
    from services.target.config import TargetConfig
    from services.target.worker import TargetWorker
    logits = []
    for name in ("torch", "triton"):
        w = TargetWorker(TargetConfig(str(tiny_llama_dir), attention_backend=name,
                                      kv_budget_bytes=4 << 20, page_size=4, device=DEVICE))
        w.alloc_memory_pools()
        w.init_attention_backends()
        t = PageTable()
        w.kv_cache.ensure(t, 24)
        ids = torch.arange(3, 27)
        out = w.forward([SeqSlice(t, 0, 16)], ids[:16], torch.arange(16), ())
        out2 = w.forward([SeqSlice(t, 16, 8)], ids[16:], torch.arange(16, 24), ())
        logits.append(torch.cat([w.logits(out.hidden), w.logits(out2.hidden)]).cpu())
    assert (logits[0] - logits[1]).abs().max().item() < 1e-4


def _run_latent(specs, nh, lat, rope, page, dtype, trees=None, seed=0):
    """MLA: a latent cache (a key's latent and rope parts in the two pools, the values its
    latent), both backends over the
    same cache; fp8 caches with different per-layer scales. Returns (torch_out, triton_out)."""
    g = torch.Generator().manual_seed(seed)
    pages = sum(-(-(p + q) // page) for p, q in specs) + 2
    cache = PagedKVCache(2, 1, lat + rope, page, pages, dtype, DEVICE, latent_value_dim=lat)
    if dtype == torch.float8_e4m3fn:
        cache.scales = type(cache.scales)((0.5, 2.0), (1.0, 1.0))
    n_slots = cache.k.shape[1]
    for layer in (0, 1):
        key = torch.randn(n_slots, 1, lat + rope, generator=g).to(DEVICE)
        cache.write(layer, torch.arange(n_slots, device=DEVICE), key[..., :lat], key[..., lat:])
    meta = _batch(cache, specs, trees)
    compute = torch.float32 if dtype in (torch.float32, torch.float8_e4m3fn) else dtype
    q = torch.randn(meta.num_tokens, nh, lat + rope, generator=g).to(compute).to(DEVICE)
    k = torch.randn(meta.num_tokens, 1, lat + rope, generator=g).to(compute).to(DEVICE)
    return tuple(_torch_and_triton(cache, meta, nh, 1, lat + rope, 0.1, 1, q, k[..., :lat],
                                   k[..., lat:]))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float8_e4m3fn, torch.bfloat16])
@pytest.mark.parametrize("nh,lat,rope", [(4, 32, 8), (4, 24, 12), (16, 512, 64)])
def test_latent_mla_matches_torch(dtype, nh, lat, rope):
    """Decode steps, verify blocks and prefill chunks over a latent (MLA) cache; fp8 pages with
    per-layer scales folded into the kernel."""
    if DEVICE == "cpu" and dtype == torch.bfloat16:
        pytest.skip("Triton's interpreter has no bfloat16 arithmetic (numpy); checked on the GPU")
    specs = [(13, 4), (0, 7), (21, 1), (5, 16), (40, 9)]
    if dtype == torch.float8_e4m3fn and lat % 16:
        with pytest.raises(ValueError, match="multiple of 16"):     # misaligned fp8 rows
            _run_latent(specs, nh, lat, rope, 16, dtype)
        return
    ref, tri = _run_latent(specs, nh, lat, rope, 16, dtype)
    assert ref.shape == tri.shape == (37, nh, lat)
    tol = 2e-2 if dtype == torch.bfloat16 else 1e-4
    assert (ref - tri).abs().max().item() < tol


def test_latent_mla_trees_match_torch():
    specs = [(11, 8), (3, 5)]
    trees = [random_tree_mask(8, 1), random_tree_mask(5, 2)]
    ref, tri = _run_latent(specs, 4, 32, 8, 4, torch.float32, trees)
    assert (ref - tri).abs().max().item() < 1e-4


def test_fp8_dense_cache_matches_torch():
    """A dense (Llama-style) fp8 cache: pages read as the queries' dtype, scales folded in."""
    specs = [(13, 4), (0, 7), (21, 1)]
    g = torch.Generator().manual_seed(0)
    cache = PagedKVCache(1, 2, 32, 8, 12, torch.float8_e4m3fn, DEVICE)
    cache.scales = type(cache.scales)((0.5,), (2.0,))
    n_slots = cache.k.shape[1]
    cache.write(0, torch.arange(n_slots, device=DEVICE), torch.randn(n_slots, 2, 32, generator=g)
                .to(DEVICE), torch.randn(n_slots, 2, 32, generator=g).to(DEVICE))
    meta = _batch(cache, specs)
    q = torch.randn(meta.num_tokens, 4, 32, generator=g).to(DEVICE)
    k = torch.randn(meta.num_tokens, 2, 32, generator=g).to(DEVICE)
    ref, tri = _torch_and_triton(cache, meta, 4, 2, 32, 32 ** -0.5, 0, q, k, k)
    assert (ref - tri).abs().max().item() < 1e-4


@pytest.mark.parametrize("kv", ["auto", "fp8_e4m3"])
@pytest.mark.parametrize("moe", [True, False])
def test_triton_mla_in_the_target_worker_matches_torch(tmp_path, kv, moe):
    """A tiny DeepSeek-V3 through the worker with each backend (on a GPU without MoE layers:
    triton's verify blocks of 16 and decode steps replayed from CUDA graphs): same logits. In
    fp32 a MoE model runs eagerly (torch's grouped GEMM copies its offsets to the host); in bf16
    it is captured (next test)."""
    from dflash.prepare.tiny_mla import make_tiny_mla
    path = make_tiny_mla(tmp_path / "mla", 3, first_k_dense_replace=1 if moe else 3)
    logits = []
    for name in ("torch", "triton"):
        out, w = mla_worker_logits(path, DEVICE, attention_backend=name, kv_cache_dtype=kv)
        logits.append(out)
        assert bool(w._graphs) == (name == "triton" and DEVICE == "cuda" and not moe)  # fp32
    assert (logits[0] - logits[1]).abs().max().item() < 1e-3


@pytest.mark.skipif(DEVICE != "cuda", reason="CUDA graphs")
def test_a_moe_model_replayed_from_cuda_graphs_in_bf16_equals_its_eager_forward(tmp_path):
    """A tiny DeepSeek-V3 with MoE layers in bf16: its prompt chunk, verify block of 16 and
    decode step replayed from graphs give the eager forward's logits bitwise (an H100, session
    41)."""
    from dflash.prepare.tiny_mla import make_tiny_mla
    path = make_tiny_mla(tmp_path / "mla", 3, first_k_dense_replace=1)
    logits = []
    for graphs in (True, False):
        out, w = mla_worker_logits(path, DEVICE, attention_backend="triton", dtype="bfloat16",
                                   cuda_graphs=graphs)
        logits.append(out)
        assert bool(w._graphs) == graphs and bool(w._prefill_graphs) == graphs
    assert torch.equal(logits[0], logits[1])
