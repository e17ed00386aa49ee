"""Incremental detokenization (the prefix-offset technique of vLLM and TGI).

Decoding token by token is wrong in two ways: a multi-byte character split over several
byte-level tokens decodes to U+FFFD halves, and decoders that strip or merge around token
boundaries (SentencePiece's leading space, cleanup rules) depend on the neighbours. So each
step decodes a short window twice - `ids[prefix:read]` (already emitted) and `ids[prefix:]` -
and emits the difference, only when it grew and does not end in U+FFFD (an incomplete
character); otherwise the tokens wait for the next one. The window starts inside the prompt
(its last few tokens) so the first output token is decoded in context too."""
from __future__ import annotations

from collections.abc import Sequence

from runtime.tokenizer import ChatTokenizer

PROMPT_CONTEXT = 5          # prompt tokens decoded as left context (vLLM uses 5)
REPLACEMENT = "\ufffd"


class IncrementalDetokenizer:
    """add(token) -> text delta ("" while held back); flush() -> what is still held at the end.
    The concatenation of all deltas plus flush() equals decode(output ids) for byte-level BPE,
    except for an incomplete character at the very end, which is never emitted."""

    def __init__(self, tokenizer: ChatTokenizer, prompt_ids: Sequence[int],
                 skip_special_tokens: bool = True) -> None:
        self.tokenizer = tokenizer
        self.skip = skip_special_tokens
        self.ids: list[int] = list(prompt_ids[-PROMPT_CONTEXT:])
        self.prefix_offset = 0                 # ids[prefix:read] were emitted (left context)
        self.read_offset = len(self.ids)       # ids[read:] are not emitted yet

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip)

    def add(self, token_id: int) -> str:
        self.ids.append(token_id)
        return self._advance(final=False)

    def flush(self) -> str:
        """At the end of a request: what is still held, less an incomplete character at the very
        end (output cut inside a multi-byte character: its bytes are not a character yet)."""
        return self._advance(final=True).rstrip(REPLACEMENT)

    def _advance(self, final: bool) -> str:
        if self.read_offset >= len(self.ids):
            return ""
        prefix = self._decode(self.ids[self.prefix_offset:self.read_offset])
        full = self._decode(self.ids[self.prefix_offset:])
        if len(full) <= len(prefix) and not final:
            return ""
        if full.endswith(REPLACEMENT) and not final:
            return ""
        delta = full[len(prefix):]
        self.prefix_offset = self.read_offset
        self.read_offset = len(self.ids)
        self._trim()
        return delta

    def _trim(self) -> None:
        """Keep the window short: drop ids before the prefix offset."""
        if self.prefix_offset > 64:
            del self.ids[:self.prefix_offset]
            self.read_offset -= self.prefix_offset
            self.prefix_offset = 0
