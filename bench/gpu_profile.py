"""python -m bench.gpu_profile: where one in-process speculative step spends its time on the GPU
(Qwen3-8B-shaped random target + 5-layer DFlash drafter, forced tau, concurrency 1).

Prints torch.profiler tables (by CUDA time and by CPU time) over a short generation, and the
engine-side split of each step (host work vs waiting for the device). For finding overheads;
the numbers that are reported live in bench/gpu_side_by_side.py."""
from __future__ import annotations

import argparse
import asyncio
import json
import os
from pathlib import Path

from bench.gpu_side_by_side import _bytes
from bench.h200_micro import QWEN3_8B, write_model_dirs
from dflash.harness import ForcedAcceptance


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=96)
    ap.add_argument("--out", default=os.environ.get("OUT", "/tmp"))
    args = ap.parse_args()
    from runtime.sampling import SamplingConfig
    from services.common.hooks import ServiceHooks
    from services.draft.config import DraftConfig
    from services.target.config import TargetConfig
    from services.target.hooks import TargetHooks
    from train.inproc import speculate, start_engines
    taps = (1, 9, 17, 25, 33)
    tdir, ddir = write_model_dirs(Path("/tmp/gpu_profile_models"), QWEN3_8B, list(taps))
    engines = start_engines(
        TargetConfig(model_dir=str(tdir), device="cuda", dtype="bfloat16",
                     attention_backend="triton", max_block_size=16, kv_budget_bytes=_bytes("20GiB"),
                     graph_capture_layers=taps),
        DraftConfig(target_dir=str(tdir), model_dir=str(ddir), device="cuda", dtype="bfloat16",
                    attention_backend="triton", kv_budget_bytes=_bytes("2GiB")),
        TargetHooks(random_weights=True, forced_acceptance=ForcedAcceptance(6.4)),
        ServiceHooks(random_weights=True))
    engines.target.worker.capture_cuda_graphs()
    engines.draft.drafter.capture_cuda_graphs()
    prompt = list(range(100, 228))

    def wave(n: int):
        return asyncio.run(speculate(engines, f"p{n}", prompt, args.tokens, 16, SamplingConfig(),
                                     set()))
    for i in range(2):
        wave(i)
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        res = wave(9)
    steps = res.steps
    print(json.dumps({"steps": steps, "draft_ms": 1000 * res.draft_seconds / steps,
                      "verify_ms": 1000 * res.verify_seconds / steps,
                      "total_ms": 1000 * res.seconds / steps}), flush=True)
    ka = prof.key_averages()
    print(ka.table(sort_by="cuda_time_total", row_limit=30, max_name_column_width=70))
    print(ka.table(sort_by="self_cpu_time_total", row_limit=30, max_name_column_width=70))
    trace = Path(args.out) / "trace.json"
    prof.export_chrome_trace(str(trace))
    os.system(f"gzip -f {trace}")
    engines.stop()


if __name__ == "__main__":
    main()
