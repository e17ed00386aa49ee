"""The target's soft state for one sequence."""
from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from runtime.kv_cache import PageTable
from runtime.penalties import PenaltyState
from runtime.sampling import SamplingConfig
from services.common.feature_plane import Publication


@dataclass
class TargetSequence:
    seq_id: str
    sampling: SamplingConfig
    capture_layers: tuple[int, ...]
    feature_dtype: torch.dtype
    generator: torch.Generator | None
    table: PageTable = field(default_factory=PageTable)
    seq_len: int = 0            # positions whose KV (and recurrent state) is committed
    num_generated: int = 0      # output tokens committed so far, the pending anchor included
    state_slot: int | None = None   # hybrid models: live recurrent state slot
    prefilling: bool = True         # until the last prompt chunk has run (Verify waits)
    last_used: float = field(default_factory=time.monotonic)
    born: float = field(default_factory=time.monotonic)
    feature_plane: str = ""         # the plane its features are published in ("" = messages)
    # its publications not yet freed, in position order, each with the position it ends before
    publications: list[tuple[Publication, int]] = field(default_factory=list)
    penalties: PenaltyState | None = None   # its committed tokens, when its sampling penalizes
    tokens: list[int] = field(default_factory=list)   # the token at each position with KV (prompt
                                                      # then committed): its pages' cache keys

    def touch(self) -> None:
        self.last_used = time.monotonic()

    def commit(self, tokens: list[int]) -> None:
        """A verify committed these block rows' tokens (the anchor and the accepted drafts)."""
        self.seq_len += len(tokens)
        self.num_generated += len(tokens)
        self.tokens.extend(tokens)
        self.touch()

    def suppress_rows(self, rows: int) -> int:
        """How many of `rows` predictions (output counts num_generated + i) are below min_tokens."""
        return max(0, min(rows, self.sampling.min_tokens - self.num_generated))
