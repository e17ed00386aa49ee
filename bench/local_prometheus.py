"""A real Prometheus server (Debian's `prometheus` package) scraping services on this machine:
for the monitoring tests and for rendering the dashboard from real data.

    prom = LocalPrometheus([ScrapeJob("gateway", 8000), ...], workdir, interval_s=1.0).start()
    prom.query('sum(dflash_spec_drafts_total)')          # -> [Sample(labels, value)]
    prom.query_range(expr, start, end, step)             # -> [Series(labels, [(t, v)])]
    prom.stop()

The config and the TSDB live in `workdir`; the server runs in its own process group and is
stopped with SIGTERM (then SIGKILL)."""
from __future__ import annotations

import json
import math
import os
import shutil
import signal
import subprocess
import time
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from services.common.ports import free_port

REPO = Path(__file__).resolve().parents[1]
INSTALL_SCRIPT = REPO / "deploy" / "install-test-tools.sh"


def ensure_installed(tools: tuple[str, ...] = ("prometheus", "promtool")) -> None:
    """Installs the Debian packages behind `tools` when one is missing (deploy/install-test-tools.sh)."""
    if all(shutil.which(t) for t in tools):
        return
    done = subprocess.run(["bash", str(INSTALL_SCRIPT)], check=False, capture_output=True,
                          text=True)
    missing = [t for t in tools if not shutil.which(t)]
    if done.returncode or missing:
        raise RuntimeError(f"could not install {missing or list(tools)} ({INSTALL_SCRIPT} exited "
                           f"{done.returncode}):\n{done.stdout[-2000:]}\n{done.stderr[-2000:]}")


@dataclass(frozen=True)
class ScrapeJob:
    name: str                     # the job label (the dashboard's readiness panel uses it)
    port: int
    host: str = "127.0.0.1"
    path: str = "/metrics"


@dataclass(frozen=True)
class Sample:
    labels: dict[str, str]
    value: float


@dataclass(frozen=True)
class Series:
    labels: dict[str, str]
    points: list[tuple[float, float]]       # (unix time, value)


def config_text(jobs: list[ScrapeJob], interval_s: float) -> str:
    """prometheus.yml for `jobs` (JSON is valid YAML)."""
    interval = f"{int(interval_s * 1000)}ms"
    return json.dumps({
        "global": {"scrape_interval": interval, "evaluation_interval": interval},
        "scrape_configs": [{"job_name": j.name, "metrics_path": j.path,
                            "static_configs": [{"targets": [f"{j.host}:{j.port}"]}]}
                           for j in jobs]}, indent=2)


class LocalPrometheus:
    def __init__(self, jobs: list[ScrapeJob], workdir: Path, interval_s: float = 1.0,
                 port: int = 0) -> None:
        self.jobs, self.interval_s = jobs, interval_s
        self.workdir = Path(workdir)
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc: subprocess.Popen | None = None

    def start(self, timeout_s: float = 60.0) -> LocalPrometheus:
        ensure_installed()
        self.workdir.mkdir(parents=True, exist_ok=True)
        config = self.workdir / "prometheus.yml"
        config.write_text(config_text(self.jobs, self.interval_s))
        self.log_path = self.workdir / "prometheus.log"
        with open(self.log_path, "w") as log:
            self.proc = subprocess.Popen(
                ["prometheus", f"--config.file={config}",
                 f"--storage.tsdb.path={self.workdir / 'data'}",
                 f"--web.listen-address=127.0.0.1:{self.port}",
                 "--storage.tsdb.retention.time=1d", "--log.level=warn"],
                stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        self._wait_ready(timeout_s)
        return self

    def _wait_ready(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"prometheus exited with {self.proc.returncode}:\n{self.log()}")
            try:
                with urllib.request.urlopen(f"{self.url}/-/ready", timeout=2) as r:
                    if r.status == 200:
                        return
            except (OSError, urllib.error.URLError):
                pass
            time.sleep(0.2)
        raise TimeoutError(f"prometheus not ready after {timeout_s} s:\n{self.log()}")

    def log(self) -> str:
        path = getattr(self, "log_path", None)
        return path.read_text()[-4000:] if path and path.exists() else ""

    def stop(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        os.killpg(self.proc.pid, signal.SIGTERM)
        try:
            self.proc.wait(15)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(5)

    # -- HTTP API ----------------------------------------------------------------------------
    def _api(self, path: str, params: dict[str, str]) -> dict:
        url = f"{self.url}/api/v1/{path}?{urllib.parse.urlencode(params)}"
        try:
            with urllib.request.urlopen(url, timeout=30) as r:
                body = json.loads(r.read())
        except urllib.error.HTTPError as e:
            body = json.loads(e.read() or b"{}")
        if body.get("status") != "success":
            raise ValueError(f"prometheus {path} {params}: {body.get('errorType')}: "
                             f"{body.get('error')}")
        return body["data"]

    def query(self, expr: str, at: float | None = None) -> list[Sample]:
        params = {"query": expr} | ({"time": f"{at:.3f}"} if at is not None else {})
        data = self._api("query", params)
        if data["resultType"] == "scalar":
            return [Sample({}, float(data["result"][1]))]
        return [Sample(r["metric"], float(r["value"][1])) for r in data["result"]]

    def query_range(self, expr: str, start: float, end: float, step_s: float) -> list[Series]:
        data = self._api("query_range", {"query": expr, "start": f"{start:.3f}",
                                         "end": f"{end:.3f}", "step": f"{step_s}"})
        return [Series(r["metric"], [(float(t), float(v)) for t, v in r["values"]])
                for r in data["result"]]

    def wait_for(self, expr: str, predicate, timeout_s: float = 30.0) -> list[Sample]:
        """Until predicate(query(expr)) is true (fresh scrapes land every interval)."""
        deadline = time.monotonic() + timeout_s
        got: list[Sample] = []
        while time.monotonic() < deadline:
            got = self.query(expr)
            if predicate(got):
                return got
            time.sleep(self.interval_s / 2)
        raise TimeoutError(f"{expr}: still {got} after {timeout_s} s")


def finite(samples: list[Sample]) -> list[Sample]:
    return [s for s in samples if math.isfinite(s.value)]
