"""Paged KV cache: one pool of fixed-size pages shared by all sequences, page tables per sequence.

With a prefix cache (runtime/prefix_cache.py), full pages of committed tokens are kept under
their prefix's key after their sequence ends, and a new sequence whose tokens start the same way
takes them instead of computing them: pages are reference-counted, and a cached page nobody
references is reused for others only when no free page is left (least recently used first)."""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from runtime.layers.fused import triton_ops_for
from runtime.prefix_cache import ROOT, PrefixCache, page_keys


class OutOfPages(Exception):
    """Raised when the pool cannot hold a sequence's next tokens."""


@dataclass
class PageTable:
    """The pages one sequence owns, in position order. Position p lives in
    slot pages[p // page_size] * page_size + p % page_size."""
    pages: list[int] = field(default_factory=list)
    keys: list[bytes] = field(default_factory=list)   # prefix keys of its first full pages


FP8_E4M3_MAX = 448.0


@dataclass(frozen=True)
class KVLayout:
    """What a model stores per token and attention layer, and how attention reads it.
    Dense: K and V of head_dim per KV head. MLA (DeepSeek-V2/V3): one latent "head" whose key
    is head_dim = kv_lora_rank + qk_rope_head_dim wide and whose value is its first
    latent_value_dim (= kv_lora_rank) dims; attention runs in the weight-absorbed form (queries
    of head_dim, outputs of latent_value_dim per head). The cache keeps such a key in two
    pools, as FlashInfer's MLA kernels read them: K the latent (also the values), V the rope
    part."""
    num_layers: int
    num_heads: int               # query heads
    num_kv_heads: int
    head_dim: int                # stored key width per KV head (= query width per head)
    scale: float                 # softmax scale
    latent_value_dim: int = 0    # MLA: values are keys[..., :latent_value_dim]; 0 = own V

    @property
    def value_dim(self) -> int:
        """Attention output width per head."""
        return self.latent_value_dim or self.head_dim


@dataclass(frozen=True)
class KVScales:
    """fp8 caches: per-layer scales of keys and values (stored = x / scale)."""
    k: tuple[float, ...]
    v: tuple[float, ...]

    @staticmethod
    def ones(num_layers: int) -> KVScales:
        return KVScales((1.0,) * num_layers, (1.0,) * num_layers)


class PagedKVCache:
    """K and V for every layer, as flat slot arrays: k[layer] is [num_pages * page_size, nkv, hd].
    Page 0 is reserved as a scratch page (padding writes land there), so usable pages are 1..N-1.

    latent_value_dim > 0 (MLA): a key of head_dim is stored split, its first latent_value_dim
    dims (the latent, also the values) in k and the rest (the rope key) in v, written so by the
    model; `gather` joins them for backends that read whole keys.
    dtype torch.float8_e4m3fn: entries are stored as x / scale (clamped to the format's range) and
    read back as entry * scale (`write`, `dequant`): per-tensor scales per layer (KVScales), from
    the checkpoint's k_scale / v_scale where it has them, else 1.0 (as vLLM and SGLang do)."""

    def __init__(self, num_layers: int, num_kv_heads: int, head_dim: int, page_size: int,
                 num_pages: int, dtype: torch.dtype, device: torch.device | str,
                 prefix_cache: PrefixCache | None = None, *, latent_value_dim: int = 0,
                 scales: KVScales | None = None) -> None:
        """prefix_cache: None = no prefix caching (every page is private to one sequence).
        scales: fp8 only (default 1.0 for every layer)."""
        if num_pages < 2:
            raise ValueError(f"the KV budget gives {num_pages} pages; at least 2 are needed")
        self.page_size = page_size
        self.num_pages = num_pages
        self.latent_value_dim = latent_value_dim
        self.fp8 = dtype == torch.float8_e4m3fn
        self.scales = scales or KVScales.ones(num_layers)
        shape = (num_layers, num_pages * page_size, num_kv_heads)
        k_dim, v_dim = ((latent_value_dim, head_dim - latent_value_dim) if latent_value_dim
                        else (head_dim, head_dim))
        self.k = torch.zeros(shape + (k_dim,), dtype=dtype, device=device)
        self.v = torch.zeros(shape + (v_dim,), dtype=dtype, device=device)
        # pop() hands out low ids first, and a freed page is the next one taken: a sequence's
        # pages are mostly consecutive, which lets the CPU attention read its K/V in place
        # (first_slot_if_consecutive)
        self._free: list[int] = list(range(num_pages - 1, 0, -1))
        self._refs = [0] * num_pages    # sequences holding each page
        self.prefix_cache = prefix_cache

    @staticmethod
    def bytes_per_page(num_layers: int, num_kv_heads: int, head_dim: int, page_size: int,
                       dtype: torch.dtype, latent: bool = False) -> int:
        """latent (MLA): keys only (latent and rope parts together)."""
        return (1 if latent else 2) * num_layers * page_size * num_kv_heads * head_dim * dtype.itemsize

    @classmethod
    def for_layout(cls, layout: KVLayout, page_size: int, num_pages: int, dtype: torch.dtype,
                   device: torch.device | str, prefix_cache: PrefixCache | None = None,
                   scales: KVScales | None = None) -> PagedKVCache:
        return cls(layout.num_layers, layout.num_kv_heads, layout.head_dim, page_size, num_pages,
                   dtype, device, prefix_cache, latent_value_dim=layout.latent_value_dim,
                   scales=scales)

    @staticmethod
    def layout_bytes_per_page(layout: KVLayout, page_size: int, dtype: torch.dtype) -> int:
        return PagedKVCache.bytes_per_page(layout.num_layers, layout.num_kv_heads,
                                           layout.head_dim, page_size, dtype,
                                           latent=bool(layout.latent_value_dim))

    # -- contents ------------------------------------------------------------------------------
    def values(self, layer: int) -> torch.Tensor:
        """The layer's values [slots, nkv, value_dim]: V, or the latent pool (MLA)."""
        return self.k[layer] if self.latent_value_dim else self.v[layer]

    def gather(self, layer: int, index: torch.Tensor | slice
               ) -> tuple[torch.Tensor, torch.Tensor]:
        """Entries at slot `index` (any shape) of the layer, not dequantised: (keys [..., nkv,
        head_dim], values [..., nkv, value_dim]); an MLA key is its two pools joined. A slice of
        consecutive slots reads them in place (views, no copy)."""
        k = self.k[layer][index]
        if not self.latent_value_dim:
            return k, self.v[layer][index]
        return torch.cat([k, self.v[layer][index]], dim=-1), k

    def write(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """k, v [T, nkv, dim] -> slots [T] of the layer, each into its pool. Latent (MLA): k is
        the latent [T, 1, latent_value_dim] and v the rope key [T, 1, rest], both at the key
        scale (one key)."""
        ops = None if self.fp8 else triton_ops_for(k)
        if ops is not None:                 # CUDA: both pools in one launch
            ops.store_kv(self.k[layer], self.v[layer], slots, k, v)
            return
        k_scale, v_scale = self.scales.k[layer], self.scales.v[layer]
        _index_copy(self.k[layer], slots, self._quantize(k, k_scale))
        _index_copy(self.v[layer], slots,
                    self._quantize(v, k_scale if self.latent_value_dim else v_scale))

    def dequant(self, layer: int, entries: torch.Tensor, dtype: torch.dtype, values: bool = False
                ) -> torch.Tensor:
        """Gathered keys (or values) of a layer -> dtype, times their scale when stored as fp8
        (a latent cache's values are its keys: the key scale)."""
        out = entries.to(dtype)
        scale = self.layer_scales(layer)[1 if values else 0]
        return out * scale if scale != 1.0 else out

    def layer_scales(self, layer: int) -> tuple[float, float]:
        """(key scale, value scale) a kernel applies to the layer's entries (1.0 unless fp8)."""
        if not self.fp8:
            return 1.0, 1.0
        k = self.scales.k[layer]
        return k, (k if self.latent_value_dim else self.scales.v[layer])

    def _quantize(self, x: torch.Tensor, scale: float) -> torch.Tensor:
        if not self.fp8:
            return x.to(self.k.dtype)
        x = x.float() / scale if scale != 1.0 else x.float()
        return x.clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX).to(self.k.dtype)

    @property
    def usable_pages(self) -> int:
        return self.num_pages - 1

    @property
    def free_pages(self) -> int:
        """Pages a sequence can take: free ones and cached ones nobody references."""
        return len(self._free) + self.idle_pages

    @property
    def cached_pages(self) -> int:
        """Pages the prefix cache holds, referenced or not (0 without one)."""
        return len(self.prefix_cache) if self.prefix_cache is not None else 0

    @property
    def idle_pages(self) -> int:
        """Cached pages no sequence references (reusable; evicted when taken)."""
        return self.prefix_cache.idle_pages if self.prefix_cache is not None else 0

    @property
    def used_pages(self) -> int:
        return self.usable_pages - self.free_pages

    def usage(self) -> float:
        return self.used_pages / self.usable_pages

    def pages_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.page_size)

    def ensure(self, table: PageTable, num_tokens: int) -> None:
        """Grow `table` to hold positions [0, num_tokens). All or nothing."""
        need = self.pages_for(num_tokens) - len(table.pages)
        if need <= 0:
            return
        if need > self.free_pages:
            raise OutOfPages(f"KV cache full: {need} more pages needed, {self.free_pages} free "
                             f"of {self.usable_pages} ({self.page_size} tokens per page)")
        table.pages.extend(self._take() for _ in range(need))

    def trim(self, table: PageTable, num_tokens: int) -> None:
        """Return pages past what positions [0, num_tokens) need."""
        keep = self.pages_for(num_tokens)
        while len(table.pages) > keep:
            self._drop(table.pages.pop())
        del table.keys[keep:]

    def release(self, table: PageTable) -> None:
        """The sequence's pages go back (its cached pages stay cached: its last page is the
        first to be evicted)."""
        while table.pages:
            self._drop(table.pages.pop())
        table.keys.clear()

    # -- prefix caching ----------------------------------------------------------------------
    def attach_prefix(self, table: PageTable, keys: list[bytes]) -> int:
        """An empty table takes the cached pages of the longest prefix of `keys` (page_keys of
        its tokens); returns the positions they hold."""
        assert not table.pages, "a prefix is attached to a new sequence"
        if self.prefix_cache is None:
            return 0
        for page in self.prefix_cache.match(keys):
            self._refs[page] += 1
            self.prefix_cache.used(page)
            table.pages.append(page)
        table.keys = keys[: len(table.pages)]
        return len(table.pages) * self.page_size

    def cache_full_pages(self, table: PageTable, tokens: list[int], committed: int) -> None:
        """The table's pages that positions [0, committed) fill completely enter the cache
        (tokens: at least those positions' tokens). Only committed positions: a page holding
        a rejected draft's KV is never full below the committed length."""
        if self.prefix_cache is None:
            return
        full, known = min(committed, len(tokens)) // self.page_size, len(table.keys)
        if full <= known:
            return
        keys = page_keys(tokens[: full * self.page_size], self.page_size, known,
                         table.keys[-1] if table.keys else ROOT)
        for i, key in enumerate(keys, start=known):
            self.prefix_cache.insert(key, table.pages[i])
        table.keys.extend(keys)

    def clear_prefix_cache(self) -> None:
        """Forgets every cached page nobody references (they become free)."""
        if self.prefix_cache is not None:
            self._free.extend(self.prefix_cache.clear())

    def _take(self) -> int:
        page = self._free.pop() if self._free else self.prefix_cache.evict()
        self._refs[page] = 1
        return page

    def _drop(self, page: int) -> None:
        self._refs[page] -= 1
        if self._refs[page] > 0:
            return
        if self.prefix_cache is not None and self.prefix_cache.cached(page):
            evicted = self.prefix_cache.unused(page)
            if evicted is not None:
                self._free.append(evicted)
        else:
            self._free.append(page)

    def slots(self, table: PageTable, start: int, end: int) -> list[int]:
        """Flat slot ids of positions [start, end) (pages must already exist)."""
        return self.slots_of(table, range(start, end))

    def copy_positions(self, table: PageTable, src: list[int], dst: list[int]) -> None:
        """K/V of positions src[i] -> positions dst[i], every layer (a verified tree's accepted
        path moved into place). All sources are read before any destination is written. Pairs
        already in place are skipped; the slots go to the device in one copy."""
        pairs = [(a, b) for a, b in zip(self.slots_of(table, src), self.slots_of(table, dst))
                 if a != b]
        if not pairs:
            return
        s, d = torch.tensor(pairs, device=self.k.device).T
        for pool in (self.k, self.v):
            raw = _raw(pool)
            raw[:, d] = raw[:, s]

    def slots_of(self, table: PageTable, positions) -> list[int]:
        """Flat slot ids of the given positions (pages must already exist)."""
        ps = self.page_size
        return [table.pages[p // ps] * ps + p % ps for p in positions]


def first_slot_if_consecutive(pages: list[int], num_tokens: int, page_size: int) -> int | None:
    """The slot of position 0 when positions [0, num_tokens) lie in consecutive slots (their
    pages are consecutive ascending ids), else None."""
    first = pages[0]
    for i in range(1, -(-num_tokens // page_size)):
        if pages[i] != first + i:
            return None
    return first * page_size


def _raw(t: torch.Tensor) -> torch.Tensor:
    """fp8 pools are copied as bytes (CPU index kernels have no float8 variant)."""
    return t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t


def _index_copy(pool: torch.Tensor, slots: torch.Tensor, x: torch.Tensor) -> None:
    _raw(pool).index_copy_(0, slots, _raw(x))
