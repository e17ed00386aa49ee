"""The DFlash drafter shipped in models/ for SmolLM2-135M-Instruct: it loads, matches its
config and the target it was trained for, and through the full stack (target, draft, gateway
processes) it is accepted well above chance while the output stays the target's own."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from support.draft_service import start_draft
from support.gateway_stack import GreedyReference, start_gateway
from support.procs import start_target

from dflash.v1 import gateway_pb2
from runtime.models.dflash import DFlashConfig, TargetFingerprint, load_dflash
from runtime.tokenizer import ChatTokenizer

SHIPPED = Path(__file__).resolve().parents[1] / "models" / "smollm2-135m-instruct-dflash"
PROMPTS = ["Explain why the sky is blue in two sentences.",
           "List three benefits of regular exercise.",
           "Write a Python function that reverses a string.",
           "What is the capital of Japan? Answer in one sentence.",
           "Give me a short tip for learning a new language."]
N = 48
# Measured on CPU through the stack at block 16: tau 2.29 with the twelfth drafter, 2.41 with
# the ninth, 2.37 with the sixth (2.23 with the fifth, 2.31 with the fourth, 2.11 with the
# third: five short answers are too few to rank them; over the 540 held-out prompts the twelfth
# is ahead, 2.46 / 2.22 against 2.44 / 2.19; greedy fp32, so the same on every run of this
# machine type). The
# floor sits under it, well above what a random drafter reaches (~1.0) and above the first
# shipped drafter (1.59), so losing the trained weights or falling back to the first ones fails.
TAU_FLOOR = 2.0
# A tree of 63 drafts (greedy, block 16): measured 3.59 on these prompts; over the held-out
# prompts 3.5 / 3.2 where the chain reaches 2.4 / 2.2 (docs/drafter-research.md, 18th finding).
# The floor sits above anything the chain reaches here, so a tree that silently fell back to a
# chain fails.
TREE_TAU_FLOOR = 2.8


def test_shipped_drafter_matches_its_config_and_target(smollm2_dir):
    cfg = DFlashConfig.from_dir(SHIPPED)
    assert cfg.block_size == 16 and 1 <= cfg.num_layers <= 3
    assert cfg.mask_token_id == 16                       # a token of SmolLM2's vocabulary
    assert cfg.target_fingerprint == TargetFingerprint.of_target(smollm2_dir)
    assert (SHIPPED / "model.safetensors").stat().st_size <= 30 * 1024 * 1024
    model = load_dflash(SHIPPED, torch.float32)
    assert model.fc.weight.shape == (576, len(cfg.target_layer_ids) * 576)
    assert "tau" in (SHIPPED / "README.md").read_text()
    assert json.loads((SHIPPED / "training.json").read_text())["command"].startswith(
        "dflash train-draft")


@pytest.mark.slow
@pytest.mark.parametrize("tree_nodes, floor", [(0, TAU_FLOOR), (63, TREE_TAU_FLOOR)])
def test_shipped_drafter_is_accepted_and_exact_through_the_stack(smollm2_dir, tmp_path,
                                                                 tree_nodes, floor):
    """tree_nodes 0: the chain of block 16; 63: each greedy step verifies a tree of 63 drafts."""
    tok = ChatTokenizer(smollm2_dir)
    prompts = [tok.encode(tok.apply_chat_template([{"role": "user", "content": p}]))
               for p in PROMPTS]
    target = start_target(smollm2_dir, tmp_path)
    draft = start_draft(smollm2_dir, tmp_path, model_dir=SHIPPED)
    # fixed sizes: the drafter's acceptance at its trained block (16) or a tree of 63 - under
    # --speculation auto the chain length follows measured costs, and chains of 2 cap tau at 2
    gw = start_gateway(target.address, smollm2_dir, tmp_path, "--speculation", "fixed",
                       "--spec-tree-nodes", str(tree_nodes), draft=draft.address)
    try:
        reference = GreedyReference(smollm2_dir)
        steps = accepted = 0
        for ids in prompts:
            out, _, responses = gw.generate(ids, N)
            assert out == reference(ids, N)[: len(out)] and len(out) > 0
            usage = responses[-1].usage
            steps += usage.draft_steps
            accepted += usage.accepted_tokens
        info = gw.stub.GetModelInfo(gateway_pb2.GetModelInfoRequest())
        assert info.drafter_kind == "dflash" and info.speculative
    finally:
        for p in (gw, draft, target):
            p.stop()
    tau = 1 + accepted / max(1, steps)
    print(f"shipped drafter through the stack, tree nodes {tree_nodes}: {steps} drafting steps, "
          f"{accepted} accepted, tau {tau:.2f}")
    assert tau >= floor
