"""A batch-invariant GEMM (runtime/batch_invariance.py): y = x W^T + b whose every output row is
bitwise the same whatever the other rows of x are and however many there are.

One program computes a [BLOCK_M, BLOCK_N] tile of y, walking K in BLOCK_K steps in order and
accumulating in fp32. A weight with few column tiles may have K split into a fixed number of
parts (more programs at a few rows), whose fp32 partial sums a second kernel adds in split order -
an order that does not depend on the rows. What a row's result depends on is the order in which
its K products are added, and that is fixed per weight: the K split (if any) by the weight's shape
alone, never by the row count.

The tile's other dimensions may follow the row count on a GPU (`tile_for`): there every tile
without a K split adds a row's K products in 16-wide MMA steps in K order into one fp32
accumulator, whatever its BLOCK_M, BLOCK_N and BLOCK_K, so a 64 x 64 tile at a verify block and a
128 x 128 tile at a batch of 512 rows give the same bits. Measured on an H100
(bench/results/gpu/session38/invariant_gemm*.json: at 128 and 512 rows every tile measured -
BLOCK_M 64 and 128, BLOCK_N 32 to 256, BLOCK_K 32 to 128 - equals cuBLAS bitwise, so each other,
and each gives a row the same bits alone, in a block of 16 and in a batch of 512) and tested on a
GPU (tests/test_batch_invariance.py). Triton's interpreter (the CPU tests) computes a tile's dot with
numpy, whose order follows the tile's shape, so there the tile is the weight's alone. The kernel
can also load through TMA descriptors (Hopper and later; a candidate the benchmark measures).

  x  [..., K] (rows = x.numel() // K), weight [N, K] (row-major), bias [N] or None -> [..., N]
  in x's dtype; fp32 inputs reduce in IEEE fp32 (the tests), 16-bit ones on the tensor cores."""
from __future__ import annotations

import functools
from typing import NamedTuple

import torch
import triton
import triton.language as tl


@triton.jit
def _gemm_kernel(x, w, bias, y, M, N, K, K_SPLIT, stride_xm, stride_wn, stride_ym, stride_ys,
                 HAS_BIAS: tl.constexpr, PRECISION: tl.constexpr, TMA: tl.constexpr,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """y[s] (or y, one split) = x[:, Ks] W[:, Ks]^T over split s = program_id(2) of K:
    [s * K_SPLIT, (s + 1) * K_SPLIT), in BLOCK_K steps in order. Several splits write fp32
    partials (stride_ys apart) that _sum_splits adds; one writes y in its dtype, with bias.
    TMA: x and w are tensor descriptors of [BLOCK_M, BLOCK_K] and [BLOCK_N, BLOCK_K] blocks
    (zero beyond the tensor; a split's bounds are whole BLOCK_Ks), else pointers."""
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
        if TMA:
            a = x.load([pid_m * BLOCK_M, k0])
            b = w.load([pid_n * BLOCK_N, k0]).T
        else:
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


class Tile(NamedTuple):
    """One launch configuration. Rows' bits depend on `splits` (and BLOCK_K off the GPU) only."""
    bm: int
    bn: int
    bk: int
    warps: int
    stages: int
    splits: int = 1
    tma: bool = False                   # loads through TMA descriptors (Hopper and later)

    def __str__(self) -> str:
        return ",".join(map(str, self[:6])) + (",tma" if self.tma else "")


BIG_BATCH_ROWS = 256                    # from here the 128 x 128 tiles of batches of blocks


def tile_for(n: int, k: int, rows: int = 1, gpu: bool = True) -> Tile:
    """The tile for a weight [n, k] at `rows` rows: never a K split; 64 x 64 x 128 tiles (64 x
    128 x 64 for wide weights: an MLP's gate_up, the LM head), and on a GPU from BIG_BATCH_ROWS
    rows 128 x 128 x 64 (8 warps; 4 stages for weights no wider than deep) - one family there,
    the same bits (see the module's docstring); off the GPU the weight's tile at every row count.
    From bench.invariant_gemm_gpu on an H100 (2026-12-06): at 512 rows the 128 x 128 tiles take
    0.62-0.84x the time of the smaller ones for the Qwen3-8B shape's weights (the forward's GEMMs
    about 17.2 against 24.1 ms; cuBLAS 12.5); at 16 rows they are slower (1.1-1.4x)."""
    if gpu and rows >= BIG_BATCH_ROWS:
        return Tile(128, 128, 64, 8, 4 if n <= k else 3)
    if n >= 16384:
        return Tile(64, 128, 64, 4, 3)
    return Tile(64, 64, 128, 4, 3)


@functools.cache
def has_tma() -> bool:
    """TMA descriptors: Triton has them and the GPU is a Hopper or later."""
    try:
        from triton.tools.tensor_descriptor import TensorDescriptor  # noqa: F401
    except ImportError:
        return False
    return torch.cuda.is_available() and torch.cuda.get_device_capability()[0] >= 9


def _tma_ok(*tensors: torch.Tensor) -> bool:
    """TMA needs 16-byte aligned bases and row strides."""
    return all(t.data_ptr() % 16 == 0 and t.stride(0) * t.element_size() % 16 == 0
               for t in tensors)


def launch(x2: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, y: torch.Tensor,
           tile: Tile | tuple) -> None:
    """y [M, N] = x2 [M, K] weight^T (+ bias) with this tile: one kernel, or with K splits the
    kernel's fp32 partials and their sum in a fixed order."""
    tile = tile if isinstance(tile, Tile) else Tile(*tile)    # tile_for's, or a bench's tuple
    bm, bn, bk, warps, stages, splits, tma = tile
    m, (n, k) = x2.shape[0], weight.shape
    k_split = triton.cdiv(triton.cdiv(k, splits), bk) * bk           # a whole number of BLOCK_K
    out = y if splits == 1 else torch.empty(splits, m, n, dtype=torch.float32, device=y.device)
    xa, wa = x2, weight
    tma = tma and _tma_ok(x2, weight)
    if tma:
        from triton.tools.tensor_descriptor import TensorDescriptor
        xa = TensorDescriptor.from_tensor(x2, [bm, bk])
        wa = TensorDescriptor.from_tensor(weight, [bn, bk])
    _gemm_kernel[(triton.cdiv(m, bm), triton.cdiv(n, bn), splits)](
        xa, wa, bias if bias is not None and splits == 1 else weight, out, m, n, k, k_split,
        x2.stride(0), weight.stride(0), n if splits > 1 else y.stride(0), m * n,
        HAS_BIAS=bias is not None and splits == 1,
        PRECISION="ieee" if x2.dtype == torch.float32 else "tf32", TMA=tma,
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
        launch(x2, weight, bias, y, tile_for(n, k, x2.shape[0], x.is_cuda))
    return y.view(*x.shape[:-1], n)
