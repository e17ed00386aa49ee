"""What the client gets from committed tokens: stop rules applied token by token, text deltas
from the incremental detokenizer, the finish reason. Tokens after a stop are dropped."""
from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from gateway.detokenizer import IncrementalDetokenizer
from gateway.request import GenerationRequest
from gateway.stop import StopMatcher
from runtime.tokenizer import ChatTokenizer


@dataclass(frozen=True)
class Delivery:
    token_ids: list[int]           # committed tokens delivered this time (stop token included)
    text: str                      # text delta
    finish_reason: str | None      # None while running; "stop" | "length"


class OutputProcessor:
    """Stops: EOS ids (unless ignore_eos) and stop_token_ids end with the token delivered and its
    text not; a stop string ends at the token that completes it, its text cut before the stop;
    max_tokens (resolved to fit the context) ends with "length"."""

    def __init__(self, req: GenerationRequest, eos_ids: Sequence[int],
                 tokenizer: ChatTokenizer) -> None:
        assert req.max_tokens is not None, "validate() resolves max_tokens"
        self.req = req
        self.stop_ids = set(req.stop_token_ids) | (set() if req.ignore_eos else set(eos_ids))
        self.detok = IncrementalDetokenizer(tokenizer, req.prompt_ids, req.skip_special_tokens)
        self.stops = StopMatcher(req.stop)
        self.output: list[int] = []
        self.finish_reason: str | None = None

    @property
    def remaining(self) -> int:
        return self.req.max_tokens - len(self.output)

    def add(self, tokens: Iterable[int]) -> Delivery:
        delivered: list[int] = []
        text: list[str] = []
        for token in tokens:
            if self.finish_reason is not None:
                break
            self.output.append(token)
            delivered.append(token)
            text.append(self._one(token))
        return Delivery(delivered, "".join(text), self.finish_reason)

    def _one(self, token: int) -> str:
        n = len(self.output)
        if token in self.stop_ids:
            self.finish_reason = "stop"
            return self._flush()
        match = self.stops.add(self.detok.add(token), check=n >= self.req.min_tokens)
        if match.stopped:
            self.finish_reason = "stop"
            return match.text
        if n >= self.req.max_tokens:
            self.finish_reason = "length"
            return match.text + self._flush()
        return match.text

    def _flush(self) -> str:
        """Held text at the end: a broken byte tail, a partial stop string that never completed."""
        match = self.stops.add(self.detok.flush(), check=len(self.output) >= self.req.min_tokens)
        if match.stopped:
            self.finish_reason = "stop"
            return match.text
        return match.text + self.stops.flush()
