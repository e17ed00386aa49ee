"""`--cpu-gemm auto`, chosen on the host it runs on (runtime/layers/linear.py).

Which fp32 CPU GEMM is fastest depends on the CPU: on the AMD EPYC hosts MKL's W · xᵀ wins at
1..4 rows and oneDNN above, while on an Intel Xeon with AMX torch's own MKL path (F.linear) beat
both by 1.7x end to end (docs/benchmarks.md). So at start-up, before the service is SERVING, each
model process times the candidates on its own matrices at the row counts it will run and keeps
the fastest per row count: a `GemmTable` that `auto` then follows. A forward's cost at r rows is
measured as a pass of one product per matrix over a sample of the model's own weights (every
shape in proportion, more bytes than the last-level cache), each read once and cold as in a
forward, so the choice is by whole-forward time, not by one matrix hot in the
cache.

A table measured once is kept on the host (`$DFLASH_HOME/cache/cpu_gemm/`, one JSON per CPU,
torch build, thread count and set of shapes) and reused by every later start of a model of the
same shapes there: the same choice each start instead of a fresh noisy one, and about 1.5 s less
start-up per model process. Delete the folder to measure again."""
from __future__ import annotations

import hashlib
import json
import logging
import os
import platform
import time
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

import torch

from runtime.home import models_home

log = logging.getLogger("dflash.gemm")

ROWS = (1, 2, 3, 4, 8, 16, 64)        # representative row counts (a batch of r rows: the first
                                      # entry >= r, the last beyond it)
SMALL_ROWS = 4                        # W · xᵀ is a candidate up to here (PADDED_ROWS)
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


def cpu_matrices(tensors: Iterable[torch.Tensor]) -> list[torch.Tensor]:
    """The fp32 CPU matrices among `tensors` (a model's parameters, in its order), each once."""
    seen: set[int] = set()
    out = []
    for t in tensors:
        if (t.dim() == 2 and t.dtype == torch.float32 and t.device.type == "cpu"
                and id(t) not in seen):
            seen.add(id(t))
            out.append(t)
    return out


def weight_shapes(tensors: Iterable[torch.Tensor]) -> Counter:
    """[N, K] shapes of the fp32 CPU matrices among `tensors` -> how many there are."""
    return Counter(tuple(t.shape) for t in cpu_matrices(tensors))


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


def last_level_cache_bytes() -> int:
    """The largest CPU cache's size (sysfs); 32 MiB where it cannot be read."""
    sizes = []
    for f in Path("/sys/devices/system/cpu/cpu0/cache").glob("index*/size"):
        try:
            text = f.read_text().strip().upper()
            sizes.append(int(text.rstrip("KM")) << (20 if text.endswith("M") else 10))
        except (OSError, ValueError):
            continue
    return max(sizes, default=32 << 20)


def cold_bytes() -> int:
    """Bytes of weights a pass reads (a sample of the model's matrices): twice the last-level cache
    (300 MB on one Xeon, 32 MB on the EPYCs), so each is read from memory as in a forward;
    within [64 MiB, 1 GiB]."""
    return min(max(2 * last_level_cache_bytes(), 64 << 20), 1 << 30)


def sample(weights: list[torch.Tensor], limit: int) -> list[torch.Tensor]:
    """About `limit` bytes of the model's matrices, in its order: the same share of every shape
    (at least one matrix of each), so a pass over them reads each from memory as a forward does
    and stands for the whole forward once each shape's time is scaled by its count."""
    total = sum(w.numel() * w.element_size() for w in weights)
    share = min(1.0, limit / total) if total else 1.0
    keep = {s: max(1, round(n * share)) for s, n in weight_shapes(weights).items()}
    taken: Counter = Counter()
    out = []
    for w in weights:
        shape = tuple(w.shape)
        if taken[shape] < keep[shape]:
            taken[shape] += 1
            out.append(w)
    return out


def _pass_seconds(gemm: Callable, inputs: dict[int, torch.Tensor], weights: list[torch.Tensor],
                  scale: dict[tuple[int, ...], float]) -> float:
    """One product per matrix, in order (each weight read once, cold, as a forward reads it):
    the sum of each product's seconds times its shape's scale (count in the model / in
    `weights`)."""
    total = 0.0
    for w in weights:
        t0 = time.perf_counter()
        gemm(inputs[w.shape[1]], w, None)
        total += (time.perf_counter() - t0) * scale[tuple(w.shape)]
    return total


def measure(weights: list[torch.Tensor], gemms: dict[str, Callable]
            ) -> dict[tuple[int, str], float]:
    """(rows, candidate) -> estimated seconds of a forward's GEMMs: one pass per candidate over
    a sample of the model's own matrices (about cold_bytes() of them, a quarter above 16 rows;
    every shape in proportion, scaled to the whole model), after a product on one matrix of each
    shape (oneDNN builds its primitives there). Timing one small matrix again and again
    measures it hot in the cache, which ranked the candidates wrongly on a host with a 300 MB L3
    (MKL's x · Wᵀ looked best at 4 rows there and cost 1.4-1.6x the reordered oneDNN weight in a
    forward)."""
    counts = weight_shapes(weights)
    out: dict[tuple[int, str], float] = {}
    with torch.inference_mode():
        for rows in ROWS:
            # above 16 rows a GEMM is bound by arithmetic more than by memory: a quarter of the
            # bytes is enough there (and a pass at 64 rows is the dearest)
            used = sample(weights, cold_bytes() // (4 if rows > 16 else 1))
            used_counts = weight_shapes(used)
            scale = {s: counts[s] / used_counts[s] for s in used_counts}
            inputs = {k: torch.randn(rows, k) for k in {w.shape[1] for w in used}}
            names = [n for n in gemms if n != "weight_left" or rows <= SMALL_ROWS]
            firsts = list({tuple(w.shape): w for w in reversed(used)}.values())
            for name in names:
                _pass_seconds(gemms[name], inputs, firsts, dict.fromkeys(scale, 0.0))
            for name in names:
                out[(rows, name)] = _pass_seconds(gemms[name], inputs, used, scale)
    return out


def calibrate(tensors: Iterable[torch.Tensor], gemms: dict[str, Callable],
              cache: Path | None = None, prepare: Callable[[], None] | None = None) -> GemmTable:
    """The table for a model whose matrices are among `tensors`; DEFAULT_TABLE when it has no
    fp32 CPU matrix or a candidate fails (logged: the service starts with the fixed rule).
    cache: the folder of kept tables (None: cache_dir()); a table kept for this host and these
    shapes is reused, a measured one is kept. prepare: called before measuring (not when a kept
    table is reused), e.g. to reorder the weights a candidate reads."""
    weights = cpu_matrices(tensors)
    shapes = weight_shapes(weights)
    if not shapes:
        return DEFAULT_TABLE
    file = (cache or cache_dir()) / f"{cache_key(shapes, gemms)}.json"
    kept = read_table(file)
    if kept is not None:
        log.info("cpu gemm table reused", extra={"table": kept.describe(), "file": str(file)})
        return kept
    t0 = time.perf_counter()
    try:
        if prepare is not None:
            prepare()
        table = choose(measure(weights, gemms))
    except Exception as e:  # noqa: BLE001 - a kernel that fails here: keep the fixed rule
        log.warning("cpu gemm calibration failed (%s: %s); using the fixed rule %s",
                    type(e).__name__, e, DEFAULT_TABLE.describe())
        return DEFAULT_TABLE
    log.info("cpu gemm calibrated", extra={"table": table.describe(), "shapes": len(shapes),
                                           "seconds": round(time.perf_counter() - t0, 2)})
    write_table(file, table)
    return table


def cache_dir() -> Path:
    return models_home() / "cache" / "cpu_gemm"


def cpu_name() -> str:
    """The CPU's model name with its family/model/stepping (/proc/cpuinfo; else platform's)."""
    try:
        info = Path("/proc/cpuinfo").read_text()
    except OSError:
        return platform.processor() or platform.machine()
    fields = {}
    for line in info.splitlines():
        key, _, value = line.partition(":")
        fields.setdefault(key.strip(), value.strip())
    return " ".join(fields.get(k, "?") for k in ("model name", "cpu family", "model",
                                                  "stepping", "flags"))


def cache_key(shapes: Counter, gemms: dict[str, Callable]) -> str:
    """What a table depends on: the CPU (and its flags), the torch build, the threads the
    products run on, the shapes with their counts, the candidates and the row counts."""
    what = {"cpu": cpu_name(), "torch": torch.__version__, "threads": torch.get_num_threads(),
            "shapes": sorted([list(shape), n] for shape, n in shapes.items()),
            "gemms": sorted(gemms), "rows": ROWS, "margin": MARGIN, "method": "cold passes"}
    return hashlib.sha256(json.dumps(what, sort_keys=True).encode()).hexdigest()[:24]


def read_table(file: Path) -> GemmTable | None:
    """The table kept in `file`; None when there is none or it does not read as one."""
    try:
        choice = {int(r): name for r, name in json.loads(file.read_text())["choice"].items()}
    except (OSError, ValueError, KeyError, AttributeError, TypeError):
        return None
    if sorted(choice) != sorted(ROWS) or not all(isinstance(v, str) for v in choice.values()):
        return None
    return GemmTable(choice)


def write_table(file: Path, table: GemmTable) -> None:
    """Kept atomically (another process may be writing the same table); a folder that cannot
    be written only costs the next start its measurement."""
    try:
        file.parent.mkdir(parents=True, exist_ok=True)
        tmp = file.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps({"choice": {str(r): n for r, n in table.choice.items()}}))
        tmp.replace(file)
    except OSError as e:
        log.warning("cpu gemm table not kept (%s: %s)", type(e).__name__, e)
