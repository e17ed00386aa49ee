"""FlashInfer backend (GPU, optional dependency `flashinfer-python`): the batch prefill/append
wrapper over the paged cache, planned once per forward (per mask variant), run per layer.
FlashInfer's causal mask is aligned bottom-right, i.e. a query at position prefix+i sees keys
0..prefix+i - exactly our contract.

MLA (a latent cache, runtime/models/deepseek.py): FlashInfer's MLA wrapper, reading our two
pools in place (the latent pool is its ckv cache, the rope pool its kpe cache) with the queries
split the same way; causal, no trees (the worker verifies trees with the triton backend);
FlashInfer's MLA kernels are built for kv_lora_rank 512 and qk_rope_head_dim 64 (DeepSeek-V2/V3,
Kimi-K2): other sizes are refused at start-up.

CUDA graphs (MLA models only): each captured shape (batch bucket, tokens per sequence) has its
own MLA wrapper in FlashInfer's cuda-graph mode, whose index buffers are fixed; plan_graph()
plans it on the host before the capture and before every replay, and the replay's kernels read
the plan from the workspace. The captured launches hold pointers the first plan placed in the
workspace, so every later plan of that shape must place them the same way: checked on each
plan (a mismatch raises instead of replaying a stale plan)."""
from __future__ import annotations

import torch

try:
    import flashinfer
except ImportError as e:  # registry turns this into a clear start-up error
    raise ImportError(f"flashinfer is not installed ({e})") from e

from dataclasses import dataclass

from runtime.attention.base import AttentionBackend
from runtime.attention.metadata import AttentionMetadata

WORKSPACE_BYTES = 128 * 1024 * 1024
MLA_DIMS = (512, 64)                    # (kv_lora_rank, qk_rope_head_dim) its MLA kernels take


@dataclass
class _GraphPlan:
    """One captured shape's MLA wrapper (FlashInfer's cuda-graph mode) and the plan it was
    captured with (the workspace offsets its launches point at)."""
    wrapper: object
    captured: tuple | None = None


def _paged_plan(kv_lens: list[int], page_lists: list[list[int]], page_size: int
                ) -> tuple[list[int], list[int], list[int]]:
    """kv_indptr [bs+1], kv_indices (each sequence's pages holding its kv_lens tokens, in
    order) and the tokens on each sequence's last page [bs] - FlashInfer's paged layout."""
    pages = [-(-n // page_size) for n in kv_lens]
    indices = [p for row, n in zip(page_lists, pages) for p in row[:n]]
    indptr = [0]
    for n in pages:
        indptr.append(indptr[-1] + n)
    last = [n - (p - 1) * page_size for n, p in zip(kv_lens, pages)]
    return indptr, indices, last


class FlashInferAttentionBackend(AttentionBackend):
    name = "flashinfer"
    supports_latent_kv = True

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
        self._wrappers: dict[tuple[bool, int], object] = {}
        self._planned: set[tuple[bool, int]] = set()
        self._graph_plans: dict[tuple[int, int], _GraphPlan] = {}   # (bucket, q_len) ->
        self._bound: object | None = None      # the MLA wrapper a graph capture runs with

    @property
    def captures_cuda_graphs(self) -> bool:
        return bool(self.cache.latent_value_dim)

    def prepare(self, meta: AttentionMetadata) -> None:
        super().prepare(meta)
        device = meta.page_tables.device
        kv_lens = meta.kv_lens
        cu_p, indices, last = _paged_plan(kv_lens, meta.page_lists, meta.page_size)
        i32 = {"dtype": torch.int32, "device": device}
        self._plan_args = (torch.tensor(meta.cu_q_lens, **i32), torch.tensor(cu_p, **i32),
                           torch.tensor(indices, **i32), torch.tensor(last, **i32))
        self._kv_lens = torch.tensor(kv_lens, **i32)
        self._planned.clear()
        self._bound = None

    def bind(self, cu_q: torch.Tensor, prefix: torch.Tensor, tables: torch.Tensor,
             max_q_len: int, tree: torch.Tensor | None = None) -> None:
        """A graph capture's forward runs with the wrapper plan_graph() planned for its shape
        (the buffers themselves are read by that plan, on the host)."""
        if tree is not None:
            raise ValueError("the flashinfer backend verifies no trees")
        self._bound = self._graph_plans[(tables.shape[0], max_q_len)].wrapper

    def plan_graph(self, q_len: int, prefix_lens: list[int], page_lists: list[list[int]],
                   max_pages: int) -> None:
        bs, ps = len(prefix_lens), self.cache.page_size
        key = (bs, q_len)
        graph = self._graph_plans.get(key)
        if graph is None:
            i32 = {"dtype": torch.int32, "device": self.cache.k.device}
            graph = self._graph_plans[key] = _GraphPlan(flashinfer.mla.BatchMLAPagedAttentionWrapper(
                self._workspace, use_cuda_graph=True,
                qo_indptr=torch.zeros(bs + 1, **i32), kv_indptr=torch.zeros(bs + 1, **i32),
                kv_indices=torch.zeros(bs * max_pages, **i32), kv_len_arr=torch.zeros(bs, **i32)))
        kv_lens = [p + q_len for p in prefix_lens]
        indptr, indices, _ = _paged_plan(kv_lens, page_lists, ps)
        i32 = {"dtype": torch.int32}
        lat = self.cache.latent_value_dim
        dtype = self.cache.k.dtype
        graph.wrapper.plan(torch.arange(0, (bs + 1) * q_len, q_len, **i32),
                           torch.tensor(indptr, **i32), torch.tensor(indices, **i32),
                           torch.tensor(kv_lens, **i32), self.num_heads, lat,
                           self.head_dim - lat, ps, True, self.scale, dtype, dtype)
        placed = tuple(graph.wrapper._plan_info)
        if graph.captured is None:
            graph.captured = placed
        elif placed != graph.captured:
            raise RuntimeError(f"FlashInfer planned a captured MLA shape {key} differently "
                               f"from its capture ({placed} vs {graph.captured})")

    def _wrapper(self, causal: bool, window: int) -> object:
        key = (causal, window)
        if key not in self._wrappers:
            self._wrappers[key] = flashinfer.BatchPrefillWithPagedKVCacheWrapper(self._workspace, "NHD")
        wrapper = self._wrappers[key]
        if key not in self._planned:
            dtype = self.cache.k.dtype
            wrapper.plan(*self._plan_args, self.num_heads, self.num_kv_heads, self.head_dim,
                         self.meta.page_size, causal=causal, sm_scale=self.scale,
                         window_left=window - 1 if window > 0 else -1,
                         q_data_type=dtype, kv_data_type=dtype)
            self._planned.add(key)
        return wrapper

    def _mla_wrapper(self, dtype: torch.dtype) -> object:
        if self._bound is not None:
            return self._bound
        key = ("mla", 0)
        if key not in self._wrappers:
            self._wrappers[key] = flashinfer.mla.BatchMLAPagedAttentionWrapper(self._workspace)
        wrapper = self._wrappers[key]
        if key not in self._planned:
            lat = self.cache.latent_value_dim
            cu_q, cu_p, indices, _ = self._plan_args
            wrapper.plan(cu_q, cu_p, indices, self._kv_lens, self.num_heads, lat,
                         self.head_dim - lat, self.meta.page_size, True, self.scale, dtype,
                         self.cache.k.dtype)
            self._planned.add(key)
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
        return self._mla_wrapper(q.dtype).run(q[..., :lat], q[..., lat:], ckv, kpe)

    def attend(self, layer: int, q: torch.Tensor, causal: bool, window: int | None
               ) -> torch.Tensor:
        if self.cache.latent_value_dim:
            if not causal or window:
                raise ValueError("the flashinfer backend runs MLA layers causal, without a window")
            return self._attend_latent(layer, q)
        ps = self.meta.page_size
        kc = self.cache.k[layer].view(-1, ps, self.num_kv_heads, self.head_dim)
        vc = self.cache.v[layer].view(-1, ps, self.num_kv_heads, self.head_dim)
        return self._wrapper(causal, window or 0).run(q.to(kc.dtype).contiguous(), (kc, vc))
