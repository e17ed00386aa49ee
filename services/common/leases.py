"""Sequence leases: a sequence idle for longer than its lease is freed, so a client that
vanished leaks nothing. Swept on the engine thread (the only owner of sequence state): at most
once a second during steps, and whenever the engine is idle."""
from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping
from typing import Protocol

log = logging.getLogger("dflash.leases")


class Leased(Protocol):
    last_used: float               # time.monotonic() of the last use
    born: float                    # time.monotonic() of its creation


class LeaseSweeper:
    def __init__(self, lease_s: float, release: Callable[[str], object],
                 interval_s: float = 1.0) -> None:
        self.lease_s, self.release, self.interval_s = lease_s, release, interval_s
        self.expired = 0
        self._last = time.monotonic()

    def maybe_sweep(self, seqs: Mapping[str, Leased]) -> int:
        return self.sweep(seqs) if time.monotonic() - self._last > self.interval_s else 0

    def sweep(self, seqs: Mapping[str, Leased]) -> int:
        """Releases every sequence past its lease; returns how many."""
        self._last = now = time.monotonic()
        stale = [seq_id for seq_id, s in seqs.items() if now - s.last_used > self.lease_s]
        for seq_id in stale:
            log.info("lease expired", extra={"seq": seq_id})
            self.release(seq_id)
        self.expired += len(stale)
        return len(stale)
