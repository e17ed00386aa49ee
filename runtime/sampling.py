"""Token choice as pure tensor functions (no server state): the sampling parameters, the
target's probabilities after temperature / top-k / top-p, and min_tokens' suppression of stop
tokens. Acceptance of drafts: runtime/acceptance.py."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from runtime.penalties import Penalties
from runtime.sampling_limits import (
    GREEDY_BELOW,
    MAX_PENALTY,
    MAX_REPETITION_PENALTY,
    MAX_TEMPERATURE,
    MAX_TOP_K,
    MAX_TOP_LOGPROBS,
    MIN_REPETITION_PENALTY,
)

__all__ = ["GREEDY_BELOW", "MAX_TEMPERATURE", "MAX_TOP_K", "MAX_TOP_LOGPROBS", "SamplingConfig"]


@dataclass(frozen=True)
class SamplingConfig:
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0                       # 0 = off
    seed: int | None = None
    min_tokens: int = 0
    stop_token_ids: tuple[int, ...] = ()
    logprobs: bool = False               # answer each committed token's log-probability ...
    top_logprobs: int = 0                # ... and the top ones at its position (runtime/logprobs.py)
    processed_logprobs: bool = False     # False: the raw distribution; True: the processed one
    presence_penalty: float = 0.0        # runtime/penalties.py, applied exactly in a verify
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0

    @property
    def penalties(self) -> Penalties:
        return Penalties(self.repetition_penalty, self.presence_penalty, self.frequency_penalty)

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_BELOW

    def validate(self, vocab_size: int) -> None:
        """Raises ValueError with what is allowed."""
        if not 0.0 <= self.temperature <= MAX_TEMPERATURE:        # NaN fails too
            raise ValueError(f"temperature must be in [0, {MAX_TEMPERATURE:g}] (below "
                             f"{GREEDY_BELOW:g}: greedy), got {self.temperature}")
        if not (0.0 < self.top_p <= 1.0):
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be 0 or -1 (off) or >= 1, got {self.top_k}")
        if not 0 <= self.top_logprobs <= MAX_TOP_LOGPROBS:
            raise ValueError(f"top_logprobs must be in [0, {MAX_TOP_LOGPROBS}], got "
                             f"{self.top_logprobs}")
        if self.top_logprobs and not self.logprobs:
            raise ValueError("top_logprobs needs logprobs set")
        for name in ("presence_penalty", "frequency_penalty"):
            if not -MAX_PENALTY <= getattr(self, name) <= MAX_PENALTY:
                raise ValueError(f"{name} must be in [-{MAX_PENALTY:g}, {MAX_PENALTY:g}], got "
                                 f"{getattr(self, name)}")
        if not MIN_REPETITION_PENALTY <= self.repetition_penalty <= MAX_REPETITION_PENALTY:
            raise ValueError(f"repetition_penalty must be in [{MIN_REPETITION_PENALTY:g}, "
                             f"{MAX_REPETITION_PENALTY:g}] (1 = off), got "
                             f"{self.repetition_penalty}")
        bad = [t for t in self.stop_token_ids if t >= vocab_size]
        if bad:
            raise ValueError(f"stop_token_ids {bad} are outside the vocabulary [0, {vocab_size})")


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
