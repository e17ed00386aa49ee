"""Stop strings over a text stream whose pieces may split a stop anywhere.

Text that could still be the beginning of a stop string is held back; when a stop string
completes, everything before it is released and the stop itself (and what follows) is not."""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class Match:
    text: str          # releasable now
    stopped: bool      # a stop string completed; nothing more is released


class StopMatcher:
    def __init__(self, stops: Sequence[str]) -> None:
        self.stops = tuple(s for s in stops if s)
        self.held = ""                 # the tail that may still become a stop string
        self.stopped = False

    def add(self, delta: str, check: bool = True) -> Match:
        """check False (below min_tokens): nothing can stop yet, release everything."""
        if self.stopped:
            return Match("", True)
        text = self.held + delta
        if not self.stops or not check:
            self.held = ""
            return Match(text, False)
        hit = self._first_stop(text)
        if hit is not None:
            self.held, self.stopped = "", True
            return Match(text[:hit], True)
        keep = self._longest_partial(text)
        self.held = text[len(text) - keep:] if keep else ""
        return Match(text[:len(text) - keep], False)

    def flush(self) -> str:
        """End of the stream without a stop: the held tail is ordinary text."""
        text, self.held = self.held, ""
        return "" if self.stopped else text

    def _first_stop(self, text: str) -> int | None:
        found = [i for i in (text.find(s) for s in self.stops) if i >= 0]
        return min(found) if found else None

    def _longest_partial(self, text: str) -> int:
        """Length of the longest suffix of text that is a proper prefix of some stop string."""
        best = 0
        for s in self.stops:
            for k in range(min(len(s) - 1, len(text)), best, -1):
                if text.endswith(s[:k]):
                    best = k
                    break
        return best
