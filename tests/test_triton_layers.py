"""The fused layer kernels (runtime.layers.triton_ops) against the torch code they replace. On the
CPU they run through Triton's interpreter (TRITON_INTERPRET=1, set in conftest); on a GPU,
natively. The interpreter rounds fp32 -> bf16 by truncation, so bf16 agrees to ~1 ulp only."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

triton = pytest.importorskip("triton")

from runtime.config import ModelConfig, RopeConfig
from runtime.layers import fused, triton_ops
from runtime.layers.mlp import silu_and_mul_torch
from runtime.layers.norm import rms_norm_torch
from runtime.layers.rope import RotaryEmbedding, rope_torch
from runtime.models.dense import DenseDecoder
from runtime.models.forward import ForwardBatch

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TOL = {torch.float32: {"atol": 1e-5, "rtol": 1e-5}, torch.bfloat16: {"atol": 3e-2, "rtol": 2e-2}}
DTYPES = [torch.float32, torch.bfloat16]
EPS = 1e-6


def rand(*shape: int, dtype: torch.dtype = torch.float32, seed: int = 0, scale: float = 1.0
         ) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(shape, generator=g) * scale).to(dtype).to(DEVICE)


def norm_weight(d: int, dtype: torch.dtype) -> torch.Tensor:
    return 1.0 + rand(d, dtype=dtype, seed=99, scale=0.2)


def assert_close(got: torch.Tensor, want: torch.Tensor, rounded_to: torch.dtype | None = None
                 ) -> None:
    """rounded_to: the narrowest dtype the op rounds through (default: the output's)."""
    assert got.shape == want.shape and got.dtype == want.dtype
    torch.testing.assert_close(got, want, **TOL[rounded_to or want.dtype])


def qkv_views(t: int, nh: int, nkv: int, hd: int, dtype: torch.dtype, seed: int = 1
              ) -> tuple[torch.Tensor, torch.Tensor]:
    """q [t, nh, hd] and k [t, nkv, hd] as strided views of one qkv projection output."""
    qkv = rand(t, (nh + 2 * nkv) * hd, dtype=dtype, seed=seed)
    q, k, _ = qkv.split([nh * hd, nkv * hd, nkv * hd], dim=-1)
    return q.view(t, nh, hd), k.view(t, nkv, hd)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("t,d", [(1, 576), (37, 576), (37, 100), (3, 8192)])
def test_rms_norm_rows(dtype, t, d):
    x, w = rand(t, d, dtype=dtype, scale=3.0), norm_weight(d, dtype)
    assert_close(triton_ops.rms_norm(x, w, EPS), rms_norm_torch(x, w, EPS))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("t,nh,hd", [(1, 32, 128), (37, 4, 64)])
def test_rms_norm_per_head_on_strided_views(dtype, t, nh, hd):
    q, k = qkv_views(t, nh, 2, hd, dtype)
    for x in (q, k):
        w = norm_weight(hd, dtype)
        assert_close(triton_ops.rms_norm(x, w, EPS), rms_norm_torch(x, w, EPS))


def test_rms_norm_fp32_weight_on_bf16_input_promotes_like_torch():
    x, w = rand(5, 64, dtype=torch.bfloat16), norm_weight(64, torch.float32)
    assert_close(triton_ops.rms_norm(x, w, EPS), rms_norm_torch(x, w, EPS), torch.bfloat16)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("t,d", [(1, 576), (37, 576)])
def test_add_rms_norm(dtype, t, d):
    x, r, w = rand(t, d, dtype=dtype), rand(t, d, dtype=dtype, seed=2), norm_weight(d, dtype)
    normed, summed = triton_ops.add_rms_norm(x, r, w, EPS)
    assert_close(summed, x + r)
    assert_close(normed, rms_norm_torch(x + r, w, EPS))
    if dtype == torch.float32:
        assert torch.equal(summed, x + r)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("t,inter", [(1, 1536), (37, 1536), (37, 100)])
def test_silu_and_mul(dtype, t, inter):
    gate_up = rand(t, 2 * inter, dtype=dtype, scale=3.0)
    assert_close(triton_ops.silu_and_mul(gate_up), silu_and_mul_torch(gate_up))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("t,nh,nkv,hd", [(1, 32, 8, 128), (37, 4, 2, 64)])
@pytest.mark.parametrize("partial", [1.0, 0.5])
def test_rotary_q_and_k_in_one_launch(dtype, t, nh, nkv, hd, partial):
    rope = RotaryEmbedding(hd, 4096, RopeConfig(theta=1e6, partial_rotary_factor=partial))
    rope.init_buffers(torch.device(DEVICE))
    positions = torch.randint(0, 4096, (t,), generator=torch.Generator().manual_seed(5)).to(DEVICE)
    q, k = qkv_views(t, nh, nkv, hd, dtype)
    got = triton_ops.rotary(positions, q, k, rope.cos, rope.sin, rope.rotary_dim)
    want = rope_torch(positions, q, k, rope.cos, rope.sin, rope.rotary_dim)
    for g, w in zip(got, want):
        assert_close(g, w)
        assert torch.equal(g[..., rope.rotary_dim:], w[..., rope.rotary_dim:])   # passed through


def test_rotary_of_one_tensor_as_q_and_k():
    """DFlash's context_kv rotates k alone by passing it as both q and k."""
    rope = RotaryEmbedding(32, 64, RopeConfig())
    rope.init_buffers(torch.device(DEVICE))
    k, pos = rand(6, 2, 32), torch.arange(6, device=DEVICE)
    got_q, got_k = triton_ops.rotary(pos, k, k, rope.cos, rope.sin, 32)
    assert_close(got_k, rope_torch(pos, k, k, rope.cos, rope.sin, 32)[1])
    assert torch.equal(got_q, got_k)


# -- the dense model: deferred residual adds, and the whole layer through the kernels -----------
class _StubAttention:
    """Attention stand-in (no cache): a fixed function of the rotated q, k and v."""

    def forward(self, layer_id, q, k, v, **_):
        group = q.shape[1] // k.shape[1]
        return 0.5 * q + (k * v).repeat_interleave(group, dim=1)


def tiny_dense(dtype: torch.dtype) -> DenseDecoder:
    cfg = ModelConfig.from_dict({
        "model_type": "qwen3", "vocab_size": 64, "hidden_size": 96, "intermediate_size": 160,
        "num_hidden_layers": 3, "num_attention_heads": 4, "num_key_value_heads": 2,
        "head_dim": 32, "max_position_embeddings": 128})
    torch.manual_seed(0)
    model = DenseDecoder(cfg)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(1.0 if p.dim() == 1 else 0.0, 0.2)
    return model.to(DEVICE, dtype).requires_grad_(False)


def unfused_forward(model: DenseDecoder, ids, positions, batch) -> tuple[torch.Tensor, list]:
    """The decoder as written before the adds were deferred into the norms."""
    x, captured = model.embed_tokens(ids), []
    for layer in model.layers:
        x = x + layer.self_attn(layer.input_layernorm(x), positions, model.rope, batch)
        x = x + layer.mlp(layer.post_attention_layernorm(x))
        captured.append(x)
    return model.norm(x), captured


def model_inputs(t: int = 11):
    ids = torch.randint(0, 64, (t,), generator=torch.Generator().manual_seed(3)).to(DEVICE)
    return ids, torch.arange(5, 5 + t, device=DEVICE), ForwardBatch(_StubAttention(), (0, 1, 2))


@pytest.mark.parametrize("dtype", DTYPES)
def test_deferred_residual_adds_are_bit_identical_in_torch(dtype, monkeypatch):
    """The torch path (the CPU's) of the restructured decoder against the unfused formulas."""
    monkeypatch.setattr(fused, "enabled", False)
    model = tiny_dense(dtype)
    ids, positions, batch = model_inputs()
    out = model(ids, positions, batch)
    hidden, captured = unfused_forward(model, ids, positions, batch)
    assert torch.equal(out.hidden, hidden)
    assert torch.equal(out.captured, torch.cat(captured[:2] + [hidden], dim=-1))


def test_dense_model_through_the_kernels_matches_torch(monkeypatch):
    """Every norm, add, activation and rotation of the model through the Triton kernels (the
    interpreter on the CPU) against the torch code, fp32."""
    model = tiny_dense(torch.float32)
    ids, positions, batch = model_inputs()
    monkeypatch.setattr(fused, "enabled", False)
    want = model(ids, positions, batch)
    monkeypatch.setattr(fused, "triton_ops_for", lambda *tensors: triton_ops)
    got = model(ids, positions, batch)
    torch.testing.assert_close(got.hidden, want.hidden, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(got.captured, want.captured, atol=1e-4, rtol=1e-4)


@pytest.mark.skipif(DEVICE != "cuda", reason="the dispatch picks Triton for CUDA tensors only")
def test_dispatch_keeps_torch_under_autograd():
    w = torch.ones(8, device=DEVICE, requires_grad=True)
    assert fused.triton_ops_for(torch.ones(2, 8, device=DEVICE), w) is None
    with torch.no_grad():
        assert fused.triton_ops_for(torch.ones(2, 8, device=DEVICE), w) is triton_ops


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("kind", ["dense", "latent"])
def test_store_kv_writes_what_two_index_copies_write(dtype, kind):
    """Dense: k and v as strided views of one qkv output; latent (MLA): the latent [T, 1, 512]
    and the rope key [T, 1, 64] as slices of one projection - rows land in the slots (scattered,
    a row of 576 and of 8 x 128 crossing the loop's 1 024-element steps), the rest untouched."""
    t, slots = 7, torch.tensor([9, 2, 30, 31, 0, 17, 5], device=DEVICE)
    if kind == "dense":
        _, k = qkv_views(t, 4, 8, 128, dtype)
        v = rand(t, 8, 128, dtype=dtype, seed=3)
    else:
        kv = rand(t, 512 + 64, dtype=dtype, seed=4)
        k, v = kv[:, :512].unsqueeze(1), kv[:, 512:].unsqueeze(1)
    pools = [rand(32, *x.shape[1:], dtype=dtype, seed=5 + i) for i, x in enumerate((k, v))]
    want = [p.clone().index_copy_(0, slots, x) for p, x in zip(pools, (k, v))]
    triton_ops.store_kv(pools[0], pools[1], slots, k, v)
    for got, w in zip(pools, want):
        assert torch.equal(got, w)


def test_store_kv_rounds_a_wider_source_into_the_pool():
    k, v = rand(3, 2, 64, seed=6), rand(3, 2, 64, seed=7)
    pools = [torch.zeros(8, 2, 64, dtype=torch.bfloat16, device=DEVICE) for _ in range(2)]
    triton_ops.store_kv(pools[0], pools[1], torch.tensor([1, 4, 6], device=DEVICE), k, v)
    assert_close(pools[0][[1, 4, 6]], k.to(torch.bfloat16))
    assert_close(pools[1][[1, 4, 6]], v.to(torch.bfloat16))
    assert not pools[0][[0, 2, 3, 5, 7]].any()


COMPILE_FOR_HOPPER = """
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from runtime.layers import triton_ops
sig = {"slots": "*i64", "k": "*bf16", "v": "*bf16", "k_pool": "*bf16", "v_pool": "*bf16",
       "stride_k": "i64", "stride_v": "i64", "DK": "constexpr", "DV": "constexpr",
       "BLOCK": "constexpr"}
src = ASTSource(fn=triton_ops._store_kv_kernel, signature=sig,
                constexprs={"DK": 512, "DV": 64, "BLOCK": triton_ops.STORE_BLOCK})
kernel = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": 4})
assert kernel.asm["cubin"]
"""


def test_store_kv_compiles_for_a_hopper_gpu():
    """Without a GPU: the kernel compiles to an sm_90 binary (Triton ships ptxas), so a GPU-only
    compile error shows on the CPU too; what it computes is checked above in the interpreter.
    In a process of its own: compiling needs the kernel undecorated by the interpreter."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    p = subprocess.run([sys.executable, "-c", COMPILE_FOR_HOPPER], env=env, capture_output=True,
                       text=True, timeout=300, check=False)
    if p.returncode and "ptxas" in p.stderr and "not found" in p.stderr.lower():
        pytest.skip("no ptxas with this Triton")
    assert p.returncode == 0, p.stderr[-2000:]
