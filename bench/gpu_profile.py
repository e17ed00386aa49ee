"""python -m bench.gpu_profile: where one in-process speculative step spends its time on the GPU
(Qwen3-8B-shaped random target + 5-layer DFlash drafter, forced tau, concurrency 1).

Prints torch.profiler tables (by CUDA time and by CPU time) over a short generation, and the
engine-side split of each step (host work vs waiting for the device). For finding overheads;
the numbers that are reported live in bench/gpu_side_by_side.py. Writes OUT/trace.json.gz and
OUT/gpu_profile.json (the split and the top operators by self CPU time).

--tiny: the same on the CPU with a tiny shape (fp32, torch attention backend, CPU activity only;
no CUDA graphs, no CUDA profiler activity), OUT defaulting to a temporary folder."""
from __future__ import annotations

import argparse
import asyncio
import json
import os
from pathlib import Path

from bench.gpu_side_by_side import _bytes
from bench.h200_micro import QWEN3_8B, TINY, write_model_dirs
from bench.tiny import NO_CUDA, add_tiny_flag, tiny_fields, tiny_outputs
from dflash.harness import ForcedAcceptance


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=96)
    ap.add_argument("--out", default=os.environ.get("OUT", "/tmp"))
    add_tiny_flag(ap)
    args = ap.parse_args(argv)
    tiny_outputs(args, ap, "gpu_profile", ("out",))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    device, dtype, backend = ("cpu", "float32", "torch") if args.tiny else \
        ("cuda", "bfloat16", "triton")
    tokens = min(args.tokens, 24) if args.tiny else args.tokens
    from runtime.sampling import SamplingConfig
    from services.common.hooks import ServiceHooks
    from services.draft.config import DraftConfig
    from services.target.config import TargetConfig
    from services.target.hooks import TargetHooks
    from train.inproc import speculate, start_engines
    taps = (1, 2, 3, 4, 5) if args.tiny else (1, 9, 17, 25, 33)
    tdir, ddir = write_model_dirs(out / "models" if args.tiny else Path("/tmp/gpu_profile_models"),
                                  TINY if args.tiny else QWEN3_8B, list(taps))
    engines = start_engines(
        TargetConfig(model_dir=str(tdir), device=device, dtype=dtype,
                     attention_backend=backend, max_block_size=16,
                     kv_budget_bytes=_bytes("64MiB" if args.tiny else "20GiB"),
                     graph_capture_layers=taps),
        DraftConfig(target_dir=str(tdir), model_dir=str(ddir), device=device, dtype=dtype,
                    attention_backend=backend,
                    kv_budget_bytes=_bytes("32MiB" if args.tiny else "2GiB")),
        TargetHooks(random_weights=True, forced_acceptance=ForcedAcceptance(6.4)),
        ServiceHooks(random_weights=True))
    engines.target.worker.capture_cuda_graphs()
    engines.draft.drafter.capture_cuda_graphs()
    prompt = list(range(100, 228))

    def wave(n: int):
        return asyncio.run(speculate(engines, f"p{n}", prompt, tokens, 16, SamplingConfig(),
                                     set()))
    for i in range(2):
        wave(i)
    from torch.profiler import ProfilerActivity, profile
    activities = [ProfilerActivity.CPU] + ([] if args.tiny else [ProfilerActivity.CUDA])
    with profile(activities=activities, experimental_config=_all_threads()) as prof:
        res = wave(9)
    steps = res.steps
    split = {"steps": steps, "draft_ms": 1000 * res.draft_seconds / steps,
             "verify_ms": 1000 * res.verify_seconds / steps, "total_ms": 1000 * res.seconds / steps}
    print(json.dumps(split), flush=True)
    ka = prof.key_averages()
    if not args.tiny:
        print(ka.table(sort_by="cuda_time_total", row_limit=30, max_name_column_width=70))
    print(ka.table(sort_by="self_cpu_time_total", row_limit=30, max_name_column_width=70))
    trace = out / "trace.json"
    prof.export_chrome_trace(str(trace))
    os.system(f"gzip -f {trace}")
    engines.stop()
    top = sorted(ka, key=lambda e: e.self_cpu_time_total, reverse=True)[:15]
    result = {"tokens": tokens, **split, "tokens_generated": len(res.tokens),
              "top_self_cpu_us": {e.key: round(e.self_cpu_time_total, 1) for e in top}}
    if args.tiny:
        result.update(tiny_fields({"cuda_graphs": NO_CUDA, "cuda_profiler_activity": NO_CUDA}))
    (out / "gpu_profile.json").write_text(json.dumps(result, indent=2) + "\n")


def _all_threads():
    """The profiler's config that records every thread: the engines compute on their own
    threads, which torch.profiler leaves out by default (the CPU table was empty of them)."""
    from torch._C._profiler import _ExperimentalConfig
    try:
        return _ExperimentalConfig(profile_all_threads=True)
    except TypeError:                   # a torch without it: the calling thread only
        return None


if __name__ == "__main__":
    main()
