"""python -m bench.gemm_table_ab [--other TABLE] [--rounds R]: the target engine's verify step
with the GEMM table `--cpu-gemm auto` measures on this host against another table, interleaved
round by round in one process (the same weights, the same load).

Two shapes of step, SmolLM2-135M-Instruct fp32 through the real TargetEngine (bench.target_cpu's
EngineBench): one sequence verifying q tokens over 256 cached ones, and q sequences of 64 cached
tokens verifying one token each in one batch. Reported: the engine step's median (forward, logits,
acceptance) per table. The default other table is what the start-up measurement chose on an Intel
Xeon with AMX before it timed the reordered oneDNN weights (`runtime/layers/linear.py`).
Writes JSON (--out). --tiny: 1 and 4 tokens, one round (a smoke test; --out defaults to a
temporary folder)."""
from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import statistics
import sys
from pathlib import Path

import torch

from bench.report import machine
from bench.target_cpu import CONTEXT, EngineBench, tokens
from bench.tiny import add_tiny_flag, smollm2, tiny_fields, tiny_outputs
from runtime.layers import linear as lin
from runtime.layers.gemm_calibration import ROWS, GemmTable
from runtime.sampling import SamplingConfig
from services.target.engine import PrefillCall

OTHER = "1:torch 2:torch 3:torch 4:torch 8:onednn 16:onednn 64:onednn"
SIZES = (1, 2, 4, 8, 16)
BATCH_CONTEXT = 64


def parse_table(text: str) -> GemmTable:
    """'1:torch 2:torch ...' (GemmTable.describe's form) -> the table; every row count named."""
    choice = {int(r): name for r, name in (item.split(":") for item in text.split())}
    if sorted(choice) != sorted(ROWS) or not set(choice.values()) <= {
            "weight_left", "onednn", "onednn_packed", "torch"}:
        raise ValueError(f"a table names a GEMM for each of {ROWS}: got {text!r}")
    return GemmTable(choice)


async def steps(bench: EngineBench, tables: dict[str, GemmTable], sizes: tuple[int, ...],
                rounds: int) -> dict[tuple[str, str, int], list[float]]:
    """(table, shape, q) -> engine-step seconds over `rounds` rounds (after one warm-up round)."""
    engine, sampling = bench.engine, SamplingConfig()
    await engine.prefill(PrefillCall("one", tokens(CONTEXT, 1), sampling, (), torch.float32))
    batch = [f"b{i}" for i in range(max(sizes))]
    for i, seq in enumerate(batch):
        await engine.prefill(PrefillCall(seq, tokens(BATCH_CONTEXT, 2 + i), sampling, (),
                                         torch.float32))
    out: dict[tuple[str, str, int], list[float]] = {}
    for k in range(rounds + 1):
        for name, table in tables.items():
            lin._table[0] = table
            for q in sizes:
                for shape, seqs, calls in (("one sequence", ["one"], [tokens(q, 3)]),
                                           ("batch", batch[:q], [tokens(1, 3)] * q)):
                    before = engine.stats.seconds
                    await asyncio.gather(*(engine.verify(s, c) for s, c in zip(seqs, calls)))
                    for s in seqs:      # on the engine thread: after the step's bookkeeping
                        await asyncio.to_thread(bench._rewind, s,
                                                CONTEXT if s == "one" else BATCH_CONTEXT)
                    if k:
                        out.setdefault((name, shape, q), []).append(engine.stats.seconds - before)
    return out


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m bench.gemm_table_ab", description=__doc__)
    p.add_argument("--other", default=OTHER, help="the table to compare with (describe's form)")
    p.add_argument("--rounds", type=int, default=14)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--out", default="bench/results/gemm_table_ab.json")
    add_tiny_flag(p)
    args = p.parse_args(argv)
    tiny_outputs(args, p, "gemm_table_ab", ("out",))
    sizes = (1, 4) if args.tiny else SIZES
    if args.tiny:
        args.rounds = 1
    bench = EngineBench(smollm2(), args.threads)
    try:
        measured = lin._table[0]
        tables = {"measured": measured, "other": parse_table(args.other)}
        samples = asyncio.run(steps(bench, tables, sizes, args.rounds))
    finally:
        bench.close()
    rows = []
    for (name, shape, q), s in sorted(samples.items(), key=lambda kv: (kv[0][1], kv[0][2])):
        rows.append({"table": name, "shape": shape, "q": q,
                     "step_median_ms": round(statistics.median(s) * 1000, 2), "n": len(s)})
    result = {"machine": machine(), "date": datetime.date.today().isoformat(),
              "command": "python -m bench.gemm_table_ab " + " ".join(argv or sys.argv[1:]),
              "tables": {k: t.describe() for k, t in tables.items()}, "rounds": args.rounds,
              "context": CONTEXT, "batch_context": BATCH_CONTEXT, "rows": rows,
              **(tiny_fields() if args.tiny else {})}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    for shape in ("one sequence", "batch"):
        for q in sizes:
            m, o = (next(r["step_median_ms"] for r in rows
                         if r["table"] == t and r["shape"] == shape and r["q"] == q)
                    for t in ("measured", "other"))
            print(f"{shape:>12} q={q:<2} measured {m:6.1f} ms  other {o:6.1f} ms  "
                  f"measured/other {m / o:.2f}")


if __name__ == "__main__":
    main()
