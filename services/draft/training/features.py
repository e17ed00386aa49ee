"""Step 2 of training: the target's tapped-layer features for whole sequences, computed on the
fly with the project's own model code (frozen target, one batched forward)."""
from __future__ import annotations

import torch

from runtime.attention.metadata import AttentionMetadata, SeqSlice
from runtime.attention.registry import backend_class
from runtime.kv_cache import PagedKVCache, PageTable
from runtime.models.forward import ForwardBatch
from runtime.models.registry import load_model


class FeatureExtractor:
    def __init__(self, target_dir: str, layers: tuple[int, ...], max_tokens: int,
                 dtype: torch.dtype, device: str, backend: str = "torch", page_size: int = 16
                 ) -> None:
        self.model = load_model(target_dir, dtype, device)
        cfg = self.model.cfg
        self.layers = layers
        self.device = torch.device(device)
        pages = max_tokens // page_size + 64
        self.cache = PagedKVCache(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, page_size,
                                  pages, dtype, device)
        self.backend = backend_class(backend)(self.cache, cfg.num_heads, cfg.num_kv_heads,
                                              cfg.head_dim, cfg.head_dim ** -0.5)

    @torch.inference_mode()
    def __call__(self, seqs: list[list[int]]) -> torch.Tensor:
        """seqs of token ids -> features [S, Lmax, K*H] (rows past a sequence's end are zero)."""
        tables = [PageTable() for _ in seqs]
        try:
            for t, ids in zip(tables, seqs):
                self.cache.ensure(t, len(ids))
            meta = AttentionMetadata.build([SeqSlice(t, 0, len(s)) for t, s in zip(tables, seqs)],
                                           self.cache, causal=True, device=self.device)
            self.backend.prepare(meta)
            ids = torch.tensor([i for s in seqs for i in s], device=self.device)
            pos = torch.cat([torch.arange(len(s), device=self.device) for s in seqs])
            out = self.model(ids, pos, ForwardBatch(self.backend, self.layers))
        finally:
            for t in tables:
                self.cache.release(t)
        lmax = max(len(s) for s in seqs)
        feats = out.captured.new_zeros(len(seqs), lmax, out.captured.shape[-1])
        offset = 0
        for i, s in enumerate(seqs):
            feats[i, : len(s)] = out.captured[offset: offset + len(s)]
            offset += len(s)
        return feats
