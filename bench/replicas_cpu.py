"""python -m bench.replicas_cpu: one target replica against two behind one gateway, on this CPU.

SmolLM2-135M-Instruct fp32 targets (`python -m services.target`) in two layouts: the host's
cores shared (one replica computing with every core, two with half each: what a second replica
buys on the same machine) and cores of their own (each replica pinned by taskset to
--cores-per-replica cores of its own, as a replica on its own machine or pod would be: what
scaling out buys). Each configuration's replicas sit behind their own gateway (`--target A` or
`--target A,B`: each request placed on the least-loaded replica, gateway/replicas.py), both
autoregressive (no draft) and speculative (one shared draft with the shipped DFlash drafter,
`--speculation auto`). At each concurrency the gateways take turns (--rounds times, the median
kept) with the same greedy requests through their gRPC API; every output must equal the
one-replica autoregressive output. The goal (issue 37): two target replicas >= 1.7x one at 8
concurrent requests.

Writes bench/results/replicas_cpu.json and the "Gateway replicas (CPU)" section of
docs/benchmarks.md. --tiny: 2 requests at once, 6 tokens, 1 round (a smoke test; outputs to a
temporary folder)."""
from __future__ import annotations

import argparse
import asyncio
import datetime
import os
import statistics
import sys
import tempfile
from pathlib import Path

from bench.adaptive_cpu import run as drive
from bench.adaptive_cpu import wait_ready
from bench.gateway_cpu import CHATS, COPY_TASKS, PREFIX_CACHING_OFF
from bench.report import add_output_flags, machine, render_only, save
from bench.tiny import add_tiny_flag, tiny_fields, tiny_outputs

SECTION = "## Gateway replicas (CPU)"
MODES = ("autoregressive", "speculative")
# how the replicas get their cores: "shared": the host's cores split between them (one replica
# computes with all of them, two with half each); "own": every replica pinned to cores of its
# own (taskset; --cores-per-replica each), as a replica on its own machine or pod would be
LAYOUTS = ("shared", "own")
REPLICAS = (1, 2)


def label(layout: str, replicas: int) -> str:
    return f"{replicas} replica{'s' if replicas > 1 else ''} ({layout} cores)"


REFERENCE = (label("shared", 1), MODES[0])


def placements(cores: int, per_replica: int) -> dict[str, list[tuple[int, list[str]]]]:
    """Each configuration's replicas: (compute threads, a command prefix pinning it);
    per_replica 0: the shared layout only (--tiny)."""
    out = {}
    for n in REPLICAS:
        out[label("shared", n)] = [(max(1, cores // n), [])] * n
        if per_replica and cores >= n * per_replica:
            out[label("own", n)] = [
                (per_replica, ["taskset", "-c", f"{i * per_replica}-{(i + 1) * per_replica - 1}"])
                for i in range(n)]
    return out


def start_services(model: Path, logs: Path, per_replica: int) -> tuple[dict[str, list], object]:
    """The target replicas of each configuration, and the one shared draft."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
    from support.draft_service import start_draft
    from support.procs import start_target

    from dflash.stack import SHIPPED_DRAFTER
    targets = {config: [start_target(model, logs, *PREFIX_CACHING_OFF, prefix=prefix,
                                     env={"OMP_NUM_THREADS": str(threads)})
                        for threads, prefix in replicas]
               for config, replicas in placements(os.cpu_count() or 1, per_replica).items()}
    draft = start_draft(model, logs, *PREFIX_CACHING_OFF, model_dir=SHIPPED_DRAFTER)
    return targets, draft


def start_gateways(model: Path, logs: Path, targets: dict[str, list], draft) -> dict:
    from support.gateway_stack import start_gateway
    gateways = {}
    for config, procs in targets.items():
        addresses = ",".join(p.address for p in procs)
        gateways[config, MODES[0]] = start_gateway(addresses, model, logs, "--speculation", "1")
        gateways[config, MODES[1]] = start_gateway(addresses, model, logs, draft=draft.address)
    for gw in gateways.values():
        wait_ready(gw.http_port)
    return gateways


def prompts(model: Path) -> list[list[int]]:
    from runtime.tokenizer import ChatTokenizer
    tok = ChatTokenizer(model)
    return [tok.encode(tok.apply_chat_template([{"role": "user", "content": t}]))
            for t in [*CHATS, *COPY_TASKS]]


def measure(args: argparse.Namespace, gateways: dict, chat: list[list[int]]) -> list[dict]:
    rows, reference = [], {}
    for gw in gateways.values():                                    # warm-up (auto learns)
        asyncio.run(drive(gw.address, chat[:2], 2, args.tokens))
    for c in args.levels:
        batch = [chat[i % len(chat)] for i in range(max(c, args.min_requests))]
        times: dict[tuple, list[float]] = {k: [] for k in gateways}
        for r in range(args.rounds):
            for key in list(gateways)[:: -1 if r % 2 else 1]:
                outputs, seconds = asyncio.run(drive(gateways[key].address, batch, c,
                                                     args.tokens))
                if key == REFERENCE:            # round 0 runs it first
                    reference[c] = outputs
                elif outputs != reference[c]:
                    raise AssertionError(f"{key} at {c} requests: output differs from one "
                                         f"replica's autoregressive output")
                times[key].append(seconds)
        tokens = len(batch) * args.tokens
        for (config, mode), ts in times.items():
            rows.append({"config": config, "mode": mode, "concurrency": c,
                         "requests": len(batch), "tokens": tokens,
                         "seconds": [round(t, 3) for t in ts],
                         "tokens_per_s": round(tokens / statistics.median(ts), 2)})
            print(rows[-1], flush=True)
    return rows


def summary(rows: list[dict], levels: list[int]) -> list[dict]:
    out = []
    for c in levels:
        for mode in MODES:
            at = {r["config"]: r["tokens_per_s"] for r in rows
                  if r["concurrency"] == c and r["mode"] == mode}
            for layout in LAYOUTS:
                one, two = at.get(label(layout, 1)), at.get(label(layout, 2))
                if one and two:
                    out.append({"concurrency": c, "mode": mode, "layout": layout,
                                "speedup": round(two / one, 2)})
    return out


def run(args: argparse.Namespace) -> dict:
    from dflash.prepare.smollm2 import prepare_smollm2
    model = prepare_smollm2(["float32"], progress=False)["float32"]
    chat = prompts(model)
    with tempfile.TemporaryDirectory() as tmp:
        logs = Path(tmp)
        targets, draft = start_services(model, logs, args.cores_per_replica)
        gateways = {}
        try:
            gateways = start_gateways(model, logs, targets, draft)
            rows = measure(args, gateways, chat)
        finally:
            for p in [*gateways.values(), draft, *(t for ts in targets.values() for t in ts)]:
                p.stop()
    return {"machine": machine(), "date": datetime.date.today().isoformat(),
            "command": " ".join(["python -m bench.replicas_cpu", *args.argv]),
            "placements": {c: [{"threads": t, "pinned": " ".join(p)} for t, p in reps]
                           for c, reps in placements(os.cpu_count() or 1,
                                                     args.cores_per_replica).items()},
            "cores_per_replica": args.cores_per_replica, "max_tokens": args.tokens, "rounds": args.rounds, "rows": rows,
            "summary": summary(rows, args.levels), "identical_outputs": True,
            **(tiny_fields() if args.tiny else {})}


def markdown(r: dict) -> str:
    m = r["machine"]
    setup = (f"{m['cpu']}, {m['cores']} cores, torch {m['torch']}; {r['date']}; "
             f"`{r['command']}`. SmolLM2-135M-Instruct fp32 targets behind one gateway per "
             f"configuration (`--target A` or `--target A,B`): with the host's cores shared "
             f"(one replica computing with all of them, two with half each) and with cores of "
             f"their own (each replica pinned by taskset to its own {r['cores_per_replica']} "
             f"core(s), as on its own machine); autoregressive, and speculative with one shared "
             f"draft (the shipped drafter, `--speculation auto`). Greedy requests of "
             f"{r['max_tokens']} tokens (EOS ignored), output tokens/s, median of {r['rounds']} "
             f"interleaved rounds; every output identical to one replica's autoregressive "
             f"output.")
    levels = sorted({row["concurrency"] for row in r["rows"]})
    configs = list(dict.fromkeys(row["config"] for row in r["rows"]))
    lines = [SECTION, "", setup, "",
             "| configuration | " + " | ".join(f"{c} at once" for c in levels) + " |",
             "|---|" + "---|" * len(levels)]
    for mode in MODES:
        for config in configs:
            vals = {row["concurrency"]: row["tokens_per_s"] for row in r["rows"]
                    if row["config"] == config and row["mode"] == mode}
            lines.append(f"| {config}, {mode} | "
                         + " | ".join(str(vals.get(c, "")) for c in levels) + " |")
    lines += ["", "| at once | mode | cores | 2 replicas / 1 (goal at 8: >= 1.7) |",
              "|---|---|---|---|"]
    lines += [f"| {s['concurrency']} | {s['mode']} | {s['layout']} | {s['speedup']} |"
              for s in r["summary"]]
    lines += ["", NOTES]
    return "\n".join(lines) + "\n"


NOTES = """Reading it (session 36, AMD EPYC, 2 cores): the goal (two target replicas >= 1.7x one
at 8 requests) is **not met** on this host, and cannot be: with two cores the host saturates at
about 70 tokens/s at 8 requests in every layout that keeps both cores computing (one replica
with 2 threads 70.3, two with 1 each 70.0, two pinned to a core each 68.5), so a second replica
sharing the cores buys nothing (1.00x autoregressive, 0.92x speculative: the shared draft and
the gateway then compete with two target processes). With a core of its own per replica, two
replicas run 1.36-1.38x one. The outputs of every layout equal one replica's (and
tests/test_replicas.py checks the spread: of 16 requests at once each replica takes at least 4).
An earlier run the same day with the shared layout only (`bench/results/archive/
replicas_cpu_shared_only_session36.json`): 1.07x autoregressive and 1.06x speculative at 8.

**On 16 cores** (session 37, 2026-12-06: the GPU machine's own CPU, an Intel Xeon with AMX, 16
vCPUs, torch 2.11.0+cu130 on the CPU; three runs of `python -m bench.replicas_cpu
--cores-per-replica N --levels 8 --rounds 2`, N = 4, 2, 1; JSON
`bench/results/replicas_cpu_xeon16_{4cores,2cores,1core}.json`). Output tokens/s at 8 requests;
the shared layout (one replica with 16 threads, two with 8 each) is the same configuration in
every run, the own layout pins each replica to N cores:

| run | shared: 1 / 2 replicas, autoregressive | speculative | own N cores: 1 / 2 replicas, autoregressive | speculative |
|---|---|---|---|---|
| N = 4 | 88.6 / 134.1 (**1.51x**) | 74.0 / 114.1 (**1.54x**) | 93.6 / 142.7 (**1.52x**) | 89.7 / 138.2 (**1.54x**) |
| N = 2 | 69.3 / 137.3 (**1.98x**) | 58.0 / 120.3 (**2.07x**) | 64.7 / 100.9 (**1.56x**) | 66.5 / 97.8 (**1.47x**) |
| N = 1 | 89.5 / 135.4 (**1.51x**) | 61.1 / 110.7 (**1.81x**) | 42.2 / 62.3 (**1.48x**) | 42.6 / 56.7 (**1.33x**) |

The goal is **not met** as a property of the project: 2 of the 12 ratios reach 1.7x (the shared
layout of the N = 2 run, 1.98x and 2.07x), and the same configuration measured 1.51x / 1.54x and
1.51x / 1.81x in the other two runs - its one-replica number moves from 69 to 89 tokens/s between
runs (one process with 16 threads on a 135M model), which is what the 2x rides on. Pinned to
cores of their own, two replicas give 1.33-1.56x. What the runs say about the gateway: it is not
the limit (135-143 tokens/s through one gateway in every two-replica layout, against 42-94 for
one replica); what keeps two replicas under 2x at 8 requests is that each then batches 4
instead of 8, and a CPU decode step of 4 sequences costs more than half one of 8. Each run is
short (8 requests x 48 tokens, 3-9 s per configuration, two rounds), so run to run moves 10-30 %;
a longer run (`--tokens 256 --min-requests 32`) and pinning the draft and gateway away from the
replicas' cores are the next things to try."""


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--levels", type=lambda s: [int(x) for x in s.split(",")], default=[1, 4, 8])
    p.add_argument("--tokens", type=int, default=48)
    p.add_argument("--min-requests", type=int, default=8)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--cores-per-replica", type=int, default=1, help="cores each replica is "
                   "pinned to in the 'own cores' layout (skipped where the host has too few)")
    add_output_flags(p, "replicas_cpu")
    add_tiny_flag(p)
    args = p.parse_args(argv)
    args.argv = sys.argv[1:] if argv is None else argv       # the command the JSON records
    if render_only(args, SECTION, markdown):
        return
    if args.tiny:
        args.levels, args.tokens, args.min_requests, args.rounds = [2], 6, 2, 1
        args.cores_per_replica = 0      # the shared layout only: half the processes
        tiny_outputs(args, p, "replicas_cpu")
    r = run(args)
    save(r, Path(args.out), Path(args.doc), SECTION, markdown)
    print(markdown(r))


if __name__ == "__main__":
    main()
