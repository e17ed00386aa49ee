"""A batch-invariant GEMM (runtime/batch_invariance.py): y = x W^T + b whose every output row is
bitwise the same whatever the other rows of x are and however many there are.

One program computes a [BLOCK_M, BLOCK_N] tile of y, walking K in BLOCK_K steps in order and
accumulating in fp32. A weight with few column tiles has K split into a fixed number of parts
(more programs at a few rows), whose fp32 partial sums a second kernel adds in split order - an
order that, like everything else here, does not depend on the rows. The tile, warps and splits
come from the weight's shape alone (`tile_for`), never from the row count, so a row meets the
same MMA instructions and the same order of partial sums in a one-token decode, a verify block
and a batch of 512 rows.

  x  [..., K] (rows = x.numel() // K), weight [N, K] (row-major), bias [N] or None -> [..., N]
  in x's dtype; fp32 inputs reduce in IEEE fp32 (the tests), 16-bit ones on the tensor cores."""
from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _gemm_kernel(x, w, bias, y, M, N, K, K_SPLIT, stride_xm, stride_wn, stride_ym, stride_ys,
                 HAS_BIAS: tl.constexpr, PRECISION: tl.constexpr,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """y[s] (or y, one split) = x[:, Ks] W[:, Ks]^T over split s = program_id(2) of K:
    [s * K_SPLIT, (s + 1) * K_SPLIT), in BLOCK_K steps in order. Several splits write fp32
    partials (stride_ys apart) that _sum_splits adds; one writes y in its dtype, with bias."""
    pid_m = tl.program_id(0)              # row tiles vary fastest: neighbours share a weight tile
    pid_n = tl.program_id(1)
    split = tl.program_id(2)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    k_lo = split * K_SPLIT
    k_hi = tl.minimum(k_lo + K_SPLIT, K)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(k_lo, k_hi, BLOCK_K):
        kk = k0 + rk
        a = tl.load(x + rm[:, None] * stride_xm + kk[None, :],
                    mask=(rm[:, None] < M) & (kk[None, :] < k_hi), other=0.0)
        b = tl.load(w + rn[None, :] * stride_wn + kk[:, None],
                    mask=(rn[None, :] < N) & (kk[:, None] < k_hi), other=0.0)
        acc = tl.dot(a, b, acc, input_precision=PRECISION)
    if HAS_BIAS:
        acc += tl.load(bias + rn, mask=rn < N, other=0.0).to(tl.float32)[None, :]
    tl.store(y + split * stride_ys + rm[:, None] * stride_ym + rn[None, :],
             acc.to(y.dtype.element_ty), mask=(rm[:, None] < M) & (rn[None, :] < N))


@triton.jit
def _sum_splits(parts, bias, y, MN, N, SPLITS: tl.constexpr, HAS_BIAS: tl.constexpr,
                BLOCK: tl.constexpr):
    """y = parts[0] + parts[1] + ... (+ bias), added in that order: parts fp32 [SPLITS, M*N]."""
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = i < MN
    acc = tl.load(parts + i, mask=ok, other=0.0)
    for s in tl.static_range(1, SPLITS):
        acc += tl.load(parts + s * MN + i, mask=ok, other=0.0)
    if HAS_BIAS:
        acc += tl.load(bias + i % N, mask=ok, other=0.0).to(tl.float32)
    tl.store(y + i, acc.to(y.dtype.element_ty), mask=ok)


def tile_for(n: int, k: int) -> tuple[int, int, int, int, int, int]:
    """(BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages, K splits) for a weight [n, k]: a
    function of the weight alone. Chosen on an H100 at 16 and 512 rows (bench.invariant_gemm_gpu,
    2026-12-06): wide weights (an MLP's gate_up, the LM head) take 128-column tiles, the rest
    64 x 64 x 128; no K split yet (128 x 128 tiles with K split per weight are the candidates
    for the 512-row cost, measured by the benchmark, not yet on a GPU)."""
    if n >= 16384:
        return 64, 128, 64, 4, 3, 1
    return 64, 64, 128, 4, 3, 1


def launch(x2: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, y: torch.Tensor,
           tile: tuple[int, int, int, int, int, int]) -> None:
    """y [M, N] = x2 [M, K] weight^T (+ bias) with this tile: one kernel, or with K splits the
    kernel's fp32 partials and their sum in a fixed order."""
    bm, bn, bk, warps, stages, splits = tile
    m, (n, k) = x2.shape[0], weight.shape
    k_split = triton.cdiv(triton.cdiv(k, splits), bk) * bk           # a whole number of BLOCK_K
    out = y if splits == 1 else torch.empty(splits, m, n, dtype=torch.float32, device=y.device)
    _gemm_kernel[(triton.cdiv(m, bm), triton.cdiv(n, bn), splits)](
        x2, weight, bias if bias is not None and splits == 1 else weight, out, m, n, k, k_split,
        x2.stride(0), weight.stride(0), n if splits > 1 else y.stride(0), m * n,
        HAS_BIAS=bias is not None and splits == 1,
        PRECISION="ieee" if x2.dtype == torch.float32 else "tf32",
        BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, num_warps=warps, num_stages=stages)
    if splits > 1:
        block = 1024
        _sum_splits[(triton.cdiv(m * n, block),)](
            out, bias if bias is not None else out, y, m * n, n, SPLITS=splits,
            HAS_BIAS=bias is not None, BLOCK=block)


def invariant_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
                     ) -> torch.Tensor:
    """F.linear through the batch-invariant kernel (no autograd)."""
    n, k = weight.shape
    x2 = x.reshape(-1, k)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    weight = weight if weight.stride(-1) == 1 else weight.contiguous()
    y = torch.empty(x2.shape[0], n, dtype=x.dtype, device=x.device)
    if x2.shape[0]:
        launch(x2, weight, bias, y, tile_for(n, k))
    return y.view(*x.shape[:-1], n)
