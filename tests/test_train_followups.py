"""Second turns for training (`train-draft --follow-ups`): each training prompt, the target's own
first answer and a follow-up request, rendered with SmolLM2's chat template; reproducible per
set, different between sets, and capped in length."""
from __future__ import annotations

import pytest

from runtime.tokenizer import ChatTokenizer
from train.follow_ups import follow_up_prompts, requests_for
from train.generate import Example, chat_prompt_ids
from train.prompt_templates import load_templates


@pytest.fixture(scope="module")
def tok(smollm2_dir) -> ChatTokenizer:
    return ChatTokenizer(smollm2_dir)


def _first(tok: ChatTokenizer, n: int, category: str = "code") -> tuple[dict, list[Example]]:
    texts = {f"p{i}": f"Write a Python function number {i} that adds two numbers." for i in range(n)}
    eos = tok.token_id("<|im_end|>")
    first = [Example(pid, category, chat_prompt_ids(tok, t),
                     tok.encode(f"def add_{i}(a, b):\n    return a + b") + [eos], 0.0)
             for i, (pid, t) in enumerate(texts.items())]
    return texts, first


def test_a_follow_up_is_the_whole_conversation_ending_at_the_assistants_turn(tok):
    texts, first = _first(tok, 3)
    records, ids = follow_up_prompts(tok, texts, first, 0, seed=0)
    assert [r.id for r in records] == ["p0/f0", "p1/f0", "p2/f0"]
    for r, conv, e in zip(records, ids, first):
        text = tok.decode(conv)
        assert r.category == "code" and r.text in requests_for("code")
        assert text.startswith(tok.decode(e.prompt_ids))          # the first turn, as prompted
        assert text.endswith(f"<|im_start|>user\n{r.text}<|im_end|>\n<|im_start|>assistant\n")
        answer = tok.decode(e.response_ids, skip_special_tokens=True)
        assert f"<|im_start|>assistant\n{answer}<|im_end|>\n<|im_start|>user\n" in text
        assert text.count("<|im_start|>assistant\n") == 2


def test_follow_up_sets_are_seeded_and_differ_from_each_other(tok):
    texts, first = _first(tok, 24)
    a0, ids0 = follow_up_prompts(tok, texts, first, 0, seed=0)
    again, ids_again = follow_up_prompts(tok, texts, first, 0, seed=0)
    a1, _ = follow_up_prompts(tok, texts, first, 1, seed=0)
    assert a0 == again and ids0 == ids_again
    assert [r.text for r in a0] != [r.text for r in a1]
    # category-specific requests are drawn too (code has its own besides the common ones)
    drawn = {r.text for r in a0 + a1}
    follow_ups = load_templates().follow_ups
    assert drawn & set(follow_ups["code"]) and drawn & set(follow_ups["*"])


def test_conversations_over_the_cap_are_left_out(tok):
    texts, first = _first(tok, 4)
    _, ids = follow_up_prompts(tok, texts, first, 0, seed=0)
    cap = sorted(map(len, ids))[1]                    # keeps the two shortest (ties aside)
    kept, kept_ids = follow_up_prompts(tok, texts, first, 0, seed=0, max_prompt=cap)
    assert 1 <= len(kept) < 4 and all(len(i) <= cap for i in kept_ids)
