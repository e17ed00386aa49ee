"""Structured output's token masks on the target: bitmasks of the tokens allowed at a position,
as the gateway's grammar matcher writes them (gateway/grammar.py) - ceil(V / 32) little-endian
int32 words, bit i % 32 of word i // 32 set = token i allowed (the layout of llguidance, xgrammar
and vLLM) - decoded and applied to logits rows."""
from __future__ import annotations

import numpy as np
import torch


def mask_bytes(vocab_size: int) -> int:
    """The size of one mask for a vocabulary of vocab_size tokens."""
    return 4 * ((vocab_size + 31) // 32)


def mask_problem(mask: bytes, vocab_size: int) -> str | None:
    """Why `mask` cannot be applied (None when it can): its size, or no token allowed."""
    want = mask_bytes(vocab_size)
    if len(mask) != want:
        return (f"a token mask has {len(mask)} bytes; a vocabulary of {vocab_size} tokens needs "
                f"{want} (ceil(V / 32) little-endian int32 words)")
    if not any(mask):
        return "a token mask allows no token"
    return None


def decode_masks(masks: list[bytes], vocab_size: int) -> torch.Tensor:
    """masks (each checked by mask_problem) -> bool [len(masks), vocab_size], True = allowed."""
    raw = np.frombuffer(b"".join(masks), dtype=np.uint8).reshape(len(masks), -1)
    bits = np.unpackbits(raw, axis=1, bitorder="little")[:, :vocab_size]
    return torch.from_numpy(bits.astype(np.bool_))


def apply_masks(logits: torch.Tensor, rows: list[int], masks: list[bytes]) -> None:
    """In place: logits [R, V] rows `rows` keep only the tokens their mask allows (one host ->
    device copy for all of them)."""
    if not rows:
        return
    allowed = decode_masks(masks, logits.shape[1]).to(logits.device, non_blocking=True)
    index = torch.tensor(rows, dtype=torch.int64).to(logits.device, non_blocking=True)
    logits[index] = logits[index].masked_fill(~allowed, float("-inf"))
