"""The reference backend: gathers each sequence's paged K/V and calls SDPA. CPU and CUDA."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from runtime.attention.base import AttentionBackend
from runtime.attention.metadata import AttentionMetadata
from runtime.kv_cache import first_slot_if_consecutive


class TorchAttentionBackend(AttentionBackend):
    name = "torch"
    supports_trees = True
    supports_latent_kv = True
    supports_fp8_kv = True

    def prepare(self, meta: AttentionMetadata) -> None:
        super().prepare(meta)
        ps = meta.page_size
        kv_lens = meta.kv_lens
        self._kv_index_built: torch.Tensor | None = None     # _kv_index, when a gather needs it
        self._uniform = (len(set(meta.q_lens)) == 1 and len(set(kv_lens)) == 1
                         and meta.tree_masks is None)
        # (prefix, q_len, causal, window) -> mask: built once per forward, not once per layer
        self._masks: dict[tuple[int, int, bool, int | None], torch.Tensor | None] = {}
        # (sequence, window) -> its tree mask over its keys, also built once per forward
        self._tree_masks: dict[tuple[int, int | None], torch.Tensor] = {}
        self._offsets = meta.cu_q_lens
        # per sequence: the slot of its position 0 when its K/V lie in consecutive slots (read
        # in place, no gather), else None
        self._spans = [first_slot_if_consecutive(pages, n, ps) if pages else None
                       for pages, n in zip(meta.page_lists, kv_lens)]

    @property
    def _kv_index(self) -> torch.Tensor:
        """int64 [bs, max_kv]: each sequence's slot of each position, built on first use in a
        forward (none when every sequence's K/V are read in place)."""
        if self._kv_index_built is None:
            meta, ps = self.meta, self.meta.page_size
            pos = torch.arange(max(meta.kv_lens), device=meta.page_tables.device)
            pages = meta.page_tables[:, (pos // ps).clamp(max=meta.page_tables.shape[1] - 1)]
            self._kv_index_built = pages * ps + pos % ps
        return self._kv_index_built

    def _mask(self, prefix: int, q_len: int, causal: bool, window: int | None
              ) -> torch.Tensor | None:
        """bool [q_len, prefix+q_len] (True = attend), or None when every key is visible."""
        key = (prefix, q_len, causal, window)
        if key not in self._masks:
            self._masks[key] = self._build_mask(prefix, q_len, causal, window)
        return self._masks[key]

    def _build_mask(self, prefix: int, q_len: int, causal: bool, window: int | None
                    ) -> torch.Tensor | None:
        if window is None and (not causal or q_len == 1):    # a lone query sees its whole past
            return None
        device = self.meta.page_tables.device
        qpos = prefix + torch.arange(q_len, device=device)[:, None]
        kpos = torch.arange(prefix + q_len, device=device)[None, :]
        mask = kpos <= qpos if causal else torch.ones_like(kpos <= qpos)
        if window is not None:
            mask = mask & (kpos > qpos - window)
        return mask

    def attend(self, layer: int, q: torch.Tensor, causal: bool, window: int | None
               ) -> torch.Tensor:
        meta = self.meta
        self._layer = layer                           # whose entries, and fp8 scales, _sdpa reads
        if self._uniform:
            return self._forward_uniform(q, causal, window)
        out = q.new_empty(q.shape[:-1] + self.cache.values(layer).shape[-1:])
        trees = meta.tree_masks or [None] * meta.batch_size
        for i, (prefix, q_len) in enumerate(zip(meta.prefix_lens, meta.q_lens)):
            lo, hi = self._offsets[i], self._offsets[i + 1]
            mask = (self._mask(prefix, q_len, causal, window) if trees[i] is None
                    else self._tree_mask(i, prefix, window))
            kb, vb = self._keys_values(i, prefix + q_len)
            out[lo:hi] = self._sdpa(q[None, lo:hi], kb[None], vb[None], mask)[0]
        return out

    def _tree_mask(self, i: int, prefix: int, window: int | None) -> torch.Tensor:
        """Sequence i's tree mask over its prefix + q_len keys (built once per forward)."""
        if (i, window) not in self._tree_masks:
            mask = _tree_mask(self.meta.tree_masks[i], prefix, window)
            self._tree_masks[(i, window)] = mask.to(self.meta.page_tables.device)
        return self._tree_masks[(i, window)]

    def _forward_uniform(self, q, causal, window) -> torch.Tensor:
        meta = self.meta
        bs, q_len, prefix = meta.batch_size, meta.q_lens[0], meta.prefix_lens[0]
        qb = q.view(bs, q_len, self.num_heads, q.shape[-1])
        if bs == 1:
            kb, vb = (t[None] for t in self._keys_values(0, prefix + q_len))
        else:
            kb, vb = self.cache.gather(self._layer, self._kv_index)             # [bs, kv, nkv, hd]
        mask = self._mask(prefix, q_len, causal, window)
        return self._sdpa(qb, kb, vb, mask).reshape(-1, self.num_heads, vb.shape[-1])

    def _keys_values(self, i: int, kv_len: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Sequence i's first kv_len keys and values of the current layer [kv_len, nkv, dim]:
        views where its slots are consecutive, else gathered."""
        start = self._spans[i]
        index = (slice(start, start + kv_len) if start is not None
                 else self._kv_index[i, :kv_len])
        return self.cache.gather(self._layer, index)

    def _sdpa(self, q, k, v, mask) -> torch.Tensor:
        """q [b, q, nh, hd], k [b, kv, nkv, hd], v [b, kv, nkv, vd] -> [b, q, nh, vd]."""
        k = self.cache.dequant(self._layer, k, q.dtype)
        v = self.cache.dequant(self._layer, v, q.dtype, values=True)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
        # GQA inside SDPA: no repeat_interleave copy of K/V per layer
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=self.scale,
                                             enable_gqa=self.num_kv_heads != self.num_heads)
        return out.transpose(1, 2)


def _tree_mask(tree: torch.Tensor, prefix: int, window: int | None) -> torch.Tensor:
    """tree bool [q, q] (ancestors and self) -> bool [q, prefix+q]: every cached key, then the
    node's ancestors; a window counts positions, and a node sits at prefix + its depth."""
    q = tree.shape[0]
    mask = torch.cat([torch.ones(q, prefix, dtype=torch.bool), tree], dim=1)
    if window is not None:
        depth = tree.sum(-1) - 1                                        # [q]
        kpos = torch.cat([torch.arange(prefix), prefix + depth])        # [prefix+q]
        mask &= kpos[None, :] > (prefix + depth)[:, None] - window
    return mask