"""CUDA graphs for fixed-shape forwards: every sequence of the batch appends exactly q_len tokens
(verify blocks on the target, propose blocks on the draft). Graphs are captured per batch-size
bucket, largest first, into one memory pool; a smaller batch is padded with dummy sequences that
write into the cache's scratch page 0. Requires a backend with `bind()` (triton)."""
from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

import torch

from runtime.attention.metadata import AttentionMetadata, SeqSlice
from runtime.kv_cache import PagedKVCache
from runtime.models.forward import ForwardOutput

log = logging.getLogger("dflash.graphs")

DEFAULT_BUCKETS = (1, 2, 4, 8, 16, 32)


@dataclass
class _Static:
    """Device buffers a captured graph reads (refilled before each replay) and writes."""
    input_ids: torch.Tensor      # int64 [bs*q]
    positions: torch.Tensor      # int64 [bs*q]
    slots: torch.Tensor          # int64 [bs*q]
    cu_q: torch.Tensor           # int32 [bs+1]
    prefix: torch.Tensor         # int32 [bs]
    tables: torch.Tensor         # int32 [bs, max_pages]
    out: ForwardOutput | None = None
    graph: torch.cuda.CUDAGraph | None = None


class GraphRunner:
    """forward(input_ids, positions, meta) runs the model with the backend bound to `meta`;
    here it is captured once per bucket and replayed."""

    def __init__(self, forward: Callable[[torch.Tensor, torch.Tensor, AttentionMetadata], ForwardOutput],
                 backend, cache: PagedKVCache, q_len: int, max_context: int, causal: bool,
                 buckets: tuple[int, ...] = DEFAULT_BUCKETS) -> None:
        self.forward, self.backend, self.cache = forward, backend, cache
        self.q_len, self.causal, self.buckets = q_len, causal, tuple(sorted(buckets))
        self.max_pages = cache.pages_for(max_context + q_len)
        self.device = cache.k.device
        self.graphs: dict[int, _Static] = {}
        self.pool = None

    def capture(self) -> None:
        for bs in reversed(self.buckets):
            st = self._alloc(bs)
            self._fill_dummy(st, 0)
            meta = self._static_meta(st, bs)
            torch.cuda.synchronize()
            for _ in range(2):                      # warm up kernels (autotune, JIT) off-graph
                self._run_static(st, meta)
            st.graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(st.graph, pool=self.pool):
                st.out = self._run_static(st, meta)
            self.pool = st.graph.pool()
            self.graphs[bs] = st
        torch.cuda.synchronize()
        log.info("cuda graphs captured", extra={"q_len": self.q_len, "buckets": self.buckets})

    def bucket(self, bs: int) -> int | None:
        return next((b for b in self.buckets if b >= bs), None)

    def can_run(self, slices: list[SeqSlice]) -> bool:
        return (self.bucket(len(slices)) is not None and all(s.q_len == self.q_len for s in slices)
                and all(len(s.table.pages) <= self.max_pages for s in slices))

    def run(self, slices: list[SeqSlice], input_ids: torch.Tensor, positions: torch.Tensor
            ) -> ForwardOutput:
        bs = len(slices)
        st = self.graphs[self.bucket(bs)]
        n = bs * self.q_len
        st.input_ids[:n].copy_(input_ids, non_blocking=True)
        st.positions[:n].copy_(positions, non_blocking=True)
        meta = AttentionMetadata.build(slices, self.cache, self.causal, self.device)
        st.slots[:n].copy_(meta.slot_mapping)
        width = meta.page_tables.shape[1]
        st.tables[:bs, :width].copy_(meta.page_tables)
        st.tables[:bs, width:].zero_()
        st.prefix[:bs].copy_(torch.tensor(meta.prefix_lens, dtype=torch.int32), non_blocking=True)
        self._fill_dummy(st, bs)
        st.graph.replay()
        captured = st.out.captured[:n] if st.out.captured is not None else None
        return ForwardOutput(hidden=st.out.hidden[:n], captured=captured)

    # -- internals -------------------------------------------------------------------------
    def _alloc(self, bs: int) -> _Static:
        i64 = dict(dtype=torch.int64, device=self.device)
        i32 = dict(dtype=torch.int32, device=self.device)
        n = bs * self.q_len
        return _Static(
            input_ids=torch.zeros(n, **i64), positions=torch.zeros(n, **i64),
            slots=torch.zeros(n, **i64),
            cu_q=torch.arange(0, (bs + 1) * self.q_len, self.q_len, **i32),
            prefix=torch.zeros(bs, **i32), tables=torch.zeros(bs, self.max_pages, **i32))

    def _fill_dummy(self, st: _Static, start: int) -> None:
        """Sequences start.. of the bucket: q_len tokens at positions 0.. in scratch page 0."""
        lo = start * self.q_len
        if lo >= st.input_ids.shape[0]:
            return
        pos = torch.arange(self.q_len, device=self.device).repeat(st.prefix.shape[0] - start)
        st.input_ids[lo:].zero_()
        st.positions[lo:].copy_(pos)
        st.slots[lo:].copy_(pos % self.cache.page_size)
        st.prefix[start:].zero_()
        st.tables[start:].zero_()

    def _static_meta(self, st: _Static, bs: int) -> AttentionMetadata:
        meta = AttentionMetadata(slot_mapping=st.slots, q_lens=[self.q_len] * bs,
                                 prefix_lens=[0] * bs, page_tables=st.tables.long(),
                                 page_size=self.cache.page_size, page_lists=[[0]] * bs,
                                 causal=self.causal)
        return meta

    def _run_static(self, st: _Static, meta: AttentionMetadata) -> ForwardOutput:
        self.backend.meta = meta
        self.backend.bind(st.cu_q, st.prefix, st.tables, self.q_len)
        return self.forward(st.input_ids, st.positions, meta)
