"""python -m bench.draft_cpu [--out bench/results/draft_cpu.json]: the draft service on CPU with
SmolLM2-135M-Instruct as the target and random DFlash drafters of its trained shape (1 and 2
layers, hidden 576, 9 heads / 3 kv heads, block 16, fp32), or with --draft-model DIR that
drafter; --dtypes: the draft dtypes measured, each row in each (default fp32).

Measured through the real DraftEngine (engine thread, paged context KV, batched step):
  - Propose latency for blocks of 4, 8, 16: each step appends 4 new feature rows (an accepted
    block's worth) to a 512-token context and drafts one block; batch 1 and batch 8 sequences.
  - the cost of appending 1 000 tokens of features (one Propose of 1 000 rows, block 1: fc +
    hidden_norm + per-layer k/v projection, k_norm, RoPE and the cache store; no block forward).
  - with --grpc (default on): the same Propose (block 16, batch 1) through a real
    `python -m services.draft` process, client-side round trip including feature encoding.
--tiny: a 1-layer random drafter, blocks 4 and 16, batches 1 and 2, a context of 64 tokens,
appends of 100, 2 timed steps (a smoke test; --out defaults to a temporary folder)."""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from bench.tiny import add_tiny_flag, tiny_fields, tiny_outputs
from dflash.make_draft import make_random_drafter
from runtime import threads
from services.common.ports import free_port
from services.draft.config import DraftConfig
from services.draft.dflash_drafter import DFlashDrafter
from services.draft.engine import DraftEngine, ProposeCall

BLOCKS, BATCHES, LAYERS = (4, 8, 16), (1, 8), (1, 2)
CONTEXT, NEW_ROWS, APPEND = 512, 4, 1000


def feats(n: int, width: int, seed: int) -> torch.Tensor:
    return torch.randn(n, width, generator=torch.Generator().manual_seed(seed)).to(torch.bfloat16)


def summary(samples: list[float]) -> dict[str, float]:
    ms = sorted(s * 1000 for s in samples)
    return {"median_ms": round(statistics.median(ms), 3),
            "p90_ms": round(ms[int(0.9 * (len(ms) - 1))], 3), "n": len(ms)}


class Bench:
    def __init__(self, draft: Path, target: Path, compute_threads: int,
                 dtype: str = "float32", context: int = CONTEXT, append: int = APPEND) -> None:
        self.context, self.append = context, append
        self.config = DraftConfig(target_dir=str(target), model_dir=str(draft), dtype=dtype,
                                  kv_budget_bytes=512 << 20)
        drafter = DFlashDrafter(self.config)
        drafter.init_backend()
        self.width = drafter.facts.feature_width
        self.engine = DraftEngine(drafter, self.config)
        self.engine.start()
        if compute_threads:      # the engine thread's count, set there before any step
            self.engine.loop.call(lambda: threads.parallel(compute_threads))
        self.loop = asyncio.new_event_loop()

    def close(self) -> None:
        self.engine.stop()
        self.loop.close()

    def run(self, calls: list[ProposeCall]) -> float:
        """Seconds for one engine iteration's worth of Proposes (submitted together)."""
        async def go():
            t0 = time.perf_counter()
            await asyncio.gather(*(self.engine.propose(c) for c in calls))
            return time.perf_counter() - t0
        return self.loop.run_until_complete(go())

    def propose_latency(self, block: int, batch: int, steps: int) -> dict[str, float]:
        ids = [f"b{block}-{batch}-{i}" for i in range(batch)]
        context = self.context
        self.run([ProposeCall(s, 0, context, feats(context, self.width, i), [], 1, 1)
                  for i, s in enumerate(ids)])
        step_feats = feats(NEW_ROWS, self.width, 99)
        samples = []
        for k in range(steps + 2):
            start = context + k * NEW_ROWS
            seconds = self.run([ProposeCall(s, start, NEW_ROWS, step_feats, [], 7, block)
                                for s in ids])
            if k >= 2:                                  # two warm-up steps
                samples.append(seconds)
        for s in ids:
            self.loop.run_until_complete(self.engine.release(s))
        return {"block": block, "batch": batch, "context": context, "new_rows": NEW_ROWS,
                **summary(samples)}

    def append_cost(self, reps: int) -> dict[str, float]:
        rows = feats(self.append, self.width, 5)
        samples = []
        for r in range(reps + 1):
            seconds = self.run([ProposeCall(f"append-{r}", 0, self.append, rows, [], 1, 1)])
            self.loop.run_until_complete(self.engine.release(f"append-{r}"))
            if r:
                samples.append(seconds)
        out = summary(samples)
        return {"tokens": self.append, **out,
                "us_per_token": round(out["median_ms"] * 1000 / self.append, 2)}


def grpc_latency(draft: Path, target: Path, steps: int, context: int = CONTEXT) -> dict[str, float]:
    import grpc

    from dflash.v1 import common_pb2, draft_pb2, draft_pb2_grpc
    from services.common import tensor_codec
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "services.draft", "--model", str(draft),
                             "--target-model", str(target), "--port", str(port), "--host",
                             "127.0.0.1", "--log-level", "WARNING"])
    try:
        with grpc.insecure_channel(f"127.0.0.1:{port}") as ch:
            grpc.channel_ready_future(ch).result(timeout=120)
            stub = draft_pb2_grpc.DraftStub(ch)
            width = 576 * len(json.loads((draft / "config.json").read_text())
                              ["dflash_config"]["target_layer_ids"])
            _wait_serving(f"127.0.0.1:{port}")
            stub.Propose(draft_pb2.ProposeRequest(
                sequence_id="g", positions=range(context),
                new_features=tensor_codec.encode(feats(context, width, 1)), anchor=1,
                block_size=1), timeout=60)
            step = feats(NEW_ROWS, width, 2)
            samples = []
            for k in range(steps + 2):
                start = context + k * NEW_ROWS
                t0 = time.perf_counter()
                stub.Propose(draft_pb2.ProposeRequest(
                    sequence_id="g", positions=range(start, start + NEW_ROWS),
                    new_features=tensor_codec.encode(step), anchor=7, block_size=16), timeout=60)
                if k >= 2:
                    samples.append(time.perf_counter() - t0)
            stub.Release(common_pb2.ReleaseRequest(sequence_id="g"), timeout=30)
    finally:
        proc.terminate()
        proc.wait(30)
    return {"block": 16, "batch": 1, "context": context, "new_rows": NEW_ROWS, **summary(samples)}



def _wait_serving(address: str) -> None:
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc
    deadline = time.monotonic() + 120
    with grpc.insecure_channel(address) as ch:
        health = health_pb2_grpc.HealthStub(ch)
        while time.monotonic() < deadline:
            status = health.Check(health_pb2.HealthCheckRequest(service="dflash.v1.Draft"),
                                  timeout=5).status
            if status == health_pb2.HealthCheckResponse.SERVING:
                return
            time.sleep(0.2)
    raise TimeoutError("draft service not SERVING")


def markdown(result: dict) -> str:
    lines = ["| draft layers | dtype | block B | batch | Propose median ms | p90 ms |",
             "|---|---|---|---|---|---|"]
    for r in result["propose"]:
        lines.append(f"| {r['layers']} | {r.get('dtype', 'float32')} | {r['block']} | "
                     f"{r['batch']} | {r['median_ms']:.2f} | {r['p90_ms']:.2f} |")
    lines += ["", "| draft layers | dtype | append 1 000 feature rows: median ms | µs per token |",
              "|---|---|---|---|"]
    for r in result["append"]:
        lines.append(f"| {r['layers']} | {r.get('dtype', 'float32')} | {r['median_ms']:.2f} | "
                     f"{r['us_per_token']:.2f} |")
    for r in result.get("grpc", []):
        text = (f"gRPC round trip (client side, {r['layers']} layer, B = 16, batch 1, "
                f"{r['new_rows']} new rows): median {r['median_ms']:.2f} ms, "
                f"p90 {r['p90_ms']:.2f} ms.")
        lines += ["", text]
    return "\n".join(lines)


def drafters(draft_model: str, target: Path, tmp: Path, layers: tuple[int, ...] = LAYERS
             ) -> list[tuple[int, Path]]:
    """(layers, checkpoint dir): --draft-model's, else random ones of each of `layers`."""
    if draft_model:
        n = json.loads((Path(draft_model) / "config.json").read_text())["num_hidden_layers"]
        return [(n, Path(draft_model))]
    return [(n, make_random_drafter(target, tmp / f"d{n}", num_layers=n, block_size=16))
            for n in layers]


def measure(result: dict, bench: Bench, tags: dict, args: argparse.Namespace) -> None:
    """Every Propose row and the append row of one drafter in one dtype into result."""
    blocks, batches = getattr(args, "blocks", BLOCKS), getattr(args, "batches", BATCHES)
    try:
        bench.propose_latency(max(blocks), max(batches), 2)     # untimed warm-up
        for block in blocks:
            for batch in batches:
                row = {**tags, **bench.propose_latency(block, batch, args.steps)}
                result["propose"].append(row)
                print(json.dumps(row), flush=True)
        row = {**tags, **bench.append_cost(args.reps)}
        result["append"].append(row)
        print(json.dumps(row), flush=True)
    finally:
        bench.close()


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m bench.draft_cpu", description=__doc__.splitlines()[0])
    p.add_argument("--out", default="bench/results/draft_cpu.json")
    p.add_argument("--steps", type=int, default=20, help="timed Propose steps per row")
    p.add_argument("--reps", type=int, default=5, help="timed 1 000-row appends")
    p.add_argument("--threads", type=int, default=0,
                   help="the engine thread's torch threads (0 = torch's default)")
    p.add_argument("--no-grpc", action="store_true", help="skip the gRPC round-trip row")
    p.add_argument("--draft-model", default="", help="this drafter instead of random ones")
    p.add_argument("--dtypes", nargs="+", default=["float32"], help="draft dtypes measured")
    add_tiny_flag(p)
    args = p.parse_args(argv)
    tiny_outputs(args, p, "draft_cpu", ("out",))
    args.blocks, args.batches, layers, context, append = BLOCKS, BATCHES, LAYERS, CONTEXT, APPEND
    if args.tiny:                       # every row kind, at the smallest sizes
        args.blocks, args.batches, layers, context, append = (4, 16), (1, 2), (1,), 64, 100
        args.steps, args.reps = 2, 1
    threads.serial()            # only the engine thread computes in parallel (runtime.threads)
    from dflash.prepare.smollm2 import prepare_smollm2
    target = prepare_smollm2(["float32"], progress=False)["float32"]
    result: dict = {"machine": platform.platform(), "processor": platform.processor(),
                    "torch": torch.__version__, "threads": args.threads or threads.COMPUTE_THREADS,
                    "target": "smollm2-135m-instruct fp32", "draft_dtypes": args.dtypes,
                    "draft_model": args.draft_model or "random",
                    "feature_dtype": "bfloat16", "load_average_before": os.getloadavg(),
                    "propose": [], "append": []}
    if args.tiny:
        result.update(tiny_fields())
    with tempfile.TemporaryDirectory() as tmp:
        for n, draft in drafters(args.draft_model, target, Path(tmp), layers):
            for dtype in args.dtypes:
                measure(result, Bench(draft, target, args.threads, dtype, context, append),
                        {"layers": n, "dtype": dtype}, args)
            if n == 1 and not args.no_grpc:
                row = {"layers": 1, **grpc_latency(draft, target, args.steps, context)}
                result["grpc"] = [row]
                print(json.dumps(row), flush=True)
    result["load_average_after"] = os.getloadavg()
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(markdown(result))


if __name__ == "__main__":
    main()
