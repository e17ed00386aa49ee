"""CUDA graphs of a per-row function at bucketed row counts: fn(rows, positions, slots) writes
its results into the KV cache (the drafter's context append: features -> per-layer k/v -> cache
slots). A call with n rows replays the smallest bucket >= n; the padding rows read zeros and
write into the cache's scratch page 0 (never part of a sequence), so they change nothing."""
from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

import torch

log = logging.getLogger("dflash.graphs")

ROW_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)


@dataclass
class _Rows:
    rows: torch.Tensor           # [b, width] input rows (device)
    positions: torch.Tensor      # int64 [b]
    slots: torch.Tensor          # int64 [b]
    graph: torch.cuda.CUDAGraph | None = None


class RowGraphs:
    def __init__(self, fn: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], None],
                 width: int, dtype: torch.dtype, device: torch.device, page_size: int,
                 buckets: tuple[int, ...] = ROW_BUCKETS) -> None:
        self.fn, self.width, self.dtype, self.device = fn, width, dtype, device
        self.page_size = page_size
        self.buckets = tuple(sorted(buckets))
        self.graphs: dict[int, _Rows] = {}

    def capture(self) -> None:
        pool = None
        for b in reversed(self.buckets):
            st = _Rows(rows=torch.zeros(b, self.width, dtype=self.dtype, device=self.device),
                       positions=torch.zeros(b, dtype=torch.int64, device=self.device),
                       slots=torch.arange(b, device=self.device) % self.page_size)
            torch.cuda.synchronize()
            for _ in range(2):                      # kernels compiled / autotuned off-graph
                self.fn(st.rows, st.positions, st.slots)
            st.graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(st.graph, pool=pool):
                self.fn(st.rows, st.positions, st.slots)
            pool = st.graph.pool()
            self.graphs[b] = st
        torch.cuda.synchronize()
        log.info("row graphs captured", extra={"buckets": self.buckets})

    def run(self, rows: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor) -> bool:
        """rows [n, width] (host or device), positions / slots int64 [n] (host). False (nothing
        done) when n exceeds the largest bucket: the caller runs fn eagerly."""
        n = rows.shape[0]
        b = next((x for x in self.buckets if x >= n), None)
        if b is None:
            return False
        st = self.graphs[b]
        st.rows[:n].copy_(rows, non_blocking=True)
        st.rows[n:].zero_()
        pad = torch.arange(b - n) % self.page_size             # scratch page 0
        st.positions.copy_(torch.cat([positions, torch.zeros(b - n, dtype=torch.int64)]),
                           non_blocking=True)
        st.slots.copy_(torch.cat([slots, pad]), non_blocking=True)
        st.graph.replay()
        return True
