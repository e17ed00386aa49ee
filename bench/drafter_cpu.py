"""python -m bench.drafter_cpu: speculative decoding with the shipped DFlash drafter over the
in-process engines (no gRPC) on this CPU, for several block sizes against autoregressive
decoding, on held-out prompts (greedy). Writes bench/results/drafter_cpu.json."""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
from datetime import date
from pathlib import Path

import torch

from runtime.sampling import SamplingConfig
from runtime.tokenizer import ChatTokenizer
from services.draft.config import DraftConfig
from services.draft.training.generate import chat_prompt_ids
from services.draft.training.inproc import speculate, start_engines
from services.draft.training.prompts import load_prompts
from services.target.config import TargetConfig


async def sweep(engines, tok, prompts, blocks, max_new) -> dict:
    eos = set(engines.target.worker.facts.eos_token_ids)
    rows = {b: {"tokens": 0, "seconds": 0.0, "steps": 0, "accepted": 0} for b in blocks}
    for i, rec in enumerate(prompts):
        ids = chat_prompt_ids(tok, rec.text)
        for b in blocks:                       # interleaved: every block size sees the same load
            r = await speculate(engines, f"b{b}-{i}", ids, max_new, b, SamplingConfig(), eos)
            row = rows[b]
            row["tokens"] += len(r.tokens)
            row["seconds"] += r.seconds
            row["steps"] += r.steps
            row["accepted"] += sum(r.accepted)
    return {str(b): {"tokens_per_s": round(r["tokens"] / r["seconds"], 2),
                     "tau": round((r["accepted"] + r["steps"]) / max(1, r["steps"]), 3),
                     "ms_per_step": round(1000 * r["seconds"] / max(1, r["steps"]), 1)}
            for b, r in rows.items()}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--blocks", type=int, nargs="+", default=[1, 4, 6, 8, 16])
    ap.add_argument("--draft-model", default="models/smollm2-135m-instruct-dflash")
    ap.add_argument("--out", default="bench/results/drafter_cpu.json")
    args = ap.parse_args()
    torch.set_num_threads(2)
    from runtime.prepare.smollm2 import prepare_smollm2
    target = str(prepare_smollm2(["float32"], progress=False)["float32"])
    engines = start_engines(TargetConfig(model_dir=target, max_block_size=16),
                            DraftConfig(target_dir=target, model_dir=args.draft_model))
    prompts = random.Random(1).sample(load_prompts("eval_in"), args.prompts)
    try:
        rows = asyncio.run(sweep(engines, ChatTokenizer(target), prompts, args.blocks,
                                 args.max_new_tokens))
    finally:
        engines.stop()
    result = {"date": str(date.today()), "machine": f"{os.cpu_count()} CPUs",
              "command": "python -m bench.drafter_cpu", "prompts": args.prompts,
              "max_new_tokens": args.max_new_tokens, "by_block_size": rows}
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
