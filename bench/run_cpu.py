"""python -m bench.run_cpu: every CPU benchmark in turn (`make bench`). Each writes its JSON to
bench/results/ and its section of docs/benchmarks.md. Run on a quiet machine.

--tiny: each of them with --tiny (eval-draft with one prompt per split, 8 tokens, T = 0), their
JSON and doc sections written to a temporary folder (--out-dir to keep them): a smoke test of
the whole command."""
from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
from pathlib import Path

BENCHES = [
    ["bench.cpu_gemm"],
    ["bench.target_cpu"],
    ["bench.draft_cpu"],
    ["bench.hybrid_cpu"],
    ["bench.gateway_cpu"],
    ["bench.wire_cpu"],
    ["bench.adaptive_cpu"],
    ["bench.prefix_cache"],
    ["dflash.cli", "eval-draft", "--out", "bench/results/drafter_eval.json"],
    ["bench.drafter_cpu"],
]
WRITES_DOC = {"bench.cpu_gemm", "bench.target_cpu", "bench.gateway_cpu", "bench.wire_cpu",
              "bench.adaptive_cpu", "bench.prefix_cache"}
TINY_EVAL = ["--per-split", "1", "--max-new-tokens", "8", "--temperatures", "0"]


def tiny_argv(argv: list[str], out_dir: Path) -> list[str]:
    """One entry of BENCHES as its --tiny command, writing into out_dir."""
    if argv[0] == "dflash.cli":
        return [*argv[:2], *TINY_EVAL, "--out", str(out_dir / "drafter_eval.json")]
    name = argv[0].removeprefix("bench.")
    doc = ["--doc", str(out_dir / "benchmarks.md")] if argv[0] in WRITES_DOC else []
    return [*argv, "--tiny", "--out", str(out_dir / f"{name}.json"), *doc]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.run_cpu", description=__doc__.splitlines()[0])
    p.add_argument("--tiny", action="store_true", help="every benchmark's --tiny smoke test")
    p.add_argument("--out-dir", default="", help="with --tiny: where their outputs go "
                   "(default: a temporary folder)")
    args = p.parse_args(argv)
    benches = BENCHES
    if args.tiny:
        out_dir = Path(args.out_dir or tempfile.mkdtemp(prefix="bench-tiny-run_cpu-"))
        out_dir.mkdir(parents=True, exist_ok=True)
        benches = [tiny_argv(b, out_dir) for b in BENCHES]
        print(f"--tiny: outputs in {out_dir}", flush=True)
    failed = []
    for cmd in benches:
        print(f"== python -m {' '.join(cmd)}", flush=True)
        if subprocess.run([sys.executable, "-m", *cmd], check=False).returncode != 0:
            failed.append(cmd[0])
    if failed:
        print(f"failed: {failed}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
