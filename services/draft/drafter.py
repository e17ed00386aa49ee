"""The Drafter interface behind the Propose RPC, and the name -> drafter registry.

A drafter is built in `__init__` (config, weights, compatibility checks: raise DrafterRefused),
then `init_backend()` allocates its memory and attention backend. The engine thread alone calls
`reserve`, `propose` and `release`."""
from __future__ import annotations

import importlib
from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch

from runtime import batch_invariance
from runtime.draft_tree import DraftTree
from runtime.layers.linear import set_cpu_gemm
from runtime.models.dflash import TargetFingerprint
from services.common.bootstrap import StartRefused
from services.draft.config import DraftConfig
from services.draft.sequence import DraftSequence

# name -> "module:Class", imported only when chosen
DRAFTERS: dict[str, str] = {
    "dflash": "services.draft.dflash_drafter:DFlashDrafter",
    "prompt-lookup": "services.draft.prompt_lookup:PromptLookupDrafter",
}


class DrafterRefused(StartRefused):
    """The drafter cannot serve this target (or its checkpoint is unusable): start-up stops."""


@dataclass(frozen=True)
class DrafterFacts:
    """What capabilities report and what Propose validation checks against."""
    kind: str
    model_id: str
    block_size: int                      # trained / default B
    max_block_size: int
    target_layer_ids: tuple[int, ...]    # empty: needs no features
    mask_token_id: int
    hidden_size: int                     # target H
    vocab_size: int                      # target vocab (anchor and token ids must be below)
    max_context: int                     # positions 0..max_context-1 (context + block)
    feature_dtype: str
    needs_features: bool
    needs_tokens: bool                   # Propose must carry the new positions' token ids
    target: TargetFingerprint            # the target it was made for
    max_tree_nodes: int = 0              # draft nodes a tree Propose may ask for (0: chains only)

    @property
    def feature_width(self) -> int:
        return len(self.target_layer_ids) * self.hidden_size


@dataclass
class ProposeItem:
    """One sequence's part of a propose batch. The engine has checked that positions
    start..context_len-1 continue `seq` (seq.context_len is still the old length)."""
    seq: DraftSequence
    start: int                           # first new position (= seq.context_len before)
    num_new: int                         # new positions start..start+num_new-1
    features: torch.Tensor | None        # [n, K*H] CPU, feature dtype; None = no new features
    token_ids: list[int]                 # the tokens at the new positions (may be empty)
    anchor: int                          # last committed token, at position context_len
    block_size: int                      # B: B-1 drafts wanted
    tree_nodes: int = 0                  # > 0: a tree of that many drafts, at most B-1 deep

    @property
    def context_len(self) -> int:
        """Context length once the new positions are committed (= the anchor's position)."""
        return self.start + self.num_new


class Drafter(ABC):
    facts: DrafterFacts

    def init_backend(self) -> None:
        """Allocate memory pools and the attention backend (no-op without a model)."""

    def capture_cuda_graphs(self) -> None:
        """Warm-up: capture the propose forward where the device and backend allow (no-op)."""

    def calibrate_cpu_gemm(self) -> None:
        """--cpu-gemm auto on the CPU: measure the fp32 GEMMs on this host's threads for the
        drafter's matrices, on the engine thread before warm-up (no-op without a model)."""

    def reserve(self, item: ProposeItem) -> None:
        """Make room for the item's new context and block; raises OutOfPages. All or nothing."""

    @abstractmethod
    def propose(self, items: list[ProposeItem]) -> list[DraftTree]:
        """Commit each item's new context and return its drafts: a chain of <= block_size-1
        tokens, or (tree_nodes > 0, drafters with max_tree_nodes) a tree of tree_nodes."""

    def release(self, seq: DraftSequence) -> None:
        """Free what the sequence holds."""

    @property
    def prefix_caching(self) -> bool:
        """Whether attach_prefix can find cached context."""
        return False

    def attach_prefix(self, seq: DraftSequence, token_ids: list[int]) -> int:
        """A new sequence takes the cached context of the longest cached prefix of the prompt
        `token_ids`; returns the positions it holds (0: none, or no prefix caching)."""
        return 0

    def prefix_cached_pages(self) -> int:
        return 0

    def kv_usage(self) -> float:
        return 0.0


def drafter_class(name: str) -> type[Drafter]:
    if name not in DRAFTERS:
        raise DrafterRefused(f"unknown drafter {name!r}; known: {sorted(DRAFTERS)}")
    module, cls = DRAFTERS[name].split(":")
    return getattr(importlib.import_module(module), cls)


def make_drafter(config: DraftConfig, random_weights: bool = False) -> Drafter:
    """random_weights (benchmarks: ServiceHooks): a weighted drafter's weights at random."""
    set_cpu_gemm(config.cpu_gemm)
    batch_invariance.enable(config.deterministic)
    return drafter_class(config.drafter)(config, random_weights)
