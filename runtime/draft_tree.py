"""Draft trees: several draft continuations of one anchor, verified by the target in one forward.

A block is node 0 (the anchor, the last committed token) followed by draft nodes 1..n; each
draft node i has a parent parents[i-1] < i (0 = the anchor). A chain is parents [0, 1, .., n-1].
The target runs every node at position (context length + its depth) under an attention mask
that lets a node see the committed context, its ancestors and itself (`ancestor_mask`), then
commits the longest path from the anchor along which every token is its own greedy choice
(`greedy_path`), plus the bonus token it predicts after the path's last node.

The DFlash drafter predicts all block positions in one parallel forward: a distribution q_k over
the vocabulary for each depth k = 1..B-1, given the context and the anchor but not the drafts
before it. Its tree (`best_tree`) is the n token prefixes with the largest product of those
marginals, q_1(t_1) x ... x q_k(t_k) - prefix-closed, since a prefix scores at least what its
extensions do. Exactness needs no assumption about the tree: at temperature 0 the committed path
is the target's own greedy chain whatever was drafted."""
from __future__ import annotations

import heapq
from dataclasses import dataclass
from functools import cached_property
from typing import TYPE_CHECKING

if TYPE_CHECKING:                  # torch only where a mask is built (the gateway has no torch)
    import torch

@dataclass(frozen=True)
class DraftTree:
    """Draft tokens and each one's parent index in [anchor, *tokens] (parents[i] <= i)."""
    tokens: list[int]
    parents: list[int]

    @staticmethod
    def chain(tokens: list[int]) -> DraftTree:
        return DraftTree(list(tokens), list(range(len(tokens))))

    @property
    def is_chain(self) -> bool:
        return all(p == i for i, p in enumerate(self.parents))

    @cached_property
    def depths(self) -> list[int]:
        """[n+1]: 0 for the anchor, then each node's distance from it (computed once)."""
        out = [0]
        for p in self.parents:
            out.append(out[p] + 1)
        return out

    @cached_property
    def ancestor_bits(self) -> list[int]:
        """[n+1]: per node, an int whose bit j is set where it may attend to node j (itself and
        its ancestors, the anchor included) - ancestor_mask's rows, computed once."""
        bits = [1]
        for i, p in enumerate(self.parents, start=1):
            bits.append(bits[p] | (1 << i))
        return bits

    def ancestor_mask(self) -> torch.Tensor:
        """bool [n+1, n+1]: True where row node may attend to column node (itself and its
        ancestors, the anchor included). Built from ancestor_bits in one vectorized pass over
        64-bit words (a row by row loop of tensor ops took 5 % of the target's host time per
        tree verify on the H100)."""
        import numpy as np
        import torch
        n, bits = len(self.tokens) + 1, self.ancestor_bits
        words = np.array([[(b >> (64 * w)) & 0xFFFF_FFFF_FFFF_FFFF for w in range(-(-n // 64))]
                          for b in bits], dtype=np.uint64)                      # [n, W]
        mask = (words[:, :, None] >> np.arange(64, dtype=np.uint64)) & np.uint64(1)  # [n, W, 64]
        return torch.from_numpy(mask.reshape(n, -1)[:, :n].astype(np.bool_))

    def first_path(self) -> list[int]:
        """The tokens of the path that takes each node's first child, from the anchor down: a
        chain's all; in a best-first tree (best_tree, prompt lookup's trie) the chain the
        drafter would have proposed."""
        first: dict[int, int] = {}
        for i, p in enumerate(self.parents, start=1):
            first.setdefault(p, i)
        out, node = [], 0
        while node in first:
            node = first[node]
            out.append(self.tokens[node - 1])
        return out

    def greedy_path(self, argmax: list[int]) -> tuple[list[int], int]:
        """argmax [n+1]: the target's greedy token after each node -> (the accepted draft nodes
        from the anchor down, in order; the bonus token after the last of them)."""
        children: dict[int, list[int]] = {}
        for i, p in enumerate(self.parents, start=1):
            children.setdefault(p, []).append(i)
        path, node = [], 0
        while True:
            nxt = next((c for c in children.get(node, ()) if self.tokens[c - 1] == argmax[node]),
                       None)
            if nxt is None:
                return path, argmax[node]
            path.append(nxt)
            node = nxt


def parents_problem(parents: list[int], num_drafts: int) -> str | None:
    """Why `parents` is not a tree over `num_drafts` drafts (None when it is)."""
    if len(parents) != num_drafts:
        return (f"parents has {len(parents)} entries for {num_drafts} draft tokens: expected "
                f"one per draft token (or none for a chain)")
    for i, p in enumerate(parents):
        if p > i:
            return (f"parents[{i}] = {p}: a draft's parent must come before it in "
                    f"[anchor, drafts...], i.e. be at most {i}")
    return None


def tree_problem(tree: DraftTree, max_nodes: int, max_depth: int) -> str | None:
    """Why a verifier would refuse `tree` (None when it takes it): its parents, more than
    max_nodes drafts (or none), deeper than max_depth drafts."""
    problem = parents_problem(tree.parents, len(tree.tokens))
    if problem is not None:
        return problem
    if not 1 <= len(tree.tokens) <= max_nodes:
        return f"{len(tree.tokens)} draft nodes; allowed 1..{max_nodes}"
    depth = max(tree.depths)
    if depth > max_depth:
        return f"{depth} drafts deep; allowed up to {max_depth}"
    return None


def best_prefixes(logp: list[list[float]], n: int) -> list[tuple[int, ...]]:
    """Per-depth log-probabilities of each depth's ranked candidates [depths][K] (best first)
    -> the n prefixes (tuples of candidate ranks) with the largest summed log-probability, in
    the order found (a prefix always after its parent). Best-first: a popped prefix pushes its
    first child and its next sibling, so every prefix is pushed at most once."""
    if not logp or n <= 0:
        return []
    depth, width = len(logp), len(logp[0])
    heap = [(-logp[0][0], (0,))]
    out: list[tuple[int, ...]] = []
    while heap and len(out) < n:
        neg, ranks = heapq.heappop(heap)
        out.append(ranks)
        d, r = len(ranks), ranks[-1]
        if d < depth:
            heapq.heappush(heap, (neg - logp[d][0], ranks + (0,)))
        if r + 1 < width:
            heapq.heappush(heap, (neg + logp[d - 1][r] - logp[d - 1][r + 1],
                                  ranks[:-1] + (r + 1,)))
    return out


def best_tree(candidates: list[list[int]], logp: list[list[float]], n: int) -> DraftTree:
    """Ranked candidate tokens per depth [B-1][K] and their log-probabilities -> the tree of
    the n most likely prefixes, breadth-first (depth by depth, the likelier first)."""
    prefixes = sorted(best_prefixes(logp, n), key=len)           # stable: likelier first
    index = {(): 0}
    tokens, parents = [], []
    for ranks in prefixes:
        parents.append(index[ranks[:-1]])
        tokens.append(candidates[len(ranks) - 1][ranks[-1]])
        index[ranks] = len(tokens)
    return DraftTree(tokens, parents)
