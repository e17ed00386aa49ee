"""python -m bench.plot_runs --out PNG LABEL=JSON ...: bench.gpu_side_by_side runs side by side.

Each JSON is one run (its `rows`); for every concurrency level the plot shows each run's output
tokens/s (the level's last row: c = 1 runs twice, cold then warm, and the warm one is kept),
grouped by level, with the value on each bar. Used for A/B runs of one change (docs/benchmarks.md).
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path


def levels(path: Path, config: str = "spec services") -> dict[int, float]:
    """concurrency -> tokens/s of the run's last row at that level for `config`."""
    out: dict[int, float] = {}
    for row in json.loads(path.read_text())["rows"]:
        if row["config"] == config:
            out[row["concurrency"]] = row["tokens_per_s"]
    return out


def plot(runs: dict[str, dict[int, float]], out: Path, title: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    cs = sorted({c for r in runs.values() for c in r})
    width = 0.8 / len(runs)
    fig, axes = plt.subplots(1, len(cs), figsize=(4 * len(cs), 3.6), squeeze=False)
    for ax, c in zip(axes[0], cs):
        for i, (label, r) in enumerate(runs.items()):
            if c in r:
                bar = ax.bar(i * width, r[c], width * 0.9, label=label)
                ax.bar_label(bar, fmt="%.0f", fontsize=8)
        ax.set_title(f"c = {c}")
        ax.set_xticks([])
        ax.set_ylabel("output tokens/s")
    axes[0][0].legend(fontsize=8, loc="lower left")
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("runs", nargs="+", help="LABEL=path/to/gpu_side_by_side.json")
    ap.add_argument("--out", required=True)
    ap.add_argument("--title", default="")
    args = ap.parse_args(argv)
    runs = {}
    for spec in args.runs:
        label, _, path = spec.partition("=")
        runs[label] = levels(Path(path))
    plot(runs, Path(args.out), args.title)
    print("wrote", args.out)


if __name__ == "__main__":
    main()
