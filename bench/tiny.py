"""What the benchmarks' --tiny modes share (not a benchmark itself).

`python -m bench.<name> --tiny` runs a benchmark's own measurement path (engines, services, gRPC,
the local stack) on the CPU at the smallest setup that exercises it, in seconds: a smoke test
that `make test` runs (tests/test_bench_smoke.py), so a refactor cannot break a benchmark
unnoticed. Its JSON records `"tiny": true` and, under `tiny_skipped`, what it left out (CUDA
graphs, CUDA events, FlashInfer on the CPU). A --tiny run never writes the committed results
(bench/results/) or docs/benchmarks.md: `tiny_outputs` sends those, and any default output
path, to a temporary folder."""
from __future__ import annotations

import argparse
import random
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PROTECTED = (REPO / "bench" / "results", REPO / "docs")
NO_CUDA = "needs CUDA (not run by --tiny on the CPU)"


def add_tiny_flag(p: argparse.ArgumentParser) -> None:
    p.add_argument("--tiny", action="store_true",
                   help="smoke test: the same code path on the CPU at the smallest setup, in "
                        "seconds (outputs default to a temporary folder)")


def _protected(path: Path) -> bool:
    resolved = path.resolve()
    return any(resolved == root or root in resolved.parents for root in PROTECTED)


def tiny_outputs(args: argparse.Namespace, p: argparse.ArgumentParser, name: str,
                 attrs: tuple[str, ...] = ("out", "doc")) -> None:
    """With --tiny: each of `attrs` (paths) that the caller left at its default, or that points
    into bench/results/ or docs/, becomes a path of the same name in a temporary folder."""
    if not getattr(args, "tiny", False):
        return
    folder: Path | None = None
    for attr in attrs:
        value = getattr(args, attr, None)
        if not value or (value != p.get_default(attr) and not _protected(Path(value))):
            continue
        folder = folder or Path(tempfile.mkdtemp(prefix=f"bench-tiny-{name}-"))
        new = folder / Path(str(value)).name
        print(f"--tiny: --{attr} {value} -> {new}", file=sys.stderr, flush=True)
        setattr(args, attr, type(value)(new) if isinstance(value, Path) else str(new))


def tiny_fields(skipped: dict[str, str] | None = None) -> dict:
    """The keys a --tiny result carries."""
    return {"tiny": True, **({"tiny_skipped": skipped} if skipped else {})}


def smollm2(dtype: str = "float32") -> Path:
    from dflash.prepare.smollm2 import prepare_smollm2
    return prepare_smollm2([dtype], progress=False)[dtype]


def greedy_answers_work(work: Path, splits: tuple[str, ...] = ("eval_in", "eval_unseen"),
                        per_split: int = 2, max_new: int = 24, target: Path | None = None,
                        seed: int = 0) -> Path:
    """A tiny --work folder: the target's (default SmolLM2 fp32) greedy answers to `per_split`
    seeded prompts of each split, written as `dflash train-draft` caches them
    (WORK/{split}_t0.0.jsonl, train/cli.py's set_path), by the same code (train/generate.py's
    waves over a TargetRunner)."""
    import torch

    from runtime.tokenizer import ChatTokenizer
    from train.generate import chat_prompt_ids, generate, save_examples
    from train.prompts import load_prompts
    from train.target_runner import TargetRunner
    target = target or smollm2()
    tok = ChatTokenizer(target)
    work.mkdir(parents=True, exist_ok=True)
    chosen = {split: random.Random(seed).sample(load_prompts(split), per_split) for split in splits}
    ids = {split: [chat_prompt_ids(tok, r.text) for r in recs] for split, recs in chosen.items()}
    longest = max(len(i) for per in ids.values() for i in per) + max_new
    runner = TargetRunner(str(target), TargetRunner.tokens_for(per_split, longest),
                          torch.float32, "cpu")
    for split in splits:
        examples = generate(runner, chosen[split], ids[split], 0.0, max_new, seed, per_split)
        save_examples(examples, work / f"{split}_t0.0.jsonl")
    return work
