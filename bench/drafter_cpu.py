"""python -m bench.drafter_cpu: the DFlash drafter through the real stack (target, draft and
gateway processes, as `dflash up` runs them) at several verify block sizes, against the same
stack without a drafter, on held-out prompts, one request at a time, greedy.

Per configuration: tokens/s (prefill included), tau (committed tokens per verify step) and the
step's parts from the services' own metrics (Verify and Propose handler times). Every output
is checked token-identical to the stack without a drafter. Writes bench/results/drafter_cpu.json.
In-process engines are not used here: two engine threads in one process each open an OpenMP
pool, which slows both (runtime/threads.py). --tiny: one prompt, 8 tokens, block 4 against no
drafter (a smoke test; --out defaults to a temporary folder)."""
from __future__ import annotations

import argparse
import json
import random
import tempfile
import time
from datetime import date
from pathlib import Path

from bench.gateway_cpu import Services, grpc_generate, step_breakdown
from bench.report import machine
from bench.tiny import add_tiny_flag, tiny_fields, tiny_outputs


def run_config(drafter: str, block: int, draft_model: str, prompts: list[list[int]],
               max_tokens: int, log_dir: Path) -> dict:
    options = {"block_size": block}
    if drafter == "dflash":
        options["draft_model"] = draft_model
    with Services(drafter, log_dir / f"{drafter}-{block}", **options) as svc:
        address = f"127.0.0.1:{svc.opts.port}"
        grpc_generate(address, prompts[0][:8], 4)                     # warm-up
        before = svc.snapshot()
        t0 = time.perf_counter()
        outputs, steps, accepted = [], 0, 0
        for ids in prompts:
            tokens, usage = grpc_generate(address, ids, max_tokens)
            outputs.append(tokens)
            steps += usage.draft_steps if drafter != "none" else len(tokens)
            accepted += usage.accepted_tokens if drafter != "none" else 0
        seconds = time.perf_counter() - t0
        parts = step_breakdown(before, svc.snapshot())
    tokens = sum(len(o) for o in outputs)
    return {"drafter": drafter, "block_size": block, "tokens": tokens,
            "seconds": round(seconds, 2), "tokens_per_s": round(tokens / seconds, 2),
            "tau": round(1 + accepted / max(1, steps), 3) if drafter != "none" else 1.0,
            **{k: round(parts[k], 2) for k in ("step_ms", "verify_handler_ms",
                                               "propose_handler_ms", "wire_ms")},
            "outputs": outputs}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompts", type=int, default=8, help="eval_in prompts (seeded sample)")
    ap.add_argument("--max-new-tokens", type=int, default=96)
    ap.add_argument("--blocks", type=int, nargs="+", default=[2, 3, 4, 6, 8, 16])
    ap.add_argument("--draft-model", default="models/smollm2-135m-instruct-dflash")
    ap.add_argument("--out", default="bench/results/drafter_cpu.json")
    add_tiny_flag(ap)
    args = ap.parse_args(argv)
    tiny_outputs(args, ap, "drafter_cpu", ("out",))
    if args.tiny:
        args.prompts, args.max_new_tokens, args.blocks = 1, 8, [4]
    from dflash.prepare.smollm2 import prepare_smollm2
    from runtime.tokenizer import ChatTokenizer
    from train.generate import chat_prompt_ids
    from train.prompts import load_prompts
    model_dir = prepare_smollm2(["float32"], progress=False)["float32"]
    tok = ChatTokenizer(model_dir)
    records = random.Random(1).sample(load_prompts("eval_in"), args.prompts)
    prompts = [chat_prompt_ids(tok, r.text) for r in records]
    rows = []
    with tempfile.TemporaryDirectory(prefix="bench-drafter-") as tmp:
        configs = [("none", 0)] + [("dflash", b) for b in args.blocks]
        for drafter, block in configs:
            rows.append(run_config(drafter, block, args.draft_model, prompts,
                                   args.max_new_tokens, Path(tmp)))
            print(json.dumps({k: v for k, v in rows[-1].items() if k != "outputs"}), flush=True)
    reference = rows[0]["outputs"]
    for r in rows:
        r["identical_to_autoregressive"] = r.pop("outputs") == reference
        r["speedup_vs_autoregressive"] = round(r["tokens_per_s"] / rows[0]["tokens_per_s"], 3)
    result = {"date": str(date.today()), "machine": machine(),
              "command": "python -m bench.drafter_cpu", "draft_model": args.draft_model,
              "prompts": args.prompts, "max_new_tokens": args.max_new_tokens, "rows": rows}
    if args.tiny:
        result.update(tiny_fields())
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
