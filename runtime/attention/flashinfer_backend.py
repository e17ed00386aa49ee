"""FlashInfer backend (GPU, optional dependency `flashinfer-python`): the batch prefill/append
wrapper over the paged cache, planned once per forward (per mask variant), run per layer.
FlashInfer's causal mask is aligned bottom-right, i.e. a query at position prefix+i sees keys
0..prefix+i - exactly our contract.

MLA (a latent cache, runtime/models/deepseek.py): FlashInfer's MLA wrapper, reading our two
pools in place (the latent pool is its ckv cache, the rope pool its kpe cache) with the queries
split the same way; causal, no trees (the worker verifies trees with the triton backend);
FlashInfer's MLA kernels are built for kv_lora_rank 512 and qk_rope_head_dim 64 (DeepSeek-V2/V3,
Kimi-K2): other sizes are refused at start-up."""
from __future__ import annotations

import torch

try:
    import flashinfer
except ImportError as e:  # registry turns this into a clear start-up error
    raise ImportError(f"flashinfer is not installed ({e})") from e

from runtime.attention.base import AttentionBackend
from runtime.attention.metadata import AttentionMetadata

WORKSPACE_BYTES = 128 * 1024 * 1024
MLA_DIMS = (512, 64)                    # (kv_lora_rank, qk_rope_head_dim) its MLA kernels take


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
        i32 = {"dtype": torch.int32, "device": device}
        self._plan_args = (torch.tensor(cu_q, **i32), torch.tensor(cu_p, **i32),
                           torch.tensor(indices, **i32), torch.tensor(last, **i32))
        self._kv_lens = torch.tensor(kv_lens, **i32)
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

    def _mla_wrapper(self, dtype: torch.dtype) -> object:
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
