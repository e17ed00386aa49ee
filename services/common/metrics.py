"""Prometheus metrics of all three services (names and meanings: docs/architecture.md §9).

One process = one service. `init(model_name, service)` is called once at start-up; code then
uses `get()`. Every series carries `model_name`; no label takes unbounded values (no ids).
Spec-decode counters follow vLLM's set, so mean acceptance length is
1 + rate(dflash_spec_accepted_tokens_total) / rate(dflash_spec_drafts_total)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from prometheus_client import Counter, Gauge, Histogram
from prometheus_client.metrics import MetricWrapperBase

# Latency buckets wide enough for a 2-core CPU (seconds per step) and an H200 (ms per step).
LATENCY_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.0075, 0.01, 0.015, 0.025, 0.04, 0.06, 0.08,
                   0.1, 0.15, 0.25, 0.4, 0.6, 1.0, 1.5, 2.5, 4.0, 6.0, 10.0, 20.0, 40.0, 80.0,
                   160.0, 320.0)
BYTES_BUCKETS = tuple(float(4 ** i * 1024) for i in range(12))      # 1 KiB .. 4 GiB
MAX_POSITIONS = 32                                                   # per-position label bound

L = ["model_name"]

SPEC_DRAFTS = Counter("dflash_spec_drafts", "Verify steps that carried at least one draft token", L)
SPEC_DRAFT_TOKENS = Counter("dflash_spec_draft_tokens", "Draft tokens proposed and verified", L)
SPEC_ACCEPTED = Counter("dflash_spec_accepted_tokens", "Draft tokens accepted by the target", L)
SPEC_ACCEPTED_POS = Counter("dflash_spec_accepted_tokens_per_position",
                            "Drafts accepted at block position i (counted only if 0..i all were)",
                            L + ["position"])
TTFT = Histogram("dflash_time_to_first_token_seconds", "Request arrival to first token", L,
                 buckets=LATENCY_BUCKETS)
ITL = Histogram("dflash_inter_token_latency_seconds",
                "Time between tokens, per token (a step of n tokens counts n times)", L,
                buckets=LATENCY_BUCKETS)
E2E = Histogram("dflash_e2e_request_latency_seconds", "Request arrival to last token", L,
                buckets=LATENCY_BUCKETS)
STEP = Histogram("dflash_step_seconds", "Time per speculative step by stage "
                 "(draft, verify: RPC round trips; gateway: the rest of the step)",
                 L + ["stage"], buckets=LATENCY_BUCKETS)
FEATURE_BYTES = Histogram("dflash_prefill_feature_bytes", "Bytes of prompt features per prefill",
                          L, buckets=BYTES_BUCKETS)
PROMPT_TOKENS = Counter("dflash_prompt_tokens", "Prompt tokens of finished requests", L)
GENERATION_TOKENS = Counter("dflash_generation_tokens", "Generated tokens", L)
REQUEST_SUCCESS = Counter("dflash_request_success", "Finished requests by finish reason",
                          L + ["finished_reason"])
RUNNING = Gauge("dflash_requests_running", "Requests being generated (gateway); work items in "
                "the engine's current batch (target, draft)", L + ["service"])
WAITING = Gauge("dflash_requests_waiting", "Requests waiting for a slot (gateway); work items "
                "queued for the engine (target, draft)", L + ["service"])
KV_USAGE = Gauge("dflash_kv_cache_usage_ratio", "Fraction of KV pages in use", L + ["service"])
STATE_USAGE = Gauge("dflash_state_pool_usage_ratio", "Fraction of recurrent state slots in use",
                    L + ["service"])
FEATURE_PLANE_USAGE = Gauge("dflash_feature_plane_usage_ratio", "Fraction of the fullest feature "
                            "plane held by features a draft has not taken yet", L + ["service"])
SEQUENCES = Gauge("dflash_sequences_active", "Sequences holding cache in this service",
                  L + ["service"])
REPLICAS = Gauge("dflash_gateway_replicas", "Gateway: upstream replicas by role and state (usable "
                 "| kept_out: serving but refused or unlike the others | down)",
                 L + ["role", "state"])
READY = Gauge("dflash_ready", "1 when the service reports SERVING", L + ["service"])
RPC_TOTAL = Counter("dflash_rpc_requests", "RPCs handled by method and status code",
                    L + ["service", "method", "code"])
RPC_SECONDS = Histogram("dflash_rpc_duration_seconds", "RPC handling time", L + ["service", "method"],
                        buckets=LATENCY_BUCKETS)
UPSTREAM_ERRORS = Counter("dflash_upstream_errors", "Errors of gateway calls to upstreams",
                          L + ["upstream", "code"])
FORWARD_SECONDS = Histogram("dflash_forward_seconds", "Engine forward time per iteration",
                            L + ["service"], buckets=LATENCY_BUCKETS)
FORWARD_TOKENS = Counter("dflash_forward_tokens", "Tokens put through the model", L + ["service"])
VERIFY_COST = Gauge("dflash_verify_cost_seconds", "Target: forward time of a verify batch of "
                    "this many tokens, measured at warm-up (the gateway's cost model)",
                    L + ["service", "tokens"])
SPEC_CHOSEN = Histogram("dflash_spec_verify_tokens_chosen", "Gateway: verify size chosen per step "
                        "(anchor + drafts; 1 = no drafting) by shape (chain or tree)",
                        L + ["shape"], buckets=(1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64))
SPEC_COST = Gauge("dflash_spec_cost_seconds", "Gateway's cost model now: verify of 1 token "
                  "(verify_1), each further token (verify_per_token), a Propose's draft forward "
                  "of no rows (propose) and per row (propose_per_row), the rest of its round "
                  "trip (propose_overhead), the rest of a step (overhead)", L + ["component"])
PREFIX_QUERIES = Counter("dflash_prefix_cache_queries", "Prompt tokens looked up in the prefix "
                         "cache (vLLM's convention: tokens)", L + ["service"])
PREFIX_HITS = Counter("dflash_prefix_cache_hits", "Prompt tokens whose KV came from the prefix "
                      "cache", L + ["service"])
PREFIX_CACHED_PAGES = Gauge("dflash_prefix_cache_pages", "KV pages the prefix cache holds "
                            "(referenced or not)", L + ["service"])
DRAFT_AHEAD = Counter("dflash_draft_ahead_blocks", "Draft: blocks drafted ahead from the target's "
                      "commit notices, by what became of them (used: a Propose took its drafts; "
                      "reshaped: its context, drafted again at another size; undone: the Propose "
                      "did not continue it; unused: the sequence went first; skipped: not drafted, "
                      "a Propose was waiting)", L + ["outcome"])
HTTP_REQUESTS = Counter("dflash_http_requests", "Gateway HTTP API requests by route and status",
                        L + ["path", "status"])

STAGES = ("draft", "verify", "gateway")                              # dflash_step_seconds{stage}
SHAPES = ("chain", "tree")                                           # ..._verify_tokens_chosen{shape}
COST_COMPONENTS = ("verify_1", "verify_per_token", "propose", "propose_per_row",
                   "propose_overhead", "overhead")   # dflash_spec_cost_seconds
FINISH_REASONS = ("stop", "length", "abort", "error")                # ..._success{finished_reason}
UPSTREAMS = ("target", "draft")
UPSTREAM_CODES = ("UNAVAILABLE", "DEADLINE_EXCEEDED")                # the usual ones, at 0 from start


@dataclass(frozen=True)
class Exports:
    """Series a service creates at start-up (at 0), so that rate()/increase() also count their
    first increments and dashboards show zeros rather than gaps."""
    by_model: tuple[MetricWrapperBase, ...] = ()          # labels (model_name,)
    by_service: tuple[MetricWrapperBase, ...] = ()        # labels (model_name, service)
    # (metric, label values after model_name, one tuple per series)
    by_values: tuple[tuple[MetricWrapperBase, tuple[tuple[str, ...], ...]], ...] = ()


_ENGINE = Exports(by_service=(RUNNING, WAITING, KV_USAGE, SEQUENCES, FORWARD_SECONDS,
                              FORWARD_TOKENS, PREFIX_QUERIES, PREFIX_HITS, PREFIX_CACHED_PAGES))
EXPORTS: dict[str, Exports] = {
    "gateway": Exports(
        by_model=(SPEC_DRAFTS, SPEC_DRAFT_TOKENS, SPEC_ACCEPTED, TTFT, ITL, E2E, FEATURE_BYTES,
                  PROMPT_TOKENS, GENERATION_TOKENS),
        by_service=(RUNNING, WAITING),
        by_values=((STEP, tuple((stage,) for stage in STAGES)),
                   (SPEC_CHOSEN, tuple((shape,) for shape in SHAPES)),
                   (REQUEST_SUCCESS, tuple((reason,) for reason in FINISH_REASONS)),
                   (UPSTREAM_ERRORS, tuple((up, code) for up in UPSTREAMS
                                           for code in UPSTREAM_CODES)))),
    "target": Exports(by_service=(*_ENGINE.by_service, FEATURE_PLANE_USAGE)),
    "draft": _ENGINE,
}


@dataclass(frozen=True)
class Labels:
    model_name: str
    service: str


_labels: Labels | None = None


def init(model_name: str, service: str) -> Labels:
    """Once per process. Readiness starts at 0; the service's series of EXPORTS exist from now."""
    global _labels
    assert _labels is None or _labels == Labels(model_name, service), "metrics.init called twice"
    _labels = Labels(model_name, service)
    READY.labels(model_name, service).set(0)
    exports = EXPORTS.get(service, Exports())
    for metric in exports.by_model:
        metric.labels(model_name)
    for metric in exports.by_service:
        metric.labels(model_name, service)
    for metric, series in exports.by_values:
        for values in series:
            metric.labels(model_name, *values)
    return _labels


def labels() -> Labels:
    return _labels or Labels("unknown", "unknown")


def set_ready(ready: bool) -> None:
    lb = labels()
    READY.labels(lb.model_name, lb.service).set(1 if ready else 0)


def observe_rpc(method: str, code: str, seconds: float) -> None:
    lb = labels()
    RPC_TOTAL.labels(lb.model_name, lb.service, method, code).inc()
    RPC_SECONDS.labels(lb.model_name, lb.service, method).observe(seconds)


class Queue(Protocol):
    """What an engine loop tells about its work (services/common/engine_loop.py)."""
    @property
    def running(self) -> int: ...
    @property
    def waiting(self) -> int: ...


def watch_queue(queue: Queue) -> None:
    """dflash_requests_running / _waiting of this service read `queue` at scrape time."""
    lb = labels()
    RUNNING.labels(lb.model_name, lb.service).set_function(lambda: queue.running)
    WAITING.labels(lb.model_name, lb.service).set_function(lambda: queue.waiting)


def record_prefix_lookup(queried: int, hit: int) -> None:
    """A prompt of `queried` tokens found `hit` of them in this service's prefix cache."""
    lb = labels()
    PREFIX_QUERIES.labels(lb.model_name, lb.service).inc(queried)
    PREFIX_HITS.labels(lb.model_name, lb.service).inc(hit)


def record_ahead(outcome: str) -> None:
    """What became of a block drafted ahead (DRAFT_AHEAD's outcomes)."""
    DRAFT_AHEAD.labels(labels().model_name, outcome).inc()


def record_acceptance(model_name: str, drafts: int, accepted: int) -> None:
    """One verify step with `drafts` draft tokens of which the first `accepted` were accepted.
    Positions 0..drafts-1 all get a series (0 until accepted there), so per-position rates
    exist for every position drafted."""
    if drafts <= 0:
        return
    SPEC_DRAFTS.labels(model_name).inc()
    SPEC_DRAFT_TOKENS.labels(model_name).inc(drafts)
    SPEC_ACCEPTED.labels(model_name).inc(accepted)
    for pos in range(min(drafts, MAX_POSITIONS)):
        counter = SPEC_ACCEPTED_POS.labels(model_name, str(pos))
        if pos < accepted:
            counter.inc()
