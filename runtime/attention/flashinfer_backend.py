"""FlashInfer backend (GPU, optional dependency `flashinfer-python`): the batch prefill/append
wrapper over the paged cache, planned once per forward (per mask variant), run per layer.
FlashInfer's causal mask is aligned bottom-right, i.e. a query at position prefix+i sees keys
0..prefix+i - exactly our contract.

MLA (a latent cache, runtime/models/deepseek.py): FlashInfer's MLA wrapper, reading our two
pools in place (the latent pool is its ckv cache, the rope pool its kpe cache) with the queries
split the same way; causal, no trees (the worker verifies trees with the triton backend);
FlashInfer's MLA kernels are built for kv_lora_rank 512 and qk_rope_head_dim 64 (DeepSeek-V2/V3,
Kimi-K2): other sizes are refused at start-up.

CUDA graphs: each captured shape (batch bucket, tokens per sequence) has its own wrappers, one
per mask variant its layers use, in FlashInfer's cuda-graph mode (fixed index buffers).
plan_graph() takes the host's view of the batch before the capture and before every replay and
plans every variant of that shape (a variant first met while the capture's warm-up runs is
planned then); the replay's kernels read the plan from the workspace. The captured launches
hold the workspace offsets of the plan they were captured with, so every later plan of that
variant must place them the same way: checked on each plan (a mismatch raises instead of
replaying a stale plan)."""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

try:
    import flashinfer
except ImportError as e:  # registry turns this into a clear start-up error
    raise ImportError(f"flashinfer is not installed ({e})") from e

from runtime.attention.base import AttentionBackend
from runtime.attention.metadata import AttentionMetadata

WORKSPACE_BYTES = 128 * 1024 * 1024
MLA_DIMS = (512, 64)                    # (kv_lora_rank, qk_rope_head_dim) its MLA kernels take
MLA = ("mla", 0)                        # the MLA wrapper's variant; dense: (causal, window)


@dataclass(frozen=True)
class _Batch:
    """A forward's batch in FlashInfer's paged layout, int32 tensors on the host (its plan
    schedules on the host and copies what its kernels read to the device itself): qo_indptr
    [bs+1], kv_indptr [bs+1], kv_indices (each sequence's pages, in order), last_page_len [bs],
    kv_lens [bs]."""
    qo_indptr: torch.Tensor
    kv_indptr: torch.Tensor
    kv_indices: torch.Tensor
    last_page_len: torch.Tensor
    kv_lens: torch.Tensor

    @classmethod
    def build(cls, cu_q: list[int], kv_lens: list[int], page_lists: list[list[int]],
              page_size: int) -> _Batch:
        pages = [-(-n // page_size) for n in kv_lens]
        indices = [p for row, n in zip(page_lists, pages) for p in row[:n]]
        indptr = [0]
        for n in pages:
            indptr.append(indptr[-1] + n)
        last = [n - (p - 1) * page_size for n, p in zip(kv_lens, pages)]
        return cls(*(torch.tensor(x, dtype=torch.int32)
                     for x in (cu_q, indptr, indices, last, kv_lens)))


@dataclass
class _GraphShape:
    """One captured shape's wrappers by variant, the plan offsets each was captured with, and
    the batch of the last plan_graph()."""
    bs: int
    max_pages: int
    batch: _Batch | None = None
    wrappers: dict[tuple, object] = field(default_factory=dict)
    captured: dict[tuple, tuple] = field(default_factory=dict)


class FlashInferAttentionBackend(AttentionBackend):
    name = "flashinfer"
    supports_latent_kv = True
    captures_cuda_graphs = True

    def __init__(self, cache, num_heads, num_kv_heads, head_dim, scale) -> None:
        super().__init__(cache, num_heads, num_kv_heads, head_dim, scale)
        if cache.k.device.type != "cuda":
            raise ValueError("the flashinfer backend needs --device cuda")
        lat = cache.latent_value_dim
        if lat and (lat, head_dim - lat) != MLA_DIMS:
            raise ValueError(f"--attention-backend flashinfer runs MLA with kv_lora_rank "
                             f"{MLA_DIMS[0]} and qk_rope_head_dim {MLA_DIMS[1]} only; this model "
                             f"has {lat} and {head_dim - lat} (use triton or torch)")
        self._workspace = torch.empty(WORKSPACE_BYTES, dtype=torch.uint8, device=cache.k.device)
        self._wrappers: dict[tuple, object] = {}        # eager forwards' wrappers by variant
        self._planned: set[tuple] = set()
        self._batch: _Batch | None = None
        self._graphs: dict[tuple[int, int], _GraphShape] = {}   # (bucket, q_len) ->
        self._bound: _GraphShape | None = None      # the shape a graph capture runs

    def prepare(self, meta: AttentionMetadata) -> None:
        super().prepare(meta)
        self._batch = _Batch.build(meta.cu_q_lens, meta.kv_lens, meta.page_lists,
                                   meta.page_size)
        self._planned.clear()
        self._bound = None

    # -- CUDA graphs -----------------------------------------------------------------------
    def bind(self, cu_q: torch.Tensor, prefix: torch.Tensor, tables: torch.Tensor,
             max_q_len: int, tree: torch.Tensor | None = None) -> None:
        """A graph capture's forward runs with the wrappers plan_graph() planned for its shape
        (the buffers themselves are read by that plan, on the host)."""
        if tree is not None:
            raise ValueError("the flashinfer backend verifies no trees")
        self._bound = self._graphs[(tables.shape[0], max_q_len)]

    def plan_graph(self, q_len: int, prefix_lens: list[int], page_lists: list[list[int]],
                   max_pages: int) -> None:
        bs = len(prefix_lens)
        shape = self._graphs.setdefault((bs, q_len), _GraphShape(bs, max_pages))
        shape.batch = _Batch.build(list(range(0, (bs + 1) * q_len, q_len)),
                                   [p + q_len for p in prefix_lens], page_lists,
                                   self.cache.page_size)
        for variant, wrapper in shape.wrappers.items():
            self._plan_graph_variant(shape, variant, wrapper)

    def _graph_wrapper(self, shape: _GraphShape, variant: tuple) -> object:
        """The shape's wrapper of this variant, made (fixed buffers sized for the shape) and
        planned the first time the capture's warm-up asks for it."""
        wrapper = shape.wrappers.get(variant)
        if wrapper is None:
            i32 = {"dtype": torch.int32, "device": self.cache.k.device}
            bs, pages = shape.bs, shape.bs * shape.max_pages
            if variant == MLA:
                wrapper = flashinfer.mla.BatchMLAPagedAttentionWrapper(
                    self._workspace, use_cuda_graph=True,
                    qo_indptr=torch.zeros(bs + 1, **i32), kv_indptr=torch.zeros(bs + 1, **i32),
                    kv_indices=torch.zeros(pages, **i32), kv_len_arr=torch.zeros(bs, **i32))
            else:
                wrapper = flashinfer.BatchPrefillWithPagedKVCacheWrapper(
                    self._workspace, "NHD", use_cuda_graph=True,
                    qo_indptr_buf=torch.zeros(bs + 1, **i32),
                    paged_kv_indptr_buf=torch.zeros(bs + 1, **i32),
                    paged_kv_indices_buf=torch.zeros(pages, **i32),
                    paged_kv_last_page_len_buf=torch.zeros(bs, **i32))
            shape.wrappers[variant] = wrapper
            self._plan_graph_variant(shape, variant, wrapper)
        return wrapper

    def _plan_graph_variant(self, shape: _GraphShape, variant: tuple, wrapper) -> None:
        self._plan(wrapper, variant, shape.batch)
        placed = tuple(wrapper._plan_info)
        if shape.captured.setdefault(variant, placed) != placed:
            raise RuntimeError(f"FlashInfer planned a captured shape (batch {shape.bs}, "
                               f"variant {variant}) differently from its capture")

    # -- planning and running ---------------------------------------------------------------
    def _plan(self, wrapper, variant: tuple, batch: _Batch) -> None:
        dtype = self.cache.k.dtype
        if variant == MLA:
            lat = self.cache.latent_value_dim
            wrapper.plan(batch.qo_indptr, batch.kv_indptr, batch.kv_indices, batch.kv_lens,
                         self.num_heads, lat, self.head_dim - lat, self.cache.page_size, True,
                         self.scale, dtype, dtype)
            return
        causal, window = variant
        wrapper.plan(batch.qo_indptr, batch.kv_indptr, batch.kv_indices, batch.last_page_len,
                     self.num_heads, self.num_kv_heads, self.head_dim, self.cache.page_size,
                     causal=causal, sm_scale=self.scale,
                     window_left=window - 1 if window > 0 else -1,
                     q_data_type=dtype, kv_data_type=dtype)

    def _wrapper(self, variant: tuple) -> object:
        """The wrapper this forward runs a variant with: the bound graph shape's, or the eager
        one (planned once per forward)."""
        if self._bound is not None:
            return self._graph_wrapper(self._bound, variant)
        if variant not in self._wrappers:
            self._wrappers[variant] = (
                flashinfer.mla.BatchMLAPagedAttentionWrapper(self._workspace) if variant == MLA
                else flashinfer.BatchPrefillWithPagedKVCacheWrapper(self._workspace, "NHD"))
        wrapper = self._wrappers[variant]
        if variant not in self._planned:
            self._plan(wrapper, variant, self._batch)
            self._planned.add(variant)
        return wrapper

    def _attend_latent(self, layer: int, q: torch.Tensor) -> torch.Tensor:
        """q [T, nh, lat+rope] -> [T, nh, lat] over the layer's latent pages. The two query
        parts go in as strided views of q (its kernels take a token and a head stride)."""
        ps, lat = self.meta.page_size, self.cache.latent_value_dim
        ckv = self.cache.k[layer].view(-1, ps, lat)
        kpe = self.cache.v[layer].view(-1, ps, self.head_dim - lat)
        q = q.to(self.cache.k.dtype)
        if q.stride(-1) != 1:
            q = q.contiguous()
        return self._wrapper(MLA).run(q[..., :lat], q[..., lat:], ckv, kpe)

    def attend(self, layer: int, q: torch.Tensor, causal: bool, window: int | None
               ) -> torch.Tensor:
        if self.cache.latent_value_dim:
            if not causal or window:
                raise ValueError("the flashinfer backend runs MLA layers causal, without a window")
            return self._attend_latent(layer, q)
        ps = self.meta.page_size
        kc = self.cache.k[layer].view(-1, ps, self.num_kv_heads, self.head_dim)
        vc = self.cache.v[layer].view(-1, ps, self.num_kv_heads, self.head_dim)
        return self._wrapper((causal, window or 0)).run(q.to(kc.dtype).contiguous(), (kc, vc))
