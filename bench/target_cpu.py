"""python -m bench.target_cpu [--threads N] [--repeats R]: the target service on CPU with
SmolLM2-135M-Instruct in fp32.

Measured through the real TargetEngine in this process (engine thread, paged KV, acceptance):
  - Verify latency for blocks of 1, 4, 8, 16 tokens at a context of 256 cached tokens. Drafts are
    random (nearly all rejected); after every Verify the sequence is rewound to 256 on the engine
    thread, so every repeat sees the same context. Block sizes are interleaved round by round,
    so all of them see the same machine load. `step_median_ms` is the engine step alone
    (forward, logits, acceptance) without the asyncio hand-offs.
  - Prefill throughput (tokens/s) for prompts of 64, 256 and 1024 tokens (token budget 512, so
    the longest runs in two chunks).
  - unless --no-transformers: transformers' own forward of the same q tokens over 256 cached
    ones (DynamicCache, cropped back), timed in the same rounds: a same-load comparison.
  - unless --no-grpc: Verify of 1 and 16 tokens through a real `python -m services.target`
    on loopback, client-side round trip; there the context grows by about one token per call.
Writes JSON (--out) and the "Target service (CPU)" section of docs/benchmarks.md (--doc).
--tiny: every part with 2 repeats and prefills of 64 and 256 tokens (a smoke test; --out and
--doc default to a temporary folder)."""
from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import os
import statistics
import sys
import threading
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import TypeVar

import torch

from bench.report import machine, save
from bench.tiny import add_tiny_flag, tiny_fields, tiny_outputs
from runtime import threads as compute_threads
from runtime.layers.linear import cpu_gemm
from runtime.sampling import SamplingConfig
from services.target.config import TargetConfig
from services.target.engine import PrefillCall, TargetEngine
from services.target.worker import TargetWorker

T = TypeVar("T")

BLOCKS = (1, 4, 8, 16)
PREFILL_LENGTHS = (64, 256, 1024)
CONTEXT = 256
# transformers 5.24 on the project's CPU machine, fp32, one forward over q new tokens with 200
# cached (../shared/reference/cpu_measurements.md)
HF_ANCHOR_MS = {1: 57.6, 2: 97.5, 4: 107.0, 8: 92.6, 16: 109.0, 32: 144.0, 64: 201.0}
SECTION = "## Target service (CPU)"
NOTES = """The row "transformers, same run" is the fairest comparison: the same forward (q tokens
over 256 cached, all q rows of logits), timed in the same rounds and on the same thread - the
engine's, which holds the process's one OpenMP pool (runtime/threads.py says why a second
computing thread would slow both).
Our engine's GEMMs go through the CPU GEMM registry of runtime/layers/linear.py (section "CPU
compute: GEMM and threads"): MKL as W · xᵀ at 1-4 rows and oneDNN above, where transformers
calls MKL as x · Wᵀ. That is most of the gap at every block size. A verify of 1-4 tokens costs
about one decode step, which is why `dflash up` verifies blocks of 4 on the CPU.
Where the time goes (torch profiler, measured before the GEMM registry): the GEMMs were 80-90 %
of a verify at every block size (4 per layer - fused qkv, o, fused gate_up, down - and the
49 152 x 576 LM head over all B rows, which acceptance needs); the paged K/V gather, RoPE, norms
and SDPA together about 10 %, and the engine's own Python (batching, acceptance) under 1 ms.
Changes made while measuring: GQA inside SDPA (no per-layer repeat_interleave copy of K/V),
attention masks built once per forward instead of once per layer, and no mask at all for
1-token queries."""


def summary(samples: list[float]) -> dict[str, float]:
    ms = sorted(s * 1000 for s in samples)
    return {"median_ms": round(statistics.median(ms), 2), "min_ms": round(ms[0], 2),
            "p90_ms": round(ms[int(0.9 * (len(ms) - 1))], 2), "n": len(ms)}


def tokens(n: int, seed: int) -> list[int]:
    return torch.randint(100, 40000, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


class TransformersReference:
    """transformers' forward of q new tokens over CONTEXT cached ones (DynamicCache, cropped back
    after each call): the same measurement as the anchors, taken in this run."""

    def __init__(self, model_dir: Path) -> None:
        from transformers import AutoModelForCausalLM, DynamicCache
        self.model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
        self.cache = DynamicCache(config=self.model.config)
        self._run(tokens(CONTEXT, 1))

    def _run(self, ids: list[int]) -> None:
        with torch.inference_mode():
            self.model(torch.tensor([ids]), cache=self.cache, use_cache=True)

    def forward(self, q: int) -> float:
        t0 = time.perf_counter()
        self._run(tokens(q, 2))
        elapsed = time.perf_counter() - t0
        self.cache.crop(-q)
        return elapsed


class EngineBench:
    """The engine driven from one asyncio loop, as the servicer drives it."""

    def __init__(self, model_dir: Path, threads: int,
                 reference: TransformersReference | None = None) -> None:
        self.reference = reference
        self.worker = TargetWorker.started(TargetConfig(model_dir=str(model_dir), dtype="float32",
                                                        kv_budget_bytes=256 << 20))
        self.engine = TargetEngine(self.worker)
        self.engine.start()
        self.on_engine_thread(lambda: compute_threads.parallel(threads))
        # --cpu-gemm auto as the service runs it: the GEMM per row count measured on this host
        # (without it the fixed rule of the AMD EPYC hosts: 1.9x slower at 1 row on a Xeon)
        table = self.on_engine_thread(self.worker.calibrate_cpu_gemm)
        self.gemm_table = table.describe() if table is not None else cpu_gemm()

    def close(self) -> None:
        self.engine.stop()

    def on_engine_thread(self, fn: Callable[[], T]) -> T:
        """fn() on the engine thread, the owner of sequences and the process's one OpenMP pool
        (runtime.threads): transformers' forward runs there too, so the two are timed on the
        same pool. Blocks the caller (call it through asyncio.to_thread)."""
        result: list = []
        done = threading.Event()

        def run() -> None:
            try:
                result.append(fn())
            except BaseException as e:  # noqa: BLE001 - handed to the caller
                result.append(e)
            finally:
                done.set()

        self.engine.loop.call(run)
        done.wait()
        if isinstance(result[0], BaseException):
            raise result[0]
        return result[0]

    def _rewind(self, seq_id: str, seq_len: int) -> None:
        """Back to seq_len committed tokens, on the engine thread."""
        def rewind() -> None:
            seq = self.engine.seqs[seq_id]
            seq.seq_len = seq_len
            self.worker.kv_cache.trim(seq.table, seq_len)
        self.on_engine_thread(rewind)

    async def _verify_samples(self, repeats: int) -> dict[int, tuple[list[float], ...]]:
        """Rounds over all block sizes (interleaved, so all see the same machine load); per
        block: verify seconds, engine-step seconds, transformers' forward seconds."""
        samples: dict[int, tuple[list[float], ...]] = {b: ([], [], []) for b in BLOCKS}
        for block in BLOCKS:
            call = PrefillCall(f"verify{block}", tokens(CONTEXT, 1), SamplingConfig(), (),
                               torch.float32)
            await self.engine.prefill(call)
        for k in range(repeats + 2):                      # two warm-up rounds
            for block in BLOCKS:
                seq, stats = f"verify{block}", self.engine.stats.seconds
                t0 = time.perf_counter()
                await self.engine.verify(seq, tokens(block, 2))
                elapsed = time.perf_counter() - t0
                await asyncio.to_thread(self._rewind, seq, CONTEXT)  # after the step's bookkeeping
                reference = None if self.reference is None else await asyncio.to_thread(
                    self.on_engine_thread, partial(self.reference.forward, block))
                if k >= 2:
                    samples[block][0].append(elapsed)
                    samples[block][1].append(self.engine.stats.seconds - stats)
                    if reference is not None:
                        samples[block][2].append(reference)
        for block in BLOCKS:
            await self.engine.release(f"verify{block}")
        return samples

    def verify(self, repeats: int) -> list[dict]:
        samples = asyncio.run(self._verify_samples(repeats))
        rows = []
        for b, (total, step, reference) in samples.items():
            row = {"block": b, "context": CONTEXT, **summary(total),
                   "step_median_ms": summary(step)["median_ms"]}
            if reference:
                row["transformers"] = summary(reference)
            rows.append(row)
        return rows

    async def _prefill_samples(self, n: int, repeats: int) -> list[float]:
        samples = []
        for k in range(repeats + 1):                      # one warm-up
            call = PrefillCall(f"prefill{n}", tokens(n, 3 + k), SamplingConfig(), (), torch.float32)
            t0 = time.perf_counter()
            await self.engine.prefill(call)
            if k >= 1:
                samples.append(time.perf_counter() - t0)
            await self.engine.release(call.seq_id)
        return samples

    def prefill(self, n: int, repeats: int) -> dict:
        """Median over `repeats` prefills of n tokens (after one warm-up)."""
        out = summary(asyncio.run(self._prefill_samples(n, repeats)))
        return {"tokens": n, **out, "tokens_per_s": round(n / (out["median_ms"] / 1000), 1)}


def grpc_verify(model_dir: Path, repeats: int, threads: int) -> list[dict]:
    """Verify of 1 and 16 tokens through a real target process on loopback."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
    from support.procs import ServiceProcess, free_port
    from support.target_client import TargetClient
    port = free_port()
    env = {"OMP_NUM_THREADS": str(threads)}
    log_dir = Path(os.environ.get("TMPDIR", "/tmp"))
    server = ServiceProcess("services.target", ["--model", str(model_dir), "--port", str(port),
                                                "--host", "127.0.0.1", "--log-level", "WARNING"],
                            "dflash.v1.Target", port, log_dir, env).start().wait_serving()
    client = TargetClient(server.address)
    blocks = (1, 16)
    samples: dict[int, list[float]] = {b: [] for b in blocks}
    last: dict[int, int] = {}
    try:
        for block in blocks:
            client.prefill(f"grpc{block}", tokens(CONTEXT, 1))
        for k in range(repeats + 2):                      # interleaved rounds, two warm-up
            for block in blocks:
                t0 = time.perf_counter()
                last[block] = client.verify(f"grpc{block}", tokens(block, 2)).seq_len
                if k >= 2:
                    samples[block].append(time.perf_counter() - t0)
    finally:
        client.close()
        server.stop()
    return [{"block": b, "context": f"{CONTEXT}..{last[b]}", **summary(samples[b])}
            for b in blocks]


def table_row(label: str, cells: list[str]) -> str:
    return f"| {label} | " + " | ".join(cells) + " |"


def markdown(r: dict) -> str:
    m = r["machine"]
    v = {row["block"]: row for row in r["verify"]}
    g = {row["block"]: row for row in r.get("grpc", [])}
    noisy = " (a shared machine: noisy)" if r["shared"] else ""
    machine_line = (f"Machine: {m['cpu']}, {m['cores']} cores ({', '.join(m['simd'])}), "
                    f"torch {m['torch']}, {r['threads']} threads; {r['date']}; load average "
                    f"{m['load_avg_start']:.1f} at start and {r['load_avg_end']:.1f} at the end"
                    f"{noisy}.")
    command_line = (f"Command: `{r['command']}` (results: `bench/results/target_cpu.json`). "
                    f"SmolLM2-135M-Instruct fp32, torch attention "
                    f"backend, page size 16, CPU GEMM per row count "
                    f"`{r.get('cpu_gemm', 'fixed rule')}`; medians over {r['repeats']} repeats "
                    f"(min in parentheses).")
    lines = [SECTION, "", machine_line, command_line, "",
             table_row("Verify block (context 256)", [str(b) for b in BLOCKS]),
             "|---|" + "---|" * len(BLOCKS),
             table_row("engine, ms", [f"{v[b]['median_ms']:.1f} ({v[b]['min_ms']:.1f})"
                                      for b in BLOCKS]),
             table_row("of which the engine step (forward, logits, acceptance), ms",
                       [f"{v[b]['step_median_ms']:.1f}" for b in BLOCKS]),
             table_row("transformers, same run, ms",
                       [f"{v[b]['transformers']['median_ms']:.1f} "
                        f"({v[b]['transformers']['min_ms']:.1f})" if "transformers" in v[b] else ""
                        for b in BLOCKS]),
             table_row("transformers anchor (quiet machine, 200 cached), ms",
                       [f"{HF_ANCHOR_MS[b]:.1f}" for b in BLOCKS])]
    if g:
        lines.append(table_row("gRPC loopback, ms",
                               [f"{g[b]['median_ms']:.1f}" if b in g else "" for b in BLOCKS]))
    ratio = v[16]["median_ms"] / v[1]["median_ms"]
    ratio_min = v[16]["min_ms"] / v[1]["min_ms"]
    hf_ratio = HF_ANCHOR_MS[16] / HF_ANCHOR_MS[1]
    prefill = r["prefill"]
    ratio_line = (f"verify(16) / verify(1) = {ratio:.2f} by medians, {ratio_min:.2f} by minima "
                  f"(transformers anchors: {hf_ratio:.2f}).")
    lines += ["", ratio_line, "",
              table_row("Prefill tokens", [str(p["tokens"]) for p in prefill]),
              "|---|" + "---|" * len(prefill),
              table_row("tokens/s", [f"{p['tokens_per_s']:.0f}" for p in prefill]),
              table_row("ms", [f"{p['median_ms']:.0f}" for p in prefill]),
              "", NOTES]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m bench.target_cpu",
                                description=__doc__.splitlines()[0])
    p.add_argument("--model", default="", help="HF model dir (default: SmolLM2 fp32, prepared)")
    p.add_argument("--threads", type=int, default=2, help="torch threads (the anchors used 2)")
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--no-grpc", action="store_true", help="skip the gRPC loopback rows")
    p.add_argument("--no-transformers", action="store_true",
                   help="skip transformers' forward, timed in the same rounds")
    p.add_argument("--shared", action="store_true", help="note in the doc that others used the CPU")
    p.add_argument("--out", default="bench/results/target_cpu.json")
    p.add_argument("--doc", default="docs/benchmarks.md")
    add_tiny_flag(p)
    args = p.parse_args(argv)
    tiny_outputs(args, p, "target_cpu")
    prefill_lengths, prefill_repeats = PREFILL_LENGTHS, max(3, args.repeats // 5)
    if args.tiny:
        args.repeats = 2
        prefill_lengths, prefill_repeats = PREFILL_LENGTHS[:2], 1
    compute_threads.serial()        # the engine thread computes (with --threads), nothing else
    if args.model:
        model_dir = Path(args.model)
    else:
        from dflash.prepare.smollm2 import prepare_smollm2
        model_dir = prepare_smollm2(["float32"], progress=False)["float32"]
    result: dict = {"machine": machine(), "threads": args.threads,
                    "date": datetime.date.today().isoformat(), "repeats": args.repeats,
                    "command": "python -m bench.target_cpu " + " ".join(argv or sys.argv[1:]),
                    "model": str(model_dir), "shared": args.shared, "hf_anchor_ms": HF_ANCHOR_MS}
    if args.tiny:
        result.update(tiny_fields())
    reference = None if args.no_transformers else TransformersReference(model_dir)
    bench = EngineBench(model_dir, args.threads, reference)
    try:
        result["cpu_gemm"] = bench.gemm_table
        result["verify"] = bench.verify(args.repeats)
        for row in result["verify"]:
            print(json.dumps(row), flush=True)
        result["prefill"] = []
        for n in prefill_lengths:
            result["prefill"].append(bench.prefill(n, prefill_repeats))
            print(json.dumps(result["prefill"][-1]), flush=True)
    finally:
        bench.close()
    if not args.no_grpc:
        result["grpc"] = grpc_verify(model_dir, args.repeats, args.threads)
        print(json.dumps(result["grpc"]), flush=True)
    save(result, Path(args.out), Path(args.doc), SECTION, markdown)
    print(markdown(result))


if __name__ == "__main__":
    main()
