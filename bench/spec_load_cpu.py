"""python -m bench.spec_load_cpu: when speculation stops paying on this CPU as concurrent requests
grow. The stack as `dflash up` runs it (target, draft, gateway processes), requests through the
gateway's gRPC API (greedy, fixed length), at several concurrency levels, for: the DFlash
drafter drafting at every load (--spec-disable-batch-size 0), the stack's default (drafting
stops above CPU_SPEC_DISABLE_BATCH running requests) and no drafter. Writes
bench/results/spec_load_cpu.json and its section of docs/benchmarks.md. --tiny: every
configuration but the default's (the same path with another flag) at 1 and 2 requests at once,
8 tokens each (a smoke test; --out and --doc default to a temporary folder)."""
from __future__ import annotations

import argparse
import datetime
import sys
import tempfile
from pathlib import Path

from bench.gateway_cpu import CHATS, COPY_TASKS, overhead
from bench.report import add_output_flags, machine, render_only, save
from bench.tiny import add_tiny_flag, tiny_fields, tiny_outputs

SECTION = "## Speculation under load (CPU)"
LEVELS = (1, 2, 3, 4, 8)
CONFIGS = {  # label -> (drafter, gateway --spec-disable-batch-size; -1 = the launcher's default)
    "dflash, drafting at every load": ("dflash", 0),
    "dflash, `dflash up` default": ("dflash", -1),
    "none (autoregressive)": ("none", -1),
}


def markdown(r: dict) -> str:
    m = r["machine"]
    levels = [str(c) for c in r["levels"]]
    lines = [SECTION, "",
             (f"`{r['command']}` (results: `bench/results/spec_load_cpu.json`). Machine: "
              f"{m['cpu']}, {m['cores']} cores, torch {m['torch']}; {r['date']}. Tokens/s over "
              f"all requests, {r['max_tokens']} tokens each (EOS ignored), greedy, verify block "
              f"4, through the gateway's gRPC API; `dflash up` stops drafting above "
              f"{r['cpu_spec_disable_batch']} running requests."), "",
             "| configuration | " + " | ".join(f"{c} at once" for c in levels) + " |",
             "|---|" + "---|" * len(levels)]
    for label, rows in r["configs"].items():
        by = {str(row["concurrency"]): row["tokens_per_s"] for row in rows}
        lines.append(f"| {label} | " + " | ".join(f"{by[c]:.1f}" for c in levels) + " |")
    return "\n".join(lines + ["", NOTES]) + "\n"


NOTES = """Reading the table: one request at a time, drafting pays (a 4-token verify costs about one
decode step); from two requests on, the target batches one-token verifies of several sequences,
while drafted blocks make every batch 4 rows per sequence and add a Propose per step, so drafting
costs more than it brings. The default drafts only while one request is running and tracks the
better of the two rows within the noise of this shared 2-core machine (about 10 %)."""


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m bench.spec_load_cpu",
                                description=__doc__.splitlines()[0])
    p.add_argument("--max-tokens", type=int, default=64)
    add_output_flags(p, "spec_load_cpu")
    add_tiny_flag(p)
    args = p.parse_args(argv)
    tiny_outputs(args, p, "spec_load_cpu")
    if render_only(args, SECTION, markdown):
        return
    levels, min_requests = ((1, 2), 2) if args.tiny else (LEVELS, 6)
    if args.tiny:
        args.max_tokens = 8
    from dflash.prepare.smollm2 import prepare_smollm2
    from dflash.stack import CPU_SPEC_DISABLE_BATCH
    from runtime.tokenizer import ChatTokenizer
    tok = ChatTokenizer(prepare_smollm2(["float32"], progress=False)["float32"])
    prompts = [tok.encode(tok.apply_chat_template([{"role": "user", "content": t}]))
               for t in CHATS + COPY_TASKS]
    result: dict = {"machine": machine(), "date": datetime.date.today().isoformat(),
                    "command": "python -m bench.spec_load_cpu " + " ".join(argv or sys.argv[1:]),
                    "max_tokens": args.max_tokens, "levels": list(levels),
                    "cpu_spec_disable_batch": CPU_SPEC_DISABLE_BATCH, "configs": {}}
    if args.tiny:
        result.update(tiny_fields())
    configs = {k: v for k, v in CONFIGS.items() if not (args.tiny and "default" in k)}
    with tempfile.TemporaryDirectory(prefix="bench-spec-load-") as tmp:
        for label, (drafter, limit) in configs.items():
            result["configs"][label] = overhead(drafter, prompts, args.max_tokens, min_requests,
                                                Path(tmp) / label.split(",")[0], levels,
                                                spec_disable_batch_size=limit)
    save(result, Path(args.out), Path(args.doc), SECTION, markdown)
    print(markdown(result))


if __name__ == "__main__":
    main()
