"""Triton's interpreter (TRITON_INTERPRET=1, the CPU tests) computes `tl.dot` with numpy's
matmul, i.e. the host's BLAS. A GPU's MMA adds a row's K products in an order fixed by the tile
whatever row of the tile it is; the BLAS need not: on an AMD EPYC of the Zen 3 generation
(OpenBLAS's Haswell kernels) a row's fp32 result depends on where it sits in the tile, so a row
computed alone and the same row in a block of 16 differ in the last bit - which the
batch-invariance tests (tests/test_batch_invariance.py) and `bench.invariant_gemm_gpu --tiny`
were written to catch in our kernels, not in the emulator. `make_dots_row_independent` replaces
the interpreter's dot with products summed over K in order for every output element (the same
arithmetic for every row). For the interpreter only (the CPU tests and tiny benchmarks): the
kernels' code is unchanged, and on a GPU nothing here runs."""
from __future__ import annotations

import numpy as np


def row_independent_matmul(a: np.ndarray, b: np.ndarray, dtype: np.dtype) -> np.ndarray:
    """a [..., M, K] @ b [..., K, N] in `dtype`: every output element the sum over k = 0..K-1,
    in that order, of a[m, k] * b[k, n] (the reduced axis is not the innermost one, so numpy
    adds along it one k after another for every (m, n) alike)."""
    a, b = a.astype(dtype, copy=False), b.astype(dtype, copy=False)
    return (a[..., :, :, None] * b[..., None, :, :]).sum(axis=-2, dtype=dtype)


def make_dots_row_independent() -> None:
    """Patches the interpreter's dot (Triton's InterpreterBuilder.create_dot), once."""
    from triton.runtime import interpreter
    builder = interpreter.InterpreterBuilder
    if getattr(builder.create_dot, "row_independent", False):
        return
    original = builder.create_dot

    def create_dot(self, a, b, d, *args, **kwargs):
        if a.data.dtype.itemsize == 1 or b.data.dtype.itemsize == 1:   # fp8: as Triton does it
            return original(self, a, b, d, *args, **kwargs)
        out = row_independent_matmul(a.data, b.data, d.data.dtype) + d.data
        return interpreter.TensorHandle(out, d.dtype.scalar)

    create_dot.row_independent = True
    builder.create_dot = create_dot
