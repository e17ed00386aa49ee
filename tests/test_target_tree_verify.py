"""Verify of a tree of drafts: the target commits the longest path of its own greedy choices
wherever that path sits in the tree (node order, siblings, decoy branches), its KV afterwards is
the KV of one-token steps, its features are the path's rows, and bad trees are refused with
INVALID_ARGUMENT while the sequence goes on serving. A tiny random Llama (fp32), as in
test_target_verify.py: the real server for the wire, the engine in-process for the KV."""
from __future__ import annotations

import random

import grpc
import pytest
import torch
from support.inproc_target import (
    assert_same_continuation,
    greedy_then_prefill,
    loaded_worker,
    run,
    started_engine,
)
from support.procs import start_target
from support.target_client import TargetClient, expect_status
from support.tiny_models import TINY_PROMPT as PROMPT
from support.tiny_models import TINY_VOCAB as VOCAB
from support.tiny_models import wrong

from dflash.v1 import common_pb2
from runtime.draft_tree import DraftTree
from services.common.tensor_codec import decode

TOKEN_BUDGET = 64                     # -> max_tree_nodes 63 (the configured 255 is clamped)


@pytest.fixture(scope="module")
def client(tiny_llama_02_dir, tmp_path_factory):
    proc = start_target(tiny_llama_02_dir, tmp_path_factory.mktemp("logs"), "--page-size", "4",
                        "--token-budget", str(TOKEN_BUDGET), "--max-block-size", "16",
                        "--kv-budget", "8MiB")
    c = TargetClient(proc.address)
    yield c
    c.close()
    assert proc.stop() == 0


@pytest.fixture(scope="module")
def greedy_ref(client) -> list[int]:
    """The model's own greedy continuation of PROMPT, one token per Verify."""
    return client.greedy("greedy-ref", PROMPT, 24)


def random_tree(rng: random.Random, truth: list[int], path_len: int, decoys: int
                ) -> DraftTree:
    """A tree whose only greedy path is truth[1..path_len] (truth[0] is the anchor; truth[d]
    the target's choice at depth d, up to path_len + 1), mixed in random order with `decoys` nodes hung under random
    earlier nodes - never the right token where the path could take it."""
    tokens: list[int] = []
    parents: list[int] = []
    on_path = {0: 0}                                   # node index -> depth, for path nodes
    placed_path = 0
    while placed_path < path_len or decoys > 0:
        if placed_path < path_len and (decoys == 0 or rng.random() < 0.4):
            parent = max(on_path, key=on_path.get)     # the deepest path node so far
            tokens.append(truth[placed_path + 1])
            placed_path += 1
            on_path[len(tokens)] = placed_path
        else:
            parent = rng.randrange(len(tokens) + 1)
            token = rng.randrange(3, VOCAB)
            if parent in on_path and token == truth[on_path[parent] + 1]:
                token = (token + 1) % VOCAB
            tokens.append(token)
            decoys -= 1
        parents.append(parent)
    return DraftTree(tokens, parents)


def test_capabilities_report_tree_nodes(client):
    assert client.capabilities().max_tree_nodes == TOKEN_BUDGET - 1


def test_tree_commits_the_greedy_path_wherever_it_sits(client, greedy_ref):
    rng = random.Random(0)
    out = [client.prefill("tree", PROMPT).next_token]
    steps = 0
    while len(out) < 20:
        k = rng.randint(0, min(6, 19 - len(out)))
        truth = greedy_ref[len(out) - 1: len(out) + k + 1]      # anchor, path, its bonus
        tree = random_tree(rng, truth, k, rng.randint(0, 10))
        if not tree.tokens:
            tree = DraftTree([wrong(truth[1])], [0])            # one wrong draft
        v = client.verify("tree", [out[-1]] + tree.tokens, tree.parents)
        assert v.accepted == k
        assert list(v.committed_tokens) == greedy_ref[len(out): len(out) + k + 1]
        out += v.committed_tokens
        steps += 1
    assert out == greedy_ref[: len(out)]
    assert steps < len(out) - 1           # some steps committed several tokens
    client.release("tree")


def test_tree_features_are_the_path_rows(client, greedy_ref):
    """The features of a tree Verify are those of a chain Verify of the accepted path."""
    layers = (0, 1)
    rows = {}
    for seq in ("chain-f", "tree-f"):
        client.prefill(seq, PROMPT, capture_layers=layers, feature_dtype="float32")
    chain = client.verify("chain-f", greedy_ref[:4])
    tree = DraftTree([wrong(greedy_ref[1]), greedy_ref[1], 5, greedy_ref[2], greedy_ref[3]],
                     [0, 0, 1, 2, 4])
    v = client.verify("tree-f", [greedy_ref[0]] + tree.tokens, tree.parents)
    assert (v.accepted, list(v.committed_tokens)) == (3, list(chain.committed_tokens))
    rows["chain"], rows["tree"] = decode(chain.features), decode(v.features)
    assert rows["tree"].shape == rows["chain"].shape == (4, rows["chain"].shape[1])
    assert torch.allclose(rows["tree"], rows["chain"], atol=1e-5)
    for seq in ("chain-f", "tree-f"):
        client.release(seq)


def test_bad_trees_are_refused_and_the_sequence_goes_on(client, greedy_ref):
    client.prefill("bad", PROMPT)
    anchor = greedy_ref[0]
    invalid = grpc.StatusCode.INVALID_ARGUMENT
    expect_status(lambda: client.verify("bad", [anchor, 5, 6], [0]), invalid,
                  "parents has 1 entries for 2 draft tokens")
    expect_status(lambda: client.verify("bad", [anchor, 5, 6], [0, 2]), invalid,
                  "parents[1] = 2", "at most 1")
    expect_status(lambda: client.verify("bad", [anchor] + [5] * 16, list(range(16))), invalid,
                  "16 drafts deep", "up to 15")
    expect_status(lambda: client.verify("bad", [anchor] + [5] * 64, [0] * 64), invalid,
                  "64 draft nodes", "1..63")
    v = client.verify("bad", [anchor, greedy_ref[1], 9], [0, 0])    # still serving, unchanged
    assert list(v.committed_tokens) == greedy_ref[1:3]
    client.release("bad")
    sampled = common_pb2.SamplingParams(temperature=0.8, seed=3)
    client.prefill("sampled", PROMPT, sampling=sampled)
    expect_status(lambda: client.verify("sampled", [anchor, 5, 6], [0, 0, 1]), invalid,
                  "parents has 3 entries for 2 draft tokens")
    v = client.verify("sampled", [anchor, 5, 6], [0, 0])     # a sampled tree: one node at most
    assert v.accepted <= 1 and len(v.committed_tokens) == v.accepted + 1
    assert v.accepted == 0 or v.committed_tokens[0] in (5, 6)
    client.release("sampled")


def test_kv_after_a_tree_equals_one_by_one(tiny_llama_02_dir):
    """The accepted path's K/V are moved into the committed positions: the sequence continues
    exactly as one verified token by token."""
    worker = loaded_worker(tiny_llama_02_dir, page_size=4)
    engine = started_engine(worker)
    try:
        g = greedy_then_prefill(engine, PROMPT, 7, ("tree", "steps"))
        # the path g1, g2, g3 sits at rows 2, 4, 6, after decoys at rows 1, 3, 5 and 7
        tree = DraftTree([wrong(g[1]), g[1], wrong(g[2]), g[2], 9, g[3], wrong(g[4])],
                         [0, 0, 2, 2, 4, 4, 6])
        v = run(engine.verify("tree", [g[0]] + tree.tokens, tree))
        assert (v.accepted, v.committed) == (3, g[1:5])
        for k in range(4):
            assert run(engine.verify("steps", [g[k]])).committed == [g[k + 1]]
        assert_same_continuation(worker, engine.seqs["tree"], engine.seqs["steps"],
                                 len(PROMPT) + 4, g[4], g[5])
    finally:
        engine.stop()


def test_min_tokens_counts_a_nodes_depth_not_its_row(client, greedy_ref):
    """Node rows are not output positions in a tree: a node at depth d predicts output
    num_generated + d. Here g1 sits at row 2 but depth 1, so the stop token g2 it predicts is
    output 2 - forbidden under min_tokens 3, allowed under 2."""
    g = greedy_ref
    assert len({g[0], g[1], g[2]}) == 3
    tree = DraftTree([wrong(g[1]), g[1], g[2]], [0, 0, 2])
    for min_tokens, accepted in ((3, 1), (2, 2)):
        sampling = common_pb2.SamplingParams(min_tokens=min_tokens, stop_token_ids=[g[2]])
        client.prefill("mt-tree", PROMPT, sampling)
        v = client.verify("mt-tree", [g[0]] + tree.tokens, tree.parents)
        assert v.accepted == accepted, min_tokens
        assert list(v.committed_tokens[:accepted]) == g[1: 1 + accepted]
        assert (g[2] in v.committed_tokens) == (min_tokens == 2)
    client.release("mt-tree")
