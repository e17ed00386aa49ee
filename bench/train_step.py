"""python -m bench.train_step: seconds per DFlash training step (features + draft forward/backward
+ optimizer) for a batch shape, to size `dflash train-draft --steps` to a time budget.

  python -m bench.train_step --target DIR --work WORK [--steps 40] [--batch-sequences 32] ...
Prints one JSON line (steady-state seconds per step, after the first 10 steps), also written to
--out if given; with --profile N, where the device time of an N-step run goes (torch.profiler).

--tiny: on the CPU, SmolLM2 as the target (unless --target), --work defaulting to a few greedy
SmolLM2 answers to training prompts generated on the spot (bench/tiny.py), a 1-layer drafter,
2 sequences x 4 blocks per step, and runs of 1, 2 and 2 + 4 steps (a smoke test; --out defaults
to a temporary folder)."""
from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

from train.config import TrainConfig
from train.generate import load_examples
from train.trainer import train


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target", help="the target's directory (required but with --tiny)")
    ap.add_argument("--work", help="folder with train_t0.0.jsonl (required but with --tiny)")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--layers", type=int, default=3)
    ap.add_argument("--batch-sequences", type=int, default=32)
    ap.add_argument("--blocks-per-sequence", type=int, default=32)
    ap.add_argument("--cache-features", action="store_true")
    ap.add_argument("--profile", type=int, default=0, metavar="N",
                    help="instead: profile an N-step run (torch.profiler) and print where the "
                         "device time goes")
    ap.add_argument("--out", default="", help="also write the JSON line here")
    from bench.tiny import add_tiny_flag
    add_tiny_flag(ap)
    args = ap.parse_args(argv)
    warm = _tiny(ap, args) if args.tiny else 10
    if not (args.target and args.work):
        ap.error("the following arguments are required: --target, --work")
    examples = load_examples(f"{args.work}/train_t0.0.jsonl")
    with tempfile.TemporaryDirectory() as tmp:
        if args.profile:
            return profile(args, examples, tmp)
        # A 3-step run first pays the one-time costs (kernel compilation, autotuning, allocator
        # growth); then the difference of a (10 + N)- and a 10-step run is N steady steps.
        times = [train(_cfg(args, tmp, steps), examples, []).summary["train_seconds"]
                 for steps in (min(3, warm - 1), warm, warm + args.steps)]
    result = {"batch_sequences": args.batch_sequences,
              "blocks_per_sequence": args.blocks_per_sequence, "layers": args.layers,
              "cache_features": args.cache_features,
              "seconds_per_step": round((times[2] - times[1]) / args.steps, 4),
              "note": f"train_seconds difference of a ({warm} + N)- and a {warm}-step run"}
    if args.tiny:
        from bench.tiny import tiny_fields
        result.update(tiny_fields(), steps=args.steps, train_seconds_of_runs=times)
    print(json.dumps(result), flush=True)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(result, indent=2) + "\n")


def _tiny(ap: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    """--tiny's sizes, target and work folder; returns the warm-up run's steps."""
    from bench.tiny import greedy_answers_work, smollm2, tiny_outputs
    tiny_outputs(args, ap, "train_step", ("out",))
    if not args.out:
        args.out = tempfile.mkdtemp(prefix="bench-tiny-train_step-") + "/train_step.json"
    args.device, args.layers, args.batch_sequences, args.blocks_per_sequence = "cpu", 1, 2, 4
    args.steps, args.profile = 1, 0      # runs of 1, 2 and 3 steps (a step: ~12 s on 2 EPYC cores)
    args.target = args.target or str(smollm2())
    args.work = args.work or str(greedy_answers_work(
        Path(args.out).parent / "train_step-work", ("train",), per_split=4,
        target=Path(args.target)))
    return 2


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
