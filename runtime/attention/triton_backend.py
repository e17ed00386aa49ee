"""Triton backend: paged attention for prefill chunks, verify blocks (causal, or a tree of
drafts) and the draft's bidirectional block, one kernel launch per layer for the whole batch."""
from __future__ import annotations

import numpy as np
import torch
import triton

from runtime import batch_invariance
from runtime.attention.base import AttentionBackend
from runtime.attention.metadata import AttentionMetadata
from runtime.attention.triton_kernels import paged_block_attention, paged_mla_attention


def _next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def mask_bits(mask: torch.Tensor | None, q_len: int, width: int) -> torch.Tensor:
    """bool [q, q] (None: causal) -> int64 [q, width]: bit j of word j // 32 set where row i
    sees new token j (the kernel's TREE input). Packed by numpy on the host (every tree verify
    asks, on its critical path)."""
    if mask is None:
        mask = torch.ones(q_len, q_len, dtype=torch.bool).tril()
    packed = np.packbits(mask.cpu().numpy(), axis=1, bitorder="little")   # uint8 [q, q / 8]
    words = np.zeros((q_len, width * 4), dtype=np.uint8)
    words[:, : packed.shape[1]] = packed
    return torch.from_numpy(words.view("<u4").astype(np.int64))


def mask_paths(mask: torch.Tensor | None, q_len: int, width: int) -> torch.Tensor:
    """bool [q, q] ancestor mask (None: causal) -> int64 [q, width] (width >= q + 1): row i =
    [depth_i, a_0, .., a_depth, -1 ..], the new tokens row i sees in block order - its
    ancestors by depth, itself last (parents come first) - the kernel's PATHS input."""
    if mask is None:
        mask = torch.ones(q_len, q_len, dtype=torch.bool).tril()
    m = mask.cpu().numpy()
    rows, cols = np.nonzero(m)                                    # row-major: by row, then col
    counts = m.sum(axis=1)
    rank = np.arange(len(rows)) - np.repeat(np.cumsum(counts) - counts, counts)
    out = np.full((q_len, width), -1, dtype=np.int64)
    out[:, 0] = counts - 1
    out[rows, 1 + rank] = cols
    return torch.from_numpy(out)


def tree_width(q_len: int) -> int:
    """Columns of a tree row (tree_rows) for blocks of up to q_len new tokens."""
    return q_len + 1 if batch_invariance.enabled() else -(-q_len // 32)


def tree_rows(mask: torch.Tensor | None, q_len: int, width: int) -> torch.Tensor:
    """The kernel's tree input for one sequence: mask bits, or under --deterministic the
    ancestor paths (runtime/batch_invariance.py)."""
    return (mask_paths if batch_invariance.enabled() else mask_bits)(mask, q_len, width)


def tree_bits(meta: AttentionMetadata) -> torch.Tensor:
    """int64 [T, W]: per new token, the new tokens of its sequence it sees - its tree mask, or
    every earlier one for a sequence without a tree (bits, or paths: tree_rows)."""
    width = tree_width(max(meta.q_lens))
    return torch.cat([tree_rows(tree, q_len, width)
                      for q_len, tree in zip(meta.q_lens, meta.tree_masks)])


class TritonAttentionBackend(AttentionBackend):
    """Dense K/V caches (paged_block_attention) and MLA's latent cache (paged_mla_attention),
    in the model's dtype or fp8 (pages read as the queries' dtype, scales folded in)."""
    name = "triton"
    supports_trees = True
    supports_latent_kv = True
    supports_fp8_kv = True
    captures_cuda_graphs = True
    BLOCK_N = 32
    MLA_BLOCK_M = 32          # rows (token x head) per program: a [32, kv_lora_rank] fp32 acc

    def __init__(self, cache, num_heads: int, num_kv_heads: int, head_dim: int, scale: float
                 ) -> None:
        super().__init__(cache, num_heads, num_kv_heads, head_dim, scale)
        if cache.latent_value_dim and cache.fp8 and cache.latent_value_dim % 16:
            raise ValueError(f"--attention-backend triton reads an fp8 MLA cache with a "
                             f"kv_lora_rank that is a multiple of 16; this model has "
                             f"{cache.latent_value_dim} (use --kv-cache-dtype auto or torch)")

    def prepare(self, meta: AttentionMetadata) -> None:
        super().prepare(meta)
        device = meta.page_tables.device
        tree = tree_bits(meta).to(device) if meta.tree_masks is not None else None
        self.bind(torch.tensor(meta.cu_q_lens, dtype=torch.int32, device=device),
                  torch.tensor(meta.prefix_lens, dtype=torch.int32, device=device),
                  meta.page_tables.to(torch.int32), max(meta.q_lens), tree)

    def bind(self, cu_q: torch.Tensor, prefix: torch.Tensor, tables: torch.Tensor,
             max_q_len: int, tree: torch.Tensor | None = None) -> None:
        """Point the kernel at these device buffers (CUDA graphs bind static ones once and
        refill them before each replay). cu_q int32 [bs+1], prefix int32 [bs], tables int32
        [bs, P]; tree int64 [T, W] (tree_bits) or None (no sequence verifies a tree)."""
        self._cu_q, self._prefix, self._tables, self._tree = cu_q, prefix, tables, tree
        group = self.num_heads // self.num_kv_heads
        self._block_m = self.block_m(max_q_len * group)
        self._group_pad = group
        if batch_invariance.enabled() and tree is not None and not self.cache.latent_value_dim:
            # --deterministic trees: a token a program (each gathers its own path's keys)
            self._group_pad = -(-group // self._block_m) * self._block_m
        rows = max_q_len * self._group_pad
        self._grid = (prefix.shape[0], self.num_kv_heads, triton.cdiv(rows, self._block_m))

    def block_m(self, rows: int) -> int:
        """Query rows per program for a forward whose longest sequence brings `rows` (new tokens
        x GQA group): as many as fill the MMA, up to 64 (MLA: 32). --deterministic: always the
        same (ATTENTION_BLOCK_M; MLA: 32), whatever the batch, so a row meets the same MMA shape
        in a decode and in a verify (runtime/batch_invariance.py)."""
        if batch_invariance.enabled():
            return self.MLA_BLOCK_M if self.cache.latent_value_dim else (
                batch_invariance.ATTENTION_BLOCK_M)
        cap = self.MLA_BLOCK_M if self.cache.latent_value_dim else 64
        return max(16, min(cap, _next_pow2(rows)))

    def attend(self, layer: int, q: torch.Tensor, causal: bool, window: int | None
               ) -> torch.Tensor:
        meta = self.meta
        tree = self._tree
        if tree is not None and (window or not causal):
            raise ValueError("a tree of drafts is verified by causal layers without a window "
                             "(target models); this layer has a window or is bidirectional")
        paths = batch_invariance.enabled()             # the tree input holds paths, not bits
        kc, vc = self.cache.k[layer], self.cache.v[layer]
        if not self.cache.fp8:
            q = q.to(kc.dtype)
        q = q.contiguous()
        k_scale, v_scale = self.cache.layer_scales(layer)
        if self.cache.latent_value_dim:
            return self._attend_latent(q, kc, vc, tree, self.scale * k_scale, v_scale)
        out = torch.empty_like(q)
        paged_block_attention[self._grid](
            q, kc, vc, out, self._cu_q, self._prefix, self._tables,
            tree if tree is not None else self._cu_q,
            q.stride(0), q.stride(1), kc.stride(0), kc.stride(1), out.stride(0), out.stride(1),
            self._tables.stride(0), tree.stride(0) if tree is not None else 0,
            self.scale * k_scale, v_scale,
            GROUP=self.num_heads // self.num_kv_heads, D=self.head_dim, PAGE=meta.page_size,
            BLOCK_M=self._block_m, BLOCK_N=self.BLOCK_N, CAUSAL=causal, WINDOW=window or 0,
            PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
            TREE=tree is not None and not paths, GROUP_PAD=self._group_pad,
            PATHS=tree is not None and paths,
        )
        return out

    def _attend_latent(self, q: torch.Tensor, kc: torch.Tensor, rc: torch.Tensor,
                       tree: torch.Tensor | None, scale: float, out_scale: float) -> torch.Tensor:
        """q [T, nh, lat+rope] over the latent pool kc [S, 1, lat] and the rope pool rc
        [S, 1, rope] -> [T, nh, lat]."""
        lat = self.cache.latent_value_dim
        out = q.new_empty(q.shape[0], self.num_heads, lat)
        paged_mla_attention[self._grid](
            q, kc, rc, out, self._cu_q, self._prefix, self._tables,
            tree if tree is not None else self._cu_q,
            q.stride(0), q.stride(1), kc.stride(0), rc.stride(0), out.stride(0), out.stride(1),
            self._tables.stride(0), tree.stride(0) if tree is not None else 0, scale, out_scale,
            GROUP=self.num_heads, DL=lat, DR=self.head_dim - lat,
            DLP=max(16, _next_pow2(lat)), DRP=max(16, _next_pow2(self.head_dim - lat)),
            PAGE=self.meta.page_size,
            BLOCK_M=self._block_m, BLOCK_N=self.BLOCK_N,
            PRECISION="ieee" if q.dtype == torch.float32 else "tf32", TREE=tree is not None,
        )
        return out
