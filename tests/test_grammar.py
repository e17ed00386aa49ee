"""The gateway's grammar matcher (gateway/grammar.py) on SmolLM2's real tokenizer: masks allow
exactly the tokens that keep the text a valid prefix, plan() cuts a draft chain at the first
refused token with the masks step-by-step accepting would give and leaves the matcher as it was,
a complete grammar allows only EOS, bad specs raise GrammarError with the compiler's message."""
from __future__ import annotations

import json
import re

import numpy as np
import pytest

from gateway.grammar import GrammarCompiler, GrammarError, GrammarMatcher, GrammarSpec
from runtime.token_mask import decode_masks, mask_bytes
from runtime.tokenizer import ChatTokenizer

EOS = 2
SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                           "n": {"type": "integer"}},
          "required": ["name", "n"], "additionalProperties": False}
DOC = '{"name": "Ada", "n": 36}'


@pytest.fixture(scope="module")
def tok(smollm2_dir) -> ChatTokenizer:
    return ChatTokenizer(smollm2_dir)


@pytest.fixture(scope="module")
def compiler(smollm2_dir) -> GrammarCompiler:
    return GrammarCompiler(smollm2_dir, 49152, [EOS])


def allowed(mask: bytes, vocab: int = 49152) -> np.ndarray:
    return np.nonzero(decode_masks([mask], vocab)[0].numpy())[0]


def schema_matcher(compiler) -> GrammarMatcher:
    return GrammarMatcher(compiler.compile(GrammarSpec("json_schema", json.dumps(SCHEMA))))


def test_a_valid_document_is_allowed_token_by_token_then_only_eos(compiler, tok):
    m = schema_matcher(compiler)
    for token in tok.encode(DOC):
        mask = m.mask()
        assert len(mask) == mask_bytes(49152)
        assert token in allowed(mask)
        m.accept([token])
    assert m.done and list(allowed(m.mask())) == [EOS]
    m.accept([EOS])                                  # EOS after completion is taken quietly


def test_masks_allow_exactly_the_valid_prefixes(compiler, tok):
    """After '{"name": "A' (inside a string of at most 12 characters), a sample of the tokens
    without quotes or backslashes: allowed iff they add at most 11 characters and no control
    character; the closing quote and '",' are allowed."""
    m = schema_matcher(compiler)
    m.accept(tok.encode('{"name": "A'))
    ok = set(allowed(m.mask()).tolist())
    checked = 0
    assert not ok & tok.special_ids                    # special tokens are never text
    for token in range(0, 49152, 37):
        text = tok.decode([token])
        if token in tok.special_ids:
            continue
        if not text or "\ufffd" in text or '"' in text or "\\" in text:
            continue
        valid = len(text) <= 11 and not re.search(r"[\x00-\x1f]", text)
        assert (token in ok) == valid, (token, text)
        checked += 1
    assert checked > 1000
    assert {tok.token_id('"'), tok.token_id('",')} <= ok


def test_plan_cuts_at_the_first_refused_draft_and_leaves_the_matcher_unchanged(compiler, tok):
    m = schema_matcher(compiler)
    m.accept(tok.encode('{"name": '))
    good = tok.encode('"Ada", "n": 3')
    bad = tok.encode("x")
    before = m.mask()
    kept, masks = m.plan(good + bad + good)
    assert kept == len(good) and len(masks) == kept + 1
    assert m.mask() == before                                      # rolled back
    step = schema_matcher(compiler)
    step.accept(tok.encode('{"name": '))
    for i, token in enumerate(good):
        assert step.mask() == masks[i]
        step.accept([token])
    assert step.mask() == masks[-1]
    assert m.plan([])[0] == 0 and m.plan([])[1] == [before]


def test_plan_stops_before_an_eos_draft(compiler, tok):
    m = GrammarMatcher(compiler.compile(GrammarSpec("choice", json.dumps(["yes", "no"]))))
    kept, masks = m.plan(tok.encode("yes") + [EOS, 5])
    assert kept == len(tok.encode("yes")) and list(allowed(masks[-1])) == [EOS]


def test_regex_choice_grammar_and_json_object(compiler, tok):
    cases = [("regex", r"\d{3}-\d{4}", "555-1234"), ("choice", json.dumps(["red", "blue"]), "blue"),
             ("grammar", 'start: a "!"\na: "yes" | "no"', "no!"),
             ("json_object", "", '{"a": [1, 2]}')]
    for kind, source, text in cases:
        m = GrammarMatcher(compiler.compile(GrammarSpec(kind, source)))
        for token in tok.encode(text):
            assert token in allowed(m.mask()), (kind, text)
            m.accept([token])
        assert EOS in allowed(m.mask()), kind


def test_bad_specs_raise_with_the_compilers_message(compiler):
    for spec, words in ((GrammarSpec("json_schema", '{"type": "objekt"}'), "objekt"),
                        (GrammarSpec("regex", "(unclosed"), "unclosed group"),
                        (GrammarSpec("grammar", "start: ???"), "Expected"),
                        (GrammarSpec("xml", "<a/>"), "unknown structured-output kind")):
        with pytest.raises(GrammarError, match=re.escape(words)):
            compiler.compile(spec)


def test_compiled_grammars_are_cached_and_matchers_independent(compiler, tok):
    spec = GrammarSpec("json_schema", json.dumps(SCHEMA))
    assert compiler.compile(spec) is compiler.compile(spec)
    a, b = schema_matcher(compiler), schema_matcher(compiler)
    a.accept(tok.encode('{"name'))
    assert b.mask() != a.mask() and b.mask() == schema_matcher(compiler).mask()


def test_a_refused_committed_token_is_an_error(compiler, tok):
    m = schema_matcher(compiler)
    with pytest.raises(GrammarError, match="refused committed token"):
        m.accept(tok.encode("hello"))


def test_ids_past_the_tokenizer_are_never_allowed(smollm2_dir):
    big = GrammarCompiler(smollm2_dir, 49152 + 64, [EOS])
    m = GrammarMatcher(big.compile(GrammarSpec("json_object", "")))
    ids = allowed(m.mask(), 49152 + 64)
    assert len(m.mask()) == mask_bytes(49152 + 64) and ids.max() < 49152
