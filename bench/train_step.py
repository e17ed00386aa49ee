"""python -m bench.train_step: seconds per DFlash training step (features + draft forward/backward
+ optimizer) for a batch shape, to size `dflash train-draft --steps` to a time budget.

  python -m bench.train_step --target DIR --work WORK [--steps 40] [--batch-sequences 32] ...
Prints one JSON line (steady-state seconds per step, after the first 10 steps)."""
from __future__ import annotations

import argparse
import json
import tempfile

from services.draft.training.generate import load_examples
from services.draft.training.trainer import TrainConfig, train


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target", required=True)
    ap.add_argument("--work", required=True, help="folder with train_t0.0.jsonl")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--layers", type=int, default=3)
    ap.add_argument("--batch-sequences", type=int, default=32)
    ap.add_argument("--blocks-per-sequence", type=int, default=32)
    args = ap.parse_args(argv)
    examples = load_examples(f"{args.work}/train_t0.0.jsonl")
    times = []
    with tempfile.TemporaryDirectory() as tmp:
        # A 3-step run first pays the one-time costs (kernel compilation, autotuning, allocator
        # growth); then the difference of a (10 + N)- and a 10-step run is N steady steps.
        for steps in (3, 10, 10 + args.steps):
            cfg = TrainConfig(target_dir=args.target, out_dir=tmp, num_layers=args.layers,
                              mask_token_id=16, steps=steps, batch_sequences=args.batch_sequences,
                              blocks_per_sequence=args.blocks_per_sequence, device=args.device,
                              feature_backend="triton" if args.device == "cuda" else "torch")
            times.append(train(cfg, examples, [])[1]["train_seconds"])
    print(json.dumps({"batch_sequences": args.batch_sequences,
                      "blocks_per_sequence": args.blocks_per_sequence, "layers": args.layers,
                      "seconds_per_step": round((times[2] - times[1]) / args.steps, 4),
                      "note": "train_seconds difference of a (10 + N)- and a 10-step run"}),
          flush=True)


if __name__ == "__main__":
    main()
