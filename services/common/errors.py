"""Domain errors that map one-to-one onto gRPC status codes, and the handler decorator that
turns them (and anything unexpected) into a status with a message - never UNKNOWN. A call
multiplexed on a stream (`answer`) gets the same mapping, counting and logging."""
from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import time
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass
from typing import Any

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


class DataLoss(ServiceError):
    """Features a message points to cannot be read (a stale or foreign plane reference): the
    caller sends that context again in the message."""
    code = grpc.StatusCode.DATA_LOSS


class Internal(ServiceError):
    """A computation failed for one sequence (its maths went non-finite): that call fails, the
    batch it was in completes for everyone else."""
    code = grpc.StatusCode.INTERNAL


class DeadlineExceeded(ServiceError):
    code = grpc.StatusCode.DEADLINE_EXCEEDED


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


@dataclass
class Outcome:
    """How a call ended; `observed` counts and logs it under this code."""
    code: grpc.StatusCode = grpc.StatusCode.OK


@contextlib.contextmanager
def observed(method: str, seq: str) -> Iterator[Outcome]:
    """Times the block; at its end the call is counted (dflash_rpc_requests_total,
    dflash_rpc_duration_seconds) and logged (log_rpc) with the code the block set."""
    from services.common import metrics
    outcome, t0 = Outcome(), time.perf_counter()
    try:
        yield outcome
    finally:
        seconds = time.perf_counter() - t0
        metrics.observe_rpc(method, outcome.code.name, seconds)
        log_rpc(method, outcome.code, seconds, seq)


def failure_status(e: Exception, method: str, seq: str) -> tuple[grpc.StatusCode, str]:
    """The status a handler's exception answers: a ServiceError its own code and text; anything
    else is a bug: INTERNAL with its text, logged with its traceback (the service keeps serving)."""
    if isinstance(e, ServiceError):
        return e.code, str(e)
    log.error("internal error in %s", method, exc_info=e, extra={"seq": seq[:128]})
    return grpc.StatusCode.INTERNAL, f"internal error: {type(e).__name__}: {e}"


def rpc(method: Callable) -> Callable:
    """Wrap an async unary servicer method: ServiceError -> its status; other errors -> INTERNAL.
    Every call is counted (dflash_rpc_requests_total) and logged (log_rpc)."""

    @functools.wraps(method)
    async def wrapper(self, request, context: grpc.aio.ServicerContext):
        seq = getattr(request, "sequence_id", "")
        with observed(method.__name__, seq) as outcome:
            try:
                return await method(self, request, context)
            except grpc.aio.AbortError:
                outcome.code = context.code() or grpc.StatusCode.UNKNOWN
                raise
            except asyncio.CancelledError:
                outcome.code = grpc.StatusCode.CANCELLED
                raise
            except Exception as e:  # noqa: BLE001 - mapped (and a bug logged) by failure_status
                outcome.code, message = failure_status(e, method.__name__, seq)
                await context.abort(outcome.code, message)

    return wrapper


async def answer(method: str, request: Any, handle: Callable[[Any], Awaitable[Any]]
                 ) -> tuple[Any, grpc.StatusCode, str]:
    """One call multiplexed on a stream (services/common/call_stream.py), with the same status
    mapping, counting and logging as an `rpc` method: (response, OK, "") or (None, code, message).
    Cancellation propagates (the stream ended)."""
    seq = getattr(request, "sequence_id", "")
    with observed(method, seq) as outcome:
        try:
            return await handle(request), grpc.StatusCode.OK, ""
        except asyncio.CancelledError:
            outcome.code = grpc.StatusCode.CANCELLED
            raise
        except Exception as e:  # noqa: BLE001 - mapped (and a bug logged) by failure_status
            outcome.code, message = failure_status(e, method, seq)
            return None, outcome.code, message
