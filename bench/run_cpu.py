"""python -m bench.run_cpu: every CPU benchmark in turn (`make bench`). Each writes its JSON to
bench/results/ and its section of docs/benchmarks.md. Run on a quiet machine."""
from __future__ import annotations

import subprocess
import sys

BENCHES = [
    ["bench.cpu_gemm"],
    ["bench.target_cpu"],
    ["bench.draft_cpu"],
    ["bench.hybrid_cpu"],
    ["bench.gateway_cpu"],
    ["bench.wire_cpu"],
    ["dflash.cli", "eval-draft", "--out", "bench/results/drafter_eval.json"],
    ["bench.drafter_cpu"],
]


def main() -> int:
    failed = []
    for argv in BENCHES:
        print(f"== python -m {' '.join(argv)}", flush=True)
        if subprocess.run([sys.executable, "-m", *argv]).returncode != 0:
            failed.append(argv[0])
    if failed:
        print(f"failed: {failed}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
