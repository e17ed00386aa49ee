"""Observability end to end (docs/architecture.md §9, issue 6).

- The Grafana dashboard (deploy/grafana/dashboards/dflash.json) is valid and its queries name
  only metrics of services/common/metrics.py (static), and only metrics the three services
  really export on their live /metrics (against the stack below).
- A real Prometheus (Debian's package, installed when missing) scrapes a stack started by
  `dflash up` (SmolLM2-135M-Instruct + the trained DFlash drafter) every second; after a few
  requests every dashboard query returns data, the mean acceptance length computed in PromQL
  equals the one the gateway reports in its Usage for the same requests, the token and step
  counters add up to those Usage fields, and provoked errors appear by service, method, code.
- Structured logs: a request's id and sequence id lead from the gateway's "request finished"
  line to the target's and the draft's per-RPC lines; the level is configurable.
- Readiness gauges of all three services are 0 before their warm-up ends and 1 after."""
from __future__ import annotations

import json
import math
import os
import re
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import httpx
import pytest
from grpc_health.v1 import health_pb2
from openai import OpenAI
from prometheus_client.parser import text_string_to_metric_families
from support import prom
from support.draft_service import start_draft
from support.gateway_stack import start_gateway, wait_until
from support.procs import REPO, free_port, health_status, start_target, stop_launcher

from bench import grafana_dashboard as dash
from bench.local_prometheus import LocalPrometheus, Sample, ScrapeJob, finite
from dflash.harness import HookFlags
from dflash.v1 import (
    common_pb2,
    draft_pb2,
    draft_pb2_grpc,
    gateway_pb2,
    gateway_pb2_grpc,
    target_pb2,
    target_pb2_grpc,
)
from services.common import metrics
from services.common.internal_auth import ENV, HEADER

MODEL = "smollm2-135m-instruct"
DRAFTER = REPO / "models" / "smollm2-135m-instruct-dflash"
SYNTHETIC = {"up"}                 # per scrape job, written by Prometheus itself
READY_NAME = "dflash_ready"


def exported_names(registry_metrics) -> set[str]:
    """Sample names a set of prometheus_client collectors exposes (_total, _bucket, ...)."""
    names = set()
    for collector in registry_metrics:
        for family in collector.describe():
            name = family.name
            names |= {"counter": {f"{name}_total"}, "gauge": {name},
                      "histogram": {f"{name}_bucket", f"{name}_sum", f"{name}_count"}}[family.type]
    return names


def defined_metrics() -> set[str]:
    from prometheus_client.metrics import MetricWrapperBase
    return exported_names(v for v in vars(metrics).values() if isinstance(v, MetricWrapperBase))


# -- static: the dashboard file ------------------------------------------------------------------
def test_dashboard_is_valid_and_names_only_defined_metrics():
    d = dash.load()
    panels = dash.panels(d)
    assert d["uid"] == "dflash" and len(panels) >= 12
    assert len({p.id for p in panels}) == len(panels)
    cells: set[tuple[int, int]] = set()
    for p in panels:
        x, y, w, h = p.grid
        assert 0 <= x and x + w <= 24 and w > 0 and h > 0, p.title
        mine = {(cx, cy) for cx in range(x, x + w) for cy in range(y, y + h)}
        assert not mine & cells, f"panel {p.title!r} overlaps another"
        cells |= mine
        assert p.queries and all(q.expr and q.ref_id for q in p.queries), p.title
    defined = defined_metrics()
    for expr in dash.expressions(d):
        names = dash.metric_names(expr)
        assert names, expr
        assert names <= defined | SYNTHETIC, f"{expr}: unknown {names - defined - SYNTHETIC}"
    # what the issue asks the dashboard to show
    titles = " | ".join(p.title.lower() for p in panels)
    for words in ("throughput", "time to first token", "inter-token", "acceptance length",
                  "acceptance rate", "by draft position", "step time", "kv cache",
                  "running / waiting", "readiness", "errors"):
        assert words in titles, words


def test_metric_name_extraction():
    assert dash.metric_names('histogram_quantile(0.9, sum by (le, service) '
                             '(rate(a_bucket{code!="OK"}[5m])))') == {"a_bucket"}
    assert dash.metric_names("1 + sum(rate(x_total[$__rate_interval])) / scalar(y) * 1e3") == \
        {"x_total", "y"}
    assert dash.metric_names("max by (job) (r) or max by (job) (0 * up{job=~\"a|b\"})") == \
        {"r", "up"}


# -- running / waiting of an engine loop -----------------------------------------------------------
def test_engine_loop_running_and_waiting_gauges():
    """While a batch runs, its works count as running, not waiting; what queues behind it is
    waiting; both read 0 once done - through the gauges, read at scrape time."""
    import asyncio

    from prometheus_client import REGISTRY

    from services.common.engine_loop import EngineLoop, Work
    release = threading.Event()

    def step(batch):
        release.wait(10)
        for work, _ in batch:
            work.resolve(len(batch))

    loop = EngineLoop(step, token_budget=1, name="gauge-test")
    metrics.watch_queue(loop)
    lb = metrics.labels()

    def gauge(name: str) -> float:
        return REGISTRY.get_sample_value(name, {"model_name": lb.model_name, "service": lb.service})

    async def scenario():
        loop.start()
        first = asyncio.ensure_future(loop.submit(Work("verify", "a", None, cost=1)))
        await asyncio.to_thread(wait_until, lambda: loop.running == 1, 5)
        second = asyncio.ensure_future(loop.submit(Work("verify", "b", None, cost=1)))
        await asyncio.to_thread(wait_until, lambda: loop.waiting == 1, 5)
        seen = (gauge("dflash_requests_running"), gauge("dflash_requests_waiting"))
        release.set()
        await asyncio.gather(first, second)
        return seen

    try:
        assert asyncio.run(scenario()) == (1, 1)
        wait_until(lambda: loop.running == 0, 5)
        assert (gauge("dflash_requests_running"), gauge("dflash_requests_waiting")) == (0, 0)
    finally:
        release.set()
        loop.stop()


# -- readiness gauges through real processes ------------------------------------------------------
def ready_value(port: int, service: str) -> float | None:
    try:
        return prom.value(port, READY_NAME, service=service)
    except OSError:
        return None


@pytest.mark.slow
def test_readiness_gauges_zero_before_warmup_one_after(tiny_llama_dir, smollm2_dir, log_dir):
    """target (warm-up +6 s) and draft (+16 s) with /metrics, and a gateway: each one's
    dflash_ready is 0 while its grpc.health.v1 status is NOT_SERVING, then 1. (The tiny target
    has no tokenizer of its own; the gateway tokenizes with SmolLM2's, as in its own tests.)"""
    NOT, SERVING = health_pb2.HealthCheckResponse.NOT_SERVING, health_pb2.HealthCheckResponse.SERVING
    tm, dm = free_port(), free_port()
    target = start_target(tiny_llama_dir, log_dir, "--metrics-port", str(tm), wait=False,
                          hooks=HookFlags(warmup_delay_s=6))
    draft = start_draft(tiny_llama_dir, log_dir, "--drafter", "prompt-lookup", "--metrics-port",
                        str(dm), wait=False, hooks=HookFlags(warmup_delay_s=16))
    gw = start_gateway(target.address, smollm2_dir, log_dir, draft=draft.address, wait=False)
    try:
        for proc, port, name in ((target, tm, "target"), (draft, dm, "draft")):
            wait_until(lambda p=port, n=name: ready_value(p, n) is not None, timeout=60,
                       what=f"{name} /metrics")
            before = health_status(proc.address, proc.service)
            value = ready_value(port, name)
            after = health_status(proc.address, proc.service)
            assert (before, value, after) == (NOT, 0, NOT), name
        target.wait_serving(timeout=120)
        assert ready_value(tm, "target") == 1
        # the gateway knows its model once the target serves; it is not ready without the draft
        wait_until(lambda: ready_value(gw.http_port, "gateway") is not None, timeout=60,
                   what="the gateway's readiness gauge")
        assert health_status(draft.address, draft.service) == NOT
        assert ready_value(gw.http_port, "gateway") == 0
        assert gw.readiness()[0] == 503
        draft.wait_serving(timeout=120)
        assert ready_value(dm, "draft") == 1
        wait_until(lambda: ready_value(gw.http_port, "gateway") == 1, timeout=60,
                   what="gateway ready gauge 1")
        assert health_status(gw.address, gw.service) == SERVING
        # default level INFO: no per-RPC debug lines
        assert " DEBUG " not in target.log() and "logging configured" in target.log()
    finally:
        for p in (gw, draft, target):
            p.stop()


# -- a real Prometheus on the `dflash up` stack ---------------------------------------------------
@dataclass
class Run:
    ports: dict[str, int]
    log_dir: Path
    prom: LocalPrometheus
    t0: float                                   # before the first request (unix time)
    t1: float = 0.0                             # after the last scrape of the results
    usages: list[dict] = field(default_factory=list)      # spec_decode + token counts per request
    http_ids: list[str] = field(default_factory=list)     # response ids of the HTTP requests
    grpc_request_id: str = "monitoring-grpc-1"

    def window(self) -> str:
        return f"{math.ceil(self.t1 - self.t0) + 5}s"

    def query(self, expr: str) -> list[Sample]:
        return self.prom.query(dash.with_window(expr, self.window()), at=self.t1)


PROMPTS = ["List the numbers from 1 to 30, separated by commas.",
           "Repeat exactly: the quick brown fox jumps over the lazy dog. The quick brown fox",
           "Write the alphabet in capital letters with spaces between the letters.",
           "The days of the week are Monday, Tuesday,"]


def _launch(tmp: Path) -> tuple[subprocess.Popen, dict[str, int], Path]:
    ports = {k: free_port() for k in ("http", "grpc", "target", "draft", "tm", "dm")}
    log = tmp / "up.log"
    proc = subprocess.Popen(
        [sys.executable, "-m", "dflash.cli", "up", "--host", "127.0.0.1",
         "--http-port", str(ports["http"]), "--port", str(ports["grpc"]),
         "--target-port", str(ports["target"]), "--draft-port", str(ports["draft"]),
         "--target-metrics-port", str(ports["tm"]), "--draft-metrics-port", str(ports["dm"]),
         "--drafter", "dflash", "--draft-model", str(DRAFTER), "--log-dir", str(tmp / "logs"),
         # every request drafts, also the overlapping ones (on the CPU `dflash up` otherwise
         # drafts only while one request runs): the dashboards and logs below follow drafts
         "--spec-disable-batch-size", "0"],
        cwd=REPO, stdout=open(log, "w"), stderr=subprocess.STDOUT,  # noqa: SIM115
        start_new_session=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1", "DFLASH_LOG_LEVEL": "DEBUG",
             ENV: INTERNAL_TOKEN})
    return proc, ports, log


def _requests(run: Run) -> None:
    """Chat (two at once, to overlap), a streamed chat with usage, a completion, and a gRPC
    Generate; each one's usage recorded."""
    base = f"http://127.0.0.1:{run.ports['http']}"
    client = OpenAI(base_url=f"{base}/v1", api_key="x", max_retries=0, timeout=300)
    lock = threading.Lock()

    def chat(prompt: str) -> None:
        r = client.chat.completions.create(model=MODEL, temperature=0, max_tokens=48,
                                           messages=[{"role": "user", "content": prompt}])
        with lock:
            run.usages.append(_usage(r.usage.model_dump()))
            run.http_ids.append(r.id)

    threads = [threading.Thread(target=chat, args=(p,)) for p in PROMPTS[:2]]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    stream = client.chat.completions.create(
        model=MODEL, temperature=0, max_tokens=40, stream=True,
        stream_options={"include_usage": True},
        messages=[{"role": "user", "content": PROMPTS[2]}])
    usage = [c.usage for c in stream if c.usage]
    run.usages.append(_usage(usage[-1].model_dump()))
    c = client.completions.create(model=MODEL, prompt=PROMPTS[3], max_tokens=32, temperature=0)
    run.usages.append(_usage(c.usage.model_dump()))
    with grpc.insecure_channel(f"127.0.0.1:{run.ports['grpc']}") as ch:
        stub = gateway_pb2_grpc.GatewayStub(ch)
        last = list(stub.Generate(gateway_pb2.GenerateRequest(
            text=PROMPTS[1], max_tokens=40, sampling=common_pb2.SamplingParams(temperature=0),
            request_id=run.grpc_request_id), timeout=300))[-1]
    u = last.usage
    run.usages.append({"prompt_tokens": u.prompt_tokens, "completion_tokens": u.completion_tokens,
                       "draft_steps": u.draft_steps, "draft_tokens": u.draft_tokens,
                       "accepted_tokens": u.accepted_tokens, "mean_acceptance_length": None})


def _usage(u: dict) -> dict:
    s = u["spec_decode"]
    return {"prompt_tokens": u["prompt_tokens"], "completion_tokens": u["completion_tokens"],
            "draft_steps": s["draft_steps"], "draft_tokens": s["draft_tokens"],
            "accepted_tokens": s["accepted_tokens"],
            "mean_acceptance_length": s["mean_acceptance_length"]}


INTERNAL_TOKEN = "monitoring-internal-token"

# the errors provoked, as (labels the error series must carry)
PROVOKED = [{"service": "gateway", "method": "Generate", "code": "INVALID_ARGUMENT"},
            {"service": "target", "method": "Verify", "code": "NOT_FOUND"},
            {"service": "draft", "method": "Propose", "code": "INVALID_ARGUMENT"},
            {"path": "/v1/chat/completions", "status": "400"},
            {"path": "/v1/chat/completions", "status": "404"}]


def _provoke_errors(run: Run) -> None:
    p = run.ports
    base = f"http://127.0.0.1:{p['http']}/v1/chat/completions"
    assert httpx.post(base, json={"model": MODEL, "messages": [], "bogus": 1}).status_code == 400
    assert httpx.post(base, json={"model": "no-such-model", "messages": [
        {"role": "user", "content": "hi"}]}).status_code == 404
    calls = [(p["grpc"], lambda ch: gateway_pb2_grpc.GatewayStub(ch).Generate(
                 gateway_pb2.GenerateRequest(text=""), timeout=10).__next__(),
              grpc.StatusCode.INVALID_ARGUMENT),
             (p["target"], lambda ch: target_pb2_grpc.TargetStub(ch).Verify(
                 target_pb2.VerifyRequest(sequence_id="no-such-seq", token_ids=[1]), timeout=10),
              grpc.StatusCode.NOT_FOUND),
             (p["draft"], lambda ch: draft_pb2_grpc.DraftStub(ch).Propose(
                 draft_pb2.ProposeRequest(sequence_id="x", anchor=1, block_size=999), timeout=10),
              grpc.StatusCode.INVALID_ARGUMENT)]
    for port, call, code in calls:
        # the stack's internal token (given to `dflash up`) on the target's and draft's ports
        with grpc.intercept_channel(grpc.insecure_channel(f"127.0.0.1:{port}"),
                                    _WithToken()) as ch:
            with pytest.raises(grpc.RpcError) as e:
                call(ch)
            assert e.value.code() == code


class _WithToken(grpc.UnaryUnaryClientInterceptor, grpc.UnaryStreamClientInterceptor):
    """Adds the stack's internal token to a call (the gateway's port ignores it)."""

    def _details(self, details):
        return details._replace(metadata=[*(details.metadata or ()), (HEADER, INTERNAL_TOKEN)])

    def intercept_unary_unary(self, continuation, details, request):
        return continuation(self._details(details), request)

    def intercept_unary_stream(self, continuation, details, request):
        return continuation(self._details(details), request)


def _total(run: Run, key: str) -> int:
    return sum(u[key] for u in run.usages)


def _scalar(samples: list[Sample]) -> float:
    assert len(samples) == 1, samples
    return samples[0].value


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("monitoring")
    proc, ports, log = _launch(tmp)
    prometheus = None
    try:
        def up():
            assert proc.poll() is None, log.read_text()
            return "dflash stack is up" in log.read_text()
        wait_until(up, timeout=300, interval=0.5, what="dflash up")
        jobs = [ScrapeJob("gateway", ports["http"]), ScrapeJob("target", ports["tm"]),
                ScrapeJob("draft", ports["dm"])]
        prometheus = LocalPrometheus(jobs, tmp / "prometheus", interval_s=1.0).start()
        prometheus.wait_for("up", lambda s: len(s) == 3 and all(x.value == 1 for x in s), 60)
        # the gateway's counters exist at 0 before any request, so rate() counts every step
        prometheus.wait_for("dflash_spec_drafts_total", lambda s: [x.value for x in s] == [0], 30)
        r = Run(ports, tmp / "logs", prometheus, t0=time.time() - 2)
        _requests(r)
        _provoke_errors(r)
        steps = _total(r, "draft_steps")
        prometheus.wait_for("sum(dflash_spec_drafts_total)",
                            lambda s: s and s[0].value == steps, 30)
        prometheus.wait_for('sum(dflash_rpc_requests_total{service="draft",code!="OK"})',
                            lambda s: s and s[0].value >= 1, 30)
        time.sleep(2.5)                              # a couple more scrapes of the final state
        r.t1 = time.time()
        yield r
    finally:
        if prometheus is not None:
            prometheus.stop()
        stop_launcher(proc)


@pytest.mark.slow
def test_every_dashboard_query_returns_data(run):
    empty = {}
    for expr in dash.expressions():
        got = finite(run.query(expr))
        if not got:
            empty[expr] = run.query(expr)
    assert not empty, f"dashboard queries without finite data: {json.dumps(str(empty))}"


@pytest.mark.slow
def test_acceptance_length_in_promql_equals_the_gateways(run):
    steps, accepted = _total(run, "draft_steps"), _total(run, "accepted_tokens")
    assert steps > 0 and accepted > 0, run.usages      # the trained drafter gets drafts accepted
    expected = 1 + accepted / steps
    # each response's own figure is the same definition (rounded to 4 places in the response)
    for u in run.usages:
        if u["mean_acceptance_length"] is not None:
            own = 1 + u["accepted_tokens"] / u["draft_steps"] if u["draft_steps"] else 1.0
            assert u["mean_acceptance_length"] == round(own, 4), u
    # counters: exactly the Usage sums (integers)
    totals = {"dflash_spec_drafts_total": steps, "dflash_spec_accepted_tokens_total": accepted,
              "dflash_spec_draft_tokens_total": _total(run, "draft_tokens"),
              "dflash_spec_accepted_tokens_per_position_total": accepted,
              "dflash_generation_tokens_total": _total(run, "completion_tokens"),
              "dflash_prompt_tokens_total": _total(run, "prompt_tokens")}
    for name, value in totals.items():
        assert _scalar(run.query(f"sum({name})")) == value, name
    # PromQL over the counters: the same float operations, so exactly equal
    assert _scalar(run.query("1 + sum(dflash_spec_accepted_tokens_total) / "
                             "sum(dflash_spec_drafts_total)")) == expected
    # the dashboard's rate() form over a window holding every request: both counters started at
    # 0 inside the window and are sampled at the same instants, so rate()'s extrapolation
    # factor is the same for both and cancels; only float rounding is left (rel 1e-9)
    [panel_expr] = {q.expr for p in dash.panels() if p.title == "Mean acceptance length"
                    for q in p.queries}                  # the stat and the time series
    assert _scalar(run.query(panel_expr)) == pytest.approx(expected, rel=1e-9)


@pytest.mark.slow
def test_dashboard_names_only_metrics_the_services_export(run):
    live: dict[str, set[str]] = {}
    for job, port in (("gateway", run.ports["http"]), ("target", run.ports["tm"]),
                      ("draft", run.ports["dm"])):
        text = httpx.get(f"http://127.0.0.1:{port}/metrics").text
        live[job] = {s.name for f in text_string_to_metric_families(text) for s in f.samples}
    exported = set().union(*live.values())
    used = set().union(*(dash.metric_names(e) for e in dash.expressions()))
    assert used - SYNTHETIC <= exported, f"not exported: {used - SYNTHETIC - exported}"
    for job, names in live.items():                      # each service reports its readiness
        assert READY_NAME in names, job


@pytest.mark.slow
def test_provoked_errors_show_by_service_method_and_code(run):
    [panel] = [p for p in dash.panels() if p.title.startswith("Errors")]
    series = [s.labels for q in panel.queries for s in run.query(q.expr) if s.value >= 1]
    for labels in PROVOKED:
        assert any(labels.items() <= s.items() for s in series), (labels, series)
    # the upstream error series exist from the start (at 0), so a first error shows in rate()
    upstream = run.query("sum by (upstream, code) (dflash_upstream_errors_total)")
    assert {(s.labels["upstream"], s.labels["code"]) for s in upstream} >= {
        ("target", "UNAVAILABLE"), ("draft", "UNAVAILABLE")}


@pytest.mark.slow
def test_queue_gauges_rise_under_load_and_return_to_zero(run):
    busy = run.query(f"max_over_time(dflash_requests_running{{service=\"gateway\"}}"
                     f"[{run.window()}])")
    assert _scalar(busy) >= 1
    for service in ("gateway", "target", "draft"):
        for gauge in ("dflash_requests_running", "dflash_requests_waiting"):
            assert _scalar(run.query(f'sum({gauge}{{service="{service}"}})')) == 0, \
                (service, gauge)
    assert _scalar(run.query('sum(dflash_sequences_active{service="target"})')) == 0


LOGFMT = re.compile(r'(\w+)=("(?:[^"\\]|\\.)*"|\S+)')


def log_events(path: Path, message: str) -> list[dict[str, str]]:
    out = []
    for line in path.read_text().splitlines():
        if f" {message} " in f"{line} " and "=" in line:
            out.append({k: json.loads(v) if v.startswith('"') else v
                        for k, v in LOGFMT.findall(line)})
    return out


def _tag(seq: str) -> str:
    from services.common.logs import seq_tag
    return seq if seq.startswith("h:") else seq_tag(seq)


@pytest.mark.slow
def test_logs_follow_a_request_through_all_three_services(run):
    finished = log_events(run.log_dir / "gateway.log", "request finished")
    assert len(finished) == len(run.usages)
    by_id = {e["request_id"]: e for e in finished}
    http_id = run.http_ids[0].removeprefix("chatcmpl-")          # the response id carries it
    for request_id in (http_id, run.grpc_request_id):
        event = by_id[request_id]
        seq = event["seq"]                   # INFO: the id's tag (DEBUG lines: the id itself)
        assert seq.startswith("h:") and event["finish_reason"] in ("stop", "length")
        target = {e["method"] for e in log_events(run.log_dir / "target.log", "rpc")
                  if _tag(e.get("seq", "")) == seq}
        draft = {e["method"] for e in log_events(run.log_dir / "draft.log", "rpc")
                 if _tag(e.get("seq", "")) == seq}
        assert {"Prefill", "Verify", "Release"} <= target, (seq, target)
        assert {"Propose", "Release"} <= draft, (seq, draft)
    # the gRPC request's own "rpc" line (DEBUG here) names its request id too
    generate = [e for e in log_events(run.log_dir / "gateway.log", "rpc")
                if e.get("method") == "Generate"]
    assert any(e.get("request_id") == run.grpc_request_id and e["code"] == "OK"
               for e in generate)
    assert any(e["code"] == "INVALID_ARGUMENT" for e in generate)


def test_log_lines_are_logfmt_and_unknown_levels_are_refused():
    import logging

    from services.common.logs import KeyValueFormatter, setup_logging
    record = logging.LogRecord("dflash.x", logging.INFO, "", 0, "request finished", None, None)
    record.__dict__.update({"request_id": "abc", "seq": "gw-1", "why": 'said "no" = bad'})
    line = KeyValueFormatter().format(record)
    fields = {k: json.loads(v) if v.startswith('"') else v for k, v in LOGFMT.findall(line)}
    # above DEBUG a sequence id (a capability on the services) is written as its tag
    assert fields == {"request_id": "abc", "seq": _tag("gw-1"), "why": 'said "no" = bad'}
    assert "gw-1" not in line and re.fullmatch(r"h:[0-9a-f]{12}", fields["seq"])
    record.levelno = logging.DEBUG
    assert " seq=gw-1 " in KeyValueFormatter().format(record) + " "
    with pytest.raises(SystemExit) as e:
        setup_logging("VERBOSE")
    assert e.value.code == 2
