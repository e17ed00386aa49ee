"""Prompt lookup: the n-gram rule, and the drafter through the real engine."""
from __future__ import annotations

import asyncio

import pytest

from services.draft.config import DraftConfig
from services.draft.engine import DraftEngine, ProposeCall
from services.draft.prompt_lookup import PromptLookupDrafter, propose_ngram, propose_ngram_tree


def test_continues_the_latest_earlier_occurrence_of_the_longest_suffix():
    #          0  1  2  3  4  5  6  7  8  9 10 11
    tokens = [5, 6, 7, 8, 9, 1, 6, 7, 2, 3, 5, 6, 7]
    # suffix 3-gram [5, 6, 7] occurs at 0 -> continue with 8, 9, 1, ...
    assert propose_ngram(tokens, 4, max_ngram=4) == [8, 9, 1, 6]
    # limited to n = 2: [6, 7] occurs last at 6 -> continue with 2, 3, 5
    assert propose_ngram(tokens, 3, max_ngram=2) == [2, 3, 5]


def test_fewer_tokens_near_the_end_and_none_without_a_match():
    assert propose_ngram([1, 2, 3, 1, 2], 7, max_ngram=3) == [3, 1, 2]
    assert propose_ngram([1, 2, 3, 4], 7, max_ngram=3) == []
    assert propose_ngram([4], 7, max_ngram=3) == []
    assert propose_ngram([1, 2, 1, 2], 0, max_ngram=3) == []
    # min_ngram 2: a lone repeated token is not enough
    assert propose_ngram([7, 1, 2, 7], 3, max_ngram=3, min_ngram=2) == []
    assert propose_ngram([7, 1, 2, 7], 3, max_ngram=3, min_ngram=1) == [1, 2, 7]


def test_a_tree_merges_the_continuations_of_several_occurrences():
    #          0  1  2  3  4  5  6  7  8  9 10
    tokens = [5, 6, 8, 9, 5, 6, 7, 2, 3, 5, 6]
    # [5, 6] occurs at 4 (-> 7 2 3) and at 0 (-> 8 9 5); [6] adds nothing new
    tree = propose_ngram_tree(tokens, 8, 3, max_ngram=2)
    assert (tree.tokens, tree.parents) == ([7, 2, 3, 8, 9, 5], [0, 1, 2, 0, 4, 5])
    assert tree.tokens[:3] == propose_ngram(tokens, 3, max_ngram=2)   # the chain's path first
    small = propose_ngram_tree(tokens, 4, 3, max_ngram=2)             # node budget
    assert (small.tokens, small.parents) == ([7, 2, 3, 8], [0, 1, 2, 0])
    shared = propose_ngram_tree([1, 2, 3, 1, 2, 4, 1], 8, 2, max_ngram=1)  # a shared prefix
    assert (shared.tokens, shared.parents) == ([2, 4, 3], [0, 1, 1])
    assert propose_ngram_tree([1, 2, 3], 8, 3, max_ngram=2).tokens == []


def test_the_drafter_drafts_trees_only_when_configured(tiny_llama_dir):
    assert PromptLookupDrafter(DraftConfig(target_dir=str(tiny_llama_dir),
                                           drafter="prompt-lookup")).facts.max_tree_nodes == 0
    cfg = DraftConfig(target_dir=str(tiny_llama_dir), drafter="prompt-lookup",
                      lookup_tree_nodes=15)
    drafter = PromptLookupDrafter(cfg)
    assert drafter.facts.max_tree_nodes == 15
    engine = DraftEngine(drafter, cfg)
    engine.start()
    try:
        r = asyncio.run(engine.propose(ProposeCall("s", 0, 6, None, [5, 6, 8, 5, 6, 7], 5, 3,
                                                   tree_nodes=4)))
    finally:
        engine.stop()
    # anchor 5: [6, 5] never occurred, [5] at 3 (-> 6 7) and at 0 (-> 6 8)
    assert (r.draft_tokens, r.draft_parents) == ([6, 7, 8], [0, 1, 1])
    with pytest.raises(ValueError, match="lookup_tree_nodes"):
        DraftConfig(target_dir=str(tiny_llama_dir), drafter="prompt-lookup",
                    lookup_tree_nodes=-1)


def test_drafter_keeps_committed_tokens_across_proposes(tiny_llama_dir):
    cfg = DraftConfig(target_dir=str(tiny_llama_dir), drafter="prompt-lookup", block_size=4)
    engine = DraftEngine(PromptLookupDrafter(cfg), cfg)
    engine.start()

    async def run() -> list:
        out = []
        # prompt 10 11 12 13, anchor 10: suffix [10] occurs at 0 -> 11 12 13
        out.append(await engine.propose(ProposeCall("s", 0, 4, None, [10, 11, 12, 13], 10, 4)))
        # verify committed 10 (the anchor) and 11, bonus 99: nothing ever followed 99
        out.append(await engine.propose(ProposeCall("s", 4, 2, None, [10, 11], 99, 4)))
        # anchor 12: [99, 12] never occurred before, [12] did at 2 -> 13 10 11
        out.append(await engine.propose(ProposeCall("s", 6, 1, None, [99], 12, 4)))
        return out

    try:
        results = asyncio.run(run())
    finally:
        engine.stop()
    assert [r.draft_tokens for r in results] == [[11, 12, 13], [], [13, 10, 11]]
    assert [r.context_len for r in results] == [4, 6, 7]
    assert engine.seqs["s"].tokens == [10, 11, 12, 13, 10, 11, 99]


@pytest.mark.parametrize("block", [1, 2])
def test_small_blocks(block, tiny_llama_dir):
    cfg = DraftConfig(target_dir=str(tiny_llama_dir), drafter="prompt-lookup")
    drafter = PromptLookupDrafter(cfg)
    engine = DraftEngine(drafter, cfg)
    engine.start()
    try:
        r = asyncio.run(engine.propose(ProposeCall("s", 0, 3, None, [1, 2, 1], 2, block)))
    finally:
        engine.stop()
    assert r.draft_tokens == [1, 2, 1][: block - 1]
