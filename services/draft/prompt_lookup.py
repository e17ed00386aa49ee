"""Prompt lookup (n-gram) drafting: no weights, no features. The drafts continue the most recent
earlier occurrence of the longest suffix n-gram of the sequence's committed tokens (n from
max_ngram down to min_ngram), as vLLM's ngram proposer does; fewer than B-1 tokens, or none,
when the match is near the end or there is none."""
from __future__ import annotations

from runtime.config import default_model_id
from runtime.draft_tree import DraftTree
from runtime.models.dflash import TargetFingerprint
from services.draft.config import DraftConfig
from services.draft.drafter import Drafter, DrafterFacts, ProposeItem

MAX_CONTEXT = 1 << 31


def propose_ngram(tokens: list[int], k: int, max_ngram: int, min_ngram: int = 1) -> list[int]:
    """Up to k tokens following the latest earlier occurrence of tokens' longest matching
    suffix of length max_ngram..min_ngram; [] when no suffix occurs earlier."""
    size = len(tokens)
    if k <= 0:
        return []
    for n in range(min(max_ngram, size - 1), min_ngram - 1, -1):
        suffix = tokens[size - n:]
        last = suffix[-1]
        for start in range(size - n - 1, -1, -1):     # latest first; must end before the suffix
            if tokens[start + n - 1] == last and tokens[start: start + n] == suffix:
                return tokens[start + n: start + n + k]
    return []


class PromptLookupDrafter(Drafter):
    def __init__(self, config: DraftConfig, random_weights: bool = False) -> None:
        self.config = config            # random_weights: no weights, nothing to do
        target = TargetFingerprint.of_target(config.target_dir)
        self.facts = DrafterFacts(
            kind="prompt-lookup",
            model_id=config.model_id or f"prompt-lookup:{default_model_id(config.target_dir)}",
            block_size=config.block_size, max_block_size=config.max_block_size or config.block_size,
            target_layer_ids=(), mask_token_id=0, hidden_size=target.hidden_size,
            vocab_size=target.vocab_size, max_context=MAX_CONTEXT,
            feature_dtype=config.feature_dtype, needs_features=False, needs_tokens=True,
            target=target)

    def propose(self, items: list[ProposeItem]) -> list[DraftTree]:
        out = []
        for item in items:
            item.seq.tokens.extend(item.token_ids)
            out.append(DraftTree.chain(propose_ngram(
                item.seq.tokens + [item.anchor], item.block_size - 1, self.config.max_ngram,
                self.config.min_ngram)))
        return out
