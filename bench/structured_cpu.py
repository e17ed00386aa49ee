"""python -m bench.structured_cpu: structured output on the CPU with SmolLM2-135M-Instruct (fp32).

1. What the grammar costs in the gateway (gateway/grammar.py, llguidance, in-process): compiling
   each kind of spec (first time and cached), one token mask, and plan() - the cut and the masks
   of a 15-draft chain, which every structured step runs.
2. What it does to speculation: `dflash up` (the shipped DFlash drafter: its default chain, then
   trees of 15 with block 16) answering the same chat prompts greedily with and without a JSON
   schema, through the OpenAI API: tau (mean acceptance length, the gateway's usage), output
   tokens, seconds; whether each answer validates against its schema.

Writes bench/results/structured_cpu.json; the tables are in docs/structured-output.md.
--tiny: one schema, 12 tokens, three timing repeats (a smoke test)."""
from __future__ import annotations

import argparse
import datetime
import json
import statistics
import tempfile
import time
from pathlib import Path

from bench.report import machine
from bench.tiny import add_tiny_flag, smollm2, tiny_fields, tiny_outputs

SHORT = {"type": "string", "maxLength": 24}


def _obj(properties: dict) -> dict:
    return {"type": "object", "properties": properties, "required": list(properties),
            "additionalProperties": False}


PROMPTS = {
    "person": ("Give the name and home town of a famous scientist as JSON.",
               _obj({"name": SHORT, "address": _obj({"city": SHORT, "zip": {"type": "integer"}})})),
    "colour": ("What colour is the sky? Answer as JSON.",
               _obj({"colour": {"enum": ["red", "green", "blue"]}, "sure": {"type": "boolean"}})),
    "list": ("List some fruits as JSON.",
             _obj({"items": {"type": "array", "items": SHORT, "minItems": 2, "maxItems": 4}})),
    "numbers": ("When did the first person walk on the moon, and how sure are you? JSON.",
                _obj({"year": {"type": "integer", "minimum": 1000, "maximum": 2100},
                      "score": {"type": "number"}})),
    "book": ("Describe a famous novel as JSON with its title, author, year and three themes.",
             _obj({"title": SHORT, "author": SHORT, "year": {"type": "integer"},
                   "themes": {"type": "array", "items": SHORT, "minItems": 3, "maxItems": 3}})),
}
SPECS = {"json_schema": PROMPTS["book"][1], "json_object": None, "regex": r"\d{3}-\d{4}",
         "choice": ["Paris", "London", "Rome"], "grammar": 'start: a "!"\na: "yes" | "no"'}


def _timed(fn, repeats: int) -> float:
    """Median seconds of fn() over repeats."""
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def grammar_costs(model_dir: Path, repeats: int) -> dict:
    from gateway.grammar import GrammarCompiler, GrammarMatcher, GrammarSpec
    from runtime.draft_tree import DraftTree
    from runtime.tokenizer import ChatTokenizer
    t0 = time.perf_counter()
    compiler = GrammarCompiler(model_dir, 49152, [2])
    out = {"tokenizer_load_ms": (time.perf_counter() - t0) * 1e3, "specs": {}}
    for kind, source in SPECS.items():
        text = "" if source is None else source if isinstance(source, str) else json.dumps(source)
        spec = GrammarSpec(kind, text)
        t0 = time.perf_counter()
        compiler.compile(spec)
        first = time.perf_counter() - t0
        out["specs"][kind] = {"compile_ms": first * 1e3,
                              "cached_ms": _timed(lambda s=spec: compiler.compile(s), repeats) * 1e3}
    doc = '{"title": "Dune", "author": "Frank Herbert", "year": 1965, "themes": ["power", "'
    drafts = ChatTokenizer(model_dir).encode(doc)[:15]
    matcher = GrammarMatcher(compiler.compile(GrammarSpec("json_schema",
                                                          json.dumps(SPECS["json_schema"]))))
    out["mask_us"] = _timed(matcher.mask, repeats * 10) * 1e6
    chain = DraftTree.chain(drafts)
    out["plan_15_drafts_us"] = _timed(lambda: matcher.plan(chain), repeats) * 1e6
    out["plan_kept"] = len(matcher.plan(chain)[0].tokens)
    return out


def speculation(log_dir: Path, names: list[str], max_tokens: int, trees: tuple[int, ...]
                ) -> list[dict]:
    """Each prompt with and without its schema, on a stack per verify shape (a chain, or
    trees of the given sizes)."""
    rows = []
    for tree in trees:
        rows += _one_stack(log_dir, names, max_tokens, tree)
    return rows


def _one_stack(log_dir: Path, names: list[str], max_tokens: int, tree: int) -> list[dict]:
    import jsonschema

    from bench.gateway_cpu import StackClient
    rows = []
    with StackClient("dflash", log_dir, spec_tree_nodes=tree, block_size=16 if tree else 0) as stack:
        for name in names:
            question, schema = PROMPTS[name]
            for constrained in (False, True):
                extra = {"response_format": {"type": "json_schema", "json_schema": {
                    "name": name, "schema": schema}}} if constrained else {}
                t0 = time.perf_counter()
                r = stack.client.chat.completions.create(
                    model=stack.model, messages=[{"role": "user", "content": question}],
                    max_tokens=max_tokens, temperature=0, **extra)
                seconds = time.perf_counter() - t0
                spec = r.usage.model_extra["spec_decode"]
                row = {"prompt": name, "tree_nodes": tree, "schema": constrained,
                       "seconds": seconds, "tokens": r.usage.completion_tokens,
                       "tau": spec["mean_acceptance_length"], "draft_steps": spec["draft_steps"],
                       "finish_reason": r.choices[0].finish_reason,
                       "content": r.choices[0].message.content}
                if constrained:
                    row["valid"] = _valid(r.choices[0].message.content, schema, jsonschema)
                rows.append(row)
                print(json.dumps(row), flush=True)
    return rows


def _valid(text: str, schema: dict, jsonschema) -> bool:
    try:
        jsonschema.validate(json.loads(text), schema)
    except (ValueError, jsonschema.ValidationError):
        return False
    return True


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default="bench/results/structured_cpu.json")
    p.add_argument("--max-tokens", type=int, default=160)
    add_tiny_flag(p)
    args = p.parse_args(argv)
    tiny_outputs(args, p, "structured_cpu", ("out",))
    model_dir = smollm2()
    names = ["colour"] if args.tiny else sorted(PROMPTS)
    log_dir = Path(tempfile.mkdtemp(prefix="bench-structured-"))
    result = {"machine": machine(), "date": datetime.date.today().isoformat(),
              "command": "python -m bench.structured_cpu" + (" --tiny" if args.tiny else ""),
              "grammar": grammar_costs(model_dir, 3 if args.tiny else 20),
              "speculation": speculation(log_dir, names, 12 if args.tiny else args.max_tokens,
                                         (0,) if args.tiny else (0, 15)),
              **(tiny_fields() if args.tiny else {})}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
