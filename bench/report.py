"""What every CPU benchmark records about the machine, and how it rewrites its own section of
docs/benchmarks.md (from its '## ' heading to the next one) without touching the others."""
from __future__ import annotations

import json
import os
import platform
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


def save(result: dict, out: Path, doc: Path, heading: str, text: str) -> None:
    """The run's JSON (with the load average at its end) and its section of the doc."""
    result["load_avg_end"] = os.getloadavg()[0]
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    write_section(doc, heading, text)
