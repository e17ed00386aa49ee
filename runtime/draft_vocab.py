"""A drafter's vocabulary: the target's token ids it may propose, most frequent first.

The drafter's LM head is the target's, [V, H]: on a CPU its product over the block's rows is
the largest part of a Propose (49 152 x 576 fp32 for SmolLM2: 113 MB read per block). A drafter
that scores only the tokens the target actually writes reads a fraction of it. The ranking
comes from the target's own answers (the training set's, `dflash draft-vocab`): the ids seen,
most frequent first, plus the end-of-sequence ids. Frequency-ranked drafting as in FR-Spec (Zhao
et al., 2025: "FR-Spec: Accelerating Large-Vocabulary Language Models via Frequency-Ranked
Speculative Sampling").

Exactness does not depend on it: the target verifies every draft, so a token the drafter cannot
propose is at worst a rejected position (the target's own token is committed there).

File: `draft_vocab.json` beside the drafter's config, {"ids": [...], "source": str, "counted":
int}."""
from __future__ import annotations

import json
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

FILE = "draft_vocab.json"
FULL = 0             # DraftConfig.draft_vocab: every target token
SHIPPED = -1         # ... the checkpoint's ranking when it ships one, else every token
MIN_IDS = 64         # fewer is refused (a tree takes each position's 16 likeliest tokens)


@dataclass(frozen=True)
class DraftVocab:
    ids: tuple[int, ...]        # target token ids, most frequent first, distinct
    source: str = ""            # what was counted (for the log and the docs)
    counted: int = 0            # tokens counted

    @staticmethod
    def rank(token_lists: Iterable[Iterable[int]], always: Iterable[int] = (),
             source: str = "") -> DraftVocab:
        """Every id seen, most frequent first (ties: lower id first); `always` (the end of
        sequence ids) first of all, so no cut drops them."""
        counts: Counter[int] = Counter()
        for tokens in token_lists:
            counts.update(tokens)
        head = list(dict.fromkeys(always))
        first = set(head)
        ranked = sorted((t for t in counts if t not in first), key=lambda t: (-counts[t], t))
        return DraftVocab(tuple(head + ranked), source, sum(counts.values()))

    def filled(self, vocab_size: int) -> DraftVocab:
        """At least min(MIN_IDS, vocab_size) ids: the ranking, then the lowest ids it lacks (a
        BPE vocabulary's low ids are its earliest, most frequent merges)."""
        want = min(MIN_IDS, vocab_size)
        if len(self.ids) >= want:
            return self
        have = set(self.ids)
        extra = [t for t in range(vocab_size) if t not in have][: want - len(self.ids)]
        return DraftVocab(self.ids + tuple(extra), self.source, self.counted)

    def top(self, n: int) -> tuple[int, ...]:
        """The n most frequent ids (all of them when n >= len)."""
        return self.ids[:n]

    def coverage(self, tokens: Iterable[int], n: int = 0) -> float:
        """The fraction of `tokens` among the n most frequent ids (0: all of them)."""
        kept = set(self.top(n) if n else self.ids)
        tokens = list(tokens)
        return sum(t in kept for t in tokens) / len(tokens) if tokens else 1.0

    def save(self, model_dir: str | Path) -> Path:
        path = Path(model_dir) / FILE
        path.write_text(json.dumps({"source": self.source, "counted": self.counted,
                                    "ids": list(self.ids)}, separators=(",", ":")) + "\n")
        return path

    @staticmethod
    def load(model_dir: str | Path) -> DraftVocab | None:
        """The drafter's ranking, or None when it ships none. ValueError when unreadable."""
        path = Path(model_dir) / FILE
        if not path.is_file():
            return None
        try:
            raw = json.loads(path.read_text())
            ids = tuple(int(t) for t in raw["ids"])
        except (ValueError, KeyError, TypeError) as e:
            raise ValueError(f"{path} is not a draft vocabulary ({{\"ids\": [...]}}): {e}") from None
        if len(set(ids)) != len(ids) or not ids:
            raise ValueError(f"{path}: ids must be distinct and not empty")
        return DraftVocab(ids, str(raw.get("source", "")), int(raw.get("counted", 0)))


def resolve(model_dir: str | Path, size: int, vocab_size: int) -> tuple[int, ...] | None:
    """The ids a drafter proposes from for DraftConfig.draft_vocab = size (SHIPPED, FULL or N),
    or None for the whole vocabulary. ValueError: N without a shipped ranking, or ids outside
    the target's vocabulary."""
    if size == FULL:
        return None
    vocab = DraftVocab.load(model_dir)
    if vocab is None:
        if size == SHIPPED:
            return None
        raise ValueError(f"--draft-vocab {size}: the drafter {model_dir} ships no {FILE} "
                         f"(write one with `dflash draft-vocab`, or pass 0 for every token)")
    ids = vocab.top(size) if size > 0 else vocab.ids
    if len(ids) < MIN_IDS:
        raise ValueError(f"a draft vocabulary of {len(ids)} ids is too small: at least "
                         f"{MIN_IDS} (--draft-vocab 0: every token)")
    bad = [t for t in ids if not 0 <= t < vocab_size]
    if bad:
        raise ValueError(f"{Path(model_dir) / FILE} holds ids outside the target vocabulary "
                         f"[0, {vocab_size}): {bad[:5]}")
    return None if len(ids) >= vocab_size else ids
