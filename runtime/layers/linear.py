"""Linear layers (y = x W^T + b) whose fp32 CPU GEMM is chosen per process.

torch's default fp32 CPU GEMM is MKL's sgemm called as x · Wᵀ. On the AMD EPYC cores of the CPU
machines (AVX2) it is slow at the row counts decoding uses: 1..16 rows of a SmolLM2 matrix
move 8..17 GB/s, and a whole forward is bound by it (bench/results/cpu_gemm.json):
  - oneDNN's matmul (the kernel torch's CPU inductor emits, reached through
    `torch.ops.mkldnn._linear_pointwise` on the plain dense weight) runs the same shapes about
    2x faster at every row count;
  - at 1..4 rows, MKL itself is faster still when the weight is the left operand, W · xᵀ,
    with 1 row padded to 2 and 3 to 4 (its fastest shapes there): a SmolLM2 forward of 1..4
    tokens then costs about what one token costs, which is what makes small verify blocks
    cheap on the CPU.

On an Intel Xeon with AMX (300 MB of L3) MKL's x · Wᵀ reads cold weights at about 20 GB/s for one
row but at half that for four (it packs W on every call), and neither oneDNN on the plain weight
nor W · xᵀ is faster there; oneDNN on a weight **reordered once** into its blocked layout
(`_reorder_linear_weight`) costs at 4..16 rows about what one row costs (a SmolLM2 forward's
GEMMs at 4 rows: 32-36 ms against 51-66 with MKL, docs/benchmarks.md). The reordered copy is kept
beside the weight (one more copy of the model's fp32 matrices) only where the start-up measurement
chooses it.

Registry of CPU GEMMs: 'auto' (the default where torch has oneDNN: per row count the fastest of
W · xᵀ (1..4 rows), oneDNN, oneDNN on reordered weights and F.linear, measured on the host at
start-up; before that, or where nothing was measured, W · xᵀ at 1..4 rows and oneDNN above) |
'onednn' | 'torch' (F.linear, MKL). Results differ only in fp32 rounding. oneDNN sees
rows padded to a few dozen counts (onednn_rows): it keeps memory for every shape it meets.
Only inference on the CPU in fp32 is routed: anything that needs a gradient (training), other
dtypes and other devices always take F.linear."""
from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from functools import partial

import torch
import torch.nn.functional as F
from torch import nn

from runtime import batch_invariance
from runtime.layers.gemm_calibration import DEFAULT_TABLE, GemmTable, calibrate, cpu_matrices

log = logging.getLogger("dflash.gemm")

Gemm = Callable[[torch.Tensor, torch.Tensor, torch.Tensor | None], torch.Tensor]


def _onednn_available() -> bool:
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")


ONEDNN_MAX_ROWS = 1024


def onednn_rows(rows: int) -> int:
    """The row count oneDNN computes for `rows`: itself up to 8, else up to a multiple of 8
    (<= 64) or of 64. oneDNN builds and keeps a primitive per distinct shape and the process
    never gets that memory back (about 0.6 MB per shape measured: +900 MB over 1 500 shapes), so
    the shapes of a serving process, whose batches have any number of rows, are kept to a few
    dozen per weight."""
    if rows <= 8:
        return rows
    return -(-rows // 8) * 8 if rows <= 64 else -(-rows // 64) * 64


PADDED_ROWS = {1: 2, 2: 2, 3: 4, 4: 4}     # rows -> rows computed by _weight_left_2d


def _rows(x: torch.Tensor) -> int:
    """Rows of x [..., K] seen as a matrix [rows, K]."""
    k = x.shape[-1]
    return x.numel() // k if k else 0


def _pad_rows(x: torch.Tensor, rows: int) -> torch.Tensor:
    """x [M, K] -> [rows, K] (rows >= M), zero rows appended; x itself when rows == M."""
    return x if rows == x.shape[0] else torch.cat([x, x.new_zeros(rows - x.shape[0], x.shape[1])])


def _onednn_2d(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None
               ) -> torch.Tensor:
    """x [M, K] with 0 < M <= ONEDNN_MAX_ROWS -> [M, N]: oneDNN on onednn_rows(M) rows."""
    m = x.shape[0]
    return torch.ops.mkldnn._linear_pointwise(_pad_rows(x, onednn_rows(m)), weight, bias,
                                              "none", [], "")[:m]


PACK_ROWS = 16      # the batch size oneDNN reorders a weight for; the reordered weight serves
                    # every row count (1..16 measured on a Xeon: within 25 % of one row's time)
_PACKED = "_dflash_onednn_packed"   # attribute of a weight: (its version then, the reordered copy)


def _version(weight: torch.Tensor) -> int:
    """The weight's in-place version counter (an inference tensor has none: -1)."""
    try:
        return weight._version
    except RuntimeError:
        return -1


def pack_weights(weights: Iterable[torch.Tensor]) -> None:
    """Keeps beside each fp32 CPU matrix its oneDNN-reordered copy (once; again after an in-place
    change of the weight)."""
    for w in weights:
        if _packed(w) is None:
            setattr(w, _PACKED, (_version(w), torch.ops.mkldnn._reorder_linear_weight(
                w.detach(), PACK_ROWS)))


def unpack_weights(weights: Iterable[torch.Tensor]) -> None:
    """Drops the reordered copies (their memory) that pack_weights kept."""
    for w in weights:
        if hasattr(w, _PACKED):
            delattr(w, _PACKED)


def _packed(weight: torch.Tensor) -> torch.Tensor | None:
    """The weight's reordered copy, if one was kept and the weight has not changed since."""
    kept = getattr(weight, _PACKED, None)
    return kept[1] if kept is not None and kept[0] == _version(weight) else None


def _onednn_packed_2d(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None
                      ) -> torch.Tensor:
    """_onednn_2d on the weight's reordered copy (pack_weights); on the weight itself where none
    was kept (a matrix made after start-up)."""
    packed = _packed(weight)
    return _onednn_2d(x, weight if packed is None else packed, bias)


def _weight_left_2d(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None
                    ) -> torch.Tensor:
    """x [M, K] with M in PADDED_ROWS -> [M, N] contiguous, computed as W [N, K] · xᵀ."""
    m = x.shape[0]
    y = (weight @ _pad_rows(x, PADDED_ROWS[m]).t()).t()[:m].contiguous()
    return y + bias if bias is not None else y


def _as_rows(gemm_2d: Gemm, x: torch.Tensor, rows: int, weight: torch.Tensor,
             bias: torch.Tensor | None) -> torch.Tensor:
    """x [..., K] (rows = _rows(x)) through a GEMM of [rows, K] matrices -> [..., N]."""
    y = gemm_2d(x.reshape(rows, x.shape[-1]), weight, bias)
    return y.view(*x.shape[:-1], weight.shape[0])


def _onednn(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
            gemm_2d: Gemm = _onednn_2d) -> torch.Tensor:
    """x [..., K], weight [N, K] (dense), bias [N] or None -> [..., N] (no autograd): oneDNN on
    rows padded to onednn_rows (gemm_2d: on the plain or the reordered weight), MKL (F.linear)
    above ONEDNN_MAX_ROWS."""
    rows = _rows(x)
    if not 0 < rows <= ONEDNN_MAX_ROWS:
        return F.linear(x, weight, bias)
    return _as_rows(gemm_2d, x, rows, weight, bias)


def _auto(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x [..., K] -> [..., N] through the GEMM the process's table picks for its row count:
    measured on this host at start-up (calibrate_cpu_gemm), else W · xᵀ at 1..4 rows and
    oneDNN above."""
    rows = _rows(x)
    name = _table[0].for_rows(rows)
    if name == "weight_left" and rows in PADDED_ROWS:
        return _as_rows(_weight_left_2d, x, rows, weight, bias)
    if name == "torch":
        return F.linear(x, weight, bias)
    return _onednn(x, weight, bias, _onednn_packed_2d if name == "onednn_packed" else _onednn_2d)


CPU_GEMMS: dict[str, Gemm] = {"torch": F.linear}
if _onednn_available():
    CPU_GEMMS["onednn"] = _onednn
    CPU_GEMMS["auto"] = _auto

DEFAULT_CPU_GEMM = "auto" if "auto" in CPU_GEMMS else "torch"
_active: list[str] = [DEFAULT_CPU_GEMM]
_table: list[GemmTable] = [DEFAULT_TABLE]         # what 'auto' follows


def calibrate_cpu_gemm(tensors: Iterable[torch.Tensor]) -> GemmTable | None:
    """With 'auto' active: times the candidate GEMMs on this host for the shapes of the fp32
    CPU matrices among `tensors` (a model's parameters) and makes 'auto' follow the fastest
    per row count (runtime/layers/gemm_calibration.py). None when 'auto' is not active."""
    if _active[0] != "auto":
        return None
    weights = cpu_matrices(tensors)
    gemms = {"weight_left": _weight_left_2d, "onednn": _onednn, "torch": F.linear}
    if hasattr(torch.ops.mkldnn, "_reorder_linear_weight"):     # (a torch build without it:
        gemms["onednn_packed"] = partial(_onednn, gemm_2d=_onednn_packed_2d)   # the other three)
    _table[0] = calibrate(weights, gemms, prepare=partial(pack_weights, weights)
                          if "onednn_packed" in gemms else None)
    if "onednn_packed" in _table[0].choice.values():
        pack_weights(weights)
    else:
        unpack_weights(weights)
    return _table[0]


def set_cpu_gemm(name: str) -> None:
    """Chooses the process's fp32 CPU GEMM ('auto' | 'onednn' | 'torch')."""
    if name not in CPU_GEMMS:
        raise ValueError(f"unknown CPU GEMM {name!r}: this torch build offers "
                         f"{' | '.join(sorted(CPU_GEMMS))}")
    if name != _active[0]:
        log.info("cpu gemm", extra={"gemm": name})
    _active[0] = name


def cpu_gemm() -> str:
    return _active[0]


def native_bf16_gemm() -> bool:
    """torch's oneDNN runs bf16 GEMMs natively on this CPU (AVX-512 core, or Arm with bf16): its
    own check for its bf16 path. Where it does, bf16 beats every fp32 GEMM above at a few rows
    (half the weight bytes); where it does not (AVX2 only), bf16 is emulated and slow."""
    check = getattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", None)
    return bool(torch.backends.mkldnn.is_available() and check is not None and check())


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
           ) -> torch.Tensor:
    """F.linear, through the batch-invariant GEMM under --deterministic
    (runtime/batch_invariance.py), else the chosen CPU GEMM for fp32 inference on the CPU."""
    if batch_invariance.enabled() and not (
            torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad)):
        from runtime.layers.invariant_gemm import invariant_linear
        return invariant_linear(x, weight, bias)
    if (x.device.type == "cpu" and x.dtype == torch.float32 and weight.dtype == torch.float32
            and not (torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad))):
        return CPU_GEMMS[_active[0]](x, weight, bias)
    return F.linear(x, weight, bias)


class Linear(nn.Linear):
    """nn.Linear (same parameters and names) whose forward is `linear`."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias)
