"""What the tiny random checkpoints (tiny_hybrid, tiny_mla) share: another model's vocabulary
and tokenizer, and an LM head restricted to a few ids (so greedy output soon repeats and prompt
lookup drafts get partly accepted)."""
from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")


def vocab_fields(vocab_from: str | Path | None) -> dict[str, Any]:
    """vocab_size and bos/eos/pad ids of vocab_from's config.json ({} without one)."""
    if vocab_from is None:
        return {}
    cfg = json.loads((Path(vocab_from) / "config.json").read_text())
    return {k: cfg[k] for k in ("vocab_size", "bos_token_id", "eos_token_id", "pad_token_id")
            if k in cfg}


def copy_tokenizer(vocab_from: str | Path | None, out: Path) -> None:
    if vocab_from is None:
        return
    for name in TOKENIZER_FILES:
        if (Path(vocab_from) / name).is_file():
            shutil.copy(Path(vocab_from) / name, out / name)


def restrict_lm_head(model, lo: int, hi: int) -> None:
    """The LM head scores only ids lo..hi-1 (the other rows are zero)."""
    import torch
    if not 0 <= lo < hi <= model.lm_head.weight.shape[0]:
        raise ValueError(f"active vocab {lo}:{hi} outside the vocabulary")
    with torch.no_grad():
        model.lm_head.weight[:lo] = 0
        model.lm_head.weight[hi:] = 0
