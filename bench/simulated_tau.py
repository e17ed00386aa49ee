"""python -m bench.simulated_tau --work DIR: a drafter's acceptance length simulated along the
target's cached greedy held-out answers (`WORK/{eval_in,eval_unseen}_t0.0.jsonl`, as written by
`dflash train-draft`), on a seeded random sample of each split - the measurement `train-draft`
reports at the end of training, here runnable anywhere (bf16 features by default, as in
training; --dtype float32 as the CPU engines compute them). Writes JSON to --out. --tiny: --work
defaults to a few greedy SmolLM2 answers generated on the spot (bench/tiny.py), 2 per split (a
smoke test; --out defaults to a temporary folder)."""
from __future__ import annotations

import argparse
import json
import platform
import time
from dataclasses import replace
from datetime import date
from pathlib import Path

import torch

from runtime.attention.registry import default_backend
from train.config import TrainConfig
from train.evaluate import default_target
from train.generate import load_examples, shuffled
from train.report import evaluate_splits


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--work", help="folder with the held-out greedy answers (required but with "
                    "--tiny)")
    ap.add_argument("--target", default="", help="target directory (default: SmolLM2 fp32)")
    ap.add_argument("--draft-model", default="models/smollm2-135m-instruct-dflash")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--per-split", type=int, default=128)
    ap.add_argument("--dtype", default="bfloat16", help="the target's, for the features")
    ap.add_argument("--max-new-tokens", type=int, default=0,
                    help="cut each answer to this many tokens (0 = as generated, <= 384)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default="bench/results/drafter_simulated.json")
    from bench.tiny import add_tiny_flag, greedy_answers_work, tiny_fields, tiny_outputs
    add_tiny_flag(ap)
    args = ap.parse_args(argv)
    if not args.work and not args.tiny:
        ap.error("the following arguments are required: --work")
    tiny_outputs(args, ap, "simulated_tau", ("out",))
    if args.tiny:
        args.per_split = min(args.per_split, 2)
        args.work = args.work or str(greedy_answers_work(
            Path(args.out).parent / "simulated_tau-work", per_split=args.per_split,
            target=Path(args.target) if args.target else None))
    target = args.target or str(default_target("float32"))
    held = {}
    for split in ("eval_in", "eval_unseen"):
        examples = shuffled(load_examples(Path(args.work) / f"{split}_t0.0.jsonl"), args.seed)
        if args.max_new_tokens:
            examples = [replace(e, response_ids=e.response_ids[: args.max_new_tokens])
                        for e in examples]
        held[split] = examples
    cfg = TrainConfig(target_dir=target, out_dir="", device=args.device, mask_token_id=0,
                      feature_backend=default_backend(args.device),
                      eval_sequences=args.per_split, batch_sequences=16)
    t0 = time.monotonic()
    result = evaluate_splits(cfg, Path(args.draft_model), held, getattr(torch, args.dtype))
    for r in result.values():      # a smaller verify block truncates the block: tau at B
        pp = r["per_position_acceptance"]
        r["tau_by_block"] = {str(b): round(1 + sum(pp[: b - 1]), 3) for b in (2, 3, 4, 6, 8, 16)
                             if b - 1 <= len(pp)}
    out = {"date": str(date.today()), "machine": platform.processor() or platform.machine(),
           "device": args.device, "dtype": args.dtype, "max_new_tokens": args.max_new_tokens,
           "draft_model": args.draft_model, "per_split": args.per_split,
           "seed": args.seed, "seconds": round(time.monotonic() - t0, 1), "splits": result}
    if args.tiny:
        out.update(tiny_fields(), work=args.work)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=2) + "\n")
    print(json.dumps({s: {"tau": r["tau"], "by_block": r["tau_by_block"]}
                      for s, r in result.items()}))


if __name__ == "__main__":
    main()
