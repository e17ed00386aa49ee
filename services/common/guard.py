"""A server interceptor in front of the dflash.v1 handlers of every service:

- a request whose bytes are not a valid protobuf of the method's type is answered
  INVALID_ARGUMENT naming the type (grpc's own answer would be INTERNAL);
- while the service drains (SIGTERM), calls that would start new work are answered UNAVAILABLE
  (which ones is the service's `refuse(method, request)`), the rest are served to the end.

Health and reflection are left to grpc."""
from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import grpc

from services.common import metrics

log = logging.getLogger("dflash.guard")

PREFIX = "/dflash.v1."


@dataclass(frozen=True)
class Undecodable:
    """Stands in for a request that could not be parsed; the handler is never called with it."""
    type_name: str
    error: str


@dataclass
class Drain:
    """SIGTERM: NOT_SERVING, refuse new work, let the rest finish until idle() or grace_s."""
    grace_s: float
    idle: Callable[[], bool] = lambda: True
    refuse: Callable[[str, Any], bool] = lambda method, request: False
    draining: bool = False
    refused: int = 0                 # calls refused while draining (logged at exit)


def _safe_deserializer(deserialize: Callable[[bytes], Any] | None, type_name: str):
    if deserialize is None:
        return None

    def parse(data: bytes) -> Any:
        try:
            return deserialize(data)
        except Exception as e:  # noqa: BLE001 - any parse failure is the client's bad input
            return Undecodable(type_name, f"{type(e).__name__}: {e}"[:200])
    return parse


class GuardInterceptor(grpc.aio.ServerInterceptor):
    def __init__(self, drain: Drain | None = None) -> None:
        self.drain = drain

    async def intercept_service(self, continuation, details: grpc.HandlerCallDetails):
        handler = await continuation(details)
        method = details.method or ""
        if handler is None or not method.startswith(PREFIX) or handler.request_streaming:
            return handler
        name = method.rsplit("/", 1)[-1]
        type_name = _request_type(handler, name)
        fields = {"request_deserializer": _safe_deserializer(handler.request_deserializer,
                                                             type_name)}
        if handler.unary_unary is not None:
            fields["unary_unary"] = self._unary(handler.unary_unary, name)
        elif handler.unary_stream is not None:
            fields["unary_stream"] = self._stream(handler.unary_stream, name)
        return handler._replace(**fields)

    async def _check(self, request: Any, context: grpc.aio.ServicerContext, name: str) -> None:
        if isinstance(request, Undecodable):
            metrics.observe_rpc(name, "INVALID_ARGUMENT", 0.0)
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                f"the request is not a valid {request.type_name} protobuf message "
                                f"({request.error})")
        d = self.drain
        if d is not None and d.draining and d.refuse(name, request):
            d.refused += 1
            metrics.observe_rpc(name, "UNAVAILABLE", 0.0)
            await context.abort(grpc.StatusCode.UNAVAILABLE,
                                f"{name} refused: this service is shutting down (draining the "
                                f"work it has); use another replica or retry when it is back")

    def _unary(self, behavior, name: str):
        async def guarded(request, context):
            await self._check(request, context, name)
            return await behavior(request, context)
        return guarded

    def _stream(self, behavior, name: str):
        async def guarded(request, context):
            await self._check(request, context, name)
            async for item in behavior(request, context):
                yield item
        return guarded


def _request_type(handler, method: str) -> str:
    """The request message's full name when the deserializer is a generated FromString."""
    fn = handler.request_deserializer
    owner = getattr(fn, "__self__", None)
    descriptor = getattr(owner, "DESCRIPTOR", None)
    return descriptor.full_name if descriptor is not None else f"{method} request"


async def wait_idle(drain: Drain, poll_s: float = 0.1) -> bool:
    """Until drain.idle() or its grace period passes; True when idle."""
    deadline = time.monotonic() + drain.grace_s
    while not drain.idle():
        if time.monotonic() >= deadline:
            return False
        await asyncio.sleep(poll_s)
    return True
