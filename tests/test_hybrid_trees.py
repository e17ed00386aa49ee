"""Trees of drafts for hybrid targets (Mamba2 + attention, Gated DeltaNet + attention) through
the three services: a prompt-lookup draft with --lookup-tree-nodes proposes tries of several
earlier continuations; the target verifies each tree with every row's recurrent state
continuing its parent's, and commits the state of the accepted path's last node. Greedy output
equals transformers' generate, with steps that accepted a path through a sibling of the chain
(counted by recomputing the drafter's trees: those commits are where the path's last row differs
from the accepted count); with the commit skipped it differs."""
from __future__ import annotations

import pytest
from support.draft_service import start_draft
from support.gateway_stack import start_gateway
from support.hybrid import hf_greedy, hf_model, make_tiny_hybrid
from support.procs import start_target

from dflash.harness import NO_HOOK_FLAGS, HookFlags
from runtime.tokenizer import ChatTokenizer
from services.draft.prompt_lookup import propose_ngram, propose_ngram_tree

pytestmark = pytest.mark.slow

N = 64
BLOCK = 8                    # tree depth 7
NODES = 7
TEXT = "The cat sat on the mat. The dog sat on the log. The cat ran to the dog. The dog ran to the cat. " * 2
TARGET_FLAGS = ("--max-block-size", str(BLOCK), "--kv-budget", "64MiB", "--state-slots", "8")


@pytest.fixture(scope="module", params=["bamba", "granitemoehybrid", "qwen3_5", "qwen3_next",
                                                "nemotron_h", "falcon_h1"])
def model_dir(tmp_path_factory, smollm2_dir, request):
    return make_tiny_hybrid(tmp_path_factory.mktemp(f"tree_{request.param}"),
                            vocab_from=smollm2_dir, active_vocab=(1000, 1016),
                            family=request.param)


@pytest.fixture(scope="module")
def logs(tmp_path_factory):
    return tmp_path_factory.mktemp("logs")


@pytest.fixture(scope="module")
def prompt(model_dir) -> list[int]:
    return ChatTokenizer(model_dir).encode(TEXT)


@pytest.fixture(scope="module")
def draft(model_dir, logs):
    proc = start_draft(model_dir, logs, "--drafter", "prompt-lookup", "--block-size", str(BLOCK),
                       "--lookup-tree-nodes", str(NODES))
    yield proc
    assert proc.stop() == 0


def run(model_dir, logs, draft, prompt, hooks: HookFlags = NO_HOOK_FLAGS
        ) -> tuple[list[int], list]:
    target = start_target(model_dir, logs, *TARGET_FLAGS, hooks=hooks)
    gateway = start_gateway(target.address, model_dir, logs, "--speculation", "fixed",
                            "--spec-tree-nodes", str(NODES), draft=draft.address)
    try:
        tokens, _, events = gateway.generate(prompt, N, ignore_eos=True)
    finally:
        assert gateway.stop() == 0 and target.stop() == 0
    return tokens, events


def sibling_accepts(prompt: list[int], tokens: list[int], events) -> int:
    """Steps whose accepted path left the chain (the trie's first path) for a sibling: the
    drafter's trees recomputed from the committed tokens, their totals checked against usage."""
    produced, drafted, siblings = 1, 0, 0
    for e in events[1:]:
        context = prompt + tokens[:produced]
        depth = min(BLOCK, N - produced) - 1          # the gateway's block for the step
        tree = propose_ngram_tree(context, NODES, depth, 4) if depth else None
        chain = propose_ngram(context, depth, 4)
        path = tokens[produced: produced + e.accepted]
        on_chain = next((i for i, (a, b) in enumerate(zip(path, chain)) if a != b),
                        min(len(path), len(chain)))
        drafted += len(tree.tokens) if tree else 0
        siblings += e.accepted > on_chain
        produced += e.accepted + 1
    assert drafted == events[-1].usage.draft_tokens
    return siblings


def test_tree_speculation_equals_transformers_with_sibling_paths_accepted(
        model_dir, logs, draft, prompt):
    reference = hf_greedy(hf_model(model_dir), prompt, N)
    tokens, events = run(model_dir, logs, draft, prompt)
    assert tokens == reference
    siblings = sibling_accepts(prompt, tokens, events)
    print(f"tree speculation: {events[-1].usage.accepted_tokens} accepted, {siblings} steps "
          f"through a sibling path")
    assert siblings >= 1


def test_tree_speculation_with_the_commit_skipped_differs(model_dir, logs, draft, prompt):
    reference = hf_greedy(hf_model(model_dir), prompt, N)
    tokens, events = run(model_dir, logs, draft, prompt, HookFlags(skip_mamba_commit=True))
    assert events[-1].usage.accepted_tokens > 0 and tokens != reference
