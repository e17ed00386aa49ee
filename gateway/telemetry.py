"""Prometheus metrics of one request (names: services/common/metrics.py, docs/architecture.md §9).

Per step, "draft" and "verify" are the Propose and Verify round trips as the gateway sees them;
"gateway" is the rest of the step's wall time (output processing, detokenization, handing the
event to the client, event-loop waiting), measured from the end of the previous step - so the
three add up to the time between consecutive steps. ITL is per token: a step that delivers n
tokens after t seconds counts n observations of t/n (as SGLang counts under speculation).
HttpMetrics counts the HTTP API's requests by route template and status."""
from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Any

from services.common import metrics

if TYPE_CHECKING:
    from gateway.generation import Usage

log = logging.getLogger("dflash.gateway.loop")


class RequestTelemetry:
    """No-op while model is "" (the gateway has not seen the target yet)."""

    def __init__(self, model: str, arrival: float) -> None:
        self.model = model
        self.arrival = arrival
        self.last_emit: float | None = None
        self.step_mark = time.perf_counter()          # end of the previous step (or prefill)

    def prefill_done(self, feature_bytes: int | None) -> None:
        self.step_mark = time.perf_counter()
        if self.model and feature_bytes is not None:
            metrics.FEATURE_BYTES.labels(self.model).observe(feature_bytes)

    def emitted(self, n: int) -> None:
        now = time.perf_counter()
        if self.model and n:
            if self.last_emit is None:
                metrics.TTFT.labels(self.model).observe(now - self.arrival)
            else:
                itl = metrics.ITL.labels(self.model)
                for _ in range(n):
                    itl.observe((now - self.last_emit) / n)
        if n:
            self.last_emit = now

    def step(self, draft_s: float | None, verify_s: float, drafts: int, accepted: int) -> None:
        now = time.perf_counter()
        wall, self.step_mark = now - self.step_mark, now
        if not self.model:
            return
        metrics.STEP.labels(self.model, "verify").observe(verify_s)
        if draft_s is not None:
            metrics.STEP.labels(self.model, "draft").observe(draft_s)
        rest = wall - verify_s - (draft_s or 0.0)
        metrics.STEP.labels(self.model, "gateway").observe(max(0.0, rest))
        metrics.record_acceptance(self.model, drafts, accepted)

    def finished(self, reason: str, usage: Usage, ids: dict, **recovery: int) -> None:
        """The request's end: one log line with its numbers (ids: request_id and seq; recovery:
        rebuilds, preemptions), and its metrics."""
        seconds = time.perf_counter() - self.arrival
        log.info("request finished", extra={
            **ids, "finish_reason": reason, "prompt_tokens": usage.prompt_tokens,
            "completion_tokens": usage.completion_tokens, "verify_steps": usage.verify_steps,
            "draft_steps": usage.draft_steps, "accepted_tokens": usage.accepted_tokens,
            "acceptance_length": round(usage.mean_acceptance_length, 4), **recovery,
            "seconds": round(seconds, 3)})
        if not self.model:
            return
        m = self.model
        metrics.E2E.labels(m).observe(seconds)
        metrics.REQUEST_SUCCESS.labels(m, reason).inc()
        metrics.PROMPT_TOKENS.labels(m).inc(usage.prompt_tokens)
        metrics.GENERATION_TOKENS.labels(m).inc(usage.completion_tokens)


class HttpMetrics:
    """ASGI middleware: dflash_http_requests_total{path, status} per HTTP request. `path` is the
    matched route's template (e.g. /v1/models/{model:path}) or "other", so it stays bounded.
    The status is the one the response started with (an error inside an SSE stream that has
    already started counts as its 200)."""

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        status = 500                     # an exception that escapes becomes a 500 outside

        async def send_status(message: dict) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_status)
        finally:
            path = getattr(scope.get("route"), "path", "other")
            metrics.HTTP_REQUESTS.labels(metrics.labels().model_name, path, str(status)).inc()
