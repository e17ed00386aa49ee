"""Draft trees (runtime/draft_tree.py): the best-first tree equals the n likeliest prefixes found
by brute force, it is prefix-closed and breadth-first, the ancestor mask and depths follow the
parents, the greedy walk commits the longest path of the target's choices, and bad parents are
named."""
from __future__ import annotations

import itertools
import math
import random

import pytest

from runtime.draft_tree import DraftTree, best_prefixes, best_tree, parents_problem


def random_logp(rng: random.Random, depth: int, width: int) -> list[list[float]]:
    """Per depth, `width` ranked log-probabilities (best first, all distinct)."""
    out = []
    for _ in range(depth):
        p = sorted((rng.random() + 1e-3 for _ in range(width)), reverse=True)
        total = sum(p) * (1 + rng.random())          # the rest of the vocabulary holds the remainder
        out.append([math.log(x / total) for x in p])
    return out


@pytest.mark.parametrize("seed", range(8))
def test_best_prefixes_are_the_likeliest_by_brute_force(seed):
    rng = random.Random(seed)
    depth, width = rng.randint(1, 4), rng.randint(1, 4)
    logp = random_logp(rng, depth, width)
    every = [ranks for d in range(1, depth + 1)
             for ranks in itertools.product(range(width), repeat=d)]
    score = {r: sum(logp[i][k] for i, k in enumerate(r)) for r in every}
    for n in (1, 3, 7, len(every), len(every) + 5):
        got = best_prefixes(logp, n)
        want = sorted(every, key=lambda r: -score[r])[:n]
        assert len(got) == min(n, len(every))
        assert sorted(score[r] for r in got) == pytest.approx(sorted(score[r] for r in want))
        assert all(r[:-1] in set(got) or len(r) == 1 for r in got)     # prefix-closed


def test_best_tree_is_breadth_first_with_parents_before_children():
    rng = random.Random(3)
    logp = random_logp(rng, 6, 5)
    candidates = [[100 * d + k for k in range(5)] for d in range(6)]
    tree = best_tree(candidates, logp, 20)
    assert len(tree.tokens) == 20 and parents_problem(tree.parents, 20) is None
    depths = tree.depths
    assert depths[1:] == sorted(depths[1:])
    for i, t in enumerate(tree.tokens, start=1):
        assert t // 100 == depths[i] - 1                # the candidate of its own depth
    assert tree.tokens[0] == candidates[0][0]           # the likeliest first draft comes first


def test_chain_is_a_tree_whose_parents_are_its_predecessors():
    chain = DraftTree.chain([5, 6, 7])
    assert chain.parents == [0, 1, 2] and chain.is_chain
    assert chain.depths == [0, 1, 2, 3]
    assert chain.ancestor_mask().tolist() == [[j <= i for j in range(4)] for i in range(4)]
    assert not DraftTree([5, 6], [0, 0]).is_chain


def test_ancestor_mask_and_depths_follow_the_parents():
    tree = DraftTree([10, 11, 12, 13, 14], [0, 0, 1, 3, 2])    # 1,2 under the anchor; 3<-1; 4<-3; 5<-2
    assert tree.depths == [0, 1, 1, 2, 3, 2]
    mask = tree.ancestor_mask()
    assert [j for j in range(6) if mask[4, j]] == [0, 1, 3, 4]
    assert [j for j in range(6) if mask[5, j]] == [0, 2, 5]
    assert [j for j in range(6) if mask[2, j]] == [0, 2]



@pytest.mark.parametrize("nodes", [1, 15, 63, 64, 130])
def test_ancestor_masks_of_any_size_walk_the_parents(nodes):
    """Row i sees exactly node i and the nodes on its way up to the anchor - across the 64-bit
    words the mask is built from - and the triton backend's packed words say the same."""
    from runtime.attention.triton_backend import mask_bits
    rng = random.Random(nodes)
    tree = DraftTree([0] * nodes, [rng.randrange(i + 1) for i in range(nodes)])
    mask = tree.ancestor_mask()
    for i in range(nodes + 1):
        up, node = {0, i}, i
        while node:
            node = tree.parents[node - 1]
            up.add(node)
        assert {j for j in range(nodes + 1) if mask[i, j]} == up
    width = -(-(nodes + 1) // 32)
    words = mask_bits(mask, nodes + 1, width).tolist()
    assert all(((words[i][j // 32] >> (j % 32)) & 1) == bool(mask[i, j])
               for i in range(nodes + 1) for j in range(nodes + 1))

def test_greedy_path_takes_the_matching_child_at_every_node():
    tree = DraftTree([10, 11, 12, 13, 14], [0, 0, 2, 3, 2])
    # argmax after each node: anchor -> 11 (node 2), node 2 -> 12 (node 3), node 3 -> 13 (node 4)
    assert tree.greedy_path([11, 0, 12, 13, 99, 0]) == ([2, 3, 4], 99)
    assert tree.greedy_path([11, 0, 14, 0, 0, 7]) == ([2, 5], 7)
    assert tree.greedy_path([42, 0, 0, 0, 0, 0]) == ([], 42)          # nothing accepted: bonus


@pytest.mark.parametrize("parents, n, words", [
    ([0], 2, "1 entries for 2 draft tokens"),
    ([0, 2], 2, "parents[1] = 2"),
    ([1, 0], 2, "parents[0] = 1"),
])
def test_bad_parents_are_named(parents, n, words):
    assert words in parents_problem(parents, n)
    assert parents_problem([0, 0, 1], 3) is None


def test_the_first_path_of_a_best_first_tree_is_the_drafters_chain():
    rng = random.Random(5)
    logp = random_logp(rng, 5, 4)
    candidates = [[100 * d + k for k in range(4)] for d in range(5)]
    tree = best_tree(candidates, logp, 12)
    chain = [candidates[d][0] for d in range(max(tree.depths))]
    assert tree.first_path() == chain
    assert DraftTree.chain([7, 8, 9]).first_path() == [7, 8, 9]
    assert DraftTree([5, 6, 7, 8], [0, 0, 2, 1]).first_path() == [5, 8]
