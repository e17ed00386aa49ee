"""python -m bench.gpu_side_by_side [--tiny]: issue 7's side-by-side run, in one process tree.

Qwen3-8B-shaped target (random bf16 weights) with a DFlash-shaped drafter (5 layers, taps
1, 9, 17, 25, 33, block 16), on one GPU:
  (a) autoregressive decoding through our target service (gateway with no draft);
  (b) transformers' `generate` with a static cache (which transformers compiles), and dynamic;
  (c) speculative decoding in-process (engine calls, no gRPC: train/inproc.py);
  (d) speculative decoding through the three services over gRPC on loopback, for each wire
      (unary calls, and one bidirectional stream per gateway connection);
at concurrency 1, 8 and 32: output tokens/s and the per-step split into draft, verify and
gateway/wire (from the gateway's stage timings and the services' handler times on /metrics);
time to first token for a 1000-token prompt; the bandwidth floor per step.

Acceptance with random weights is near zero, so the target accepts a FORCED number of drafts
(TargetHooks.forced_acceptance through dflash/harness.py, benchmark-only, logged): every speculative number is
reported beside the forced tau (6.4 and 3). Health transitions of both services are recorded
from start to SERVING (warm-up includes kernel JIT and CUDA-graph capture).

Writes OUT/gpu_side_by_side.json incrementally (a timeout keeps what was measured) and a PNG
plot (bench.gpu_report renders the section of docs/benchmarks.md from the JSON). --tiny runs
every part at a small shape on the CPU (fp32, torch attention backend, no CUDA graphs; forced tau
6.4 only, concurrency 1 and 2, the gateway at the GPU's settings: block 16, drafting at every
load), --out defaulting to a temporary folder, and exits 1 if a part failed (a smoke test of the
whole command)."""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import threading
import time
from pathlib import Path

# before grpc is imported: the children exec right away, gRPC's fork handlers only get in the way
os.environ.setdefault("GRPC_ENABLE_FORK_SUPPORT", "false")

import torch

from bench.gateway_cpu import drive, features_travel, scrape, step_breakdown
from bench.h200_micro import (
    QWEN3_5_9B,
    QWEN3_5_DRAFT,
    QWEN3_8B,
    TINY,
    Recorder,
    copy_bandwidth,
    copy_tokenizer,
    guarded,
    tiny_hybrid,
    write_model_dirs,
)
from bench.tiny import NO_CUDA, tiny_fields, tiny_outputs
from dflash.harness import ForcedAcceptance, HookFlags
from dflash.prepare.tiny_mla import DEEPSEEK_V2_LITE
from services.common.ports import free_port

# --shape: (target config, the drafter's taps, the drafter's own layer layout: None = the
# target's; a hybrid target's drafter is a dense Qwen3 layout of its width)
SHAPES = {"qwen3-8b": (QWEN3_8B, [1, 9, 17, 25, 33], None),
          "deepseek-v2-lite": (DEEPSEEK_V2_LITE, [1, 7, 13, 19, 25], None),
          "qwen3.5-9b": (QWEN3_5_9B, [1, 8, 15, 22, 29], QWEN3_5_DRAFT)}
TAUS = (6.4, 3.0)
LEVELS = (1, 8, 32)
WIRES = ("unary", "stream")                   # by default; --wires socket also runs
TTFT_PROMPT = 1000
TINY_SKIPPED = {"cuda_graphs": NO_CUDA + ": the target and the draft run eagerly, and the draft "
                               "graph check compares the eager path with itself",
                "bf16": "fp32 on the CPU", "triton": "torch attention backend on the CPU"}


# -- shapes and the bandwidth floor ---------------------------------------------------------
def weight_bytes(cfg: dict, draft_layers: int, taps: int) -> dict[str, int]:
    """Bytes read per step: every target layer + final norm + LM head (the embedding reads only
    the rows of the step's tokens, ignored); the drafter's layers + fc, and the target LM head
    again (the drafter scores its block with it). bf16."""
    h, i, v = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"]
    nh, nkv, hd = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]
    layer = h * (nh + 2 * nkv) * hd + nh * hd * h + 3 * h * i + 2 * h + 2 * hd
    target = 2 * (cfg["num_hidden_layers"] * layer + h + v * h)
    draft = 2 * (draft_layers * layer + taps * h * h + 2 * h + v * h)
    return {"target": target, "draft": draft}


# -- health transitions ------------------------------------------------------------------------
class HealthLog:
    """Follows grpc.health.v1 Watch of one service from before it listens until stop();
    records (seconds since t0, status) at every change."""

    def __init__(self, name: str, address: str, service: str, t0: float) -> None:
        self.name, self.address, self.service, self.t0 = name, address, service, t0
        self.events: list[tuple[float, str]] = []
        self._stop = threading.Event()
        self._call = None
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _record(self, status: str) -> None:
        if not self.events or self.events[-1][1] != status:
            self.events.append((round(time.monotonic() - self.t0, 2), status))
            print(f"health {self.name}: {status} at +{self.events[-1][0]} s", flush=True)

    def _run(self) -> None:
        import grpc
        from grpc_health.v1 import health_pb2, health_pb2_grpc
        while not self._stop.is_set():
            try:
                with grpc.insecure_channel(self.address) as ch:
                    stub = health_pb2_grpc.HealthStub(ch)
                    self._call = stub.Watch(health_pb2.HealthCheckRequest(service=self.service),
                                            timeout=3600)
                    for msg in self._call:
                        self._record(health_pb2.HealthCheckResponse.ServingStatus.Name(msg.status))
                        if self._stop.is_set():
                            return
            except grpc.RpcError as e:
                if self._stop.is_set():
                    return
                self._record(f"no answer ({e.code().name})" if e.code() else "no answer")
            self._stop.wait(0.2)

    def stop(self) -> list[tuple[float, str]]:
        self._stop.set()
        if self._call is not None:
            self._call.cancel()
        self._thread.join(5)
        return list(self.events)


# -- (a) and (d): through the services -------------------------------------------------------
class GpuStack:
    """target (+ draft) + one gateway per wire, as child processes, with /metrics ports."""

    def __init__(self, tdir: Path, ddir: Path | None, args, log_dir: Path, taps: list[int],
                 tau: float | None, plane: str = "auto") -> None:
        from bench.gateway_cpu import PREFIX_CACHING_OFF  # TTFT is measured, not the cache
        from dflash.stack import Stack, StackOptions
        self.taps, self.tau, self.plane = taps, tau, plane
        self.wires = tuple(args.wires)
        capture = ",".join(map(str, taps)) if ddir is not None else ""
        self.opts = StackOptions(
            http_port=free_port(), port=free_port(), target_port=free_port(),
            draft_port=free_port(), target_metrics_port=free_port(),
            draft_metrics_port=free_port(), model_dir=str(tdir), dtype=args.dtype,
            drafter="dflash" if ddir is not None else "none", draft_model=str(ddir or ""),
            log_dir=str(log_dir), quiet=True, ready_timeout_s=900, device=args.device,
            attention_backend=args.backend, deterministic=args.deterministic,
            target_args=(*PREFIX_CACHING_OFF, "--kv-budget", args.target_kv,
                         "--kv-cache-dtype", args.kv_cache_dtype,
                         "--max-block-size", "16", "--graph-capture-layers", capture,
                         "--token-budget", "2048", "--feature-plane", plane,
                         "--max-message-mib", "512", *_state_slots(args)),
            draft_args=(*PREFIX_CACHING_OFF, "--kv-budget", args.draft_kv,
                        "--attention-backend", args.draft_backend,
                        "--token-budget", "8192", "--max-message-mib", "512"),
            gateway_args=("--wire", self.wires[0], "--max-message-mib", "512"),
            spec_tree_nodes=0,      # chains: forced acceptance is a chain's (dflash up: trees on GPU)
            target_hooks=HookFlags(random_weights=True, force_tau=tau or 0.0),
            draft_hooks=HookFlags(random_weights=True),
            # --tiny on the CPU: the GPU's gateway settings (the drafter's block of 16, drafting
            # at every load), not the launcher's CPU defaults (a block of 4, no drafts above 1)
            **({"block_size": 16, "spec_disable_batch_size": 0} if args.tiny else {}))
        self.stack = Stack(self.opts)
        self.gateways = {self.wires[0]: (self.opts.port, self.opts.http_port)}

    def start(self) -> dict:
        t0 = time.monotonic()
        health: list[HealthLog] = []
        self.stack.start()              # children first: no fork while gRPC threads run here
        health.append(HealthLog("target", f"127.0.0.1:{self.opts.target_port}",
                                "dflash.v1.Target", t0))
        if self.opts.drafter != "none":
            health.append(HealthLog("draft", f"127.0.0.1:{self.opts.draft_port}",
                                    "dflash.v1.Draft", t0))
        self.stack.wait_ready()
        events = {h.name: h.stop() for h in health}
        if self.opts.drafter != "none" and len(self.wires) > 1:
            self._second_gateway(self.wires[1])
        time.sleep(0.5)
        return {"ready_s": round(time.monotonic() - t0, 1), "health": events}

    def _second_gateway(self, wire: str) -> None:
        """Another gateway on the same target and draft, with the other wire."""
        from dflash.stack import readiness
        port, http = free_port(), free_port()
        child = self.stack.add_gateway(f"gateway-{wire}", port, http, "--wire", wire)
        deadline = time.monotonic() + 120
        while not readiness(f"http://127.0.0.1:{http}")[0]:
            if time.monotonic() > deadline or child.exited() is not None:
                raise RuntimeError(f"gateway --wire {wire} not ready:\n{child.tail()}")
            time.sleep(0.2)
        self.gateways[wire] = (port, http)

    def snapshot(self, wire: str) -> dict:
        out = {"gateway": scrape(self.gateways[wire][1]),
               "target": scrape(self.opts.target_metrics_port)}
        if self.opts.drafter != "none":
            out["draft"] = scrape(self.opts.draft_metrics_port)
        return out

    def stop(self) -> None:
        self.stack.stop()


def service_rows(stack: GpuStack, prompts: list[list[int]], max_tokens: int, wire: str,
                 levels, label: str) -> list[dict]:
    port = stack.gateways[wire][0]
    address = f"127.0.0.1:{port}"
    asyncio.run(drive(address, prompts[:2], 2, 16))                       # warm-up
    rows = []
    for c in levels:
        batch = [prompts[i % len(prompts)] for i in range(max(c, 4))]
        before = stack.snapshot(wire)
        tokens, seconds = asyncio.run(drive(address, batch, c, max_tokens))
        split = step_breakdown(before, stack.snapshot(wire))
        row = {"config": label, "wire": wire, "feature_plane": stack.plane,
               "forced_tau": stack.tau, "concurrency": c,
               "requests": len(batch), "tokens": tokens, "seconds": round(seconds, 3),
               "tokens_per_s": round(tokens / seconds, 1),
               **{k: round(v, 3) if isinstance(v, float) else v for k, v in split.items()}}
        print(json.dumps(row), flush=True)
        rows.append(row)
    return rows


def service_profile(stack: GpuStack, prompts: list[list[int]], max_tokens: int, wire: str,
                    seconds: float, out: Path, concurrency: int = 1) -> dict:
    """py-spy on the three processes (bench/host_profile.py) while requests run `concurrency`
    at a time for `seconds`: where each process's host time goes."""
    from bench import host_profile
    address = f"127.0.0.1:{stack.gateways[wire][0]}"
    gateway = "gateway" if wire == stack.wires[0] else f"gateway-{wire}"   # the wire's own
    pids = {"gateway" if c.name == gateway else c.name: c.proc.pid for c in stack.stack.children
            if c.name in ("target", "draft", gateway)}

    def run_once(i: int) -> int:
        batch = [prompts[(i * concurrency + k) % len(prompts)] for k in range(concurrency)]
        return asyncio.run(drive(address, batch, concurrency, max_tokens))[0]

    result = host_profile.while_driving(pids, seconds, out, run_once)
    if "rounds" in result:
        result["requests"] = result.pop("rounds") * concurrency
    return {"wire": wire, "concurrency": concurrency, **result}


def service_ttft(stack: GpuStack, prompt: list[int], wire: str) -> dict:
    """Time to the first streamed token of a 1000-token prompt, and to the second event (the
    first speculative step: the draft receives the prompt's features first)."""
    import grpc

    from dflash.v1 import common_pb2, gateway_pb2, gateway_pb2_grpc
    address = f"127.0.0.1:{stack.gateways[wire][0]}"
    out = []
    for _ in range(3):
        with grpc.insecure_channel(address, options=[("grpc.max_receive_message_length", 1 << 29)]) as ch:
            stub = gateway_pb2_grpc.GatewayStub(ch)
            req = gateway_pb2.GenerateRequest(token_ids=gateway_pb2.TokenIds(ids=prompt),
                                              max_tokens=8, ignore_eos=True,
                                              sampling=common_pb2.SamplingParams(temperature=0))
            t0 = time.perf_counter()
            times = [time.perf_counter() - t0 for _ in stub.Generate(req, timeout=600)]
        out.append({"ttft_ms": round(1000 * times[0], 2),
                    "second_event_ms": round(1000 * times[1], 2) if len(times) > 1 else None})
    return {"runs": out, "ttft_ms": sorted(r["ttft_ms"] for r in out)[1]}


# -- (c): in-process ---------------------------------------------------------------------------
def inprocess(tdir: Path, ddir: Path | None, args, prompts, max_tokens: int, tau: float | None,
              levels, ttft_prompts: dict[int, list[int]] | None) -> dict:
    from runtime.sampling import SamplingConfig
    from services.common.hooks import ServiceHooks
    from services.draft.config import DraftConfig
    from services.target.config import TargetConfig
    from services.target.hooks import TargetHooks
    from train.inproc import speculate, start_engines
    taps = tuple(json.loads((ddir / "config.json").read_text())["dflash_config"]["target_layer_ids"]) \
        if ddir is not None else ()
    forced = ForcedAcceptance(tau) if tau is not None else None
    engines = start_engines(
        TargetConfig(model_dir=str(tdir), device=args.device, dtype=args.dtype,
                     attention_backend=args.backend, max_block_size=16,
                     kv_budget_bytes=_bytes(args.target_kv), graph_capture_layers=taps,
                     token_budget=2048, deterministic=args.deterministic),
        DraftConfig(target_dir=str(tdir), model_dir=str(ddir), device=args.device,
                    dtype=args.dtype, attention_backend=args.draft_backend,
                    kv_budget_bytes=_bytes(args.draft_kv), token_budget=8192,
                    deterministic=args.deterministic)
        if ddir is not None else None,
        TargetHooks(random_weights=True, forced_acceptance=forced), ServiceHooks(random_weights=True))
    engines.target.worker.capture_cuda_graphs()
    out: dict = {"rows": []}
    if engines.draft is not None:
        engines.draft.drafter.capture_cuda_graphs()
        out["draft_graph_check"] = draft_graph_check(engines.draft.drafter)
        print("draft graph check", out["draft_graph_check"], flush=True)
    block = 16 if ddir is not None else 1
    try:
        asyncio.run(_inproc_wave(engines, prompts[:2], 16, block, speculate, SamplingConfig()))
        for c in levels:
            batch = [prompts[i % len(prompts)] for i in range(max(c, 4))]
            t0 = time.perf_counter()
            results = asyncio.run(_inproc_wave(engines, batch, max_tokens, block, speculate,
                                               SamplingConfig(), c))
            seconds = time.perf_counter() - t0
            tokens = sum(len(r.tokens) for r in results)
            steps = sum(r.steps for r in results)
            row = {"config": "in-process", "forced_tau": tau, "concurrency": c,
                   "tokens": tokens, "seconds": round(seconds, 3),
                   "tokens_per_s": round(tokens / seconds, 1), "steps": steps,
                   "tau_measured": round(sum(r.tau * r.steps for r in results) / max(1, steps), 3),
                   "draft_ms": round(1000 * sum(r.draft_seconds for r in results) / max(1, steps), 3),
                   "verify_ms": round(1000 * sum(r.verify_seconds for r in results) / max(1, steps), 3)}
            print(json.dumps(row), flush=True)
            out["rows"].append(row)
        if ttft_prompts:
            out["ttft_by_len"] = {n: _inproc_ttft(engines, p, taps) for n, p in ttft_prompts.items()}
            out["ttft"] = next(iter(out["ttft_by_len"].values()))
    finally:
        engines.stop()
        del engines
        torch.cuda.empty_cache() if torch.cuda.is_available() else None
    return out


def draft_graph_check(drafter, ctx: int = 40, batch: int = 3) -> dict:
    """The captured path (context append + block forward graphs) against the eager one on the
    same features: drafts that agree, out of all. Run while the engine is idle."""
    graphs = drafter._append_graphs
    eager = _drafts(drafter, "eager", ctx, batch, graphed=False)
    graphed = _drafts(drafter, "graphed", ctx, batch, graphed=True)
    drafter._append_graphs = graphs
    same = sum(a == b for x, y in zip(eager, graphed) for a, b in zip(x, y))
    return {"graph_captured": drafter._graph is not None and graphs is not None, "agree": same,
            "drafts": sum(len(x) for x in eager)}


def _drafts(drafter, name: str, ctx: int, batch: int, graphed: bool) -> list[list[int]]:
    """Each sequence's draft tokens for one block, through propose() (which replays the captured
    graphs where there are some) or run() (eager); both return DraftTree objects."""
    from services.draft.drafter import ProposeItem
    from services.draft.sequence import DraftSequence
    saved = drafter._append_graphs
    if not graphed:
        drafter._append_graphs = None
    seqs = [DraftSequence(f"check-{name}-{i}") for i in range(batch)]
    g = torch.Generator().manual_seed(1)
    feats = torch.randn(ctx, drafter.facts.feature_width, generator=g).to(
        getattr(torch, drafter.facts.feature_dtype))
    for s in seqs:                       # appended in 8-row pieces, as steps append them
        for start in range(0, ctx, 8):
            item = ProposeItem(seq=s, start=start, num_new=8, features=feats[start: start + 8],
                               token_ids=[0] * 8, anchor=1, block_size=1)
            drafter.reserve(item)
            drafter.run([item])
            s.context_len = start + 8
    blocks = [ProposeItem(seq=s, start=ctx, num_new=0, features=None, token_ids=[],
                          anchor=7 + i, block_size=16) for i, s in enumerate(seqs)]
    for it in blocks:
        drafter.reserve(it)
    out = [t.tokens for t in drafter.propose(blocks)] if graphed else drafter.run(blocks).drafts
    for s in seqs:
        drafter.release(s)
    drafter._append_graphs = saved
    return out


async def _inproc_wave(engines, prompts, max_tokens, block, speculate, sampling, concurrency=None):
    sem = asyncio.Semaphore(concurrency or len(prompts))

    async def one(i, ids):
        async with sem:
            return await speculate(engines, f"b{i}-{time.monotonic_ns()}", ids, max_tokens, block,
                                   sampling, set())
    return await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts)))


def _inproc_ttft(engines, prompt: list[int], taps: tuple[int, ...]) -> dict:
    """Prefill of the prompt with feature capture (returns the first token), then the draft
    appending those features and proposing the first block."""
    from runtime.sampling import SamplingConfig
    from services.draft.engine import ProposeCall
    from services.target.engine import PrefillCall

    async def once(i: int) -> dict:
        seq = f"ttft-{i}"
        t0 = time.perf_counter()
        pre = await engines.target.prefill(PrefillCall(seq, prompt, SamplingConfig(), taps,
                                                       torch.bfloat16))
        t1 = time.perf_counter()
        if engines.draft is not None:
            await engines.draft.propose(ProposeCall(seq, 0, len(prompt), pre.features, prompt,
                                                    pre.next_token, 16))
            await engines.draft.release(seq)
        t2 = time.perf_counter()
        await engines.target.release(seq)
        return {"ttft_ms": round(1000 * (t1 - t0), 2), "first_propose_ms": round(1000 * (t2 - t1), 2)}
    runs = [asyncio.run(once(i)) for i in range(3)]
    return {"runs": runs, "ttft_ms": sorted(r["ttft_ms"] for r in runs)[1]}


def _bytes(text: str) -> int:
    from services.common.flags import parse_size
    return parse_size(text)


# -- (b): transformers -------------------------------------------------------------------------
def transformers_rows(cfg: dict, args, prompt_len: int, max_tokens: int, levels) -> list[dict]:
    from transformers import AutoConfig, AutoModelForCausalLM
    hf_cfg = AutoConfig.for_model(**{k: v for k, v in cfg.items() if k != "architectures"})
    dtype = torch.bfloat16 if args.device == "cuda" else torch.float32
    with torch.device(args.device):
        model = AutoModelForCausalLM.from_config(hf_cfg, dtype=dtype).eval()
    rows = []
    for impl in ("static", "dynamic"):
        for c in levels:
            if time.monotonic() > args.transformers_deadline:
                rows.append({"config": f"transformers-{impl}", "concurrency": c,
                             "skipped": "time budget of the run"})
                continue
            ids = torch.randint(0, 500, (c, prompt_len), device=args.device)
            extra = {"cache_implementation": "static"} if impl == "static" else {}
            kw = dict(max_new_tokens=max_tokens, min_new_tokens=max_tokens, do_sample=False,
                      **extra)
            t0 = time.perf_counter()
            model.generate(ids, **kw)                      # compiles (static) / warms up
            _sync(args.device)
            first = time.perf_counter() - t0
            t0 = time.perf_counter()
            model.generate(ids, **kw)
            _sync(args.device)
            seconds = time.perf_counter() - t0
            row = {"config": f"transformers-{impl}", "concurrency": c,
                   "tokens": c * max_tokens, "seconds": round(seconds, 3),
                   "tokens_per_s": round(c * max_tokens / seconds, 1),
                   "first_call_s": round(first, 1)}
            print(json.dumps(row), flush=True)
            rows.append(row)
    del model
    return rows


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


# -- report ------------------------------------------------------------------------------------
def plot(data: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    rows = [r for r in data.get("rows", []) if "tokens_per_s" in r]
    series: dict[str, dict[int, float]] = {}
    for r in rows:
        name = r["config"] + (f" ({r['wire']})" if r.get("wire") else "") + \
            (f" tau={r['forced_tau']:g}" if r.get("forced_tau") else "")
        series.setdefault(name, {})[r["concurrency"]] = r["tokens_per_s"]
    fig, ax = plt.subplots(figsize=(11, 5.5))
    width = 0.8 / max(1, len(series))
    for k, (name, vals) in enumerate(sorted(series.items())):
        xs = [LEVELS.index(c) + k * width for c in vals if c in LEVELS]
        ax.bar(xs, [vals[c] for c in vals if c in LEVELS], width, label=name)
    ax.set_xticks([i + 0.4 - width / 2 for i in range(len(LEVELS))], [f"c={c}" for c in LEVELS])
    ax.set_yscale("log")
    ax.set_ylabel("output tokens/s (log)")
    ax.set_title(f"Qwen3-8B-shaped target + 5-layer DFlash drafter, {data.get('device', '')}; "
                 "speculative rows at FORCED tau", fontsize=10)
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def _state_slots(args: argparse.Namespace) -> tuple[str, ...]:
    """A hybrid target's state pool sized for the most requests in flight (+2), not the
    default 64 slots: each holds 1 + 16 states of every recurrent layer (a Qwen3.5-9B shape:
    0.9 GB a slot), which at 64 slots passed the KV budget."""
    layer_types = SHAPES[args.shape][0].get("layer_types", ())
    if "linear_attention" not in layer_types:
        return ()
    return ("--state-slots", str(max(args.levels) + 2))


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tiny", action="store_true",
                    help="small shape on CPU (smoke test; --out defaults to a temporary folder)")
    ap.add_argument("--out", default=os.environ.get("OUT", "/tmp/gpu_side_by_side"))
    ap.add_argument("--parts", nargs="*", default=["ar", "services", "inproc", "transformers"])
    ap.add_argument("--shape", default="qwen3-8b", choices=sorted(SHAPES),
                    help="the target's shape (random weights): deepseek-v2-lite is MLA + MoE "
                         "(parts ar and services)")
    ap.add_argument("--kv-cache-dtype", default="auto", help="the target's: auto | fp8_e4m3")
    ap.add_argument("--attention-backend", default="triton", help="on a GPU: triton | flashinfer")
    ap.add_argument("--draft-attention-backend", default="",
                    help="the draft's, where it differs (default: --attention-backend)")
    ap.add_argument("--target-kv", default="40GiB",
                    help="the target's KV budget on a GPU (the H200's sizing; an 80 GB card "
                         "takes about 20GiB beside the DeepSeek-V2-Lite shape's 31 GB weights)")
    ap.add_argument("--draft-kv", default="6GiB", help="the draft's KV budget on a GPU")
    ap.add_argument("--deterministic", action="store_true",
                    help="the target and the draft with batch-invariant kernels (its cost)")
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--transformers-budget-s", type=float, default=240)
    ap.add_argument("--ttft-lens", nargs="+", type=int, default=[TTFT_PROMPT],
                    help="prompt lengths whose time to first token is measured")
    ap.add_argument("--levels", nargs="+", type=int, default=list(LEVELS),
                    help="concurrency levels, in the order they run")
    ap.add_argument("--wires", nargs="+", default=list(WIRES), choices=(*WIRES, "socket"),
                    help="the gateways' --wire, one gateway each on the same services (the "
                         "first also serves the autoregressive rows); socket: the services' "
                         "call sockets (dflash up gives them one)")
    ap.add_argument("--taus", nargs="+", type=float, default=list(TAUS))
    ap.add_argument("--feature-planes", nargs="+", default=["auto"],
                    choices=["auto", "cuda-ipc", "shm", "stream", "off"],
                    help="the target's --feature-plane of each speculative stack (one stack each)")
    ap.add_argument("--profile-seconds", type=float, default=0,
                    help="after each speculative stack's rows: py-spy on its three processes "
                         "for this long while requests run one at a time (bench/host_profile.py)")
    ap.add_argument("--profile-concurrency", nargs="+", type=int, default=[1],
                    help="requests in flight while profiling (one profile each)")
    args = ap.parse_args(argv)
    tiny_outputs(args, ap, "gpu_side_by_side", ("out",))
    args.device = "cpu" if args.tiny else "cuda"
    args.dtype = "float32" if args.tiny else "bfloat16"
    args.backend = "torch" if args.tiny else args.attention_backend
    args.draft_backend = "torch" if args.tiny else args.draft_attention_backend or args.backend
    if args.tiny:
        args.target_kv, args.draft_kv = "64MiB", "32MiB"
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    rec = Recorder(out / "gpu_side_by_side.json")
    shape, taps, draft_base = SHAPES[args.shape]
    if args.tiny:                       # a CPU-sized shape of the same kind
        hybrid = draft_base is not None
        shape, taps = (tiny_hybrid(shape), [0, 1, 2, 3]) if hybrid else (TINY, [1, 2, 3, 4, 5])
        draft_base = {**TINY, "vocab_size": shape["vocab_size"]} if hybrid else None
    levels = (1, 2) if args.tiny else tuple(args.levels)
    max_tokens = 24 if args.tiny else args.max_tokens
    prompt_len = 16 if args.tiny else args.prompt_len
    ttft_lens = [64] if args.tiny else args.ttft_lens
    tdir, ddir = write_model_dirs(out / "models" if args.tiny
                                  else Path("/tmp/gpu_side_by_side_models"), shape, taps,
                                  draft_base)
    copy_tokenizer(tdir)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 500, (prompt_len,), generator=g).tolist() for _ in range(64)]
    ttft_prompts = {n: torch.randint(0, 500, (n,), generator=g).tolist() for n in ttft_lens}
    rec.put("device", torch.cuda.get_device_name() if args.device == "cuda" else "cpu (--tiny)")
    if args.tiny:
        for key, value in tiny_fields(TINY_SKIPPED).items():
            rec.put(key, value)
    taus = tuple(args.taus[:1] if args.tiny else args.taus)   # --tiny: one forced tau
    rec.put("setup", {"target": f"{args.shape} shape, random bf16" if not args.tiny else "tiny",
                      "kv_cache_dtype": args.kv_cache_dtype,
                      "deterministic": args.deterministic,
                      "drafter": f"DFlash 5 layers, taps {taps}, block 16",
                      "prompt_tokens": prompt_len, "max_tokens": max_tokens,
                      "forced_tau": list(taus),
                      "hooks": ["random_weights", "forced_acceptance"]})
    bw = copy_bandwidth(args.device)
    wb = weight_bytes({"head_dim": shape["hidden_size"] // shape["num_attention_heads"], **shape},
                      5, len(taps))      # MLA + MoE shapes: a dense estimate (an upper bound)
    rec.put("floor", {"copy_GBps": round(bw, 1), "target_bytes": wb["target"],
                      "draft_bytes": wb["draft"],
                      "floor_ms_per_step": round(1000 * (wb["target"] + wb["draft"]) / (bw * 1e9), 3),
                      "target_floor_ms": round(1000 * wb["target"] / (bw * 1e9), 3),
                      "note": "bytes of weights read per step / measured device copy bandwidth "
                              "(bytes read + written per second)"})
    rows: list[dict] = []
    args.transformers_deadline = time.monotonic() + args.transformers_budget_s

    def keep(new: list[dict]) -> None:
        rows.extend(new)
        rec.put("rows", rows)

    if "ar" in args.parts:
        guarded(rec, "services_ar", lambda: _stack_part(tdir, None, args, out, taps, None, prompts,
                                                        max_tokens, levels, ttft_prompts, keep))
    if "services" in args.parts:
        for tau in taus:
            for plane in args.feature_planes:
                guarded(rec, f"services_tau{tau:g}" + ("" if plane == "auto" else f"_{plane}"),
                        lambda tau=tau, plane=plane: _stack_part(
                            tdir, ddir, args, out, taps, tau, prompts, max_tokens, levels,
                            ttft_prompts, keep, plane))
    if "inproc" in args.parts:
        for tau in taus:
            def run_inproc(tau=tau):
                res = inprocess(tdir, ddir, args, prompts, max_tokens, tau, levels,
                                ttft_prompts if tau == taus[0] else None)
                keep(res["rows"])
                if "draft_graph_check" in res:      # was printed only: kept in the JSON now
                    rec.put(f"inproc_tau{tau:g}_draft_graph_check", res["draft_graph_check"])
                if "ttft_by_len" in res:
                    rec.put(f"inproc_tau{tau:g}_ttft_by_len", res["ttft_by_len"])
                return res.get("ttft")
            guarded(rec, f"inproc_tau{tau:g}_ttft", run_inproc)
    if "transformers" in args.parts:
        args.transformers_deadline = time.monotonic() + args.transformers_budget_s
        guarded(rec, "transformers", lambda: keep(transformers_rows(shape, args, prompt_len,
                                                                    max_tokens, levels)) or "done")
    plot({**rec.data, "rows": rows}, out / "gpu_side_by_side.png")
    print("wrote", out, flush=True)
    failed = sorted(k for k in rec.data if k.endswith("_error"))
    if args.tiny and failed:            # a smoke test fails loudly; a GPU run keeps its parts
        raise SystemExit(f"--tiny: parts failed: {failed}")


def _stack_part(tdir, ddir, args, out, taps, tau, prompts, max_tokens, levels, ttft_prompts,
                keep, plane: str = "auto") -> dict:
    name = "ar" if ddir is None else f"spec-tau{tau:g}-{plane}"
    stack = GpuStack(tdir, ddir, args, out / f"logs-{name}", taps, tau, plane)
    try:
        info = stack.start()
        info["feature_plane"] = plane
        wires = stack.wires if ddir is not None else stack.wires[:1]
        label = "AR service" if ddir is None else "spec services"
        for wire in wires:
            keep(service_rows(stack, prompts, max_tokens, wire, levels, label))
        if args.profile_seconds and ddir is not None:
            wire = "stream" if "stream" in wires else wires[0]
            for c in args.profile_concurrency:
                key = "host_profile" if c == 1 else f"host_profile_c{c}"
                info[key] = service_profile(stack, prompts, max_tokens, wire, args.profile_seconds,
                                            out / f"profile-{name}-c{c}", c)
        info["ttft_by_len"] = {n: {w: service_ttft(stack, p, w) for w in wires}
                               for n, p in ttft_prompts.items()}
        info["ttft"] = next(iter(info["ttft_by_len"].values()))
    finally:
        stack.stop()
        for log in (out / f"logs-{name}").glob("*.log"):
            shutil.copy(log, out / f"{name}-{log.name}")
    info["features_travel"] = features_travel(out / f"logs-{name}")
    return info


if __name__ == "__main__":
    main()
