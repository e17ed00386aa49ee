"""Self-written training prompts (Magpie): SmolLM2 writes user requests from its chat template's
open user turn; only complete, plain-ASCII requests that near-duplicate no other kept request and
no held-out prompt are kept; the set is seeded, and `train-draft --self-prompts N` caches the
requests and the target's greedy answers to them in --work."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from runtime.tokenizer import ChatTokenizer
from train.generate import answer_wave
from train.self_prompts import request_text, user_turn_prefix, write_prompts
from train.target_runner import TargetRunner

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def tok(smollm2_dir) -> ChatTokenizer:
    return ChatTokenizer(smollm2_dir)


@pytest.fixture(scope="module")
def runner(smollm2_dir) -> TargetRunner:
    return TargetRunner(str(smollm2_dir), 16 * 120, torch.float32, "cpu")


def test_the_prefix_is_the_chat_template_up_to_the_users_words(tok):
    prefix = tok.decode(user_turn_prefix(tok))
    whole = tok.apply_chat_template([{"role": "user", "content": "Hello there"}],
                                    add_generation_prompt=True)
    assert prefix.endswith("<|im_start|>user\n") and whole.startswith(prefix)
    assert whole[len(prefix):].startswith("Hello there")


@pytest.mark.parametrize("text, eos, kept", [
    ("How do I boil an egg?", True, "How do I boil an egg?"),
    ("  It\u2019s raining \u2014 what now?  ", True, "It's raining - what now?"),
    ("How do I boil an egg?", False, None),                 # cut off: no EOS
    ("Write a poem about caf\u00e9 life", True, None),       # not plain ASCII
    ("Hi there", True, None),                               # under 3 words
    ("Tell me<|im_start|>user a joke", True, None),          # special token text
])
def test_requests_are_kept_only_when_complete_and_plain(tok, text, eos, kept):
    ids = tok.encode(text) + ([2] if eos else [])
    assert request_text(tok, ids, {2}) == kept


def test_written_requests_are_seeded_deduplicated_and_avoid_held_out_prompts(runner, tok):
    first = write_prompts(runner, tok, 6, 0.8, 48, seed=5, concurrency=16, held_out=[])
    assert len(first) == 6
    assert [r.id for r in first] == [f"self-{i:05d}" for i in range(6)]
    assert {r.category for r in first} == {"self"} and {r.split for r in first} == {"train"}
    assert len({r.text.lower() for r in first}) == 6
    assert write_prompts(runner, tok, 6, 0.8, 48, seed=5, concurrency=16, held_out=[]) == first
    # the same draws with two of them held out: neither is kept, the others are
    held = [first[0].text, first[3].text]
    second = write_prompts(runner, tok, 6, 0.8, 48, seed=5, concurrency=16, held_out=held,
                           max_waves=1)
    texts = [r.text for r in second]
    assert not set(held) & set(texts)
    assert [r.text for r in first if r.text not in held] == texts[:4]
    assert runner.cache.used_pages == 0


def test_every_kept_request_is_one_the_target_wrote(runner, tok):
    """write_prompts keeps texts of the wave's own draws (the same seed, drawn directly)."""
    kept = write_prompts(runner, tok, 4, 0.8, 48, seed=9, concurrency=8, held_out=[],
                         max_waves=1)
    draws = answer_wave(runner, [user_turn_prefix(tok)] * 8, 0.8, 48, 9 * 7907)
    texts = [t for t in (request_text(tok, d, set(runner.eos_token_ids)) for d in draws) if t]
    assert kept and [r.text for r in kept] == texts[: len(kept)]


@pytest.mark.slow
def test_train_draft_caches_self_written_prompts_and_their_greedy_answers(smollm2_dir, tmp_path):
    work = tmp_path / "work"
    cmd = [sys.executable, "-m", "dflash.cli", "train-draft", "--target", str(smollm2_dir),
           "--out", str(tmp_path / "unused"), "--work", str(work), "--device", "cpu",
           "--dtype", "float32", "--mask-token-id", "16", "--max-new-tokens", "8",
           "--limit-prompts", "2", "--limit-eval", "1", "--concurrency", "8", "--seed", "3",
           "--sampled-temperature", "0", "--follow-ups", "0", "--self-prompts", "3",
           "--self-prompt-tokens", "40", "--generate-only"]
    done = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=300,
                          check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "self-written prompts: kept 3 of" in done.stderr
    requests = _records(work / "self_prompts_n3_t0.8.jsonl")
    answers = _records(work / "train-self3_t0.0.jsonl")
    assert len(requests) == 3 and [a["prompt_id"] for a in answers] == [r["id"] for r in requests]
    tok = ChatTokenizer(smollm2_dir)
    for r, a in zip(requests, answers):
        assert a["category"] == "self" and a["temperature"] == 0.0
        assert 1 <= len(a["response_ids"]) <= 8
        rendered = tok.decode(a["prompt_ids"])
        assert rendered.endswith(r["text"] + "<|im_end|>\n<|im_start|>assistant\n")
    before = {p.name: p.read_text() for p in work.glob("*.jsonl")}
    again = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=300,
                           check=False)
    assert again.returncode == 0 and "self-written prompts" not in again.stderr  # cached
    assert {p.name: p.read_text() for p in work.glob("*.jsonl")} == before


def _records(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_the_model_card_counts_self_written_requests_apart(tmp_path):
    from train.report import write_card
    cfg = {"num_layers": 1, "block_size": 8, "mask_token_id": 16, "gamma": 3.0, "lr": 1e-3,
           "steps": 10, "batch_sequences": 4, "blocks_per_sequence": 8, "grad_clip": 1.0}
    summary = {"config": cfg, "target_layer_ids": [1, 5], "num_train_examples": 30,
               "num_train_prompts": 12, "num_self_written": 5, "num_second_turns": 0,
               "answers_by_temperature": {"0.0": 30}, "train_seconds": 1.0}
    write_card(tmp_path, summary)
    assert ("30 answers of the target itself to 7 training prompts of `data/prompts/train.jsonl` "
            "and 5 requests the target wrote itself") in (tmp_path / "README.md").read_text()


def test_a_runner_sized_by_tokens_for_holds_a_whole_wave_at_full_length(smollm2_dir):
    """Pages are whole per sequence: 100 sequences of 17 tokens need 200 pages, not 17 x 100 /
    16 (the first H200 run of --self-prompts ran out of pages on 1 024 requests this way)."""
    runner = TargetRunner(str(smollm2_dir), TargetRunner.tokens_for(100, 17), torch.float32,
                          "cpu")
    runner.release(runner.tables([17] * 100))
    assert TargetRunner.tokens_for(1024, 121) == 1024 * 128
