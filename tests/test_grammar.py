"""The gateway's grammar matcher (gateway/grammar.py) on SmolLM2's real tokenizer (tokenizer.json
through `tokenizers`, no transformers, no mocks): masks allow exactly the tokens that keep the text
a valid prefix (checked against Python's json and a partial-matching regex engine), plan() cuts a
draft chain at the first refused token with the masks step-by-step accepting would give and
leaves the matcher as it was, a complete grammar allows only EOS, bad specs raise GrammarError
with the compiler's message, compiled grammars are cached, and matchers run on several threads.

Masks are decoded here with numpy alone (the gateway has no decoder; the target's is
runtime/token_mask.py): ceil(V / 32) little-endian int32 words, bit i % 32 of word i // 32 set =
token i allowed."""
from __future__ import annotations

import json
import re
import struct
import threading
from pathlib import Path

import numpy as np
import pytest
from tokenizers import Tokenizer

import gateway.grammar
from gateway.grammar import GrammarCompiler, GrammarError, GrammarMatcher, GrammarSpec
from runtime.draft_tree import DraftTree

V = 49152                      # SmolLM2's vocabulary (model and tokenizer)
EOS = 2                        # <|im_end|>, the chat model's EOS
SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                           "n": {"type": "integer"}},
          "required": ["name", "n"], "additionalProperties": False}
DOC = '{"name": "Ada", "n": 36}'
PATTERN = r"[A-Z][a-z]{1,6}-\d{2,4}(\.\d)?"


class Tok:
    """SmolLM2's tokenizer.json: encode without special tokens, decode one token, special ids."""

    def __init__(self, model_dir: Path) -> None:
        self.tokenizer = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
        self.special = {i for i, t in self.tokenizer.get_added_tokens_decoder().items()
                        if t.special}
        self.texts = [self.tokenizer.decode([i], skip_special_tokens=False) for i in range(V)]

    def encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False).ids

    def plain(self, token: int) -> str | None:
        """The text of a token that is whole UTF-8 text and not special, else None."""
        text = self.texts[token]
        return None if token in self.special or not text or "\ufffd" in text else text


@pytest.fixture(scope="module")
def tok(smollm2_dir) -> Tok:
    return Tok(smollm2_dir)


@pytest.fixture(scope="module")
def compiler(smollm2_dir) -> GrammarCompiler:
    return GrammarCompiler(smollm2_dir, V, [EOS])


def allowed(mask: bytes, vocab: int = V) -> np.ndarray:
    """The token ids a mask allows, ascending (numpy: bits little-endian within each byte)."""
    assert len(mask) == 4 * ((vocab + 31) // 32)
    bits = np.unpackbits(np.frombuffer(mask, dtype=np.uint8), bitorder="little")
    return np.nonzero(bits[:vocab])[0]


def matcher(compiler: GrammarCompiler, kind: str, source: str = "") -> GrammarMatcher:
    return GrammarMatcher(compiler.compile(GrammarSpec(kind, source)))


def schema_matcher(compiler: GrammarCompiler) -> GrammarMatcher:
    return matcher(compiler, "json_schema", json.dumps(SCHEMA))


def plan_chain(m: GrammarMatcher, drafts: list[int]) -> tuple[int, list[bytes]]:
    """plan() of a chain: (drafts kept, masks); the kept drafts must be a prefix, as a chain."""
    kept, masks = m.plan(DraftTree.chain(drafts))
    assert kept.is_chain and kept.tokens == drafts[: len(kept.tokens)]
    return len(kept.tokens), masks


def test_the_mask_is_little_endian_int32_words(compiler, tok):
    """Word by word (struct '<i'), bit i % 32 of word i // 32 is token i: the numpy decoder
    above reads the same bits."""
    mask = schema_matcher(compiler).mask()
    words = struct.unpack(f"<{V // 32}i", mask)
    by_words = [i for i in range(V) if (words[i // 32] >> (i % 32)) & 1]
    assert by_words == allowed(mask).tolist() and tok.encode("{")[0] in by_words
    assert all(tok.texts[i].startswith("{") for i in by_words)


def test_a_valid_document_is_allowed_token_by_token_then_only_eos(compiler, tok):
    m = schema_matcher(compiler)
    for token in tok.encode(DOC):
        assert not m.done and token in allowed(m.mask())
        m.accept([token])
    assert m.done and allowed(m.mask()).tolist() == [EOS]
    m.accept([EOS])
    assert m.done and allowed(m.mask()).tolist() == [EOS]
    m.accept([EOS])                                  # EOS after completion is taken quietly


def test_string_masks_allow_exactly_the_valid_prefixes(compiler, tok):
    """After '{"name": "A' (inside a string of at most 12 characters), a sample of the tokens
    without quotes or backslashes: allowed iff they add at most 11 characters and no control
    character; the closing quote and '",' are allowed; special tokens never."""
    m = schema_matcher(compiler)
    m.accept(tok.encode('{"name": "A'))
    ok = set(allowed(m.mask()).tolist())
    assert not ok & tok.special
    checked = 0
    for token in range(0, V, 37):
        text = tok.plain(token)
        if text is None or '"' in text or "\\" in text:
            continue
        valid = len(text) <= 11 and not re.search(r"[\x00-\x1f]", text)
        assert (token in ok) == valid, (token, text)
        checked += 1
    assert checked > 1000
    assert {tok.encode('"')[0], tok.encode('",')[0]} <= ok


def _json_prefix_ok(text: str) -> bool:
    """Whether text can still become a document of SCHEMA whose last value is "n" (for a text
    that stops inside that integer): some short completion parses and validates."""
    for end in ("", "}", "0}"):
        try:
            doc = json.loads(text + end)
        except ValueError:
            continue
        if isinstance(doc, dict) and doc.keys() == {"name", "n"} and type(doc["n"]) is int:
            return True
    return False


def test_integer_masks_agree_with_python_json(compiler, tok):
    """After '{"name": "Ada", "n": ' every token made of number characters, and a sample of the
    others (whitespace left out: the grammar's layout is its own), is allowed iff Python's json
    can still finish the document with an integer "n"."""
    prefix = '{"name": "Ada", "n": '
    m = schema_matcher(compiler)
    m.accept(tok.encode(prefix))
    ok = set(allowed(m.mask()).tolist())
    numeric = re.compile(r"[0-9eE+\-.},]{1,6}")
    checked = valid = 0
    for token in range(V):
        text = tok.plain(token)
        if text is None or re.search(r"\s", text) or not (numeric.fullmatch(text) or
                                                           token % 23 == 0):
            continue
        expected = _json_prefix_ok(prefix + text)
        assert (token in ok) == expected, (token, text)
        checked, valid = checked + 1, valid + expected
    assert checked > 500 and valid >= 10          # SmolLM2 splits numbers into digits


@pytest.mark.parametrize("prefix", ["", "Ab", "Abc-1", "Abc-12", "Abc-12.5"])
def test_regex_masks_agree_with_a_partial_regex_match(compiler, tok, prefix):
    """Each token that could continue the pattern, and a sample of the others, is allowed iff
    the `regex` module's partial full match says the text can still match; EOS iff it matches."""
    partial = pytest.importorskip("regex")
    m = matcher(compiler, "regex", PATTERN)
    m.accept(tok.encode(prefix))
    ok = set(allowed(m.mask()).tolist())
    assert (EOS in ok) == bool(re.fullmatch(PATTERN, prefix))
    near = re.compile(r"[A-Za-z0-9.\-]{1,8}")
    checked = valid = 0
    for token in range(V):
        text = tok.plain(token)
        if text is None or not (near.fullmatch(text) or token % 29 == 0):
            continue
        expected = partial.fullmatch(PATTERN, prefix + text, partial=True) is not None
        assert (token in ok) == expected, (prefix, token, text)
        checked, valid = checked + 1, valid + expected
    assert checked > 2000
    assert valid > 0 if prefix != "Abc-12.5" else ok == {EOS}          # complete: nothing more


def test_plan_cuts_at_the_first_refused_draft_and_leaves_the_matcher_unchanged(compiler, tok):
    """From every position of the document: a valid continuation of up to 6 tokens, then a
    token the grammar refuses anywhere (a raw control character), then more. plan keeps exactly the continuation, its k + 1 masks
    are those accept() step by step gives, and the mask after plan is the one before."""
    doc = tok.encode(DOC)
    wrong = tok.encode("\x01")[0]
    for start in range(len(doc)):
        m = schema_matcher(compiler)
        m.accept(doc[:start])
        good = doc[start:start + 6]
        before = m.mask()
        kept, masks = plan_chain(m, good + [wrong] + doc[start:])
        assert kept == len(good) and len(masks) == kept + 1, start
        assert m.mask() == before and not m.done
        step = schema_matcher(compiler)
        step.accept(doc[:start])
        for i, token in enumerate(good):
            assert step.mask() == masks[i], (start, i)
            step.accept([token])
        assert step.mask() == masks[-1]
        m.accept(good)                               # still where it was: the drafts fit
        assert m.mask() == masks[-1]
    m = schema_matcher(compiler)
    assert plan_chain(m, []) == (0, [m.mask()])
    assert plan_chain(m, [wrong])[0] == 0


def test_plan_prunes_a_tree_node_and_its_subtree(compiler, tok):
    """Under the anchor: a valid branch ('"Ada' then '",'), a refused node ('x') with a
    child, and a refused node under the branch's last; the kept tree is re-indexed, each kept
    row's mask is the one accepting its path step by step gives, and the matcher is unchanged."""
    m = schema_matcher(compiler)
    m.accept(tok.encode('{"name": '))
    a, b = tok.encode('"Ada'), tok.encode('",')
    assert len(a) == 3 and len(b) == 1
    x = tok.encode("x")[0]
    # nodes: 1 a0 (0), 2 x (0), 3 a1 (1), 4 a0 (2: under x), 5 a2 (3), 6 b (5), 7 x (6)
    tree = DraftTree([a[0], x, a[1], a[0], a[2], b[0], x], [0, 0, 1, 2, 3, 5, 6])
    before = m.mask()
    kept, masks = m.plan(tree)
    assert kept.tokens == [*a, b[0]] and kept.parents == [0, 1, 2, 3]
    assert len(masks) == 5 and m.mask() == before
    step = schema_matcher(compiler)
    step.accept(tok.encode('{"name": '))
    for i, token in enumerate(kept.tokens):
        assert step.mask() == masks[i]
        step.accept([token])
    assert step.mask() == masks[-1]
    branches = DraftTree([a[0], x, a[1]], [0, 0, 1])         # two siblings, one refused
    kept, masks = m.plan(branches)
    assert kept.tokens == [a[0], a[1]] and kept.parents == [0, 1] and len(masks) == 3


def test_plan_stops_before_an_eos_draft(compiler, tok):
    m = matcher(compiler, "choice", json.dumps(["yes", "no"]))
    yes = tok.encode("yes")
    kept, masks = plan_chain(m, yes + [EOS, 5])
    assert kept == len(yes) and allowed(masks[-1]).tolist() == [EOS]
    assert plan_chain(m, [EOS])[0] == 0 and not m.done


def test_eos_where_the_grammar_may_end_or_go_on(compiler, tok):
    """'\\d+' after "5": more digits or EOS. accept(EOS) completes it; only EOS after that."""
    m = matcher(compiler, "regex", r"\d+")
    m.accept(tok.encode("5"))
    ok = allowed(m.mask()).tolist()
    assert EOS in ok and tok.encode("7")[0] in ok and not m.done
    m.accept([EOS])
    assert m.done and allowed(m.mask()).tolist() == [EOS]


def test_regex_choice_grammar_and_json_object(compiler, tok):
    cases = [("regex", r"\d{3}-\d{4}", "555-1234"), ("choice", json.dumps(["red", "blue"]), "blue"),
             ("grammar", 'start: a "!"\na: "yes" | "no"', "no!"),
             ("json_object", "", '{"a": [1, 2]}')]
    for kind, source, text in cases:
        m = matcher(compiler, kind, source)
        for token in tok.encode(text):
            assert token in allowed(m.mask()), (kind, text)
            m.accept([token])
        assert EOS in allowed(m.mask()), kind
        m.accept([EOS])
        assert m.done, kind


def test_choices_with_quotes_escapes_and_unicode(compiler, tok):
    choices = ['say "hi"', "back\\slash", "two\nlines", "café", "日本", "a|b"]
    for choice in choices:
        m = matcher(compiler, "choice", json.dumps(choices))
        for token in tok.encode(choice):
            assert token in allowed(m.mask()), choice
            m.accept([token])
        assert m.done and allowed(m.mask()).tolist() == [EOS], choice
    m = matcher(compiler, "choice", json.dumps(choices))
    assert tok.encode("hello")[0] not in allowed(m.mask())


def test_bad_specs_raise_with_the_compilers_message(compiler):
    for spec, words in ((GrammarSpec("json_schema", '{"type": "objekt"}'), "objekt"),
                        (GrammarSpec("json_schema", "[1, 2]"), "schema must be an object"),
                        (GrammarSpec("json_schema", "{not json"),
                         ("not JSON: Expecting property name enclosed in double quotes: line 1 "
                          "column 2")),
                        (GrammarSpec("regex", "(unclosed"), "unclosed group"),
                        (GrammarSpec("grammar", "start: ???"), "Expected"),
                        (GrammarSpec("grammar", "start: undefined_rule"), "undefined_rule"),
                        (GrammarSpec("xml", "<a/>"), "unknown structured-output kind")):
        with pytest.raises(GrammarError, match=re.escape(words)):
            compiler.compile(spec)


def test_validate_refuses_unknown_kinds_empty_sources_and_bad_choices():
    GrammarSpec("json_object", "").validate()
    GrammarSpec("choice", '["a"]').validate()
    for spec, words in ((GrammarSpec("yaml", "a: 1"), "unknown structured-output kind"),
                        (GrammarSpec("regex", ""), "the regex is empty"),
                        (GrammarSpec("grammar", "  \n"), "the grammar is empty"),
                        (GrammarSpec("json_schema", ""), "the json_schema is empty"),
                        (GrammarSpec("choice", "[]"), "non-empty JSON list"),
                        (GrammarSpec("choice", '["a", 3]'), "non-empty JSON list"),
                        (GrammarSpec("choice", '["a", ""]'), "non-empty JSON list"),
                        (GrammarSpec("choice", "a, b"), "the choices are not JSON")):
        with pytest.raises(GrammarError, match=re.escape(words)):
            spec.validate()


def test_compiled_grammars_are_cached_and_matchers_independent(compiler, tok, monkeypatch):
    spec = GrammarSpec("json_schema", json.dumps(SCHEMA))
    assert compiler.compile(spec) is compiler.compile(spec)
    a, b = schema_matcher(compiler), schema_matcher(compiler)
    a.accept(tok.encode('{"name'))
    assert b.mask() != a.mask() and b.mask() == schema_matcher(compiler).mask()
    monkeypatch.setattr(gateway.grammar, "CACHE_SIZE", 2)
    first = compiler.compile(GrammarSpec("regex", "a+"))
    compiler.compile(GrammarSpec("regex", "b+"))
    compiler.compile(GrammarSpec("regex", "c+"))            # evicts the least recently used
    assert compiler.compile(GrammarSpec("regex", "c+")) is compiler.compile(GrammarSpec("regex",
                                                                                      "c+"))
    assert compiler.compile(GrammarSpec("regex", "a+")) is not first


def test_a_refused_committed_token_is_an_error(compiler, tok):
    m = schema_matcher(compiler)
    with pytest.raises(GrammarError, match="refused committed token"):
        m.accept(tok.encode("hello"))


def test_ids_past_the_tokenizer_are_never_allowed(smollm2_dir, tok):
    big = GrammarCompiler(smollm2_dir, V + 64, [EOS])
    for kind, source, prefix in (("json_object", "", '{"a": "'), ("regex", ".*", "")):
        m = GrammarMatcher(big.compile(GrammarSpec(kind, source)))
        m.accept(tok.encode(prefix))
        ids = allowed(m.mask(), V + 64)
        assert ids.max() < V and len(ids) > 1000, kind
        assert plan_chain(m, [V + 3])[0] == 0
        with pytest.raises(GrammarError, match="refused committed token"):
            m.accept([V + 3])


def test_matchers_and_compiles_on_several_threads(compiler, tok):
    """Four threads compile one new spec at once (one object comes back) and walk their own
    matchers of it: every mask equals the one a single thread computes."""
    doc = tok.encode(DOC)
    spec = GrammarSpec("json_schema", json.dumps({**SCHEMA, "title": "threads"}))
    reference = GrammarMatcher(compiler.compile(GrammarSpec("json_schema", json.dumps(SCHEMA))))
    expected = []
    for token in doc:
        expected.append(reference.mask())
        reference.accept([token])
    got: list = []
    barrier = threading.Barrier(4)

    def walk() -> None:
        barrier.wait()
        compiled = compiler.compile(spec)
        for _ in range(3):
            m, masks = GrammarMatcher(compiled), []
            for token in doc:
                masks.append(m.mask())
                plan_chain(m, doc)                          # rolled back: no effect on what follows
                m.accept([token])
            got.append((compiled, masks))

    threads = [threading.Thread(target=walk) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(got) == 12 and len({id(c) for c, _ in got}) == 1
    assert all(masks == expected for _, masks in got)
