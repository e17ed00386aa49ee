"""python -m bench.train_step: seconds per DFlash training step (features + draft forward/backward
+ optimizer) for a batch shape, to size `dflash train-draft --steps` to a time budget.

  python -m bench.train_step --target DIR --work WORK [--steps 40] [--batch-sequences 32] ...
Prints one JSON line (steady-state seconds per step, after the first 10 steps); with
--profile N, where the device time of an N-step run goes (torch.profiler)."""
from __future__ import annotations

import argparse
import json
import tempfile

from train.config import TrainConfig
from train.generate import load_examples
from train.trainer import train


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target", required=True)
    ap.add_argument("--work", required=True, help="folder with train_t0.0.jsonl")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--layers", type=int, default=3)
    ap.add_argument("--batch-sequences", type=int, default=32)
    ap.add_argument("--blocks-per-sequence", type=int, default=32)
    ap.add_argument("--cache-features", action="store_true")
    ap.add_argument("--profile", type=int, default=0, metavar="N",
                    help="instead: profile an N-step run (torch.profiler) and print where the "
                         "device time goes")
    args = ap.parse_args(argv)
    examples = load_examples(f"{args.work}/train_t0.0.jsonl")
    with tempfile.TemporaryDirectory() as tmp:
        if args.profile:
            return profile(args, examples, tmp)
        # A 3-step run first pays the one-time costs (kernel compilation, autotuning, allocator
        # growth); then the difference of a (10 + N)- and a 10-step run is N steady steps.
        times = [train(_cfg(args, tmp, steps), examples, []).summary["train_seconds"]
                 for steps in (3, 10, 10 + args.steps)]
    print(json.dumps({"batch_sequences": args.batch_sequences,
                      "blocks_per_sequence": args.blocks_per_sequence, "layers": args.layers,
                      "cache_features": args.cache_features,
                      "seconds_per_step": round((times[2] - times[1]) / args.steps, 4),
                      "note": "train_seconds difference of a (10 + N)- and a 10-step run"}),
          flush=True)


def _cfg(args, out_dir: str, steps: int) -> TrainConfig:
    return TrainConfig(target_dir=args.target, out_dir=out_dir, num_layers=args.layers,
                       mask_token_id=16, steps=steps, batch_sequences=args.batch_sequences,
                       blocks_per_sequence=args.blocks_per_sequence, device=args.device,
                       cache_features=args.cache_features,
                       feature_backend="triton" if args.device == "cuda" else "torch")


def profile(args, examples, tmp: str) -> None:
    """Device time by operator over an N-step run (after a warm-up run), against its wall time:
    a device busy for a small share of the wall is waiting on the host (launches, Python)."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if args.device.startswith("cuda")
                                     else [])
    train(_cfg(args, tmp, 3), examples, [])
    with torch_profile(activities=acts) as prof:
        wall = train(_cfg(args, tmp, args.profile), examples, []).summary["train_seconds"]
    key = "self_cuda_time_total" if len(acts) > 1 else "self_cpu_time_total"
    print(prof.key_averages().table(sort_by=key, row_limit=25), flush=True)
    busy = sum(getattr(e, "self_device_time_total", 0) for e in prof.key_averages()) / 1e6
    print(json.dumps({"profile_steps": args.profile, "train_seconds": wall,
                      "device_busy_seconds": round(busy, 3)}), flush=True)


if __name__ == "__main__":
    main()
