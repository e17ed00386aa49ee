"""Where the host time of a running stack goes: py-spy samples each service process (gateway,
target, draft) while a benchmark drives it, and the samples are summarized per process.

Used by `bench.gpu_side_by_side --profile-seconds N` (the c = 1 level of each speculative stack)
for issue 32's lean hot path: the services' GPU work is known from the device traces
(bench.gpu_profile); what is left of a step is Python on the host, and this says which.

py-spy (`pip install py-spy`; on the GPU machine a wheel in .whl) samples without changing the
process (`--nonblocking`); only threads running Python or native code are counted (idle threads,
waiting in epoll or a lock, are not), so a function's share is of the process's busy samples, and
`busy_ms_per_s` says how busy each process was (milliseconds of samples per second of wall time,
summed over its threads: 1 000 = one core busy all the time)."""
from __future__ import annotations

import re
import shutil
import subprocess
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

RATE = 500                          # samples per second per thread
_FRAME = re.compile(r"^(?P<func>.*) \((?P<file>[^()]*?)(?::\d+)?\)$")
# inclusive time of these functions (suffix of "file:function"), when they appear in a stack
PHASES = {
    "gateway": ("generation.py:_step", "draft_link.py:propose", "target_link.py:verify",
                "generation.py:_deliver", "grpc_api.py:Generate", "call_stream.py:call",
                "upstream.py:call"),
    "target": ("engine.py:_step", "engine.py:_run", "engine.py:_decide", "engine.py:_features",
               "worker.py:forward", "servicer.py:verify", "call_stream.py:_call",
               "publisher.py:flush", "scheduler.py:admit"),
    "draft": ("engine.py:_step", "servicer.py:propose", "call_stream.py:_call",
              "dflash_drafter.py:propose", "planes.py:arrive"),
}


@dataclass
class Recording:
    name: str
    path: Path
    proc: subprocess.Popen


def available() -> str | None:
    """The py-spy executable, or None."""
    return shutil.which("py-spy")


def start(pids: dict[str, int], seconds: float, out: Path) -> list[Recording]:
    """One `py-spy record` per process, for `seconds`; collapsed stacks into out/<name>.txt."""
    exe = available()
    if exe is None:
        raise FileNotFoundError("py-spy is not installed (pip install py-spy)")
    out.mkdir(parents=True, exist_ok=True)
    recs = []
    for name, pid in pids.items():
        path = out / f"{name}.txt"
        cmd = [exe, "record", "--pid", str(pid), "--duration", str(int(seconds)), "--rate",
               str(RATE), "--format", "raw", "--nonblocking", "-o", str(path)]
        recs.append(Recording(name, path, subprocess.Popen(
            cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)))
    return recs


def finish(recs: list[Recording], seconds: float, top: int = 25) -> dict:
    """Waits for the recordings; their summaries by process name (or the error of each)."""
    result = {}
    for rec in recs:
        try:
            _, err = rec.proc.communicate(timeout=seconds + 60)
        except subprocess.TimeoutExpired:
            rec.proc.kill()
            err = "py-spy did not finish"
        if rec.proc.returncode != 0 or not rec.path.exists():
            result[rec.name] = {"error": (err or "").strip()[-500:]}
            continue
        result[rec.name] = summarize(rec.path.read_text(), seconds, PHASES.get(rec.name, ()), top)
    return result


def while_driving(pids: dict[str, int], seconds: float, out: Path,
                  run_once: Callable[[int], int]) -> dict:
    """Samples the processes for `seconds` while run_once(i) (the i-th round of requests; it
    returns the tokens it produced) runs again and again: tokens/s while profiled, the rounds,
    and each process's summary (or, without py-spy, the error; the caller's rows are kept)."""
    if available() is None:
        return {"error": "py-spy is not installed (pip install py-spy)"}
    recs = start(pids, seconds, out)
    t0, tokens, rounds = time.monotonic(), 0, 0
    while time.monotonic() - t0 < seconds + 0.5:
        tokens += run_once(rounds)
        rounds += 1
    elapsed = time.monotonic() - t0
    return {"seconds": seconds, "rounds": rounds, "tokens_per_s": round(tokens / elapsed, 1),
            "processes": finish(recs, seconds)}


def parse(text: str) -> list[tuple[list[str], int]]:
    """Collapsed stacks: 'frame;frame;... count' -> ([frames root first], count)."""
    stacks = []
    for line in text.splitlines():
        stack, _, count = line.rpartition(" ")
        if stack and count.isdigit():
            stacks.append((stack.split(";"), int(count)))
    return stacks


def frame_name(frame: str) -> str:
    """'func (path/to/file.py:12)' -> 'file.py:func' (native frames keep their name)."""
    m = _FRAME.match(frame.strip())
    if not m:
        return frame.strip()
    return f"{Path(m['file']).name}:{m['func']}"


def summarize(text: str, seconds: float, phases: tuple[str, ...] = (), top: int = 25) -> dict:
    """Busy samples per process, the top functions by self samples (the innermost frame) and
    by inclusive samples, and the inclusive share of each phase function."""
    stacks = parse(text)
    total = sum(n for _, n in stacks)
    selfs, inclusive, threads = Counter(), Counter(), Counter()
    for frames, n in stacks:
        names = [frame_name(f) for f in frames]
        threads[names[0]] += n                  # py-spy's first frame names the thread
        selfs[names[-1]] += n
        for name in set(names[1:]):
            inclusive[name] += n

    def share(n: int) -> float:
        return round(100 * n / total, 1) if total else 0.0

    return {
        "busy_ms_per_s": round(1000 * total / RATE / seconds, 1),
        "samples": total,
        "threads": {t: share(n) for t, n in threads.most_common(8)},
        "self_pct": {f: share(n) for f, n in selfs.most_common(top)},
        "inclusive_pct": {f: share(n) for f, n in inclusive.most_common(top)},
        "phases_pct": {p: share(sum(n for f, n in inclusive.items() if f.endswith(p)))
                       for p in phases},
    }
