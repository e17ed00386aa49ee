"""Prompts to token ids, off the event loop (docs/reliability.md, issue 39 hole 3).

A request's prompt is rendered (chat template) and tokenized on a worker thread (the tokenizer's
Rust code releases the GIL there), and a text that cannot fit is refused before any of that: a
token covers at most `max_token_bytes` bytes of text, so a text of more characters than the
tokens allowed times that has more tokens than allowed - a 7.8 MB prompt is a 400 at once, not
seconds of tokenizing first."""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

from gateway.request import RequestError
from runtime.tokenizer import ChatTokenizer


class PromptTokenizer:
    """The target's tokenizer as the APIs use it for prompts: encode with the size check."""

    def __init__(self, tokenizer: ChatTokenizer, max_prompt_tokens: Callable[[], int]) -> None:
        self.tokenizer = tokenizer
        self.max_prompt_tokens = max_prompt_tokens        # what the server accepts now
        self.max_token_bytes = tokenizer.max_token_bytes  # computed once, at start

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        limit = self.max_prompt_tokens()
        if len(text) > limit * self.max_token_bytes:
            raise RequestError(
                f"the prompt is {len(text)} characters long; it cannot fit: at most {limit} "
                f"prompt tokens are accepted and one token covers at most "
                f"{self.max_token_bytes} bytes of text", "prompt")
        return self.tokenizer.encode(text, add_special_tokens=add_special_tokens)

    def apply_chat_template(self, messages: list[dict[str, Any]], **kwargs: Any) -> str:
        return self.tokenizer.apply_chat_template(messages, **kwargs)
