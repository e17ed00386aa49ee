"""Structured output's grammars in the gateway (docs/structured-output.md), with llguidance.

The gateway owns a structured request's grammar state, as it owns its committed output: a
`GrammarMatcher` per request advances by the committed tokens, and before every Prefill and
Verify it writes the tokens the grammar allows at each row the target will decide (token masks:
ceil(V / 32) little-endian int32 words, bit i % 32 of word i // 32 set = token i allowed, the
layout of runtime/token_mask.py). A draft chain is cut before the first token the grammar
refuses (a tree: each such node with its subtree), so the target never verifies a draft it would
have to reject for the grammar alone; what the verify rejects is never fed to the matcher (plan()
rolls its walk back).

llguidance (Rust; no torch, no transformers) reads tokenizer.json directly, compiles a JSON schema
in about a millisecond, computes a mask in 4-15 us (about 115 us inside a string with maxLength),
and rolls back any number of tokens (bench/grammar_cpu.py, bench/results/grammar_cpu.json).
Compiled grammars are cached per spec; each request gets a copy of the cached matcher."""
from __future__ import annotations

import json
import threading
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from runtime.draft_tree import DraftTree

if TYPE_CHECKING:
    import llguidance

KINDS = ("json_object", "json_schema", "regex", "choice", "grammar")
CACHE_SIZE = 256


class GrammarError(ValueError):
    """A grammar that does not compile (the compiler's message), or a matcher misused."""


@dataclass(frozen=True)
class GrammarSpec:
    """What a request's output must match. Hashable: the compile cache's key."""
    kind: str            # one of KINDS
    source: str          # json_schema: the schema as JSON text; regex; choice: a JSON list of
                         # non-empty strings; grammar: Lark (llguidance's dialect); json_object:
                         # ignored ("" by convention)

    def validate(self) -> None:
        """Raises GrammarError for an unknown kind, an empty source (json_object takes none) or
        a choice source that is not a JSON list of non-empty strings. Whether the source
        compiles is the compiler's to say (GrammarCompiler.compile)."""
        if self.kind not in KINDS:
            raise GrammarError(f"unknown structured-output kind {self.kind!r}; allowed: "
                               f"{list(KINDS)}")
        if self.kind != "json_object" and not self.source.strip():
            raise GrammarError(f"the {self.kind} is empty")
        if self.kind == "choice":
            self.choices()

    def choices(self) -> list[str]:
        """choice: the strings the output may be (one of them, exactly)."""
        try:
            choices = json.loads(self.source)
        except ValueError as e:
            raise GrammarError(f"the choices are not JSON: {e}") from None
        if not isinstance(choices, list) or not choices or \
                not all(isinstance(c, str) and c for c in choices):
            raise GrammarError("the choices must be a non-empty JSON list of non-empty strings")
        return choices

    def llguidance_grammar(self) -> str:
        """The grammar in llguidance's serialized form (validated, not yet compiled). A schema is
        parsed here: llguidance pastes schema text into its own JSON verbatim, so its message
        for text that is not JSON would point into that wrapper, not into the schema."""
        self.validate()
        llguidance = _llguidance()
        if self.kind == "json_object":
            return llguidance.LLMatcher.grammar_from_json_schema({"type": "object"})
        if self.kind == "json_schema":
            try:
                schema = json.loads(self.source)
            except ValueError as e:
                raise GrammarError(f"the schema is not JSON: {e}") from None
            return llguidance.LLMatcher.grammar_from_json_schema(schema)
        if self.kind == "regex":
            return llguidance.LLMatcher.grammar_from_regex(self.source)
        if self.kind == "choice":               # JSON string literals are Lark string literals
            return llguidance.LLMatcher.grammar_from_lark(
                "start: " + " | ".join(json.dumps(c) for c in self.choices()))
        return llguidance.LLMatcher.grammar_from_lark(self.source)


def _llguidance() -> Any:
    """The module, imported on first use: a gateway without it serves everything else."""
    try:
        import llguidance
    except ImportError as e:
        raise GrammarError(f"structured output is not available on this gateway: the llguidance "
                           f"package is not installed ({e})") from None
    return llguidance


@dataclass(frozen=True, eq=False)
class CompiledGrammar:
    """A checked grammar: a matcher in its start state, copied for every request."""
    start: llguidance.LLMatcher
    mask_bytes: int                  # one mask: 4 * ceil(V / 32), V the model's vocabulary
    eos_ids: frozenset[int]
    executor: llguidance.LLExecutor  # the compiler's: computes a draft chain's masks in one call


class GrammarCompiler:
    """One per gateway: the target's tokenizer (tokenizer.json) as llguidance sees it, the
    vocabulary size (the model's; ids past the tokenizer's are never allowed) and EOS ids."""

    def __init__(self, tokenizer_dir: str | Path, vocab_size: int, eos_ids: list[int]) -> None:
        self.vocab_size = vocab_size
        self.eos_ids = frozenset(eos_ids)
        self.llguidance = _llguidance()
        self.tokenizer = self.llguidance.LLTokenizer(str(Path(tokenizer_dir) / "tokenizer.json"),
                                                n_vocab=vocab_size, eos_token=list(eos_ids))
        # plan()'s masks: a thread pool of llguidance's default size (80% of the CPUs, at most
        # 32); one plan() keeps one of its threads busy, without the GIL
        self.executor = self.llguidance.LLExecutor()
        self._cache: OrderedDict[GrammarSpec, CompiledGrammar] = OrderedDict()
        self._lock = threading.Lock()

    def compile(self, spec: GrammarSpec) -> CompiledGrammar:
        """Cached (LRU, CACHE_SIZE specs); thread-safe: compiles run outside the lock (llguidance
        drops the GIL while it builds a matcher), and two threads that compiled the same spec at
        once both get the first one cached. Raises GrammarError with the compiler's message."""
        with self._lock:
            if spec in self._cache:
                self._cache.move_to_end(spec)
                return self._cache[spec]
        compiled = self._compile(spec)
        with self._lock:
            compiled = self._cache.setdefault(spec, compiled)
            while len(self._cache) > CACHE_SIZE:
                self._cache.popitem(last=False)
        return compiled

    def _compile(self, spec: GrammarSpec) -> CompiledGrammar:
        try:
            grammar = spec.llguidance_grammar()
        except GrammarError:
            raise
        except (ValueError, TypeError) as e:          # llguidance refusing its arguments
            raise GrammarError(str(e)) from None
        problem = self.llguidance.LLMatcher.validate_grammar(grammar, self.tokenizer)
        if problem:
            raise GrammarError(problem.strip())
        start = self.llguidance.LLMatcher(self.tokenizer, grammar, log_level=0)
        if start.is_error():
            raise GrammarError(start.get_error().strip())
        return CompiledGrammar(start, 4 * ((self.vocab_size + 31) // 32), self.eos_ids,
                               self.executor)


class GrammarMatcher:
    """One request's grammar state: where its committed output stands in the grammar.

    Not thread-safe: one caller at a time (the request's loop awaits each call, plan() on a
    worker thread included). Matchers of one compiled grammar are independent copies and may
    run on different threads at once (llguidance drops the GIL while it computes a mask)."""

    def __init__(self, compiled: CompiledGrammar) -> None:
        self.compiled = compiled
        self.matcher = compiled.start.deep_copy()

    @property
    def done(self) -> bool:
        """The grammar is complete: only EOS may follow (or EOS was taken). Also true after
        accept() raised (llguidance's error state), which the caller treats as a bug."""
        return self.matcher.is_stopped()

    def mask(self) -> bytes:
        """The tokens allowed next (only EOS once the grammar is complete): ceil(V / 32)
        little-endian int32 words, bit i % 32 of word i // 32 set = token i allowed. llguidance's
        own bitmask may run a word past what V needs (49152 tokens: 1537 words); that tail is
        cut."""
        raw = self.matcher.compute_bitmask()
        size = self.compiled.mask_bytes
        return raw[:size] if len(raw) >= size else raw + bytes(size - len(raw))

    def accept(self, tokens: list[int]) -> None:
        """Committed tokens (the target kept them inside the masks: a refusal is a bug). EOS is
        consumed where the grammar allows it (it completes the grammar); once the grammar is
        complete an EOS is skipped (llguidance 1.9 takes it there too; the skip does not rely
        on that)."""
        for token in tokens:
            if self.done and token in self.compiled.eos_ids:
                continue
            if not self.matcher.consume_token(token):
                raise GrammarError(f"the grammar refused committed token {token}: "
                                   f"{self.matcher.get_error()}")

    def plan(self, drafts: DraftTree) -> tuple[DraftTree, list[bytes]]:
        """For the drafts about to be verified (a chain or a tree): the nodes the grammar allows
        - a node whose token its parent's state refuses, or an EOS node, is cut with everything
        under it (a chain: before its first refused token) - and the mask of every block row
        kept: the anchor's, then each kept node's (the tokens allowed after it), in order. The
        matcher is left exactly where it was."""
        if drafts.is_chain:
            kept, masks = self._plan_chain(list(drafts.tokens))
            return DraftTree.chain(drafts.tokens[:kept]), masks
        children: dict[int, list[int]] = {}
        for i, p in enumerate(drafts.parents, start=1):
            children.setdefault(p, []).append(i)
        masks_of = {0: self.mask()}
        self._walk(drafts, children, 0, masks_of)
        kept_nodes = sorted(k for k in masks_of if k)
        index = {0: 0, **{old: new for new, old in enumerate(kept_nodes, start=1)}}
        tree = DraftTree([drafts.tokens[k - 1] for k in kept_nodes],
                         [index[drafts.parents[k - 1]] for k in kept_nodes])
        return tree, [masks_of[0], *(masks_of[k] for k in kept_nodes)]

    def _plan_chain(self, drafts: list[int]) -> tuple[int, list[bytes]]:
        """A chain: (k = the drafts the grammar allows before its first refusal or an EOS
        draft, the k + 1 masks: before d1 (the anchor's row), after d1, ..., after dk). One
        llguidance call (LLExecutor) walks d1..dk from the matcher's state, writes row i after
        d_i and rolls the walk back: up to a third cheaper than a Python loop of consume and
        mask (bench/grammar_cpu.py); it refuses rows smaller than its mask."""
        k = self.matcher.validate_tokens(drafts) if drafts else 0
        k = next((i for i, t in enumerate(drafts[:k]) if t in self.compiled.eos_ids), k)
        if k == 0:                                   # (llguidance refuses an empty walk)
            return 0, [self.mask()]
        masks = _draft_masks(self.compiled.executor, self.matcher, drafts[:k],
                             self.compiled.mask_bytes)
        if self.matcher.is_error():
            raise GrammarError(f"the grammar failed while planning {k} drafts: "
                               f"{self.matcher.get_error()}")
        return k, masks

    def _walk(self, drafts: DraftTree, children: dict[int, list[int]], node: int,
              masks: dict[int, bytes]) -> None:
        """A tree, depth first under `node` (whose mask is masks[node]): each allowed child is
        consumed, its mask taken, its subtree walked, and rolled back."""
        for child in children.get(node, ()):
            token = drafts.tokens[child - 1]
            if token in self.compiled.eos_ids or not _allows(masks[node], token):
                continue
            if not self.matcher.consume_token(token):
                raise GrammarError(f"the grammar refused draft {token} that its mask allowed: "
                                   f"{self.matcher.get_error()}")
            masks[child] = self.mask()
            self._walk(drafts, children, child, masks)
            if not self.matcher.rollback(1):
                raise GrammarError(f"the grammar could not roll back: {self.matcher.get_error()}")


def _allows(mask: bytes, token: int) -> bool:
    """Bit `token` of a mask (little-endian int32 words: byte token // 8, bit token % 8)."""
    return token // 8 < len(mask) and bool(mask[token // 8] >> (token % 8) & 1)


def _draft_masks(executor: Any, matcher: Any, drafts: list[int], mask_bytes: int) -> list[bytes]:
    """The len(drafts) + 1 masks of a walk along drafts (all allowed, at least one), rolled
    back: llguidance.numpy's one-call helper (numpy comes with it, on the first structured
    request, as llguidance does)."""
    import numpy as np
    from llguidance.numpy import fill_next_token_bitmask_par_with_draft_tokens
    rows = np.zeros((len(drafts) + 1, mask_bytes // 4), dtype=np.int32)
    fill_next_token_bitmask_par_with_draft_tokens(executor, [(matcher, 0, drafts)], rows)
    return [row.tobytes() for row in rows]
