"""Structured output's grammars in the gateway (docs/structured-output.md), with llguidance.

The gateway owns a structured request's grammar state, as it owns its committed output: a
`GrammarMatcher` per request advances by the committed tokens, and before every Prefill and
Verify it writes the tokens the grammar allows at each row the target will decide (token masks:
ceil(V / 32) little-endian int32 words, bit i % 32 of word i // 32 set = token i allowed, the
layout of runtime/token_mask.py). A draft chain is cut before the first token the grammar
refuses, so the target never verifies a draft it would have to reject for the grammar alone; what
the verify rejects is never fed to the matcher (plan() rolls its walk back).

llguidance (Rust; no torch) compiles a JSON schema in about a millisecond and computes a mask in
microseconds, rolls back any number of tokens, and reads tokenizer.json directly. Compiled
grammars are cached per spec; each request gets a copy of the cached matcher."""
from __future__ import annotations

import json
import threading
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import llguidance

KINDS = ("json_object", "json_schema", "regex", "choice", "grammar")
CACHE_SIZE = 256


class GrammarError(ValueError):
    """A grammar that does not compile (the compiler's message), or a matcher misused."""


@dataclass(frozen=True)
class GrammarSpec:
    kind: str            # one of KINDS
    source: str          # json_schema: the schema as JSON text; regex; choice: a JSON list of
                         # strings; grammar: Lark (llguidance's dialect); json_object: ""

    def llguidance_grammar(self) -> str:
        """The grammar in llguidance's serialized form (not yet checked)."""
        llguidance = _llguidance()
        if self.kind == "json_object":
            return llguidance.LLMatcher.grammar_from_json_schema({"type": "object"})
        if self.kind == "json_schema":
            return llguidance.LLMatcher.grammar_from_json_schema(self.source)
        if self.kind == "regex":
            return llguidance.LLMatcher.grammar_from_regex(self.source)
        if self.kind == "choice":
            choices = json.loads(self.source)
            return llguidance.LLMatcher.grammar_from_lark(
                "start: " + " | ".join(json.dumps(c) for c in choices))
        if self.kind == "grammar":
            return llguidance.LLMatcher.grammar_from_lark(self.source)
        raise GrammarError(f"unknown structured-output kind {self.kind!r}; allowed: {list(KINDS)}")


def _llguidance() -> Any:
    """The module, imported on first use: a gateway without it serves everything else."""
    try:
        import llguidance
    except ImportError as e:
        raise GrammarError(f"structured output is not available on this gateway: the llguidance "
                           f"package is not installed ({e})") from None
    return llguidance


class CompiledGrammar:
    """A checked grammar and a matcher in its start state, copied for every request."""

    def __init__(self, start: llguidance.LLMatcher, mask_bytes: int, eos_ids: frozenset[int]
                 ) -> None:
        self.start, self.mask_bytes, self.eos_ids = start, mask_bytes, eos_ids


class GrammarCompiler:
    """One per gateway: the target's tokenizer (tokenizer.json) as llguidance sees it, the
    vocabulary size (the model's; ids past the tokenizer's are never allowed) and EOS ids."""

    def __init__(self, tokenizer_dir: str | Path, vocab_size: int, eos_ids: list[int]) -> None:
        self.vocab_size = vocab_size
        self.eos_ids = frozenset(eos_ids)
        self.llguidance = _llguidance()
        self.tokenizer = self.llguidance.LLTokenizer(str(Path(tokenizer_dir) / "tokenizer.json"),
                                                n_vocab=vocab_size, eos_token=list(eos_ids))
        self._cache: OrderedDict[GrammarSpec, CompiledGrammar] = OrderedDict()
        self._lock = threading.Lock()

    def compile(self, spec: GrammarSpec) -> CompiledGrammar:
        """Cached; thread-safe. Raises GrammarError with the compiler's message."""
        with self._lock:
            if spec in self._cache:
                self._cache.move_to_end(spec)
                return self._cache[spec]
        compiled = self._compile(spec)
        with self._lock:
            self._cache[spec] = compiled
            while len(self._cache) > CACHE_SIZE:
                self._cache.popitem(last=False)
        return compiled

    def _compile(self, spec: GrammarSpec) -> CompiledGrammar:
        try:
            grammar = spec.llguidance_grammar()
        except (ValueError, TypeError) as e:          # a schema or choice list that is not JSON
            raise GrammarError(str(e)) from None
        problem = self.llguidance.LLMatcher.validate_grammar(grammar, self.tokenizer)
        if problem:
            raise GrammarError(problem.strip())
        start = self.llguidance.LLMatcher(self.tokenizer, grammar, log_level=0)
        if start.is_error():
            raise GrammarError(start.get_error().strip())
        return CompiledGrammar(start, 4 * ((self.vocab_size + 31) // 32), self.eos_ids)


class GrammarMatcher:
    """One request's grammar state: where its committed output stands in the grammar."""

    def __init__(self, compiled: CompiledGrammar) -> None:
        self.compiled = compiled
        self.matcher = compiled.start.deep_copy()

    @property
    def done(self) -> bool:
        """The grammar is complete: only EOS may follow (or EOS was taken)."""
        return self.matcher.is_stopped()

    def mask(self) -> bytes:
        """The tokens allowed next (only EOS once the grammar is complete)."""
        raw = self.matcher.compute_bitmask()
        size = self.compiled.mask_bytes
        return raw[:size] if len(raw) >= size else raw + bytes(size - len(raw))

    def accept(self, tokens: list[int]) -> None:
        """Committed tokens (the target kept them inside the masks: a refusal is a bug). Once
        the grammar is complete the EOS that follows needs no consuming (llguidance may refuse
        it then)."""
        for token in tokens:
            if self.done and token in self.compiled.eos_ids:
                continue
            if not self.matcher.consume_token(token):
                raise GrammarError(f"the grammar refused committed token {token}: "
                                   f"{self.matcher.get_error()}")

    def plan(self, drafts: list[int]) -> tuple[int, list[bytes]]:
        """For a draft chain about to be verified: (k = the drafts the grammar allows before its
        first refusal or an EOS draft, the k + 1 masks of the block rows: before d1 (the
        anchor's row), after d1, ..., after dk). The matcher is left where it was."""
        k = self.matcher.validate_tokens(list(drafts)) if drafts else 0
        k = next((i for i, t in enumerate(drafts[:k]) if t in self.compiled.eos_ids), k)
        masks = [self.mask()]
        for token in drafts[:k]:
            self.matcher.consume_token(token)
            masks.append(self.mask())
        if k and not self.matcher.rollback(k):
            raise GrammarError(f"the grammar could not roll back {k} tokens: "
                               f"{self.matcher.get_error()}")
        return k, masks
