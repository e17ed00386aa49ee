"""python -m bench.grammar_cpu: the grammar libraries for structured output side by side on the CPU,
on SmolLM2's vocabulary (49152 tokens), each built from tokenizer.json without transformers.

For llguidance (the gateway's, through gateway/grammar.py), xgrammar and outlines-core:
- what importing it pulls in (torch, transformers, triton) and takes, in a fresh interpreter, and
  what its wheel requires;
- building its view of the tokenizer; compiling each kind of spec the gateway serves
  (json_schema, json_object, regex, choice, grammar - "unsupported" where it has none);
- one token mask along a canned JSON document (median, p90, mean, max over every position of
  --walks walks, after a warm-up walk), consuming a token, rolling 15 back;
- the plan of a 15-draft chain from several positions of the document (mask, consume, ... mask,
  roll back): what gateway/grammar.py's plan() does on every step of a structured request;
- checks: the document walks through, a complete grammar allows only EOS, rolling everything back
  gives the first mask again, which special tokens a JSON string allows, and the messages for a
  bad schema and a bad regex.
For llguidance also the gateway's own GrammarMatcher.plan (one llguidance call for a chain's
masks, LLExecutor) against that Python loop.

A library this interpreter lacks runs in --other-python (a throwaway venv: xgrammar's wheel needs
torch, transformers and triton, which the gateway's environment must not get), or is recorded as
not installed. Writes bench/results/grammar_cpu.json; findings in docs/structured-output.md.
--tiny: llguidance only, one walk (a smoke test)."""
from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

from bench.report import machine
from bench.tiny import add_tiny_flag, smollm2, tiny_fields, tiny_outputs

REPO = Path(__file__).resolve().parents[1]
LIBRARIES = {"llguidance": "llguidance", "xgrammar": "xgrammar", "outlines_core": "outlines-core"}
VOCAB, EOS, DRAFTS = 49152, 2, 15


def book(string: dict) -> dict:
    """bench/structured_cpu.py's book schema, its strings `string`."""
    return {"type": "object", "properties": {
        "title": string, "author": string, "year": {"type": "integer"},
        "themes": {"type": "array", "items": string, "minItems": 3, "maxItems": 3}},
        "required": ["title", "author", "year", "themes"], "additionalProperties": False}


BOOK = book({"type": "string", "maxLength": 24})
# the same without maxLength: llguidance's masks inside a bounded string are much slower
BOOK_FREE = book({"type": "string"})
DOC = ('{"title": "Dune", "author": "Frank Herbert", "year": 1965, "themes": ["power", '
       '"ecology", "religion"]}')
STRING_PREFIX = '{"title": "'
# kind -> what each library compiles; "grammar" is one grammar in each library's language
SPECS = {"json_schema": BOOK, "json_object": {"type": "object"}, "regex": r"\d{3}-\d{4}",
         "choice": ["Paris", "London", "Rome"],
         "grammar": {"lark": 'start: a "!"\na: "yes" | "no"', "ebnf": 'root ::= a "!"\na ::= '
                                                                     '"yes" | "no"'}}
BAD = {"json_schema": {"type": "objekt"}, "regex": "(unclosed"}


class Unsupported(Exception):
    """The library has no such kind of spec."""


class LLGuidance:
    """llguidance through the gateway's own module (compile = what the gateway pays: validation
    and the matcher; masks cut to ceil(V / 32) words)."""

    def __init__(self, model_dir: Path) -> None:
        from gateway.grammar import GrammarCompiler
        self.compiler = GrammarCompiler(model_dir, VOCAB, [EOS])

    def compile(self, kind: str, source):
        from gateway.grammar import GrammarSpec
        text = "" if kind == "json_object" else source["lark"] if kind == "grammar" else \
            source if kind == "regex" else json.dumps(source)
        return self.compiler.compile(GrammarSpec(kind, text))

    def matcher(self, compiled):
        from gateway.grammar import GrammarMatcher
        return GrammarMatcher(compiled)

    def mask(self, m) -> bytes:
        return m.mask()

    def accept(self, m, token: int) -> None:
        m.accept([token])

    def rollback(self, m, n: int) -> None:
        m.matcher.rollback(n)


class XGrammar:
    """xgrammar's TokenizerInfo from tokenizer.json's vocabulary and the metadata detection its
    from_huggingface uses (no transformers tokenizer object; importing xgrammar loads torch and
    transformers anyway)."""

    def __init__(self, model_dir: Path) -> None:
        import numpy as np
        import xgrammar as xgr
        from tokenizers import Tokenizer
        text = (model_dir / "tokenizer.json").read_text()
        encoded = [""] * VOCAB
        for token, i in Tokenizer.from_str(text).get_vocab(with_added_tokens=True).items():
            encoded[i] = token
        meta = xgr.TokenizerInfo._detect_metadata_from_hf(text)
        info = xgr.TokenizerInfo(encoded, vocab_type=meta["vocab_type"], vocab_size=VOCAB,
                                 stop_token_ids=[EOS], add_prefix_space=meta["add_prefix_space"])
        self.xgr, self.buf = xgr, np.zeros((1, (VOCAB + 31) // 32), dtype=np.int32)
        self.compiler = xgr.GrammarCompiler(info, max_threads=os.cpu_count() or 1,
                                            cache_enabled=False)

    def compile(self, kind: str, source):
        c = self.compiler
        if kind in ("json_schema", "json_object"):
            return c.compile_json_schema(json.dumps(source), any_whitespace=False)
        if kind == "regex":
            return c.compile_regex(source)
        if kind == "choice":
            return c.compile_grammar("root ::= " + " | ".join(json.dumps(s) for s in source))
        return c.compile_grammar(source["ebnf"])

    def matcher(self, compiled):
        return self.xgr.GrammarMatcher(compiled)

    def mask(self, m) -> bytes:
        m.fill_next_token_bitmask(self.buf)
        return self.buf.tobytes()

    def accept(self, m, token: int) -> None:
        if not m.accept_token(token):
            raise ValueError(f"xgrammar refused token {token}")

    def rollback(self, m, n: int) -> None:
        m.rollback(n)


def _byte_decoder() -> dict[str, int]:
    """GPT-2's byte-level alphabet, character -> byte (the tokenizer's ByteLevel pre-tokenizer)."""
    bs = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1),
          *range(ord("®"), ord("ÿ") + 1)]
    cs, extra = bs[:], 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + extra)
            extra += 1
    return {chr(c): b for b, c in zip(bs, cs)}


class OutlinesCore:
    """outlines-core: a regex DFA index over the vocabulary (tokens as bytes, special tokens
    left out); JSON schemas become regexes; no context-free grammars."""

    def __init__(self, model_dir: Path) -> None:
        import numpy as np
        import outlines_core
        from tokenizers import Tokenizer
        tok = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
        special = {t.content for t in tok.get_added_tokens_decoder().values() if t.special}
        decode, vocab = _byte_decoder(), {}
        for token, i in tok.get_vocab(with_added_tokens=True).items():
            if token not in special:
                vocab.setdefault(bytes(decode[c] for c in token), []).append(i)
        self.oc, self.buf = outlines_core, np.zeros((VOCAB + 31) // 32, dtype=np.int32)
        self.vocabulary = outlines_core.Vocabulary(EOS, vocab)

    def compile(self, kind: str, source):
        if kind == "grammar":
            raise Unsupported("no context-free grammars (regular languages only)")
        if kind in ("json_schema", "json_object"):
            source = self.oc.json_schema.build_regex_from_schema(json.dumps(source))
        elif kind == "choice":
            source = "(" + "|".join(re.escape(s) for s in source) + ")"
        return self.oc.Index(source, self.vocabulary)

    def matcher(self, compiled):
        return self.oc.Guide(compiled, max_rollback=64)

    def mask(self, m) -> bytes:
        m.write_mask_into(self.buf.ctypes.data, self.buf.size, 4)
        return self.buf.tobytes()

    def accept(self, m, token: int) -> None:
        m.advance(token, return_tokens=False)

    def rollback(self, m, n: int) -> None:
        m.rollback_state(n)


ADAPTERS = {"llguidance": LLGuidance, "xgrammar": XGrammar, "outlines_core": OutlinesCore}


def _ms(t0: float) -> float:
    return (time.perf_counter() - t0) * 1e3


def _stats_us(seconds: list[float]) -> dict:
    s = sorted(seconds)
    return {"median": statistics.median(s) * 1e6, "p90": s[int(0.9 * (len(s) - 1))] * 1e6,
            "mean": statistics.fmean(s) * 1e6, "max": s[-1] * 1e6, "n": len(s)}


def _allowed(mask: bytes) -> list[int]:
    return [i for i in range(VOCAB) if mask[i // 8] >> (i % 8) & 1]


def import_facts(library: str, python: str) -> dict:
    """Importing the library in a fresh interpreter: seconds, and whether torch, transformers or
    triton came with it; its version and what its wheel requires."""
    code = (f"import json, sys, time, importlib.metadata as md\nt = time.perf_counter()\n"
            f"import {library}\ns = time.perf_counter() - t\nprint(json.dumps({{'seconds': s, "
            f"'loads': [m for m in ('torch', 'transformers', 'triton') if m in sys.modules], "
            f"'version': md.version({LIBRARIES[library]!r}), "
            f"'requires': md.requires({LIBRARIES[library]!r}) or []}}))")
    done = subprocess.run([python, "-c", code], capture_output=True, text=True, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def compile_costs(lib) -> tuple[dict, dict]:
    """kind -> first-compile ms (or "unsupported: ..."); the compiled grammars."""
    costs, compiled = {}, {}
    for kind, source in SPECS.items():
        t0 = time.perf_counter()
        try:
            compiled[kind] = lib.compile(kind, source)
        except Unsupported as e:
            costs[kind] = f"unsupported: {e}"
            continue
        costs[kind] = _ms(t0)
    return costs, compiled


def error_messages(lib) -> dict:
    out = {}
    for kind, source in BAD.items():
        try:
            lib.compile(kind, source)
            out[kind] = "(compiled: no error)"
        except (ValueError, RuntimeError) as e:  # GrammarError, xgrammar, outlines-core
            out[kind] = f"{type(e).__name__}: {str(e).strip()[:300]}"
    return out


def walk(lib, compiled, doc: list[int], walks: int) -> dict:
    """Mask then consume along the document, `walks` times after a warm-up walk; checks."""
    masks, consumes, first, ok = [], [], None, True
    for w in range(walks + 1):
        m = lib.matcher(compiled)
        for token in doc:
            t0 = time.perf_counter()
            mask = lib.mask(m)
            t1 = time.perf_counter()
            ok = ok and bool(mask[token // 8] >> (token % 8) & 1)
            lib.accept(m, token)
            t2 = time.perf_counter()
            first = first or mask
            if w:
                masks.append(t1 - t0)
                consumes.append(t2 - t1)
    end = _allowed(lib.mask(m))
    t0 = time.perf_counter()
    lib.rollback(m, DRAFTS)
    rollback_us = (time.perf_counter() - t0) * 1e6
    lib.rollback(m, len(doc) - DRAFTS)
    return {"mask_us": _stats_us(masks), "consume_us": _stats_us(consumes)["mean"],
            "rollback_15_us": rollback_us, "document_walks_through": ok,
            "only_eos_when_complete": end == [EOS], "rollback_all_gives_the_first_mask":
            lib.mask(m) == first}


def plan_costs(lib, compiled, doc: list[int], repeats: int) -> dict:
    """The plan of a DRAFTS-token chain (all valid) from several anchors of the document."""
    times = []
    for anchor in (0, 8, 16, len(doc) - DRAFTS):
        m = lib.matcher(compiled)
        for token in doc[:anchor]:
            lib.accept(m, token)
        drafts = doc[anchor:anchor + DRAFTS]
        for _ in range(repeats):
            t0 = time.perf_counter()
            lib.mask(m)
            for token in drafts:
                lib.accept(m, token)
                lib.mask(m)
            lib.rollback(m, len(drafts))
            times.append(time.perf_counter() - t0)
    return {"plan_15_us": _stats_us(times)}


def special_in_a_string(lib, compiled, encode) -> list[int]:
    """The special tokens (ids 0-16 in SmolLM2) a JSON string allows: none should be."""
    m = lib.matcher(compiled)
    for token in encode(STRING_PREFIX):
        lib.accept(m, token)
    mask = lib.mask(m)
    return [i for i in range(17) if mask[i // 8] >> (i % 8) & 1]


def gateway_plan(lib: LLGuidance, compiled, doc: list[int], repeats: int) -> dict:
    """The gateway's own GrammarMatcher.plan on the same chains as plan_costs (validate the
    drafts, then one llguidance call for all the masks, rolled back): against plan_15_us, the
    Python loop of mask and consume, what that one call saves."""
    from runtime.draft_tree import DraftTree
    times = []
    for anchor in (0, 8, 16, len(doc) - DRAFTS):
        m = lib.matcher(compiled)
        m.accept(doc[:anchor])
        drafts = DraftTree.chain(doc[anchor:anchor + DRAFTS])
        for _ in range(repeats):
            t0 = time.perf_counter()
            kept, _ = m.plan(drafts)
            times.append(time.perf_counter() - t0)
            assert kept.tokens == drafts.tokens
    return {"gateway_plan_15_us": _stats_us(times)}


def measure(library: str, model_dir: Path, walks: int) -> dict:
    """Everything but the import facts, for one library in this interpreter (imported before
    the clock starts)."""
    from tokenizers import Tokenizer
    __import__(library)
    tok = Tokenizer.from_file(str(model_dir / "tokenizer.json"))

    def encode(text: str) -> list[int]:
        return tok.encode(text, add_special_tokens=False).ids

    doc = encode(DOC)
    t0 = time.perf_counter()
    lib = ADAPTERS[library](model_dir)
    out = {"tokenizer_ms": _ms(t0)}
    out["compile_ms"], compiled = compile_costs(lib)
    t0 = time.perf_counter()
    free = lib.compile("json_schema", BOOK_FREE)
    out["compile_ms"]["json_schema, strings without maxLength"] = _ms(t0)
    out["errors"] = error_messages(lib)
    out["special_tokens_allowed_in_a_string"] = special_in_a_string(lib, free, encode)
    out["documents"] = {}
    for name, grammar in (("strings maxLength 24", compiled["json_schema"]),
                          ("strings without maxLength", free)):
        row = {**walk(lib, grammar, doc, walks), **plan_costs(lib, grammar, doc, 5 * walks)}
        if library == "llguidance":
            row.update(gateway_plan(lib, grammar, doc, 5 * walks))
        out["documents"][name] = row
    out["document_tokens"] = len(doc)
    return out


def run_library(library: str, model_dir: Path, args: argparse.Namespace) -> dict:
    """In this interpreter when it has the library, else in --other-python, else not run."""
    try:
        __import__(library)
        python = sys.executable
    except ImportError:
        python = args.other_python
    if not python:
        return {"available": False, "why": "not installed in this interpreter (see "
                                           "--other-python)"}
    facts = {"available": True, "python": python, "import": import_facts(library, python)}
    if python == sys.executable:
        return {**facts, **measure(library, model_dir, args.walks)}
    done = subprocess.run([python, "-m", "bench.grammar_cpu", "--only", library,
                           "--model-dir", str(model_dir), "--walks", str(args.walks)],
                          cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)},
                          capture_output=True, text=True, check=True)
    return {**facts, **json.loads(done.stdout.strip().splitlines()[-1])}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m bench.grammar_cpu",
                                description=__doc__.splitlines()[0])
    p.add_argument("--out", default="bench/results/grammar_cpu.json")
    p.add_argument("--walks", type=int, default=5, help="timed walks along the document")
    p.add_argument("--other-python", default="",
                   help="an interpreter that has the libraries this one lacks (a throwaway venv)")
    p.add_argument("--only", choices=sorted(LIBRARIES), help=argparse.SUPPRESS)
    p.add_argument("--model-dir", help=argparse.SUPPRESS)
    add_tiny_flag(p)
    args = p.parse_args(argv)
    if args.only:                                    # the --other-python side: JSON on stdout
        print(json.dumps(measure(args.only, Path(args.model_dir), args.walks)))
        return
    tiny_outputs(args, p, "grammar_cpu", ("out",))
    if args.tiny:
        args.walks = 1
    model_dir = smollm2()
    names = ["llguidance"] if args.tiny else list(LIBRARIES)
    result = {"machine": machine(), "date": datetime.date.today().isoformat(),
              "command": " ".join(["python -m bench.grammar_cpu", *(argv or sys.argv[1:])]),
              "vocab_size": VOCAB, "drafts": DRAFTS, "walks": args.walks,
              "libraries": {name: run_library(name, model_dir, args) for name in names},
              **(tiny_fields({"xgrammar, outlines_core": "--tiny runs llguidance only"})
                 if args.tiny else {})}
    result["load_avg_end"] = os.getloadavg()[0]
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps({k: v for k, v in result.items() if k != "libraries"}))
    for name, lib in result["libraries"].items():
        print(name, json.dumps({k: lib.get(k) for k in ("import", "tokenizer_ms", "compile_ms")}))
        for doc, row in lib.get("documents", {}).items():
            line = {k: round(v["median"], 1) for k, v in row.items() if isinstance(v, dict)}
            print(f"  {doc}: medians {line}")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
