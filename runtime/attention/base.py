"""The attention backend interface shared by the target (verify/prefill) and the draft (block)."""
from __future__ import annotations

from abc import ABC, abstractmethod

import torch

from runtime.attention.metadata import AttentionMetadata
from runtime.kv_cache import PagedKVCache


class AttentionBackend(ABC):
    """Computes attention of new tokens over their sequence's paged history.

    Contract: `prepare(meta)` once per forward, then `forward(layer, q, k, v)` per layer, which
    first stores the new k/v at meta.slot_mapping, then attends. A query at position prefix+i sees
    keys 0..prefix+i when meta.causal (or a window of them), and keys 0..prefix+q_len-1 otherwise.
    """

    name: str = "base"
    supports_trees: bool = False     # reads meta.tree_masks (a verified tree of drafts)
    supports_latent_kv: bool = False  # MLA: a latent cache (KVLayout.latent_value_dim)
    supports_fp8_kv: bool = False     # float8_e4m3fn pages with per-layer scales (KVScales)

    def __init__(self, cache: PagedKVCache, num_heads: int, num_kv_heads: int, head_dim: int,
                 scale: float) -> None:
        self.cache = cache
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = scale
        self.meta: AttentionMetadata | None = None

    def prepare(self, meta: AttentionMetadata) -> None:
        self.meta = meta

    # -- CUDA graphs (runtime/cuda_graphs.py) -----------------------------------------------
    @property
    def captures_cuda_graphs(self) -> bool:
        """Whether forwards through this backend can be captured by a GraphRunner: the backend
        reads its per-forward inputs from device buffers that bind() hands it once at capture
        and the runner refills before each replay (plus plan_graph()'s host work)."""
        return False

    def bind(self, cu_q: torch.Tensor, prefix: torch.Tensor, tables: torch.Tensor,
             max_q_len: int, tree: torch.Tensor | None = None) -> None:
        """Point the backend at a graph's static buffers: cu_q int32 [bs+1], prefix int32 [bs],
        tables int32 [bs, P], tree int64 [T, W] or None."""
        raise NotImplementedError(f"the {self.name} backend is not captured in CUDA graphs")

    def plan_graph(self, q_len: int, prefix_lens: list[int], page_lists: list[list[int]],
                   max_pages: int) -> None:
        """Host work before a captured graph of len(prefix_lens) sequences appending q_len
        tokens each runs (its capture and every replay), from the host's view of the batch
        (dummy sequences included: prefix 0, pages [0]). Nothing for kernels that read
        everything from the bound buffers (triton)."""

    def store_kv(self, layer: int, k: torch.Tensor, v: torch.Tensor,
                 slot_mapping: torch.Tensor) -> None:
        """k, v [T, nkv, hd] -> cache slots [T] (a latent cache: the latent and the rope key)."""
        self.cache.write(layer, slot_mapping, k, v)

    def forward(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                causal: bool | None = None, window: int | None = None) -> torch.Tensor:
        """q [T, nh, hd], k/v [T, nkv, hd] -> out [T, nh, value_dim] (hd; MLA: k the latent,
        v the rope key, out the latent's width). `causal`/`window` override meta."""
        self.store_kv(layer, k, v, self.meta.slot_mapping)
        return self.attend(layer, q, self.meta.causal if causal is None else causal, window)

    @abstractmethod
    def attend(self, layer: int, q: torch.Tensor, causal: bool, window: int | None
               ) -> torch.Tensor:
        """q [T, nh, hd] over the layer's cache (the new k/v are already stored) -> [T, nh, hd]."""
