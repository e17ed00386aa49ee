"""Exact sampling over a draft tree: which path of a tree of drafts a sampled sequence commits,
decided on the device without a host sync (the rule and its proof: docs/tree-sampling.md).

The rule is recursive rejection sampling with point-mass proposals. At a node whose target
distribution is p, its children c_1..c_m (distinct tokens, in the tree's order) are tried in
turn against a residual r that starts as p: child c_j is accepted with probability r(c_j), and
on rejection c_j is removed from r (r(c_j) = 0, renormalised). The first child accepted becomes
the node whose children are tried next; when every child is rejected (or the node is a leaf) the
bonus token is drawn from the residual. Each step commits c_j with probability
r_{j-1}(c_j) * prod_{i<j} (1 - r_{i-1}(c_i)) = p(c_j), and any other token x with probability
p(x): the committed tokens follow the target's distribution exactly, whatever tokens the tree
holds, as long as the tree does not depend on the target's draws. The chain rule in
runtime/acceptance.py is the one-child case.

Parallel form (what runs): r_{j-1}(c_j) = p(c_j) / (1 - sum_{i<j} p(c_i)) needs only each node's
earlier siblings, so one uniform per node decides every node's test at once; a node is chosen
when it passes and no earlier sibling does, and is on the path when it and all its ancestors are
chosen. A sibling repeating an earlier sibling's token has residual 0 (never accepted)."""
from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import torch

from runtime.draft_tree import DraftTree


@dataclass(frozen=True)
class TreeLayout:
    """The host-side structure the device rule needs (n drafts, V = vocab), sent in one copy:
    int64 [n+1, 4 + 2n + C]. Row i = draft node i (1..n): its parent row, token, depth, whether
    it repeats an earlier sibling's token, its earlier siblings (n flags), its ancestors-or-self
    among the drafts (n flags). Every row, the anchor's (0) included, ends with the tokens of its
    children (C columns, padded with V)."""
    tree: DraftTree
    vocab: int

    @cached_property
    def packed(self) -> torch.Tensor:
        n, tree = len(self.tree.tokens), self.tree
        children: dict[int, list[int]] = {}
        for i, p in enumerate(tree.parents, start=1):
            children.setdefault(p, []).append(i)
        width = max((len(c) for c in children.values()), default=0) or 1
        out = torch.zeros((n + 1, 4 + 2 * n + width), dtype=torch.int64)
        ancestors = tree.ancestor_mask()[1:, 1:].to(torch.int64)
        for i, p in enumerate(tree.parents, start=1):
            siblings = [s for s in children[p] if s < i]
            out[i, :4] = torch.tensor([p, tree.tokens[i - 1], tree.depths[i],
                                       any(tree.tokens[s - 1] == tree.tokens[i - 1]
                                           for s in siblings)])
            for s in siblings:
                out[i, 4 + s - 1] = 1
            out[i, 4 + n: 4 + 2 * n] = ancestors[i - 1]
        for node in range(n + 1):
            kids = [tree.tokens[c - 1] for c in children.get(node, [])]
            out[node, 4 + 2 * n:] = torch.tensor(kids + [self.vocab] * (width - len(kids)))
        return out


def tree_rejection_device(tree: DraftTree, probs: torch.Tensor,
                          generator: torch.Generator | None) -> torch.Tensor:
    """probs [n+1, V]: the target's probabilities after each block row (row 0: the anchor, row i:
    draft node i), on their device. Returns int64 [2 + n] on that device: (a = the accepted path's
    length, the bonus token, then 1 for each draft node on the path). Draws: n uniforms, then one
    multinomial. No host sync."""
    n, vocab = len(tree.tokens), probs.shape[1]
    packed = TreeLayout(tree, vocab).packed.to(probs.device, non_blocking=True)
    nodes = packed[1:]
    parent, token, depth, repeat = nodes[:, 0], nodes[:, 1], nodes[:, 2], nodes[:, 3]
    earlier = nodes[:, 4: 4 + n].to(probs.dtype)                         # [n, n]
    ancestors = nodes[:, 4 + n: 4 + 2 * n].to(probs.dtype)               # [n, n]
    p_child = probs[parent, token] * (1 - repeat).to(probs.dtype)        # [n]
    residual_mass = (1 - earlier @ p_child).clamp_min(1e-30)
    passed = torch.rand(n, generator=generator, device=probs.device) < p_child / residual_mass
    chosen = passed & ((earlier @ passed.to(probs.dtype)) == 0)
    on_path = (ancestors @ (~chosen).to(probs.dtype)) == 0               # [n]
    a = on_path.sum()
    last = torch.where(a > 0, (on_path * depth).argmax() + 1, torch.zeros_like(a))
    bonus = _residual_draw(probs, packed, last, 4 + 2 * n, generator)
    return torch.cat([a.view(1), bonus.view(1), on_path.to(torch.int64)])


def _residual_draw(probs: torch.Tensor, packed: torch.Tensor, last: torch.Tensor, kids_at: int,
                   generator: torch.Generator | None) -> torch.Tensor:
    """The bonus after block row `last` (a 0-d device tensor): drawn from its probabilities with
    its children's tokens removed (every child was rejected), renormalised."""
    row = probs.index_select(0, last.view(1))[0]                                  # [V]
    kids = packed.index_select(0, last.view(1))[0, kids_at:]                      # [C], V = pad
    residual = torch.cat([row, row.new_zeros(1)]).index_fill(0, kids, 0.0)[:-1]
    total = residual.sum()
    row = torch.where(total > 0, residual / total.clamp_min(1e-30), row)
    return torch.multinomial(row, 1, generator=generator)[0]


def path_rows(on_path: list[int]) -> list[int]:
    """The accepted path's block rows, anchor down (node indexes order ancestors first)."""
    return [i for i, flag in enumerate(on_path, start=1) if flag]
