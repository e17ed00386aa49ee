"""python -m bench.render_dashboard: the Grafana dashboard's panels drawn with matplotlib from
real Prometheus data (for the README, where Grafana itself cannot run).

Default: start the local stack (`dflash up`'s Stack: SmolLM2-135M-Instruct + the trained DFlash
drafter, metrics on), a real Prometheus scraping it every second (bench/local_prometheus.py),
send chat requests from a few clients for --seconds (with --max-running below the concurrency,
so requests also wait, and one invalid request every 20 s, so the error panel has something to
show), then query every panel of deploy/grafana/dashboards/dflash.json over the run and draw
them in the dashboard's layout to docs/img/dashboard.png.

    python -m bench.render_dashboard [--seconds 150] [--concurrency 3] [--out PNG]
    python -m bench.render_dashboard --prometheus http://HOST:9090 --minutes 15   (any Prometheus
        that scrapes the three services, e.g. the docker-compose one)

Needs matplotlib (not a dependency of the services) and Debian's prometheus for the default."""
from __future__ import annotations

import argparse
import itertools
import math
import os
import random
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from bench import grafana_dashboard as dash
from bench.local_prometheus import LocalPrometheus, ScrapeJob, Series
from services.common.ports import free_port

REPO = Path(__file__).resolve().parents[1]
OUT = REPO / "docs" / "img" / "dashboard.png"
DRAFTER = REPO / "models" / "smollm2-135m-instruct-dflash"
MODEL = "smollm2-135m-instruct"
PROMPTS = [
    "List the numbers from 1 to 40, separated by commas.",
    "Repeat this sentence three times: the quick brown fox jumps over the lazy dog.",
    "Write the alphabet in capital letters, separated by spaces.",
    "Explain in two sentences why the sky is blue.",
    "Write a short poem about the sea.",
    "What is the capital of France? Answer in one sentence.",
    "Give three tips for writing clean Python code.",
    "Translate to French: good morning, how are you today?",
]


@dataclass(frozen=True)
class Window:
    start: float
    end: float
    step_s: float
    rate_window: str                 # what $__rate_interval becomes


# -- drawing --------------------------------------------------------------------------------------
def _fmt(value: float, unit: str) -> str:
    if not math.isfinite(value):
        return "-"
    if unit == "s":
        return f"{value * 1000:.0f} ms" if abs(value) < 1 else f"{value:.2f} s"
    if unit == "percentunit":
        return f"{value * 100:.1f}%" if abs(value) < 0.1 else f"{value * 100:.0f}%"
    if unit == "bytes":
        for name, size in (("GiB", 2 ** 30), ("MiB", 2 ** 20), ("KiB", 2 ** 10)):
            if abs(value) >= size:
                return f"{value / size:.1f} {name}"
        return f"{value:.0f} B"
    if unit == "reqps":
        return f"{value:.2f}/s"
    return f"{value:.2f}" if abs(value) < 100 else f"{value:.0f}"


def _axis_formatter(unit: str):
    from matplotlib.ticker import FuncFormatter
    return FuncFormatter(lambda v, _: _fmt(v, unit))


COLORS = {"red": "tab:red", "green": "tab:green"}


def _draw_stat(ax, panel: dash.Panel, prom: LocalPrometheus, w: Window) -> None:
    """The last value of each series, big, with the panel's value mappings (READY, ...)."""
    ax.axis("off")
    rows = []
    for q in panel.queries:
        for s in prom.query(dash.with_window(q.expr, w.rate_window), at=w.end):
            text, color = panel.mappings.get(s.value, (_fmt(s.value, panel.unit), "blue"))
            rows.append((dash.legend(q.legend, s.labels), text, COLORS.get(color, "tab:blue")))
    rows.sort(key=lambda r: r[0])
    n = max(1, len(rows))
    for i, (name, text, color) in enumerate(rows):
        x = (i + 0.5) / n
        ax.text(x, 0.45, text, ha="center", va="center", fontsize=15 if n < 3 else 11,
                color=color, weight="bold", transform=ax.transAxes)
        ax.text(x, 0.12, name, ha="center", va="center", fontsize=8, color="0.3",
                transform=ax.transAxes)
    if not rows:
        ax.text(0.5, 0.45, "no data", ha="center", va="center", transform=ax.transAxes)


def _draw_timeseries(ax, panel: dash.Panel, prom: LocalPrometheus, w: Window) -> None:
    """One line per series (stacked areas when the panel stacks; the panel's right-axis
    queries on a second axis)."""
    curves: list[tuple[str, str, Series]] = []          # (legend, refId, series)
    for q in panel.queries:
        for s in prom.query_range(dash.with_window(q.expr, w.rate_window), w.start, w.end,
                                  w.step_s):
            curves.append((dash.legend(q.legend, s.labels), q.ref_id, s))
    curves.sort(key=lambda c: c[0])
    twin = ax.twinx() if panel.right_axis else None
    if panel.stacked and curves:
        times = sorted({t for _, _, s in curves for t, _ in s.points})
        ys = []
        for _, _, s in curves:
            points = dict(s.points)
            ys.append([v if math.isfinite(v := points.get(t, 0.0)) else 0.0 for t in times])
        ax.stackplot([t - w.start for t in times], ys, labels=[c[0] for c in curves], alpha=0.7)
    else:
        for name, ref, s in curves:
            target = twin if ref in panel.right_axis else ax
            target.plot([t - w.start for t, _ in s.points], [v for _, v in s.points],
                        label=name, linewidth=1.2)
    handles, names = ax.get_legend_handles_labels()
    if twin is not None:
        twin.tick_params(labelsize=7)
        more = twin.get_legend_handles_labels()
        handles, names = handles + more[0], names + more[1]
    ax.yaxis.set_major_formatter(_axis_formatter(panel.unit))
    ax.tick_params(labelsize=7)
    ax.set_xlim(0, w.end - w.start)
    ax.set_xlabel("seconds into the run", fontsize=7)
    ax.grid(alpha=0.3)
    if handles:
        ax.legend(handles, names, fontsize=6, loc="upper left", ncol=2 if len(names) > 6 else 1)
    else:
        ax.text(0.5, 0.5, "no data", ha="center", va="center", transform=ax.transAxes)


def render(prom: LocalPrometheus, w: Window, out: Path, subtitle: str) -> Path:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = dash.panels()
    rows = max(p.grid[1] + p.grid[3] for p in panels)
    unit_w, unit_h = 0.78, 0.36                             # inches per grid column / row
    fig = plt.figure(figsize=(24 * unit_w, rows * unit_h + 0.8))
    top = 0.8 / (rows * unit_h + 0.8)
    for p in panels:
        x, y, gw, gh = p.grid
        left = x / 24 + 0.035 / (gw / 8)
        width = gw / 24 - 0.05 / (gw / 8)
        height = (gh / rows) * (1 - top) - 0.045
        bottom = (1 - top) * (1 - (y + gh) / rows) + 0.02
        ax = fig.add_axes((left, bottom, width, height))
        ax.set_title(p.title, fontsize=9, loc="left", weight="bold")
        if p.kind == "stat":
            _draw_stat(ax, p, prom, w)
        else:
            _draw_timeseries(ax, p, prom, w)
    fig.suptitle(f"DFlash speculative decoding - {subtitle}", x=0.01, ha="left", fontsize=12)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=80)
    plt.close(fig)
    return out


# -- load -----------------------------------------------------------------------------------------
def run_load(http_url: str, seconds: float, concurrency: int, seed: int = 0) -> dict[str, int]:
    """Chat requests from `concurrency` clients until `seconds` pass; one invalid request
    every 20 s. Returns counts."""
    import httpx
    from openai import OpenAI
    client = OpenAI(base_url=f"{http_url}/v1", api_key="x", max_retries=0, timeout=600)
    stop_at = time.monotonic() + seconds
    counts = {"ok": 0, "invalid": 0}
    lock = threading.Lock()
    rng = random.Random(seed)
    order = itertools.cycle(rng.sample(PROMPTS, len(PROMPTS)))

    def worker(i: int) -> None:
        while time.monotonic() < stop_at:
            with lock:
                prompt = next(order)
            stream = i % 2 == 1
            kw = {"model": MODEL, "temperature": 0, "max_tokens": 64,
                  "messages": [{"role": "user", "content": prompt}]}
            if stream:
                for _ in client.chat.completions.create(stream=True, **kw):
                    pass
            else:
                client.chat.completions.create(**kw)
            with lock:
                counts["ok"] += 1

    def invalid() -> None:
        while time.monotonic() < stop_at - 5:
            time.sleep(20)
            httpx.post(f"{http_url}/v1/chat/completions", json={"model": MODEL, "bogus": 1})
            with lock:
                counts["invalid"] += 1

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(concurrency)]
    threads.append(threading.Thread(target=invalid, daemon=True))
    for t in threads:
        t.start()
    for t in threads[:-1]:
        t.join()
    return counts


def run_and_render(args: argparse.Namespace) -> Path:
    from dflash.stack import Stack, StackOptions
    os.environ["DFLASH_MAX_RUNNING"] = str(args.max_running)      # the gateway reads it
    work = Path(tempfile.mkdtemp(prefix="dflash-render-"))
    ports = {k: free_port() for k in ("http", "grpc", "target", "draft", "tm", "dm")}
    stack = Stack(StackOptions(http_port=ports["http"], port=ports["grpc"],
                               target_port=ports["target"], draft_port=ports["draft"],
                               target_metrics_port=ports["tm"], draft_metrics_port=ports["dm"],
                               drafter="dflash", draft_model=str(DRAFTER),
                               log_dir=str(work / "logs"), quiet=True))
    jobs = [ScrapeJob("gateway", ports["http"]), ScrapeJob("target", ports["tm"]),
            ScrapeJob("draft", ports["dm"])]
    prom = LocalPrometheus(jobs, work / "prometheus", interval_s=1.0).start()
    try:
        t0 = time.time()
        prom.wait_for("up", lambda s: len(s) == len(jobs), 30)   # first scrapes: nothing there
        stack.start()                     # Prometheus sees the services start up too
        stack.wait_ready()
        print(f"stack ready after {time.time() - t0:.0f} s; load for {args.seconds} s ...",
              flush=True)
        counts = run_load(stack.http_url, args.seconds, args.concurrency)
        time.sleep(5)
        t1 = time.time()
        print(f"requests: {counts}", flush=True)
        window = Window(t0, t1, step_s=2.0, rate_window=args.rate_window)
        subtitle = (f"local run, {counts['ok']} chat requests from {args.concurrency} clients "
                    f"(--max-running {args.max_running}), SmolLM2-135M-Instruct + trained "
                    f"DFlash drafter on CPU; Prometheus scrape 1 s, rate window "
                    f"{args.rate_window}")
        return render(prom, window, Path(args.out), subtitle)
    finally:
        stack.stop()
        prom.stop()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.render_dashboard",
                                description=__doc__.splitlines()[0])
    p.add_argument("--out", default=str(OUT))
    p.add_argument("--seconds", type=float, default=150.0, help="load duration")
    p.add_argument("--concurrency", type=int, default=3)
    p.add_argument("--max-running", type=int, default=2, help="the gateway's --max-running")
    p.add_argument("--rate-window", default="15s", help="what $__rate_interval becomes")
    p.add_argument("--prometheus", default="", help="render from this Prometheus instead")
    p.add_argument("--minutes", type=float, default=15.0, help="with --prometheus: time range")
    args = p.parse_args(argv)
    if args.prometheus:
        prom = LocalPrometheus([], Path(tempfile.mkdtemp()))
        prom.url = args.prometheus.rstrip("/")
        end = time.time()
        w = Window(end - args.minutes * 60, end, max(1.0, args.minutes * 60 / 300),
                   args.rate_window)
        out = render(prom, w, Path(args.out), f"{args.prometheus}, last {args.minutes:g} min")
    else:
        out = run_and_render(args)
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
