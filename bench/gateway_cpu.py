"""python -m bench.gateway_cpu [--shared]: the gateway on CPU with SmolLM2-135M-Instruct (fp32).

1. Per-step gateway overhead at concurrency 1, 8, 32: target, draft and gateway as real
   processes; requests through the gateway's gRPC API. Per verify step, from the gateway's own
   stage timings (dflash_step_seconds{stage}) and the services' handler times
   (dflash_rpc_duration_seconds{method} on their /metrics):
     wire    = (Verify round trip - target's Verify handler) + (Propose round trip - draft's
               Propose handler): serialisation, transport, gRPC on both sides, event-loop waits;
     gateway = the rest of the step inside the gateway (output rules, detokenisation, handing
               the event to the client);
     overhead = wire + gateway, i.e. everything outside the two services' handlers (their
               compute and batching queues).
   Two configurations: the shipped trained DFlash drafter (block 16, features on the wire) and
   none (autoregressive: Verify of one token).
2. End to end: `dflash up` (the launcher's Stack, default drafter) against transformers'
   `generate` on the same prompts, one request at a time, greedy, prefill included; every
   system up at once and the prompts interleaved over them, --e2e-rounds times (median per
   prompt); the stack's output is checked token-identical to transformers' greedy.

Results: bench/results/gateway_cpu.json and the "Gateway / end to end (CPU)" section of
docs/benchmarks.md. On a shared machine pass --shared: the numbers are then upper bounds.
--tiny: the same parts at concurrency 1 and 2, 8 tokens, one chat and one copy prompt, one
round, only the default drafter's stack (a smoke test; --out and --doc default to a temporary
folder)."""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import datetime
import json
import statistics
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import grpc
from prometheus_client.parser import text_string_to_metric_families

from bench.report import machine, save, write_section
from bench.tiny import add_tiny_flag, tiny_fields, tiny_outputs
from dflash.v1 import common_pb2, gateway_pb2, gateway_pb2_grpc
from services.common.ports import free_port

SECTION = "## Gateway / end to end (CPU)"
LEVELS = (1, 8, 32)
CHATS = ["Write a short story about a robot who learns to paint.",
         "Explain how photosynthesis works in simple terms.",
         "What are three good habits for staying healthy?"]
COPY_TASKS = [("Repeat this sentence word for word: The early bird catches the worm, but the "
              "second mouse gets the cheese, and the patient cat gets both of them in the end."),
              ("Write a Python function that adds two numbers, then write the same function again "
              "with a docstring."),
              ("Rewrite this list with each item on its own line: apples, bananas, cherries, dates, "
              "elderberries, figs, grapes, honeydew melons, kiwis, lemons.")]


# -- processes ---------------------------------------------------------------------------------

def scrape(port: int) -> dict[tuple[str, tuple], float]:
    """(sample name, sorted labels) -> value."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
        text = r.read().decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for f in text_string_to_metric_families(text) for s in f.samples}


def total(snapshot: dict, name: str, **labels: str) -> float:
    return sum(v for (n, lb), v in snapshot.items()
               if n == name and labels.items() <= dict(lb).items())


PREFIX_CACHING_OFF = ("--enable-prefix-caching", "off")


class Services:
    """target (+ draft) + gateway as children via the launcher's Stack, with /metrics ports."""

    def __init__(self, drafter: str, log_dir: Path, prefix_caching: bool = False,
                 **options) -> None:
        """options: further StackOptions (device, dtype, model_dir, ... for the GPU runs).
        prefix_caching: off unless asked for: the benchmarks repeat their prompts and measure
        the loop, not the cache (bench.prefix_cache measures the cache)."""
        from dflash.stack import Stack, StackOptions
        if not prefix_caching:
            for role in ("target_args", "draft_args"):
                options[role] = (*options.get(role, ()), *PREFIX_CACHING_OFF)
        self.opts = StackOptions(http_port=free_port(), port=free_port(),
                                 target_port=free_port(), draft_port=free_port(),
                                 target_metrics_port=free_port(), draft_metrics_port=free_port(),
                                 drafter=drafter, log_dir=str(log_dir), quiet=True, **options)
        self.stack = Stack(self.opts)

    def __enter__(self) -> Services:  # noqa: PYI034
        self.stack.start()
        try:
            self.stack.wait_ready()
        except BaseException:
            self.stack.stop()           # a child that died or a timeout: stop the others
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.stack.stop()

    def features_travel(self) -> list[str]:
        """What the gateway logged about the feature plane (which one the draft reads, or none)."""
        return features_travel(Path(self.opts.log_dir))

    def ahead_outcomes(self) -> dict[str, float]:
        """The draft's blocks drafted ahead so far, by outcome (empty: none, or no draft)."""
        if self.opts.drafter == "none":
            return {}
        snap = scrape(self.opts.draft_metrics_port)
        return {dict(lb)["outcome"]: v for (n, lb), v in snap.items()
                if n == "dflash_draft_ahead_blocks_total"}

    def snapshot(self) -> dict[str, dict]:
        out = {"gateway": scrape(self.opts.http_port), "target": scrape(self.opts.target_metrics_port)}
        if self.opts.drafter != "none":
            out["draft"] = scrape(self.opts.draft_metrics_port)
        return out


# -- part 1: per-step overhead ---------------------------------------------------------------
async def drive(address: str, prompts: list[list[int]], concurrency: int, max_tokens: int,
                outputs: list[list[int]] | None = None) -> tuple[int, float]:
    """Runs every prompt once with `concurrency` in flight; returns (tokens, seconds).
    outputs: filled with each prompt's output tokens, in the prompts' order."""
    queue: asyncio.Queue = asyncio.Queue()
    for i, p in enumerate(prompts):
        queue.put_nowait((i, p))
    if outputs is not None:
        outputs[:] = [[] for _ in prompts]
    produced = 0
    async with grpc.aio.insecure_channel(address) as ch:
        stub = gateway_pb2_grpc.GatewayStub(ch)

        async def worker() -> None:
            nonlocal produced
            while not queue.empty():
                i, ids = queue.get_nowait()
                req = gateway_pb2.GenerateRequest(
                    token_ids=gateway_pb2.TokenIds(ids=ids), max_tokens=max_tokens,
                    ignore_eos=True, sampling=common_pb2.SamplingParams(temperature=0))
                async for r in stub.Generate(req, timeout=1800):
                    produced += len(r.token_ids)
                    if outputs is not None:
                        outputs[i] += r.token_ids

        t0 = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        return produced, time.perf_counter() - t0


def features_travel(log_dir: Path) -> list[str]:
    """The gateways' log lines about the feature plane in log_dir (gateway*.log)."""
    return [line.split(" dflash.gateway.planes ", 1)[1].strip()
            for log in sorted(log_dir.glob("gateway*.log"))
            for line in log.read_text(errors="replace").splitlines()
            if " dflash.gateway.planes " in line]


def gemm_tables(log_dir: Path) -> dict[str, str]:
    """What `--cpu-gemm auto` chose at each model process's start-up (its log line: measured,
    or reused from the host's kept tables), by log file under log_dir."""
    out = {}
    for log in sorted(log_dir.rglob("*.log")):
        for line in log.read_text(errors="replace").splitlines():
            if (" cpu gemm calibrated " in line or " cpu gemm table reused " in line) \
                    and " table=" in line:                              # logged once
                out[str(log.relative_to(log_dir))] = line.split(' table="', 1)[1].split('"')[0]
                break
    return out


def step_breakdown(before: dict, after: dict) -> dict:
    """Per verify step, in ms, from metric deltas."""
    def d(service: str, name: str, **labels: str) -> float:
        return total(after[service], name, **labels) - total(before[service], name, **labels)

    steps = d("gateway", "dflash_step_seconds_count", stage="verify")
    per = {stage: 1000 * d("gateway", "dflash_step_seconds_sum", stage=stage) / steps
           for stage in ("draft", "verify", "gateway")}
    verify_server = 1000 * d("target", "dflash_rpc_duration_seconds_sum", method="Verify") / steps
    target_forward = 1000 * d("target", "dflash_forward_seconds_sum") / steps
    propose_server = draft_forward = 0.0
    if "draft" in after:
        propose_server = 1000 * d("draft", "dflash_rpc_duration_seconds_sum",
                                  method="Propose") / steps
        draft_forward = 1000 * d("draft", "dflash_forward_seconds_sum") / steps
    wire = (per["verify"] - verify_server) + (per["draft"] - propose_server)
    step = per["draft"] + per["verify"] + per["gateway"]
    return {"steps": int(steps), "step_ms": step, "gateway_ms": per["gateway"], "wire_ms": wire,
            "overhead_ms": wire + per["gateway"], "overhead_pct": 100 * (wire + per["gateway"]) / step,
            "verify_rpc_ms": per["verify"], "verify_handler_ms": verify_server,
            "propose_rpc_ms": per["draft"], "propose_handler_ms": propose_server,
            "target_forward_ms_incl_prefill": target_forward,
            "draft_forward_ms_incl_prefill": draft_forward}


def overhead(drafter: str, prompts: list[list[int]], max_tokens: int, min_requests: int,
             log_dir: Path, levels: tuple[int, ...] = LEVELS, **options) -> list[dict]:
    """Per concurrency level: throughput and the step's parts (options: more StackOptions)."""
    rows = []
    with Services(drafter, log_dir / f"overhead-{drafter}", **options) as svc:
        address = f"127.0.0.1:{svc.opts.port}"
        asyncio.run(drive(address, prompts[:2], 2, 8))                       # warm-up
        for c in levels:
            batch = [prompts[i % len(prompts)] for i in range(max(c, min_requests))]
            before = svc.snapshot()
            tokens, seconds = asyncio.run(drive(address, batch, c, max_tokens))
            row = {"drafter": drafter, "concurrency": c, "requests": len(batch),
                   "tokens": tokens, "seconds": seconds, "tokens_per_s": tokens / seconds,
                   **step_breakdown(before, svc.snapshot())}
            rows.append({k: round(v, 3) if isinstance(v, float) else v for k, v in row.items()})
            print(json.dumps(rows[-1]), flush=True)
    return rows


# -- part 2: end to end ----------------------------------------------------------------------
class StackClient:
    """A `dflash up` stack (the launcher's Stack) serving one request at a time through its
    OpenAI HTTP API, streamed, as users call it."""

    def __init__(self, drafter: str, log_dir: Path, **options) -> None:
        tag = "-".join([drafter, *(str(v) for v in options.values() if v)])
        self.services = Services(drafter, log_dir / f"e2e-{tag}", **options)

    def __enter__(self) -> StackClient:  # noqa: PYI034
        from openai import OpenAI
        self.services.__enter__()
        try:
            self.client = OpenAI(base_url=f"{self.services.stack.http_url}/v1", api_key="x",
                                 max_retries=0, timeout=1800)
            self.model = self.client.models.list().data[0].id
        except BaseException:
            self.services.__exit__(None, None, None)     # no stack left behind
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.services.__exit__(*exc)

    def warm(self, prompts: list[list[int]]) -> None:
        self.client.completions.create(model=self.model, prompt=prompts[0][:8], max_tokens=4)

    def run(self, ids: list[int], max_tokens: int) -> dict:
        """One greedy request, timed from sending to its last chunk (prefill included)."""
        t0 = time.perf_counter()
        ttft, usage = None, None
        for chunk in self.client.completions.create(
                model=self.model, prompt=ids, max_tokens=max_tokens, temperature=0, stream=True,
                stream_options={"include_usage": True}):
            if ttft is None and chunk.choices:
                ttft = time.perf_counter() - t0
            if chunk.usage is not None:
                usage = chunk.usage
        spec = usage.model_extra["spec_decode"]
        return {"tokens": usage.completion_tokens, "seconds": time.perf_counter() - t0,
                "ttft_s": ttft, "mean_acceptance_length": spec["mean_acceptance_length"],
                "verify_steps": spec["verify_steps"]}

    def output_ids(self, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
        """The greedy outputs as token ids (through the gRPC API, which returns ids)."""
        opts = self.services.opts
        return [_grpc_ids(f"{opts.host}:{opts.port}", ids, max_tokens)
                for ids in prompts]


def grpc_generate(address: str, ids: list[int], max_tokens: int
                  ) -> tuple[list[int], gateway_pb2.Usage | None]:
    """One greedy request through the gateway's gRPC API: (output token ids, its usage)."""
    with grpc.insecure_channel(address) as ch:
        req = gateway_pb2.GenerateRequest(token_ids=gateway_pb2.TokenIds(ids=ids),
                                          max_tokens=max_tokens,
                                          sampling=common_pb2.SamplingParams(temperature=0))
        tokens, usage = [], None
        for r in gateway_pb2_grpc.GatewayStub(ch).Generate(req, timeout=1800):
            tokens.extend(r.token_ids)
            if r.HasField("usage"):
                usage = r.usage
        return tokens, usage


def _grpc_ids(address: str, ids: list[int], max_tokens: int) -> list[int]:
    return grpc_generate(address, ids, max_tokens)[0]


class TransformersGenerate:
    """transformers' greedy `generate` in this process (cache: "" dynamic, "static";
    lookup: prompt lookup's n-gram tokens, 0 for none)."""

    def __init__(self, model_dir: Path, lookup: int = 0, device: str = "cpu",
                 dtype: str = "float32", cache: str = "") -> None:
        import torch
        from transformers import AutoModelForCausalLM
        self.torch, self.device = torch, device
        self.sync = torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)
        self.model = AutoModelForCausalLM.from_pretrained(
            str(model_dir), dtype=getattr(torch, dtype)).to(device).eval()
        self.extra: dict = {"prompt_lookup_num_tokens": lookup} if lookup else {}
        if cache:
            self.extra["cache_implementation"] = cache
        self.outputs: dict[tuple[int, ...], list[int]] = {}   # prompt -> its first output

    def __enter__(self) -> TransformersGenerate:  # noqa: PYI034
        return self

    def __exit__(self, *exc) -> None:
        pass

    def _generate(self, ids: list[int], max_new_tokens: int) -> list[int]:
        with self.torch.no_grad():
            return self.model.generate(self.torch.tensor([ids], device=self.device),
                                       max_new_tokens=max_new_tokens, do_sample=False,
                                       **self.extra)[0, len(ids):].tolist()

    def warm(self, prompts: list[list[int]]) -> None:
        for ids in prompts[:2]:
            self._generate(ids, 8)

    def run(self, ids: list[int], max_tokens: int) -> dict:
        self.sync()
        t0 = time.perf_counter()
        out = self._generate(ids, max_tokens)
        self.sync()
        seconds = time.perf_counter() - t0
        self.outputs.setdefault(tuple(ids), out)
        return {"tokens": len(out), "seconds": seconds}

    def output_ids(self, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
        """Each prompt's output from its first timed run (generated now if it never ran)."""
        return [self.outputs[tuple(ids)] if tuple(ids) in self.outputs
                else self._generate(ids, max_tokens) for ids in prompts]


def transformers_run(model_dir: Path, prompts: list[list[int]], max_tokens: int,
                     lookup: int = 0, device: str = "cpu", dtype: str = "float32",
                     cache: str = "") -> dict:
    """transformers' greedy `generate`, one prompt at a time, after a warm-up."""
    system = TransformersGenerate(model_dir, lookup, device, dtype, cache)
    system.warm(prompts)
    runs = [system.run(ids, max_tokens) for ids in prompts]
    return {"runs": runs, "output_ids": system.output_ids(prompts, max_tokens)}


def aggregate(runs: list[dict], kinds: list[str]) -> dict:
    out = {}
    for kind in ("chat", "copy", "all"):
        sel = [r for r, k in zip(runs, kinds) if kind in ("all", k)]
        out[kind] = round(sum(r["tokens"] for r in sel) / sum(r["seconds"] for r in sel), 2)
    return out


def end_to_end(model_dir: Path, drafters: list[str], max_tokens: int, log_dir: Path,
               rounds: int = 3, chats: list[str] = CHATS, copies: list[str] = COPY_TASKS) -> dict:
    """Every system up at once; each prompt runs on every system in turn (the order rotated
    from prompt to prompt), `rounds` times; a prompt's time on a system is the median of its
    rounds, so a slow spell of a shared machine hits all systems alike and is voted out."""
    from runtime.tokenizer import ChatTokenizer
    tok = ChatTokenizer(model_dir)
    texts = list(chats) + list(copies)
    kinds = ["chat"] * len(chats) + ["copy"] * len(copies)
    prompts = [tok.encode(tok.apply_chat_template([{"role": "user", "content": t}])) for t in texts]
    systems: dict = dict(stack_system(d, log_dir) for d in drafters)
    systems["transformers generate"] = TransformersGenerate(model_dir)
    systems["transformers prompt lookup (10)"] = TransformersGenerate(model_dir, lookup=10)
    names = list(systems)
    measured: dict[str, list[list[dict]]] = {n: [[] for _ in prompts] for n in names}
    with contextlib.ExitStack() as stack:
        for name in names:
            stack.enter_context(systems[name]).warm(prompts)
        for r in range(rounds):
            for i, ids in enumerate(prompts):
                k = (r * len(prompts) + i) % len(names)
                for name in names[k:] + names[:k]:
                    measured[name][i].append(systems[name].run(ids, max_tokens))
        outputs = {n: systems[n].output_ids(prompts, max_tokens) for n in names}
    result: dict = {"prompts": texts, "kinds": kinds, "max_tokens": max_tokens, "rounds": rounds,
                    "systems": {}, "gemm_tables": gemm_tables(log_dir)}
    for name in names:
        runs = [median_run(per_prompt) for per_prompt in measured[name]]
        result["systems"][name] = {
            "runs": runs, "tokens_per_s": aggregate(runs, kinds),
            "identical_to_transformers_greedy": outputs[name] == outputs["transformers generate"]}
        print(json.dumps({name: result["systems"][name]["tokens_per_s"]}), flush=True)
    return result


def stack_system(spec: str, log_dir: Path) -> tuple[str, StackClient]:
    """A system spec (system_options) -> (its label, its stack)."""
    label, drafter, options = system_options(spec)
    return label, StackClient(drafter, log_dir, **options)


def system_options(spec: str) -> tuple[str, str, dict]:
    """'DRAFTER[:DRAFT_DTYPE][,tree=N][,block=B][,speculation=S][,ahead=on|off][,gemm=G]
    [,wire=W][,deterministic]' (e.g. dflash:float32, dflash,tree=15,block=16, dflash,tree=15,
    speculation=fixed, dflash,ahead=off, dflash,gemm=torch (the target's --cpu-gemm),
    dflash,wire=socket (`dflash up --wire`), none,deterministic) -> (its label, the drafter, its
    further StackOptions)."""
    head, *opts = spec.split(",")
    drafter, _, dtype = head.partition(":")
    extra = dict(o.split("=", 1) if "=" in o else (o, "1") for o in opts)
    tree, block = int(extra.get("tree", 0)), int(extra.get("block", 0))
    speculation = extra.get("speculation", "")
    label = (f"dflash up --drafter {drafter}" + (f" --draft-dtype {dtype}" if dtype else "")
             + (f" --spec-tree-nodes {tree}" if tree else "")
             + (f" --block-size {block}" if block else "")
             + (f" --speculation {speculation}" if speculation else "")
             + (" --deterministic" if "deterministic" in extra else "")
             + (f" --wire {extra['wire']}" if "wire" in extra else "")
             + (f" (draft --draft-ahead {extra['ahead']})" if "ahead" in extra else "")
             + (f" (target --cpu-gemm {extra['gemm']})" if "gemm" in extra else ""))
    return label, drafter, {"draft_dtype": dtype, "spec_tree_nodes": tree, "block_size": block,
                            **({"speculation": speculation} if speculation else {}),
                            **({"deterministic": True} if "deterministic" in extra else {}),
                            **({"wire": extra["wire"]} if "wire" in extra else {}),
                            **({"draft_args": ("--draft-ahead", extra["ahead"])}
                               if "ahead" in extra else {}),
                            **({"target_args": ("--cpu-gemm", extra["gemm"])}
                               if "gemm" in extra else {})}


def median_run(rounds: list[dict]) -> dict:
    """One prompt's rounds on one system: the first round's record with the median seconds (and
    time to first token); every round's seconds kept. Greedy: every round has the same tokens."""
    if len({r["tokens"] for r in rounds}) != 1:
        raise RuntimeError(f"greedy rounds differ in length: {[r['tokens'] for r in rounds]}")
    run = dict(rounds[0], seconds=statistics.median(r["seconds"] for r in rounds),
               seconds_rounds=[round(r["seconds"], 4) for r in rounds])
    if "ttft_s" in run:
        run["ttft_s"] = statistics.median(r["ttft_s"] for r in rounds)
    return run


# -- report -----------------------------------------------------------------------------------
def markdown(r: dict) -> str:
    m = r["machine"]
    noisy = (" **A shared machine under load: treat these as upper bounds and rerun on a quiet "
             "one.**" if r["shared"] else "")
    lines = [SECTION, "",
             (f"`{r['command']}` (results: `bench/results/gateway_cpu.json`). Machine: {m['cpu']}, "
             f"{m['cores']} cores, torch {m['torch']}; {r['date']}; load average "
             f"{m['load_avg_start']:.1f} at start, {r['load_avg_end']:.1f} at the end. All three "
             f"processes share these cores.{noisy}"), "",
             ("**Per-step gateway overhead** (SmolLM2-135M-Instruct fp32 target; greedy, "
             f"{r['overhead_max_tokens']} tokens per request, requests through the gRPC API). "
             "Per verify step: *wire* = Verify and Propose round trips seen by the gateway minus "
             "the services' own handler times; *gateway* = the rest of the step in the gateway "
             "process; *overhead* = wire + gateway, i.e. everything outside the two services' "
             "handlers (compute and batching queues)."), "",
             ("| drafter | concurrency | step ms | target Verify handler ms | draft Propose "
             "handler ms | wire ms | gateway ms | overhead ms | overhead % | tokens/s |"),
             "|---|---|---|---|---|---|---|---|---|---|"]
    for row in r["overhead"]:
        lines.append(f"| {row['drafter']} | {row['concurrency']} | {row['step_ms']:.1f} | "
                     f"{row['verify_handler_ms']:.1f} | {row['propose_handler_ms']:.1f} | "
                     f"{row['wire_ms']:.1f} | {row['gateway_ms']:.1f} | "
                     f"{row['overhead_ms']:.1f} | {row['overhead_pct']:.1f} | "
                     f"{row['tokens_per_s']:.1f} |")
    e = r["end_to_end"]
    kinds = e.get("kinds") or ["chat"] * len(CHATS) + ["copy"] * len(COPY_TASKS)
    lines += ["", (f"**End to end**, one request at a time, greedy, up to {e['max_tokens']} new "
                  f"tokens, prefill included (`dflash up` through its OpenAI HTTP API, streamed; "
                  f"transformers `generate` in one process). Chat: {kinds.count('chat')} open "
                  f"questions; copy: {kinds.count('copy')} tasks whose answers repeat the "
                  f"prompt.{rounds_text(e)}"),
              "",
              ("| system | tokens/s chat | tokens/s copy | tokens/s all | mean acceptance length "
              "| identical to transformers greedy |"), "|---|---|---|---|---|---|"]
    for name, s in e["systems"].items():
        mal = [run["mean_acceptance_length"] for run in s["runs"] if "mean_acceptance_length" in run]
        mal_text = f"{sum(mal) / len(mal):.2f}" if mal else "-"
        tps = s["tokens_per_s"]
        lines.append(f"| {name} | {tps['chat']:.1f} | {tps['copy']:.1f} | {tps['all']:.1f} | "
                     f"{mal_text} | {'yes' if s['identical_to_transformers_greedy'] else 'NO'} |")
    return "\n".join(lines + ["", NOTES]) + "\n"


def rounds_text(e: dict) -> str:
    n = e.get("rounds", 1)
    return (f" Every system up at once; each prompt ran on every system in turn (order rotated), "
            f"{n} rounds; a prompt's time is the median of its rounds." if n > 1 else "")


NOTES = """Reading the tables: the services' handler times include their batching queues (at
concurrency 32 one target iteration serves every sequence's Verify, so each handler waits about a
whole iteration). What the gateway adds - its own work plus the round trips beyond the handlers -
is a few milliseconds per step and a few percent of it; it grows with concurrency mostly because
the three processes share two cores (event-loop and CPU waits show up as wire time). The DFlash
rows use the drafter shipped for SmolLM2 (models/smollm2-135m-instruct-dflash) with `dflash up`'s
CPU defaults: a verify block of 4 tokens (see "CPU compute" for why a verify of up to 4 tokens
costs about one decode step there), a draft of dtype auto (`--draft-dtype`: bf16 on this CPU,
whose torch computes it natively; its few-row forwards are about a third faster than in fp32,
see "Draft service (CPU)"; the `--draft-dtype float32` row is the same stack with an fp32
draft), and drafting only while one request is running, so at
concurrency 8 and 32 those rows run autoregressively (see "Speculation under load"). Prompt lookup pays off on copy-like answers
and costs a little on open chat. `dflash up` spreads one request over three processes, which
transformers in one process does not pay for; its speed over transformers comes from the engine
(oneDNN / MKL GEMM choice, one OpenMP pool per process, short idle spinning) and, on top, from
the drafter."""


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m bench.gateway_cpu",
                                description=__doc__.splitlines()[0])
    p.add_argument("--overhead-drafters", nargs="*", default=["dflash", "none"])
    p.add_argument("--overhead-max-tokens", type=int, default=32)
    p.add_argument("--min-requests", type=int, default=4, help="requests per level at least")
    p.add_argument("--e2e-drafters", nargs="*", default=[],
                   help="drafters for `dflash up`, each DRAFTER[:DRAFT_DTYPE][,tree=N][,block=B] (default: "
                        "the launcher's default, and none)")
    p.add_argument("--e2e-max-tokens", type=int, default=128)
    p.add_argument("--e2e-rounds", type=int, default=3,
                   help="rounds of every prompt on every system (median per prompt)")
    p.add_argument("--shared", action="store_true", help="note that others used the CPU")
    p.add_argument("--out", default="bench/results/gateway_cpu.json")
    p.add_argument("--doc", default="docs/benchmarks.md")
    p.add_argument("--render-only", action="store_true", help="rewrite the doc from --out")
    add_tiny_flag(p)
    args = p.parse_args(argv)
    from dflash.stack import DEFAULT_DRAFTER
    if args.e2e_rounds < 1:
        p.error(f"--e2e-rounds {args.e2e_rounds}: give at least 1 round")
    tiny_outputs(args, p, "gateway_cpu")
    levels, chats, copies = LEVELS, CHATS, COPY_TASKS
    if args.tiny:                       # every part, at the smallest size that runs it
        levels, chats, copies = (1, 2), CHATS[:1], COPY_TASKS[:1]
        args.overhead_max_tokens, args.min_requests = 8, 2
        args.e2e_max_tokens, args.e2e_rounds = 8, 1
        args.e2e_drafters = args.e2e_drafters or [DEFAULT_DRAFTER]
        if args.overhead_drafters == p.get_default("overhead_drafters"):
            args.overhead_drafters = [DEFAULT_DRAFTER]  # none: bench.spec_load_cpu --tiny
    if args.render_only:
        write_section(Path(args.doc), SECTION, markdown(json.loads(Path(args.out).read_text())))
        return
    from dflash.prepare.smollm2 import prepare_smollm2
    from runtime.tokenizer import ChatTokenizer
    model_dir = prepare_smollm2(["float32"], progress=False)["float32"]
    tok = ChatTokenizer(model_dir)
    prompts = [tok.encode(tok.apply_chat_template([{"role": "user", "content": t}]))
               for t in chats + copies]
    result: dict = {"machine": machine(), "date": datetime.date.today().isoformat(),
                    "command": "python -m bench.gateway_cpu " + " ".join(argv or sys.argv[1:]),
                    "shared": args.shared, "overhead_max_tokens": args.overhead_max_tokens,
                    "overhead": []}
    if args.tiny:
        result.update(tiny_fields())
    with tempfile.TemporaryDirectory(prefix="bench-gateway-") as tmp:
        for drafter in args.overhead_drafters:
            result["overhead"] += overhead(drafter, prompts, args.overhead_max_tokens,
                                           args.min_requests, Path(tmp), levels)
        result["end_to_end"] = end_to_end(model_dir, args.e2e_drafters or [DEFAULT_DRAFTER, "none"],
                                          args.e2e_max_tokens, Path(tmp), args.e2e_rounds,
                                          chats, copies)
    save(result, Path(args.out), Path(args.doc), SECTION, markdown)
    print(markdown(result))


if __name__ == "__main__":
    main()
