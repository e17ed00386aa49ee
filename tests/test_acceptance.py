"""Acceptance as pure functions: the batched greedy acceptance decided on the device equals the
rule written out sequentially."""
from __future__ import annotations

import random

import torch

from runtime.acceptance import greedy_accept_batch


def sequential_greedy(drafts: list[int], argmax: list[int]) -> tuple[int, int]:
    """The rule written out: accept while the draft equals the target's argmax; the bonus is the
    argmax at the first mismatch (or after the last draft)."""
    a = 0
    while a < len(drafts) and drafts[a] == argmax[a]:
        a += 1
    return a, argmax[a]


def test_greedy_acceptance_batch_matches_the_sequential_rule():
    rng = random.Random(3)
    drafts, argmax, expect = [], [], []
    for _ in range(40):
        n = rng.randrange(0, 8)
        am = [rng.randrange(3) for _ in range(n + 1)]
        d = [rng.randrange(3) for _ in range(n)]
        drafts.append(d)
        argmax.append(am)
        expect.append(sequential_greedy(d, am))
    width = max(len(d) for d in drafts)
    dt = torch.full((len(drafts), width), -1, dtype=torch.int64)
    at = torch.zeros((len(drafts), width + 1), dtype=torch.int64)
    for i, (d, am) in enumerate(zip(drafts, argmax)):
        dt[i, : len(d)] = torch.tensor(d, dtype=torch.int64)
        at[i, : len(am)] = torch.tensor(am)
        at[i, len(am):] = am[-1]
    assert greedy_accept_batch(dt, at).tolist() == [list(e) for e in expect]
    assert any(a > 0 for a, _ in expect) and any(a < len(d) for (a, _), d in zip(expect, drafts))


def test_a_sequence_whose_maths_fails_fails_alone():
    """Issue 39, hole 1: one batch's decisions where one sequence's sampling probabilities are
    NaN (finite logits of 1e35 at temperature 2e-5 overflow) and another's logits row is NaN:
    both fail with the reason; the greedy chain beside them is decided as when alone, and the
    read-back raises nothing."""
    from runtime.acceptance import BatchDecisions
    from runtime.sampling import SamplingConfig
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(5, 32, generator=gen)
    logits[3] = 1e35 * torch.linspace(-1, 1, 32)
    logits[4, 7] = float("nan")
    drafts = [int(logits[0].argmax()), 5]

    def decide(with_bad: bool):
        d = BatchDecisions(logits.clone())
        d.chain(0, drafts, SamplingConfig(), None)
        if with_bad:
            d.next_token(3, SamplingConfig(temperature=2e-5), torch.Generator().manual_seed(1))
            d.next_token(4, SamplingConfig(), None)
        return d.read()
    alone, (good, sampled, nan_row) = decide(False)[0], decide(True)
    assert good == alone and not good.failed and good.accepted >= 1
    assert "sampling probabilities" in sampled.failed and sampled.token is None
    assert "not usable" in nan_row.failed and nan_row.token is None
