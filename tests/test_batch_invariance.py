"""--deterministic (runtime/batch_invariance.py): a row's result is bitwise the same whether its
token is computed alone, in a verify block, or beside other sequences. On the CPU the Triton
kernels run through Triton's interpreter (TRITON_INTERPRET=1, set in conftest); on a GPU,
natively (where the property is what makes bf16 speculative output equal autoregressive)."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("triton")

from runtime import batch_invariance
from runtime.attention.metadata import SeqSlice
from runtime.kv_cache import PageTable
from runtime.layers.invariant_gemm import invariant_linear, tile_for
from services.target.config import TargetConfig
from services.target.worker import TargetWorker

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.fixture
def deterministic():
    batch_invariance.enable(True)
    yield
    batch_invariance.enable(False)


@pytest.mark.parametrize("n,k,bias", [(48, 40, False), (200, 72, True)])
def test_gemm_rows_are_the_same_alone_and_in_any_batch(n, k, bias):
    g = torch.Generator().manual_seed(0)
    w = torch.randn(n, k, generator=g).to(DEVICE)
    b = torch.randn(n, generator=g).to(DEVICE) if bias else None
    x = torch.randn(70, k, generator=g).to(DEVICE)
    full = invariant_linear(x, w, b)
    torch.testing.assert_close(full, F.linear(x, w, b), atol=1e-4, rtol=1e-4)
    for start, rows in [(0, 1), (5, 1), (3, 16), (10, 37), (64, 6)]:    # decode, block, batch
        assert torch.equal(invariant_linear(x[start:start + rows], w, b), full[start:start + rows])
    assert invariant_linear(x[:0], w, b).shape == (0, n)
    assert invariant_linear(x.view(7, 10, k), w, b).shape == (7, 10, n)     # any leading dims


@pytest.mark.parametrize("splits,tma", [(2, False), (3, False), (1, True), (2, True)])
def test_a_split_k_gemm_adds_its_parts_in_a_fixed_order(splits, tma):
    """(and the loads through TMA descriptors, the benchmark's candidates)"""
    from runtime.layers.invariant_gemm import launch
    g = torch.Generator().manual_seed(1)
    w = torch.randn(40, 200, generator=g).to(DEVICE)
    b = torch.randn(40, generator=g).to(DEVICE)
    x = torch.randn(33, 200, generator=g).to(DEVICE)
    tile = (16, 32, 32, 4, 2, splits, tma)             # K = 200 in parts of 96, 96, 8 / 64..

    def gemm(rows):
        y = torch.empty(rows.shape[0], 40, device=DEVICE)
        launch(rows.contiguous(), w, b, y, tile)
        return y
    full = gemm(x)
    torch.testing.assert_close(full, F.linear(x, w, b), atol=1e-4, rtol=1e-4)
    for start, rows in [(0, 1), (7, 1), (2, 16), (20, 13)]:
        assert torch.equal(gemm(x[start:start + rows]), full[start:start + rows])


def test_tile_follows_the_weight_and_on_a_gpu_the_batch_never_the_k_order():
    assert tile_for(49152, 576).bn >= tile_for(576, 576).bn   # wide weights: wider tiles
    # the interpreter (numpy's dot per tile): the weight's tile at every row count
    assert len({tile_for(576, 576, rows, gpu=False) for rows in (1, 16, 512, 4096)}) == 1
    # a GPU: wider tiles for batches of blocks, from one family (no K split: the same bits)
    small, big = tile_for(576, 576, 16), tile_for(576, 576, 512)
    assert big.bm > small.bm and small.splits == big.splits == 1


@pytest.mark.skipif(DEVICE != "cuda", reason="the GPU's tile families (MMA steps in K order)")
@pytest.mark.parametrize("n,k", [(6144, 4096), (3072, 576), (49152, 576)])
def test_bf16_rows_are_the_same_under_every_tile_a_row_count_picks(n, k):
    g = torch.Generator().manual_seed(2)
    w = (torch.randn(n, k, generator=g) * k ** -0.5).to(DEVICE, torch.bfloat16)
    x = torch.randn(600, k, generator=g).to(DEVICE, torch.bfloat16)
    full = invariant_linear(x, w)                                  # the big-batch tile
    assert tile_for(n, k, 600) != tile_for(n, k, 16)
    for start, rows in [(0, 1), (9, 16), (3, 64), (100, 127), (50, 300)]:
        assert torch.equal(invariant_linear(x[start:start + rows], w), full[start:start + rows])


def _worker(model_dir, dtype: str = "float32", graphs: bool = False) -> TargetWorker:
    """graphs (CUDA): verifies of 16 tokens and trees of 16 replay captured graphs."""
    w = TargetWorker(TargetConfig(str(model_dir), device=DEVICE, attention_backend="triton",
                                  dtype=dtype, kv_budget_bytes=4 << 20, page_size=4,
                                  cuda_graphs=graphs, graph_block_sizes=(1, 16),
                                  graph_tree_sizes=(16,), deterministic=True))
    w.alloc_memory_pools()
    w.init_attention_backends()
    w.capture_cuda_graphs()
    return w


def _logits(w: TargetWorker, batch: list[tuple[PageTable, list[int], int]],
            graphs: dict | None = None) -> list[torch.Tensor]:
    """One forward over several sequences, each (pages, its whole token list, tokens already
    in its cache): the new tokens' logits per sequence. graphs: the worker's captured graphs
    the forward must replay."""
    slices, ids, pos = [], [], []
    for table, tokens, cached in batch:
        w.kv_cache.ensure(table, len(tokens))
        slices.append(SeqSlice(table, cached, len(tokens) - cached))
        ids += tokens[cached:]
        pos += range(cached, len(tokens))
    if graphs is not None:
        assert w._graph_for(slices, (), graphs) is not None
    out = w.forward(slices, torch.tensor(ids, device=DEVICE),
                    torch.tensor(pos, device=DEVICE), ())
    logits = w.logits(out.hidden).float().cpu()
    sizes = [len(t) - c for _, t, c in batch]
    return list(logits.split(sizes))


# bf16 (the GPU's case) and CUDA graphs where a GPU runs it: the interpreter computes in
# numpy's dtypes
DTYPES = ["float32", "bfloat16"] if DEVICE == "cuda" else ["float32"]
GRAPHS = [False, True] if DEVICE == "cuda" else [False]


@pytest.mark.parametrize("graphs", GRAPHS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_a_tokens_logits_are_bitwise_equal_decoded_verified_and_batched(tiny_llama_dir, dtype,
                                                                        graphs, deterministic):
    w = _worker(tiny_llama_dir, dtype, graphs)
    prompt = list(range(3, 22))                       # 19 tokens: pages of 4, several key tiles
    block = list(range(30, 46))                       # 16: a captured verify size
    # decoded: the prompt, then one token per forward
    t = PageTable()
    _logits(w, [(t, prompt, 0)])
    decoded = torch.stack([_logits(w, [(t, prompt + block[:i + 1], len(prompt) + i)])[0][0]
                           for i in range(len(block))])
    # verified: the block in one forward, beside another sequence's 16-token prefill (and,
    # eagerly, a decode)
    t2, other, third = PageTable(), PageTable(), PageTable()
    _logits(w, [(t2, prompt, 0)])
    _logits(w, [(third, list(range(50, 60)), 0)])
    batch = [(t2, prompt + block, len(prompt)), (other, list(range(60, 76)), 0)]
    if not graphs:
        batch.append((third, list(range(50, 61)), 10))
    verified = _logits(w, batch, w._graphs if graphs else None)[0]
    assert torch.equal(verified, decoded)


def _decoded(w: TargetWorker, tokens: list[int], cached: int) -> torch.Tensor:
    """The logits of tokens[-1], decoded one token per forward after a prefill of
    tokens[:cached], in fresh pages."""
    t = PageTable()
    _logits(w, [(t, tokens[:cached], 0)])
    for n in range(cached + 1, len(tokens) + 1):
        last = _logits(w, [(t, tokens[:n], n - 1)])[0][0]
    return last


@pytest.mark.parametrize("graphs", GRAPHS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_a_tree_nodes_logits_are_bitwise_its_paths_decode(tiny_llama_dir, dtype, graphs,
                                                          deterministic):
    from runtime.draft_tree import DraftTree
    w = _worker(tiny_llama_dir, dtype, graphs)
    prompt = list(range(3, 20))                       # 17 tokens: the block starts mid-tile
    tree = DraftTree(list(range(40, 55)), [0, 0, 1, 1, 2, 3, 3, 4, 5, 6, 7, 2, 8, 9, 10])
    block = [30] + tree.tokens                        # the anchor, then 15 drafts: 16 rows
    t, other = PageTable(), PageTable()
    _logits(w, [(t, prompt, 0)])
    w.kv_cache.ensure(t, len(prompt) + len(block))
    w.kv_cache.ensure(other, 16)
    slices = [SeqSlice(t, len(prompt), len(block), tree.ancestor_mask()),
              SeqSlice(other, 0, 16)]                 # beside a 16-token prefill
    if graphs:
        assert w._graph_for(slices, (), w._tree_graphs) is not None
    ids = block + list(range(60, 76))
    pos = [len(prompt) + d for d in tree.depths] + list(range(16))   # depths: anchor first
    out = w.forward(slices, torch.tensor(ids, device=DEVICE), torch.tensor(pos, device=DEVICE), ())
    verified = w.logits(out.hidden).float().cpu()[: len(block)]
    mask = tree.ancestor_mask()
    for node in range(len(block)):
        path = [block[j] for j in range(len(block)) if mask[node, j]]   # by depth: parents first
        assert torch.equal(verified[node], _decoded(w, prompt + path, len(prompt))), node


def test_paths_list_each_nodes_ancestors_by_depth():
    from runtime.attention.triton_backend import mask_paths
    from runtime.draft_tree import DraftTree
    tree = DraftTree([5, 6, 7, 8], [0, 0, 2, 1])
    rows = mask_paths(tree.ancestor_mask(), 5, 6).tolist()
    assert rows == [[0, 0, -1, -1, -1, -1], [1, 0, 1, -1, -1, -1], [1, 0, 2, -1, -1, -1],
                    [2, 0, 2, 3, -1, -1], [2, 0, 1, 4, -1, -1]]
    assert mask_paths(None, 3, 4).tolist() == [[0, 0, -1, -1], [1, 0, 1, -1], [2, 0, 1, 2]]


def test_default_mode_keeps_its_own_blocks():
    from runtime.attention.triton_backend import TritonAttentionBackend
    from runtime.kv_cache import PagedKVCache
    backend = TritonAttentionBackend(PagedKVCache(1, 2, 16, 4, 4, torch.float32, "cpu"),
                                     6, 2, 16, 0.25)
    assert (backend.block_m(3), backend.block_m(48)) == (16, 64)
    batch_invariance.enable(True)
    try:
        assert (backend.block_m(3), backend.block_m(48)) == (64, 64)     # one shape for all
    finally:
        batch_invariance.enable(False)


@pytest.mark.parametrize("device,backend,message", [
    ("cuda", "flashinfer", "--attention-backend triton"),
    ("cuda", "torch", "--attention-backend triton"),
])
def test_deterministic_refuses_what_it_cannot_cover(device, backend, message):
    with pytest.raises(ValueError, match=message):
        TargetConfig("m", device=device, attention_backend=backend, deterministic=True)


def test_deterministic_on_the_cpu_needs_the_interpreter(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(ValueError, match="--device cuda"):
        TargetConfig("m", device="cpu", attention_backend="triton", deterministic=True)


def test_deterministic_refuses_recurrent_models(tmp_path):
    from support.hybrid import make_tiny_hybrid
    model = make_tiny_hybrid(tmp_path / "bamba")
    try:
        with pytest.raises(ValueError, match="recurrent"):
            TargetWorker(TargetConfig(str(model), device=DEVICE, attention_backend="triton",
                                      kv_budget_bytes=4 << 20, deterministic=True))
    finally:
        batch_invariance.enable(False)


def test_a_target_asked_for_deterministic_on_the_cpu_exits_refusing_before_it_serves(
        tiny_llama_dir, tmp_path):
    from support.procs import start_target
    p = start_target(tiny_llama_dir, tmp_path, "--deterministic", wait=False,
                     env={"TRITON_INTERPRET": "0"})
    assert p.proc.wait(120) == 2
    assert "--deterministic needs --device cuda" in p.log()
