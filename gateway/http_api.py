"""The OpenAI-compatible HTTP API (FastAPI), served by uvicorn on the gateway's event loop.

POST /v1/completions, POST /v1/chat/completions (stream: SSE ending in `data: [DONE]`),
GET /v1/models, /health (live), /readiness (503 until ready, with the reason), /metrics."""
from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import replace
from typing import Any

import grpc
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.exceptions import HTTPException as StarletteHTTPException

from gateway.auth import OPEN_HTTP, ApiKeyMiddleware, ApiKeys
from gateway.body_limit import BodyLimitMiddleware
from gateway.errors import ClientError, ModelNotFound, classify
from gateway.generation import Event, Usage
from gateway.logprobs import LogprobShape, TokenText
from gateway.openai_schema import ChatCompletionRequest, CompletionRequest
from gateway.request import GenerationRequest
from gateway.service import GatewayService
from gateway.telemetry import HttpMetrics
from gateway.upstream import UpstreamError
from services.common.errors import ServiceError

log = logging.getLogger("dflash.gateway.http")


def build_app(service: GatewayService) -> FastAPI:
    """Requests pass the metrics middleware, the API-key check (gateway/auth.py, 401), the body
    limit (413), then FastAPI."""
    cfg = service.state.config
    app = FastAPI(title="dflash gateway", docs_url=None, redoc_url=None, openapi_url=None)
    _install_error_handlers(app)
    app.add_middleware(BodyLimitMiddleware, max_bytes=cfg.max_request_bytes)
    open_paths = OPEN_HTTP if cfg.metrics_auth else (*OPEN_HTTP, "/metrics")
    app.add_middleware(ApiKeyMiddleware, keys=ApiKeys(cfg.api_keys), open_paths=open_paths)
    app.add_middleware(HttpMetrics)          # outermost: counts the 401s and 413s too
    api = OpenAIApi(service)

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request) -> Response:
        return await api.complete(body, request, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
        return await api.complete(body, request, chat=True)

    @app.get("/v1/models")
    async def models() -> dict:
        return {"object": "list", "data": [api.model_card()]}

    @app.get("/v1/models/{model:path}")
    async def model(model: str) -> dict:
        api.check_model(model)
        return api.model_card()

    @app.get("/health")
    async def health() -> dict:
        return {"status": "ok"}

    @app.get("/readiness")
    async def readiness() -> JSONResponse:
        state = service.state
        return JSONResponse({"ready": state.ready, "reason": state.reason},
                            status_code=200 if state.ready else 503)

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(generate_latest(), media_type=CONTENT_TYPE_LATEST)

    return app


def _error(err: ClientError) -> JSONResponse:
    headers = {"Retry-After": err.retry_after} if err.retry_after else None
    return JSONResponse(err.openai_body(), status_code=err.http_status, headers=headers)


def _install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        return _error(_validation_error(exc))

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        body = {"error": {"message": str(exc.detail), "type": "invalid_request_error",
                          "param": None, "code": None}}
        return JSONResponse(body, status_code=exc.status_code)

    @app.exception_handler(ServiceError)
    @app.exception_handler(UpstreamError)
    async def known(request: Request, exc: Exception) -> JSONResponse:
        return _error(classify(exc))

    @app.exception_handler(Exception)
    async def bug(request: Request, exc: Exception) -> JSONResponse:
        return _error(classify(exc))           # a 500 with the text; also logged


def _validation_error(exc: RequestValidationError) -> ClientError:
    """pydantic's 422 as OpenAI's 400: malformed JSON, wrong types, unknown fields."""
    first = exc.errors()[0] if exc.errors() else {}
    loc = [str(x) for x in first.get("loc", ()) if x != "body"]
    param = ".".join(loc) or None
    kind = first.get("type", "")
    if kind == "json_invalid":
        msg = f"the request body is not valid JSON: {first.get('ctx', {}).get('error', '')}"
    elif kind == "extra_forbidden":
        msg = f"unrecognized request argument: {param}"
    elif kind == "missing":
        msg = f"missing required parameter: {param}"
    else:
        msg = f"invalid value for {param or 'the body'}: {first.get('msg', 'invalid')}"
    return ClientError(grpc.StatusCode.INVALID_ARGUMENT, msg, param)


class OpenAIApi:
    def __init__(self, service: GatewayService) -> None:
        self.service = service
        self.token_text = TokenText(service.state.tokenizer)

    @property
    def served_names(self) -> set[str]:
        state = self.service.state
        caps = state.target_caps
        return {state.model_name} | ({caps.model_id} if caps is not None else set())

    def check_model(self, model: str) -> None:
        self.service.require_ready()
        if model not in self.served_names:
            raise ModelNotFound(f"the model `{model}` does not exist; this server serves "
                                f"`{self.service.state.model_name}`")

    def model_card(self) -> dict[str, Any]:
        self.service.require_ready()
        caps = self.service.state.target_caps
        return {"id": self.service.state.model_name, "object": "model", "created": 0,
                "owned_by": "dflash", "max_model_len": caps.max_context}

    async def complete(self, body: CompletionRequest | ChatCompletionRequest, request: Request,
                       chat: bool) -> Response:
        arrival = time.perf_counter()
        built: list[GenerationRequest] = []
        events = await self.service.open(lambda: self._request(body, built), arrival)
        logprobs = LogprobShape(self.token_text, chat) if built[0].logprobs else None
        shape = ChunkShape(chat, body.model, body.include_usage, built[0].request_id, logprobs)
        if body.stream:
            return await self._stream(events, shape)
        return await _until_disconnected(request, self._collect(events, shape))

    def _request(self, body: CompletionRequest | ChatCompletionRequest,
                 built: list[GenerationRequest]) -> GenerationRequest:
        """check_model, then the request with its id (kept in `built` for the response id)."""
        self.check_model(body.model)
        processed = self.service.state.config.logprobs_mode == "processed"
        req = replace(body.to_request(body.prompt_ids(self.service.prompts)),
                      request_id=uuid.uuid4().hex, processed_logprobs=processed)
        built.append(req)
        return req

    async def _collect(self, events: AsyncIterator[Event], shape: ChunkShape) -> JSONResponse:
        text, ids, lps, last = [], [], [], None
        async with contextlib.aclosing(events):
            async for event in events:
                text.append(event.text)
                ids.extend(event.token_ids)
                lps.extend(event.logprobs)
                last = event
        return JSONResponse(shape.whole("".join(text), last.finish_reason, last.usage,
                                        shape.logprobs_of(ids, lps)))

    async def _stream(self, events: AsyncIterator[Event], shape: ChunkShape) -> Response:
        """The first event is awaited before answering, so that a failed prefill still gets a
        proper status code instead of a 200 with an error inside the stream."""
        first = await anext(events)
        return StreamingResponse(_sse(first, events, shape), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache"})


async def _sse(first: Event, events: AsyncIterator[Event], shape: ChunkShape) -> AsyncIterator[str]:
    """SSE lines; a client that disconnects cancels this generator, which releases the sequences."""
    async with contextlib.aclosing(events):
        try:
            if shape.chat:
                yield _data(shape.chunk({"role": "assistant", "content": ""}, None))
            event: Event | None = first
            while event is not None:
                logprobs = shape.logprobs_of(event.token_ids, event.logprobs)
                if event.text or event.finish_reason or logprobs and event.token_ids:
                    yield _data(shape.delta(event.text, event.finish_reason, logprobs))
                if event.usage is not None and shape.include_usage:
                    yield _data(shape.usage_chunk(event.usage))
                event = await anext(events, None)
        except Exception as e:  # noqa: BLE001 - mid-stream: an error object, then the end marker
            yield _data(classify(e).openai_body())
        yield "data: [DONE]\n\n"


def _data(obj: dict) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False, separators=(',', ':'))}\n\n"


async def _until_disconnected(request: Request, work) -> Response:
    """Runs work (a non-streaming answer); a client that goes away cancels it."""
    task = asyncio.ensure_future(work)
    gone = asyncio.ensure_future(_wait_disconnect(request))
    try:
        await asyncio.wait({task, gone}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        gone.cancel()
        if not task.done():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
    if task.cancelled():
        return Response(status_code=499)       # nobody is listening any more
    return task.result()


async def _wait_disconnect(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


class ChunkShape:
    """OpenAI's response objects for /v1/completions (text_completion) and chat."""

    def __init__(self, chat: bool, model: str, include_usage: bool, request_id: str = "",
                 logprobs: LogprobShape | None = None) -> None:
        self.chat, self.model, self.include_usage = chat, model, include_usage
        self.logprobs = logprobs             # None: the request asked for none
        # the request id of the gateway's logs (request_id=...), so an answer can be traced
        self.id = ("chatcmpl-" if chat else "cmpl-") + (request_id or uuid.uuid4().hex)
        self.created = int(time.time())

    def _envelope(self, obj: str, choices: list, **extra: Any) -> dict:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model,
                "choices": choices, **extra}

    def logprobs_of(self, ids: list[int], lps: list) -> dict | None:
        """The logprobs object of these tokens (None when the request asked for none)."""
        return self.logprobs.of(ids, lps) if self.logprobs is not None else None

    def chunk(self, delta: dict, finish_reason: str | None, logprobs: dict | None = None) -> dict:
        usage = {"usage": None} if self.include_usage else {}
        if self.chat:
            choice = {"index": 0, "delta": delta, "logprobs": logprobs,
                      "finish_reason": finish_reason}
            return self._envelope("chat.completion.chunk", [choice], **usage)
        choice = {"index": 0, "text": delta.get("content", ""), "logprobs": logprobs,
                  "finish_reason": finish_reason}
        return self._envelope("text_completion", [choice], **usage)

    def delta(self, text: str, finish_reason: str | None, logprobs: dict | None = None) -> dict:
        return self.chunk({"content": text} if text or not self.chat else {}, finish_reason,
                          logprobs)

    def usage_chunk(self, usage: Usage) -> dict:
        obj = "chat.completion.chunk" if self.chat else "text_completion"
        return self._envelope(obj, [], usage=usage_dict(usage))

    def whole(self, text: str, finish_reason: str | None, usage: Usage | None,
              logprobs: dict | None = None) -> dict:
        if self.chat:
            choice = {"index": 0, "message": {"role": "assistant", "content": text},
                      "logprobs": logprobs, "finish_reason": finish_reason}
            obj = "chat.completion"
        else:
            choice = {"index": 0, "text": text, "logprobs": logprobs,
                      "finish_reason": finish_reason}
            obj = "text_completion"
        return self._envelope(obj, [choice], usage=usage_dict(usage) if usage else None)


def usage_dict(u: Usage) -> dict[str, Any]:
    return {"prompt_tokens": u.prompt_tokens, "completion_tokens": u.completion_tokens,
            "total_tokens": u.prompt_tokens + u.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": u.cached_tokens},
            "spec_decode": {"verify_steps": u.verify_steps, "draft_steps": u.draft_steps,
                            "draft_tokens": u.draft_tokens, "accepted_tokens": u.accepted_tokens,
                            "mean_acceptance_length": round(u.mean_acceptance_length, 4)}}

