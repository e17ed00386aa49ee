"""Second turns for training (`train-draft --follow-ups N`): each training prompt, the target's
own greedy answer to it, then a follow-up request (data/prompt-templates/index.json, "follow_ups") - a conversation
the target answers again. The drafter learns from these answers as from first ones: more of the
target's text, in contexts the single-turn prompts never show (and that served chats do).

Follow-up set k picks each prompt's request with a RNG seeded by (seed, k, prompt id), so the
sets are reproducible and differ from one another. An answer cut at max_new tokens is continued
as it is (a served chat resends such answers too); conversations longer than `max_prompt` tokens
are left out (the answer then fits the trainer's max_len)."""
from __future__ import annotations

import random
from dataclasses import dataclass

from runtime.tokenizer import ChatTokenizer
from train.generate import Example
from train.prompt_templates import load_templates

MAX_PROMPT_TOKENS = 384


@dataclass(frozen=True)
class FollowUp:
    """A follow-up request: `id` is the first prompt's id plus /f{set}; `text` the request."""
    id: str
    category: str
    text: str


def first_prompt_id(prompt_id: str) -> str:
    """The training prompt an example answers: a second turn's id is that prompt's id + /f{k}."""
    return prompt_id.split("/f", 1)[0]


def is_second_turn(prompt_id: str) -> bool:
    return first_prompt_id(prompt_id) != prompt_id


def requests_for(category: str) -> list[str]:
    follow_ups = load_templates().follow_ups
    return follow_ups["*"] + follow_ups.get(category, [])


def follow_up_prompts(tok: ChatTokenizer, texts: dict[str, str], first: list[Example],
                      set_index: int, seed: int, max_prompt: int | None = MAX_PROMPT_TOKENS
                      ) -> tuple[list[FollowUp], list[list[int]]]:
    """texts: prompt id -> first user message; first: the target's greedy answers to them ->
    (follow-up records, their conversations' chat-formatted ids), in `first`'s order, leaving
    out conversations over max_prompt tokens (None: none left out)."""
    records: list[FollowUp] = []
    ids: list[list[int]] = []
    for e in first:
        rng = random.Random(f"{seed}:{set_index}:{e.prompt_id}")
        request = rng.choice(requests_for(e.category))
        answer = tok.decode(e.response_ids, skip_special_tokens=True)   # without its EOS
        rendered = tok.apply_chat_template(
            [{"role": "user", "content": texts[e.prompt_id]},
             {"role": "assistant", "content": answer},
             {"role": "user", "content": request}], add_generation_prompt=True)
        conv = tok.encode(rendered)
        if max_prompt is None or len(conv) <= max_prompt:
            records.append(FollowUp(f"{first_prompt_id(e.prompt_id)}/f{set_index}", e.category,
                                    request))
            ids.append(conv)
    return records, ids
