"""Speculative acceptance as pure functions (no server state): what the target commits of a
verified block, decided on the device for a whole batch and read back in one transfer.

Acceptance for a chain drafted greedily (the draft distribution is one-hot on each draft token):
draft token x_i is accepted with probability p_i(x_i); on the first rejection the bonus token is
drawn from the residual p_i with x_i removed (renormalised); if every draft is accepted the bonus
is drawn from p_B. This is the standard rejection rule with q = one-hot, so the committed tokens
follow the target's distribution exactly (lossless). Greedy (temperature 0) is the limit: accept
while x_i == argmax p_i, bonus = argmax at the first mismatch. A tree of drafts (greedy only)
commits the longest path of the target's own greedy choices (runtime/draft_tree.py); a sampled
tree, the path that recursive rejection sampling accepts (runtime/tree_sampling.py)."""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from runtime.draft_tree import DraftTree
from runtime.sampling import SamplingConfig, target_probs
from runtime.tree_sampling import path_rows, tree_rejection_device


@dataclass(frozen=True)
class Acceptance:
    """What one verified block commits."""
    accepted: int                        # a: accepted drafts
    tokens: list[int]                    # [d1..da, bonus]
    rows: Sequence[int] = ()             # the block rows committed: the anchor's (0), then the
                                         # accepted drafts' (1..a in a chain, a path in a tree)


def chain_acceptance(drafts: Sequence[int], accepted: int, bonus: int) -> Acceptance:
    """A chain whose first `accepted` drafts stand, then `bonus`."""
    return Acceptance(accepted, [*drafts[:accepted], bonus], range(accepted + 1))


def tree_acceptance(tree: DraftTree, argmax: list[int]) -> Acceptance:
    """argmax: the target's greedy token at each block row (anchor, then the tree's nodes)."""
    path, bonus = tree.greedy_path(argmax)
    return Acceptance(len(path), [tree.tokens[i - 1] for i in path] + [bonus], [0, *path])


def greedy_accept_batch(drafts: torch.Tensor, argmax: torch.Tensor) -> torch.Tensor:
    """Greedy acceptance of S sequences at once, on their device (no host sync).
    drafts int64 [S, W], padded with -1 past each sequence's drafts; argmax int64 [S, W+1] =
    target argmax at block positions 0..W (rows past a sequence's block repeat any value).
    Returns int64 [S, 2]: (a, bonus) with a = leading drafts equal to the argmax, bonus =
    argmax at position a."""
    match = (drafts == argmax[:, :-1]).to(torch.int32)
    accepted = match.cumprod(dim=1).sum(dim=1) if drafts.shape[1] else \
        torch.zeros(drafts.shape[0], dtype=torch.int64, device=drafts.device)
    bonus = argmax.gather(1, accepted.long()[:, None])[:, 0]
    return torch.stack([accepted.long(), bonus], dim=1)


def sampled_tree_acceptance(tree: DraftTree, path: list[int], bonus: int) -> Acceptance:
    """path: the accepted draft nodes, anchor down (runtime/tree_sampling.py)."""
    return Acceptance(len(path), [tree.tokens[i - 1] for i in path] + [bonus], [0, *path])


def rejection_accept_device(drafts: torch.Tensor, probs: torch.Tensor,
                            generator: torch.Generator | None) -> torch.Tensor:
    """One sequence's rejection sampling on its device, without a host sync.
    drafts int64 [B-1] on probs.device; probs [B, V] target probabilities at block positions
    0..B-1. Returns int64 [2]: (a, bonus). Draws: B-1 uniforms, then one multinomial."""
    n = drafts.shape[0]
    if n == 0:
        bonus = torch.multinomial(probs[0], 1, generator=generator)[0]
        return torch.stack([torch.zeros_like(bonus), bonus])
    p_draft = probs[:n].gather(1, drafts[:, None])[:, 0]
    u = torch.rand(n, generator=generator, device=probs.device)
    rejected = u >= p_draft
    a = torch.where(rejected.any(), rejected.to(torch.int32).argmax().long(), n)  # first True
    row = probs.index_select(0, a.view(1))[0]                   # [V]
    # residual: p with the rejected draft removed, renormalised (when a draft was rejected)
    token = drafts[a.clamp(max=n - 1)].view(1)
    kept = row.gather(0, token)
    residual = row.scatter(0, token, torch.where(a < n, torch.zeros_like(kept), kept))
    total = residual.sum()
    row = torch.where(total > 0, residual / total.clamp_min(1e-30), row)
    bonus = torch.multinomial(row, 1, generator=generator)[0]
    return torch.stack([a, bonus])


def rejection_accept(drafts: list[int], probs: torch.Tensor, generator: torch.Generator
                     ) -> Acceptance:
    """drafts [B-1]; probs [B, V] target probabilities at block positions 0..B-1."""
    d = torch.tensor(drafts, dtype=torch.int64, device=probs.device)
    a, bonus = rejection_accept_device(d, probs, generator).tolist()
    return chain_acceptance(drafts, a, bonus)


# -- one batch, decided on the device -------------------------------------------------------------
def sanitized(probs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """probs [N, V] of one sequence -> (probs a multinomial can draw from, ok: a 0-d bool on the
    device, False when they were not finite or summed to 0 - then the draw is meaningless and
    the sequence fails alone, instead of the whole batch's sampling raising)."""
    ok = torch.isfinite(probs).all() & (probs.sum(dim=-1) > 0).all()
    return torch.where(ok, probs, torch.ones_like(probs)), ok


@dataclass(frozen=True)
class Decided:
    """What the device decided for one work of a batch, on the host."""
    argmax: list[int] = field(default_factory=list)   # greedy token at each of its logits rows
    accepted: int | None = None          # a chain verify: accepted drafts ...
    token: int | None = None             # ... and its bonus; a finished prefill: its next token
    path: list[int] = field(default_factory=list)   # a sampled tree: the accepted nodes
    failed: str = ""                     # why its rows could not be decided ("" = they were)


@dataclass(frozen=True)
class _Ask:
    """Where a work's answer lies in the read-back: its argmax rows [row, row + rows), and a
    pair (a, bonus) or one token at `at` of the greedy or sampled part (-1: none)."""
    row: int
    rows: int
    part: str = ""                       # "greedy" | "sampled" | "token" (the argmax row is
                                         # the token) | "" (argmax rows only)
    at: int = -1
    width: int = 0                       # values at `at`: 2 (a, bonus), 1 (a token), or
                                         # 2 + n (a sampled tree: a, bonus, n path flags); a
                                         # sampled part also has its ok flag after them


class BatchDecisions:
    """Collects the decisions one forward's logits [R, V] need - chain acceptance (greedy, batched;
    or rejection sampling per sequence), tree argmax rows, a prefill's next token - then reads
    them back in one device -> host transfer: [argmax of every row | whether each row is usable |
    (a, bonus) per greedy chain | the sampled parts, each with its ok flag]. Call one ask method
    per work, in order, then `read()`. A work with an unusable logits row (a NaN or +inf, or
    every value -inf), or whose sampling probabilities are not finite (Decided.failed), fails
    alone: the others are decided as usual."""

    def __init__(self, logits: torch.Tensor | None) -> None:
        self.logits = logits
        self.asks: list[_Ask] = []
        self.greedy: list[tuple[Sequence[int], int, int]] = []   # (drafts, first row, rows)
        self.sampled: list[torch.Tensor] = []
        self.sampled_size = 0

    def chain(self, row: int, drafts: Sequence[int], sampling: SamplingConfig,
              generator: torch.Generator | None) -> None:
        """A chain verify whose block rows are logits rows [row, row + len(drafts) + 1)."""
        n = len(drafts) + 1
        if sampling.greedy:
            self.asks.append(_Ask(row, n, "greedy", 2 * len(self.greedy), 2))
            self.greedy.append((drafts, row, n))
            return
        device = self.logits.device
        d = torch.tensor(list(drafts), dtype=torch.int64).to(device, non_blocking=True)
        probs, ok = sanitized(target_probs(self.logits[row: row + n], sampling))
        self._sample(_Ask(row, n), rejection_accept_device(d, probs, generator), ok)

    def tree(self, row: int, tree: DraftTree, sampling: SamplingConfig,
             generator: torch.Generator | None) -> None:
        """A tree verify whose block rows are logits rows [row, row + n + 1): greedy, its argmax
        rows alone (the path is walked on the host); sampled, the path decided on the device."""
        rows = len(tree.tokens) + 1
        if sampling.greedy:
            self.asks.append(_Ask(row, rows))
            return
        probs, ok = sanitized(target_probs(self.logits[row: row + rows], sampling))
        self._sample(_Ask(row, rows), tree_rejection_device(tree, probs, generator), ok)

    def next_token(self, row: int, sampling: SamplingConfig,
                   generator: torch.Generator | None) -> None:
        """A finished prefill: the token after the prompt, from logits row `row`."""
        if sampling.greedy:
            self.asks.append(_Ask(row, 1, "token"))
            return
        probs, ok = sanitized(target_probs(self.logits[row: row + 1], sampling))
        self._sample(_Ask(row, 1), torch.multinomial(probs[0], 1, generator=generator), ok)

    def nothing(self) -> None:
        """A prefill chunk that is not the prompt's last: no logits rows."""
        self.asks.append(_Ask(0, 0))

    def _sample(self, ask: _Ask, values: torch.Tensor, ok: torch.Tensor) -> None:
        self.asks.append(_Ask(ask.row, ask.rows, "sampled", self.sampled_size, values.numel()))
        self.sampled.append(torch.cat([values.view(-1), ok.view(1).to(values.dtype)]))
        self.sampled_size += values.numel() + 1

    def read(self) -> list[Decided]:
        """One decision per ask, in order (one host sync)."""
        if self.logits is None:
            return [Decided() for _ in self.asks]
        # one reduction for both: the greedy token (the first maximum, as argmax) and the row's
        # top value - NaN when the row has one, -inf when every token is masked
        top, argmax = self.logits.max(dim=-1)                          # [R], [R]
        finite = ((top > float("-inf")) & (top < float("inf"))).to(argmax.dtype)
        greedy = (_greedy_rows(self.greedy, argmax).flatten() if self.greedy
                  else argmax.new_empty(0))
        flat = torch.cat([argmax, finite, greedy, *self.sampled]).tolist()
        r = argmax.numel()
        starts = {"finite": r, "greedy": 2 * r, "sampled": 2 * r + greedy.numel()}
        return [_decided(ask, flat, starts) for ask in self.asks]


def _decided(ask: _Ask, flat: list[int], starts: dict[str, int]) -> Decided:
    argmax = flat[ask.row: ask.row + ask.rows]
    finite = flat[starts["finite"] + ask.row: starts["finite"] + ask.row + ask.rows]
    if not all(finite):
        return Decided(argmax, failed=f"the target's logits at {finite.count(0)} of this "
                                      f"sequence's {ask.rows} rows are not usable (NaN, +inf, "
                                      f"or every token masked)")
    if ask.part in ("", "token"):
        return Decided(argmax, None, argmax[0] if ask.part == "token" else None)
    at = starts[ask.part] + ask.at
    values = flat[at: at + ask.width]
    if ask.part == "sampled" and not flat[at + ask.width]:
        return Decided(argmax, failed="its sampling probabilities (after temperature, top-k and "
                                      "top-p) are not finite or sum to 0")
    if ask.width == 1:
        return Decided(argmax, None, values[0])
    return Decided(argmax, values[0], values[1], path_rows(values[2:]))


def _greedy_rows(rows: list[tuple[Sequence[int], int, int]], argmax: torch.Tensor) -> torch.Tensor:
    """rows: (drafts, first logits row, block size) per greedy chain; argmax [R] on the device.
    Returns int64 [S, 2] (a, bonus) decided on the device (one host -> device copy)."""
    width = max(len(d) for d, _, _ in rows)
    drafts = torch.full((len(rows), width), -1, dtype=torch.int64)
    index = torch.empty((len(rows), width + 1), dtype=torch.int64)
    for i, (d, first, n) in enumerate(rows):
        drafts[i, : len(d)] = torch.tensor(list(d), dtype=torch.int64)
        index[i] = first + torch.arange(width + 1).clamp(max=n - 1)
    both = torch.cat([drafts, index], dim=1).to(argmax.device)
    return greedy_accept_batch(both[:, :width], argmax[both[:, width:]])
