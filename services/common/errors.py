"""Domain errors that map one-to-one onto gRPC status codes, and the handler decorator that
turns them (and anything unexpected) into a status with a message - never UNKNOWN."""
from __future__ import annotations

import asyncio
import functools
import logging
import time
from collections.abc import Callable

import grpc

log = logging.getLogger("dflash.rpc")


class ServiceError(Exception):
    code: grpc.StatusCode = grpc.StatusCode.INTERNAL


class InvalidArgument(ServiceError):
    code = grpc.StatusCode.INVALID_ARGUMENT


class NotFound(ServiceError):
    code = grpc.StatusCode.NOT_FOUND


class ResourceExhausted(ServiceError):
    code = grpc.StatusCode.RESOURCE_EXHAUSTED


class Unavailable(ServiceError):
    code = grpc.StatusCode.UNAVAILABLE


class FailedPrecondition(ServiceError):
    code = grpc.StatusCode.FAILED_PRECONDITION


class NotReady(Unavailable):
    """Asked for something that exists only after start-up reached a later stage."""


# Outcomes logged at DEBUG (one line per RPC); the others at INFO (INTERNAL also with a traceback).
QUIET_CODES = frozenset({grpc.StatusCode.OK, grpc.StatusCode.CANCELLED})


def log_rpc(method: str, code: grpc.StatusCode, seconds: float, seq: str = "",
            request_id: str = "") -> None:
    """One line per RPC: method, status, time, and the request / sequence id where known."""
    level = logging.DEBUG if code in QUIET_CODES else logging.INFO
    if log.isEnabledFor(level):
        extra = {"method": method, "code": code.name, "ms": round(seconds * 1000, 2)}
        if request_id:
            extra["request_id"] = request_id[:128]
        if seq:
            extra["seq"] = seq[:128]
        log.log(level, "rpc", extra=extra)


def rpc(method: Callable) -> Callable:
    """Wrap an async unary servicer method: ServiceError -> its status; other errors -> INTERNAL.
    Every call is counted (dflash_rpc_requests_total) and logged (log_rpc)."""

    from services.common import metrics

    @functools.wraps(method)
    async def wrapper(self, request, context: grpc.aio.ServicerContext):
        t0 = time.perf_counter()
        code = grpc.StatusCode.OK
        seq = getattr(request, "sequence_id", "")
        try:
            return await method(self, request, context)
        except ServiceError as e:
            code = e.code
            await context.abort(e.code, str(e))
        except grpc.aio.AbortError:
            code = context.code() or grpc.StatusCode.UNKNOWN
            raise
        except asyncio.CancelledError:
            code = grpc.StatusCode.CANCELLED
            raise
        except Exception as e:  # a bug: report it as INTERNAL with its text, keep serving
            code = grpc.StatusCode.INTERNAL
            log.exception("internal error in %s", method.__name__, extra={"seq": seq[:128]})
            await context.abort(grpc.StatusCode.INTERNAL, f"internal error: {type(e).__name__}: {e}")
        finally:
            seconds = time.perf_counter() - t0
            metrics.observe_rpc(method.__name__, code.name, seconds)
            log_rpc(method.__name__, code, seconds, seq)

    return wrapper
