"""Prefix caching through `dflash up` (target + draft + gateway): cache on against off.

Two workloads, each run on a stack with the cache on and one with it off (one after the other):
- multi-turn chat: C conversations of T turns each (SmolLM2's chat template; each turn's prompt
  holds the conversation so far, the model's answers included), the conversations run at once
  (c = C), turn after turn: output tokens per second over the whole workload, the median time
  to first token of first turns and of later turns;
- a shared system prompt of about S tokens ahead of R different short questions, run one at a
  time: the median time to first token of the questions after the first.
The hit rate: the target's and the draft's dflash_prefix_cache_hits_total / _queries_total over
the run. Greedy; every output is checked equal between the two stacks.

    python -m bench.prefix_cache                     # CPU, SmolLM2 fp32 + the shipped drafter
    python -m bench.prefix_cache --device cuda       # bf16 on a GPU (--out, --doc elsewhere)
    python -m bench.prefix_cache --device cuda --shape qwen3-8b --history-tokens 1000

--shape qwen3-8b: a Qwen3-8B-shaped target (random bf16 weights) and a DFlash-shaped drafter
under the forced acceptance profile of bench.adaptive_cpu, so that a prefill costs what an 8B
model's does; the conversations continue in token ids (each turn's prompt is the previous
prompt, its output and the next user message in SmolLM2's chat template: random weights make
no text). --history-tokens N: each conversation opens with its own system message of about N
tokens (an agent's instructions, a document), so later turns resend a long history.

Writes bench/results/prefix_cache.json and the "Prefix caching (CPU)" section of
docs/benchmarks.md (with --device cuda: "Prefix caching (GPU)"; with --shape qwen3-8b:
"Prefix caching (GPU, Qwen3-8B shape)")."""
from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import grpc

from bench.adaptive_cpu import PROFILE, shaped_stack, smollm2_options
from bench.gateway_cpu import Services, total
from bench.report import add_output_flags, machine, render_only, save
from bench.tiny import add_tiny_flag, tiny_fields, tiny_outputs
from dflash.v1 import common_pb2, gateway_pb2, gateway_pb2_grpc
from runtime.tokenizer import ChatTokenizer

QUESTIONS = ["Name three colours of the rainbow.", "Which of them is the warmest?",
             "Why do leaves change colour in autumn?", "Give one example.",
             "What is the capital of France?", "And of Italy?", "Which is further south?",
             "Explain gravity to a child.", "Say that again in one sentence.",
             "What is two plus two?", "Write a haiku about the sea.", "Now one about rain."]
SYSTEM_LINE = ("You are a helpful assistant for a library. Be accurate, cite the shelf where a "
               "book can be found, keep answers short, and never invent titles. ")


async def request(stub, ids: list[int], max_tokens: int) -> tuple[list[int], str, float]:
    """Greedy: (token ids, text, time to first token)."""
    req = gateway_pb2.GenerateRequest(token_ids=gateway_pb2.TokenIds(ids=ids),
                                      max_tokens=max_tokens,
                                      sampling=common_pb2.SamplingParams(temperature=0))
    t0, ttft, out, text = time.perf_counter(), 0.0, [], []
    async for r in stub.Generate(req, timeout=1800):
        if not ttft and r.token_ids:
            ttft = time.perf_counter() - t0
        out += r.token_ids
        text.append(r.text)
    return out, "".join(text), ttft


def opening(system: str, c: int, history: str) -> list[dict]:
    """Conversation c's system message: `system` (a warm-up's, so that no measured prompt hits
    its pages), then its own long history (--history-tokens), numbered so no two share it."""
    content = " ".join(x for x in (system, f"Conversation {c}: {history}" if history else "") if x)
    return [{"role": "system", "content": content}] if content else []


async def multi_turn(address: str, tok: ChatTokenizer, conversations: int, turns: int,
                     max_tokens: int, system: str = "", history: str = "",
                     in_ids: bool = False) -> dict:
    """Every conversation at once, each turn after the previous one's answer (opening: the
    system message). in_ids: each turn's prompt is the previous prompt + its output + the next
    user message's template (random weights write no text to send back)."""
    ttfts: dict[str, list[float]] = {"first": [], "later": []}
    outputs: list[list[list[int]]] = []
    produced = 0
    async with grpc.aio.insecure_channel(address) as ch:
        stub = gateway_pb2_grpc.GatewayStub(ch)

        async def conversation(c: int) -> list[list[int]]:
            nonlocal produced
            messages = opening(system, c, history)
            outs, ids = [], []
            for t in range(turns):
                user = {"role": "user", "content": QUESTIONS[(c * turns + t) % len(QUESTIONS)]}
                if in_ids:
                    ids = [*ids, *tok.encode(tok.apply_chat_template(
                        [*(messages if t == 0 else []), user]))]
                else:
                    messages.append(user)
                    ids = tok.encode(tok.apply_chat_template(messages))
                out, text, ttft = await request(stub, ids, max_tokens)
                if in_ids:
                    ids = [*ids, *out]
                else:
                    messages.append({"role": "assistant", "content": text})
                ttfts["first" if t == 0 else "later"].append(ttft)
                produced += len(out)
                outs.append(out)
            return outs

        t0 = time.perf_counter()
        outputs = await asyncio.gather(*(conversation(c) for c in range(conversations)))
        seconds = time.perf_counter() - t0
    return {"tokens": produced, "seconds": round(seconds, 3),
            "tokens_per_s": round(produced / seconds, 2),
            "ttft_first_ms": round(1e3 * statistics.median(ttfts["first"]), 1),
            "ttft_later_ms": round(1e3 * statistics.median(ttfts["later"]), 1),
            "outputs": outputs}


async def shared_system(address: str, tok: ChatTokenizer, system: str, questions: int,
                        max_tokens: int) -> dict:
    """The questions one at a time behind the same system prompt."""
    ttfts, outputs = [], []
    async with grpc.aio.insecure_channel(address) as ch:
        stub = gateway_pb2_grpc.GatewayStub(ch)
        for q in range(questions):
            ids = tok.encode(tok.apply_chat_template(
                [{"role": "system", "content": system},
                 {"role": "user", "content": QUESTIONS[q % len(QUESTIONS)]}]))
            out, _, ttft = await request(stub, ids, max_tokens)
            ttfts.append(ttft)
            outputs.append(out)
    return {"prompt_tokens": len(ids), "ttft_first_ms": round(1e3 * ttfts[0], 1),
            "ttft_rest_ms": round(1e3 * statistics.median(ttfts[1:]), 1), "outputs": outputs}


def delta(before: dict, after: dict, service: str, name: str, **labels: str) -> float:
    """A counter's (or a histogram sample's) growth over the run on one service."""
    return (total(after.get(service, {}), name, **labels)
            - total(before.get(service, {}), name, **labels))


def hit_rate(before: dict, after: dict, service: str) -> float | None:
    """Hits / queries (tokens) of one service over the run."""
    queries = delta(before, after, service, "dflash_prefix_cache_queries_total")
    hits = delta(before, after, service, "dflash_prefix_cache_hits_total")
    return round(hits / queries, 3) if queries else None


def mean_ms(before: dict, after: dict, service: str, name: str, **labels: str) -> dict:
    """A histogram's mean (ms) and count over the run."""
    n = delta(before, after, service, name + "_count", **labels)
    s = delta(before, after, service, name + "_sum", **labels)
    return {"ms": round(1e3 * s / n, 2) if n else None, "n": int(n)}


def breakdown(before: dict, after: dict) -> dict:
    """Where the time went: each service's RPC handling time by method, its engine's forward
    time per iteration, the gateway's step stages, and the drafts' acceptance."""
    rpcs = {("target", m) for m in ("Prefill", "Verify")} | {
        ("draft", m) for m in ("Propose", "OpenSequence")}
    out: dict = {f"{svc}.{m}": mean_ms(before, after, svc, "dflash_rpc_duration_seconds",
                                       method=m) for svc, m in sorted(rpcs)}
    for svc in ("target", "draft"):
        out[f"{svc}.forward"] = mean_ms(before, after, svc, "dflash_forward_seconds")
    for stage in ("draft", "verify", "gateway"):
        out[f"step.{stage}"] = mean_ms(before, after, "gateway", "dflash_step_seconds",
                                       stage=stage)
    out["ttft"] = mean_ms(before, after, "gateway", "dflash_time_to_first_token_seconds")
    drafts = delta(before, after, "gateway", "dflash_spec_drafts_total")
    accepted = delta(before, after, "gateway", "dflash_spec_accepted_tokens_total")
    out["accepted_per_draft_step"] = round(accepted / drafts, 3) if drafts else None
    return out


def measure(args: argparse.Namespace, tok: ChatTokenizer, system: str, cached: bool,
            log_dir: Path, options: dict) -> dict:
    chat_args = (tok, args.conversations, args.turns, args.max_tokens)
    chat_kw = {"history": args.history, "in_ids": args.shape != "smollm2"}
    with Services("dflash", log_dir, prefix_caching=cached, **options) as svc:
        address = f"127.0.0.1:{svc.opts.port}"
        asyncio.run(request_once(address, tok))                       # warm-up
        if args.warmup:         # every kernel shape the workload meets compiled (Triton JIT)
            asyncio.run(multi_turn(address, *chat_args, system="Warm-up run.", **chat_kw))
            asyncio.run(shared_system(address, tok, "Warm-up run. " + system, 2,
                                      args.max_tokens))
        before = svc.snapshot()
        chat = asyncio.run(multi_turn(address, *chat_args, **chat_kw))
        mid = svc.snapshot()
        shared = asyncio.run(shared_system(address, tok, system, args.questions,
                                           args.max_tokens))
        after = svc.snapshot()
    chat["hit_rate"] = {s: hit_rate(before, mid, s) for s in ("target", "draft")}
    shared["hit_rate"] = {s: hit_rate(mid, after, s) for s in ("target", "draft")}
    chat["breakdown"], shared["breakdown"] = breakdown(before, mid), breakdown(mid, after)
    return {"multi_turn": chat, "shared_system": shared}


async def request_once(address: str, tok: ChatTokenizer) -> None:
    async with grpc.aio.insecure_channel(address) as ch:
        ids = tok.encode(tok.apply_chat_template([{"role": "user", "content": "Hi."}]))
        await request(gateway_pb2_grpc.GatewayStub(ch), ids, 4)


def summary(on: dict, off: dict) -> dict:
    m_on, m_off = on["multi_turn"], off["multi_turn"]
    s_on, s_off = on["shared_system"], off["shared_system"]
    return {"throughput_ratio": round(m_on["tokens_per_s"] / m_off["tokens_per_s"], 3),
            "later_turn_ttft_ratio": round(m_off["ttft_later_ms"] / m_on["ttft_later_ms"], 2),
            "shared_prompt_ttft_ratio": round(s_off["ttft_rest_ms"] / s_on["ttft_rest_ms"], 2),
            "identical_outputs": m_on["outputs"] == m_off["outputs"]
            and s_on["outputs"] == s_off["outputs"]}


GPU_NOTES = """Reading it (session 41, at 48676f8; an H100, with `--warmup`). Since session 40's
run at 7b351fc (multi-turn 670.3 against 662.2 tokens/s, later turns' TTFT 43.6 against 35.3
ms, behind the shared system prompt 10.7 against 16.8 ms; `bench/results/gpu/session40/
prefix_cache_gpu_h100.json`; the H200 run of 2026-12-05 is archived in
`bench/results/archive/prefix_cache_gpu_h200_session36.json`; session 40 brought prefill
graphs - the 1 941-token prompt's Prefill from 90 to 15 ms - and the draft's absorb of a prompt
that is not drafted for, without which nothing hit behind the shared system prompt:
`bench/results/gpu/session40/prefix_cache_gpu_h100_before_absorb.json`), prompt chunks run in forwards of
their own on a GPU, taking turns with the verifies (`EngineLoop.prompts_apart`): a batch that
mixed a chunk with verifies matched no CUDA graph and ran eagerly. The multi-turn workload went
from 670 to 871 tokens/s with the cache and from 662 to 954 without it, later turns' TTFT from
43.6 to 30.3 and from 35.3 to 28.1 ms.

The goals stay missed, by more than before on throughput: the cache now costs the multi-turn
workload (0.91x; TTFT of later turns 0.93x) and cuts the shared-prompt TTFT 1.71x (9.4
against 16.1 ms). At c = 8 the Prefill round trip is still 28 ms (cache on) and 22 ms (off)
against a forward of about 4 ms: in this run every prompt waiting at a prompts' turn still went
into one forward - several conversations' turns at once, a batch no prefill graph was captured
for (they are captured for one sequence), so it ran eagerly. Since then (unmeasured) a prompts'
turn takes one sequence's chunk. On this GPU a 135M model's prefill is not what time to first
token is made of - the fixed costs are (two gRPC round trips, the engine's queue, the gateway):
the goals (TTFT of later turns >= 5x lower, multi-turn >= 1.5x at c = 8) need a target whose
prefill dominates (a larger model, longer histories). Outputs differ with and without the cache
in bf16 (a prefill that starts after a cached prefix rounds differently; `--deterministic` makes
them equal); on the CPU in fp32 they are identical."""

BREAKDOWN_ROWS = ("ttft", "target.Prefill", "draft.OpenSequence", "target.Verify",
                  "draft.Propose", "target.forward", "draft.forward", "step.gateway",
                  "accepted_per_draft_step")


SHAPE_SECTION = "## Prefix caching (GPU, Qwen3-8B shape)"


def section_for(device: str, shape: str = "smollm2") -> str:
    if shape != "smollm2":
        return SHAPE_SECTION
    return "## Prefix caching (GPU)" if device != "cpu" else "## Prefix caching (CPU)"


def section(r: dict) -> str:
    return section_for(r["device"], r.get("shape", "smollm2"))


def models(r: dict) -> str:
    """What served the run, for the section's first sentence."""
    if r.get("shape", "smollm2") == "smollm2":
        return "SmolLM2-135M-Instruct + the shipped drafter, `dflash up` defaults"
    return (f"a Qwen3-8B-shaped target (random {r['dtype']} weights) + a DFlash-shaped drafter "
            f"(5 layers, block 16), acceptance forced by position (P_d = {r['force_profile']}), "
            "the conversations continued in token ids")


def markdown(r: dict) -> str:
    on, off, s = r["on"], r["off"], r["summary"]
    m = r["machine"]
    where = r.get("gpu") or f"{m['cpu']}, {m['cores']} cores"
    rows = [(f"multi-turn: output tokens/s (c = {r['conversations']})",
             "tokens_per_s", "multi_turn"),
            ("multi-turn: TTFT of first turns (ms, median)", "ttft_first_ms", "multi_turn"),
            ("multi-turn: TTFT of later turns (ms, median)", "ttft_later_ms", "multi_turn"),
            ("shared system prompt: TTFT of the first question (ms)", "ttft_first_ms",
             "shared_system"),
            ("shared system prompt: TTFT of the others (ms, median)", "ttft_rest_ms",
             "shared_system")]
    history = (f", each opening with its own {r['history_tokens']}-token system message"
               if r.get("history_tokens") else "")
    if r.get("prompt_batch", 1) != 1:
        history += f", the target's `--prompt-batch {r['prompt_batch']}`"
    intro = (f"{where}, {r['dtype']}, {models(r)}, {r['date']}: `{r['command']}` (results: "
             f"`{r.get('json', 'bench/results/prefix_cache.json')}`). {r['conversations']} "
             f"conversations x {r['turns']} turns at once{history}, {r['max_tokens']} tokens per answer; "
             f"then {r['questions']} questions one at a time behind a "
             f"{on['shared_system']['prompt_tokens']}-token system prompt (with its question).")
    lines = [section(r), "", intro, "", "| | cache on | cache off |",
             "|---|---|---|"]
    for label, key, part in rows:
        lines.append(f"| {label} | {on[part][key]} | {off[part][key]} |")
    for part in ("multi_turn", "shared_system"):
        rate = on[part]["hit_rate"]
        lines.append(f"| {part.replace('_', ' ')}: hit rate target / draft (tokens) | "
                     f"{rate['target']} / {rate['draft']} | - |")
    closing = (f"Throughput of the multi-turn workload with the cache: "
               f"{s['throughput_ratio']}x (goal >= 1.5x at c = 8); TTFT of later turns "
               f"{s['later_turn_ttft_ratio']}x lower (goal >= 5x, on the GPU); behind the shared "
               f"system prompt {s['shared_prompt_ttft_ratio']}x lower. " + same_outputs(r))
    lines += ["", closing, *breakdown_table(on["multi_turn"], off["multi_turn"])]
    if r["device"] != "cpu" and r.get("warmup") and r.get("shape", "smollm2") == "smollm2":
        lines += ["", GPU_NOTES]
    return "\n".join(lines) + "\n"


def same_outputs(r: dict) -> str:
    if r.get("shape", "smollm2") != "smollm2":
        return ("Outputs not compared: forced acceptance draws from one random stream in the "
                "order the steps come, and the output is not the target's.")
    return f"Outputs identical with and without the cache: {r['summary']['identical_outputs']}."


def breakdown_table(on: dict, off: dict) -> list[str]:
    """The multi-turn workload's breakdown, cache on against off (none for runs before it
    was measured)."""
    if "breakdown" not in on:
        return []
    intro = ("Where the time went in the multi-turn workload (means over the run, ms, from the "
             "services' histograms):")
    lines = ["", intro, "", "| | cache on | cache off |", "|---|---|---|"]
    for key in BREAKDOWN_ROWS:
        cells = [part.get("breakdown", {}).get(key) for part in (on, off)]
        lines.append(f"| {key} | " + " | ".join(
            str(c["ms"] if isinstance(c, dict) else c) for c in cells) + " |")
    return lines


class FoldedTokenizer(ChatTokenizer):
    """SmolLM2's tokenizer with its ids folded into a random-weight shape's vocabulary (the
    tiny shape's 512 ids on the CPU; the Qwen3-8B shape's 151 936 hold them all)."""

    def __init__(self, model_dir: Path) -> None:
        super().__init__(model_dir)
        self.vocab = json.loads((model_dir / "config.json").read_text())["vocab_size"]

    def encode(self, text: str) -> list[int]:
        return [i % self.vocab for i in super().encode(text)]


def repeat_to(line: str, tokens: int, tok: ChatTokenizer) -> str:
    """`line` repeated to about `tokens` tokens."""
    return line * max(1, tokens // len(tok.encode(line)))


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m bench.prefix_cache",
                                description=__doc__.splitlines()[0])
    p.add_argument("--conversations", type=int, default=8)
    p.add_argument("--turns", type=int, default=6)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--questions", type=int, default=6)
    p.add_argument("--system-tokens", type=int, default=2000)
    p.add_argument("--device", default="cpu", help="cpu | cuda (then bf16 and triton)")
    p.add_argument("--shape", default="smollm2", choices=("smollm2", "qwen3-8b"),
                   help="qwen3-8b: random bf16 weights of that shape, forced acceptance (see above)")
    p.add_argument("--history-tokens", type=int, default=0,
                   help="each conversation opens with its own system message of about N tokens")
    p.add_argument("--prompt-batch", type=int, default=1,
                   help="the target's --prompt-batch (prompt chunks of this many sequences in "
                        "one forward where they run apart from verifies)")
    p.add_argument("--speculation", default="", help="the gateways' --speculation (default: "
                   "theirs, auto); fixed keeps the chain length out of the cache comparison")
    p.add_argument("--warmup", action=argparse.BooleanOptionalAction, default=None,
                   help="run the workloads once, unmeasured, on each stack first (behind "
                        "another system prompt: nothing measured hits their pages): kernels "
                        "compile on first use. Default: on a GPU")
    add_output_flags(p, "prefix_cache")
    add_tiny_flag(p)
    args = p.parse_args(argv)
    tiny_outputs(args, p, "prefix_cache")
    if render_only(args, section_for(args.device, args.shape), markdown):
        return
    if args.warmup is None:
        args.warmup = args.device != "cpu"
    if args.tiny:
        args.conversations, args.turns, args.max_tokens = 2, 2, 4
        args.questions, args.system_tokens = 2, 100
        args.history_tokens = min(args.history_tokens, 40)
    dtype = "float32" if args.device == "cpu" else "bfloat16"
    tmp = tempfile.TemporaryDirectory(prefix="bench-prefix-")    # the shape's model folders
    if args.shape == "smollm2":
        model, options = smollm2_options(args.device, dtype)
        tok = ChatTokenizer(model)
    else:                       # --tiny: a tiny model of the shape, on the CPU
        args.force_profile = PROFILE
        _, options = shaped_stack(args, dtype, Path(tmp.name))
        options["spec_tree_nodes"] = 0          # chains: forced acceptance is a chain's
        tok = FoldedTokenizer(Path(options["model_dir"]))
    if args.speculation:
        options["speculation"] = args.speculation
    if args.prompt_batch != 1:
        options["target_args"] = (*options.get("target_args", ()),
                                  "--prompt-batch", str(args.prompt_batch))
    system, args.history = (repeat_to(SYSTEM_LINE, n, tok) if n else ""
                            for n in (args.system_tokens, args.history_tokens))
    result: dict = {"machine": machine(), "date": datetime.date.today().isoformat(),
                    "command": "python -m bench.prefix_cache " + " ".join(argv or sys.argv[1:]),
                    "device": args.device, "dtype": dtype, "conversations": args.conversations,
                    "turns": args.turns, "max_tokens": args.max_tokens,
                    "questions": args.questions, "warmup": args.warmup, "shape": args.shape,
                    "history_tokens": args.history_tokens, "prompt_batch": args.prompt_batch,
                    "speculation": args.speculation or "auto"}
    if args.shape != "smollm2":
        result["force_profile"] = args.force_profile
    if args.tiny:
        result.update(tiny_fields())
    if args.device != "cpu":
        import torch
        result["gpu"] = torch.cuda.get_device_name(args.device)
    with tmp:
        for name, cached in (("on", True), ("off", False)):
            result[name] = measure(args, tok, system, cached, Path(tmp.name) / name, options)
            print(name, {k: {kk: vv for kk, vv in v.items() if kk != "outputs"}
                         for k, v in result[name].items()}, flush=True)
    result["summary"] = summary(result["on"], result["off"])
    for name in ("on", "off"):              # compared in the summary; not kept (thousands of ids)
        for part in result[name].values():
            part.pop("outputs")
    save(result, Path(args.out), Path(args.doc), section(result), markdown)
    print(markdown(result))


if __name__ == "__main__":
    main()
