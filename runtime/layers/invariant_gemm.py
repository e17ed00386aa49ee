"""A batch-invariant GEMM (runtime/batch_invariance.py): y = x W^T + b whose every output row is
bitwise the same whatever the other rows of x are and however many there are.

One program computes a [BLOCK_M, BLOCK_N] tile of y, walking K in BLOCK_K steps in order and
accumulating in fp32 (no split-K: one program owns each output element's whole reduction). The
tile shape and warps come from the weight's shape alone (`tile_for`), never from the row count,
so a row meets the same MMA instructions and the same order of partial sums in a one-token
decode, a verify block and a batch of 512 rows.

  x  [..., K] (rows = x.numel() // K), weight [N, K] (row-major), bias [N] or None -> [..., N]
  in x's dtype; fp32 inputs reduce in IEEE fp32 (the tests), 16-bit ones on the tensor cores."""
from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _gemm_kernel(x, w, bias, y, M, N, K, stride_xm, stride_wn, stride_ym,
                 HAS_BIAS: tl.constexpr, PRECISION: tl.constexpr,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    pid_m = tl.program_id(0)              # row tiles vary fastest: neighbours share a weight tile
    pid_n = tl.program_id(1)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        kk = k0 + rk
        a = tl.load(x + rm[:, None] * stride_xm + kk[None, :],
                    mask=(rm[:, None] < M) & (kk[None, :] < K), other=0.0)
        b = tl.load(w + rn[None, :] * stride_wn + kk[:, None],
                    mask=(rn[None, :] < N) & (kk[:, None] < K), other=0.0)
        acc = tl.dot(a, b, acc, input_precision=PRECISION)
    if HAS_BIAS:
        acc += tl.load(bias + rn, mask=rn < N, other=0.0).to(tl.float32)[None, :]
    tl.store(y + rm[:, None] * stride_ym + rn[None, :], acc.to(y.dtype.element_ty),
             mask=(rm[:, None] < M) & (rn[None, :] < N))


def tile_for(n: int, k: int) -> tuple[int, int, int, int, int]:
    """(BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages) for a weight [n, k]: a function of the
    weight alone. Chosen on an H100 at 16 and 512 rows (bench.invariant_gemm_gpu, 2026-12-06):
    wide weights (an MLP's gate_up, the LM head) take 128-column tiles, the rest 64 x 128."""
    if n >= 16384:
        return 64, 128, 64, 4, 3
    return 64, 64, 128, 4, 3


def invariant_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
                     ) -> torch.Tensor:
    """F.linear through the batch-invariant kernel (no autograd)."""
    n, k = weight.shape
    x2 = x.reshape(-1, k)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    weight = weight if weight.stride(-1) == 1 else weight.contiguous()
    m = x2.shape[0]
    y = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m:
        bm, bn, bk, warps, stages = tile_for(n, k)
        grid = (triton.cdiv(m, bm), triton.cdiv(n, bn))
        _gemm_kernel[grid](x2, weight, bias if bias is not None else weight, y, m, n, k,
                           x2.stride(0), weight.stride(0), y.stride(0),
                           HAS_BIAS=bias is not None,
                           PRECISION="ieee" if x.dtype == torch.float32 else "tf32",
                           BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, num_warps=warps, num_stages=stages)
    return y.view(*x.shape[:-1], n)
