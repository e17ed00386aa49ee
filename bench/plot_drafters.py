"""python -m bench.plot_drafters: held-out acceptance length during training of every SmolLM2
drafter trained so far (from their training.json), against the training blocks seen, and the
final simulated tau per held-out split. Writes docs/img/drafter_training.png (--out: elsewhere)."""
from __future__ import annotations

import argparse
import json
from pathlib import Path

RUNS = [  # label, training.json
    ("first", "bench/results/archive/training/smollm2_drafter1_training.json"),
    ("second", "bench/results/archive/training/smollm2_drafter2_training.json"),
    ("third", "bench/results/archive/training/smollm2_drafter3_training.json"),
    ("fourth (gamma 3)", "bench/results/archive/training/smollm2_drafter4_training.json"),
    ("fifth (gamma 3, 24k steps)", "bench/results/archive/training/smollm2_drafter5_training.json"),
    ("sixth (+ second turns, 20k steps)",
     "bench/results/archive/training/smollm2_drafter6_training.json"),
    ("seventh (+ soft labels, 16k steps)",
     "bench/results/archive/training/smollm2_drafter7_training.json"),
    ("eighth (seventh's recipe, 24k steps)",
     "bench/results/archive/training/smollm2_drafter8_training.json"),
    ("ninth (+ 10 000 self-written prompts, 18k steps)",
     "bench/results/archive/training/smollm2_drafter9_training.json"),
    ("twelfth (shipped, ninth's data, loss weighted by reach, gamma 7)",
     "models/smollm2-135m-instruct-dflash/training.json"),
]
NOT_SHIPPED = [  # label, training.json, colour: dashed curves of runs not shipped
    ("eighth + 10 000 self-written prompts, 24k steps (stopped at 23k)",
     "bench/results/archive/training/smollm2_self_prompts_partial.json", "gold"),
    ("tenth: the ninth's recipe, 21k steps (level with the ninth, not shipped)",
     "bench/results/archive/training/smollm2_drafter10_training.json", "black"),
    ("eleventh: the ninth's recipe, FFN 2048 wide (level with the ninth, not shipped)",
     "bench/results/archive/training/smollm2_drafter11_training.json", "tab:olive"),
    ("thirteenth: the twelfth's command, layers started from the target's (behind, not shipped)",
     "bench/results/archive/training/smollm2_drafter13_training.json", "tab:brown"),
]
CONTINUED_FROM = "third"
CONTINUED = "bench/results/archive/training/smollm2_continued_training.json"


def curve(summary: dict, offset: float = 0.0) -> tuple[list[float], list[float]]:
    """(millions of training blocks seen, held-out tau) at each evaluation."""
    cfg = summary["config"]
    per_step = cfg["batch_sequences"] * cfg["blocks_per_sequence"] / 1e6
    points = [(offset + (h["step"] + 1) * per_step, h["eval_tau"])
              for h in summary["history"] if "eval_tau" in h]
    return [p[0] for p in points], [p[1] for p in points]


def main(out: str = "docs/img/drafter_training.png") -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    runs = [(label, json.loads(Path(p).read_text())) for label, p in RUNS]
    fig, (left, right) = plt.subplots(1, 2, figsize=(13, 5))
    for label, summary in runs:
        x, y = curve(summary)
        left.plot(x, y, marker="o", ms=3, label=f"{label}: {summary['num_train_examples']} answers")
    for label, path, colour in NOT_SHIPPED:
        summary = json.loads(Path(path).read_text())
        x, y = curve(summary)
        left.plot(x, y, marker="o", ms=3, ls="--", color=colour,
                  label=f"{label}: {summary['num_train_examples']} answers")
    base = dict(runs)[CONTINUED_FROM]
    done = base["config"]["steps"] * base["config"]["batch_sequences"] * \
        base["config"]["blocks_per_sequence"] / 1e6
    cont = json.loads(Path(CONTINUED).read_text())
    x, y = curve(cont, offset=done)
    left.plot(x, y, marker="s", ls="none", label="third + continuation (not shipped)")
    left.axhline(3.5, color="grey", ls="--", lw=1)
    left.text(0, 3.42, "goal in distribution (3.5)", color="grey", fontsize=8)
    left.set(xlabel="training blocks seen (millions)", ylabel="held-out tau (64 eval_in, simulated)",
             title="Acceptance length during training", ylim=(1, 3.7))
    left.legend(fontsize=6.5, loc="lower right")
    names = [label.split(" (")[0] for label, _ in runs] + ["third\n+ cont."]
    summaries = [s for _, s in runs] + [cont]
    for i, split in enumerate(("eval_in", "eval_unseen")):
        taus = [s["eval"][split]["tau"] for s in summaries]
        bars = right.bar([k + 0.38 * i for k in range(len(names))], taus, width=0.38, label=split)
        right.bar_label(bars, fmt="%.2f", fontsize=7)
    right.set_xticks([k + 0.19 for k in range(len(names))], names, fontsize=7)
    right.set(ylabel="tau (128 prompts, <= 384 tokens, simulated)", ylim=(0, 3.7),
              title="Final simulated tau per held-out split")
    right.axhline(3.5, color="grey", ls="--", lw=1)
    right.axhline(2.5, color="grey", ls=":", lw=1)
    right.legend(fontsize=8, loc="upper left")
    fig.tight_layout()
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    print(out)


def cli(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m bench.plot_drafters",
                                description=__doc__.splitlines()[0])
    p.add_argument("--out", default="docs/img/drafter_training.png", help="the PNG written")
    main(p.parse_args(argv).out)


if __name__ == "__main__":
    cli()
