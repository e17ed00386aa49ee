"""Prompt lookup (n-gram) drafting: no weights, no features. The drafts continue the most recent
earlier occurrence of the longest suffix n-gram of the sequence's committed tokens (n from
max_ngram down to min_ngram), as vLLM's ngram proposer does; fewer than B-1 tokens, or none,
when the match is near the end or there is none. With --lookup-tree-nodes N a tree Propose gets
a trie of the continuations of several earlier occurrences (N drafts at most)."""
from __future__ import annotations

from collections.abc import Iterator

from runtime.config import default_model_id
from runtime.draft_tree import DraftTree
from runtime.models.dflash import TargetFingerprint
from services.draft.config import DraftConfig
from services.draft.drafter import Drafter, DrafterFacts, ProposeItem

MAX_CONTEXT = 1 << 31


def ngram_matches(tokens: list[int], max_ngram: int, min_ngram: int = 1) -> Iterator[int]:
    """Where the continuation starts after each earlier occurrence of tokens' suffix n-gram,
    n from max_ngram down to min_ngram, the latest occurrence first."""
    size = len(tokens)
    for n in range(min(max_ngram, size - 1), min_ngram - 1, -1):
        suffix = tokens[size - n:]
        last = suffix[-1]
        for start in range(size - n - 1, -1, -1):     # latest first; must end before the suffix
            if tokens[start + n - 1] == last and tokens[start: start + n] == suffix:
                yield start + n


def propose_ngram(tokens: list[int], k: int, max_ngram: int, min_ngram: int = 1) -> list[int]:
    """Up to k tokens following the latest earlier occurrence of tokens' longest matching
    suffix of length max_ngram..min_ngram; [] when no suffix occurs earlier."""
    if k > 0:
        for start in ngram_matches(tokens, max_ngram, min_ngram):
            return tokens[start: start + k]
    return []


def propose_ngram_tree(tokens: list[int], nodes: int, depth: int, max_ngram: int,
                       min_ngram: int = 1) -> DraftTree:
    """A trie of the continuations (up to `depth` tokens each) after the suffix's earlier
    occurrences, in ngram_matches' order - the longest, latest match's path first - until it
    holds `nodes` drafts (SGLang's n-gram speculation drafts such trees)."""
    tokens_out: list[int] = []
    parents: list[int] = []
    node_of: dict[tuple[int, int], int] = {}        # (parent node, token) -> node (1-based)
    for start in ngram_matches(tokens, max_ngram, min_ngram):
        parent = 0
        for token in tokens[start: start + depth]:
            node = node_of.get((parent, token))
            if node is None:
                if len(tokens_out) == nodes:
                    return DraftTree(tokens_out, parents)
                tokens_out.append(token)
                parents.append(parent)
                node = node_of[(parent, token)] = len(tokens_out)
            parent = node
    return DraftTree(tokens_out, parents)


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
            target=target, max_tree_nodes=config.lookup_tree_nodes)

    def propose(self, items: list[ProposeItem]) -> list[DraftTree]:
        out = []
        for item in items:
            item.seq.tokens.extend(item.token_ids)
            context = item.seq.tokens + [item.anchor]
            cfg = self.config
            if item.tree_nodes:
                out.append(propose_ngram_tree(context, item.tree_nodes, item.block_size - 1,
                                              cfg.max_ngram, cfg.min_ngram))
            else:
                out.append(DraftTree.chain(propose_ngram(context, item.block_size - 1,
                                                         cfg.max_ngram, cfg.min_ngram)))
        return out
