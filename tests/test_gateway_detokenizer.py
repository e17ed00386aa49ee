"""Incremental detokenization and the output rules on SmolLM2's real tokenizer (byte-level BPE,
where emoji and CJK characters are split over several tokens)."""
from __future__ import annotations

import random

import pytest

from gateway.detokenizer import IncrementalDetokenizer
from gateway.output import OutputProcessor
from gateway.request import GenerationRequest
from runtime.tokenizer import ChatTokenizer

pytestmark = pytest.mark.slow

THUMBS_UP = [15107, 235, 231]          # " 👍": three tokens, none a character on its own
TEXTS = ["Hello, world! 日本語のテキスト 🙂👍 café — naïve “quotes” ∑∫ 中文字符",
         "  leading spaces\n\ttabs and 😀😃😄 emoji runs\n",
         "Ünïcödé ñ ß ø å ¿¡ 한국어 العربية עברית 🇫🇷"]


@pytest.fixture(scope="module")
def tok(smollm2_dir) -> ChatTokenizer:
    return ChatTokenizer(smollm2_dir)


def stream(tok, ids, prompt=(), skip=True):
    d = IncrementalDetokenizer(tok, list(prompt), skip)
    deltas = [d.add(t) for t in ids]
    return deltas, d.flush()


def test_the_emoji_tokens_really_split_a_character(tok):
    assert tok.decode(THUMBS_UP) == " 👍"
    assert all("\ufffd" in tok.decode([t]) for t in THUMBS_UP)


def test_split_character_is_held_until_complete(tok):
    deltas, tail = stream(tok, THUMBS_UP + tok.encode(" ok"))
    assert deltas[:3] == ["", "", " 👍"] and "".join(deltas) + tail == " 👍 ok"


@pytest.mark.parametrize("text", TEXTS)
def test_deltas_never_hold_broken_utf8_and_add_up_to_the_text(tok, text):
    ids = tok.encode(text)
    assert any("\ufffd" in tok.decode([t]) for t in ids)        # the case under test occurs
    deltas, tail = stream(tok, ids, prompt=tok.encode("Say:"))
    assert not any("\ufffd" in d for d in deltas)
    assert "".join(deltas) + tail == text == tok.decode(ids)


def test_random_token_sequences_add_up_to_the_full_decode(tok):
    rng = random.Random(0)
    for _ in range(200):
        ids = [rng.choice([rng.randrange(49152), *THUMBS_UP, 7365, 124, 10813])
               for _ in range(rng.randint(1, 12))]
        prompt = [rng.randrange(49152) for _ in range(rng.randint(0, 7))]
        deltas, tail = stream(tok, ids, prompt)
        assert "".join(deltas) + tail == tok.decode(ids, skip_special_tokens=True).rstrip("\ufffd")


def test_output_cut_inside_a_character_emits_no_replacement_char(tok):
    deltas, tail = stream(tok, tok.encode("ok") + THUMBS_UP[:2])
    assert "".join(deltas) + tail == "ok "          # the space is whole; the emoji's bytes are not


def test_special_tokens_skipped_or_kept(tok):
    ids = tok.encode("hi<|im_end|> there")
    assert "".join(stream(tok, ids, skip=True)[0]) + "" == "hi there"
    deltas, tail = stream(tok, ids, skip=False)
    assert "".join(deltas) + tail == "hi<|im_end|> there"


# -- the output rules over real tokens ----------------------------------------------------------
def processor(tok, **kw):
    req = GenerationRequest(**{"prompt_ids": (1, 2), "max_tokens": 100, **kw})
    return OutputProcessor(req, [2], tok)


def run_steps(p, steps):
    out = [p.add(s) for s in steps]
    return [t for d in out for t in d.token_ids], "".join(d.text for d in out), out[-1].finish_reason


def test_stop_string_spanning_tokens_cuts_tokens_and_text(tok):
    ids = tok.encode("The answer is forty-two, said the computer.")
    stop = "y-tw"                       # spans the tokens of "forty" and "-two"
    assert not any(stop in tok.decode([t]) for t in ids)
    toks, text, reason = run_steps(processor(tok, stop=(stop,)), [ids[:3], ids[3:]])
    assert text == "The answer is fort" and reason == "stop"
    assert stop in tok.decode(toks) and stop not in tok.decode(toks[:-1])   # cut at the token


def test_eos_and_stop_token_ids_end_without_text(tok):
    ids = tok.encode("Hello there")
    toks, text, reason = run_steps(processor(tok), [ids + [2] + ids])
    assert (toks, text, reason) == (ids + [2], "Hello there", "stop")
    toks, text, reason = run_steps(processor(tok, stop_token_ids=(ids[1],)), [ids])
    assert (toks, text, reason) == (ids[:2], tok.decode(ids[:1]), "stop")


def test_ignore_eos_keeps_going_until_max_tokens(tok):
    ids = tok.encode("a b c d")
    toks, _, reason = run_steps(processor(tok, ignore_eos=True, max_tokens=3), [[2] + ids])
    assert toks == [2] + ids[:2] and reason == "length"


def test_max_tokens_cuts_a_step_and_flushes_held_text(tok):
    ids = tok.encode("one two three four")
    toks, text, reason = run_steps(processor(tok, max_tokens=2, stop=("two three",)), [ids])
    assert toks == ids[:2] and text == "one two" and reason == "length"


def test_stops_wait_for_min_tokens(tok):
    ids = tok.encode("x STOP y STOP z")
    _, text, reason = run_steps(processor(tok, stop=("STOP",), min_tokens=4), [ids])
    assert text == "x STOP y " and reason == "stop"
