"""`dflash eval-draft` end to end on the shipped drafter: the real target and draft engines in
one process, a few held-out prompts, both temperatures. Its JSON is what docs/benchmarks.md's
acceptance tables come from, so its fields and their invariants are checked here."""
from __future__ import annotations

import argparse
import asyncio
import json
import subprocess
import sys
from pathlib import Path

from train.evaluate import add_arguments, evaluate

REPO = Path(__file__).resolve().parents[1]


def test_eval_draft_reports_tau_per_category_and_exactness(smollm2_dir, tmp_path):
    out = tmp_path / "eval.json"
    cmd = [sys.executable, "-m", "dflash.cli", "eval-draft", "--target", str(smollm2_dir),
           "--splits", "eval_in", "eval_unseen", "--temperatures", "0", "0.7",
           "--per-split", "2", "--max-new-tokens", "24", "--out", str(out)]
    done = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=600,
                          check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["complete"] is True
    summary = result["summary"]
    assert [(r["split"], r["temperature"]) for r in summary] == [
        ("eval_in", 0.0), ("eval_in", 0.7), ("eval_unseen", 0.0), ("eval_unseen", 0.7)]
    for r in summary:
        positions = r["per_position"]
        assert len(positions) == 15 and all(0 <= p <= 1 for p in positions)
        assert positions == sorted(positions, reverse=True)   # k accepted implies k-1 accepted
        assert 1.0 <= r["tau"] <= 16.0 and r["per_category"]
        # greedy: the speculative output is the target's own; sampled: not checked token-wise
        assert r["identical_to_target"] is (True if r["temperature"] == 0.0 else None)
    # the trained drafter is accepted well above chance at T = 0 (measured ~2; random ~1.0)
    assert min(r["tau"] for r in summary if r["temperature"] == 0.0) >= 1.3, summary


def test_eval_draft_hands_over_each_finished_run(smollm2_dir):
    """A run cut short (a device call's time limit) keeps what it measured: after every
    (split, temperature) the result so far is handed over, marked incomplete."""
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args(["--target", str(smollm2_dir), "--splits", "eval_unseen",
                              "--temperatures", "0", "0.7", "--per-split", "1",
                              "--max-new-tokens", "8"])
    partials: list[dict] = []
    final = asyncio.run(evaluate(args, on_progress=partials.append))
    assert [len(p["summary"]) for p in partials] == [1, 2]
    assert not any(p["complete"] for p in partials) and final["complete"]
    assert final["summary"] == partials[-1]["summary"]


def test_eval_draft_measures_second_turns_after_the_targets_own_answers(smollm2_dir):
    """--follow-up: each prompt, the target's greedy answer, a follow-up request; the second
    answer is measured and, at T = 0, is still the target's own."""
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args(["--target", str(smollm2_dir), "--splits", "eval_in",
                              "--temperatures", "0", "--per-split", "2", "--max-new-tokens", "12",
                              "--follow-up", "--first-answer-tokens", "16"])
    result = asyncio.run(evaluate(args))
    assert result["turn"] == "second" and result["complete"]
    (run,) = result["runs"]
    assert run["prompts"] == 2 and run["identical_to_target"] is True
    assert 1.0 <= run["tau"] <= 16.0
