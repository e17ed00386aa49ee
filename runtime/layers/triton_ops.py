"""Fused Triton kernels for the elementwise parts of a decoder layer (CUDA; on the CPU they run
only through Triton's interpreter, in tests). The layers reach them through
runtime.layers.fused.triton_ops_for, which keeps the torch code for CPU tensors and autograd.

Each op rounds where its torch reference (norm.rms_norm_torch, mlp.silu_and_mul_torch,
rope.rope_torch) rounds, with fp32 math in between, so results match it to about one ulp of
the output dtype. Launch grids and block sizes depend on shapes only, and outputs are plain
allocations: no host syncs, so every op can be captured in a CUDA graph.

  rms_norm      x [..., D] -> [..., D]                  one launch
  add_rms_norm  x, residual [..., D] -> (normed, sum)   one launch (sum = x + residual)
  silu_and_mul  gate_up [T, 2I] -> [T, I]               one launch
  rotary        q [T, nh, hd], k [T, nkv, hd] -> both   one launch
  store_kv      k, v [T, n, d] -> their pools' slots     one launch (two index_copy_ in torch)
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

ROW_TILE = 2048         # elements of x per rms_norm program: short rows (q/k heads) share one
SILU_BLOCK = 1024       # columns per silu_and_mul program


# -- RMSNorm (with the residual add fused in front) -------------------------------------------
@triton.jit
def _rms_norm_kernel(
    x, res, w, out, summed, n_rows, B, sxa, sxb, sra, srb, eps,
    D: tl.constexpr, BLOCK_D: tl.constexpr, ROWS: tl.constexpr, HAS_RES: tl.constexpr,
):
    """ROWS rows of D per program. Row r of x is x[r // B, r % B, :] (strides sxa, sxb; unit
    stride along D), likewise for res; out and summed are contiguous [n_rows, D].
    summed = x + res (rounded to x's dtype, as torch adds);
    out = w * cast(h * rsqrt(mean(h^2) + eps)) with h = fp32(x or summed)."""
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    cols = tl.arange(0, BLOCK_D)
    ok = (rows < n_rows)[:, None] & (cols < D)[None, :]
    a, b = (rows // B).to(tl.int64), (rows % B).to(tl.int64)
    h = tl.load(x + (a * sxa + b * sxb)[:, None] + cols[None, :], mask=ok, other=0.0)
    dense = rows.to(tl.int64)[:, None] * D + cols[None, :]           # [ROWS, BLOCK_D] offsets
    if HAS_RES:
        r = tl.load(res + (a * sra + b * srb)[:, None] + cols[None, :], mask=ok, other=0.0)
        h = (h.to(tl.float32) + r.to(tl.float32)).to(x.dtype.element_ty)
        tl.store(summed + dense, h, mask=ok)
    hf = h.to(tl.float32)
    inv = tl.rsqrt(tl.sum(hf * hf, axis=1) / D + eps)                   # [ROWS]
    normed = (hf * inv[:, None]).to(x.dtype.element_ty).to(tl.float32)  # torch: h.to(dtype)
    wt = tl.load(w + cols, mask=cols < D, other=0.0).to(tl.float32)
    tl.store(out + dense, (wt[None, :] * normed).to(out.dtype.element_ty), mask=ok)


def _as_rows(x: torch.Tensor) -> torch.Tensor:
    """[..., D] -> a 3-d [A, B, D] view (a copy only if needed) with unit stride along D."""
    if x.stride(-1) != 1:
        x = x.contiguous()
    if x.dim() == 3:
        return x
    if x.dim() < 3:
        return x.reshape((1,) * (3 - x.dim()) + tuple(x.shape))
    return x.flatten(0, -3)


def _norm_launch(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor | None]:
    d = x.shape[-1]
    x3 = _as_rows(x)
    r3 = _as_rows(residual) if residual is not None else x3
    out_dtype = torch.promote_types(weight.dtype, x.dtype)      # as `weight * h.to(dtype)`
    out = torch.empty(x.shape, dtype=out_dtype, device=x.device)
    summed = out if residual is None else torch.empty(x.shape, dtype=x.dtype, device=x.device)
    n_rows = x3.shape[0] * x3.shape[1]
    block_d = triton.next_power_of_2(d)
    rows = max(1, ROW_TILE // block_d)
    if n_rows:
        _rms_norm_kernel[(triton.cdiv(n_rows, rows),)](
            x3, r3, weight, out, summed, n_rows, x3.shape[1], x3.stride(0), x3.stride(1),
            r3.stride(0), r3.stride(1), eps,
            D=d, BLOCK_D=block_d, ROWS=rows, HAS_RES=residual is not None,
            num_warps=min(16, max(4, rows * block_d // 512)))
    return out, (None if residual is None else summed)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x [..., D] (any strides with unit last stride, e.g. q/k heads [T, nh, hd] split out of
    the qkv projection), weight [D] -> [..., D] contiguous."""
    return _norm_launch(x, None, weight, eps)[0]


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """x, residual [..., D] -> (rms_norm(x + residual), x + residual), both contiguous."""
    if residual.shape != x.shape or residual.dtype != x.dtype:
        raise ValueError(f"residual {tuple(residual.shape)} {residual.dtype} does not match "
                         f"x {tuple(x.shape)} {x.dtype}")
    return _norm_launch(x, residual, weight, eps)


# -- SwiGLU activation --------------------------------------------------------------------------
@triton.jit
def _silu_and_mul_kernel(gate_up, out, I, stride_t, BLOCK: tl.constexpr):
    """Program (t, j): columns j*BLOCK.. of row t. gate = gate_up[t, :I], up = gate_up[t, I:];
    out[t] = cast(silu(gate)) * up, rounded twice as torch's F.silu(gate) * up is."""
    t = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = cols < I
    g = tl.load(gate_up + t * stride_t + cols, mask=ok, other=0.0).to(tl.float32)
    up = tl.load(gate_up + t * stride_t + I + cols, mask=ok, other=0.0)
    act = (g / (1.0 + tl.exp(-g))).to(up.dtype).to(tl.float32)
    tl.store(out + t * I + cols, (act * up.to(tl.float32)).to(out.dtype.element_ty), mask=ok)


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """gate_up [T, 2I] (unit last stride) -> silu(gate) * up [T, I]."""
    if gate_up.stride(-1) != 1:
        gate_up = gate_up.contiguous()
    t, i = gate_up.shape[0], gate_up.shape[1] // 2
    out = torch.empty((t, i), dtype=gate_up.dtype, device=gate_up.device)
    if t:
        _silu_and_mul_kernel[(t, triton.cdiv(i, SILU_BLOCK))](
            gate_up, out, i, gate_up.stride(0), BLOCK=SILU_BLOCK, num_warps=4)
    return out


# -- rotary embedding ---------------------------------------------------------------------------
@triton.jit
def _rotate_heads(src, dst, t, cos_row, sin_row, s_t, s_h,
                  NH: tl.constexpr, HD: tl.constexpr, RD: tl.constexpr,
                  BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr):
    """All NH heads of token t: dst[t, h, :RD] = x * cos + rotate_half(x) * sin (fp32, then
    cast), dst[t, h, RD:] = x. rotate_half(x)[j] = -x[j + RD/2] (j < RD/2), x[j - RD/2] after."""
    heads = tl.arange(0, BLOCK_H)
    d = tl.arange(0, BLOCK_D)
    ok = (heads < NH)[:, None] & (d < HD)[None, :]
    in_rot = d < RD
    first = d < RD // 2
    partner = tl.where(first, d + RD // 2, d - RD // 2)
    row = src + t * s_t + heads[:, None] * s_h                           # [BLOCK_H, 1] pointers
    x = tl.load(row + d[None, :], mask=ok, other=0.0)
    xp = tl.load(row + partner[None, :], mask=ok & in_rot[None, :], other=0.0).to(tl.float32)
    c = tl.load(cos_row + d, mask=in_rot, other=0.0).to(tl.float32)
    s = tl.load(sin_row + d, mask=in_rot, other=0.0).to(tl.float32)
    rotated = tl.where(first, -1.0, 1.0)[None, :] * xp
    y = (x.to(tl.float32) * c[None, :] + rotated * s[None, :]).to(dst.dtype.element_ty)
    y = tl.where(in_rot[None, :], y, x)
    tl.store(dst + t * (NH * HD) + heads[:, None] * HD + d[None, :], y, mask=ok)


@triton.jit
def _rotary_kernel(q, k, q_out, k_out, positions, cos, sin, stride_pos,
                   s_qt, s_qh, s_kt, s_kh,
                   NH: tl.constexpr, NKV: tl.constexpr, HD: tl.constexpr, RD: tl.constexpr,
                   BLOCK_QH: tl.constexpr, BLOCK_KH: tl.constexpr, BLOCK_D: tl.constexpr):
    """Program (t, 0) rotates the q heads of token t, program (t, 1) its k heads; cos/sin are
    the [max_position, RD] tables, read at row positions[t]."""
    t = tl.program_id(0).to(tl.int64)
    pos = tl.load(positions + t)
    cos_row, sin_row = cos + pos * stride_pos, sin + pos * stride_pos
    if tl.program_id(1) == 0:
        _rotate_heads(q, q_out, t, cos_row, sin_row, s_qt, s_qh, NH, HD, RD, BLOCK_QH, BLOCK_D)
    else:
        _rotate_heads(k, k_out, t, cos_row, sin_row, s_kt, s_kh, NKV, HD, RD, BLOCK_KH, BLOCK_D)


def rotary(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor,
           sin: torch.Tensor, rotary_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """positions int [T]; q [T, nh, hd], k [T, nkv, hd] (unit last stride; may be views of one
    buffer, even the same tensor); cos/sin [max_position, rotary_dim] -> new q, k (contiguous)."""
    q = q if q.stride(-1) == 1 else q.contiguous()
    k = k if k.stride(-1) == 1 else k.contiguous()
    cos, sin = cos.contiguous(), sin.contiguous()
    (t, nh, hd), nkv = q.shape, k.shape[1]
    q_out, k_out = torch.empty(q.shape, dtype=q.dtype, device=q.device), torch.empty(
        k.shape, dtype=k.dtype, device=k.device)
    if t:
        _rotary_kernel[(t, 2)](
            q, k, q_out, k_out, positions, cos, sin, cos.stride(0),
            q.stride(0), q.stride(1), k.stride(0), k.stride(1),
            NH=nh, NKV=nkv, HD=hd, RD=rotary_dim, BLOCK_QH=triton.next_power_of_2(nh),
            BLOCK_KH=triton.next_power_of_2(nkv), BLOCK_D=triton.next_power_of_2(hd), num_warps=4)
    return q_out, k_out


# -- KV store: a layer's new keys and values (or MLA's latent and rope key) into their pools --
STORE_BLOCK = 1024      # elements of a row per loop step


@triton.jit
def _store_row(src, pool, t, slot, stride_t, D: tl.constexpr, BLOCK: tl.constexpr):
    for lo in tl.static_range(0, D, BLOCK):
        d = lo + tl.arange(0, BLOCK)
        x = tl.load(src + t * stride_t + d, mask=d < D)
        tl.store(pool + slot * D + d, x.to(pool.dtype.element_ty), mask=d < D)


@triton.jit
def _store_kv_kernel(slots, k, v, k_pool, v_pool, stride_k, stride_v,
                     DK: tl.constexpr, DV: tl.constexpr, BLOCK: tl.constexpr):
    """Program t copies row t of k and of v (each [T, D*] with unit inner strides) into row
    slots[t] of its pool ([S, D*], contiguous)."""
    t = tl.program_id(0).to(tl.int64)
    slot = tl.load(slots + t).to(tl.int64)
    _store_row(k, k_pool, t, slot, stride_k, DK, BLOCK)
    _store_row(v, v_pool, t, slot, stride_v, DV, BLOCK)


def _rows(x: torch.Tensor) -> torch.Tensor:
    """[T, n, d] -> a [T, n*d] view with a unit inner stride (a copy only if there is none)."""
    if x.stride(-1) != 1 or (x.shape[1] > 1 and x.stride(1) != x.shape[2]):
        x = x.contiguous()
    return x.as_strided((x.shape[0], x.shape[1] * x.shape[2]), (x.stride(0), 1))


def store_kv(k_pool: torch.Tensor, v_pool: torch.Tensor, slots: torch.Tensor, k: torch.Tensor,
             v: torch.Tensor) -> None:
    """k [T, n, dk] -> k_pool [S, n, dk] at slots [T] (int64), v likewise into v_pool, cast to
    the pools' dtype (the same rounding as Tensor.to; not for fp8 pools, which scale first).
    What kv_cache.PagedKVCache.write's two index_copy_ do, in one launch."""
    t = slots.shape[0]
    if not t:
        return
    k, v = _rows(k), _rows(v)
    _store_kv_kernel[(t,)](slots, k, v, k_pool, v_pool, k.stride(0), v.stride(0),
                           DK=k.shape[1], DV=v.shape[1], BLOCK=STORE_BLOCK, num_warps=4)
