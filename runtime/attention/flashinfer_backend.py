"""FlashInfer backend (GPU, optional dependency `flashinfer-python`): the batch prefill/append
wrapper over the paged cache, planned once per forward (per mask variant), run per layer.
FlashInfer's causal mask is aligned bottom-right, i.e. a query at position prefix+i sees keys
0..prefix+i - exactly our contract."""
from __future__ import annotations

import torch

try:
    import flashinfer
except ImportError as e:  # registry turns this into a clear start-up error
    raise ImportError(f"flashinfer is not installed ({e})") from e

from runtime.attention.base import AttentionBackend
from runtime.attention.metadata import AttentionMetadata

WORKSPACE_BYTES = 128 * 1024 * 1024


class FlashInferAttentionBackend(AttentionBackend):
    name = "flashinfer"

    def __init__(self, cache, num_heads, num_kv_heads, head_dim, scale) -> None:
        super().__init__(cache, num_heads, num_kv_heads, head_dim, scale)
        if cache.k.device.type != "cuda":
            raise ValueError("the flashinfer backend needs --device cuda")
        self._workspace = torch.empty(WORKSPACE_BYTES, dtype=torch.uint8, device=cache.k.device)
        self._wrappers: dict[tuple[bool, int], object] = {}
        self._planned: set[tuple[bool, int]] = set()

    def prepare(self, meta: AttentionMetadata) -> None:
        super().prepare(meta)
        device = meta.page_tables.device
        kv_lens = meta.kv_lens
        pages = [-(-n // meta.page_size) for n in kv_lens]
        indices = [p for row, n in zip(meta.page_lists, pages) for p in row[:n]]
        cu_q, cu_p = meta.cu_q_lens, [0]
        for n in pages:
            cu_p.append(cu_p[-1] + n)
        last = [n - (p - 1) * meta.page_size for n, p in zip(kv_lens, pages)]
        i32 = dict(dtype=torch.int32, device=device)
        self._plan_args = (torch.tensor(cu_q, **i32), torch.tensor(cu_p, **i32),
                           torch.tensor(indices, **i32), torch.tensor(last, **i32))
        self._planned.clear()

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

    def attend(self, layer: int, q: torch.Tensor, causal: bool, window: int | None
               ) -> torch.Tensor:
        ps = self.meta.page_size
        kc = self.cache.k[layer].view(-1, ps, self.num_kv_heads, self.head_dim)
        vc = self.cache.v[layer].view(-1, ps, self.num_kv_heads, self.head_dim)
        return self._wrapper(causal, window or 0).run(q.to(kc.dtype).contiguous(), (kc, vc))
