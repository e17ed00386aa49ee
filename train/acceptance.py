"""Acceptance length of a drafter along the target's own greedy answers, without a server.

Under greedy decoding the speculative output equals the target's greedy output R, so the steps
of speculative decoding are fully determined by R: at anchor position p the drafter proposes
d1..d_{B-1} from the context features of positions < p, the target accepts the longest prefix
equal to R[p+1..], and the next anchor is p + a + 1. tau = committed tokens / steps (bonus
included). All sequences advance together: one batched draft forward per step."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from runtime.models.dflash import DFlashDraftModel, TargetHead
from train.blocks import accepted_drafts, block_inputs, draft_hidden


@dataclass
class AcceptanceStats:
    steps: int = 0
    tokens: int = 0
    per_position: list[int] | None = None     # accepted at draft position k (k = 1..B-1)

    @property
    def tau(self) -> float:
        return self.tokens / max(1, self.steps)

    def merge(self, other: AcceptanceStats) -> None:
        self.steps += other.steps
        self.tokens += other.tokens
        if other.per_position is not None:
            self.per_position = [a + b for a, b in zip(self.per_position or [0] * len(other.per_position),
                                                       other.per_position)]


@torch.no_grad()
def simulate(draft: DFlashDraftModel, head: TargetHead, feats: torch.Tensor, ids: torch.Tensor,
             prompt_lens: torch.Tensor, lengths: torch.Tensor, block: int) -> AcceptanceStats:
    """feats [S, L, K*H], ids [S, L] (prompt + greedy response), lengths [S]."""
    total = AcceptanceStats(per_position=[0] * (block - 1))
    for st in simulate_each(draft, head, feats, ids, prompt_lens, lengths, block):
        total.merge(st)
    return total


@torch.no_grad()
def simulate_each(draft: DFlashDraftModel, head: TargetHead, feats: torch.Tensor,
                  ids: torch.Tensor, prompt_lens: torch.Tensor, lengths: torch.Tensor,
                  block: int) -> list[AcceptanceStats]:
    """As `simulate`, one AcceptanceStats per sequence."""
    s = ids.shape[0]
    pos = prompt_lens.clone()                      # current anchor position per sequence
    stats = [AcceptanceStats(per_position=[0] * (block - 1)) for _ in range(s)]
    active = pos < lengths - 1
    while bool(active.any()):
        anchors = torch.where(active, pos, torch.zeros_like(pos))[:, None]
        bids, bpos, labels = block_inputs(ids, anchors, block, draft.cfg.mask_token_id, lengths)
        a = accepted_drafts(draft_hidden(draft, head, feats, bids, bpos), labels, head)[:, 0]
        remaining = lengths - 1 - pos              # tokens after the anchor that exist
        committed = torch.minimum(a + 1, remaining)
        for i in torch.nonzero(active).flatten().tolist():
            stats[i].steps += 1
            stats[i].tokens += int(committed[i])
            for k in range(int(a[i])):
                stats[i].per_position[k] += 1
        pos = pos + torch.where(active, committed, torch.zeros_like(committed))
        active = pos < lengths - 1
    return stats
