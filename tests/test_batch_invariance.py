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


def test_tile_depends_on_the_weight_only():
    assert tile_for(576, 576) == tile_for(576, 576)
    assert tile_for(49152, 576)[1] >= tile_for(576, 576)[1]   # wide weights: wider tiles


def _worker(model_dir, dtype: str = "float32") -> TargetWorker:
    w = TargetWorker(TargetConfig(str(model_dir), device=DEVICE, attention_backend="triton",
                                  dtype=dtype, kv_budget_bytes=4 << 20, page_size=4,
                                  cuda_graphs=False, deterministic=True))
    w.alloc_memory_pools()
    w.init_attention_backends()
    return w


def _logits(w: TargetWorker, batch: list[tuple[PageTable, list[int], int]]) -> list[torch.Tensor]:
    """One forward over several sequences, each (pages, its whole token list, tokens already
    in its cache): the new tokens' logits per sequence."""
    slices, ids, pos = [], [], []
    for table, tokens, cached in batch:
        w.kv_cache.ensure(table, len(tokens))
        slices.append(SeqSlice(table, cached, len(tokens) - cached))
        ids += tokens[cached:]
        pos += range(cached, len(tokens))
    out = w.forward(slices, torch.tensor(ids, device=DEVICE),
                    torch.tensor(pos, device=DEVICE), ())
    logits = w.logits(out.hidden).float().cpu()
    sizes = [len(t) - c for _, t, c in batch]
    return list(logits.split(sizes))


# bf16 (the GPU's case) where a GPU runs it: the interpreter computes in numpy's dtypes
DTYPES = ["float32", "bfloat16"] if DEVICE == "cuda" else ["float32"]


@pytest.mark.parametrize("dtype", DTYPES)
def test_a_tokens_logits_are_bitwise_equal_decoded_verified_and_batched(tiny_llama_dir, dtype,
                                                                        deterministic):
    w = _worker(tiny_llama_dir, dtype)
    assert w.max_tree_nodes == 0                      # chains only
    prompt = list(range(3, 22))                       # 19 tokens: pages of 4, several key tiles
    block = [30, 31, 32, 33, 34, 35, 36, 37, 38, 39, 40, 41]
    # decoded: the prompt, then one token per forward
    t = PageTable()
    _logits(w, [(t, prompt, 0)])
    decoded = [_logits(w, [(t, prompt + block[:i + 1], len(prompt) + i)])[0][0]
               for i in range(len(block))]
    decoded = torch.stack(decoded)
    # verified: the block in one forward, beside another sequence's prefill and a decode
    t2, other, third = PageTable(), PageTable(), PageTable()
    _logits(w, [(t2, prompt, 0)])
    _logits(w, [(third, list(range(50, 60)), 0)])
    verified, _, _ = _logits(w, [(t2, prompt + block, len(prompt)),
                                 (other, list(range(60, 83)), 0),
                                 (third, list(range(50, 61)), 10)])
    assert torch.equal(verified, decoded)


def test_default_mode_keeps_its_own_blocks():
    from runtime.attention.triton_backend import TritonAttentionBackend
    from runtime.kv_cache import PagedKVCache
    backend = TritonAttentionBackend(PagedKVCache(1, 2, 16, 4, 4, torch.float32, "cpu"),
                                     6, 2, 16, 0.25)
    assert (backend.block_m(3), backend.block_m(48)) == (16, 64)
    batch_invariance.enable(True)
    try:
        assert (backend.block_m(3), backend.block_m(48)) == (16, 16)
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
