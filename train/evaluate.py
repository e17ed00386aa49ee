"""`dflash eval-draft`: a drafter's acceptance length through the real engines (in-process).

For each held-out split and temperature: tau (committed tokens per verify step, bonus
included) per category, the acceptance rate at each draft position, and - at temperature 0 -
a check that the speculative output equals the target alone. Results: JSON.

--follow-up measures second turns instead: each prompt, the target's own greedy first answer
(up to --first-answer-tokens, generated speculatively: at T = 0 that is the target's output),
then a follow-up request (follow_ups.py); tau is measured on the answer to that."""
from __future__ import annotations

import argparse
import asyncio
import json
import logging
import platform
import random
import time
from collections import defaultdict
from collections.abc import Callable
from datetime import date
from pathlib import Path

from runtime.attention.registry import default_backend
from runtime.sampling import SamplingConfig
from runtime.tokenizer import ChatTokenizer
from services.draft.config import DraftConfig
from services.target.config import TargetConfig
from train.follow_ups import follow_up_prompts
from train.generate import Example, chat_prompt_ids
from train.inproc import SpecResult, speculate, start_engines

log = logging.getLogger("dflash.eval")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--target", default="", help="target directory (default: SmolLM2 fp32)")
    p.add_argument("--draft-model", default="models/smollm2-135m-instruct-dflash")
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--draft-dtype", default="", help="the drafter's dtype (default: --dtype)")
    p.add_argument("--attention-backend", default="", help="default: torch on cpu, triton on cuda")
    p.add_argument("--splits", nargs="+", default=["eval_in", "eval_unseen"])
    p.add_argument("--temperatures", nargs="+", type=float, default=[0.0, 0.7])
    p.add_argument("--per-split", type=int, default=24, help="prompts per split (0 = all)")
    p.add_argument("--max-new-tokens", type=int, default=96)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--draft-vocab", type=int, default=-1, help="the drafter's vocabulary: -1 = "
                   "its draft_vocab.json when it ships one, 0 = every token, N = its N most frequent")
    p.add_argument("--tree-nodes", type=int, default=0,
                   help="T = 0: verify a tree of this many drafts per step (0 = a chain)")
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--follow-up", action="store_true",
                   help="measure second turns: a follow-up request after the target's own "
                        "greedy answer to each prompt")
    p.add_argument("--first-answer-tokens", type=int, default=256,
                   help="with --follow-up: the first answer's length at most")
    p.add_argument("--out", default="bench/results/drafter_eval.json")


def run(args: argparse.Namespace) -> int:
    from services.common.logs import setup_logging
    setup_logging("INFO", "eval-draft")
    result = asyncio.run(evaluate(args, on_progress=lambda partial: _write(args.out, partial)))
    _write(args.out, result)
    print(json.dumps({k: v for k, v in result.items() if k != "runs"}, indent=2))
    return 0


def _write(out: str, result: dict) -> None:
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    Path(out).write_text(json.dumps(result, indent=2) + "\n")


async def evaluate(args: argparse.Namespace,
                   on_progress: Callable[[dict], None] | None = None) -> dict:
    """Every (split, temperature) run in turn. After each, on_progress gets the result so far
    ("complete": false), so a run cut short keeps what it measured."""
    from train.prompts import load_prompts
    target_dir = args.target or str(default_target(args.dtype))
    backend = args.attention_backend or default_backend(args.device)
    engines = start_engines(
        TargetConfig(model_dir=target_dir, device=args.device, dtype=args.dtype,
                     attention_backend=backend, max_block_size=max(16, args.block_size),
                     lease_seconds=3600),
        DraftConfig(target_dir=target_dir, model_dir=args.draft_model, device=args.device,
                    dtype=_draft_dtype(args), attention_backend=backend,
                    draft_vocab=args.draft_vocab, lease_seconds=3600))
    tok = ChatTokenizer(target_dir)
    eos = set(engines.target.worker.facts.eos_token_ids)
    runs: list[dict] = []
    try:
        for split in args.splits:
            prompts = load_prompts(split)
            if args.per_split:
                prompts = random.Random(args.seed).sample(prompts, min(args.per_split, len(prompts)))
            turns = await _second_turns(engines, tok, eos, split, prompts, args) \
                if args.follow_up else \
                [(r.category, chat_prompt_ids(tok, r.text)) for r in prompts]
            for temp in args.temperatures:
                runs.append(await _run_split(engines, eos, split, turns, temp, args))
                log.info("eval-draft %s T=%s: tau %.3f over %d prompts in %.0f s", split, temp,
                         runs[-1]["tau"], len(prompts), runs[-1]["seconds"])
                if on_progress is not None:
                    on_progress(_result(args, target_dir, runs, complete=False))
    finally:
        engines.stop()
    return _result(args, target_dir, runs, complete=True)


def _draft_dtype(args: argparse.Namespace) -> str:
    return args.draft_dtype or args.dtype


def _result(args: argparse.Namespace, target_dir: str, runs: list[dict], complete: bool) -> dict:
    return {"machine": platform.processor() or platform.machine(), "date": str(date.today()),
            "target": target_dir, "draft_model": args.draft_model, "dtype": args.dtype,
            "draft_dtype": _draft_dtype(args), "block_size": args.block_size,
            "tree_nodes": args.tree_nodes, "max_new_tokens": args.max_new_tokens,
            "turn": "second" if args.follow_up else "first", "complete": complete,
            "summary": [{k: r[k] for k in ("split", "temperature", "tau", "per_category",
                                           "per_position", "identical_to_target")}
                        for r in runs], "runs": runs}


async def _second_turns(engines, tok, eos, split, prompts, args) -> list[tuple[str, list[int]]]:
    """(category, chat-formatted ids) of each prompt's second turn: the prompt, the target's
    greedy answer to it (speculative at T = 0: the target's own output), a follow-up request."""
    sem = asyncio.Semaphore(args.concurrency)

    async def first(i: int, rec) -> Example:
        async with sem:
            ids = chat_prompt_ids(tok, rec.text)
            spec = await speculate(engines, f"first-{split}-{i}", ids, args.first_answer_tokens,
                                   args.block_size, SamplingConfig(temperature=0.0), eos)
            return Example(rec.id, rec.category, ids, spec.tokens, 0.0)

    answers = await asyncio.gather(*(first(i, r) for i, r in enumerate(prompts)))
    records, ids = follow_up_prompts(tok, {r.id: r.text for r in prompts}, list(answers), 0,
                                     args.seed, max_prompt=None)
    return [(r.category, i) for r, i in zip(records, ids)]


async def _run_split(engines, eos, split, turns: list[tuple[str, list[int]]], temp, args
                     ) -> dict:
    """turns: (category, chat-formatted prompt ids) of each prompt."""
    sem = asyncio.Semaphore(args.concurrency)

    async def one(i: int, turn: tuple[str, list[int]]) -> tuple[str, SpecResult, list[int] | None]:
        category, ids = turn
        async with sem:
            sampling = SamplingConfig(temperature=temp, seed=args.seed + i)
            spec = await speculate(engines, f"ev-{split}-{temp}-{i}", ids, args.max_new_tokens,
                                   args.block_size, sampling, eos, args.tree_nodes)
            alone = None
            if temp == 0.0:
                alone = (await speculate(engines, f"ar-{split}-{i}", ids, args.max_new_tokens, 1,
                                         sampling, eos)).tokens
            return category, spec, alone

    t0 = time.perf_counter()
    done = await asyncio.gather(*(one(i, t) for i, t in enumerate(turns)))
    by_cat: dict[str, list[SpecResult]] = defaultdict(list)
    for cat, spec, _ in done:
        by_cat[cat].append(spec)
    specs = [s for _, s, _ in done]
    positions = [0] * (args.block_size - 1)
    for s in specs:
        for a in s.accepted:
            for k in range(a):
                positions[k] += 1
    steps = sum(s.steps for s in specs)
    return {
        "split": split, "temperature": temp, "prompts": len(turns),
        "tau": round(_tau(specs), 3),
        "per_category": {c: round(_tau(v), 3) for c, v in sorted(by_cat.items())},
        "per_position": [round(p / max(1, steps), 4) for p in positions],
        "identical_to_target": all(a == s.tokens for _, s, a in done) if temp == 0.0 else None,
        "seconds": round(time.perf_counter() - t0, 1),
    }


def _tau(specs: list[SpecResult]) -> float:
    steps = sum(s.steps for s in specs)
    return (sum(sum(s.accepted) for s in specs) + steps) / max(1, steps)


def default_target(dtype: str) -> Path:
    from dflash.prepare.smollm2 import prepare_smollm2
    return prepare_smollm2([dtype], progress=False)[dtype]
