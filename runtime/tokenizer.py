"""The target's tokenizer (tokenizer.json) with its chat template, and its fingerprint."""
from __future__ import annotations

import hashlib
import json
from functools import cached_property, lru_cache
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer


@lru_cache(maxsize=16)
def tokenizer_fingerprint(model_dir: str | Path) -> str:
    """sha256 of tokenizer.json in canonical JSON form (key order and whitespace ignored);
    "" when the directory has no tokenizer.json (tiny test models)."""
    file = Path(model_dir) / "tokenizer.json"
    if not file.is_file():
        return ""
    canonical = json.dumps(json.loads(file.read_text()), sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(canonical.encode()).hexdigest()


class ChatTokenizer:
    """Encode/decode plus the chat template from tokenizer_config.json (rendered with jinja2)."""

    def __init__(self, model_dir: str | Path) -> None:
        model_dir = Path(model_dir)
        self.tokenizer = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
        cfg_file = model_dir / "tokenizer_config.json"
        self.config: dict[str, Any] = json.loads(cfg_file.read_text()) if cfg_file.is_file() else {}
        self.chat_template: str | None = self.config.get("chat_template")
        self.vocab_size = self.tokenizer.get_vocab_size(with_added_tokens=True)
        self.special_ids = {i for i, t in self.tokenizer.get_added_tokens_decoder().items()
                            if t.special}

    def token_id(self, text: str | None) -> int | None:
        return None if text is None else self.tokenizer.token_to_id(_content(text))

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        """Through encode_batch, which releases the GIL (encode holds it: a 1 MB text kept a
        gateway's event loop waiting 0.4 s even from a worker thread); the same ids."""
        return self.tokenizer.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids

    @cached_property
    def max_token_bytes(self) -> int:
        """The most UTF-8 bytes of text one token covers (an upper bound: a partial character
        decodes as U+FFFD, 3 bytes), so a text of n characters has at least
        n / max_token_bytes tokens - before any tokenizing."""
        decode = self.tokenizer.decode
        return max(len(decode([i], skip_special_tokens=False).encode())
                   for i in range(self.vocab_size))

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)

    def id_to_token(self, token_id: int) -> str | None:
        return self.tokenizer.id_to_token(token_id)

    def apply_chat_template(self, messages: list[dict[str, Any]],
                            add_generation_prompt: bool = True, **kwargs: Any) -> str:
        if not self.chat_template:
            raise ValueError("this model's tokenizer has no chat template")
        return _compiled(self.chat_template).render(
            messages=messages, add_generation_prompt=add_generation_prompt,
            bos_token=_content(self.config.get("bos_token")) or "",
            eos_token=_content(self.config.get("eos_token")) or "", **kwargs)


def _content(token: Any) -> str | None:
    return token.get("content") if isinstance(token, dict) else token


@lru_cache(maxsize=8)
def _compiled(template: str):
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message: str) -> None:
        raise ValueError(message)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    env.globals["raise_exception"] = raise_exception
    return env.from_string(template)
