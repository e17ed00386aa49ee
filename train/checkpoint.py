"""Pausing and resuming a training run (`dflash train-draft --stop-after`): the drafter, the
optimizer and the data order saved at a step, and refused when they belong to another run."""
from __future__ import annotations

import random
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from train.config import TrainConfig

# TrainConfig fields that may differ between the segments of one run: where things go, how long
# a segment lasts, how often it evaluates, and whether features are cached (speed, not recipe).
SEGMENT_FIELDS = ("out_dir", "checkpoint", "stop_after_seconds", "eval_every", "eval_sequences",
                  "cache_features", "extra")


@dataclass
class TrainState:
    """Where a run stands: saved to `TrainConfig.checkpoint` when a segment stops early."""
    step: int = 0
    seconds: float = 0.0                        # training time of the earlier segments
    history: list[dict] = field(default_factory=list)


def run_key(cfg: TrainConfig) -> dict:
    """What identifies a run: every config field but the per-segment ones."""
    return {k: v for k, v in asdict(cfg).items() if k not in SEGMENT_FIELDS}


def save_checkpoint(cfg: TrainConfig, state: TrainState, draft: torch.nn.Module,
                    opt: torch.optim.Optimizer, rng: random.Random, num_examples: int) -> None:
    path = Path(cfg.checkpoint)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    torch.save({"run": run_key(cfg), "num_examples": num_examples, "state": asdict(state),
                "draft": draft.state_dict(), "opt": opt.state_dict(), "rng": rng.getstate()},
               tmp)
    tmp.replace(path)                           # never a half-written checkpoint


def load_checkpoint(cfg: TrainConfig, draft: torch.nn.Module, opt: torch.optim.Optimizer,
                    rng: random.Random, num_examples: int) -> TrainState:
    """Restores draft, optimizer and data order from cfg.checkpoint (if it exists); a checkpoint
    of a different run (another recipe or data) is refused rather than silently mixed in."""
    path = Path(cfg.checkpoint) if cfg.checkpoint else None
    if path is None or not path.is_file():
        return TrainState()
    ck = torch.load(path, map_location=cfg.device, weights_only=False)
    problems = _differences(ck["run"], run_key(cfg))
    if ck["num_examples"] != num_examples:
        problems.append(f"training answers: {ck['num_examples']} there, {num_examples} here")
    if problems:
        raise ValueError(f"checkpoint {path} belongs to another run ({', '.join(problems)}); "
                         "delete it or pass another --checkpoint")
    draft.load_state_dict(ck["draft"])
    opt.load_state_dict(ck["opt"])
    rng.setstate(ck["rng"])
    return TrainState(**ck["state"])


def _differences(theirs: dict, mine: dict) -> list[str]:
    return [f"{k}: {theirs.get(k)!r} there, {mine.get(k)!r} here"
            for k in sorted(set(mine) | set(theirs)) if mine.get(k) != theirs.get(k)]
