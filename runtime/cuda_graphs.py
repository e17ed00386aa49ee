"""CUDA graphs for fixed-shape forwards: every sequence of the batch appends exactly q_len tokens
(verify blocks on the target, propose blocks on the draft). Graphs are captured per batch-size
bucket, largest first, into one memory pool; a smaller batch is padded with dummy sequences that
write into the cache's scratch page 0. Requires a backend that captures_cuda_graphs (triton;
flashinfer, which plans each replay on the host: plan_graph). A runner made
with tree=True also reads each sequence's tree mask (SeqSlice.tree; causal where it has none)
from a static buffer: verifies of trees of drafts."""
from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

import torch

from runtime.attention.metadata import AttentionMetadata, SeqSlice
from runtime.attention.triton_backend import tree_rows, tree_width
from runtime.kv_cache import PagedKVCache
from runtime.models.forward import ForwardOutput

log = logging.getLogger("dflash.graphs")

DEFAULT_BUCKETS = (1, 2, 4, 8, 16, 32)


@dataclass
class _Static:
    """Device buffers a captured graph reads (refilled before each replay) and writes.
    The int inputs are views into two packed device buffers, filled from pinned host mirrors
    with one copy each (instead of one synchronous pageable copy per tensor)."""
    packed64: torch.Tensor       # int64 [3*bs*q]: input_ids | positions | slots
    packed32: torch.Tensor       # int32 [bs + bs*max_pages]: prefix | tables
    host64: torch.Tensor         # pinned mirrors of the two
    host32: torch.Tensor
    cu_q: torch.Tensor           # int32 [bs+1] (constant)
    bs: int
    n: int                       # bs * q
    tree: torch.Tensor | None = None       # int64 [n, W] tree mask bits (tree runners)
    host_tree: torch.Tensor | None = None  # its pinned mirror
    out: ForwardOutput | None = None
    graph: torch.cuda.CUDAGraph | None = None

    @property
    def input_ids(self) -> torch.Tensor:
        return self.packed64[: self.n]

    @property
    def positions(self) -> torch.Tensor:
        return self.packed64[self.n: 2 * self.n]

    @property
    def slots(self) -> torch.Tensor:
        return self.packed64[2 * self.n:]

    @property
    def prefix(self) -> torch.Tensor:
        return self.packed32[: self.bs]

    @property
    def tables(self) -> torch.Tensor:
        return self.packed32[self.bs:].view(self.bs, -1)


class GraphRunner:
    """forward(input_ids, positions, meta) runs the model with the backend bound to `meta`;
    here it is captured once per bucket and replayed."""

    def __init__(self, forward: Callable[[torch.Tensor, torch.Tensor, AttentionMetadata], ForwardOutput],
                 backend, cache: PagedKVCache, q_len: int, max_context: int, causal: bool,
                 buckets: tuple[int, ...] = DEFAULT_BUCKETS, tree: bool = False) -> None:
        self.forward, self.backend, self.cache = forward, backend, cache
        self.q_len, self.causal, self.buckets = q_len, causal, tuple(sorted(buckets))
        self.tree = tree
        self._causal_bits = tree_rows(None, q_len, tree_width(q_len)) if tree else None
        self.max_pages = cache.pages_for(max_context + q_len)
        self.device = cache.k.device
        self.graphs: dict[int, _Static] = {}
        self.pool = None

    def capture(self) -> None:
        for bs in reversed(self.buckets):
            st = self._alloc(bs)
            self._fill_dummy_host(st, 0)
            st.packed64.copy_(st.host64)
            st.packed32.copy_(st.host32)
            if st.tree is not None:
                st.tree.copy_(st.host_tree)
            self._plan(st, [])
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
        """input_ids, positions: int64 [bs*q] on the host. The caller synchronises with the
        outputs before the next run (the pinned mirrors are rewritten by it)."""
        bs = len(slices)
        st = self.graphs[self.bucket(bs)]
        n, q = bs * self.q_len, self.q_len
        h64, h32 = st.host64, st.host32
        h64[:n].copy_(input_ids)
        h64[st.n: st.n + n].copy_(positions)
        h64[2 * st.n: 2 * st.n + n] = torch.tensor(
            [x for s in slices for x in self.cache.slots(s.table, s.prefix_len, s.prefix_len + q)],
            dtype=torch.int64)
        h32[:bs] = torch.tensor([s.prefix_len for s in slices], dtype=torch.int32)
        tables = h32[st.bs:].view(st.bs, -1)
        tables.zero_()
        for i, s in enumerate(slices):
            tables[i, : len(s.table.pages)] = torch.tensor(s.table.pages, dtype=torch.int32)
        self._fill_dummy_host(st, bs)
        st.packed64.copy_(h64, non_blocking=True)
        st.packed32.copy_(h32, non_blocking=True)
        if st.tree is not None:
            for i, s in enumerate(slices):
                rows = st.host_tree[i * q: (i + 1) * q]
                rows.copy_(tree_rows(s.tree, q, rows.shape[1]) if s.tree is not None
                           else self._causal_bits)
            st.tree.copy_(st.host_tree, non_blocking=True)
        self._plan(st, slices)
        st.graph.replay()
        captured = st.out.captured[:n] if st.out.captured is not None else None
        return ForwardOutput(hidden=st.out.hidden[:n], captured=captured)

    # -- internals -------------------------------------------------------------------------
    def _alloc(self, bs: int) -> _Static:
        n = bs * self.q_len
        size64, size32 = 3 * n, bs + bs * self.max_pages
        tree = host_tree = None
        if self.tree:
            host_tree = self._causal_bits.repeat(bs, 1).pin_memory()
            tree = host_tree.to(self.device)
        return _Static(
            tree=tree, host_tree=host_tree,
            packed64=torch.zeros(size64, dtype=torch.int64, device=self.device),
            packed32=torch.zeros(size32, dtype=torch.int32, device=self.device),
            host64=torch.zeros(size64, dtype=torch.int64, pin_memory=True),
            host32=torch.zeros(size32, dtype=torch.int32, pin_memory=True),
            cu_q=torch.arange(0, (bs + 1) * self.q_len, self.q_len, dtype=torch.int32,
                              device=self.device), bs=bs, n=n)

    def _fill_dummy_host(self, st: _Static, start: int) -> None:
        """Host mirrors of sequences start.. of the bucket: q_len tokens at positions 0.. in
        scratch page 0 (prefix 0, table of page 0)."""
        lo = start * self.q_len
        if lo >= st.n:
            return
        pos = torch.arange(self.q_len).repeat(st.bs - start)
        st.host64[lo: st.n].zero_()
        st.host64[st.n + lo: 2 * st.n].copy_(pos)
        st.host64[2 * st.n + lo:].copy_(pos % self.cache.page_size)
        st.host32[start: st.bs].zero_()
        st.host32[st.bs:].view(st.bs, -1)[start:].zero_()
        if st.host_tree is not None:
            st.host_tree[lo:] = self._causal_bits.repeat(st.bs - start, 1)

    def _plan(self, st: _Static, slices: list[SeqSlice]) -> None:
        """The backend's host work for this replay: the real sequences, then dummies."""
        pad = st.bs - len(slices)
        self.backend.plan_graph(self.q_len, [s.prefix_len for s in slices] + [0] * pad,
                                [s.table.pages for s in slices] + [[0]] * pad, self.max_pages)

    def _static_meta(self, st: _Static, bs: int) -> AttentionMetadata:
        meta = AttentionMetadata(slot_mapping=st.slots, q_lens=[self.q_len] * bs,
                                 prefix_lens=[0] * bs, page_tables=st.tables.long(),
                                 page_size=self.cache.page_size, page_lists=[[0]] * bs,
                                 causal=self.causal)
        return meta

    def _run_static(self, st: _Static, meta: AttentionMetadata) -> ForwardOutput:
        self.backend.meta = meta
        self.backend.bind(st.cu_q, st.prefix, st.tables, self.q_len, st.tree)
        return self.forward(st.input_ids, st.positions, meta)
