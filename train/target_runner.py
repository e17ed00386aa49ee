"""The frozen target for training-time work (answer generation, features): the project's own
model code, paged KV cache and attention backend, driven directly as whole batches - no request
scheduling, leases or per-sequence RPC state, which the serving engine needs and a batch job
does not."""
from __future__ import annotations

import torch

from runtime.attention.metadata import AttentionMetadata, SeqSlice
from runtime.attention.registry import backend_class
from runtime.kv_cache import PagedKVCache, PageTable
from runtime.models.forward import ForwardBatch, ForwardOutput
from runtime.models.registry import load_model

PAGE_SIZE = 16          # tokens per KV page


class TargetRunner:
    """A target model with a KV cache of `max_tokens` tokens (all sequences of one batch)."""

    def __init__(self, target_dir: str, max_tokens: int, dtype: torch.dtype, device: str,
                 backend: str = "torch", page_size: int = PAGE_SIZE) -> None:
        self.model = load_model(target_dir, dtype, device)
        cfg = self.model.cfg
        self.device = torch.device(device)
        self.eos_token_ids = tuple(cfg.eos_token_ids)
        self.cache = PagedKVCache(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, page_size,
                                  max_tokens // page_size + 64, dtype, device)
        self.backend = backend_class(backend)(self.cache, cfg.num_heads, cfg.num_kv_heads,
                                              cfg.head_dim, cfg.head_dim ** -0.5)

    @staticmethod
    def tokens_for(sequences: int, length: int, page_size: int = PAGE_SIZE) -> int:
        """max_tokens that holds `sequences` sequences of `length` tokens each (whole pages)."""
        return sequences * -(-length // page_size) * page_size

    def forward(self, slices: list[SeqSlice], ids: torch.Tensor, layers: tuple[int, ...] = ()
                ) -> ForwardOutput:
        """ids int64 [T]: each slice's q_len new tokens in order; positions follow the slices."""
        meta = AttentionMetadata.build(slices, self.cache, causal=True, device=self.device)
        self.backend.prepare(meta)
        pos = torch.cat([torch.arange(s.prefix_len, s.prefix_len + s.q_len, device=self.device)
                         for s in slices])
        return self.model(ids, pos, ForwardBatch(self.backend, layers))

    def greedy(self, hidden: torch.Tensor, chunk: int = 4096) -> torch.Tensor:
        """hidden [N, H] -> int64 [N]: the target's argmax next token (fp32 logits, in chunks)."""
        return torch.cat([self.model.compute_logits(hidden[i: i + chunk]).argmax(-1)
                          for i in range(0, hidden.shape[0], chunk)])

    def tables(self, lengths: list[int]) -> list[PageTable]:
        """Page tables holding `lengths` tokens each (released with `release`)."""
        out = []
        try:
            for n in lengths:
                out.append(PageTable())
                self.cache.ensure(out[-1], n)
        except Exception:
            self.release(out)
            raise
        return out

    def release(self, tables: list[PageTable]) -> None:
        for t in tables:
            self.cache.release(t)
