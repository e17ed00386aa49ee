"""Per-forward attention metadata: which tokens belong to which sequence and where their K/V go."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from runtime.kv_cache import PagedKVCache, PageTable


@dataclass(frozen=True)
class SeqSlice:
    """One sequence's part of a forward: q_len new tokens appended after prefix_len cached ones.
    tree (a verified tree of drafts, runtime/draft_tree.py): bool [q_len, q_len], which new
    tokens each new token sees (its ancestors and itself) instead of every earlier one."""
    table: PageTable
    prefix_len: int
    q_len: int
    tree: torch.Tensor | None = None


@dataclass
class AttentionMetadata:
    """Tokens of all sequences are flattened in order: seq 0's q_len tokens, then seq 1's, ...

    slot_mapping   int64 [T]       cache slot of each new token
    q_lens         list[int] [bs]  new tokens per sequence
    prefix_lens    list[int] [bs]  cached tokens before them
    page_tables    int64 [bs, P]   padded with page 0 (on the device)
    page_lists     the same page ids as host lists (planning without a device sync)
    causal         causal inside the new tokens (target); False = bidirectional block (draft)
    tree_masks     per sequence, its SeqSlice.tree (None: no sequence verifies a tree); only
                   backends with supports_trees read it
    """
    slot_mapping: torch.Tensor
    q_lens: list[int]
    prefix_lens: list[int]
    page_tables: torch.Tensor
    page_size: int
    page_lists: list[list[int]]
    causal: bool = True
    tree_masks: list[torch.Tensor | None] | None = None

    @property
    def batch_size(self) -> int:
        return len(self.q_lens)

    @property
    def kv_lens(self) -> list[int]:
        return [p + q for p, q in zip(self.prefix_lens, self.q_lens)]

    @property
    def cu_q_lens(self) -> list[int]:
        """[bs+1] token offsets of each sequence's new tokens in the flattened batch."""
        out = [0]
        for q in self.q_lens:
            out.append(out[-1] + q)
        return out

    @property
    def num_tokens(self) -> int:
        return sum(self.q_lens)

    @staticmethod
    def build(seqs: list[SeqSlice], cache: PagedKVCache, causal: bool = True,
              device: torch.device | str = "cpu") -> AttentionMetadata:
        slots: list[int] = []
        for s in seqs:
            slots.extend(cache.slots(s.table, s.prefix_len, s.prefix_len + s.q_len))
        width = max(1, max((len(s.table.pages) for s in seqs), default=1))
        tables = [s.table.pages + [0] * (width - len(s.table.pages)) for s in seqs]
        return AttentionMetadata(
            slot_mapping=torch.tensor(slots, dtype=torch.int64, device=device),
            q_lens=[s.q_len for s in seqs],
            prefix_lens=[s.prefix_len for s in seqs],
            page_tables=torch.tensor(tables, dtype=torch.int64, device=device),
            page_size=cache.page_size,
            page_lists=[list(s.table.pages) for s in seqs],
            causal=causal,
            tree_masks=[s.tree for s in seqs] if any(s.tree is not None for s in seqs) else None,
        )
