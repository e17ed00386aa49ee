"""Logprobs in OpenAI's shapes, from the target's TokenLogprobs (one per delivered token).

- chat: `choices[].logprobs = {"content": [{"token", "logprob", "bytes", "top_logprobs": [...]}]}`
- completions (legacy): `choices[].logprobs = {"tokens", "token_logprobs", "top_logprobs",
  "text_offset"}`, top_logprobs a {token: logprob} object per position.

A token's text is its bytes decoded with U+FFFD for an incomplete UTF-8 sequence (a byte-level
token can hold part of a character); `bytes` has its exact bytes. A logprob of -inf (a token the
processed distribution excludes) is written as -9999.0, as vLLM does: JSON has no infinity."""
from __future__ import annotations

import json
from functools import lru_cache
from typing import Any

from dflash.v1 import common_pb2
from runtime.tokenizer import ChatTokenizer

FLOOR = -9999.0


def _byte_decoder() -> dict[str, int]:
    """GPT-2's byte-level alphabet, reversed: the character a ByteLevel tokenizer writes for
    each byte -> the byte."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1),
                 *range(ord("®"), ord("ÿ") + 1)]
    chars, extra = {}, 0
    for b in range(256):
        if b in printable:
            chars[chr(b)] = b
        else:
            chars[chr(256 + extra)] = b
            extra += 1
    return chars


class TokenText:
    """A token id's exact bytes and its text, cached."""

    def __init__(self, tokenizer: ChatTokenizer) -> None:
        self.tokenizer = tokenizer
        decoder = json.loads(tokenizer.tokenizer.to_str()).get("decoder") or {}
        self.byte_level = decoder.get("type") == "ByteLevel"
        self.byte_of = _byte_decoder()
        self.bytes = lru_cache(maxsize=65536)(self._bytes)

    def _bytes(self, token_id: int) -> bytes:
        piece = self.tokenizer.id_to_token(token_id)
        if self.byte_level and piece is not None and all(c in self.byte_of for c in piece):
            return bytes(self.byte_of[c] for c in piece)
        return self.tokenizer.decode([token_id]).encode()

    def text(self, token_id: int) -> str:
        return self.bytes(token_id).decode("utf-8", errors="replace")


def _value(logprob: float) -> float:
    return max(float(logprob), FLOOR)


def chat_content(text: TokenText, ids: list[int], lps: list[common_pb2.TokenLogprobs]
                 ) -> list[dict[str, Any]]:
    """The chat shape's `content` entries for tokens ids (one TokenLogprobs each)."""
    def entry(token: int, logprob: float) -> dict[str, Any]:
        return {"token": text.text(token), "logprob": _value(logprob),
                "bytes": list(text.bytes(token))}
    return [{**entry(t, lp.logprob),
             "top_logprobs": [entry(i, v) for i, v in zip(lp.top_ids, lp.top_logprobs)]}
            for t, lp in zip(ids, lps)]


def completion_logprobs(text: TokenText, ids: list[int], lps: list[common_pb2.TokenLogprobs],
                        offset: int) -> dict[str, Any]:
    """The legacy shape for tokens ids; offset: characters of the completion before them."""
    tokens = [text.text(t) for t in ids]
    offsets = []
    for token in tokens:
        offsets.append(offset)
        offset += len(token)
    return {"tokens": tokens, "token_logprobs": [_value(lp.logprob) for lp in lps],
            "top_logprobs": [{text.text(i): _value(v) for i, v in zip(lp.top_ids, lp.top_logprobs)}
                             for lp in lps],
            "text_offset": offsets}


class LogprobShape:
    """One response's logprobs objects (the chat or the legacy shape), event by event: the
    legacy text offsets carry over from one chunk to the next."""

    def __init__(self, text: TokenText, chat: bool) -> None:
        self.text, self.chat, self.offset = text, chat, 0

    def of(self, ids: list[int], lps: list[common_pb2.TokenLogprobs]) -> dict[str, Any]:
        if self.chat:
            return {"content": chat_content(self.text, ids, lps)}
        out = completion_logprobs(self.text, ids, lps, self.offset)
        self.offset += sum(len(t) for t in out["tokens"])
        return out
