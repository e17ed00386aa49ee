"""A server interceptor in front of the dflash.v1 handlers of every service:

- a request whose bytes are not a valid protobuf of the method's type is answered
  INVALID_ARGUMENT naming the type (grpc's own answer would be INTERNAL);
- while the service drains (SIGTERM), calls that would start new work are answered UNAVAILABLE
  (which ones is the service's `refuse(method, request)`), the rest are served to the end;
- with an internal token (services/common/internal_auth.py), a call without it is answered
  UNAUTHENTICATED before anything else.

A call stream `<M>Stream` (services/common/call_stream.py) gets the same per call: each <M> call
on it that the drain refuses is handed on as call_stream.Refused (answered UNAVAILABLE, not run);
undecodable bytes end the stream INVALID_ARGUMENT (they carry no call_id to answer).

Health and reflection are left to grpc."""
from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterable, AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

import grpc

from services.common import internal_auth, metrics
from services.common.call_stream import Refused
from services.common.errors import Unavailable

log = logging.getLogger("dflash.guard")

PREFIX = "/dflash.v1."
STREAM_SUFFIX = "Stream"          # <M>Stream multiplexes <M> calls


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

    def refusal(self, name: str, request: Any) -> str | None:
        """Why this call is refused now (draining, and work `refuse` names), or None."""
        if not self.draining or not self.refuse(name, request):
            return None
        self.refused += 1
        return (f"{name} refused: this service is shutting down (draining the work it has); use "
                f"another replica or retry when it is back")


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
    def __init__(self, drain: Drain | None = None, token: str = "") -> None:
        self.drain = drain
        self.token = token                     # the internal token calls must carry ("" = none)

    async def intercept_service(self, continuation, details: grpc.HandlerCallDetails):
        handler = await continuation(details)
        method = details.method or ""
        if handler is None or not method.startswith(PREFIX):
            return handler
        name = method.rsplit("/", 1)[-1]
        if handler.unary_unary is not None:
            fields = {"unary_unary": self._unary(handler.unary_unary, name)}
        elif handler.unary_stream is not None:
            fields = {"unary_stream": self._stream(handler.unary_stream, name)}
        elif handler.stream_stream is not None and name.endswith(STREAM_SUFFIX):
            fields = {"stream_stream": self._call_stream(handler.stream_stream, name)}
        else:
            return handler
        fields["request_deserializer"] = _safe_deserializer(handler.request_deserializer,
                                                            _request_type(handler, name))
        return handler._replace(**fields)

    async def _authorized(self, context: grpc.aio.ServicerContext, name: str) -> None:
        if not internal_auth.allowed(self.token, context.invocation_metadata()):
            metrics.observe_rpc(name, "UNAUTHENTICATED", 0.0)
            await context.abort(grpc.StatusCode.UNAUTHENTICATED,
                                f"{name} needs this service's internal token (metadata "
                                f"{internal_auth.HEADER}); only the gateway and the draft "
                                f"call these ports")

    async def _check(self, request: Any, context: grpc.aio.ServicerContext, name: str) -> None:
        await self._authorized(context, name)
        await _decodable(request, context, name)
        why = self._refusal(name, request)
        if why is not None:
            metrics.observe_rpc(name, "UNAVAILABLE", 0.0)
            await context.abort(grpc.StatusCode.UNAVAILABLE, why)

    def _refusal(self, name: str, request: Any) -> str | None:
        return self.drain.refusal(name, request) if self.drain is not None else None

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

    def _call_stream(self, behavior, name: str):
        call = name.removesuffix(STREAM_SUFFIX)

        async def guarded(requests, context):
            await self._authorized(context, name)
            await behavior(self._admitted(requests, context, name, call), context)
        return guarded

    async def _admitted(self, requests: AsyncIterable, context: grpc.aio.ServicerContext,
                        name: str, call: str) -> AsyncIterator:
        """The stream's messages, each refused call replaced by a Refused."""
        async for message in requests:
            await _decodable(message, context, name)
            why = None if message.cancel else self._refusal(call, message.request)
            yield message if why is None else Refused(message, Unavailable(why))


async def _decodable(request: Any, context: grpc.aio.ServicerContext, name: str) -> None:
    """Aborts INVALID_ARGUMENT (naming the type) when the bytes did not parse."""
    if isinstance(request, Undecodable):
        metrics.observe_rpc(name, "INVALID_ARGUMENT", 0.0)
        await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                            f"the request is not a valid {request.type_name} protobuf message "
                            f"({request.error})")


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
