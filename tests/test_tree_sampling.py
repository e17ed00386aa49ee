"""Exact sampling over draft trees (runtime/tree_sampling.py), as a statistical test: what one
verified tree commits (its accepted path, then the bonus) must follow the target's own
autoregressive distribution - the exact law is enumerated and compared by a chi-squared test at
significance 1e-3 - and the naive rule (each child tried against the unchanged p) must fail the
same test. docs/tree-sampling.md has the argument."""
from __future__ import annotations

import random
from collections import Counter

import pytest
import torch
from support.inproc_target import in_one_batch, loaded_worker, run, started_engine
from support.tiny_models import TINY_PROMPT

from runtime.draft_tree import DraftTree
from runtime.sampling import SamplingConfig, target_probs
from runtime.tree_sampling import TreeLayout, path_rows, tree_rejection_device
from services.target.calls import PrefillCall

ALPHA = 1e-3
SAMPLES = 12_000
V = 6

# Trees over a 6-token vocabulary: (drafts, parents). Node i's token is drafts[i-1].
TREES = {
    "two-level": ([0, 1, 2, 3, 1, 0], [0, 0, 0, 1, 1, 2]),
    "deep-chain-with-siblings": ([1, 2, 0, 4, 5], [0, 1, 2, 0, 4]),
    "wide": ([0, 1, 2, 3, 4], [0, 0, 0, 0, 0]),
    "repeated-sibling": ([2, 2, 3], [0, 0, 1]),          # node 2 repeats node 1: never taken
}


def _probs(tree: DraftTree, seed: int) -> torch.Tensor:
    """[n+1, V] random distributions that favour each node's drafted children (as a drafter
    that is often but not always right would make them)."""
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(len(tree.tokens) + 1, V, generator=g)
    for i, p in enumerate(tree.parents, start=1):
        logits[p, tree.tokens[i - 1]] += 1.5
    return torch.softmax(logits, dim=-1)


def _exact(tree: DraftTree, probs: torch.Tensor) -> dict[tuple[int, ...], float]:
    """The target's own law of a step's output: sample x ~ p(node); if x is one of the node's
    children (its first node with that token) continue from it, else stop after x."""
    children: dict[int, dict[int, int]] = {}
    for i, p in enumerate(tree.parents, start=1):
        children.setdefault(p, {}).setdefault(tree.tokens[i - 1], i)
    law: dict[tuple[int, ...], float] = {}

    def walk(node: int, prefix: tuple[int, ...], weight: float) -> None:
        for x in torch.nonzero(probs[node]).flatten().tolist():
            w = weight * float(probs[node, x])
            child = children.get(node, {}).get(x)
            if child is None:
                law[prefix + (x,)] = law.get(prefix + (x,), 0.0) + w
            else:
                walk(child, prefix + (x,), w)

    walk(0, (), 1.0)
    return law


def _exact_rule(tree: DraftTree, probs: torch.Tensor, n: int, seed: int) -> Counter:
    g = torch.Generator().manual_seed(seed)
    out: Counter = Counter()
    for _ in range(n):
        values = tree_rejection_device(tree, probs, g).tolist()
        path = path_rows(values[2:])
        assert len(path) == values[0]
        out[tuple(tree.tokens[i - 1] for i in path) + (values[1],)] += 1
    return out


def _naive_rule(tree: DraftTree, probs: torch.Tensor, n: int, seed: int) -> Counter:
    """Each child accepted with probability p(child) of the unchanged p (no residual), the bonus
    from p without the children: the rule that skews the output."""
    rng = random.Random(seed)
    kids: dict[int, list[int]] = {}
    for i, p in enumerate(tree.parents, start=1):
        kids.setdefault(p, []).append(i)
    p = probs.tolist()
    out: Counter = Counter()
    for _ in range(n):
        node, emitted = 0, []
        while True:
            nxt = next((c for c in kids.get(node, []) if rng.random() < p[node][tree.tokens[c - 1]]),
                       None)
            if nxt is None:
                banned = {tree.tokens[c - 1] for c in kids.get(node, [])}
                weights = [0.0 if x in banned else p[node][x] for x in range(V)]
                emitted.append(rng.choices(range(V), weights)[0])
                break
            emitted.append(tree.tokens[nxt - 1])
            node = nxt
        out[tuple(emitted)] += 1
    return out


def _chi2_pvalue(counts: Counter, law: dict[tuple[int, ...], float]) -> float:
    """Pearson's test of counts against law; cells expected below 5 are pooled."""
    n = sum(counts.values())
    assert set(counts) <= set(law), f"impossible outcomes {set(counts) - set(law)}"
    stat, pooled_obs, pooled_exp, cells = 0.0, 0, 0.0, 0
    for outcome, p in law.items():
        e, o = n * p, counts.get(outcome, 0)
        if e < 5:
            pooled_obs, pooled_exp = pooled_obs + o, pooled_exp + e
            continue
        stat, cells = stat + (o - e) ** 2 / e, cells + 1
    if pooled_exp > 0:
        stat, cells = stat + (pooled_obs - pooled_exp) ** 2 / pooled_exp, cells + 1
    df = cells - 1
    return float(torch.special.gammaincc(torch.tensor(df / 2.0, dtype=torch.float64),
                                         torch.tensor(stat / 2.0, dtype=torch.float64)))


@pytest.mark.parametrize("name", sorted(TREES))
def test_the_committed_tokens_follow_the_targets_distribution(name):
    tree = DraftTree(*TREES[name])
    probs = _probs(tree, seed=len(name))
    law = _exact(tree, probs)
    assert abs(sum(law.values()) - 1) < 1e-5
    p = _chi2_pvalue(_exact_rule(tree, probs, SAMPLES, seed=1), law)
    assert p > ALPHA, f"{name}: chi-squared p = {p:.2e} against the target's law"


def test_the_naive_rule_fails_the_same_test():
    """The test has the power to see the skew the residual update removes."""
    for name in ("two-level", "wide", "deep-chain-with-siblings"):
        tree = DraftTree(*TREES[name])
        probs = _probs(tree, seed=len(name))
        p = _chi2_pvalue(_naive_rule(tree, probs, SAMPLES, seed=1), _exact(tree, probs))
        assert p < 1e-6, f"{name}: the naive rule passed (p = {p:.2e})"


def test_a_node_certain_of_its_child_always_takes_it_and_a_leaf_draws_its_bonus():
    tree = DraftTree([3, 4], [0, 1])
    probs = torch.full((3, V), 1e-9)
    probs[0, 3] = probs[1, 4] = probs[2, 5] = 1.0
    probs = probs / probs.sum(-1, keepdim=True)
    values = tree_rejection_device(tree, probs, torch.Generator().manual_seed(0)).tolist()
    assert values == [2, 5, 1, 1]


def test_the_layout_marks_siblings_repeats_ancestors_and_children():
    tree = DraftTree(*TREES["repeated-sibling"])          # nodes 1 (2), 2 (2), 3 (3, under 1)
    packed = TreeLayout(tree, V).packed
    n = 3
    assert packed[1:, :4].tolist() == [[0, 2, 1, 0], [0, 2, 1, 1], [1, 3, 2, 0]]
    assert packed[1:, 4: 4 + n].tolist() == [[0, 0, 0], [1, 0, 0], [0, 0, 0]]   # earlier siblings
    assert packed[1:, 4 + n: 4 + 2 * n].tolist() == [[1, 0, 0], [0, 1, 0], [1, 0, 1]]
    assert packed[:, 4 + 2 * n:].tolist() == [[2, 2], [3, V], [V, V], [V, V]]   # children tokens


# -- the same test through the real target engine -------------------------------------------------
ENGINE_SAMPLES = 2_400
ENGINE_BATCH = 200
SAMPLED = SamplingConfig(temperature=1.0, top_k=3)


def _node_probs(probs_of, tree: DraftTree, anchor: int) -> torch.Tensor:
    """[n+1, V]: the reference probabilities after the anchor and after each node's path."""
    paths = [[anchor]]
    for i, p in enumerate(tree.parents, start=1):
        paths.append(paths[p] + [tree.tokens[i - 1]])
    return torch.stack([probs_of(path) for path in paths])


def _tree_from(probs_of, anchor: int, size: int) -> DraftTree:
    """Root children: the top-3 tokens after the anchor (second-best first) and one token the
    target's top-k never allows; size 8: under each of the first two also its top-2."""
    root = probs_of([anchor]).topk(3).indices.tolist()
    impossible = probs_of([anchor]).argmin().item()
    tokens, parents = [root[1], root[0], impossible, root[2]], [0, 0, 0, 0]
    for node in (1, 2) if size == 8 else ():
        for t in probs_of([anchor, tokens[node - 1]]).topk(2).indices.tolist():
            tokens.append(t)
            parents.append(node)
    return DraftTree(tokens, parents)


DEVICES = [pytest.param({}, id="cpu"),
           pytest.param({"device": "cuda", "attention_backend": "triton"}, id="cuda",
                        marks=pytest.mark.skipif(not torch.cuda.is_available(),
                                                 reason="needs CUDA"))]


@pytest.mark.slow
@pytest.mark.parametrize("size", [4, 8])
@pytest.mark.parametrize("where", DEVICES)
def test_a_sampled_tree_through_the_engine_commits_the_targets_distribution(tiny_llama_02_dir,
                                                                             where, size):
    """Prefill + one tree Verify per sample (T = 1, top-k 3) through the real engine, batched:
    what it commits matches the law enumerated from transformers' probabilities (the
    reference, after the same temperature and top-k). On CUDA too (the draws on the device)."""
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(str(tiny_llama_02_dir)).eval()

    def probs_of(path: list[int]) -> torch.Tensor:
        with torch.no_grad():
            logits = model(torch.tensor([TINY_PROMPT + path])).logits[0, -1:]
        return target_probs(logits.float(), SAMPLED)[0]

    anchor = 42
    tree = _tree_from(probs_of, anchor, size)
    assert len(tree.tokens) == size
    law = _exact(tree, _node_probs(probs_of, tree, anchor))
    engine = started_engine(loaded_worker(tiny_llama_02_dir, kv_budget_bytes=16 << 20, **where))
    counts: Counter = Counter()
    try:
        for base in range(0, ENGINE_SAMPLES, ENGINE_BATCH):
            ids = [f"s{i}" for i in range(ENGINE_BATCH)]
            run(in_one_batch(engine, [engine.prefill(PrefillCall(
                seq, TINY_PROMPT, SamplingConfig(1.0, top_k=3, seed=base + i), (), torch.float32))
                for i, seq in enumerate(ids)]))
            verified = run(in_one_batch(engine, [engine.verify(seq, [anchor] + tree.tokens, tree)
                                                 for seq in ids]))
            counts.update(tuple(v.committed) for v in verified)
    finally:
        engine.stop()
    assert sum(n for k, n in counts.items() if len(k) > 1) > ENGINE_SAMPLES // 4   # paths taken
    p = _chi2_pvalue(counts, law)
    assert p > ALPHA, f"chi-squared p = {p:.2e}: {counts.most_common(6)} vs the law"
