"""The draft's soft state for one sequence."""
from __future__ import annotations

import time
from dataclasses import dataclass, field

from runtime.kv_cache import PageTable


@dataclass
class DraftSequence:
    seq_id: str
    table: PageTable = field(default_factory=PageTable)
    context_len: int = 0        # positions whose context (features / tokens) is committed
    tokens: list[int] = field(default_factory=list)   # committed token ids (prompt lookup; the
                                                      # prefix cache's keys)
    last_used: float = field(default_factory=time.monotonic)
    born: float = field(default_factory=time.monotonic)

    def touch(self) -> None:
        self.last_used = time.monotonic()
