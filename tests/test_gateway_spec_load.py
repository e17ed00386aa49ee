"""--spec-disable-batch-size: above that many running requests the gateway verifies one token per
step without drafting, and drafts again once load falls; the draft's features are kept meanwhile,
so the output stays the target's own (real target, draft with the shipped drafter, gateway)."""
from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from support.draft_service import start_draft
from support.gateway_stack import GreedyReference, chat_prompts, start_gateway
from support.procs import start_target

from gateway.config import GatewayConfig

SHIPPED = Path(__file__).resolve().parents[1] / "models" / "smollm2-135m-instruct-dflash"
N = 24


def test_negative_limit_is_refused():
    with pytest.raises(ValueError, match="--spec-disable-batch-size must be >= 0"):
        GatewayConfig(target="t:1", tokenizer_dir="x", spec_disable_batch_size=-1)


@pytest.mark.slow
def test_drafting_stops_above_the_limit_and_output_stays_exact(smollm2_dir, tmp_path):
    prompts = chat_prompts(smollm2_dir, ["List three benefits of regular exercise.",
                                         "Write a Python function that reverses a string.",
                                         "Explain why the sky is blue in two sentences."])
    target = start_target(smollm2_dir, tmp_path)
    draft = start_draft(smollm2_dir, tmp_path, model_dir=SHIPPED)
    # fixed speculation: the limit is a fixed-size flag (auto decides each step by cost, and
    # may verify the anchor alone below it)
    gw = start_gateway(target.address, smollm2_dir, tmp_path, "--spec-disable-batch-size", "1",
                       "--speculation", "fixed", draft=draft.address)
    try:
        reference = GreedyReference(smollm2_dir)

        def run(ids):
            out, _, responses = gw.generate(ids, N)
            return out, responses[-1].usage

        alone_out, alone = run(prompts[0])              # one running request: it drafts
        with ThreadPoolExecutor(len(prompts)) as pool:  # three at once: above the limit
            together = list(pool.map(run, prompts))
        again_out, again = run(prompts[1])              # alone again: drafting resumes
    finally:
        for p in (gw, draft, target):
            p.stop()
    assert alone.draft_steps == alone.verify_steps > 0 and alone.accepted_tokens > 0
    assert again.draft_steps == again.verify_steps > 0
    steps = sum(u.verify_steps for _, u in together)
    drafted = sum(u.draft_steps for _, u in together)
    assert steps >= 30 and drafted <= 3, (steps, drafted)
    for ids, (out, _) in zip(prompts, together):
        assert out == reference(ids, N)
    assert alone_out == reference(prompts[0], N) and again_out == reference(prompts[1], N)
