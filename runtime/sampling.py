"""Token choice and speculative acceptance as pure tensor functions (no server state).

Acceptance for a chain drafted greedily (the draft distribution is one-hot on each draft token):
draft token x_i is accepted with probability p_i(x_i); on the first rejection the bonus token is
drawn from the residual p_i with x_i removed (renormalised); if every draft is accepted the bonus
is drawn from p_B. This is the standard rejection rule with q = one-hot, so the committed tokens
follow the target's distribution exactly (lossless). Greedy (temperature 0) is the limit: accept
while x_i == argmax p_i, bonus = argmax at the first mismatch.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class SamplingConfig:
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0                       # 0 = off
    seed: int | None = None
    min_tokens: int = 0
    stop_token_ids: tuple[int, ...] = ()

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def validate(self, vocab_size: int) -> None:
        """Raises ValueError with what is allowed."""
        if not (self.temperature >= 0.0) or self.temperature != self.temperature:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not (0.0 < self.top_p <= 1.0):
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be 0 or -1 (off) or >= 1, got {self.top_k}")
        bad = [t for t in self.stop_token_ids if t >= vocab_size]
        if bad:
            raise ValueError(f"stop_token_ids {bad} are outside the vocabulary [0, {vocab_size})")


@dataclass(frozen=True)
class Acceptance:
    accepted: int                        # a: accepted drafts
    tokens: list[int]                    # [d1..da, bonus]


def suppress_tokens(logits: torch.Tensor, token_ids: list[int], rows: int) -> None:
    """In place: forbid token_ids in the first `rows` rows of logits [N, V] (min_tokens)."""
    if rows > 0 and token_ids:
        logits[:rows, token_ids] = float("-inf")


def target_probs(logits: torch.Tensor, cfg: SamplingConfig) -> torch.Tensor:
    """logits [N, V] fp32 -> probabilities [N, V] after temperature, top-k and top-p."""
    logits = logits / cfg.temperature
    if 0 < cfg.top_k < logits.shape[-1]:
        kth = torch.topk(logits, cfg.top_k, dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if cfg.top_p < 1.0:
        sorted_p, order = probs.sort(dim=-1, descending=True)
        cum = sorted_p.cumsum(dim=-1)
        drop = (cum - sorted_p) >= cfg.top_p       # keep the smallest prefix reaching top_p
        sorted_p = sorted_p.masked_fill(drop, 0.0)
        probs = torch.zeros_like(probs).scatter_(-1, order, sorted_p)
        probs = probs / probs.sum(dim=-1, keepdim=True)
    return probs


def greedy_accept_batch(drafts: torch.Tensor, argmax: torch.Tensor) -> torch.Tensor:
    """Greedy acceptance of S sequences at once, on their device (no host sync).
    drafts int64 [S, W], padded with -1 past each sequence's drafts; argmax int64 [S, W+1] =
    target argmax at block positions 0..W (rows past a sequence's block repeat any value).
    Returns int64 [S, 2]: (a, bonus) with a = leading drafts equal to the argmax, bonus =
    argmax at position a."""
    match = (drafts == argmax[:, :-1]).to(torch.int32)
    accepted = match.cumprod(dim=1).sum(dim=1) if drafts.shape[1] else \
        torch.zeros(drafts.shape[0], dtype=torch.int64, device=drafts.device)
    bonus = argmax.gather(1, accepted.long()[:, None])[:, 0]
    return torch.stack([accepted.long(), bonus], dim=1)


def rejection_accept_device(drafts: torch.Tensor, probs: torch.Tensor,
                            generator: torch.Generator | None) -> torch.Tensor:
    """One sequence's rejection sampling on its device, without a host sync.
    drafts int64 [B-1] on probs.device; probs [B, V] target probabilities at block positions
    0..B-1. Returns int64 [2]: (a, bonus). Draws: B-1 uniforms, then one multinomial."""
    n = drafts.shape[0]
    if n == 0:
        bonus = torch.multinomial(probs[0], 1, generator=generator)[0]
        return torch.stack([torch.zeros_like(bonus), bonus])
    p_draft = probs[:n].gather(1, drafts[:, None])[:, 0]
    u = torch.rand(n, generator=generator, device=probs.device)
    rejected = u >= p_draft
    a = torch.where(rejected.any(), rejected.to(torch.int32).argmax().long(), n)  # first True
    row = probs.index_select(0, a.view(1))[0]                   # [V]
    # residual: p with the rejected draft removed, renormalised (when a draft was rejected)
    token = drafts[a.clamp(max=n - 1)].view(1)
    kept = row.gather(0, token)
    residual = row.scatter(0, token, torch.where(a < n, torch.zeros_like(kept), kept))
    total = residual.sum()
    row = torch.where(total > 0, residual / total.clamp_min(1e-30), row)
    bonus = torch.multinomial(row, 1, generator=generator)[0]
    return torch.stack([a, bonus])


def rejection_accept(drafts: list[int], probs: torch.Tensor, generator: torch.Generator
                     ) -> Acceptance:
    """drafts [B-1]; probs [B, V] target probabilities at block positions 0..B-1."""
    d = torch.tensor(drafts, dtype=torch.int64, device=probs.device)
    a, bonus = rejection_accept_device(d, probs, generator).tolist()
    return Acceptance(a, drafts[:a] + [bonus])
