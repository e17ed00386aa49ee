"""python -m bench.wire_cpu [--shared]: the per-step wire on CPU, unary RPCs against one
long-lived bidirectional stream per upstream, and that stream on the services' unix call
sockets (the gateway's --wire unary | stream | socket).

1. Wire alone: per-call latency of a Verify-sized and a Propose-sized round trip at 1 and 8
   concurrent callers. The client is the gateway's own Upstream (gateway/upstream.py, with its
   channel options); the server is a separate process with the real servicer plumbing (server
   bootstrap, guard interceptor, `rpc` decorator, call_stream) around a trivial Verify / Propose
   that answers at once with real-sized messages of SmolLM2 + the shipped DFlash drafter
   (5 tapped layers x 576 = 2880 bf16 features per token; 2 committed tokens per step): Verify
   sends a 16-token block and gets 2 tokens + features [2, 2880]; Propose sends features
   [2, 2880] with their positions and token ids and gets 15 draft tokens. No model runs. The
   server also serves both streams on call sockets (services/common/call_socket.py).
2. End to end: `dflash up` (SmolLM2-135M-Instruct fp32, the shipped drafter) with each wire, one
   request at a time through the gateway's gRPC API, greedy; tokens/s and the per-step wire time
   (round trips seen by the gateway minus the services' handler times, as bench/gateway_cpu.py
   computes it). Both wires must give the same tokens.

The wires alternate (unary, stream, socket, unary, ...) over --rounds rounds and the median round is
reported, so a change of load on the machine hits both. Results: bench/results/wire_cpu.json and
the "Per-step wire: unary, stream and socket (CPU)" section of docs/benchmarks.md. --tiny: one round of
a few calls per row, and end to end one prompt of 8 tokens (a smoke test; --out and --doc
default to a temporary folder)."""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import datetime
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import grpc
import torch

from bench.report import add_output_flags, machine, render_only, save
from bench.tiny import add_tiny_flag, tiny_fields, tiny_outputs
from dflash.v1 import draft_pb2, draft_pb2_grpc, target_pb2, target_pb2_grpc
from services.common import tensor_codec
from services.common.call_socket import CallSocket, SocketMethod
from services.common.server import Readiness, build_server
from services.common.tls import ServerTls

SECTION = "## Per-step wire: unary, stream and socket (CPU)"
WIRES = ("unary", "stream", "socket")
LEVELS = (1, 8)
BLOCK, COMMITTED, FEATURE_WIDTH = 16, 2, 5 * 576
E2E_PROMPTS = ["Write a short story about a robot who learns to paint.",
               "Explain how photosynthesis works in simple terms.",
               ("Repeat this sentence word for word: The early bird catches the worm, but the "
                "second mouse gets the cheese.")]


def features(rows: int):
    return tensor_codec.encode(torch.randn(rows, FEATURE_WIDTH).to(torch.bfloat16))


def verify_request(seq: str) -> target_pb2.VerifyRequest:
    return target_pb2.VerifyRequest(sequence_id=seq, token_ids=list(range(1000, 1000 + BLOCK)))


def propose_request(seq: str) -> draft_pb2.ProposeRequest:
    return draft_pb2.ProposeRequest(sequence_id=seq, new_features=features(COMMITTED),
                                    positions=[100, 101], new_token_ids=[7, 8], anchor=9,
                                    block_size=BLOCK)


# -- the server process: real plumbing, trivial handlers -----------------------------------------
def serve(port: int) -> None:
    from services.draft.servicer import DraftServicer
    from services.draft.servicer import add_to_server as add_draft
    from services.target.servicer import TargetServicer
    from services.target.servicer import add_to_server as add_target

    verify_reply = target_pb2.VerifyResponse(accepted=COMMITTED - 1, seq_len=101,
                                             committed_tokens=[5] * COMMITTED,
                                             features=features(COMMITTED))
    propose_reply = draft_pb2.ProposeResponse(draft_tokens=[5] * (BLOCK - 1), context_len=102)

    class Target(TargetServicer):
        async def verify(self, request, owner):
            return verify_reply

    class Draft(DraftServicer):
        async def propose(self, request, owner):
            return propose_reply

    target, draft = Target(), Draft()

    def register(server: grpc.aio.Server) -> list[str]:
        return add_target(target, server) + add_draft(draft, server)

    async def main() -> None:
        server = build_server(port, "127.0.0.1", 256 << 20, Readiness("bench"), register,
                              tls=ServerTls())
        await server.start()
        sockets = [CallSocket(socket_path(port, role), {method: SocketMethod(handler, request)},
                              "", None, 256 << 20)
                   for role, method, handler, request in (
                       ("target", "Verify", target.VerifyStream, target_pb2.VerifyStreamRequest),
                       ("draft", "Propose", draft.ProposeStream, draft_pb2.ProposeStreamRequest))]
        for sock, role in zip(sockets, ("target", "draft")):
            sock.id = role                   # what the client expects (call_socket_id)
            await sock.start()
        print("ready", flush=True)
        try:
            await server.wait_for_termination()
        finally:
            for sock in sockets:
                await sock.close()

    asyncio.run(main())


def socket_path(port: int, role: str) -> str:
    return f"{tempfile.gettempdir()}/dflash-wire-{port}-{role}.sock"


# -- part 1: the wire alone ---------------------------------------------------------------------
# ONE_LOOP: grpc.aio's completion-queue poller stays bound to the event loop a process first uses;
# an asyncio.run per row left it calling into closed loops ("Event loop is closed" tracebacks).
def upstream(role: str, port: int, wire: str):
    from gateway.config import GatewayConfig
    from gateway.upstream import Upstream
    config = GatewayConfig(target=f"127.0.0.1:{port}", tokenizer_dir="unused", wire=wire)
    if role == "target":
        up = Upstream(role, config.target, "", target_pb2_grpc.TargetStub, config,
                      lambda: None, {"Verify": (target_pb2.VerifyStreamRequest,
                                                target_pb2.VerifyStreamResponse)})
        up.capabilities = target_pb2.TargetCapabilities(call_socket=socket_path(port, role),
                                                        call_socket_id=role)
    else:
        up = Upstream(role, config.target, "", draft_pb2_grpc.DraftStub, config, lambda: None,
                      {"Propose": (draft_pb2.ProposeStreamRequest,
                                   draft_pb2.ProposeStreamResponse)})
        up.capabilities = draft_pb2.DraftCapabilities(call_socket=socket_path(port, role),
                                                      call_socket_id=role)
    return up


async def measure(port: int, method: str, wire: str, callers: int, calls: int,
                  warmup: int = 50) -> dict:
    """`callers` tasks sharing `calls` calls, each caller's back to back (after `warmup` calls
    each); latency per call in µs."""
    up = upstream("target" if method == "Verify" else "draft", port, wire)
    await up.probe_socket(up.capabilities)           # as when the service turns SERVING
    assert not up.socket_failed, up.socket_failed
    make = verify_request if method == "Verify" else propose_request
    requests = [make(f"seq-{i}") for i in range(callers)]
    latencies: list[float] = []

    async def caller(i: int, n: int, keep: bool) -> None:
        for _ in range(n):
            t0 = time.perf_counter()
            await up.call(method, requests[i], 10.0)
            if keep:
                latencies.append((time.perf_counter() - t0) * 1e6)

    await asyncio.gather(*(caller(i, warmup, False) for i in range(callers)))     # warm-up
    t0 = time.perf_counter()
    await asyncio.gather(*(caller(i, calls // callers, True) for i in range(callers)))
    seconds = time.perf_counter() - t0
    await up.close()
    latencies.sort()
    return {"method": method, "wire": wire, "callers": callers, "calls": len(latencies),
            "mean_us": statistics.fmean(latencies), "p50_us": latencies[len(latencies) // 2],
            "p90_us": latencies[int(len(latencies) * 0.9)], "calls_per_s": len(latencies) / seconds}


def wire_alone(rounds: int, calls: int, warmup: int = 50) -> list[dict]:
    from services.common.ports import free_port
    port = free_port()
    server = subprocess.Popen([sys.executable, "-m", "bench.wire_cpu", "--serve", str(port)],
                              stdout=subprocess.PIPE, text=True)
    try:
        assert server.stdout.readline().strip() == "ready"
        runs: dict[tuple, list[dict]] = {}
        with asyncio.Runner() as runner:      # one event loop for every row (see ONE_LOOP)
            for _ in range(rounds):
                for method in ("Verify", "Propose"):
                    for callers in LEVELS:
                        for wire in WIRES:
                            row = runner.run(measure(port, method, wire, callers, calls,
                                                     warmup))
                            runs.setdefault((method, callers, wire), []).append(row)
    finally:
        server.terminate()
        server.wait(10)
    rows = [median_row(r, "mean_us") for r in runs.values()]
    for row in rows:
        print(json.dumps(row), flush=True)
    return rows


def median_row(rows: list[dict], key: str) -> dict:
    """The round whose `key` is the median, with every round's value kept."""
    best = sorted(rows, key=lambda r: r[key])[len(rows) // 2]
    return {**{k: round(v, 1) if isinstance(v, float) else v for k, v in best.items()},
            f"rounds_{key}": [round(r[key], 1) for r in rows]}


# -- part 2: end to end -------------------------------------------------------------------------
def end_to_end(rounds: int, max_tokens: int, log_dir: Path,
               texts: list[str] = E2E_PROMPTS) -> dict:
    """Two stacks, one per wire, both up; one request at a time, the wires taking turns."""
    from bench.gateway_cpu import Services, _grpc_ids, drive, step_breakdown
    from dflash.prepare.smollm2 import prepare_smollm2
    from dflash.stack import DEFAULT_DRAFTER
    from runtime.tokenizer import ChatTokenizer
    tok = ChatTokenizer(prepare_smollm2(["float32"], progress=False)["float32"])
    prompts = [tok.encode(tok.apply_chat_template([{"role": "user", "content": t}]))
               for t in texts]
    runs: dict[str, list[dict]] = {w: [] for w in WIRES}
    with contextlib.ExitStack() as stacks, asyncio.Runner() as runner:      # see ONE_LOOP
        svcs = {w: stacks.enter_context(Services(DEFAULT_DRAFTER, log_dir / w, wire=w))
                for w in WIRES}
        grpc_at = {w: f"127.0.0.1:{svc.opts.port}" for w, svc in svcs.items()}
        outputs = {w: [_grpc_ids(grpc_at[w], ids, max_tokens) for ids in prompts]
                   for w in WIRES}                      # also the warm-up
        for _ in range(rounds):
            for wire, svc in svcs.items():
                before = svc.snapshot()
                tokens, seconds = runner.run(drive(grpc_at[wire], prompts, 1, max_tokens))
                runs[wire].append({"wire": wire, "tokens": tokens, "seconds": seconds,
                                   "tokens_per_s": tokens / seconds,
                                   **step_breakdown(before, svc.snapshot())})
    rows = [median_row(runs[w], "tokens_per_s") for w in WIRES]
    for row in rows:
        print(json.dumps(row), flush=True)
    return {"drafter": DEFAULT_DRAFTER, "max_tokens": max_tokens, "prompts": list(texts),
            "rounds": rounds, "rows": rows,
            "identical": outputs["unary"] == outputs["stream"] == outputs["socket"]}


# -- report -------------------------------------------------------------------------------------
def markdown(r: dict) -> str:
    m = r["machine"]
    noisy = (" **The machine was shared (other work ran on it): treat these numbers as rough; "
             "the wires alternated, so the comparison holds better than the absolute values.**"
             if r["shared"] else "")
    lines = [SECTION, "",
             (f"`{r['command']}` (results: `bench/results/wire_cpu.json`). Machine: {m['cpu']}, "
              f"{m['cores']} cores, torch {m['torch']}; {r['date']}; load average "
              f"{m['load_avg_start']:.1f} at start, {r['load_avg_end']:.1f} at the end. The "
              f"wires alternate within each round.{noisy}"), "",
             ("**The wire alone**: the gateway's `Upstream` against a server process with the real "
              "servicer plumbing and a trivial Verify / Propose answering real-sized messages "
              "(Verify: a 16-token block in, 2 tokens + [2, 2880] bf16 features out; Propose: "
              "[2, 2880] bf16 features in, 15 draft tokens out; no model). Latency per call in "
              f"µs (with 8 callers, each waits for its own call); {r['calls']} calls per row, "
              f"median of {r['rounds']} rounds (by mean); calls/s of all callers together."), "",
             "| call | callers | wire | mean µs | p50 µs | p90 µs | calls/s |",
             "|---|---|---|---|---|---|---|"]
    for row in r["wire_alone"]:
        lines.append(f"| {row['method']} | {row['callers']} | {row['wire']} | "
                     f"{row['mean_us']:.0f} | {row['p50_us']:.0f} | {row['p90_us']:.0f} | "
                     f"{row['calls_per_s']:.0f} |")
    e = r["end_to_end"]
    if e:
        lines += ["", (f"**End to end**: `dflash up` (SmolLM2-135M-Instruct fp32, drafter "
                       f"{e['drafter']}), one stack per wire, one request at a time through the "
                       f"gRPC API, greedy, {e['max_tokens']} tokens per request, "
                       f"{len(e['prompts'])} prompts, median of {e['rounds']} rounds (by "
                       "tokens/s). *wire ms* = the Propose and Verify round "
                       "trips minus the services' handler times, per step. Same tokens from every "
                       f"wire: {'yes' if e['identical'] else 'NO'}."), "",
                  "| wire | tokens/s | step ms | wire ms | gateway ms | steps |",
                  "|---|---|---|---|---|---|"]
        for row in e["rows"]:
            lines.append(f"| {row['wire']} | {row['tokens_per_s']:.1f} | {row['step_ms']:.1f} | "
                         f"{row['wire_ms']:.1f} | {row['gateway_ms']:.1f} | {row['steps']} |")
    return "\n".join(lines + ["", verdict(r)]) + "\n"


def verdict(r: dict) -> str:
    """What the numbers say, and the default they chose."""
    from gateway.config import DEFAULT_WIRE
    by = {(x["method"], x["callers"], x["wire"]): x for x in r["wire_alone"]}
    pairs = [(m, c) for m, c, w in by if w == "unary"]
    faster = sum(by[(m, c, "stream")]["mean_us"] < by[(m, c, "unary")]["mean_us"]
                 for m, c in pairs)
    text = ", ".join(f"{m} c={c} {by[(m, c, 'unary')]['mean_us']:.0f} -> "
                     f"{by[(m, c, 'stream')]['mean_us']:.0f} µs" for m, c in pairs)
    out = (f"Mean per call, unary -> stream: {text}; the stream is faster in {faster} of "
           f"{len(pairs)}, and carries {_gain(by, 'calls_per_s')} more calls/s.")
    if all((m, c, "socket") in by for m, c in pairs):
        text = ", ".join(f"{m} c={c} {by[(m, c, 'stream')]['mean_us']:.0f} -> "
                         f"{by[(m, c, 'socket')]['mean_us']:.0f} µs" for m, c in pairs)
        out += f" Stream -> the same stream on the call socket: {text}."
    e = r.get("end_to_end")
    if e:
        u, st = ({row["wire"]: row for row in e["rows"]}[w] for w in ("unary", "stream"))
        out += (f" End to end it saves {u['wire_ms'] - st['wire_ms']:.1f} ms of wire per step "
                f"({u['tokens_per_s']:.1f} -> {st['tokens_per_s']:.1f} tokens/s): on this CPU the "
                f"model forwards ({st['step_ms']:.0f} ms a step) dominate, so the gain is small "
                f"here and grows where steps are short (GPU) or calls many.")
        so = {row["wire"]: row for row in e["rows"]}.get("socket")
        if so is not None:
            out += (f" The socket: {st['wire_ms']:.1f} -> {so['wire_ms']:.1f} ms of wire per "
                    f"step ({st['tokens_per_s']:.1f} -> {so['tokens_per_s']:.1f} tokens/s; "
                    f"{st['steps']} and {so['steps']} steps: with `--speculation auto` the block "
                    f"sizes follow the measured costs, so the stacks may verify differently).")
    return out + (f" The gateway's default is `--wire {DEFAULT_WIRE}`; `--wire socket` uses the "
                  f"services' call sockets, `--wire unary` sends one RPC per call.")


def _gain(by: dict, key: str) -> str:
    """The range of stream / unary - 1 over the rows, as percentages."""
    gains = [by[(m, c, "stream")][key] / by[(m, c, "unary")][key] - 1 for m, c, w in by
             if w == "unary"]
    return f"{100 * min(gains):.0f}-{100 * max(gains):.0f} %"


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m bench.wire_cpu",
                                description=__doc__.splitlines()[0])
    p.add_argument("--serve", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--calls", type=int, default=2000, help="calls per measurement (all callers)")
    p.add_argument("--e2e-rounds", type=int, default=3)
    p.add_argument("--e2e-max-tokens", type=int, default=64)
    p.add_argument("--no-e2e", action="store_true", help="the wire alone")
    add_output_flags(p, "wire_cpu")
    add_tiny_flag(p)
    args = p.parse_args(argv)
    if args.serve:
        serve(args.serve)
        return
    tiny_outputs(args, p, "wire_cpu")
    if render_only(args, SECTION, markdown):
        return
    warmup, texts = 50, E2E_PROMPTS
    if args.tiny:                       # every row, a few calls; end to end one short prompt
        args.rounds, args.calls, args.e2e_rounds, args.e2e_max_tokens = 1, 16, 1, 8
        warmup, texts = 4, E2E_PROMPTS[:1]
    result: dict = {"machine": machine(), "date": datetime.date.today().isoformat(),
                    "command": " ".join(["python -m bench.wire_cpu", *(argv or sys.argv[1:])]),
                    "shared": args.shared, "rounds": args.rounds, "calls": args.calls}
    if args.tiny:
        result.update(tiny_fields())
    result["wire_alone"] = wire_alone(args.rounds, args.calls, warmup)
    with tempfile.TemporaryDirectory(prefix="bench-wire-") as tmp:
        result["end_to_end"] = (None if args.no_e2e else
                                end_to_end(args.e2e_rounds, args.e2e_max_tokens, Path(tmp), texts))
    save(result, Path(args.out), Path(args.doc), SECTION, markdown)
    print(markdown(result))


if __name__ == "__main__":
    main()
