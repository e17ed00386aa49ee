"""DeepSeek-V2 / V3 (multi-head latent attention + mixture of experts) against transformers,
through the target worker's paged latent KV cache: logits in fp32 tolerance for prompts fed in
chunks, batched with other sequences and verifying trees; the absorbed attention form against
the expanded one; the fp8 (e4m3) cache: half the bytes of bf16, near the fp32 logits, with the
checkpoint's scales; and the start-up errors of configurations and backends it cannot serve."""
from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file
from support.inproc_target import batch_logits, chunked_logits, loaded_worker

from dflash.prepare.tiny_mla import make_tiny_mla
from runtime.attention.base import AttentionBackend
from runtime.attention.metadata import AttentionMetadata, SeqSlice
from runtime.attention.torch_backend import TorchAttentionBackend
from runtime.kv_cache import PagedKVCache, PageTable
from runtime.models.deepseek import MLAConfig
from runtime.models.forward import ForwardBatch
from runtime.models.registry import load_model
from services.target.config import TargetConfig
from services.target.worker import TargetWorker, check_backend_fits

FP32_TOL = 1e-4
IDS = [1, 17, 42, 99, 7, 3, 250, 18, 64, 5, 77, 120, 33, 9, 201, 45, 8, 150, 6, 91, 13, 2, 240]

# name -> (version, overrides): V2 without a query LoRA and group-limited softmax routing, V2
# with plain greedy routing and no dense layer, V3 with YaRN + mscale and sigmoid grouped routing,
# V3 with the rotary dims not interleaved, V3 with norm_topk_prob off and attention biases
VARIANTS = {
    "v2": (2, {}),
    "v2-greedy-all-moe": (2, {"topk_method": "greedy", "first_k_dense_replace": 0, "n_group": None,
                                  "topk_group": None}),
    "v3": (3, {}),
    "v3-no-interleave": (3, {"rope_interleave": False}),
    "v3-unnormalised-bias": (3, {"norm_topk_prob": False, "attention_bias": True}),
}


@pytest.fixture(scope="module", params=sorted(VARIANTS))
def variant(request, tmp_path_factory):
    version, overrides = VARIANTS[request.param]
    path = make_tiny_mla(tmp_path_factory.mktemp(f"mla_{request.param}"), version, **overrides)
    return request.param, path


def hf_logits(path, ids: list[int]) -> torch.Tensor:
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].float()


def test_logits_match_transformers_in_chunks_and_batches(variant):
    name, path = variant
    ref = hf_logits(path, IDS)
    worker = loaded_worker(path)
    # latent: one key per token and layer, split as FlashInfer reads it (latent | rope)
    assert (worker.kv_cache.k.shape[-1], worker.kv_cache.v.shape[-1]) == (32, 8)
    for chunks in ([len(IDS)], [9, 1, 13], [1] * len(IDS)):
        got = chunked_logits(worker, IDS, chunks)
        assert (got - ref).abs().max() < FP32_TOL, (name, chunks)
    # batched with another sequence of another length: rows stay their sequence's own
    other = [5, 6, 7, 8, 9, 10, 11]
    a, b = PageTable(), PageTable()
    got_a, got_b = batch_logits(worker, [(a, 0, IDS), (b, 0, other)])
    assert (got_a - ref).abs().max() < FP32_TOL
    assert (got_b - hf_logits(path, other)).abs().max() < FP32_TOL
    worker.kv_cache.release(a)
    worker.kv_cache.release(b)
    assert worker.kv_cache.used_pages == 0


def test_tree_verify_reads_each_nodes_ancestors(variant):
    """A verified tree (two branches after the anchor) gives each node the logits of its own
    path, as transformers computes that path alone."""
    _, path = variant
    worker = loaded_worker(path)
    prompt, branch_a, branch_b = IDS[:10], [11, 12], [21, 22]
    table = PageTable()
    batch_logits(worker, [(table, 0, prompt)])
    # nodes: anchor, a1, a2, b1, b2 (a1->a2, b1->b2 hang off the anchor)
    nodes = [prompt[-1]] + branch_a + branch_b
    tree = torch.tensor([[1, 0, 0, 0, 0], [1, 1, 0, 0, 0], [1, 1, 1, 0, 0], [1, 0, 0, 1, 0],
                         [1, 0, 0, 1, 1]], dtype=torch.bool)
    start = len(prompt) - 1
    worker.kv_cache.trim(table, start)
    worker.kv_cache.ensure(table, start + len(nodes))
    out = worker.forward([SeqSlice(table, start, len(nodes), tree)], torch.tensor(nodes),
                         torch.tensor([start, start + 1, start + 2, start + 1, start + 2]), ())
    logits = worker.logits(out.hidden)
    ref_a = hf_logits(path, prompt + branch_a)[-3:]
    ref_b = hf_logits(path, prompt + branch_b)[-2:]
    assert (logits[:3] - ref_a).abs().max() < FP32_TOL
    assert (logits[3:] - ref_b).abs().max() < FP32_TOL


def test_absorbed_attention_equals_the_expanded_form(variant):
    """Every layer's attention, weight-absorbed over the latent cache (what the service runs)
    against the per-head K/V form transformers computes."""
    _, path = variant
    model = load_model(path)
    layout = model.kv_layout
    x = torch.randn(len(IDS), model.cfg.hidden_size, generator=torch.Generator().manual_seed(0))
    positions = torch.arange(len(IDS))
    for layer in model.layers:
        attn = layer.self_attn
        cache = PagedKVCache.for_layout(layout, 4, 16, torch.float32, "cpu")
        backend = TorchAttentionBackend(cache, layout.num_heads, layout.num_kv_heads,
                                        layout.head_dim, layout.scale)
        table = PageTable()
        cache.ensure(table, len(IDS))
        backend.prepare(AttentionMetadata.build([SeqSlice(table, 0, len(IDS))], cache))
        with torch.no_grad():
            absorbed = attn(x, positions, model.rope, ForwardBatch(backend))
            expanded = attn.forward_expanded(x, positions, model.rope)
        assert (absorbed - expanded).abs().max() < 1e-5


def test_fp8_cache_halves_bf16_bytes_and_stays_near(tmp_path):
    path = make_tiny_mla(tmp_path / "v3", 3)
    layout = load_model(path).kv_layout
    per_token = {d: PagedKVCache.layout_bytes_per_page(layout, 16, d) // 16
                 for d in (torch.float32, torch.bfloat16, torch.float8_e4m3fn)}
    # 3 layers x (kv_lora_rank 32 + rope 8) entries: no per-head K/V, no V at all
    assert per_token[torch.bfloat16] == 3 * 40 * 2
    assert per_token[torch.float8_e4m3fn] * 2 == per_token[torch.bfloat16]
    ref = hf_logits(path, IDS)
    fp8 = loaded_worker(path, kv_cache_dtype="fp8_e4m3")
    assert fp8.kv_cache.k.dtype == torch.float8_e4m3fn
    got = chunked_logits(fp8, IDS, [9, 14])
    # rounded (not exact) and close: 3 mantissa bits move this tiny random MoE model about as
    # far as bf16 weights do (a routing choice flips here and there)
    err = (got - ref).abs().mean()
    assert 0 < err < 0.15 * ref.abs().mean(), err
    assert (got.argmax(-1) == ref.argmax(-1)).float().mean() >= 0.85


def test_fp8_scales_from_the_checkpoint(tmp_path):
    """k_scale tensors (vLLM's names) set the per-layer scale; stored = x / scale."""
    path = make_tiny_mla(tmp_path / "v3", 3)
    tensors = load_file(str(path / "model.safetensors"))
    scales = {0: 0.5, 2: 2.0}
    for layer, s in scales.items():
        tensors[f"model.layers.{layer}.self_attn.k_scale"] = torch.tensor(s)
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    worker = loaded_worker(path, kv_cache_dtype="fp8_e4m3")
    assert worker.kv_cache.scales.k == (0.5, 1.0, 2.0)
    table = PageTable()
    batch_logits(worker, [(table, 0, IDS[:4])])
    slots = torch.tensor(worker.kv_cache.slots(table, 0, 4))
    plain = loaded_worker(path)                 # same weights, fp32 cache: the true latents
    ptable = PageTable()
    batch_logits(plain, [(ptable, 0, IDS[:4])])
    true = plain.kv_cache.k[:, torch.tensor(plain.kv_cache.slots(ptable, 0, 4))]
    stored = worker.kv_cache.k[:, slots].float()
    # layer 0's latents do not depend on the cache yet: stored exactly as x / 0.5 in fp8
    assert torch.equal(stored[0], (true[0] / 0.5).to(torch.float8_e4m3fn).float())
    # every layer: written as x / scale (latent and rope parts alike), read back (dequant) as
    # entry * scale
    cache, x = worker.kv_cache, torch.randn(2, 1, worker.model.kv_layout.head_dim)
    for layer, s in ((0, 0.5), (1, 1.0), (2, 2.0)):
        cache.write(layer, slots[:2], x[..., :32], x[..., 32:])
        keys, values = cache.gather(layer, slots[:2])
        want = (x / s).to(torch.float8_e4m3fn).float()
        assert torch.equal(keys.float(), want) and torch.equal(values.float(), want[..., :32])
        assert torch.equal(cache.dequant(layer, keys, torch.float32), want * s), layer
    worker.kv_cache.release(table)


def test_bad_configs_name_the_field(tmp_path):
    path = make_tiny_mla(tmp_path / "v2", 2)
    raw = json.loads((path / "config.json").read_text())
    cases = {
        "kv_lora_rank": {"kv_lora_rank": None},
        "qk_rope_head_dim 7": {"qk_rope_head_dim": 7},
        "topk_method 'sparse'": {"topk_method": "sparse"},
        "n_group 3": {"n_group": 3},
        "moe_layer_freq": {"moe_layer_freq": 2},
    }
    for needle, change in cases.items():
        with pytest.raises(ValueError, match=needle):
            MLAConfig.from_hf({**raw, **change})
    bad = tmp_path / "bad"
    shutil.copytree(path, bad)
    (bad / "config.json").write_text(json.dumps({**raw, "qk_nope_head_dim": 8}))
    with pytest.raises(ValueError, match="kv_b_proj"):       # rope/nope sizes vs the weights
        TargetWorker(TargetConfig(model_dir=str(bad)))


def test_backends_that_cannot_read_the_cache_refuse_before_serving(tmp_path):
    path = make_tiny_mla(tmp_path / "v3", 3)
    layout = load_model(path).kv_layout
    with pytest.raises(ValueError, match="multi-head latent attention.*backends that can: "
                                         r"\['torch'"):
        check_backend_fits(AttentionBackend, layout, torch.float32)
    dense = layout.__class__(3, 4, 4, 16, 0.25)
    with pytest.raises(ValueError, match="--kv-cache-dtype fp8_e4m3 is not supported"):
        check_backend_fits(AttentionBackend, dense, torch.float8_e4m3fn)
    with pytest.raises(ValueError, match="fp8_e4m3"):
        TargetConfig(model_dir=str(path), kv_cache_dtype="fp8")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_grouped_experts_equal_the_reference_loop(tmp_path, dtype):
    """The GPU's MoE path (one grouped GEMM per projection over the tokens sorted by expert,
    no host sync) against the reference loop, on the CPU; the experts' parameters are views
    into the stacked weights the grouped GEMMs read (the checkpoint filled both)."""
    path = make_tiny_mla(tmp_path / "v3", 3)
    model = load_model(path, dtype=dtype)
    moe = model.layers[1].mlp
    assert all(e.gate_up_proj.weight.data_ptr() == moe._w13[i].data_ptr()
               for i, e in enumerate(moe.experts))
    x = torch.randn(29, model.cfg.hidden_size, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        weights, ids = moe.gate(x.to(dtype))
        loop = moe._loop(x.to(dtype), weights, ids).float()
        grouped = moe._grouped(x.to(dtype), weights, ids).float()
    assert (loop - grouped).abs().max() < (1e-5 if dtype == torch.float32 else 2e-2)
