"""A wrapper that routes attention layers to a full-attention backend and recurrent (mamba)
layers to a state backend, as SGLang's HybridLinearAttnBackend does.

Whether verify must commit recurrent state is a property of the *model* (does it have mamba
layers?) and of the *state backend* (can it commit?), never of the wrapper type alone: a wrapper
that merely delegates answers False for a pure-attention model (SGLang PR #29218)."""
from __future__ import annotations

from typing import Protocol

import torch

from runtime.attention.base import AttentionBackend
from runtime.attention.metadata import AttentionMetadata


class MambaStateBackend(Protocol):
    def prepare(self, meta: AttentionMetadata) -> None: ...
    def commit_verified_state(self, commits: list[tuple[int, int]]) -> None: ...


class HybridAttnBackend(AttentionBackend):
    name = "hybrid"

    def __init__(self, full: AttentionBackend, mamba: MambaStateBackend | None = None) -> None:
        self.full = full
        self.mamba = mamba
        self.cache = full.cache
        self.num_heads, self.num_kv_heads = full.num_heads, full.num_kv_heads
        self.head_dim, self.scale = full.head_dim, full.scale
        self.meta = None

    @property
    def inner_name(self) -> str:
        return self.full.name

    def prepare(self, meta: AttentionMetadata) -> None:
        self.meta = meta
        self.full.prepare(meta)
        if self.mamba is not None:
            self.mamba.prepare(meta)

    def forward(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                causal: bool | None = None, window: int | None = None) -> torch.Tensor:
        return self.full.forward(layer, q, k, v, causal, window)

    def attend(self, layer: int, q: torch.Tensor, causal: bool, window: int | None
               ) -> torch.Tensor:
        return self.full.attend(layer, q, causal, window)

    def store_kv(self, layer, k, v, slot_mapping) -> None:
        self.full.store_kv(layer, k, v, slot_mapping)

    def can_commit_mamba_state(self) -> bool:
        return self.mamba is not None and callable(getattr(self.mamba, "commit_verified_state", None))

    def update_mamba_state_after_mtp_verify(self, commits: list[tuple[int, int]]) -> None:
        """commits: (state slot, last committed block index) per sequence of the last verify
        batch. Copies that intermediate recurrent state into the live state; must run right
        after that verify forward."""
        if not self.can_commit_mamba_state():
            raise RuntimeError("this hybrid backend has no mamba state backend that can commit")
        self.mamba.commit_verified_state(commits)


def can_commit_mamba_state(backend: AttentionBackend) -> bool:
    probe = getattr(backend, "can_commit_mamba_state", None)
    return bool(probe()) if callable(probe) else False
