"""The draft's soft state for one sequence."""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from runtime.draft_tree import DraftTree
from runtime.kv_cache import PageTable


@dataclass(frozen=True)
class Ahead:
    """A block drafted from the target's commit notice before its Propose came (draft-ahead):
    `notice` (the engine's ProposeCall of it: the context it appended, its features' plane refs,
    tokens and anchor), the size it was drafted at, and its drafts."""
    notice: Any                 # services.draft.engine.ProposeCall
    block_size: int
    tree_nodes: int
    drafts: DraftTree
    rows: int                   # the forward it ran in: every sequence's rows, and its time
    seconds: float


@dataclass
class DraftSequence:
    seq_id: str
    table: PageTable = field(default_factory=PageTable)
    context_len: int = 0        # positions whose context (features / tokens) is committed
    tokens: list[int] = field(default_factory=list)   # committed token ids (prompt lookup; the
                                                      # prefix cache's keys)
    shape: tuple[int, int] | None = None    # the last Propose's (block_size, tree_nodes): an
                                            # ahead block drafts the same
    ahead: Ahead | None = None              # a block drafted ahead, awaiting its Propose
    last_used: float = field(default_factory=time.monotonic)
    born: float = field(default_factory=time.monotonic)

    def touch(self) -> None:
        self.last_used = time.monotonic()
