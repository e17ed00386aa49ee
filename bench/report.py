"""What every CPU benchmark records about the machine, and how it rewrites its own section of
docs/benchmarks.md (from its '## ' heading to the next one) without touching the others."""
from __future__ import annotations

import argparse
import json
import os
import platform
from collections.abc import Callable
from pathlib import Path

DOC_HEADER = "# Benchmarks\n"


def machine() -> dict:
    cpu, flags = platform.processor(), set()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
            if line.startswith("flags"):
                flags = set(line.split(":", 1)[1].split())
    except OSError:
        pass
    import torch
    simd = [f for f in ("avx2", "avx512f", "avx512_bf16", "avx_vnni", "amx_tile") if f in flags]
    return {"cpu": cpu, "cores": os.cpu_count(), "simd": simd, "platform": platform.platform(),
            "torch": torch.__version__, "load_avg_start": os.getloadavg()[0]}


def write_section(doc: Path, heading: str, text: str) -> None:
    """Replaces the section starting at `heading` in doc, or appends it."""
    old = doc.read_text() if doc.is_file() else DOC_HEADER
    if heading in old:
        start = old.index(heading)
        nxt = old.find("\n## ", start + len(heading))
        new = old[:start] + text + ("\n" + old[nxt + 1:] if nxt >= 0 else "")
    else:
        new = old.rstrip("\n") + "\n\n" + text
    doc.parent.mkdir(parents=True, exist_ok=True)
    doc.write_text(new)


def save(result: dict, out: Path, doc: Path, heading: str,
         text: str | Callable[[dict], str]) -> None:
    """The run's JSON (with the load average at its end) and its section of the doc; `text` may
    be the function that renders it from the result (then it sees load_avg_end too)."""
    result["load_avg_end"] = os.getloadavg()[0]
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    write_section(doc, heading, text(result) if callable(text) else text)


def add_output_flags(p: argparse.ArgumentParser, name: str) -> None:
    """The flags every CPU benchmark has: --shared, --out (bench/results/<name>.json), --doc,
    --render-only."""
    p.add_argument("--shared", action="store_true", help="note that others used the CPU")
    p.add_argument("--out", default=f"bench/results/{name}.json")
    p.add_argument("--doc", default="docs/benchmarks.md")
    p.add_argument("--render-only", action="store_true", help="rewrite the doc from --out")


def render_only(args: argparse.Namespace, heading: str, markdown: Callable[[dict], str]) -> bool:
    """--render-only: rewrites the benchmark's doc section from its JSON; True when it did."""
    if args.render_only:
        write_section(Path(args.doc), heading, markdown(json.loads(Path(args.out).read_text())))
    return args.render_only


def write_json(path: str | Path, result: dict, args: argparse.Namespace) -> None:
    """A benchmark's JSON; with --tiny marked so (and naming its --work folder)."""
    if getattr(args, "tiny", False):
        from bench.tiny import tiny_fields
        result.update(tiny_fields(), work=str(args.work))
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=2) + "\n")
