"""`dflash prepare-model NAME [--dtype D ...] [--home DIR] [--quiet]`."""
from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from pathlib import Path

from dflash.prepare.smollm2 import prepare_smollm2
from runtime.home import DTYPES

# model name -> prepare(dtypes, home, progress) -> {dtype: model directory}
MODELS: dict[str, Callable[[list[str], Path | None, bool], dict[str, Path]]] = {
    "smollm2-135m-instruct": prepare_smollm2,
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("name", help=f"model to prepare; known: {', '.join(MODELS)}")
    parser.add_argument("--dtype", action="append", choices=DTYPES, dest="dtypes",
                        help="weight dtype to write; repeat for several (default: float32)")
    parser.add_argument("--home", type=Path, default=None,
                        help="models home (default: $DFLASH_HOME or ~/.cache/dflash)")
    parser.add_argument("--quiet", action="store_true", help="no progress output on stderr")


def run(args: argparse.Namespace) -> int:
    """Prepare the model; prints `dtype<TAB>directory` lines on stdout. Unknown name: exit 2."""
    prepare = MODELS.get(args.name)
    if prepare is None:
        print(f"dflash prepare-model: unknown model {args.name!r}; known models: "
              f"{', '.join(sorted(MODELS))}", file=sys.stderr)
        return 2
    for dtype, path in prepare(args.dtypes or ["float32"], args.home, not args.quiet).items():
        print(f"{dtype}\t{path}")
    return 0
