"""Self-written training prompts (Magpie: Xu et al., 2024, "Alignment Data Synthesis from Scratch
by Prompting Aligned LLMs with Nothing"): given its chat template up to an open user turn, an
instruction-tuned target writes a user's request itself. Sampled in waves, cleaned, kept only
when complete (ended by EOS), plain ASCII and no near-duplicate of another kept request or of
any held-out prompt. They widen the training prompts beyond the template-built set with
requests in the target's own distribution, at no cost but generation."""
from __future__ import annotations

import logging
import time

from runtime.tokenizer import ChatTokenizer
from train.generate import answer_wave
from train.prompts import DedupIndex, PromptRecord
from train.target_runner import TargetRunner

log = logging.getLogger("dflash.train.self_prompts")

CATEGORY = "self"
MIN_WORDS = 3
_PLACEHOLDER = "\x00USER\x00"
_TYPOGRAPHIC = str.maketrans({"\u2018": "'", "\u2019": "'", "\u201c": '"', "\u201d": '"',
                              "\u2013": "-", "\u2014": "-", "\u2026": "..."})


def user_turn_prefix(tok: ChatTokenizer) -> list[int]:
    """The chat template's tokens before a user's words (system turn included, as the template
    renders a conversation without one)."""
    rendered = tok.apply_chat_template([{"role": "user", "content": _PLACEHOLDER}],
                                       add_generation_prompt=True)
    return tok.encode(rendered[: rendered.index(_PLACEHOLDER)])


def request_text(tok: ChatTokenizer, ids: list[int], eos: set[int]) -> str | None:
    """A written request's text, or None when it is unfit: not ended by EOS (cut off), with
    special tokens, not plain ASCII after typographic punctuation is replaced, or under
    MIN_WORDS words."""
    if not ids or ids[-1] not in eos or eos & set(ids[:-1]):
        return None
    text = tok.decode(ids[:-1]).translate(_TYPOGRAPHIC).strip()
    printable = all(c.isprintable() or c in "\n\t" for c in text)
    if "<|" in text or not text.isascii() or not printable or len(text.split()) < MIN_WORDS:
        return None
    return text


def write_prompts(runner: TargetRunner, tok: ChatTokenizer, count: int, temperature: float,
                  max_tokens: int, seed: int, concurrency: int, held_out: list[str],
                  max_waves: int = 0) -> list[PromptRecord]:
    """Up to `count` requests the target writes itself (fewer only when `max_waves` waves of
    `concurrency` draws, default enough for 4 x count draws, keep too few); each wave has its own
    seed, so the result is reproducible. held_out: texts no request may near-duplicate."""
    index = DedupIndex()
    for text in held_out:
        index.add(text, "held-out")
    prefix, eos = user_turn_prefix(tok), set(runner.eos_token_ids)
    max_waves = max_waves or -(-4 * count // concurrency)
    out: list[PromptRecord] = []
    t0, drawn = time.monotonic(), 0
    for wave in range(max_waves):
        if len(out) >= count:
            break
        n = min(concurrency, 2 * (count - len(out)))
        for ids in answer_wave(runner, [prefix] * n, temperature, max_tokens, seed * 7907 + wave):
            text = request_text(tok, ids, eos)
            if text and len(out) < count and index.add(text, "train"):
                out.append(PromptRecord(f"self-{len(out):05d}", CATEGORY, "train", text))
        drawn += n
        log.info("self-written prompts: kept %d of %d drawn (%.0f s)", len(out), drawn,
                 time.monotonic() - t0)
    return out
