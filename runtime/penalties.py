"""Repetition, presence and frequency penalties, applied exactly inside a verify.

A penalty depends on the tokens generated before the position a logits row predicts, and in a
verify block those include the drafts before that row. So every row gets its own counts: the
sequence's committed outputs (`PenaltyState`, on the device) plus the block's tokens on the way
to the row - the anchor and the drafts before it in a chain, the anchor and the node's ancestors
in a tree. Row by row this is what one-token steps would see, so speculation stays exact.

Semantics as vLLM's (OpenAI's for presence / frequency): repetition_penalty r over every token of
the prompt and the output (a positive logit divided by r, a negative one multiplied), then
presence_penalty (once per token that occurred) and frequency_penalty (per occurrence) subtracted
over the output tokens only."""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Penalties:
    repetition: float = 1.0          # 1 = off
    presence: float = 0.0            # 0 = off
    frequency: float = 0.0           # 0 = off

    @property
    def active(self) -> bool:
        return self.repetition != 1.0 or self.presence != 0.0 or self.frequency != 0.0


@dataclass
class PenaltyState:
    """One sequence's committed tokens as penalties see them, on its device:
    counts float32 [V] (output occurrences), seen bool [V] (in the prompt or the output)."""
    counts: torch.Tensor
    seen: torch.Tensor

    @staticmethod
    def start(token_ids: Sequence[int], num_generated: int, vocab: int,
              device: torch.device) -> PenaltyState:
        """token_ids: the prefilled context, whose last num_generated tokens are outputs."""
        counts = torch.zeros(vocab, dtype=torch.float32)
        outputs = list(token_ids[len(token_ids) - num_generated:]) if num_generated else []
        counts.index_add_(0, torch.tensor(outputs, dtype=torch.int64), torch.ones(len(outputs)))
        seen = torch.zeros(vocab, dtype=torch.bool)
        seen[torch.tensor(list(token_ids), dtype=torch.int64)] = True
        return PenaltyState(counts.to(device), seen.to(device))

    def add(self, outputs: Sequence[int]) -> None:
        """Outputs that now have KV (a verify's anchor and accepted drafts)."""
        index = torch.tensor(list(outputs), dtype=torch.int64).to(self.counts.device)
        self.counts.index_add_(0, index, torch.ones(len(outputs), device=self.counts.device))
        self.seen[index] = True


def apply_penalties(logits: torch.Tensor, state: PenaltyState, p: Penalties,
                    before: Sequence[Sequence[int]]) -> None:
    """In place: logits [n, V] of one sequence; before[i]: the outputs without KV that precede
    the position row i predicts (the anchor and drafts on the way to row i; [] for a prefill)."""
    device = logits.device
    extra = torch.zeros(logits.shape, dtype=torch.float32, device=device)   # [n, V]
    toks = [t for row in before for t in row]
    if toks:
        rows = [i for i, row in enumerate(before) for _ in row]
        index = torch.tensor([rows, toks], dtype=torch.int64).to(device, non_blocking=True)
        extra.index_put_((index[0], index[1]), torch.ones(len(toks), device=device),
                         accumulate=True)
    counts = state.counts[None] + extra                                   # [n, V]
    if p.repetition != 1.0:
        seen = state.seen[None] | (extra > 0)
        scaled = torch.where(logits > 0, logits / p.repetition, logits * p.repetition)
        logits.copy_(torch.where(seen, scaled, logits))
    if p.presence or p.frequency:
        logits.sub_(p.presence * (counts > 0).to(logits.dtype) + p.frequency * counts)
