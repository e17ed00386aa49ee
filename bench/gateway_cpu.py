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
   `generate` on the same prompts, one request at a time, greedy, prefill included; the stack's
   output is checked token-identical to transformers' greedy.

Results: bench/results/gateway_cpu.json and the "Gateway / end to end (CPU)" section of
docs/benchmarks.md. On a shared machine pass --shared: the numbers are then upper bounds."""
from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import grpc
from prometheus_client.parser import text_string_to_metric_families

from bench.report import machine, save, write_section
from dflash.v1 import common_pb2, gateway_pb2, gateway_pb2_grpc

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
def free_port() -> int:
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def scrape(port: int) -> dict[tuple[str, tuple], float]:
    """(sample name, sorted labels) -> value."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
        text = r.read().decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for f in text_string_to_metric_families(text) for s in f.samples}


def total(snapshot: dict, name: str, **labels: str) -> float:
    return sum(v for (n, lb), v in snapshot.items()
               if n == name and labels.items() <= dict(lb).items())


class Services:
    """target (+ draft) + gateway as children via the launcher's Stack, with /metrics ports."""

    def __init__(self, drafter: str, log_dir: Path, **options) -> None:
        """options: further StackOptions (device, dtype, model_dir, ... for the GPU runs)."""
        from gateway.launcher import Stack, StackOptions
        self.opts = StackOptions(http_port=free_port(), port=free_port(),
                                 target_port=free_port(), draft_port=free_port(),
                                 target_metrics_port=free_port(), draft_metrics_port=free_port(),
                                 drafter=drafter, log_dir=str(log_dir), quiet=True, **options)
        self.stack = Stack(self.opts)

    def __enter__(self) -> Services:  # noqa: PYI034
        self.stack.start()
        self.stack.wait_ready()
        return self

    def __exit__(self, *exc) -> None:
        self.stack.stop()

    def snapshot(self) -> dict[str, dict]:
        out = {"gateway": scrape(self.opts.http_port), "target": scrape(self.opts.target_metrics_port)}
        if self.opts.drafter != "none":
            out["draft"] = scrape(self.opts.draft_metrics_port)
        return out


# -- part 1: per-step overhead ---------------------------------------------------------------
async def drive(address: str, prompts: list[list[int]], concurrency: int, max_tokens: int
                ) -> tuple[int, float]:
    """Runs every prompt once with `concurrency` in flight; returns (tokens, seconds)."""
    queue: asyncio.Queue = asyncio.Queue()
    for p in prompts:
        queue.put_nowait(p)
    produced = 0
    async with grpc.aio.insecure_channel(address) as ch:
        stub = gateway_pb2_grpc.GatewayStub(ch)

        async def worker() -> None:
            nonlocal produced
            while not queue.empty():
                ids = queue.get_nowait()
                req = gateway_pb2.GenerateRequest(
                    token_ids=gateway_pb2.TokenIds(ids=ids), max_tokens=max_tokens,
                    ignore_eos=True, sampling=common_pb2.SamplingParams(temperature=0))
                async for r in stub.Generate(req, timeout=1800):
                    produced += len(r.token_ids)

        t0 = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        return produced, time.perf_counter() - t0


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
def stack_run(drafter: str, prompts: list[list[int]], max_tokens: int, log_dir: Path,
              **options) -> dict:
    """One request at a time through the OpenAI HTTP API (streamed), as `dflash up` serves."""
    from openai import OpenAI
    with Services(drafter, log_dir / f"e2e-{drafter}", **options) as svc:
        client = OpenAI(base_url=f"{svc.stack.http_url}/v1", api_key="x", max_retries=0,
                        timeout=1800)
        model = client.models.list().data[0].id
        client.completions.create(model=model, prompt=prompts[0][:8], max_tokens=4)   # warm-up
        runs = []
        for ids in prompts:
            t0 = time.perf_counter()
            ttft, usage = None, None
            for chunk in client.completions.create(model=model, prompt=ids, max_tokens=max_tokens,
                                                   temperature=0, stream=True,
                                                   stream_options={"include_usage": True}):
                if ttft is None and chunk.choices:
                    ttft = time.perf_counter() - t0
                if chunk.usage is not None:
                    usage = chunk.usage
            spec = usage.model_extra["spec_decode"]
            runs.append({"tokens": usage.completion_tokens, "seconds": time.perf_counter() - t0,
                         "ttft_s": ttft, "mean_acceptance_length": spec["mean_acceptance_length"],
                         "verify_steps": spec["verify_steps"]})
        ids_out = [_grpc_ids(f"127.0.0.1:{svc.opts.port}", ids, max_tokens) for ids in prompts]
    return {"runs": runs, "output_ids": ids_out}


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


def transformers_run(model_dir: Path, prompts: list[list[int]], max_tokens: int,
                     lookup: int = 0, device: str = "cpu", dtype: str = "float32",
                     cache: str = "") -> dict:
    """transformers' greedy `generate`, one prompt at a time (cache: "" dynamic, "static")."""
    import torch
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=getattr(torch, dtype)
                                                 ).to(device).eval()
    extra = {"prompt_lookup_num_tokens": lookup} if lookup else {}
    if cache:
        extra["cache_implementation"] = cache
    sync = torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)
    runs, outputs = [], []
    with torch.no_grad():
        for warm in prompts[:2]:
            model.generate(torch.tensor([warm], device=device), max_new_tokens=8,
                           do_sample=False, **extra)
        for ids in prompts:
            sync()
            t0 = time.perf_counter()
            out = model.generate(torch.tensor([ids], device=device), max_new_tokens=max_tokens,
                                 do_sample=False, **extra)[0, len(ids):].tolist()
            sync()
            runs.append({"tokens": len(out), "seconds": time.perf_counter() - t0})
            outputs.append(out)
    return {"runs": runs, "output_ids": outputs}


def aggregate(runs: list[dict], kinds: list[str]) -> dict:
    out = {}
    for kind in ("chat", "copy", "all"):
        sel = [r for r, k in zip(runs, kinds) if kind in ("all", k)]
        out[kind] = round(sum(r["tokens"] for r in sel) / sum(r["seconds"] for r in sel), 2)
    return out


def end_to_end(model_dir: Path, drafters: list[str], max_tokens: int, log_dir: Path) -> dict:
    from runtime.tokenizer import ChatTokenizer
    tok = ChatTokenizer(model_dir)
    texts = CHATS + COPY_TASKS
    kinds = ["chat"] * len(CHATS) + ["copy"] * len(COPY_TASKS)
    prompts = [tok.encode(tok.apply_chat_template([{"role": "user", "content": t}])) for t in texts]
    result: dict = {"prompts": texts, "kinds": kinds, "max_tokens": max_tokens, "systems": {}}
    for drafter in drafters:
        r = stack_run(drafter, prompts, max_tokens, log_dir)
        result["systems"][f"dflash up --drafter {drafter}"] = r
        print(json.dumps({drafter: aggregate(r["runs"], kinds)}), flush=True)
    for name, lookup in (("transformers generate", 0), ("transformers prompt lookup (10)", 10)):
        r = transformers_run(model_dir, prompts, max_tokens, lookup)
        result["systems"][name] = r
        print(json.dumps({name: aggregate(r["runs"], kinds)}), flush=True)
    reference = result["systems"]["transformers generate"]["output_ids"]
    for r in result["systems"].values():
        r["tokens_per_s"] = aggregate(r["runs"], kinds)
        r["identical_to_transformers_greedy"] = r.pop("output_ids") == reference
    return result


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
    lines += ["", (f"**End to end**, one request at a time, greedy, up to {e['max_tokens']} new "
                  f"tokens, prefill included (`dflash up` through its OpenAI HTTP API, streamed; "
                  f"transformers `generate` in one process). Chat: {len(CHATS)} open questions; "
                  f"copy: {len(COPY_TASKS)} tasks whose answers repeat the prompt."), "",
              ("| system | tokens/s chat | tokens/s copy | tokens/s all | mean acceptance length "
              "| identical to transformers greedy |"), "|---|---|---|---|---|---|"]
    for name, s in e["systems"].items():
        mal = [run["mean_acceptance_length"] for run in s["runs"] if "mean_acceptance_length" in run]
        mal_text = f"{sum(mal) / len(mal):.2f}" if mal else "-"
        tps = s["tokens_per_s"]
        lines.append(f"| {name} | {tps['chat']:.1f} | {tps['copy']:.1f} | {tps['all']:.1f} | "
                     f"{mal_text} | {'yes' if s['identical_to_transformers_greedy'] else 'NO'} |")
    return "\n".join(lines + ["", NOTES]) + "\n"


NOTES = """Reading the tables: the services' handler times include their batching queues (at
concurrency 32 one target iteration serves every sequence's Verify, so each handler waits about a
whole iteration). What the gateway adds - its own work plus the round trips beyond the handlers -
is a few milliseconds per step and a few percent of it; it grows with concurrency mostly because
the three processes share two cores (event-loop and CPU waits show up as wire time). The DFlash
rows use the drafter shipped for SmolLM2 (models/smollm2-135m-instruct-dflash) with `dflash up`'s
CPU defaults: a verify block of 4 tokens (see "CPU compute" for why a verify of up to 4 tokens
costs about one decode step there), and drafting only while one request is running, so at
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
                   help="drafters for `dflash up` (default: the launcher's default, and none)")
    p.add_argument("--e2e-max-tokens", type=int, default=128)
    p.add_argument("--shared", action="store_true", help="note that others used the CPU")
    p.add_argument("--out", default="bench/results/gateway_cpu.json")
    p.add_argument("--doc", default="docs/benchmarks.md")
    p.add_argument("--render-only", action="store_true", help="rewrite the doc from --out")
    args = p.parse_args(argv)
    if args.render_only:
        write_section(Path(args.doc), SECTION, markdown(json.loads(Path(args.out).read_text())))
        return
    from gateway.launcher import DEFAULT_DRAFTER
    from runtime.prepare.smollm2 import prepare_smollm2
    from runtime.tokenizer import ChatTokenizer
    model_dir = prepare_smollm2(["float32"], progress=False)["float32"]
    tok = ChatTokenizer(model_dir)
    prompts = [tok.encode(tok.apply_chat_template([{"role": "user", "content": t}]))
               for t in CHATS + COPY_TASKS]
    result: dict = {"machine": machine(), "date": datetime.date.today().isoformat(),
                    "command": "python -m bench.gateway_cpu " + " ".join(argv or sys.argv[1:]),
                    "shared": args.shared, "overhead_max_tokens": args.overhead_max_tokens,
                    "overhead": []}
    with tempfile.TemporaryDirectory(prefix="bench-gateway-") as tmp:
        for drafter in args.overhead_drafters:
            result["overhead"] += overhead(drafter, prompts, args.overhead_max_tokens,
                                           args.min_requests, Path(tmp))
        result["end_to_end"] = end_to_end(model_dir, args.e2e_drafters or [DEFAULT_DRAFTER, "none"],
                                          args.e2e_max_tokens, Path(tmp))
    save(result, Path(args.out), Path(args.doc), SECTION, markdown)
    print(markdown(result))


if __name__ == "__main__":
    main()
