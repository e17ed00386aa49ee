"""What the target engine is asked (from the servicer, the in-process loop and warm-up) and
what it answers: domain objects, no protobuf."""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from runtime.draft_tree import DraftTree
from runtime.logprobs import TokenLogprobs
from runtime.sampling import SamplingConfig
from services.common.feature_plane import PlaneRef


@dataclass(frozen=True)
class PrefillCall:
    seq_id: str
    token_ids: list[int]
    sampling: SamplingConfig
    capture_layers: tuple[int, ...]
    feature_dtype: torch.dtype
    num_generated: int = 0
    feature_plane: str = ""             # publish the features there ("" = in the answer)
    token_mask: bytes = b""             # structured output: the first output's allowed tokens
                                        # (runtime/token_mask.py; b"" = any)
    features_from: int = 0              # the draft holds positions below it: features of the
                                        # rest only, and cached KV reused only below it


# Features in an answer: a host tensor [rows, K*H] in the requested dtype, a reference to them in
# the sequence's plane, or None (no capture).
Features = torch.Tensor | PlaneRef | None


@dataclass(frozen=True)
class PrefillResult:
    next_token: int
    features: Features                  # [L, K*H]
    seq_len: int
    logprobs: TokenLogprobs | None = None   # of next_token, when the sampling asked
    cached_tokens: int = 0              # prompt positions whose KV came from the prefix cache


@dataclass(frozen=True)
class VerifyCall:
    tokens: list[int]                   # [anchor, d1..dn]
    tree: DraftTree | None = None       # the drafts' parents (checked by the servicer);
                                        # None = a chain
    features_consumed: int = 0          # the draft holds positions below this (frees publications)
    token_masks: tuple[bytes, ...] = () # structured output: one per block row, the tokens
                                        # allowed after it; () = any

    @property
    def drafts(self) -> list[int]:
        return self.tokens[1:]

    @property
    def depths(self) -> Sequence[int]:
        """Each block row's offset from the anchor's position (0..n for a chain)."""
        return self.tree.depths if self.tree is not None else range(len(self.tokens))


@dataclass(frozen=True)
class VerifyResult:
    accepted: int
    committed: list[int]
    features: Features                  # [a+1, K*H]
    seq_len: int
    logprobs: list[TokenLogprobs] | None = None   # one per committed token, when asked
    batch_tokens: int = 0               # the forward it ran in: tokens of the whole batch
    batch_seconds: float = 0.0          # ... and its time to the decisions' read-back
    queue_seconds: float = 0.0          # its wait in the engine before that forward
