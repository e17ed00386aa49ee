"""python -m bench.adaptive_cpu: `--speculation auto` against every fixed choice, on this CPU.

One target and one draft (SmolLM2-135M-Instruct fp32 and the shipped DFlash drafter, as
`dflash up` runs them) and one gateway per configuration on them: autoregressive
(`--speculation 1`), every fixed chain (`--speculation B`, a verify block of B), every fixed tree
(`--speculation fixed --spec-tree-nodes N`) and auto. At each concurrency the configurations
take turns (--rounds times, the median kept), each running the same greedy requests through its
gateway's gRPC API; every configuration's output must be token-identical to the
autoregressive one's (speculation never changes greedy output). The goal (issue 33): auto >=
0.95x the best configuration at every level, and never below autoregressive.

Writes bench/results/adaptive_cpu.json, docs/adaptive_cpu.png and the "Adaptive speculation
(CPU)" section of docs/benchmarks.md. --device cuda: the same on a GPU (bf16, triton, CUDA
graphs; pass --levels 1,2,4,8,16,32 and --out/--doc/--plot elsewhere). --shape qwen3-8b: a
Qwen3-8B-shaped target with random bf16 weights and a DFlash-shaped drafter (5 layers, block 16),
chains only, whose acceptance is forced by position (--force-profile, the target's benchmark
hook: draft d accepted with probability P_d once d - 1 were; the output is not the target's, so
it is not compared; its own section). --tiny: autoregressive, one chain, one tree and auto at 1
and 2 requests, 8 tokens (a smoke test; outputs default to a temporary folder; with --shape
qwen3-8b a tiny shape of it on the CPU)."""
from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import shutil
import statistics
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import grpc

from bench.gateway_cpu import CHATS, COPY_TASKS, Services
from bench.report import add_output_flags, machine, save, write_section
from bench.tiny import add_tiny_flag, tiny_fields, tiny_outputs
from dflash.v1 import common_pb2, gateway_pb2, gateway_pb2_grpc
from services.common.ports import free_port

SECTION = "## Adaptive speculation (CPU)"
GPU_SECTION = "## Adaptive speculation (GPU)"
SHAPE_SECTION = "## Adaptive speculation (GPU, Qwen3-8B shape, forced acceptance profile)"
PROFILE = "0.95,0.9,0.9,0.85,0.85,0.8,0.8,0.75,0.7,0.65,0.6,0.55,0.5,0.45,0.4"
SMOLLM2 = ("SmolLM2-135M-Instruct {dtype}, the shipped drafter; every output token-identical to the "
           "autoregressive one")
LEVELS = (1, 2, 4, 8)
CHAINS = (2, 3, 4, 5, 6, 8, 10, 12, 16)
TREES = (7, 15, 63)
AUTO, AR = "auto", "autoregressive"


def configs(chains: tuple[int, ...], trees: tuple[int, ...]) -> dict[str, list[str]]:
    """label -> the gateway's extra flags."""
    out = {AR: ["--speculation", "1"]}
    out.update({f"chain {b}": ["--speculation", str(b)] for b in chains})
    out.update({f"tree {n}": ["--speculation", "fixed", "--spec-tree-nodes", str(n)]
                for n in trees})
    out[AUTO] = ["--speculation", "auto"]
    return out


async def run(address: str, prompts: list[list[int]], concurrency: int, max_tokens: int
              ) -> tuple[list[list[int]], float]:
    """Every prompt once, `concurrency` in flight, greedy; (outputs in prompt order, seconds)."""
    outputs: list[list[int]] = [[] for _ in prompts]
    todo = list(range(len(prompts)))
    async with grpc.aio.insecure_channel(address) as ch:
        stub = gateway_pb2_grpc.GatewayStub(ch)

        async def worker() -> None:
            while todo:
                i = todo.pop(0)
                req = gateway_pb2.GenerateRequest(
                    token_ids=gateway_pb2.TokenIds(ids=prompts[i]), max_tokens=max_tokens,
                    ignore_eos=True, sampling=common_pb2.SamplingParams(temperature=0))
                async for r in stub.Generate(req, timeout=1800):
                    outputs[i] += list(r.token_ids)

        t0 = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        return outputs, time.perf_counter() - t0


def wait_ready(http_port: int, timeout: float = 300.0) -> None:
    deadline = time.monotonic() + timeout
    while True:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{http_port}/readiness", timeout=5):
                return
        except OSError:
            if time.monotonic() > deadline:
                raise TimeoutError(f"gateway on :{http_port} not ready within {timeout} s")
            time.sleep(0.5)


def chosen(http_port: int) -> dict[str, tuple[float, float]]:
    """The auto gateway's dflash_spec_verify_tokens_chosen: shape -> (steps, sum of tokens)."""
    with urllib.request.urlopen(f"http://127.0.0.1:{http_port}/metrics", timeout=10) as r:
        text = r.read().decode()
    out: dict[str, list[float]] = {}
    for line in text.splitlines():
        for i, suffix in enumerate(("_count{", "_sum{")):
            if line.startswith("dflash_spec_verify_tokens_chosen" + suffix):
                shape = line.split('shape="')[1].split('"')[0]
                out.setdefault(shape, [0.0, 0.0])[i] = float(line.rsplit(" ", 1)[1])
    return {k: (v[0], v[1]) for k, v in out.items()}


def chosen_delta(before: dict, after: dict) -> dict[str, dict]:
    """Steps and mean verify tokens per shape between two scrapes."""
    out = {}
    for shape, (n, total) in after.items():
        n0, t0 = before.get(shape, (0.0, 0.0))
        if n > n0:
            out[shape] = {"steps": int(n - n0), "mean_tokens": round((total - t0) / (n - n0), 2)}
    return out


def measure(args: argparse.Namespace, svc: Services, prompts: list[list[int]],
            labels: dict[str, list[str]], levels: tuple[int, ...], checkpoint=None) -> dict:
    """Every level's rows; `checkpoint(rows)` after each level (a run cut short by a time limit
    keeps the levels it finished)."""
    gateways = {}
    for label, extra in labels.items():
        port, http = free_port(), free_port()
        svc.stack.add_gateway("gateway-" + label.replace(" ", "-"), port, http, *extra)
        gateways[label] = (port, http)
    for port, http in gateways.values():
        wait_ready(http)
    for port, _ in gateways.values():                                   # warm-up (auto learns)
        asyncio.run(run(f"127.0.0.1:{port}", prompts[:2], 2, args.max_tokens))
    rows, reference, auto_chosen = [], None, {}
    for c in levels:
        batch = [prompts[i % len(prompts)] for i in range(max(c, args.min_requests))]
        times: dict[str, list[float]] = {k: [] for k in labels}
        same: dict[str, int] = {}          # outputs equal to the autoregressive one's (bf16 on a
                                           # GPU is not batch-invariant: near-ties may flip)
        if args.level_warmup:     # unmeasured: a load band auto has not seen is explored here,
            for port, _ in gateways.values():        # and kernels meet the level's shapes
                asyncio.run(run(f"127.0.0.1:{port}", batch, c, args.max_tokens))
        before = chosen(gateways[AUTO][1])
        for r in range(args.rounds):
            # odd rounds in reverse order: no configuration always runs first or last (the
            # autoregressive outputs they are checked against come from round 0)
            order = list(gateways.items())[:: -1 if r % 2 else 1]
            for label, (port, _) in order:
                outputs, seconds = asyncio.run(run(f"127.0.0.1:{port}", batch, c, args.max_tokens))
                if label == AR:
                    reference = outputs
                elif outputs != reference and args.device == "cpu" and not args.force_profile:
                    raise AssertionError(f"{label} at {c} requests: output differs from the "
                                         f"autoregressive one")
                same[label] = same.get(label, 0) + sum(o == r for o, r in zip(outputs, reference))
                times[label].append(seconds)
        auto_chosen[c] = chosen_delta(before, chosen(gateways[AUTO][1]))
        tokens = len(batch) * args.max_tokens
        for label, ts in times.items():
            rows.append({"config": label, "concurrency": c, "requests": len(batch),
                         "tokens": tokens, "seconds": [round(t, 3) for t in ts],
                         "tokens_per_s": round(tokens / statistics.median(ts), 2),
                         "identical_outputs": f"{same[label]}/{len(batch) * len(ts)}"})
            print(rows[-1], flush=True)
        if checkpoint is not None:
            checkpoint(rows)
    out = summary(rows, levels)
    for s in out:
        s["auto_chosen"] = auto_chosen[s["concurrency"]]
    return {"rows": rows, "summary": out}


def summary(rows: list[dict], levels: tuple[int, ...]) -> list[dict]:
    out = []
    for c in levels:
        at = {r["config"]: r["tokens_per_s"] for r in rows if r["concurrency"] == c}
        fixed = {k: v for k, v in at.items() if k != AUTO}
        best = max(fixed, key=fixed.get)
        out.append({"concurrency": c, "auto": at[AUTO], "best": best, "best_tokens_per_s":
                    fixed[best], "autoregressive": at[AR],
                    "auto_vs_best": round(at[AUTO] / fixed[best], 3),
                    "auto_vs_autoregressive": round(at[AUTO] / at[AR], 3),
                    "met": at[AUTO] >= 0.95 * fixed[best] and at[AUTO] >= at[AR]})
    return out


def section(r: dict) -> str:
    return section_for(r.get("device", "cpu"), r.get("shape", "smollm2"))


def section_for(device: str, shape: str) -> str:
    if shape != "smollm2":
        return SHAPE_SECTION
    return GPU_SECTION if device != "cpu" else SECTION


def setup(r: dict) -> str:
    """What ran, for the section's first paragraph."""
    if r.get("shape", "smollm2") != "smollm2":
        from dflash.harness import ForcedProfile
        f = ForcedProfile(r["force_profile"])
        return (f"a Qwen3-8B-shaped target (random {r['dtype']} weights) and a DFlash-shaped drafter (5 "
                f"layers, block 16), chains only, acceptance forced by position (P_d = "
                f"{r['force_profile']}: committed tokens per step "
                + ", ".join(f"{f.expected(k):.2f} for {k} drafts" for k in (1, 3, 7, 15))
                + "); the output is not the target's (not compared)")
    same = ("outputs equal to the autoregressive one's where bf16 allows (`identical_outputs` "
            "in the JSON; bf16 on a GPU is not batch-invariant)" if r.get("device", "cpu") != "cpu"
            else "every output token-identical to the autoregressive one")
    return f"SmolLM2-135M-Instruct {r.get('dtype', 'float32')}, the shipped drafter; {same}"


def markdown(r: dict) -> str:
    m, levels = r["machine"], r["levels"]
    gpu = r.get("device", "cpu") != "cpu"
    where = (f"{r.get('gpu')} ({r['dtype']}, triton, CUDA graphs), torch {m['torch']}" if gpu
             else f"{m['cpu']}, {m['cores']} cores, torch {m['torch']}")
    lines = [section(r), "",
             (f"`{r['command']}` (results: `{r.get('json', 'bench/results/adaptive_cpu.json')}`, "
              f"plot: `{r.get('plot', 'docs/adaptive_cpu.png')}`). Machine: {where}; {r['date']}. "
              f"Output tokens/s over {r['requests_min']}+ greedy "
              f"requests of {r['max_tokens']} tokens (EOS ignored) per level through each "
              f"configuration's own gateway on one target + draft ({setup(r)}), median of "
              f"{r['rounds']} interleaved rounds"
              + (", after one unmeasured run of the level's requests through every "
                 "configuration." if r.get("level_warmup") else ".")), "",
             "| configuration | " + " | ".join(f"{c} at once" for c in levels) + " |",
             "|---|" + "---|" * len(levels)]
    by = {(row["config"], row["concurrency"]): row["tokens_per_s"] for row in r["rows"]}
    for label in dict.fromkeys(row["config"] for row in r["rows"]):
        cells = [f"{by[label, c]:.1f}" for c in levels]
        lines.append(f"| {'**auto**' if label == AUTO else label} | " + " | ".join(cells) + " |")
    lines += ["", ("| at once | auto | best fixed | auto / best (goal >= 0.95) | auto / "
                   "autoregressive (goal >= 1) | met | auto chose (steps: mean verify tokens) |"),
              "|---|---|---|---|---|---|---|"]
    for s in r["summary"]:
        picks = ", ".join(f"{k} {v['steps']}: {v['mean_tokens']:.1f}"
                          for k, v in s.get("auto_chosen", {}).items()) or "-"
        lines.append(f"| {s['concurrency']} | {s['auto']:.1f} | {s['best']} "
                     f"({s['best_tokens_per_s']:.1f}) | {s['auto_vs_best']:.2f} | "
                     f"{s['auto_vs_autoregressive']:.2f} | {'yes' if s['met'] else 'no'} | "
                     f"{picks} |")
    notes = {SECTION: NOTES, GPU_SECTION: GPU_NOTES, SHAPE_SECTION: SHAPE_NOTES}[section(r)]
    return "\n".join(lines + ["", notes]) + "\n"


NOTES = """Reading it (session 35, at b27d0a8; AMD EPYC, 2 cores): auto is 1.00, 0.98, 1.10, 0.99x
the best fixed shape and 1.09, 0.98, 1.10, 0.99x autoregressive at 1, 2, 4, 8 requests - within
0.95 of the best everywhere, but 2 % and 1 % under autoregressive at 2 and 8 (the goal says
never below: not met there, though within this machine's round-to-round spread of 5-10 %). Two
fixes since session 34, both found in the auto gateway's debug log (`--keep-logs`): (1) a
Propose's round-trip overhead is a median of serving's last few, the Verify's overhead standing
in for the untimed - the first Propose of a process (97 ms for a 19 ms forward) had been taken
whole and kept auto from drafting again in short answers; (2) a kind of Propose serving has not
timed (chains alone, when only trees ran alone) borrows its sibling's scale against the warm-up
- serving's tree Proposes alone took 0.36x the warm-up's, and chains alone, priced at the
warm-up's level (70 ms a step against 31 without drafts), never ran. At one request auto now
drafts chains of about 3 tokens (271 steps of 2.3 verify tokens) level with chain 2, the best;
at 2, 4 and 8 it hardly drafts, as autoregressive wins there on two shared cores. Runs at
almost the same code the same day show the spread: at 2f84f4c (before fix 2) 0.89, 0.81, 0.91,
0.87 of the best, where auto drafted trees of 7 at 2 requests and lost 19 %; at 914a2fc (the
same pricing, the next hour) 0.95, 0.96, 0.94, 1.01 (`bench/results/archive/`). What the debug
log also shows, for the next step: the model's price of a step without drafts at 2 requests is
about half the measured one (54 predicted against 27 tokens/s measured) - the two requests do not
stay in one batch at the target - so drafting and not drafting are compared on prices that are
both wrong; a measured period per shape and load would replace them. Earlier runs (auto / best
fixed at 1, 2, 4, 8): 0d1cc96 0.89, 0.87, 0.96, 0.97; 055be24 0.82, 0.91, 0.96, 0.97; ebf85aa
0.86, 1.05, 0.99, 1.04; 6d2b781 0.95, 0.91, 1.01, 0.81; 044dbbf 0.90, 0.77, 0.82, 0.83; e31774b
0.88, 1.01, 0.95, 0.89; a2d1727 0.89, 0.97, 0.83, 0.91; 742d993 0.91, 0.96, 0.96, 0.97.
Start-up: the target's verify cost calibration is bounded by `--cost-calibration-s` (default 1.5
s), on top of the CPU GEMM calibration (1.2-1.3 s on this EPYC); the draft's Propose curve adds
0.4 s."""

GPU_NOTES = """Reading it (session 40, at 7b351fc; an H100 - the card lent this session): still a
miss - 0.80, 0.84, 0.76, 0.87, 0.65, 0.62x the best fixed shape at 1-32 requests, 0.76-1.06x
autoregressive. Three changes since session 38 were measured in this session's runs (all on the
same H100; `bench/results/gpu/session40/`): the Propose overhead without the draft's queue wait,
a dearer Propose level believed only after 3 Proposes (propose_line.py), and each kind of step's
measured period against its price (step_period.py, this session). Run A (periods against the
newest batch decision, a moving average): 0.76, 1.01, 0.79, 0.87, 0.64, 0.69; runs B (each
request's period against the decision it ran under, a median): 0.78 / 0.68, 0.96 / 0.75, 0.89 /
0.91, 0.90 / 0.88, 0.65 / 0.62, 0.43 / 0.38; run C (the table; B plus the verify-curve fix
below). What the logs show:

- The periods do what they were built for at 1-8 requests: steps without drafts ran 1.25-1.7x
  their price, trees 1.2-2.4x, chains 0.9-1.1x (the split session 38's H200 log showed), and
  auto's choice at 4 and 8 moved from 0.79 / 0.87 to 0.89-0.91 / 0.88-0.90 in runs B.
- Runs B exposed an old fault of the verify curve: sizes serving never ran were nudged by every
  observation's ratio to the fitted curve, and where the fit pooled two observed sizes that
  ratio had a constant sign - at 16 and 32 requests, where only steps without drafts ran, the
  unrun 512-row point drifted to a chain step price of 1-400 s, and auto never drafted there.
  Fixed (cost_model.py: unrun sizes take the median ratio of serving to warm-up at the sizes
  both measured, recomputed, never compounded); run C's prices stay at 5-54 ms.
- Left: at 16 and 32 requests a chain step is still priced 35-54 ms against 23-28 ms measured
  (chains of 8 at 1,983 and 2,945 tokens/s), and at one request chains are chosen where trees
  of 63 win (chain acceptance over-estimated: auto committed 1.8 tokens a step where it expected
  2.3-2.7). At 4 requests auto ran below autoregressive while choosing no drafts 95 % of its
  steps (0.76x): a non-drafting step through a stack with a draft still captures and publishes
  the draft's features, and exploration runs the runner-up.

A later run (session 41, at 48676f8, the same H100 kind, prompt chunks now apart from the
verifies; `bench/results/gpu/session41/adaptive_gpu_h100_prompts_apart.json`, the auto gateway's
log beside it): the fixed shapes got faster at 8-32 requests (chain 6 at 8: 1,507 tokens/s,
chain 16 at 32: 3,581; autoregressive 1,332 and 2,272) and auto did not follow - 0.67, 0.91,
0.84, 0.67, 0.61, 0.53x the best fixed shape, below autoregressive at 4-32 requests (0.74-1.00x).
At 8 it chose no drafts for 387 of 419 steps and still ran 0.76x autoregressive (the rest were
trees of 64, exploring); at 16 it verified trees of about 21 in 285 of 481 steps, where chains of
6 win; at one request it mixed chains of about 6 (216 steps) with trees of 63 (59), against fixed trees
of 63 at 564 tokens/s. Each level began with auto meeting a load band it had not timed, in a
run of 8-32 requests; `--level-warmup` (on by default on a GPU since) runs every configuration
through each level once unmeasured first. Not rerun: no device could be had again that session.

The runs are short (8-32 requests of 64 tokens, one round): a fixed shape's own rate moves
10-20 % between runs (autoregressive at 4 requests: 785 and 849 tokens/s an hour apart). Earlier
GPU runs (SmolLM2, auto / best fixed at 1, 2, 4, 8, 16, 32): session 38 at 46af736 (an H200)
0.80, 0.91, 0.77, 0.66, 0.73, 0.65 (`bench/results/archive/adaptive_gpu_h200_session38.json`);
session 37 at 88921f8 (an H200, after the calibration fix only) 0.94, 0.36, 0.90, 0.77, 0.45,
0.35 (`bench/results/archive/adaptive_gpu_h200_session37.json`); its H100 run before both fixes
0.73, 0.88, 0.89, 0.71, 0.82, 0.69 (`bench/results/gpu/session37/adaptive_gpu_h100_before.json`);
session 35 at bd474d7 (an H200) 0.90, 0.81, 0.69, 0.85, 0.64, 0.48
(`bench/results/archive/adaptive_gpu_h200_session35.json`); before it 0.88, 0.85, 0.91, 1.06,
0.73, 0.72 and 0.84, 0.89, 0.66, 0.79, 0.80, 0.74."""

SHAPE_NOTES = """Reading it (session 37, at 03023bf - before the chain calibration fix; an H100): auto is at or above
autoregressive everywhere (2.4-3.9x) and chooses chains of about 14 tokens at every load, the
best fixed shapes' neighbourhood. The goal (>= 0.95x the best fixed) is met at 1, 2, 16 and 32
requests (0.98, 0.99, 0.96, 1.04) and missed at 4 and 8 (0.92, 0.84), within this one-round
run's spread: chain 12 and chain 16 should be within 1 % of each other (the target pads both
to its captured block of 16) and differ by up to 10 % between levels. This shape's chains
calibrate as one sequence up to 16 tokens and as the warm-up's eager 24 and 32 above - at c = 1
the same price as after the fix, and at higher loads auto kept drafting anyway (its acceptance
profile makes drafting win by 2-4x). The run of session 35 on an H200 (at ee68ebd):
0.93, 0.97, 0.93, 0.86, 0.97, 1.05 (`bench/results/archive/adaptive_gpu_qwen3_h200_session35.json`)."""


def plot(r: dict, out: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for label in dict.fromkeys(row["config"] for row in r["rows"]):
        pts = [(row["concurrency"], row["tokens_per_s"]) for row in r["rows"]
               if row["config"] == label]
        style = {"lw": 3, "color": "black"} if label == AUTO else {"lw": 1, "alpha": 0.6}
        ax.plot(*zip(*pts), marker="o", label=label, **style)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("requests at once")
    ax.set_ylabel("output tokens/s")
    where = r["machine"]["cpu"] if r.get("device", "cpu") == "cpu" else r.get("gpu", r["device"])
    if r.get("shape", "smollm2") != "smollm2":
        where += f", {r['shape']} shape, forced acceptance"
    ax.set_title(f"--speculation auto vs fixed sizes ({where})", fontsize=9)
    ax.legend(fontsize=6, ncol=3)
    fig.tight_layout()
    fig.savefig(out, dpi=110)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m bench.adaptive_cpu",
                                description=__doc__.splitlines()[0])
    p.add_argument("--max-tokens", type=int, default=48)
    p.add_argument("--min-requests", type=int, default=4)
    p.add_argument("--rounds", type=int, default=1)
    p.add_argument("--levels", default=",".join(map(str, LEVELS)))
    p.add_argument("--chains", default=",".join(map(str, CHAINS)))
    p.add_argument("--trees", default=",".join(map(str, TREES)))
    p.add_argument("--plot", default="docs/adaptive_cpu.png")
    p.add_argument("--device", default="cpu", help="cpu | cuda (then bf16 and triton)")
    p.add_argument("--shape", default="smollm2", choices=("smollm2", "qwen3-8b"))
    p.add_argument("--force-profile", default="",
                   help=f"--shape qwen3-8b: P1,P2,.. (default {PROFILE})")
    p.add_argument("--level-warmup", action=argparse.BooleanOptionalAction, default=None,
                   help="every configuration runs each level's requests once, unmeasured, "
                        "before its measured rounds (auto explores a load band it has not seen "
                        "there, as a long-running service would have; Triton compiles the "
                        "level's shapes). Default: on a GPU")
    p.add_argument("--keep-logs", default="",
                   help="copy the services' logs here at the end, the auto gateway's at debug "
                        "level (every batch decision with its options' prices, every timed "
                        "Propose): to read why auto chose what it did")
    add_output_flags(p, "adaptive_cpu")
    add_tiny_flag(p)
    args = p.parse_args(argv)
    tiny_outputs(args, p, "adaptive_cpu")
    if args.render_only:            # the section the JSON's run belongs to, whatever the flags
        r = json.loads(Path(args.out).read_text())
        write_section(Path(args.doc), section(r), markdown(r))
        return
    if args.level_warmup is None:
        args.level_warmup = args.device != "cpu"
    levels = tuple(int(x) for x in args.levels.split(","))
    chains = tuple(int(x) for x in args.chains.split(",") if x)
    trees = tuple(int(x) for x in args.trees.split(",") if x)
    if args.tiny:
        levels, chains, trees, args.max_tokens, args.min_requests = (1, 2), (4,), (7,), 8, 2
        args.plot = str(Path(args.out).with_suffix(".png"))
    dtype = "float32" if args.device == "cpu" else "bfloat16"
    result: dict = {"machine": machine(), "date": datetime.date.today().isoformat(),
                    "command": "python -m bench.adaptive_cpu " + " ".join(argv or sys.argv[1:]),
                    "max_tokens": args.max_tokens, "requests_min": args.min_requests,
                    "rounds": args.rounds, "level_warmup": args.level_warmup,
                    "levels": list(levels), "device": args.device,
                    "dtype": dtype, "shape": args.shape}
    if args.tiny:
        result.update(tiny_fields())
    if args.device != "cpu":
        import torch
        result["gpu"] = torch.cuda.get_device_name(args.device)
    with tempfile.TemporaryDirectory(prefix="bench-adaptive-") as tmp:
        if args.shape == "smollm2":
            prompts, options = smollm2_stack(args, dtype)
        else:
            args.force_profile = result["force_profile"] = args.force_profile or PROFILE
            trees = ()                          # forced acceptance is a chain's
            prompts, options = shaped_stack(args, dtype, Path(tmp))
        def checkpoint(rows: list[dict]) -> None:
            Path(args.out).write_text(json.dumps({**result, "rows": rows, "partial": True},
                                                 indent=1) + "\n")
        labels = configs(chains, trees)
        if args.keep_logs:
            labels[AUTO] = [*labels[AUTO], "--log-level", "debug"]
        try:
            with Services("dflash", Path(tmp) / "logs", speculation="auto", **options) as svc:
                result.update(measure(args, svc, prompts, labels, levels, checkpoint))
        finally:
            if args.keep_logs:
                shutil.copytree(Path(tmp) / "logs", args.keep_logs, dirs_exist_ok=True)
    save(result, Path(args.out), Path(args.doc), section(result), markdown)
    plot(result, Path(args.plot))
    print(markdown(result))


def smollm2_stack(args: argparse.Namespace, dtype: str) -> tuple[list[list[int]], dict]:
    """SmolLM2 as `dflash up` runs it (the shipped drafter): chat prompts, the stack's options."""
    from runtime.tokenizer import ChatTokenizer
    model_dir, options = smollm2_options(args.device, dtype)
    tok = ChatTokenizer(model_dir)
    prompts = [tok.encode(tok.apply_chat_template([{"role": "user", "content": t}]))
               for t in CHATS + COPY_TASKS]
    return prompts, options


def smollm2_options(device: str, dtype: str) -> tuple[Path, dict]:
    """SmolLM2 prepared in `dtype`, and the stack options that serve it on `device` (on a GPU:
    that checkpoint, triton, a longer start-up for the graphs; on the CPU `dflash up`'s own)."""
    from dflash.prepare.smollm2 import prepare_smollm2
    model_dir = prepare_smollm2([dtype], progress=False)[dtype]
    options = {} if device == "cpu" else {
        "device": device, "dtype": dtype, "attention_backend": "triton",
        "model_dir": str(model_dir), "ready_timeout_s": 900}
    return model_dir, options


def kv_budgets(device: str) -> tuple[str, str]:
    """The target's and the draft's --kv-budget for the Qwen3-8B shape: 40 and 6 GiB on a card
    of 120 GiB or more (an H200), else 20 and 4 GiB (on an 80 GB H100 the target's 16 GB of
    weights, 40 GiB of pages, graphs and planes came to 72 GiB and the draft's pages no longer
    fit). Either holds the benchmarks' contexts many times over."""
    import torch
    total = torch.cuda.get_device_properties(device).total_memory
    return ("40GiB", "6GiB") if total >= 120 * 2**30 else ("20GiB", "4GiB")


def shaped_stack(args: argparse.Namespace, dtype: str, root: Path
                 ) -> tuple[list[list[int]], dict]:
    """The Qwen3-8B shape (random weights; --tiny: a tiny shape of it on the CPU) with a
    DFlash-shaped drafter and the forced acceptance profile: random prompts, the options."""
    import torch

    from bench.h200_micro import QWEN3_8B, TINY, copy_tokenizer, write_model_dirs
    from dflash.harness import HookFlags
    tiny = args.device == "cpu"
    taps = [1, 2, 3, 4, 5] if tiny else [1, 9, 17, 25, 33]
    tdir, ddir = write_model_dirs(root / "models", TINY if tiny else QWEN3_8B, taps)
    copy_tokenizer(tdir)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 500, (64,), generator=g).tolist() for _ in range(32)]
    target_kv, draft_kv = ("64MiB", "32MiB") if tiny else kv_budgets(args.device)
    options = {
        "device": args.device, "dtype": dtype, "attention_backend": "torch" if tiny else "triton",
        "model_dir": str(tdir), "draft_model": str(ddir), "ready_timeout_s": 900,
        "target_args": ("--kv-budget", target_kv, "--max-block-size", "16",
                        "--graph-capture-layers", ",".join(map(str, taps)),
                        "--token-budget", "2048"),
        "draft_args": ("--kv-budget", draft_kv, "--token-budget", "8192"),
        "target_hooks": HookFlags(random_weights=True, force_profile=args.force_profile),
        "draft_hooks": HookFlags(random_weights=True)}
    return prompts, options


if __name__ == "__main__":
    main()
