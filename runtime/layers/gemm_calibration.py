"""`--cpu-gemm auto`, chosen on the host it runs on (runtime/layers/linear.py).

Which fp32 CPU GEMM is fastest depends on the CPU: on the AMD EPYC hosts MKL's W · xᵀ wins at
1..4 rows and oneDNN above, while on an Intel Xeon with AMX torch's own MKL path (F.linear) beat
both by 1.7x end to end (docs/benchmarks.md). So at start-up, before the service is SERVING, each
model process times the candidates on its own weights' shapes at the row counts it will run and
keeps the fastest per row count: a `GemmTable` that `auto` then follows. A forward's cost at r
rows is estimated as the sum over its distinct weight shapes of (modules of that shape) x (one
product's median time), so the choice is by whole-forward time, not by one matrix."""
from __future__ import annotations

import logging
import statistics
import time
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from functools import partial

import torch

log = logging.getLogger("dflash.gemm")

ROWS = (1, 2, 3, 4, 8, 16, 64)        # representative row counts (a batch of r rows: the first
                                      # entry >= r, the last beyond it)
SMALL_ROWS = 4                        # W · xᵀ is a candidate up to here (PADDED_ROWS)
TARGET_S = 0.006                      # time spent per measurement, about (repeats adapt)
MAX_REPEATS = 3
MARGIN = 0.1                          # another GEMM must beat the fixed rule's by 10 %


@dataclass(frozen=True)
class GemmTable:
    """Representative row count -> the GEMM to use ("weight_left" | "onednn" | "torch")."""
    choice: dict[int, str]

    def for_rows(self, rows: int) -> str:
        for r in ROWS:
            if rows <= r:
                return self.choice[r]
        return self.choice[ROWS[-1]]

    def describe(self) -> str:
        return " ".join(f"{r}:{self.choice[r]}" for r in ROWS)


# the fixed rule of the AMD EPYC hosts: used when nothing was measured, and kept where a
# measured alternative is not clearly faster
DEFAULT_TABLE = GemmTable({r: "weight_left" if r <= SMALL_ROWS else "onednn" for r in ROWS})


def weight_shapes(tensors: Iterable[torch.Tensor]) -> Counter:
    """[N, K] shapes of the fp32 CPU matrices among `tensors` -> how many there are."""
    return Counter(tuple(t.shape) for t in tensors
                   if t.dim() == 2 and t.dtype == torch.float32 and t.device.type == "cpu")


def choose(timings: dict[tuple[int, str], float]) -> GemmTable:
    """(rows, candidate) -> estimated forward seconds => per row count the fastest candidate,
    unless the fixed rule's is within MARGIN of it (then the fixed rule's: a measurement's noise
    should not flip the choice). Pure: the tests give it synthetic timings."""
    choice = {}
    for r in ROWS:
        best_s, best = min((s, name) for (rows, name), s in timings.items() if rows == r)
        fixed = DEFAULT_TABLE.choice[r]
        keep = timings.get((r, fixed), float("inf")) <= best_s * (1 + MARGIN)
        choice[r] = fixed if keep else best
    return GemmTable(choice)


def _time_one(fn: Callable[[], torch.Tensor]) -> float:
    """Median seconds of fn after one warm call (oneDNN builds its primitive there); about
    TARGET_S of repeats, at least one."""
    t0 = time.perf_counter()
    fn()
    warm = time.perf_counter() - t0
    times = []
    for _ in range(max(1, min(MAX_REPEATS, int(TARGET_S / max(warm, 1e-6))))):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def measure(shapes: Counter, gemms: dict[str, Callable]) -> dict[tuple[int, str], float]:
    """(rows, candidate) -> sum over shapes of count x one product's median time, on random
    fp32 weights of those shapes (the values do not change the time)."""
    weights = {shape: torch.randn(shape) * 0.02 for shape in shapes}
    out: dict[tuple[int, str], float] = {}
    with torch.inference_mode():
        for rows in ROWS:
            inputs = {shape: torch.randn(rows, shape[1]) for shape in shapes}
            for name, gemm in gemms.items():
                if name == "weight_left" and rows > SMALL_ROWS:
                    continue
                out[(rows, name)] = sum(
                    count * _time_one(partial(gemm, inputs[shape], weights[shape], None))
                    for shape, count in shapes.items())
    return out


def calibrate(tensors: Iterable[torch.Tensor], gemms: dict[str, Callable]) -> GemmTable:
    """The table for a model whose matrices are among `tensors`; DEFAULT_TABLE when it has no
    fp32 CPU matrix or a candidate fails (logged: the service starts with the fixed rule)."""
    shapes = weight_shapes(tensors)
    if not shapes:
        return DEFAULT_TABLE
    t0 = time.perf_counter()
    try:
        table = choose(measure(shapes, gemms))
    except Exception as e:  # noqa: BLE001 - a kernel that fails here: keep the fixed rule
        log.warning("cpu gemm calibration failed (%s: %s); using the fixed rule %s",
                    type(e).__name__, e, DEFAULT_TABLE.describe())
        return DEFAULT_TABLE
    log.info("cpu gemm calibrated", extra={"table": table.describe(), "shapes": len(shapes),
                                           "seconds": round(time.perf_counter() - t0, 2)})
    return table
